"""The native extension: our C++ kernels (csrc/), compiled once per machine and loaded on first use.

Two source sets, one per instruction-set level, each compiled into one translation unit by
`torch.utils.cpp_extension.load_inline` (gcc + ninja) into torch's extension cache dir:
- avx512 (where the CPU probe, `kernels.cpu`, reports AVX-512 F/BW/VL/DQ): the shared vector math, the int8 VNNI
  GEMV (its int8 path also needs VNNI), the decode step's vector pieces, the estimator's bf16 GEMM, attention
  and transformer block (AMX), its fp32 attention and LayerNorm + Mish (the avx2 set's), and the fused
  decoder-stack steps (int8 / fp32 / bf16) with the Python module;
- avx2 (AVX2 + FMA + F16C): the same decode steps and int8 GEMV with 8-wide vectors (`*_avx2.cpp`), and the
  estimator's attention and LayerNorm + Mish in fp32 (no bf16 arithmetic there).
The decode steps' ISA-free part (decode_weights.cpp, decode_operands.cpp, int8_decode.cpp), a conv's GEMM input
(conv_columns.cpp) and the Python module (module.cpp) are in both. A CPU forced to a lower level
(`VOCALIS_CPU_ISA=avx2`) builds and loads the avx2 set, so an AVX-512 machine tests it too. When the set cannot be
built or loaded, `extension()` is None, one log line says why, and every caller keeps its torch path.
"""

from __future__ import annotations

import hashlib
import logging
import threading
from pathlib import Path
from types import ModuleType

from vocalis.kernels import cpu

log = logging.getLogger(__name__)

CSRC = Path(__file__).with_name("csrc")
# the ISA-free sources (the fused decode steps', a conv's columns), then the module: the same in both sets
_BOTH_SETS = ("decode_weights.cpp", "decode_operands.cpp", "int8_decode.cpp", "conv_columns.cpp", "module.cpp")
# per set: sources in order (later ones use what earlier ones define; module.cpp, last, holds the Python module)
# and the ISA flags
SOURCE_SETS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "avx512": (("vec_math.cpp", "int8_gemv.cpp", "decode_math.cpp", "bf16_gemm.cpp", "bf16_attention.cpp",
                "bf16_block.cpp", "vec_math_avx2.cpp", "fp32_attention_avx2.cpp", "fp32_pointwise_avx2.cpp",
                *_BOTH_SETS),
               ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512vnni", "-mfma")),
    "avx2": (("vec_math_avx2.cpp", "int8_gemv_avx2.cpp", "decode_math_avx2.cpp", "fp32_attention_avx2.cpp",
              "fp32_pointwise_avx2.cpp", *_BOTH_SETS),
             ("-mavx2", "-mfma", "-mf16c")),
}

_lock = threading.Lock()
_ext: ModuleType | None = None
_reason: str | None = None  # why the extension is unavailable, once decided


def isa() -> str | None:
    """The source set the CPU level in use calls for: "avx512", "avx2", or None (no native kernels)."""
    feats = cpu.features()
    if feats.at_least("avx512"):
        return "avx512"
    return "avx2" if feats.at_least("avx2") else None


def sources(name: str) -> tuple[list[str], list[str]]:
    """The set's source texts in order and its compiler flags."""
    files, isa_flags = SOURCE_SETS[name]
    return [(CSRC / f).read_text() for f in files], ["-O3", *isa_flags, "-fopenmp"]


def _build(name: str) -> ModuleType:
    from torch.utils.cpp_extension import load_inline

    texts, flags = sources(name)
    # the name carries a hash of the sources and flags, so an edited kernel is rebuilt rather than a stale one loaded
    tag = hashlib.sha1("\n".join(texts + flags).encode()).hexdigest()[:10]
    log.info("loading the native %s kernels (compiled once per machine into torch's extension cache)", name)
    return load_inline(name=f"vocalis_kernels_{name}_{tag}", cpp_sources=texts, functions=None,
                       extra_cflags=flags, extra_ldflags=["-fopenmp"], verbose=False)


def extension() -> ModuleType | None:
    """The compiled extension of the level in use (`isa()`; its `isa` attribute names the set), building it on first
    call; None (logged once, with the reason) when it cannot be built or loaded here."""
    global _ext, _reason
    ext = _ext
    if ext is not None:  # built: no lock (every attention call of a step asks, from every worker thread)
        return ext
    with _lock:
        if _ext is None and _reason is None:
            name = isa()
            if name is None:
                _reason = f"the native kernels need AVX2 + FMA or AVX-512 (CPU level {cpu.features().describe()})"
            else:
                try:
                    _ext = _build(name)
                except Exception as e:  # noqa: BLE001 - any build failure means: use the fallback
                    _reason = f"build failed ({type(e).__name__}: {str(e).strip().splitlines()[-1:]})"
            if _reason is not None:
                log.info("native kernels unavailable: %s; torch's ops run instead", _reason)
        return _ext


def unavailable_reason() -> str | None:
    """Why the extension cannot run here (None: it can)."""
    extension()
    return _reason


def reset() -> None:
    """Forget the decision (tests that force a CPU level call this with `cpu.reset()`)."""
    global _ext, _reason
    with _lock:
        _ext, _reason = None, None
