"""Which of our native CPU kernels a precision backend may use. The environment's switches for them are read here
and nowhere else (`KernelConfig.with_env_overrides`)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, replace

# weight bytes each thread of the int8 kernel gets at least: smaller GEMMs run on the calling thread alone, as
# waking a pool thread costs more than it saves for the ~1 MB q/k/v and o projections (see `int8_linear`)
INT8_GRAIN_BYTES = 2 << 20


@dataclass(frozen=True, slots=True)
class KernelConfig:
    """Each kernel runs only where the CPU and the build allow it; turning one off keeps torch's ops instead.

    int8_kernel: the LLM's int8 Linear layers on our GEMV kernel (`int8_linear`); off, the int8 backend uses
        torch's dynamic quantization (fbgemm), and `auto` does not pick int8 for the kernel's sake.
    int8_grain_bytes: weight bytes each thread of that kernel gets at least (0: split every GEMV over all threads).
    bf16_gemm: whether the token2wav estimator's bf16 GEMMs and attention may run on our kernels (GEMMs: AMX,
        `kernels.bf16_gemm`; attention: AMX or AVX512-BF16, `kernels.bf16_attention`, and its fp32 attention on
        AVX2 CPUs, `kernels.fp32_attention`) rather than torch's oneDNN ops; `apply_backend` records it
        in `Runtime.kernels` for the token2wav engine built over the model.

    Environment overrides (`with_env_overrides`, applied by `backends.choice`): VOCALIS_INT8_KERNEL=0 and
    VOCALIS_BF16_GEMM=0 turn a kernel off; VOCALIS_INT8_GRAIN_BYTES=N sets the grain.
    """

    int8_kernel: bool = True
    int8_grain_bytes: int = INT8_GRAIN_BYTES
    bf16_gemm: bool = True

    def __post_init__(self) -> None:
        if self.int8_grain_bytes < 0:
            raise ValueError(f"int8_grain_bytes must be >= 0, got {self.int8_grain_bytes}")

    def with_env_overrides(self, environ: Mapping[str, str] | None = None) -> KernelConfig:
        """This config with the environment's switches (see the class doc) applied; `environ` stands in for
        `os.environ`. An unset variable leaves its field as it is."""
        env = os.environ if environ is None else environ
        grain = env.get("VOCALIS_INT8_GRAIN_BYTES")
        try:
            grain_bytes = self.int8_grain_bytes if grain is None else int(grain)
        except ValueError:
            raise ValueError(f"VOCALIS_INT8_GRAIN_BYTES={grain!r}: expected a byte count") from None
        return replace(self, int8_kernel=self.int8_kernel and env.get("VOCALIS_INT8_KERNEL", "1") != "0",
                       bf16_gemm=self.bf16_gemm and env.get("VOCALIS_BF16_GEMM", "1") != "0",
                       int8_grain_bytes=grain_bytes)
