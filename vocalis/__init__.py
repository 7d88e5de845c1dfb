"""Vocalis: fast, full-stack CosyVoice 2-compatible speech generation.

Public names are imported on first use, so `import vocalis` stays cheap.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__all__ = ["TTS", "AudioChunk", "Mode", "SynthesisRequest", "Voice", "ModelConfig", "VocalisError"]
__version__ = "0.1.0"

_WHERE = {
    "TTS": "vocalis.tts",
    "AudioChunk": "vocalis.frontend.request",
    "Mode": "vocalis.frontend.request",
    "SynthesisRequest": "vocalis.frontend.request",
    "Voice": "vocalis.frontend.voice",
    "ModelConfig": "vocalis.config",
    "VocalisError": "vocalis.errors",
}

if TYPE_CHECKING:
    from vocalis.config import ModelConfig
    from vocalis.errors import VocalisError
    from vocalis.frontend.request import AudioChunk, Mode, SynthesisRequest
    from vocalis.tts import TTS
    from vocalis.frontend.voice import Voice


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        import importlib

        return getattr(importlib.import_module(_WHERE[name]), name)
    raise AttributeError(f"module 'vocalis' has no attribute {name!r}")
