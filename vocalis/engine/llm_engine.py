"""The LLM engine: add_request / step / abort over the scheduler, block manager, model runner and sampler.

One `step()` schedules a batch (decodes and prefill chunks of many requests), runs one forward pass, samples
one speech id for each request that reached its last position, and records the result. Single-threaded: the
owner (e.g. `AsyncEngine`'s loop thread) calls every method.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence

import torch

from vocalis.adapters.batched import banked_adapters
from vocalis.engine.base import EngineFront
from vocalis.engine.bistream import BistreamInput
from vocalis.engine.block_manager import BlockManager
from vocalis.engine.config import EngineConfig
from vocalis.engine.lm_family import SpeechLM, family_of
from vocalis.engine.model_runner import ModelRunner, kv_bytes_per_block
from vocalis.engine.packed_weights import pack_llm
from vocalis.engine.request import Request, RequestStatus, SamplingParams, TokenSink, fit_to_model_len
from vocalis.engine.sampler import Sampler
from vocalis.engine.scheduler import Scheduler
from vocalis.errors import InputError

log = logging.getLogger(__name__)


class LLMEngine(EngineFront):
    def __init__(self, llm: SpeechLM, config: EngineConfig | None = None) -> None:
        self.config = cfg = (config or EngineConfig()).with_env_overrides()
        self.llm = llm
        self.family = family_of(llm)  # InputError here, at load, for a module the engine cannot drive
        self.ids = self.family.ids
        self.bank = banked_adapters(llm)
        if self.bank is not None:  # per-request LoRA: packed GEMMs plus each row's update, no captured graphs
            cfg = self.config = dataclasses.replace(cfg, cuda_graphs=False)
            self.adapters = tuple(self.bank.names)
        # fused q/k/v and gate/up GEMMs on every device: fewer, wider GEMMs (and, on a GPU, fewer kernels per step)
        packed = pack_llm(llm) if cfg.pack_weights else None
        num_blocks = cfg.num_kv_blocks or self._blocks_for_budget()
        self.max_model_len = min(cfg.max_model_len, llm.config.qwen.max_position_embeddings,
                                 num_blocks * cfg.block_size)
        self.runner = ModelRunner(llm, num_blocks, cfg.block_size, self.max_model_len, packed, cfg.cuda_graphs,
                                  cfg.fused_decode, cfg.huge_pages, cfg.reserve_kv_cache, self.bank)
        self.block_manager = BlockManager(num_blocks, cfg.block_size, cfg.enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, cfg.max_num_seqs, cfg.max_num_batched_tokens,
                                   self.family.stop_ids)
        self.sampler = Sampler(self.family.min_len_mask_id, self.family.stop_ids)
        self._requests: dict[str, Request] = {}
        self._idle: dict[str, Request] = {}  # bi-streams that have not had input to compute yet

    def _blocks_for_budget(self) -> int:
        cfg = self.config
        per_block = kv_bytes_per_block(self.llm, cfg.block_size)
        by_budget = cfg.kv_cache_bytes // per_block
        # no point holding more than every sequence at full length
        by_use = cfg.max_num_seqs * -(-cfg.max_model_len // cfg.block_size)
        num = int(min(by_budget, by_use))
        if num < 1:
            raise ValueError(f"kv_cache_bytes={cfg.kv_cache_bytes} holds no {per_block}-byte KV block")
        return num

    # ---- requests -----------------------------------------------------------------------------------
    def make_bistream_request(self, prompt_text_ids: Sequence[int] = (), prompt_speech_ids: Sequence[int] = (),
                              params: SamplingParams | None = None, *, max_len: int | None = None,
                              request_id: str | None = None, sink: TokenSink | None = None,
                              generator: torch.Generator | None = None, adapter: str | None = None) -> Request:
        """A request whose text arrives later in pieces (`add_text`, `end_text`); see `bistream.py`.
        max_len bounds the speech ids after the text ended (default: max_token_text_ratio x text ids)."""
        self.check_adapter(adapter)
        if not self.family.bistream:
            raise InputError(f"text in pieces (bi-streaming) is not available for {self.family.name} models yet; "
                             "send the whole text")
        params = params or self.sampling_params(0)
        state = BistreamInput(self.llm.config, prompt_text_ids, prompt_speech_ids, max_len)
        return Request([], params, request_id, sink, generator, bistream=state, adapter=adapter)

    def add_text(self, request_id: str, text_ids: Sequence[int]) -> None:
        """One more piece of a bi-stream's text (Qwen text ids)."""
        req = self._bistream(request_id)
        if req is not None:
            assert req.bistream is not None
            req.bistream.push(text_ids)
            self._feed(req)

    def end_text(self, request_id: str) -> None:
        """A bi-stream's text is complete: it decodes to eos after the rest of its text."""
        req = self._bistream(request_id)
        if req is not None:
            assert req.bistream is not None
            req.bistream.end()
            self._feed(req)

    def _bistream(self, request_id: str) -> Request | None:
        req = self._requests.get(request_id)
        if req is None:
            return None  # finished or aborted meanwhile: late text is dropped
        if req.bistream is None:
            raise ValueError(f"request {request_id!r} is not a bi-stream")
        return req

    def _feed(self, req: Request) -> None:
        if req.sample_at_end or not self.scheduler.feed_bistream(req):
            return  # decoding (the text is taken at its next fill), or still waiting for more text
        assert req.bistream is not None
        if req.bistream.over_limit or req.num_tokens > self.max_model_len:
            if req.num_tokens > self.max_model_len:
                log.warning("bi-stream %s reached max_model_len %d", req.request_id, self.max_model_len)
            self._drop(req.request_id, RequestStatus.FINISHED_LENGTH)
        elif self._idle.pop(req.request_id, None) is not None:
            self.scheduler.add(req)

    def add_request(self, request: Request) -> None:
        if request.request_id in self._requests:
            raise ValueError(f"request id {request.request_id!r} is already running")
        self.check_adapter(request.adapter)
        request.adapter_index = self.bank.index(request.adapter) if self.bank is not None else -1
        if request.bistream is not None:
            self._requests[request.request_id] = request
            self._idle[request.request_id] = request
            self._feed(request)
            return
        if not fit_to_model_len(request, self.max_model_len):
            return
        self._requests[request.request_id] = request
        self.scheduler.add(request)

    def abort(self, request_id: str) -> bool:
        """Stop a request now and free its KV blocks; False if it is not running here."""
        return self._drop(request_id, RequestStatus.FINISHED_ABORTED)

    def _drop(self, request_id: str, status: RequestStatus) -> bool:
        req = self.scheduler.abort(request_id, status) or self._idle.pop(request_id, None)
        self._requests.pop(request_id, None)
        if req is None:
            return False
        req.finish(status)
        return True

    def has_unfinished(self) -> bool:
        """Requests not finished, including bi-streams waiting for text."""
        return bool(self._requests)

    def has_work(self) -> bool:
        """Whether `step()` would compute anything now."""
        return self.scheduler.has_work()

    @property
    def num_unfinished(self) -> int:
        return len(self._requests)

    # ---- stepping ----------------------------------------------------------------------------------
    def step(self) -> list[tuple[Request, int | None]]:
        """One batched forward pass. Returns (request, new speech id or None if it stopped) per sampled
        request; each request's sink hears the same, with finished=True on its last call."""
        out = self.scheduler.schedule()
        if out.empty:
            return []
        sampled = out.sampled
        logp = self.runner.execute(out.scheduled)  # (R, V)
        new_ids = self.sampler(logp, sampled) if sampled else []
        events = self.scheduler.update(out, new_ids)
        for req, tok in events:
            if req.finished:
                self._requests.pop(req.request_id, None)
            if req.sink is not None:
                req.sink(req, tok, req.finished)
        for req in sampled:  # a bi-stream's length is not known in advance: stop where positions run out
            if req.bistream is not None and not req.finished and req.num_tokens > self.max_model_len:
                log.warning("bi-stream %s reached max_model_len %d", req.request_id, self.max_model_len)
                self._drop(req.request_id, RequestStatus.FINISHED_LENGTH)
        return events

