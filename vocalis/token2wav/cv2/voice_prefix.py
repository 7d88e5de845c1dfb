"""CosyVoice 2's voice-prefix entry: a voice's first 25 * floor((P - 3) / 25) prompt tokens neither look ahead into
nor share an attention block with generated tokens, so their encoder and estimator caches are computed once per
voice (`voice_cache.VoiceCache`) and every request of that voice continues them read only (`EncoderCache.prefix`,
`EstimatorCache.prefix`), storing only its own frames."""

from __future__ import annotations

from dataclasses import dataclass

from vocalis.token2wav.cv2.encoder import EncoderCache
from vocalis.token2wav.cv2.estimator_cache import EstimatorCache


@dataclass(eq=False)
class VoicePrefix:
    """A voice's prompt-prefix caches: computed once, read only, shared by every request of the voice."""

    key: str
    num_tokens: int
    enc: EncoderCache
    est: list[EstimatorCache]  # one per Euler step

    def nbytes(self) -> int:
        return self.enc.nbytes() + sum(c.nbytes() for c in self.est)


def start_caches(voice: VoicePrefix | None) -> tuple[EncoderCache, list[EstimatorCache]]:
    """Fresh per-request caches: continuing a voice's shared prefix (nothing copied), or empty."""
    if voice is None:
        return EncoderCache(), []
    return EncoderCache.on_prefix(voice.enc), [EstimatorCache.on_prefix(c) for c in voice.est]
