"""How the native extension arrives: loaded from torch's extension cache when compiled, compiled by a detached
process while torch's ops run when not (the default), and never on a machine without a compiler, each path logged."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from vocalis.kernels import build, cpu, fp32_pointwise


@pytest.fixture
def background(monkeypatch: pytest.MonkeyPatch):
    """The user's default (compile in the background); every decision taken anew, and again afterwards."""
    if build.isa() is None:
        pytest.skip("this CPU has no native kernel level")
    monkeypatch.setenv(build.BUILD_ENV, "background")
    build.reset()
    yield monkeypatch
    build.reset()


@pytest.fixture
def compiled(background) -> Path:
    """The set compiled (here, if not yet) into torch's cache; then every decision taken anew, in the background."""
    background.setenv(build.BUILD_ENV, "wait")
    if build.extension() is None:
        pytest.skip(f"the native extension does not build here ({build.unavailable_reason()})")
    library = build.library(build.isa())
    build.reset()
    background.setenv(build.BUILD_ENV, "background")
    return library


def test_without_a_compiler_torch_runs_and_the_log_says_why(background, tmp_path: Path, caplog) -> None:
    background.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))  # an empty cache: nothing compiled
    background.setenv("CXX", str(tmp_path / "no-such-c++"))
    with caplog.at_level(logging.INFO, logger="vocalis.kernels.build"):
        assert build.extension() is None
    assert "no C++ compiler" in build.unavailable_reason()
    assert "native kernels unavailable: no C++ compiler" in caplog.text
    assert not any(tmp_path.rglob("*.so")) and not any(tmp_path.rglob("build.log"))  # no build was started


def test_a_failing_background_build_is_reported_and_torch_keeps_running(background, tmp_path: Path, caplog) -> None:
    background.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    background.setenv("CXX", "false")  # a compiler that fails at once: the real detached builder, a quick failure
    with caplog.at_level(logging.INFO, logger="vocalis.kernels.build"):
        assert build.extension() is None  # the first call does not wait
        assert build.unavailable_reason() == "compiling in the background"
        assert "compiling in the background" in caplog.text
        lib = build.library(build.isa())
        for _ in range(600):  # the builder imports torch, then the compile fails
            if build.unavailable_reason() != "compiling in the background":
                break
            build._next_poll = 0.0
            subprocess.run([sys.executable, "-c", "import time; time.sleep(0.1)"], check=True)
    assert build.extension() is None and "the background build failed" in build.unavailable_reason()
    assert "the background build failed" in caplog.text and (lib.parent / "build.log").stat().st_size > 0


def test_a_compiled_set_loads_from_the_cache_with_no_compiler_called(background, compiled: Path) -> None:
    background.setenv("CXX", "false")  # were anything compiled, it would fail
    ext = build.extension()
    assert ext is not None and ext.__file__ == str(compiled) and ext.isa == build.isa()
    x = torch.randn(2, 8, 30)  # a per-call kernel runs on it: LayerNorm over channels + Mish
    norm = torch.nn.LayerNorm(8)
    assert fp32_pointwise.supports(x)
    ref = torch.nn.functional.mish(norm(x.transpose(1, 2))).transpose(1, 2)
    torch.testing.assert_close(fp32_pointwise.norm_mish(x, norm), ref, atol=1e-5, rtol=1e-5)


def test_ahead_of_time_build_command(tmp_path: Path) -> None:
    env = {**os.environ, "CXX": "false", "TORCH_EXTENSIONS_DIR": str(tmp_path)}
    done = subprocess.run([sys.executable, "-m", "vocalis.kernels.build", "--isa", "nope"], env=env, check=False,
                          capture_output=True, text=True)
    assert done.returncode == 2 and "invalid choice: 'nope'" in done.stderr
    if cpu.features().at_least("avx2"):  # the real compile, with a compiler that fails: a non-zero exit, no library
        done = subprocess.run([sys.executable, "-m", "vocalis.kernels.build", "--isa", "avx2"], env=env, check=False,
                              capture_output=True, text=True)
        assert done.returncode != 0 and not any(tmp_path.rglob("*.so"))


def test_a_stale_build_lock_is_removed_and_a_live_one_kept(tmp_path: Path, caplog) -> None:
    """A builder killed mid-build leaves load_inline's lock; every later build would wait on it for ever."""
    lock = tmp_path / "lock"
    lock.touch()
    build._clear_stale_lock(lock)
    assert lock.exists()  # a build may be running: left alone
    old = lock.stat().st_mtime - build._STALE_LOCK_S - 60
    os.utime(lock, (old, old))
    with caplog.at_level(logging.WARNING, logger="vocalis.kernels.build"):
        build._clear_stale_lock(lock)
    assert not lock.exists() and "stale native-kernel build lock" in caplog.text
    build._clear_stale_lock(lock)  # none there: nothing to do


def test_a_build_another_process_runs_is_waited_for_not_repeated(background, compiled: Path,
                                                                 tmp_path: Path) -> None:
    background.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    background.setenv("CXX", "false")  # a builder of ours would fail: the test sees whether one ran
    lib = build.library(build.isa())
    lib.parent.mkdir(parents=True, exist_ok=True)
    (lib.parent / "lock").touch()  # another process's builder is at work
    assert build.extension() is None and build.unavailable_reason() == "compiling in the background"
    assert not (lib.parent / "build.log").exists()  # no second builder
    lib.write_bytes(compiled.read_bytes())  # the other build ends: its library, then its lock gone
    build._next_poll = 0.0
    assert build.extension() is None  # still locked
    (lib.parent / "lock").unlink()
    build._next_poll = 0.0
    ext = build.extension()  # (this process has the same module loaded already: it is the one returned)
    assert ext is not None and ext.isa == build.isa() and build.unavailable_reason() is None
