"""The OpenAI-compatible HTTP front (vLLM's routes) on the same engine and state as gRPC."""
