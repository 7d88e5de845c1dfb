"""The native extension: our C++ kernels (csrc/), compiled once per machine and loaded on first use.

One translation unit holds the shared vector math, the int8 VNNI GEMV, the estimator's bf16 GEMM, attention and
transformer block, and the fused decoder-stack steps (int8 / fp32 / bf16) with the Python module. It is compiled
by `torch.utils.cpp_extension.load_inline` (gcc + ninja) into torch's extension cache dir. The code is AVX-512:
it builds where the CPU probe (`kernels.cpu`) reports AVX-512 F/BW/VL/DQ; the int8 GEMV also needs VNNI. When it
cannot be built or loaded, `extension()` is None, one log line says why, and every caller keeps its torch path.
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
# order matters: later sources use what earlier ones define; int8_decode.cpp holds the Python module
_SOURCES = ("vec_math.cpp", "int8_gemv.cpp", "bf16_gemm.cpp", "bf16_attention.cpp", "bf16_block.cpp",
            "int8_decode.cpp")
_FLAGS = ["-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512vnni", "-fopenmp"]

_lock = threading.Lock()
_ext: ModuleType | None = None
_reason: str | None = None  # why the extension is unavailable, once decided


def _build() -> ModuleType:
    from torch.utils.cpp_extension import load_inline

    sources = [(CSRC / name).read_text() for name in _SOURCES]
    # the name carries a hash of the sources, so an edited kernel is rebuilt rather than a stale one loaded
    tag = hashlib.sha1("\n".join(sources).encode()).hexdigest()[:10]
    log.info("loading the native kernels (compiled once per machine into torch's extension cache)")
    return load_inline(name=f"vocalis_kernels_{tag}", cpp_sources=sources, functions=None,
                       extra_cflags=_FLAGS, extra_ldflags=["-fopenmp"], verbose=False)


def extension() -> ModuleType | None:
    """The compiled extension, building it on first call; None (logged once, with the reason) when it cannot be
    built or loaded here."""
    global _ext, _reason
    with _lock:
        if _ext is None and _reason is None:
            feats = cpu.features()
            if not feats.at_least("avx512"):
                _reason = f"the native kernels need AVX-512 (CPU level {feats.describe()})"
            else:
                try:
                    _ext = _build()
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
