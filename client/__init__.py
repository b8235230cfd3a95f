"""Programs that talk to a running gateway over its HTTP API (no import of the server)."""
