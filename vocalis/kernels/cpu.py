"""The one CPU capability probe: what this CPU can run, read once from torch's own CPU detection.

Every native path (the int8 GEMV, the fused decode steps, the AMX bf16 estimator kernels, fbgemm's 8-bit
activations, `auto` precision) asks `isa()` which instruction-set level it may use, and that is decided here
once per process. `VOCALIS_CPU_ISA` forces a lower level than the CPU has (`avx2`, `generic`), so a machine
with AVX-512 or AMX also runs and tests the paths of smaller CPUs; asking for more than the CPU has is refused.
"""

from __future__ import annotations

import functools
import logging
import os
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)

# levels in order; each includes the ones before it
LEVELS = ("generic", "avx2", "avx512", "avx512_vnni", "amx")


@dataclass(frozen=True, slots=True)
class CpuFeatures:
    """What the CPU offers (as torch detects it) and the level Vocalis uses."""

    name: str
    architecture: str
    avx2: bool  # AVX2 + FMA
    avx512: bool  # AVX-512 F/BW/VL/DQ
    avx512_vnni: bool
    avx512_bf16: bool
    amx: bool  # AMX tiles with bf16 and int8
    neon: bool
    level: str  # the level in use: one of LEVELS (capped by VOCALIS_CPU_ISA)
    forced: bool  # whether VOCALIS_CPU_ISA lowered it

    def at_least(self, level: str) -> bool:
        return LEVELS.index(self.level) >= LEVELS.index(level)

    def describe(self) -> str:
        how = f" (forced by VOCALIS_CPU_ISA={self.level})" if self.forced else ""
        return f"{self.name or self.architecture}: {self.level}{how}"


def _detected_level(caps: dict[str, object]) -> str:
    def has(*names: str) -> bool:
        return all(bool(caps.get(n)) for n in names)

    avx512 = has("avx512_f", "avx512_bw", "avx512_vl", "avx512_dq")
    if avx512 and has("avx512_vnni", "amx_tile", "amx_bf16", "amx_int8"):
        return "amx"
    if avx512 and has("avx512_vnni"):
        return "avx512_vnni"
    if avx512:
        return "avx512"
    if has("avx2", "fma3"):
        return "avx2"
    return "generic"


@functools.cache
def features() -> CpuFeatures:
    """The probe, run once per process."""
    try:
        caps: dict[str, object] = dict(torch.cpu.get_capabilities())
    except (AttributeError, RuntimeError):  # an unusual build: assume nothing
        caps = {}
    detected = _detected_level(caps)
    level, forced = detected, False
    wanted = os.environ.get("VOCALIS_CPU_ISA", "").strip().lower()
    if wanted:
        if wanted not in LEVELS:
            raise ValueError(f"VOCALIS_CPU_ISA={wanted!r}: choose one of {', '.join(LEVELS)}")
        if LEVELS.index(wanted) > LEVELS.index(detected):
            raise ValueError(f"VOCALIS_CPU_ISA={wanted!r} asks for more than this CPU has ({detected})")
        level, forced = wanted, wanted != detected
    arch = str(caps.get("architecture", ""))
    feats = CpuFeatures(
        name=str(caps.get("cpu_name", "")), architecture=arch,
        avx2=bool(caps.get("avx2")) and bool(caps.get("fma3")),
        avx512=all(bool(caps.get(n)) for n in ("avx512_f", "avx512_bw", "avx512_vl", "avx512_dq")),
        avx512_vnni=bool(caps.get("avx512_vnni")), avx512_bf16=bool(caps.get("avx512_bf16")),
        amx=bool(caps.get("amx_tile")) and bool(caps.get("amx_bf16")),
        neon=arch in ("aarch64", "arm64") or bool(caps.get("asimd")),
        level=level, forced=forced)
    log.info("CPU %s", feats.describe())
    return feats


def reset() -> None:
    """Forget the probe's answer (tests that change VOCALIS_CPU_ISA call this)."""
    features.cache_clear()


def has_amx() -> bool:
    """Whether the AMX paths may run: the CPU has AMX tiles (and the level is not forced below them)."""
    return features().at_least("amx")


def native_bf16() -> bool:
    """Whether bf16 matmuls run natively (AVX512-BF16 or AMX), at the level in use."""
    f = features()
    return f.at_least("amx") or (f.at_least("avx512") and f.avx512_bf16)
