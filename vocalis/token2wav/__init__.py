"""Streaming token2wav for many requests at once: per-request state, cached chunk-causal flow, batched HiFT."""
