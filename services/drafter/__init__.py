"""The drafter service: any registered drafter and its per-sequence state behind gRPC."""
