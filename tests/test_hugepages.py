"""`import vocalis` asks torch for transparent huge pages (THP_MEM_ALLOC_ENABLE=1) unless the caller said otherwise.

Each check runs in a fresh interpreter: torch reads the variable once, at its allocator's first use, and this test
process has long since imported torch.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

_THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")

# Prints the variable as torch saw it and the growth of AnonHugePages (kB) over one 64 MiB tensor, touched.
_PROBE = """
import os, re
import vocalis, torch
def anon_huge_kb():
    text = open("/proc/self/smaps_rollup").read()
    return int(re.search(r"AnonHugePages:\\s+(\\d+) kB", text).group(1))
before = anon_huge_kb()
t = torch.empty(64 << 20, dtype=torch.uint8)
t.fill_(1)
print(os.environ.get("THP_MEM_ALLOC_ENABLE"), anon_huge_kb() - before)
"""


def _run_probe(env_value: str | None) -> tuple[str, int]:
    env = {k: v for k, v in os.environ.items() if k != "THP_MEM_ALLOC_ENABLE"}
    if env_value is not None:
        env["THP_MEM_ALLOC_ENABLE"] = env_value
    out = subprocess.run([sys.executable, "-c", _PROBE], env=env, check=True, capture_output=True, text=True,
                         timeout=120).stdout.split()
    return out[0], int(out[1])


def _thp_mode() -> str | None:
    """The kernel's selected THP mode (`always`, `madvise`, `never`), None where the kernel has no THP."""
    if not _THP_MODE.exists() or not Path("/proc/self/smaps_rollup").exists():
        return None
    text = _THP_MODE.read_text()
    return text[text.index("[") + 1:text.index("]")]


def test_import_puts_torch_tensors_on_huge_pages() -> None:
    mode = _thp_mode()
    if mode not in ("always", "madvise"):
        pytest.skip(f"kernel THP mode is {mode!r}: no huge pages to ask for")
    value, grown_kb = _run_probe(None)
    assert value == "1"
    assert grown_kb > 0  # at least one 2 MiB huge page under the tensor


def test_callers_explicit_zero_wins() -> None:
    value, grown_kb = _run_probe("0")
    assert value == "0"
    if _thp_mode() == "madvise":  # with `always` the kernel gives huge pages whatever torch asks
        assert grown_kb == 0
