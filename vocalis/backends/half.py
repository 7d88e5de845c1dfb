"""Whole-model half precision (bf16 or fp16): weights cast once, activations kept in the half dtype between layers,
a cast only where a model part is entered and left.

Why: `CastLinear` (`precision.layers`) keeps fp32 activations and rounds each Linear's input down and its output
back up, two cast kernels around every GEMM. On a GPU each is a launch and a pass over the activations, which made
fp16 and bf16 slower than fp32 there. Here the parts a step spends its time in hold half-precision weights and pass
half-precision activations from layer to layer:

- the LLM (`cast_llm`): every parameter and the KV cache in the half dtype (the engine's `ModelRunner` keys its
  cache and rotary tables on the speech table's dtype). RMSNorm squares and sums in fp32 (`Qwen2RMSNorm`), SDPA's
  softmax accumulates in fp32, and the speech head's logits are widened to fp32 before the log-softmax.
- the flow estimator (`cast_estimator`): Linears become `CastLinear`s in the half dtype, plain convs `CastConv`s,
  causal conv subclasses hold half weights; norms keep fp32 parameters (LayerNorm on a half input with fp32 parameters normalises in fp32 and
  returns the half dtype). The module's own forward (full passes) is entered through `HalfBoundary` hooks: x, mu,
  spks, cond and the mask are cast down once per call, the time t stays fp32 (its sinusoidal embedding needs
  fp32's resolution), and the velocity comes back fp32, so the Euler state the solver integrates stays fp32. In
  that forward every `CastLinear` sees its own dtype and casts nothing. The token2wav engine's incremental path,
  which calls the estimator's parts on fp32 activations, sees the same `CastLinear`s and half conv weights as it
  sees under `CastLinear` alone (`ComputeWeights` takes the half weights as they are).
- HiFT: its body convs in the half dtype (`precision.layers.cast_hift_convs`) or fp32, the caller's choice
  (`apply_backend(hift_reduced=...)`); the F0 predictor and the sine source stay fp32.

The flow encoder stays fp32 (it runs once per chunk, not once per Euler step and guidance row).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from vocalis.precision.layers import CastConv, cast_linears
from vocalis.precision.module_swap import swap_modules

HALF = {"bf16": torch.bfloat16, "fp16": torch.float16}
_NORMS = (nn.LayerNorm, nn.GroupNorm)


def cast_llm(llm: nn.Module, dtype: torch.dtype) -> int:
    """Every parameter and floating buffer of the speech LM in `dtype` (in place); returns how many Linears now
    hold `dtype` weights."""
    llm.to(dtype)
    return sum(1 for m in llm.modules() if isinstance(m, nn.Linear))


class HalfBoundary:
    """Forward hooks that cast a module's floating tensor inputs to `dtype` on entry (except the arguments named
    in `keep`, by position or keyword) and its floating tensor output back to fp32 on exit."""

    def __init__(self, module: nn.Module, dtype: torch.dtype, keep: tuple[tuple[int, str], ...] = ()) -> None:
        self.dtype = dtype
        self.keep_pos = {i for i, _ in keep}
        self.keep_names = {n for _, n in keep}
        self.handles = (module.register_forward_pre_hook(self._enter, with_kwargs=True),
                        module.register_forward_hook(self._leave))

    def _down(self, v: object) -> object:
        return v.to(self.dtype) if isinstance(v, torch.Tensor) and v.is_floating_point() else v

    def _enter(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
               ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        args = tuple(v if i in self.keep_pos else self._down(v) for i, v in enumerate(args))
        kwargs = {k: v if k in self.keep_names else self._down(v) for k, v in kwargs.items()}
        return args, kwargs

    @staticmethod
    def _leave(module: nn.Module, args: tuple[Any, ...], out: object) -> object:
        return out.float() if isinstance(out, torch.Tensor) and out.is_floating_point() else out

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def cast_estimator(estimator: nn.Module, dtype: torch.dtype) -> int:
    """The flow estimator in `dtype` (module doc): Linears as `CastLinear`, conv weights cast in place, norms
    fp32, `HalfBoundary` hooks on its forward (t, the fourth argument, kept fp32). In place; returns how many
    layers hold `dtype` weights."""
    n = cast_linears(estimator, dtype)
    # plain convs, which the engines' incremental paths also call on fp32 inputs, become `CastConv`s (a cast only
    # where the input is not already `dtype`); causal conv subclasses keep their forward, their weights cast (the
    # incremental path runs them as GEMMs through `ComputeWeights`)
    n += swap_modules(estimator, lambda m: type(m) in (nn.Conv1d, nn.ConvTranspose1d), lambda m: CastConv(m, dtype))
    for m in estimator.modules():
        if isinstance(m, (nn.Conv1d, nn.ConvTranspose1d)):
            m.to(dtype)
            n += 1
        elif isinstance(m, _NORMS):
            m.float()
    estimator._vocalis_half = HalfBoundary(estimator, dtype, keep=((3, "t"),))  # type: ignore[assignment]
    return n
