"""Vocalis: fast, full-stack CosyVoice 2-compatible speech generation.

Public names are imported on first use, so `import vocalis` stays cheap.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

# Put torch's large CPU allocations (the engine's weights above all) on transparent huge pages. Batch-1 decode
# streams every weight once per token, and on 4 KiB pages it reads measurably slower than on huge pages (TLB misses;
# see README, "bench"). torch reads THP_MEM_ALLOC_ENABLE once, when its CPU allocator is first used, so this must run
# before any torch tensor exists: every Vocalis entry point (the CLI, `python -m vocalis.*`, the server) imports this
# package before torch. If the caller imported torch and allocated first, the setting cannot apply in that process.
# setdefault: a caller's explicit THP_MEM_ALLOC_ENABLE=0 wins. It only asks (madvise); with the kernel's THP mode
# `never` nothing changes. Costs ~+130 MiB peak RSS (huge-page rounding), measured with the bench.
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

__all__ = ["TTS", "AudioChunk", "Mode", "SynthesisRequest", "Voice", "ModelConfig", "VocalisError"]
__version__ = "0.1.0"

_WHERE = {
    "TTS": "vocalis.tts",
    "AudioChunk": "vocalis.inference.request",
    "Mode": "vocalis.inference.request",
    "SynthesisRequest": "vocalis.inference.request",
    "Voice": "vocalis.voice",
    "ModelConfig": "vocalis.config",
    "VocalisError": "vocalis.errors",
}

if TYPE_CHECKING:
    from vocalis.config import ModelConfig
    from vocalis.errors import VocalisError
    from vocalis.inference.request import AudioChunk, Mode, SynthesisRequest
    from vocalis.tts import TTS
    from vocalis.voice import Voice


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        import importlib

        return getattr(importlib.import_module(_WHERE[name]), name)
    raise AttributeError(f"module 'vocalis' has no attribute {name!r}")
