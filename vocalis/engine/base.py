"""`EngineFront`: what every LLM engine (ours, `LLMEngine`; vLLM's, `VLLMEngine`) offers its callers on top of its
own add_request / has_work / step: the model's sampling parameters, unistream requests in the engine's id space,
and running requests to completion."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence

import torch

from vocalis.config import SamplingConfig
from vocalis.engine.id_space import IdSpace
from vocalis.engine.label_path import LabelPath
from vocalis.engine.lm_family import SpeechLM
from vocalis.engine.request import Request, SamplingParams, TokenSink
from vocalis.errors import InputError


class EngineFront:
    """Base of the LLM engines; a subclass sets `llm` and `ids` and implements the three methods below."""

    llm: SpeechLM
    ids: IdSpace
    adapters: tuple[str, ...] = ()  # LoRA adapters a request may name (`LLMEngine` with an adapter bank)

    def add_request(self, request: Request) -> None:
        raise NotImplementedError

    def has_work(self) -> bool:
        raise NotImplementedError

    def step(self) -> list[tuple[Request, int | None]]:
        raise NotImplementedError

    def sampling_params(self, num_text_tokens: int, sampling: SamplingConfig | None = None,
                        seed: int | None = None, **overrides: object) -> SamplingParams:
        """The model's sampling settings (RAS) and length bounds for a text of that many tokens, with overrides."""
        s = sampling or SamplingConfig()
        min_len, max_len = self.llm.length_bounds(num_text_tokens)
        params = SamplingParams(temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, win_size=s.win_size,
                                tau_r=s.tau_r, min_len=min_len, max_len=max_len, seed=seed,
                                follow_phones=s.follow_phones, stop_cycle_span=s.stop_cycle_span)
        return dataclasses.replace(params, **overrides) if overrides else params  # type: ignore[arg-type]

    def make_request(self, text_ids: Sequence[int], prompt_text_ids: Sequence[int] = (),
                     prompt_speech_ids: Sequence[int] = (), params: SamplingParams | None = None, *,
                     request_id: str | None = None, sink: TokenSink | None = None,
                     generator: torch.Generator | None = None, adapter: str | None = None) -> Request:
        """A unistream request: [sos] + prompt text + text + [task] + prompt speech; default params from
        `sampling_params(len(text_ids))`. adapter: one of `adapters` (None: the base model)."""
        self.check_adapter(adapter)
        prompt = self.ids.prompt(text_ids, prompt_text_ids, prompt_speech_ids)
        params = params or self.sampling_params(len(text_ids))
        path = None
        if params.follow_phones:
            path = LabelPath(text_ids, self.llm.config.eos_token, self.ids.num_speech, params.min_len)
        return Request(prompt, params, request_id, sink, generator, label_path=path, adapter=adapter)

    def check_adapter(self, adapter: str | None) -> None:
        """InputError unless `adapter` is None or one this engine serves."""
        if adapter is not None and adapter not in self.adapters:
            raise InputError(f"unknown adapter {adapter!r} (loaded: {', '.join(self.adapters) or 'none'})")

    def generate(self, requests: Iterable[Request]) -> dict[str, list[int]]:
        """Run requests to completion (a convenience for tests and benchmarks) -> speech ids by request id."""
        reqs = list(requests)
        for r in reqs:
            self.add_request(r)
        while self.has_work():
            self.step()
        return {r.request_id: r.output_ids for r in reqs}
