"""The token2wav engine's runtime knobs (`Token2WavConfig`).

The final chunk. The reference runs its last call with full attention over the whole utterance. Here
`Token2WavConfig.final_attention` chooses:
- "causal" (default): the final chunk continues the block-causal computation (look-ahead zero-padded, like any
  finalize call): linear cost. It equals the reference's flow run with streaming masks on the whole utterance;
  against the reference's full-attention final chunk it differs by however much the model's two attention modes
  disagree on the last hop (the released model is trained on both; with random weights this is O(1) on the last
  chunk's mel, so tests compare it with the streaming-mask reference instead).
- "full": the final chunk recomputes the whole utterance with full attention, exactly like the reference
  (tolerance 1e-4 on audio, fp32); costs one extra non-streaming flow pass per request. It reads no cache, so once
  a request's input has ended the chunk before it keeps none and the caches held are dropped (`budget.CacheOwner`).
Non-streaming requests always take one full-attention pass, equal to the reference offline path.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch

FINAL_ATTENTION = ("causal", "full")
GRAPH_MODES = ("off", "eager", "compile", "cuda-graphs", "reduce-overhead")  # `Token2WavConfig.graphs`
CACHE_DTYPES = {None: None, "bf16": torch.bfloat16, "fp16": torch.float16}
GPU_STEP_BATCH, CPU_STEP_BATCH = 16, 2  # `Token2WavConfig.max_batch` when it is None
# ...except a CPU with a small flow estimator (fewer weights than SMALL_ESTIMATOR, int8-packed ones counted), whose
# steps are bound by per-call overheads rather than arithmetic, so wider steps finish more audio per second there;
# not much wider: wider steps vary the GEMMs' row counts more, and oneDNN keeps a compiled primitive per shape (up
# to 1024), so a server's idle RSS would keep growing for several rounds
SMALL_ESTIMATOR, CPU_SMALL_STEP_BATCH = 20_000_000, 4


@dataclass(frozen=True, slots=True)
class Token2WavConfig:
    """Runtime knobs of the token2wav engine.

    final_attention: "causal" (linear cost) or "full" (the reference's last call, exactly); see module doc.
    voice_cache_size: idle prompt prefixes kept (LRU; one in use by a live request is always kept and shared);
    0 disables prefix reuse altogether (every request computes its prompt). One costs ~4.6 MB per prompt mel
    frame at the 0.5B shapes in fp32 (half in bf16).
    max_batch: most requests in one step (the rest wait for the next step, oldest first as given). None:
    `GPU_STEP_BATCH` on a GPU; on a CPU `CPU_STEP_BATCH` per worker (`workers`), where wider steps finished less
    audio per second at the 0.5B shapes, or `CPU_SMALL_STEP_BATCH` per worker for an estimator under
    `SMALL_ESTIMATOR` weights (the tiny and built-in shapes; `dynamic_int8.weight_count`: an int8 estimator's
    packed weights count), where they finished more (docs/benchmarks.md, "Requests per token2wav step").
    cache_dtype: "bf16" (default) / "fp16" store the estimator's cached keys/values reduced: half the memory,
    mel max rel error 3.6e-5 at the 0.5B shapes (random weights); None keeps the compute dtype (exact).
    dit_cache_dtype: the same for CosyVoice 3's DiT caches, exact (None) by default: its streamed audio moved by
    up to 2e-4 with bf16 or fp16 storage on the test fixture, against 3e-5 exact (summation order).
    max_cache_mib: budget for all requests' flow caches. When a step would exceed it, the growing requests with
    the largest caches drop them and compute their later chunks from the voice prefix like the reference path
    (same output, reference cost). None: a quarter of the device's memory; 0: never cache.
    wait_for_cache: instead, a new stream waits for its first chunk until the budget has room for it and its next
    hop beside the started streams' caches and next hops (first come, first served), so starting a stream does not
    push the started ones into recomputing.
    Off by default: short utterances recompute little, so waiting costs them more than it saves; it pays with
    long utterances, whose recomputing is quadratic in their length (docs/benchmarks.md).
    One policy for every family (`token2wav.budget`).
    max_streams: most requests with token2wav work in flight at once (from their LLM's start to their last
    chunk); a request beyond it waits, before its LLM starts, for one to finish (first come, first served). None:
    no cap. Every stream in flight holds flow caches and widens every token2wav step, and the later chunks of
    wide steps cost more per stream than narrow ones, so past some width a server finishes more audio per second
    by letting requests queue than by starting them all (figures in docs/benchmarks.md).
    compute: "auto" runs the incremental estimator's GEMMs, convs and attention in the dtype its Linear weights
    were reduced to by a backend (bf16/fp16: `CastLinear`), with bf16/fp16 activations into them and fp32
    norms, residual stream and Euler state (`token2wav.cv2.compute.ComputeWeights`); at fp32 and int8 the modules run
    as they are, except that int8 attention's q/k/v run as one GEMM (`dynamic_int8.FusedQKV`, the same values).
    "modules" always calls the modules as they are (fp32 activations between the reduced-weight GEMMs).
    flow_steps: Euler steps of every flow solve (streaming chunks, voice prefixes, whole passes), a speed/quality
    setting: the flow's cost is proportional to it, and fewer steps land the mel further from the model's own
    count (mel error against 10 steps: docs/benchmarks.md). None: the model's `cfm.n_timesteps` (10 for CosyVoice 2).
    native_kernels: let the incremental estimator run its bf16 GEMMs (AMX) and its bf16 attention (AMX or
    AVX512-BF16) on our native kernels where the CPU has them; False keeps torch's (the runtime's
    `KernelConfig.bf16_gemm`, VOCALIS_BF16_GEMM=0, sets it).
    workers: threads that share a step's requests on a CPU, each running its part of them on one core
    (`kernels.threads.CoreWorkers`) instead of every op of the whole step split over the cores; a step with one
    request runs on the calling thread with all of them (a lone request's latency). None: torch's intra-op thread
    count when the engine is made, on a CPU; 1 (off) on a GPU, with the native bf16 estimator kernels (AMX CPUs,
    unmeasured) and where a backend runs HiFT (its own thread pool). Values are the same either way but for the int8
    GEMMs' per-call activation scale, which spans the requests of a call as batching does (docs/benchmarks.md, "A
    step's requests on per-core workers").
    vocoder_window: CosyVoice 3's causal HiFT decodes, per streaming call, only the new samples' frames and the
    frames that can reach them (`token2wav.cv3.vocoder`): linear in the stream's length, the same samples to float
    rounding. False re-runs it over all mel so far, as the official pipeline does (quadratic).
    graphs: "off" (default) or how CosyVoice 2's static-shape path runs (`token2wav.graphs.GRAPH_MODES`: "eager",
    "compile", "cuda-graphs", "reduce-overhead"): each chunk recomputes its request's whole prefix in (rows, tokens)
    buckets, the encoder and every Euler step as one function, HiFT's body in (rows, frames) buckets; no caches.
    graph_dtype: that path's encoder/estimator compute dtype: None (fp32), "bf16" or "fp16" (Euler state fp32);
    "fp16" runs CosyVoice 2's HiFT body in fp16 too (bf16 would cost its audio ~1e-2 relative RMS).
    Their defaults are VOCALIS_T2W_GRAPHS and VOCALIS_T2W_GRAPH_DTYPE where set (a GPU run's A/B), else "off", None.
    """

    final_attention: str = "causal"
    voice_cache_size: int = 4
    max_batch: int | None = None
    cache_dtype: str | None = "bf16"
    dit_cache_dtype: str | None = None
    max_cache_mib: int | None = None
    wait_for_cache: bool = False
    max_streams: int | None = None
    compute: str = "auto"
    flow_steps: int | None = None
    native_kernels: bool = True
    vocoder_window: bool = True
    workers: int | None = None
    graphs: str = field(default_factory=lambda: os.environ.get("VOCALIS_T2W_GRAPHS", "off"))
    graph_dtype: str | None = field(default_factory=lambda: os.environ.get("VOCALIS_T2W_GRAPH_DTYPE") or None)

    def __post_init__(self) -> None:
        if self.graphs not in GRAPH_MODES or self.graph_dtype not in CACHE_DTYPES:
            raise ValueError(f"graphs must be one of {GRAPH_MODES} and graph_dtype None, 'bf16' or 'fp16'")
        if self.final_attention not in FINAL_ATTENTION:
            raise ValueError(f"final_attention must be one of {FINAL_ATTENTION}, got {self.final_attention!r}")
        if self.voice_cache_size < 0 or (self.max_batch is not None and self.max_batch < 1):
            raise ValueError("voice_cache_size must be >= 0 and max_batch >= 1 (or None for the device's own)")
        for name in ("cache_dtype", "dit_cache_dtype"):
            if getattr(self, name) not in CACHE_DTYPES:
                raise ValueError(f"{name} must be None, 'bf16' or 'fp16', got {getattr(self, name)!r}")
        if self.max_streams is not None and self.max_streams < 1:
            raise ValueError(f"max_streams must be >= 1 (or None for no cap), got {self.max_streams}")
        if self.compute not in ("auto", "modules"):
            raise ValueError(f"compute must be 'auto' or 'modules', got {self.compute!r}")
        if self.max_cache_mib is not None and self.max_cache_mib < 0:
            raise ValueError("max_cache_mib must be >= 0 (or None for a quarter of the device memory)")
        if not _count_or_none(self.workers):
            raise ValueError(f"workers must be >= 1 (or None for the CPU's threads), got {self.workers!r}")
        if not _count_or_none(self.flow_steps):
            raise ValueError(f"flow_steps must be >= 1 (or None for the model's own count), got {self.flow_steps!r}")

    def step_batch(self, device: torch.device, estimator_weights: int | None = None, workers: int = 1) -> int:
        """`max_batch`, or the default for the device and the flow estimator's size (its weights, int8-packed ones
        included: `dynamic_int8.weight_count`; None: large); on a CPU that many per worker (`step_workers`)."""
        if self.max_batch is not None:
            return self.max_batch
        if device.type == "cuda":
            return GPU_STEP_BATCH
        return (CPU_SMALL_STEP_BATCH if _small(estimator_weights) else CPU_STEP_BATCH) * workers

    def step_workers(self, device: torch.device, threads: int, native: bool = False, own_vocoder: bool = False
                     ) -> int:
        """`workers`, or the default for the device: `threads` (torch's intra-op count) on a CPU unless the
        estimator runs the `native` bf16 kernels or a backend runs HiFT (`own_vocoder`); else 1."""
        if self.workers is not None:
            return self.workers
        return 1 if device.type != "cpu" or native or own_vocoder else max(1, threads)

    def cache_budget_bytes(self, device: torch.device) -> int:
        """`max_cache_mib` in bytes, or a quarter of the device's memory when it is None."""
        if self.max_cache_mib is not None:
            return self.max_cache_mib * 2**20
        if device.type == "cuda":
            return torch.cuda.get_device_properties(device).total_memory // 4
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 4


def _count_or_none(value: object) -> bool:
    """None or an int >= 1 (a bool is not a count)."""
    return value is None or (isinstance(value, int) and not isinstance(value, bool) and value >= 1)


def _small(estimator_weights: int | None) -> bool:
    """An estimator under `SMALL_ESTIMATOR` weights (None: large)."""
    return estimator_weights is not None and estimator_weights < SMALL_ESTIMATOR
