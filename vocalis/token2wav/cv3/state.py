"""One CosyVoice 3 request's token2wav progress (`CV3StreamState`, a `protocol.Token2WavStream`): its tokens
(after the official silent-token filter), call schedule, DiT caches and the vocoder's mel so far."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from vocalis.frontend.prompt import FlowPrompt
from vocalis.token2wav.cv3.dit import DiTCache
from vocalis.token2wav.cv3.schedule import StreamSchedule, keep_token
from vocalis.token2wav.protocol import StreamInput


@dataclass(eq=False)
class CV3StreamState(StreamInput):
    """One request's CosyVoice 3 token2wav progress: its tokens, schedule and the vocoder's mel so far. Voice
    conversion's given ids are taken unfiltered, as officially (`StreamInput.add_source_tokens`)."""

    request_id: str
    prompt: FlowPrompt
    schedule: StreamSchedule
    streaming: bool = True
    speed: float = 1.0
    tokens: list[int] = field(default_factory=list)
    input_done: bool = False
    chunks_done: int = 0
    finished: bool = False
    silent_run: int = 0  # consecutive silent LLM ids so far (the filter's state)
    mel: torch.Tensor | None = None  # (C, T_kept) the vocoder input so far
    num_yielded: int = 0  # samples already emitted
    estimator_frames: int = 0  # frames x Euler steps put through the estimator (cost counter)
    vocoder_frames: int = 0  # mel frames put through the HiFT decoder (cost counter)
    dit: list[DiTCache] = field(default_factory=list)  # per Euler step, after its streaming calls so far
    cached: bool = True  # False once the cache budget made it recompute its calls
    voice: list[DiTCache] | None = None  # the voice prefix its caches continue (counts as a user of it)

    def add_tokens(self, ids: Iterable[int]) -> None:
        """LLM ids: the official silent-token filter drops a silent id from the 6th in a row on."""
        self.check_open()
        for t in ids:
            keep, self.silent_run = keep_token(int(t), self.silent_run)
            if keep:
                self.tokens.append(int(t))

    def release(self) -> None:
        self.mel = None
        self.drop_flow_caches()

    def drop_flow_caches(self) -> None:
        self.voice = None
        self.dit = []

    def cache_bytes(self) -> int:
        return sum(c.nbytes() for c in self.dit)
