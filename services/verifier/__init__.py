"""The verifier service: target model, target KV cache and acceptance rules behind gRPC."""
