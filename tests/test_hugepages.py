"""`huge_pages.to_huge_pages` moves long-lived tensors onto 2 MiB pages in place, values and addresses unchanged;
the engine applies it to the decoder's weights and KV cache unless `EngineConfig.huge_pages` is off
(VOCALIS_HUGE_PAGES=0)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from vocalis.kernels import huge_pages
from vocalis.kernels.huge_pages import HUGE_PAGE, to_huge_pages

_THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _thp_mode() -> str | None:
    if not _THP_MODE.exists() or not Path("/proc/self/smaps").exists():
        return None
    text = _THP_MODE.read_text()
    return text[text.index("[") + 1:text.index("]")]


needs_thp = pytest.mark.skipif(_thp_mode() not in ("always", "madvise"), reason="no transparent huge pages here")


def _huge_kb_at(address: int) -> int:
    """AnonHugePages (kB) of the mapping that holds `address`."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = re.match(r"^([0-9a-f]+)-([0-9a-f]+) ", line)
        if head:
            inside = int(head.group(1), 16) <= address < int(head.group(2), 16)
        elif inside and line.startswith("AnonHugePages:"):
            return int(line.split()[1])
    raise AssertionError(f"no mapping holds {address:#x}")


@needs_thp
@pytest.mark.parametrize("mib", [6, 24])
def test_tensor_moves_onto_huge_pages_in_place(mib: int) -> None:
    t = torch.randn(mib << 18)  # mib MiB of fp32
    expected = t.clone()
    ptr = t.data_ptr()
    moved = to_huge_pages([t, t[10:]])  # a view of the same storage is collapsed once
    assert moved >= HUGE_PAGE
    assert moved <= (mib << 20) + 2 * HUGE_PAGE
    assert t.data_ptr() == ptr
    assert torch.equal(t, expected)
    assert _huge_kb_at(ptr + (mib << 19)) >= HUGE_PAGE >> 10


@pytest.mark.parametrize(("field", "env", "moved"), [(True, None, True), (False, None, False), (True, "0", False)])
def test_engine_moves_its_tensors_only_when_asked(field: bool, env: str | None, moved: bool,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """`EngineConfig.huge_pages` (or VOCALIS_HUGE_PAGES=0 over it) decides whether the engine hands its decoder
    weights and KV cache to `to_huge_pages` at all."""
    from vocalis.config import PRESETS
    from vocalis.engine import model_runner
    from vocalis.engine.config import EngineConfig
    from vocalis.engine.llm_engine import LLMEngine
    from vocalis.models.speech_lm import Qwen2LM

    handed: list[torch.Tensor] = []
    monkeypatch.setattr(model_runner, "to_huge_pages", lambda tensors: handed.extend(tensors) or 0)
    if env is None:
        monkeypatch.delenv("VOCALIS_HUGE_PAGES", raising=False)
    else:
        monkeypatch.setenv("VOCALIS_HUGE_PAGES", env)
    lm = Qwen2LM(PRESETS["tiny"].llm).eval().requires_grad_(False)
    engine = LLMEngine(lm, EngineConfig(num_kv_blocks=8, huge_pages=field))
    assert engine.config.huge_pages is moved
    assert any(t is engine.runner.k_cache for t in handed) is moved


def test_ranges_merge_frames() -> None:
    a = torch.empty(3 << 20, dtype=torch.uint8)
    ranges = huge_pages._ranges([a, a[5:], torch.empty(0)])
    assert len(ranges) == 1
    start, end = ranges[0]
    assert start % HUGE_PAGE == 0 and end % HUGE_PAGE == 0
    assert start <= a.data_ptr() and a.data_ptr() + a.numel() <= end


@needs_thp
def test_engine_kv_cache_faults_in_on_huge_pages(monkeypatch: pytest.MonkeyPatch) -> None:
    """The KV cache is untouched when the engine is built (nothing to collapse): it is marked so its first use
    faults in huge pages."""
    from vocalis.config import PRESETS
    from vocalis.engine.config import EngineConfig
    from vocalis.engine.llm_engine import LLMEngine
    from vocalis.models.speech_lm import Qwen2LM

    monkeypatch.setenv("VOCALIS_HUGE_PAGES", "1")
    torch.manual_seed(0)
    lm = Qwen2LM(PRESETS["tiny"].llm).eval().requires_grad_(False)
    engine = LLMEngine(lm, EngineConfig(block_size=16, num_kv_blocks=4096))
    cache = engine.runner.k_cache
    assert cache.nbytes >= 8 * HUGE_PAGE
    cache.fill_(1.0)  # first touch, after the engine was built
    assert _huge_kb_at(cache.data_ptr() + cache.nbytes // 2) >= HUGE_PAGE >> 10
