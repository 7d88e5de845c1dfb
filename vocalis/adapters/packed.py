"""Batched LoRA on the engine's packed weights: each row's update added to the outputs of the fused GEMMs.

The engine multiplies by fused weights (`engine.packed_weights`: q/k/v as one GEMM, gate/up as one) instead of
calling the Linear modules that `bank_linears` wrapped, so the bank's updates are added to those GEMMs' outputs
here. The projections that share an input share one pair of update GEMMs: the A^T of every adapted projection side
by side (in, n K r), and their scaled B^T as one (n K r, out) matrix whose blocks write each projection's columns of
the fused output (zeros elsewhere). Per step: y += ((x @ A) * mask) @ B, the mask (N, n K r) keeping each row's
adapter's columns (none for a row with index -1), as `AdapterBank.update` does per Linear. Fixed shapes and no host
synchronisation: two GEMMs and a multiply per fused projection, whatever the adapters in the step. Why not the
alternatives: gathering each row's A and B for two batched matmuls copies N of each per projection and step;
grouping rows by adapter takes index ops per adapter per layer and host-side index lists; folding A into the
packed base weight (one GEMM for both) saves no time with the (out, in) layout the fused step reads.

Legend: K adapters, r largest rank, n projections sharing an input (q/k/v: up to 3, gate/up: up to 2), N rows,
D hidden, Dq / Dkv query / key-value widths, I intermediate.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate

import torch
from torch import nn

from vocalis.adapters.batched import AdapterBank, BankedLinear, unwrap


@dataclass(frozen=True, slots=True)
class LoraPair:
    a: torch.Tensor  # (in, n K r): the adapted projections' A^T side by side
    b: torch.Tensor  # (n K r, out): their scaled B^T, block j writing projection j's columns of the fused output
    n: int  # adapted projections (which column mask: (N, n K r))


@dataclass(frozen=True, slots=True)
class LayerLora:
    qkv: LoraPair | None  # (D, .) -> (N, Dq + 2 Dkv)
    o: LoraPair | None  # (Dq, .) -> (N, D)
    gate_up: LoraPair | None  # (D, .) -> (N, 2 I)
    down: LoraPair | None  # (I, .) -> (N, D)


@dataclass(frozen=True, slots=True)
class StepLora:
    """One step's rows: the layers' pairs and the column masks of the rows' adapters."""

    layers: Sequence[LayerLora | None]
    masks: tuple[torch.Tensor, ...]  # masks[n - 1]: (N, n K r)

    def add(self, y: torch.Tensor, x: torch.Tensor, pair: LoraPair | None) -> torch.Tensor:
        """y (N, out) += each row's update of x (N, in), in place (y is a GEMM's fresh output)."""
        if pair is None:
            return y
        t = torch.mm(x, pair.a)  # (N, n K r)
        t.mul_(self.masks[pair.n - 1])
        return y.addmm_(t, pair.b)


def _width(module: nn.Module) -> int:
    out = unwrap(module).out_features
    assert isinstance(out, int), f"no output width for {type(module).__name__}"
    return out


class PackedLora:
    """The bank's updates per decoder layer, fused as `packed_weights` fuses the weights."""

    def __init__(self, bank: AdapterBank, llm: nn.Module, layers: Sequence[nn.Module], dtype: torch.dtype) -> None:
        self.bank = bank
        self.dtype = dtype
        self.kr = len(bank.names) * bank.rank  # K r: every adapter's columns in each projection's stack
        modules = dict(llm.named_modules())
        paths = {id(m): path for path, m in modules.items()}
        self.layers: list[LayerLora | None] = []
        self._taken: set[str] = set()  # the bank paths these pairs hold
        for layer in layers:
            p = paths[id(layer)]
            attn, mlp = layer.self_attn, layer.mlp  # type: ignore[union-attr]
            qkv = (attn.q_proj, attn.k_proj, attn.v_proj)
            lora = LayerLora(
                self._pair([f"{p}.self_attn.{n}" for n in ("q_proj", "k_proj", "v_proj")], [_width(m) for m in qkv]),
                self._pair([f"{p}.self_attn.o_proj"], [_width(attn.o_proj)]),
                self._pair([f"{p}.mlp.gate_proj", f"{p}.mlp.up_proj"], [_width(mlp.gate_proj), _width(mlp.up_proj)]),
                self._pair([f"{p}.mlp.down_proj"], [_width(mlp.down_proj)]))
            self.layers.append(None if lora == LayerLora(None, None, None, None) else lora)
        for path in set(bank.a) - self._taken:  # the rest: their `BankedLinear`s add them (the speech head)
            assert isinstance(modules.get(path), BankedLinear), f"adapted layer {path} is not in this model"
        self.max_n = max((pair.n for lo in self.layers if lo is not None
                          for pair in (lo.qkv, lo.o, lo.gate_up, lo.down) if pair is not None), default=1)

    def _pair(self, paths: Sequence[str], widths: Sequence[int]) -> LoraPair | None:
        """Projections sharing one input, their outputs side by side `widths` wide -> their fused pair (None: no
        adapter of the bank adapts any of them)."""
        bank, kr = self.bank, self.kr
        present = [(i, path) for i, path in enumerate(paths) if path in bank.a]
        if not present:
            return None
        self._taken.update(path for _, path in present)
        starts = [0, *accumulate(widths)]
        a = torch.cat([bank.a[path] for _, path in present], dim=1)  # (in, n K r)
        b = a.new_zeros(len(present) * kr, starts[-1])  # (n K r, out)
        for j, (i, path) in enumerate(present):
            b[j * kr:(j + 1) * kr, starts[i]:starts[i + 1]] = bank.b[path]
        return LoraPair(a.to(self.dtype).contiguous(), b.to(self.dtype), len(present))

    def step(self, rows: torch.Tensor) -> StepLora:
        """rows (N,) adapter index per position (-1: none) -> the step's masks. Graph-safe: no host sync."""
        mask = self.bank.column_mask(rows).to(self.dtype)  # (N, K r)
        return StepLora(self.layers, tuple(mask.repeat(1, n) for n in range(1, self.max_n + 1)))
