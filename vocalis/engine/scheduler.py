"""Continuous batching: which requests compute how many positions this step. Pure Python, no tensors.

Each step spends a token budget: running requests first, in admission order (a decode costs 1, a partly
prefilled prompt continues with as much as the budget leaves: chunked prefill), then waiting requests are
admitted in arrival order while blocks, budget and the sequence limit allow. When a running request cannot
get a block, the most recently admitted running request is preempted (its blocks freed, its computed
positions forgotten; it goes back to the front of the queue and is recomputed later, partly from the prefix
cache). Abort removes a request wherever it is and frees its blocks at once.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from vocalis.engine.block_manager import BlockManager
from vocalis.engine.request import Request, RequestStatus

log = logging.getLogger(__name__)


@dataclass(slots=True)
class SchedulerOutput:
    """scheduled: (request, positions to compute this step) in batch order; sampled: the requests whose
    computed positions reach their last id this step, in batch order (they get a new id)."""

    scheduled: list[tuple[Request, int]] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)

    @property
    def sampled(self) -> list[Request]:
        return [r for r, n in self.scheduled if r.sample_at_end and r.num_computed_tokens + n == r.num_tokens]

    @property
    def empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 stop_ids: Iterable[int]) -> None:
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.stop_ids = frozenset(stop_ids)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    # ---- queue ----------------------------------------------------------------------------------------
    def add(self, request: Request) -> None:
        request.status = RequestStatus.WAITING
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def has_work(self) -> bool:
        """Whether a step would compute anything (a bi-stream waiting for text has nothing to compute)."""
        return bool(self.waiting) or any(r.num_tokens > r.num_computed_tokens for r in self.running)

    def abort(self, request_id: str, status: RequestStatus = RequestStatus.FINISHED_ABORTED) -> Request | None:
        """Remove the request and free its blocks now; None if it is not here (finished or unknown)."""
        for req in self.running:
            if req.request_id == request_id:
                self.running.remove(req)
                return self._finish(req, status)
        for req in self.waiting:
            if req.request_id == request_id:
                self.waiting.remove(req)
                return self._finish(req, status)
        return None

    def _finish(self, req: Request, status: RequestStatus) -> Request:
        req.status = status
        self.block_manager.free(req)
        return req

    def _preempt(self, req: Request) -> None:
        self.block_manager.free(req)
        req.status = RequestStatus.WAITING
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.waiting.appendleft(req)
        log.debug("preempted %s", req.request_id)

    # ---- policy -----------------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        bm = self.block_manager
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            if n == 0:  # a bi-stream waiting for text: nothing to compute, keeps its blocks
                i += 1
                continue
            while not bm.allocate_slots(req, n):
                victim = self.running.pop()  # [preempt] the latest admitted; never one scheduled above
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is req:
                    break
            else:
                out.scheduled.append((req, n))
                budget -= n
                i += 1
        if out.preempted:
            return out  # [no admit] admitting now would only preempt again
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            cached = bm.match_prefix(req)
            num_cached = len(cached) * bm.block_size
            n = min(req.num_tokens - num_cached, budget)
            if not bm.allocate_slots(req, n, cached):
                break  # [fifo] the head waits for blocks; later requests do not overtake it
            self.waiting.popleft()
            req.num_computed_tokens = req.num_cached_tokens = num_cached
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            out.scheduled.append((req, n))
            budget -= n
        return out

    def update(self, out: SchedulerOutput, sampled_ids: Sequence[int]) -> list[tuple[Request, int | None]]:
        """Record a computed step. `sampled_ids` aligns with `out.sampled` (computed before this call).
        Returns (request, new speech id, or None when it finished without one) for every request that got an
        id to pass on or finished; a bi-stream's fill ids are recorded but not passed on."""
        sampled = out.sampled
        if len(sampled) != len(sampled_ids):
            raise ValueError(f"{len(sampled)} requests sampled but {len(sampled_ids)} ids given")
        for req, n in out.scheduled:
            req.num_computed_tokens += n
            self.block_manager.cache_full_blocks(req)
        events: list[tuple[Request, int | None]] = []
        for req, tok in zip(sampled, sampled_ids):
            if req.bistream is not None:
                self._bistream_token(req, tok, events)
                continue
            if tok in self.stop_ids:
                self.running.remove(req)
                self._finish(req, RequestStatus.FINISHED_STOPPED)
                events.append((req, None))
                continue
            req.token_ids.append(tok)
            req.output_ids.append(tok)
            events.append((req, tok))
            if req.num_output_tokens >= req.params.max_len:
                self.running.remove(req)
                self._finish(req, RequestStatus.FINISHED_LENGTH)
                if req.params.min_len < req.params.max_len:  # not a forced count: the text's bound was reached
                    log.warning("request %s: stopped at its length bound of %d speech ids (no end of speech)",
                                req.request_id, req.params.max_len)
            elif req.cycle_watch is not None and (period := req.cycle_watch.push(req.output_ids)) is not None:
                self.running.remove(req)
                self._finish(req, RequestStatus.FINISHED_CYCLE)
                log.warning("request %s: stopped a runaway: its last %d speech ids repeat a cycle of %d",
                            req.request_id, req.cycle_watch.span, period)
        return events

    def _bistream_token(self, req: Request, tok: int, events: list[tuple[Request, int | None]]) -> None:
        bs = req.bistream
        assert bs is not None
        emit, feed, done = bs.accept(tok, req.num_output_tokens)
        req.output_ids.append(tok)
        if feed:
            req.token_ids.append(tok)
        elif not done:  # a fill: the next text block decides what is fed (it may have arrived already)
            req.sample_at_end = False
            self.feed_bistream(req)
        if emit:
            events.append((req, tok))
        if done or bs.over_limit:
            self.running.remove(req)
            status = RequestStatus.FINISHED_LENGTH if emit or bs.over_limit else RequestStatus.FINISHED_STOPPED
            self._finish(req, status)
            if not emit:
                events.append((req, None))

    def feed_bistream(self, req: Request) -> bool:
        """Let a waiting bi-stream take the text that arrived; True if it has input to compute again."""
        bs = req.bistream
        assert bs is not None
        ids = bs.advance(req.output_ids)
        if ids is None:
            return False
        req.token_ids.extend(ids)
        req.sample_at_end = True
        return True
