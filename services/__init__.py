"""gRPC services of the split deployment: the verifier (target model, KV cache, acceptance
rules), the drafter (any registered drafter with per-sequence state), the shared wire codecs
and a launcher that runs them as local subprocesses."""
