"""What a model family's token2wav engine is to its caller, whatever its flow and vocoder.

The caller (the runtime's engine loop) owns one stream per request: it creates it with `new_stream`, appends the
LLM's ids (`add_tokens`; voice conversion's given ids: `add_source_tokens`), calls `end_input`, and calls
`step(streams)`, which runs one batched pass over every stream with a chunk ready and returns those chunks.
`next_work` and `tokens_short` say when a stream will have one. A family (`token2wav/cv2`, `token2wav/cv3`)
implements `Token2Wav` over its own stream type, and declares itself with a `Token2WavFamily` entry, which the
package face (`vocalis.token2wav.token2wav_for`) picks by the model's flow and vocoder modules.

What the families share is written once beside this: the cache-memory policy (`budget.CacheBudget`, over the
public methods of `Budgeted`) and the voice-prefix cache (`voice_cache.VoiceCache`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol, TypeVar

import numpy as np
import torch

from vocalis.config import StreamConfig
from vocalis.frontend.prompt import FlowPrompt
from vocalis.token2wav.config import Token2WavConfig

Work = Literal["chunk", "final"]


class Token2WavStream(Protocol):
    """One request's token2wav progress (caller-owned; the engine keeps no per-request data of its own)."""

    request_id: str
    prompt: FlowPrompt
    streaming: bool
    speed: float
    tokens: list[int]
    input_done: bool
    chunks_done: int
    finished: bool
    cached: bool  # False once the cache budget made it recompute its chunks
    voice: object | None  # the shared voice prefix its caches continue (counts as a user of it)
    estimator_frames: int  # frames x Euler steps put through the flow estimator (cost counter)

    def add_tokens(self, ids: Iterable[int]) -> None: ...

    def add_source_tokens(self, ids: Iterable[int]) -> None: ...

    def end_input(self) -> None: ...

    @property
    def num_prompt_tokens(self) -> int: ...

    def release(self) -> None:
        """Drop every cache (finish or abort) and the reference to the voice prefix."""

    def drop_flow_caches(self) -> None:
        """Drop the flow caches and the voice-prefix reference: later chunks recompute."""

    def cache_bytes(self) -> int:
        """Bytes of its own flow caches (a shared voice prefix not counted)."""


S = TypeVar("S", bound=Token2WavStream)


class StreamInput:
    """The input side every family's stream state shares (a base of the families' dataclasses): given ids
    (voice conversion's, `add_source_tokens`) are taken as they are; the LLM's (`add_tokens`) are the family's."""

    request_id: str
    prompt: FlowPrompt
    tokens: list[int]
    input_done: bool

    def add_tokens(self, ids: Iterable[int]) -> None:
        self.add_source_tokens(ids)

    def add_source_tokens(self, ids: Iterable[int]) -> None:
        self.check_open()
        self.tokens.extend(int(i) for i in ids)

    def check_open(self) -> None:
        if self.input_done:
            raise RuntimeError(f"request {self.request_id}: tokens added after end_input()")

    def end_input(self) -> None:
        self.input_done = True

    @property
    def num_prompt_tokens(self) -> int:
        return int(self.prompt.speech_ids.shape[1])


@dataclass(frozen=True)
class Token2WavChunk:
    """Audio for one request from one step: samples (N,) float32 at 24 kHz; final = the request is done."""

    request_id: str
    samples: np.ndarray
    final: bool
    index: int


@dataclass
class Token2WavStats:
    steps: int = 0
    rows: int = 0
    estimator_frames: int = 0  # frames x Euler steps, all requests, voice prefixes included
    voice_cache_hits: int = 0
    voice_cache_misses: int = 0
    cache_fallbacks: int = 0  # requests that dropped their caches to stay within max_cache_mib
    held_steps: int = 0  # steps a ready stream waited for cache room before its first chunk (summed over streams)


class Budgeted(Protocol[S]):
    """What the cache budget policy reads of an engine (public methods; the family decides the byte counts)."""

    config: Token2WavConfig
    cache_budget: int  # bytes; 0: nothing is cached
    stats: Token2WavStats
    held: int  # streams waiting for cache room after the last step

    def live_cache_bytes(self) -> int:
        """Bytes of every live stream's own caches and the voice prefixes held, each once."""

    def started_streams(self) -> list[S]:
        """Live streams holding caches of their own."""

    def next_growth(self, state: S) -> int:
        """Bytes its next (non-final, cached) chunk adds to its caches; 0 when that chunk keeps nothing."""

    def start_need(self, state: S) -> int:
        """Bytes a stream about to store its first caches needs: its first chunk, the hop after it (reserved as
        for the started streams), and its voice's prefix when that is not held yet."""

    def starts_cache(self, state: S) -> bool:
        """Its next chunk would be the first to store caches, and `wait_for_cache` may hold it."""

    def record_held(self, waiting: int) -> None:
        """`waiting` streams wait for cache room after this step (sets `held`, counts `stats.held_steps`)."""

    def record_cache_fallback(self) -> None:
        """A stream dropped its caches to stay within the budget (counts `stats.cache_fallbacks`)."""


class Token2Wav(Budgeted[S], Protocol[S]):
    """A family's batched, cached token2wav engine over its shared flow and vocoder modules."""

    stream: StreamConfig

    def new_stream(self, request_id: str, prompt: FlowPrompt, *, streaming: bool = True, speed: float = 1.0,
                   generator: torch.Generator | None = None) -> S: ...

    def next_work(self, state: S) -> Work | None:
        """"chunk" (a non-final streaming chunk is ready), "final", or None (waiting for tokens)."""

    def tokens_short(self, state: S) -> int:
        """Tokens a streaming request still needs for its next non-final chunk; <= 0 when it is ready."""

    def step(self, states: Sequence[S], *, hold_new: bool = False) -> list[Token2WavChunk]:
        """One batched pass over every state with work (at most `max_batch`); their chunks, in order."""

    def abort(self, state: S) -> None: ...


@dataclass(frozen=True)
class Token2WavFamily:
    """A model family's token2wav: the flow and vocoder module types it runs, and its engine's constructor."""

    name: str
    flow: type[torch.nn.Module]
    hift: type[torch.nn.Module]
    engine: Callable[..., Token2Wav[Token2WavStream]]  # (flow, hift, config, stream)

    def runs(self, flow: object, hift: object) -> bool:
        return isinstance(flow, self.flow) and isinstance(hift, self.hift)
