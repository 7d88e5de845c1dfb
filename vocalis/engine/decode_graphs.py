"""CUDA graphs for the LLM's decode steps: the whole layer stack and head replayed as one graph launch.

Why: at batch 1 a decode step of the 0.5B LLM is ~24 layers x ~20 small kernels. On a GPU each launch costs a few
microseconds of CPU time, which is more than the kernel itself, so eager decode is bound by Python and launch
overhead rather than by memory bandwidth. A captured graph replays every kernel with one launch.

A graph has fixed shapes and fixed addresses, so a step is padded into static buffers:
- rows: the batch is padded up to a captured size (`BATCH_SIZES`); padding rows read and write one scratch KV slot
  (`ModelRunner.scratch_slot`, never part of a block) and are dropped after the replay;
- context: every row gathers a fixed number of context slots (the smallest `CONTEXT_SIZES` bucket that holds the
  longest row, or the runner's `max_positions`), with the unused ones masked, as the eager path masks its padding.
One graph is captured per (rows, context) bucket on first use; all share one memory pool (a replay's logits are
copied out before the next replay, so no two graphs are ever live at once).

Only steps of single-query rows whose ids are all speech ids take this path (prefill chunks have varying shapes
and the mixed-table embedding uses data-dependent indexing); everything else runs eagerly. `capture=False` runs
the same padded computation eagerly: that is how the padding is tested on a machine with no GPU.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from vocalis.engine.model_runner import ModelRunner, StepInputs

log = logging.getLogger(__name__)

BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64)
CONTEXT_SIZES = (256, 512, 1024, 2048)


def _bucket(n: int, sizes: tuple[int, ...], cap: int) -> int:
    return next((s for s in sizes if s >= n and s <= cap), cap)


class _Graph:
    """One captured (rows, context) shape: its static inputs, and the logits (rows, V) its replay writes."""

    def __init__(self, runner: ModelRunner, rows: int, context: int) -> None:
        dev, scratch = runner.device, runner.scratch_slot
        self.ids = torch.zeros(rows, dtype=torch.long, device=dev)
        self.positions = torch.zeros(rows, dtype=torch.long, device=dev)
        self.write_slots = torch.full((rows,), scratch, dtype=torch.long, device=dev)
        self.gather_slots = torch.full((rows, context), scratch, dtype=torch.long, device=dev)
        self.valid = torch.zeros(rows, context, dtype=torch.bool, device=dev)
        self.valid[:, 0] = True  # a padding row attends to the scratch slot alone (never an all-masked row)
        self.logits: torch.Tensor | None = None
        self.graph: torch.cuda.CUDAGraph | None = None

    def load(self, inp: StepInputs, scratch: int) -> None:
        """Copy a step's inputs into the static buffers; rows past the step's become padding again."""
        b = inp.num_single
        assert inp.gather_slots is not None and inp.valid is not None
        lmax = inp.gather_slots.shape[1]
        self.ids[:b].copy_(inp.ids)
        self.ids[b:].zero_()
        self.positions[:b].copy_(inp.positions)
        self.positions[b:].zero_()
        self.write_slots[:b].copy_(inp.write_slots)
        self.write_slots[b:].fill_(scratch)
        self.gather_slots[:b, :lmax].copy_(inp.gather_slots)
        self.gather_slots[:b, lmax:] = inp.gather_slots[:, :1]  # a real slot of the row, masked below
        self.gather_slots[b:].fill_(scratch)
        self.valid[:b, :lmax].copy_(inp.valid)
        self.valid[:b, lmax:] = False
        self.valid[b:] = False
        self.valid[b:, 0] = True


class DecodeGraphs:
    def __init__(self, runner: ModelRunner, capture: bool = True) -> None:
        """capture: record CUDA graphs (needs a CUDA runner); False runs the padded steps eagerly."""
        if capture and runner.device.type != "cuda":
            raise ValueError("CUDA graphs need the model on a CUDA device")
        self.runner = runner
        self.capture = capture
        self.max_rows = BATCH_SIZES[-1]
        self._graphs: dict[tuple[int, int], _Graph] = {}
        self._pool = torch.cuda.graph_pool_handle() if capture else None

    def applies(self, inp: StepInputs) -> bool:
        return (not inp.prefills and inp.all_speech and 0 < inp.num_single <= self.max_rows
                and inp.gather_slots is not None)

    @torch.inference_mode()
    def forward(self, inp: StepInputs) -> torch.Tensor:
        """Log-probs (R, V) of the step's sampled rows, as `ModelRunner.forward` returns them."""
        assert inp.gather_slots is not None
        rows = _bucket(inp.num_single, BATCH_SIZES, self.max_rows)
        context = _bucket(inp.gather_slots.shape[1], CONTEXT_SIZES, self.runner.max_positions)
        g = self._graphs.get((rows, context))
        if g is None:
            g = self._graphs[(rows, context)] = self._make(rows, context)
        g.load(inp, self.runner.scratch_slot)
        if g.graph is not None:
            g.graph.replay()
        else:
            g.logits = self._run(g)
        assert g.logits is not None
        return g.logits.index_select(0, inp.sample_rows).float().log_softmax(dim=-1)  # (R, V)

    def _run(self, g: _Graph) -> torch.Tensor:
        """The padded step: every row through the layer stack, the final norm and the speech head."""
        return self.runner.static_decode(g.ids, g.positions, g.write_slots, g.gather_slots, g.valid)

    def _make(self, rows: int, context: int) -> _Graph:
        g = _Graph(self.runner, rows, context)
        if not self.capture:
            return g
        # warm up on a side stream first (lazy library initialisation must not happen during capture); the
        # static inputs point every write at the scratch slot, so neither run touches a request's K/V
        side = torch.cuda.Stream(self.runner.device)
        side.wait_stream(torch.cuda.current_stream(self.runner.device))
        with torch.cuda.stream(side):
            self._run(g)
        torch.cuda.current_stream(self.runner.device).wait_stream(side)
        g.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g.graph, pool=self._pool):
            g.logits = self._run(g)
        log.debug("captured a CUDA graph for decode steps of %d rows x %d context positions", rows, context)
        return g
