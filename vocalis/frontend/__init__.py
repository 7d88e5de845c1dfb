"""Frontend: text normalisation, text tokenizer, audio loading/features, speech tokenizer, speaker encoder.

Public names are imported on first use, so importing one submodule does not load the others' dependencies.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

_WHERE = {
    "NormalizedText": "vocalis.frontend.text",
    "normalize_text": "vocalis.frontend.text",
    "normalize": "vocalis.frontend.text",
    "split_paragraph": "vocalis.frontend.text",
    "detect_language": "vocalis.frontend.text",
    "check_text_length": "vocalis.frontend.text",
    "TextTokenizer": "vocalis.frontend.tokenizer",
    "load_wav": "vocalis.frontend.audio",
    "check_wav": "vocalis.frontend.audio",
    "whisper_log_mel": "vocalis.frontend.audio",
    "kaldi_fbank": "vocalis.frontend.audio",
    "mel_spectrogram": "vocalis.frontend.audio",
    "prompt_mel": "vocalis.frontend.audio",
    "align_prompt": "vocalis.frontend.audio",
    "SpeechTokenizer": "vocalis.frontend.speech_tokenizer",
    "OnnxSpeechTokenizer": "vocalis.frontend.speech_tokenizer",
    "SpeakerEncoder": "vocalis.frontend.speaker",
    "CampplusSpeakerEncoder": "vocalis.frontend.speaker",
}
__all__ = list(_WHERE)

if TYPE_CHECKING:
    from vocalis.frontend.audio import (
        align_prompt,
        check_wav,
        kaldi_fbank,
        load_wav,
        mel_spectrogram,
        prompt_mel,
        whisper_log_mel,
    )
    from vocalis.frontend.speaker import CampplusSpeakerEncoder, SpeakerEncoder
    from vocalis.frontend.speech_tokenizer import OnnxSpeechTokenizer, SpeechTokenizer
    from vocalis.frontend.text import (
        NormalizedText,
        check_text_length,
        detect_language,
        normalize,
        normalize_text,
        split_paragraph,
    )
    from vocalis.frontend.tokenizer import TextTokenizer


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        import importlib

        return getattr(importlib.import_module(_WHERE[name]), name)
    raise AttributeError(f"module 'vocalis.frontend' has no attribute {name!r}")
