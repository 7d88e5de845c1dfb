"""Vocalis: fast, full-stack CosyVoice 2-compatible speech generation.

Public names are imported on first use, so `import vocalis` stays cheap.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

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
