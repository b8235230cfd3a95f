"""HTTP gateway: OpenAI-compatible API in front of the drafter and verifier."""
