"""Shared fixtures: the official-layout compatibility folder and its recorded references."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

# kernels compile in the calling thread here (the default compiles them in the background while torch's ops run):
# a test of a native kernel must get it; the tests' subprocesses inherit this
os.environ.setdefault("VOCALIS_KERNEL_BUILD", "wait")

COMPAT_DIR = Path(__file__).resolve().parents[1].parent / "shared" / "reference" / "compat"
COMPAT_CV3_DIR = COMPAT_DIR.with_name("compat_cv3")  # the CosyVoice 3 fixture


@pytest.fixture(scope="session")
def compat_dir() -> Path:
    """`../shared/reference/compat`: skipped when absent on a developer machine, a failure in CI."""
    if not (COMPAT_DIR / "llm.pt").exists():
        if os.environ.get("CI") == "true":
            pytest.fail(f"compatibility fixture missing at {COMPAT_DIR}: broken CI set-up")
        pytest.skip(f"compatibility fixture missing at {COMPAT_DIR}")
    return COMPAT_DIR


@pytest.fixture(scope="session")
def compat_model(compat_dir: Path):  # -> vocalis.model_dir.LoadedModel
    """The compat folder loaded through the official-layout loader (strict by name), modules in eval mode.

    Shared by the parity tests: they must not modify the modules.
    """
    from vocalis.model_dir import load_official

    return load_official(compat_dir)


@pytest.fixture(scope="session")
def cv3_dir() -> Path:
    """`../shared/reference/compat_cv3`: skipped when absent on a developer machine, a failure in CI."""
    if not (COMPAT_CV3_DIR / "llm.pt").exists():
        if os.environ.get("CI") == "true":
            pytest.fail(f"CosyVoice 3 compatibility fixture missing at {COMPAT_CV3_DIR}: broken CI set-up")
        pytest.skip(f"CosyVoice 3 compatibility fixture missing at {COMPAT_CV3_DIR}")
    return COMPAT_CV3_DIR


@pytest.fixture(scope="session")
def cv3_model(cv3_dir: Path):  # -> vocalis.model_dir.LoadedModel of kind "cosyvoice3"
    """The CosyVoice 3 folder through `load_model` (strict by name), modules in eval mode; shared, do not modify."""
    from vocalis.model_dir import load_model

    return load_model(cv3_dir)


def load_reference(compat_dir: Path, name: str) -> dict[str, torch.Tensor]:
    """One recorded reference dict, e.g. `ref_llm`."""
    return torch.load(compat_dir / "reference" / f"{name}.pt", weights_only=True)


@pytest.fixture(autouse=True)
def _two_threads() -> None:
    torch.set_num_threads(2)


@pytest.fixture
def force_cpu_level(monkeypatch: pytest.MonkeyPatch):
    """`force_cpu_level("avx2")`: run the rest of the test as on a CPU of that level (`VOCALIS_CPU_ISA`), every
    kernel decision taken anew; restored afterwards."""
    from vocalis.precision import int8_linear

    def force(level: str) -> None:
        monkeypatch.setenv("VOCALIS_CPU_ISA", level)
        int8_linear.reset()

    yield force
    monkeypatch.delenv("VOCALIS_CPU_ISA", raising=False)
    int8_linear.reset()


@pytest.fixture(params=["own level", "avx2"])
def native_level(request, force_cpu_level) -> None:
    """Run the test twice: at this CPU's own level and at the AVX2 level (the other source set of the native
    extension where the CPU has more); skipped where the extension does not build (below AVX2, no compiler)."""
    from vocalis.kernels import build, cpu

    if not cpu.features().at_least("avx2"):
        pytest.skip("the native extension needs AVX2")
    if request.param == "avx2":
        force_cpu_level("avx2")
    if build.extension() is None:
        pytest.skip("the native extension is not built here (no compiler?)")
