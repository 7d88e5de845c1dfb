"""Batched LoRA: many adapters of one base model in one forward pass, each row with its own adapter.

A bank stacks the adapters per adapted Linear layer, A as (K r, in) and B (already scaled by alpha / r) as
(out, K r), ranks zero-padded to the largest (padded rows and columns add exact zeros). A batch's rows carry an
adapter index (-1: none, the base model); the update is y += B (m * (A x)), m zeroing the K r columns that are not
the row's adapter's: two GEMMs per layer whatever the adapters in the batch, with no data-dependent shapes or
host synchronisation (so a captured step can replay it), and a row's update is its adapter's alone (the other
adapters' columns contribute exact zeros).

`bank_linears` swaps the adapted `nn.Linear`s of a model for `BankedLinear`s that read the rows' indices from the
bank (`AdapterBank.rows`, set by the caller before each forward pass), so any code that calls the modules (the
dense `Qwen2LM.forward`, the engine's module path) serves several adapters at once. The engine's packed path
multiplies by the base weights without calling the modules and adds the same updates itself (`adapters.packed`).

Legend: K adapters, r largest rank, N rows, in/out the Linear's widths.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import torch
from torch import nn

from vocalis.adapters.lora_file import LoraAdapter, load_adapters, merge_at_load, resolve_adapter
from vocalis.errors import InputError


class AdapterBank:
    def __init__(self, adapters: Sequence[LoraAdapter], device: torch.device | str = "cpu",
                 dtype: torch.dtype = torch.float32) -> None:
        if not adapters:
            raise InputError("an adapter bank needs at least one adapter")
        self.names = [a.name for a in adapters]
        if len(set(self.names)) != len(self.names):
            raise InputError(f"adapter names must differ: {self.names}")
        digests = {a.config.base_digest for a in adapters}
        if len(digests) > 1:
            raise InputError("the adapters were trained on different base models")
        r = max(a.config.rank for a in adapters)
        self.rank = r
        k = len(adapters)
        # stored transposed, so that a step multiplies by them as they are
        self.a: dict[str, torch.Tensor] = {}  # path -> A^T (in, K r)
        self.b: dict[str, torch.Tensor] = {}  # path -> B^T (K r, out), scaled
        for i, adapter in enumerate(adapters):
            for path, (a, b) in adapter.layers().items():
                if path not in self.a:
                    self.a[path] = torch.zeros(a.shape[1], k * r, device=device, dtype=dtype)
                    self.b[path] = torch.zeros(k * r, b.shape[0], device=device, dtype=dtype)
                rank = a.shape[0]
                self.a[path][:, i * r:i * r + rank] = a.t().to(device, dtype)
                self.b[path][i * r:i * r + rank] = (b * adapter.config.scale).t().to(device, dtype)
        self.dtype = dtype
        self.owner = torch.arange(k * r, device=device) // r  # (K r,) the adapter each stacked column belongs to
        self._rows: torch.Tensor | None = None
        self.mask: torch.Tensor | None = None  # (N, K r) of `rows`, made once per forward pass, not per layer

    @property
    def rows(self) -> torch.Tensor | None:
        """(N,) or (B,) adapter index per row of the next forward pass (-1: none); None: no updates at all."""
        return self._rows

    @rows.setter
    def rows(self, rows: torch.Tensor | None) -> None:
        self._rows = rows
        self.mask = None if rows is None else self.column_mask(rows)

    def column_mask(self, rows: torch.Tensor) -> torch.Tensor:
        """rows (N,) -> (N, K r): 1 on the stacked columns of each row's adapter, else 0."""
        return (self.owner[None, :] == rows[:, None]).to(self.dtype)

    def index(self, name: str | None) -> int:
        """A request's adapter name -> its row index (None: -1, the base model)."""
        if name is None:
            return -1
        try:
            return self.names.index(name)
        except ValueError:
            raise InputError(f"unknown adapter {name!r} (loaded: {', '.join(self.names)})") from None

    def delta(self, path: str, x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """x (N, in), rows (N,) adapter indices -> the LoRA update (N, out) of layer `path` (zeros for rows with
        no adapter, or whose adapter leaves this layer alone). Graph-safe: fixed shapes, no host sync."""
        return self.update(path, x, self.column_mask(rows))

    def update(self, path: str, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """x (N, in) and its column mask (N, K r) (`column_mask`) -> the update (N, out) of layer `path`."""
        a, b = self.a[path], self.b[path]
        if x.dtype != a.dtype:
            a, b, mask = a.to(x.dtype), b.to(x.dtype), mask.to(x.dtype)
        return ((x @ a) * mask) @ b  # (N, K r) -> (N, out)


class BankedLinear(nn.Module):
    """A base `nn.Linear` plus the bank's per-row LoRA update. Rows: `bank.rows` indexes x's first dimension (a
    (B, T, in) batch: one adapter per sequence; a flat (N, in) batch: one per position)."""

    def __init__(self, base: nn.Linear, bank: AdapterBank, path: str) -> None:
        super().__init__()
        self.base = base
        self.bank = bank
        self.path = path

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        bank = self.bank
        rows, mask = bank.rows, bank.mask
        if rows is None or mask is None:
            return y
        if x.dim() == 2:  # the engine's flat positions: the mask made once for the step
            assert mask.shape[0] == x.shape[0], f"{x.shape[0]} rows, {mask.shape[0]} adapter indices"
            return y + bank.update(self.path, x, mask).to(y.dtype)
        per_row = rows.repeat_interleave(x[0].numel() // x.shape[-1])  # (B * T,)
        flat = x.reshape(-1, x.shape[-1])  # (N, in)
        assert per_row.shape[0] == flat.shape[0], f"{x.shape[0]} rows, {rows.shape[0]} adapter indices"
        return y + bank.delta(self.path, flat, per_row).reshape(y.shape).to(y.dtype)


def unwrap(module: nn.Module) -> nn.Module:
    """The layer a `BankedLinear` wraps (whatever a precision backend made of it since), else `module` itself."""
    return module.base if isinstance(module, BankedLinear) else module


def bank_linears(model: nn.Module, bank: AdapterBank) -> int:
    """Replace every Linear of `model` that some adapter of the bank adapts with a `BankedLinear`, in place;
    returns how many. The base weights are untouched (still `<path>.base.weight`)."""
    modules = dict(model.named_modules())
    count = 0
    for path in bank.a:
        linear = modules.get(path)
        if not isinstance(linear, nn.Linear):
            raise InputError(f"the adapters adapt {path}, which is not a Linear layer of this model")
        parent_path, _, leaf = path.rpartition(".")
        setattr(modules[parent_path] if parent_path else model, leaf, BankedLinear(linear, bank, path))
        count += 1
    return count


def banked_adapters(model: nn.Module) -> AdapterBank | None:
    """The bank whose `BankedLinear`s `model` holds (`bank_linears`), else None."""
    for m in model.modules():
        if isinstance(m, BankedLinear):
            return m.bank
    return None


def attach_at_load(llm: nn.Module, specs: Mapping[str, str | Path], model_dir: Path | None) -> tuple[bool, tuple[str, ...]]:
    """`TTS.load(adapters=...)`: check each adapter against `llm`; one adapter is merged into the weights (no cost
    per step, every request gets it), several are kept apart in a bank on `llm`'s device (each request names one,
    or none for the base model). Returns (banked, the adapter names)."""
    if len(specs) == 1:
        return False, merge_at_load(llm, specs, model_dir)
    adapters = load_adapters({name: resolve_adapter(path, model_dir) for name, path in specs.items()}, llm)
    device = next(llm.parameters()).device
    bank_linears(llm, AdapterBank(list(adapters.values()), device=device))
    return True, tuple(adapters)
