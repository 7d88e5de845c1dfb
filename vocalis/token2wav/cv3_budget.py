"""The CosyVoice 3 token2wav engine's cache budget (`Token2WavConfig.max_cache_mib`): what a call adds to a
stream's DiT caches, who recomputes when a step would go over, and, with `wait_for_cache`, whether a new stream
has room to start.

Over the budget by default the growing streams with the largest caches drop them and compute their later calls
from the voice prefix (the official cost, the same audio). With `wait_for_cache` a new stream instead waits for its
first cached call until the budget has room for that call and its next hop beside the caches held and every
started stream's next call (reserved, so that starting streams does not push the started ones into recomputing).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

from vocalis.token2wav.cv3_dit import cache_bytes_per_frame, cache_bytes_per_stream
from vocalis.token2wav.cv3_schedule import FlowCall
from vocalis.token2wav.voice_cache import voice_key

if TYPE_CHECKING:
    from vocalis.token2wav.cv3 import CV3StreamState, CV3Token2WavEngine

log = logging.getLogger(__name__)


@dataclass
class Room:
    """What one step's budget leaves for starting streams (computed on first need), and whether any stream holds
    or is about to hold caches."""

    free: int | None = None
    started: bool = False


class CV3CacheBudget:
    def __init__(self, engine: CV3Token2WavEngine) -> None:
        self.engine = engine

    def frame_bytes(self) -> int:
        """Cache bytes of one frame over every Euler step."""
        e = self.engine
        dtype = e.cache_dtype or e.flow.input_embedding.weight.dtype
        return cache_bytes_per_frame(e.flow.estimator, dtype) * e.n_timesteps

    def growth(self, s: CV3StreamState, call: FlowCall) -> int:
        """Bytes a non-final cached call adds to the stream's caches (its new frames; the position-conv tails
        on its first call)."""
        e = self.engine
        cached = s.dit[0].num_frames if s.dit else 0
        frames = (s.num_prompt_tokens + call.num_tokens - e.stream.pre_lookahead_len) * e.ratio
        tails = 0 if s.dit else cache_bytes_per_stream(e.flow.estimator) * e.n_timesteps
        return (frames - cached) * self.frame_bytes() + tails

    def enforce(self, items: list[tuple[CV3StreamState, FlowCall]]) -> None:
        """Make the requests with the largest caches recompute instead, until this step's growth fits."""
        if not items:
            return
        e = self.engine
        total = e.live_cache_bytes() + sum(self.growth(s, call) for s, call in items)
        for s, call in sorted(items, key=lambda sc: sc[0].cache_bytes(), reverse=True):
            if total <= e.cache_budget:
                return
            total -= self.growth(s, call) + s.cache_bytes()
            s.cached = False
            s.dit = []
            log.warning("token2wav cache budget (%d MiB) reached: request %s recomputes its calls from now on",
                        e.cache_budget // 2**20, s.request_id)

    def starts_cache(self, s: CV3StreamState, call: FlowCall) -> bool:
        """Whether this call would be the stream's first cached one and `wait_for_cache` may hold it."""
        e = self.engine
        return (e.config.wait_for_cache and not s.dit and s.chunks_done == 0 and not call.finalize
                and e._incremental(s, call))

    def take_room(self, s: CV3StreamState, call: FlowCall, room: Room) -> bool:
        """Reserve room for `s`'s first call and the hop after it; True if it starts now. `room` (one per step)
        keeps what the budget leaves after the caches held and every started stream's next call. A stream always
        starts when no other holds caches (then none that ends would make room for it)."""
        e = self.engine
        if room.free is None:
            started = [t for t in list(e._live) if t.dit and not t.finished]
            calls = [(t, e._next_call(t)[0]) for t in started]
            growing = sum(self.growth(t, c) for t, c in calls if c is not None and not c.finalize)
            room.free = e.cache_budget - e.live_cache_bytes() - growing
            room.started = bool(started)
        hop = min(e.stream.token_max_hop_len, s.schedule.hop * e.stream.stream_scale_factor)
        need = self.growth(s, FlowCall(call.num_tokens + hop, call.num_tokens, streaming=True, finalize=False))
        prefix = e.prefix_frames(s.num_prompt_tokens)
        if prefix and e.config.voice_cache_size and voice_key(s.prompt) not in e._voices:
            need += prefix * self.frame_bytes()  # its voice's prefix, computed with its first call
        if room.started and need > room.free:
            return False
        room.free -= need
        room.started = True
        return True
