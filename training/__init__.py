"""Drafter training: data preparation, models and the shared training loop."""
