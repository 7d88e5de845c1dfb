"""The speech LM's precision, applied the same way whole (`convert_llm`, from `backends.choice.apply_backend`) or
one piece at a time while the model is built (`LLMConverter.convert`, from the layer-wise builders in `model_dir`),
so a model loaded in int8 or bf16 never holds the whole fp32 LLM.

What changes (CPU): every `nn.Linear` (the Qwen2 layers and the speech head) becomes the precision's layer (our
int8 kernel's `Int8Linear`, else torch's dynamic int8; `CastLinear` in bf16/fp16), and Qwen's text table becomes a
`ReducedEmbedding` in the same precision (int8 rows with per-row scales; bf16 rows); the speech table, the sos /
task rows and the norms stay fp32. On a GPU only the Linear layers change. Applying twice changes nothing.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from vocalis.kernels.config import KernelConfig
from vocalis.models.qwen2 import Qwen2Model
from vocalis.precision import int8_linear
from vocalis.precision.dynamic_int8 import use_x86_quantized_engine
from vocalis.precision.embedding import ReducedEmbedding
from vocalis.precision.layers import CastLinear

REDUCED = ("int8", "bf16", "fp16")
_FLOATS = {"bf16": torch.bfloat16, "fp16": torch.float16}


def _dynamic_int8(linear: nn.Linear) -> nn.Module:
    """torch's dynamic int8 form of one Linear (what `quantize_dynamic` makes of it)."""
    use_x86_quantized_engine()
    holder = nn.Sequential(linear)
    with warnings.catch_warnings():  # eager dynamic quantization is deprecated upstream but present in torch 2.13
        warnings.simplefilter("ignore")
        torch.ao.quantization.quantize_dynamic(holder, {nn.Linear}, dtype=torch.qint8, inplace=True)
    return holder[0]


def _materialised(m: nn.Module) -> bool:
    return all(p.device.type != "meta" for p in m.parameters(recurse=False))


@dataclass(frozen=True)
class LLMConverter:
    """One precision's conversion of the speech LM's layers. Build with `for_precision`."""

    precision: str
    make_linear: Callable[[nn.Linear], nn.Module]
    table_dtype: torch.dtype | None  # the text table's storage; None: left fp32
    linear_kind: str  # what the Linear layers become, for the runtime's notes

    @classmethod
    def for_precision(cls, precision: str, device: str | torch.device = "cpu",
                      kernels: KernelConfig | None = None) -> LLMConverter | None:
        """None for a precision that leaves the LLM as it is (fp32)."""
        if precision not in REDUCED:
            return None
        cpu = torch.device(device).type == "cpu"
        if precision == "int8":
            k = kernels or KernelConfig()
            if int8_linear.available(k.int8_kernel):
                grain = k.int8_grain_bytes
                return cls(precision, lambda m: int8_linear.Int8Linear(m, grain), torch.int8,
                           f"int8 (our {int8_linear.layout()} kernel)")
            return cls(precision, _dynamic_int8, torch.int8, "int8 (dynamic, fbgemm)")
        dtype = _FLOATS[precision]
        return cls(precision, lambda m: CastLinear(m, dtype), dtype if cpu else None, precision)

    def convert(self, parent: nn.Module, name: str) -> None:
        """Convert `parent`'s child `name` (just built or loaded) and everything below it in place; pieces not yet
        materialised (meta) and layers already converted are left alone."""
        child = getattr(parent, name)
        if type(child) is nn.Linear:
            if _materialised(child):
                setattr(parent, name, self.make_linear(child))
            return
        if type(child) is nn.Embedding:
            if self.table_dtype is not None and _is_text_table(parent, name) and _materialised(child):
                setattr(parent, name, ReducedEmbedding(child, self.table_dtype))
            return
        for sub in [n for n, _ in child.named_children()]:
            self.convert(child, sub)


def _is_text_table(parent: nn.Module, name: str) -> bool:
    """Qwen's token table (`Qwen2Model.embed_tokens`): the speech LM's one large, sparsely read table."""
    return isinstance(parent, Qwen2Model) and name == "embed_tokens"


def convert_llm(llm: nn.Module, precision: str, device: str | torch.device = "cpu",
                kernels: KernelConfig | None = None) -> str | None:
    """Apply `precision` to the whole speech LM in place (layers already converted are kept); a note saying what
    its layers now are, or None when the precision leaves it fp32."""
    converter = LLMConverter.for_precision(precision, device, kernels)
    if converter is None:
        return None
    for name in [n for n, _ in llm.named_children()]:
        converter.convert(llm, name)
    linears = sum(1 for m in llm.modules() if _reduced_linear(m))
    note = f"{linears} LLM Linear layers {converter.linear_kind}"
    tables = [m for m in llm.modules() if isinstance(m, ReducedEmbedding)]
    if tables:
        note += f", text table {tables[0].rows.dtype} rows ({sum(t.nbytes() for t in tables) / 2**20:.0f} MiB)"
    return note


def _reduced_linear(m: nn.Module) -> bool:
    return isinstance(m, (int8_linear.Int8Linear, CastLinear)) or type(m).__module__.startswith(
        "torch.ao.nn.quantized.dynamic")
