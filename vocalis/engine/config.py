"""Runtime knobs of the LLM engine (never architecture): KV paging, batching budgets, prefix caching."""

from __future__ import annotations

from dataclasses import dataclass

MiB = 1 << 20


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """How the LLM engine uses memory and batches work.

    block_size: positions per KV block (the prefix-sharing granularity too).
    kv_cache_bytes: memory budget for the K and V tensors of every layer; the block count is derived from it.
    num_kv_blocks: explicit block count (tests, to force preemption); overrides the budget.
    max_num_seqs: most requests decoded together.
    max_num_batched_tokens: token budget of one step; longer prompts are prefilled in chunks of what is left.
    max_model_len: most positions per request (prompt + generated); max_len is clamped to fit.
    enable_prefix_caching: share the KV of identical full prompt blocks (a saved voice's [sos] + prompt text).
    pack_weights: on CPU, fuse the LLM's q/k/v and gate/up fp32 weights into one tensor each, in place (the
        modules keep views with the same values; see `packed_weights`).
    cuda_graphs: on a CUDA device, replay decode steps as captured CUDA graphs (`decode_graphs`); the
        environment can turn them off with VOCALIS_CUDA_GRAPHS=0 (to measure what they give).
    """

    block_size: int = 16
    kv_cache_bytes: int = 512 * MiB
    num_kv_blocks: int | None = None
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 512
    max_model_len: int = 4096
    enable_prefix_caching: bool = True
    pack_weights: bool = True
    cuda_graphs: bool = True

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1")
        if self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
