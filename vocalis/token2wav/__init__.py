"""Streaming token2wav for many requests at once: speech tokens -> 24 kHz audio chunks, per model family.

`protocol` says what an engine and its streams are to the caller; `budget` (the cache-memory policy) and
`voice_cache` (the voice-prefix cache) are written once for every family; each family is a subpackage (`cv2`,
`cv3`) declaring a `Token2WavFamily`. A new family is one more subpackage and one more entry in `FAMILIES`.
"""

from __future__ import annotations

from vocalis.config import StreamConfig
from vocalis.errors import InputError
from vocalis.token2wav.config import Token2WavConfig
from vocalis.token2wav.cv2 import FAMILY as CV2
from vocalis.token2wav.cv3 import FAMILY as CV3
from vocalis.token2wav.protocol import Token2Wav, Token2WavChunk, Token2WavFamily, Token2WavStats, Token2WavStream

# Tried in order; CosyVoice 3's modules first.
FAMILIES: tuple[Token2WavFamily, ...] = (CV3, CV2)


def token2wav_for(flow: object, hift: object, config: Token2WavConfig | None = None,
                  stream: StreamConfig | None = None) -> Token2Wav[Token2WavStream]:
    """The batched token2wav engine of the model's family (by its flow and vocoder modules); InputError for
    modules no family runs, at load rather than at the first request."""
    for family in FAMILIES:
        if family.runs(flow, hift):
            return family.engine(flow, hift, config, stream)
    names = " and ".join(sorted(f.name for f in FAMILIES))
    raise InputError(f"the token2wav engine runs {names} flows and vocoders, not "
                     f"{type(flow).__name__} + {type(hift).__name__}")


__all__ = ["FAMILIES", "Token2Wav", "Token2WavChunk", "Token2WavConfig", "Token2WavFamily", "Token2WavStats",
           "Token2WavStream", "token2wav_for"]
