"""Runtime knobs of the LLM engine (never architecture): KV paging, batching budgets, prefix caching, and which
fast paths may run. The environment's switches are read here and nowhere else (`with_env_overrides`)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, replace

MiB = 1 << 20
FUSED_DECODE_KINDS = ("int8", "fp32", "bf16")  # the weight kinds `decode_stack` has a native step for


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
    cuda_graphs: on a CUDA device, replay decode steps as captured CUDA graphs (`decode_graphs`).
    fused_decode: the weight kinds (of FUSED_DECODE_KINDS) whose decode steps of a few rows may run as one native
        call (`decode_stack`, on CPU where it applies); a kind left out runs every step op by op.
    huge_pages: move the decoder's weights and the KV cache onto transparent huge pages (`kernels.huge_pages`).
    reserve_kv_cache: write the whole KV cache when the engine is built, so that its memory is resident from the
        start (on a CPU). Otherwise a page becomes resident when a block on it is first used, and since freed
        blocks keep their prefixes findable until the never-used ones run out, a long-running process's RSS grows
        into the budget request by request (as a leak would). Servers set it (`TTS.hold_kv_budget`); a one-off
        synthesis leaves it off and pays only for the blocks it uses.

    Environment overrides, applied by `with_env_overrides` when the engine is built (to measure what a fast path
    gives without changing code): VOCALIS_CUDA_GRAPHS=0, VOCALIS_INT8_FUSED=0, VOCALIS_FP32_FUSED=0,
    VOCALIS_BF16_FUSED=0 and VOCALIS_HUGE_PAGES=0 turn the matching path off.
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
    fused_decode: tuple[str, ...] = FUSED_DECODE_KINDS
    huge_pages: bool = True
    reserve_kv_cache: bool = False

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1")
        if self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        unknown = set(self.fused_decode) - set(FUSED_DECODE_KINDS)
        if unknown:
            raise ValueError(f"fused_decode kinds must be of {FUSED_DECODE_KINDS}, got {sorted(unknown)}")

    def with_env_overrides(self, environ: Mapping[str, str] | None = None) -> EngineConfig:
        """This config with the environment's switches (see the class doc) applied; `environ` stands in for
        `os.environ`. A switch only turns a path off: an unset variable leaves its field as it is."""
        env = os.environ if environ is None else environ

        def off(name: str) -> bool:
            return env.get(name, "1") == "0"

        return replace(self, cuda_graphs=self.cuda_graphs and not off("VOCALIS_CUDA_GRAPHS"),
                       huge_pages=self.huge_pages and not off("VOCALIS_HUGE_PAGES"),
                       fused_decode=tuple(k for k in self.fused_decode if not off(f"VOCALIS_{k.upper()}_FUSED")))
