"""One request's token2wav progress (`StreamState`: its tokens, schedule and caches, owned by the caller)
and the audio a step gives it back (`Token2WavChunk`)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np
import torch

from vocalis.frontend.prompt import FlowPrompt
from vocalis.token2wav.encoder import EncoderCache
from vocalis.token2wav.estimator_cache import EstimatorCache
from vocalis.token2wav.voice_cache import VoicePrefix


@dataclass(eq=False)
class StreamState:
    """One request's token2wav progress: tokens so far, schedule, flow caches, HiFT caches."""

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

    def add_tokens(self, ids: Iterable[int]) -> None:
        if self.input_done:
            raise RuntimeError(f"request {self.request_id}: tokens added after end_input()")
        self.tokens.extend(int(i) for i in ids)

    def add_source_tokens(self, ids: Iterable[int]) -> None:
        """Given ids (voice conversion): as `add_tokens` here (CosyVoice 3's state filters LLM ids, not these)."""
        self.add_tokens(ids)

    def end_input(self) -> None:
        self.input_done = True

    @property
    def num_prompt_tokens(self) -> int:
        return int(self.prompt.speech_ids.shape[1])

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


@dataclass(frozen=True)
class Token2WavChunk:
    """Audio for one request from one step: samples (N,) float32 at 24 kHz; final = the request is done."""

    request_id: str
    samples: np.ndarray
    final: bool
    index: int

