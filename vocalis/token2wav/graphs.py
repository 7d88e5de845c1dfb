"""Static (rows, frames) buckets for token2wav's hot functions, and how a bucket's function runs (`BucketGraphs`):
eagerly, compiled (`torch.compile(fullgraph=True, dynamic=False)`), or replayed as one CUDA graph per bucket.

Buckets. A streaming request's flow call covers its prompt and tokens so far plus 3 look-ahead tokens; the prompt
and the first hop end on a 25-token block and later hops are 25 -> 50 -> 100 tokens, so non-final calls end at
25 k + 3 tokens: `TOKEN_BUCKETS` holds every such size up to 203 tokens (the prompt prefix and the first hops), then
50- and 100-token steps (a later call pads at most one hop); a final call of any length pads to the next one.
Rows pad to `ROW_BUCKETS`. Padding is masked: every padded row and frame is computed and thrown away, and never
reaches a valid one (causal convs, masked attention keys; see each function's module).

Modes (`GRAPH_MODES`):
- "eager": the bucket's function as Python ops (CPUs; also what the CUDA modes are tested against);
- "compile": `torch.compile(fullgraph=True, dynamic=False)`, one compiled graph per bucket (inductor);
- "cuda-graphs": the function captured once per bucket into a `torch.cuda.CUDAGraph` on static input buffers
  (all graphs share one memory pool; a replay's output is copied out before the next replay), then replayed:
  one launch for the whole function, no Python or launch cost per kernel;
- "reduce-overhead": `torch.compile(mode="reduce-overhead")`: inductor's kernels inside CUDA graphs.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable

import torch

from vocalis.errors import InputError
from vocalis.token2wav.config import GRAPH_MODES

ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
TOKEN_BUCKETS = (*(25 * k + 3 for k in range(1, 9)), *(50 * k + 3 for k in range(5, 9)),
                 *(100 * k + 3 for k in range(5, 75)))
# HiFT's mel frames per call: a chunk's new frames plus the 8 it holds back, any length after a speed change
HIFT_FRAME_BUCKETS = (*(32 * k for k in range(1, 9)), *(128 * k for k in range(3, 118)))


def bucket(n: int, sizes: tuple[int, ...]) -> int:
    """The smallest size >= n; InputError past the largest (the callers split rows; the token buckets reach
    nearly the flow's fixed noise, 5 minutes of mel)."""
    for s in sizes:
        if s >= n:
            return s
    raise InputError(f"{n} exceeds the largest static-shape bucket ({sizes[-1]}); synthesise shorter segments")


class BucketGraphs:
    """`make(key)` -> the function of one bucket (static shapes: its tensors' sizes follow from the key), run by
    `mode` on tensors of exactly the bucket's shapes (`__call__`). The returned tensor is the caller's own."""

    def __init__(self, make: Callable[[Hashable], Callable[..., torch.Tensor]], mode: str) -> None:
        if mode not in GRAPH_MODES or mode == "off":
            raise ValueError(f"graph mode must be one of {GRAPH_MODES[1:]}, got {mode!r}")
        self.make = make
        self.mode = mode
        self._fns: dict[Hashable, Callable[..., torch.Tensor]] = {}
        self._pool: tuple[int, int] | None = None

    def __call__(self, key: Hashable, *inputs: torch.Tensor) -> torch.Tensor:
        fn = self._fns.get(key)
        if fn is None:
            fn = self._fns[key] = self._build(key, inputs)
        return fn(*inputs)

    def __len__(self) -> int:
        return len(self._fns)

    def _build(self, key: Hashable, inputs: tuple[torch.Tensor, ...]) -> Callable[..., torch.Tensor]:
        fn = self.make(key)
        if self.mode == "eager":
            return fn
        if self.mode == "compile":
            return torch.compile(fn, fullgraph=True, dynamic=False)
        if not all(t.is_cuda for t in inputs):
            raise ValueError(f"graph mode {self.mode!r} needs CUDA tensors")
        if self.mode == "reduce-overhead":
            compiled = torch.compile(fn, mode="reduce-overhead", fullgraph=True, dynamic=False)
            return lambda *xs: compiled(*xs).clone()  # the graph's output buffer is reused by its next replay
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        return _Captured(fn, inputs, self._pool)


class _Captured:
    """One bucket's function captured as a CUDA graph: static inputs copied in, the graph replayed, its output
    copied out."""

    def __init__(self, fn: Callable[..., torch.Tensor], inputs: tuple[torch.Tensor, ...],
                 pool: tuple[int, int]) -> None:
        self.inputs = [t.clone() for t in inputs]
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up off the capture: lazy inits, cuBLAS workspaces, autotuning
            for _ in range(2):
                fn(*self.inputs)
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool):
            self.output = fn(*self.inputs)

    def __call__(self, *inputs: torch.Tensor) -> torch.Tensor:
        for buf, t in zip(self.inputs, inputs):
            buf.copy_(t, non_blocking=True)
        self.graph.replay()
        return self.output.clone()
