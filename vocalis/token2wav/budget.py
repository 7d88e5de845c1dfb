"""The token2wav cache budget (`Token2WavConfig.max_cache_mib`), one policy for every family: who recomputes when a
step would go over, and, with `wait_for_cache`, which new streams start their caches in a step.

Over the budget by default the growing streams with the largest caches drop them and compute their later chunks
from the voice prefix (the reference path's cost, the same audio). With `wait_for_cache` a new stream instead
waits for its first cached chunk until the budget has room for that chunk and its next hop beside the caches held
and every started stream's next chunk (reserved, so that starting streams does not push the started ones into
recomputing); first come, first served. The byte counts are the family's (`protocol.Budgeted`).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Generic, TypeVar

from vocalis.token2wav.protocol import Budgeted, S, Token2WavStats
from vocalis.token2wav.voice_cache import VoiceCache

log = logging.getLogger(__name__)

E = TypeVar("E")  # a family's voice-prefix entry
P = TypeVar("P")  # what the engine plans for a stream in a step (its kind of chunk, its flow call)


class BudgetCounters:
    """The counters the budget policy reports to, in one place for every family's engine (a base class: the
    engine sets `held` and `stats` up in its constructor)."""

    held: int  # streams waiting for cache room after the last step
    stats: Token2WavStats

    def record_held(self, waiting: int) -> None:
        """`waiting` streams wait for cache room after this step (`CacheBudget.admit`)."""
        self.held = waiting
        self.stats.held_steps += waiting

    def record_cache_fallback(self) -> None:
        """A stream dropped its caches to keep the step within the budget (`CacheBudget.enforce`)."""
        self.stats.cache_fallbacks += 1


class CacheOwner(BudgetCounters, Generic[S, E]):
    """Every family's engine: a request's flow caches go as soon as no chunk will read them, i.e. once its input
    has ended and its next chunk is a final full pass (`Token2WavConfig.final_attention`), and the chunk before
    that pass keeps nothing (`ends_with_full_pass`, the family's schedule)."""

    _voices: VoiceCache[E]  # the family's voice prefixes

    def ends_with_full_pass(self, s: S, after_this_chunk: bool = False) -> bool:
        """Whether the input has ended and the next chunk (after the one about to run, if `after_this_chunk`) is
        a final full pass, which reads no cache."""
        raise NotImplementedError

    def drop_unread(self, states: Iterable[S]) -> None:
        """Drop the flow caches of the requests whose next chunk reads none."""
        for s in states:
            # the schedule's arithmetic first: counting a stream's cache bytes walks its ~1,000 tensors
            if self.ends_with_full_pass(s) and (s.voice is not None or s.cache_bytes()):
                self.drop_caches(s)

    def drop_caches(self, s: S) -> None:
        """Drop its flow caches and its use of the voice prefix."""
        voice = s.voice
        s.drop_flow_caches()
        self._voices.released(voice)

    def release(self, s: S) -> None:
        """Drop every cache of a request that ended (finished or aborted)."""
        self.drop_caches(s)
        s.release()


class CacheBudget(Generic[S]):
    def __init__(self, engine: Budgeted[S]) -> None:
        self.engine = engine

    def enforce(self, growing: list[S]) -> None:
        """Make the streams with the largest caches recompute instead, until this step's growth fits; `growing`:
        the step's streams whose chunk extends their caches."""
        if not growing:
            return
        e = self.engine
        total = e.live_cache_bytes() + sum(e.next_growth(s) for s in growing)
        for s in sorted(growing, key=lambda s: s.cache_bytes(), reverse=True):
            if total <= e.cache_budget:
                return
            total -= e.next_growth(s) + s.cache_bytes()
            s.cached = False
            s.drop_flow_caches()
            e.record_cache_fallback()
            log.warning("token2wav cache budget (%d MiB) reached: request %s recomputes its chunks from now on",
                        e.cache_budget // 2**20, s.request_id)

    def admit(self, ready: Iterable[tuple[S, P]], max_batch: int, hold_new: bool) -> list[tuple[S, P]]:
        """The step's work among `ready` (streams with a chunk ready and the engine's plan for it, in order):
        at most `max_batch`; a stream starting its caches goes only while `Room` has room for it, and once one
        waits, later new streams wait behind it. With nothing else to do in the step the first waiting stream
        starts anyway, unless `hold_new`: the caller has other work that goes on (LLM steps) and will call again.
        Records how many wait (`record_held`)."""
        e = self.engine
        work: list[tuple[S, P]] = []
        held: list[tuple[S, P]] = []
        room = Room(e)
        for s, plan in ready:
            if e.starts_cache(s) and (held or not room.take(s)):
                held.append((s, plan))
                continue
            work.append((s, plan))
            if len(work) == max_batch:
                break
        if held and not work and not hold_new:
            work.append(held.pop(0))
        e.record_held(len(held))
        return work


class Room(Generic[S]):
    """What the cache budget leaves for streams starting their caches in one step: the budget minus the caches
    held and every started stream's next chunk. Computed on first use."""

    def __init__(self, engine: Budgeted[S]) -> None:
        self.engine = engine
        self.free: int | None = None
        self.started = False

    def take(self, s: S) -> bool:
        """Reserve room for `s`'s first chunk; True if it starts now. A stream always starts when no other
        stream holds caches (then none that ends would make room for it)."""
        e = self.engine
        if self.free is None:
            started = e.started_streams()
            self.started = bool(started)
            self.free = e.cache_budget - e.live_cache_bytes() - sum(e.next_growth(t) for t in started)
        need = e.start_need(s)
        if self.started and need > self.free:
            return False
        self.free -= need
        self.started = True
        return True
