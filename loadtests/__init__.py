"""Load generation against a running gateway (see README.md)."""
