"""An LLM engine request: data only (ids, progress, blocks, sampling parameters, RNG, output sink).

Everything a request changes lives here, so the shared engine parts stay stateless per request. The
scheduler and block manager move it between states; the model runner reads its ids and block table; the
sampler reads its parameters and generator.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING

import torch

from vocalis.engine.runaway import CycleWatch
from vocalis.errors import InputError

if TYPE_CHECKING:
    from vocalis.engine.bistream import BistreamInput
    from vocalis.engine.label_path import LabelPath

log = logging.getLogger(__name__)
_ids = itertools.count()


class RequestStatus(Enum):
    WAITING = "waiting"  # not scheduled yet, or preempted (its KV dropped; recomputed when rescheduled)
    RUNNING = "running"
    FINISHED_STOPPED = "stopped"  # sampled a stop id (never appended)
    FINISHED_LENGTH = "length"  # reached max_len
    FINISHED_CYCLE = "cycle"  # its latest ids repeat a short cycle (params.stop_cycle_span; a degenerate loop)
    FINISHED_ABORTED = "aborted"

    @property
    def finished(self) -> bool:
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_CYCLE,
                        RequestStatus.FINISHED_ABORTED)


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """Per-request sampling. Defaults are the released model's RAS settings.

    greedy: arg-max instead of RAS (temperature and the RAS knobs are then unused).
    min_len / max_len: speech ids to produce at least / at most; eos is masked while fewer than min_len were
        produced (stop_all_masked: every stop id is, which with min_len = max_len forces an exact count).
    seed: seeds this request's own torch.Generator (None: a random seed); the draws use nothing else.
    follow_phones: a phone model's labels follow its text (`vocalis.engine.label_path`; whole-text requests).
    stop_cycle_span: stop (FINISHED_CYCLE) once this many latest ids repeat a cycle of at most
        `runaway.CYCLE_MAX_PERIOD` ids (0: never; whole-text requests).
    """

    temperature: float = 1.0
    top_p: float = 0.8
    top_k: int = 25
    win_size: int = 10
    tau_r: float = 0.1
    greedy: bool = False
    min_len: int = 0
    max_len: int = 2000
    seed: int | None = None
    stop_all_masked: bool = False
    follow_phones: bool = False
    stop_cycle_span: int = 0

    def __post_init__(self) -> None:
        if not self.greedy and self.temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature}")
        if self.top_k < 1 or not 0 < self.top_p <= 1:
            raise ValueError(f"need top_k >= 1 and 0 < top_p <= 1, got {self.top_k}, {self.top_p}")
        if self.min_len < 0 or self.max_len < 0:
            raise ValueError(f"min_len and max_len must be >= 0, got {self.min_len}, {self.max_len}")
        if self.stop_cycle_span < 0:
            raise ValueError(f"stop_cycle_span must be >= 0, got {self.stop_cycle_span}")


# Called by the engine for each new speech id (token None: finished without one), and once with finished=True.
TokenSink = Callable[["Request", int | None, bool], None]


class Request:
    """One sequence the LLM extends. `token_ids`: every id fed, in order (engine ids, see `IdSpace`): the prompt,
    then each generated speech id (with bi-streaming also the text blocks fed between them).
    `output_ids`: the ids sampled so far (bi-streaming: fill ids included, as the repetition window sees them).

    num_computed_tokens counts positions whose K/V sit in the cache; the last generated id is fed (and so
    computed) on the next step. block_table lists the KV blocks covering positions 0.. in order.
    sample_at_end: computing the last fed position yields an id (False while a bi-stream waits for text).
    adapter: the LoRA adapter this request runs with (None: the base model), by name; adapter_index is its row in
    the engine's adapter bank (-1: none), set when the engine accepts the request.
    """

    __slots__ = ("adapter", "adapter_index", "arrival_time", "bistream", "block_hashes", "block_table", "cycle_watch", "generator", "label_path",
                 "num_cached_tokens", "num_computed_tokens", "num_preemptions", "num_prompt_tokens", "output_ids",
                 "params", "request_id", "sample_at_end", "sink", "status", "token_ids")

    def __init__(self, prompt_ids: Sequence[int], params: SamplingParams | None = None,
                 request_id: str | None = None, sink: TokenSink | None = None,
                 generator: torch.Generator | None = None, bistream: BistreamInput | None = None,
                 label_path: LabelPath | None = None, adapter: str | None = None) -> None:
        if not prompt_ids and bistream is None:
            raise ValueError("a request needs at least one prompt id")
        self.request_id = request_id if request_id is not None else f"req-{next(_ids)}"
        self.token_ids: list[int] = list(prompt_ids)
        self.output_ids: list[int] = []
        self.num_prompt_tokens = len(self.token_ids)
        self.bistream = bistream
        self.label_path = label_path  # labels that follow the text (params.follow_phones), this request's own
        self.sample_at_end = bistream is None
        self.params = params or SamplingParams()
        span = self.params.stop_cycle_span
        self.cycle_watch = CycleWatch(span) if span and bistream is None else None
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # positions taken from the prefix cache at (last) admission
        self.block_table: list[int] = []
        self.block_hashes: list[int] = []  # chained hashes of this request's full blocks, in order
        self.generator = generator
        self.sink = sink
        self.arrival_time = time.monotonic()
        self.num_preemptions = 0
        self.adapter = adapter
        self.adapter_index = -1

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_ids)

    @property
    def finished(self) -> bool:
        return self.status.finished

    def make_generator(self, device: torch.device) -> torch.Generator:
        """The request's RNG (created from params.seed on first use)."""
        if self.generator is None:
            gen = torch.Generator(device=device)
            if self.params.seed is None:
                gen.seed()
            else:
                gen.manual_seed(self.params.seed)
            self.generator = gen
        return self.generator

    def finish(self, status: RequestStatus, token: int | None = None) -> None:
        """End the request with `status`; its sink hears the last event (token, or None without one)."""
        self.status = status
        if self.sink is not None:
            self.sink(self, token, True)

    def __repr__(self) -> str:
        return (f"Request({self.request_id}, {self.status.value}, prompt={self.num_prompt_tokens}, "
                f"out={self.num_output_tokens}, computed={self.num_computed_tokens}, blocks={len(self.block_table)})")


def fit_to_model_len(request: Request, max_model_len: int) -> bool:
    """Admission rule of every LLM engine: a prompt must leave room to generate; max_len (and min_len) are clamped
    to the positions left. False when nothing may be generated: the request is then finished and its sink told."""
    room = max_model_len - request.num_tokens
    if room < 1:
        raise InputError(f"the prompt has {request.num_tokens} positions; the engine holds at most "
                         f"{max_model_len} per request (text too long?)")
    if request.params.max_len > room:
        log.warning("request %s: max_len %d clamped to %d (max_model_len %d)", request.request_id,
                    request.params.max_len, room, max_model_len)
        request.params = dataclasses.replace(request.params, max_len=room, min_len=min(request.params.min_len, room))
    if request.params.max_len == 0:
        request.finish(RequestStatus.FINISHED_LENGTH)
        return False
    return True

