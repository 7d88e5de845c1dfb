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
(`VOCALIS_CPU_ISA=avx2`) builds and loads the avx2 set, so an AVX-512 machine tests it too.

A compiled set is loaded straight from the cache. One not compiled yet is, by default, compiled by a detached
`python -m vocalis.kernels.build` at low priority while torch's ops serve the calls, so that no first call waits
for a compiler: calls that ask per call (attention, LayerNorm + Mish, conv columns) switch to it once it is
ready; what is decided at model load (the fused decode step, the int8 kernel) takes it from the next load.
`VOCALIS_KERNEL_BUILD=wait` compiles in the calling thread instead (tests, benchmarks); `python -m
vocalis.kernels.build` compiles ahead of time (an image build, an install script). Where the set cannot be built
or loaded (no compiler, a CPU below AVX2), `extension()` is None, one log line says why, and every caller keeps its
torch path.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib.util
import logging
import os
import shutil
import subprocess
import sys
import threading
import time
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

_STALE_LOCK_S = 1800.0  # a build takes minutes; a lock this old has no live builder
BUILD_ENV = "VOCALIS_KERNEL_BUILD"  # "background" (the default) or "wait"
_POLL_S = 0.5  # how often calls look at a background build while it runs

_lock = threading.Lock()
_ext: ModuleType | None = None
_reason: str | None = None  # why the extension is unavailable, once decided
# (set, library, our builder or None for another process's) while one compiles
_pending: tuple[str, Path, subprocess.Popen[bytes] | None] | None = None
_next_poll = 0.0


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


def module_name(name: str) -> str:
    """The set's module name: a hash of its sources, flags and torch's version, so that an edited kernel or another
    torch is rebuilt rather than a stale library loaded."""
    import torch

    texts, flags = sources(name)
    tag = hashlib.sha1("\n".join([*texts, *flags, torch.__version__]).encode()).hexdigest()[:10]
    return f"vocalis_kernels_{name}_{tag}"


def library(name: str) -> Path:
    """Where the set's compiled library lives in torch's extension cache (`TORCH_EXTENSIONS_DIR`)."""
    from torch.utils.cpp_extension import _get_build_directory  # the folder load_inline builds in

    module = module_name(name)
    return Path(_get_build_directory(module, verbose=False)) / f"{module}.so"


def _compiled(lib: Path) -> bool:
    return lib.is_file() and not (lib.parent / "lock").exists()  # "lock": load_inline's baton while it builds


def _clear_stale_lock(lock: Path) -> None:
    """A builder killed mid-build leaves load_inline's lock behind, and every later build would wait on it for
    ever: one older than any build takes is removed."""
    with contextlib.suppress(OSError):
        if time.time() - lock.stat().st_mtime > _STALE_LOCK_S:
            lock.unlink()
            log.warning("removed a stale native-kernel build lock (%s): its builder had died", lock)


