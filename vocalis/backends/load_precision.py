"""The LLM's precision applied while a model loads (`model_dir.load_model(llm_convert=)`, `random_model`), so a CPU
process running it in int8 or bf16 never holds its whole fp32 form beside the reduced one; `apply_backend` then
finds the LLM done and applies the rest (`precision.llm_precision`)."""

from __future__ import annotations

import torch

from vocalis.backends.choice import resolve
from vocalis.kernels.config import KernelConfig
from vocalis.model_dir.layerwise import Convert
from vocalis.precision.llm_precision import LLMConverter


def llm_load_converter(backend: str, precision: str, device: str | torch.device = "cpu",
                       kernels: KernelConfig | None = None) -> Convert | None:
    """The conversion `apply_backend(backend, precision)` would give the LLM, for the loader to apply piece by piece;
    None where the LLM stays fp32, runs off the CPU (cast after the move), or another process decodes it (vllm).
    Raises InputError for an unavailable choice, as `resolve` does."""
    if torch.device(device).type != "cpu":
        return None
    kernels = (kernels or KernelConfig()).with_env_overrides()
    backend, precision = resolve(backend, precision, device, kernels)
    converter = None if backend == "vllm" else LLMConverter.for_precision(precision, device, kernels)
    return None if converter is None else converter.convert
