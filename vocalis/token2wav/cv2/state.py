"""One CosyVoice 2 request's token2wav progress (`StreamState`: its tokens, schedule and caches, owned by the
caller; a `protocol.Token2WavStream`)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from vocalis.frontend.prompt import FlowPrompt
from vocalis.token2wav.cv2.encoder import EncoderCache
from vocalis.token2wav.cv2.estimator_cache import EstimatorCache
from vocalis.token2wav.cv2.voice_prefix import VoicePrefix
from vocalis.token2wav.protocol import StreamInput


@dataclass(eq=False)
class StreamState(StreamInput):
    """One request's token2wav progress: tokens so far, schedule, flow caches, HiFT caches. The LLM's ids and
    voice conversion's alike are taken as they are (`StreamInput`)."""

    request_id: str
    prompt: FlowPrompt
    streaming: bool = True
    speed: float = 1.0
    generator: torch.Generator | None = None  # HiFT source noise; on the vocoder's device
    tokens: list[int] = field(default_factory=list)
    input_done: bool = False
    token_offset: int = 0  # generated tokens already emitted as audio
    hop: int = 25
    chunks_done: int = 0
    hops: list[int] = field(default_factory=list)
    finished: bool = False
    cached: bool = True  # False once the cache budget made it recompute its chunks
    estimator_frames: int = 0  # frames x Euler steps this request put through the estimator (cost counter)
    encoder_tokens: int = 0
    enc_cache: EncoderCache | None = None
    est_caches: list[EstimatorCache] = field(default_factory=list)
    voice: VoicePrefix | None = None  # the shared prompt prefix its caches continue (counts as a user of it)
    cache_mel: torch.Tensor | None = None  # (80, mel_cache_len)
    cache_source: torch.Tensor | None = None  # (1, 1, source_cache_len)
    cache_speech: torch.Tensor | None = None  # (source_cache_len,)

    def release(self) -> None:
        """Drop every cache (finish or abort) and the reference to the voice prefix."""
        self.drop_flow_caches()
        self.cache_mel = self.cache_source = self.cache_speech = None

    def drop_flow_caches(self) -> None:
        """Drop the flow caches and the voice prefix reference (the HiFT seam caches stay)."""
        self.voice = None
        self.enc_cache = None
        self.est_caches = []

    def cache_bytes(self) -> int:
        """Bytes of this request's own flow caches (the shared voice prefix not counted)."""
        n = self.enc_cache.nbytes() if self.enc_cache is not None else 0
        return n + sum(c.nbytes() for c in self.est_caches)