def _import(lib: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(lib.stem, lib)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _build(name: str) -> ModuleType:
    """Compile (or find compiled) and load the set, in this thread."""
    from torch.utils.cpp_extension import load_inline

    texts, flags = sources(name)
    log.info("compiling the native %s kernels (once per machine, into torch's extension cache)", name)
    return load_inline(name=module_name(name), cpp_sources=texts, functions=None,
                       extra_cflags=flags, extra_ldflags=["-fopenmp"], verbose=False)


def compiler() -> str | None:
    """The C++ compiler load_inline would call ($CXX, else c++), if there is one."""
    return shutil.which(os.environ.get("CXX", "c++"))


def _start_builder(name: str, lib: Path) -> subprocess.Popen[bytes]:
    # its own session: the build outlives a short process (a first `vocalis speak`) and fills the cache for the next
    with open(lib.parent / "build.log", "wb") as out:
        return subprocess.Popen([sys.executable, "-m", "vocalis.kernels.build", "--isa", name],
                                stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def _decide() -> None:
    """First call: load the compiled set, compile it (here or in the background), or say why there is none."""
    global _ext, _reason, _pending
    name = isa()
    if name is None:
        _reason = f"the native kernels need AVX2 + FMA or AVX-512 (CPU level {cpu.features().describe()})"
        return
    try:
        lib = library(name)
        if _compiled(lib):
            _ext = _import(lib)
            log.info("native %s kernels loaded from the cache (%s)", name, lib.parent)
        elif os.environ.get(BUILD_ENV, "background") == "wait":
            _ext = _build(name)
        elif compiler() is None:
            _reason = f"no C++ compiler ({os.environ.get('CXX', 'c++')}) to build them"
        else:
            _clear_stale_lock(lib.parent / "lock")
            # another process's builder at work: wait for its library rather than start a second build behind it
            builder = None if (lib.parent / "lock").exists() else _start_builder(name, lib)
            _pending = (name, lib, builder)
            log.info("native %s kernels: compiling in the background (once per machine; log %s); torch's ops run "
                     "until they are ready", name, lib.parent / "build.log")
    except Exception as e:  # noqa: BLE001 - any build failure means: use the fallback
        _reason = f"build failed ({_last_line(e)})"


def _last_line(e: Exception) -> str:
    return f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[-1]}"


def _poll() -> None:
    """While a background build runs: take its library once it has finished."""
    global _ext, _reason, _pending, _next_poll
    assert _pending is not None
    name, lib, builder = _pending
    if builder is None:  # another process builds: done when its library is there and its lock gone
        code = 0 if _compiled(lib) else (None if (lib.parent / "lock").exists() else 1)
    else:
        code = builder.poll()
    if code is None:
        _next_poll = time.monotonic() + _POLL_S
        return
    _pending = None
    try:
        if code != 0:
            raise RuntimeError(f"exit code {code}; see {lib.parent / 'build.log'}")
        _ext = _import(lib)
        log.info("native %s kernels ready: they take over from torch's ops", name)
    except Exception as e:  # noqa: BLE001 - any build failure means: use the fallback
        _reason = f"the background build failed ({_last_line(e)})"


def extension() -> ModuleType | None:
    """The compiled extension of the level in use (`isa()`; its `isa` attribute names the set); None (logged once,
    with the reason) when it cannot be built or loaded here, and while it compiles in the background."""
    ext = _ext
    if ext is not None:  # built: no lock (every attention call of a step asks, from every worker thread)
        return ext
    if _reason is not None or time.monotonic() < _next_poll:
        return None
    with _lock:
        if _ext is None and _reason is None:
            if _pending is None:
                _decide()
            else:
                _poll()
            if _reason is not None:
                log.info("native kernels unavailable: %s; torch's ops run instead", _reason)
        return _ext


def settled() -> bool:
    """Whether `extension()` has its final answer here (False while the set compiles in the background): callers
    that decide once keep their decision only when it is settled."""
    extension()
    return _ext is not None or _reason is not None


def unavailable_reason() -> str | None:
    """Why the extension cannot run here now (None: it can)."""
    if extension() is not None:
        return None
    return _reason or "compiling in the background"


def reset() -> None:
    """Forget the decision (tests that force a CPU level call this with `cpu.reset()`); a background build goes on."""
    global _ext, _reason, _pending, _next_poll
    with _lock:
        _ext, _reason, _pending, _next_poll = None, None, None, 0.0


def main(argv: list[str] | None = None) -> int:
    """`python -m vocalis.kernels.build [--isa avx512|avx2|all]`: compile ahead of time (default: this CPU's set)."""
    parser = argparse.ArgumentParser(prog="python -m vocalis.kernels.build", description=main.__doc__)
    parser.add_argument("--isa", choices=[*SOURCE_SETS, "all"], help="the set to compile (default: this CPU's)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    names = list(SOURCE_SETS) if args.isa == "all" else [args.isa or isa()]
    if names == [None]:
        print(f"vocalis: error: this CPU has no native kernel level ({cpu.features().describe()})", file=sys.stderr)
        return 2
    with contextlib.suppress(OSError):
        os.nice(10)  # a background build yields to the synthesis it runs beside
    for name in names:
        _build(name)
        log.info("native %s kernels compiled: %s", name, library(name))
    return 0


if __name__ == "__main__":
    sys.exit(main())
