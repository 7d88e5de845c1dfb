"""Reduced-precision layers (bf16/fp16 casts, int8) and the module swaps that put them in a model."""
