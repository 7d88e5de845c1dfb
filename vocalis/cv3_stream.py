"""CosyVoice 3 streaming token2wav, as the official pipeline does it: the schedule, the silence filter, the vocoder.

- Schedule (shared with CosyVoice 2): the first chunk takes `token_hop_len` tokens plus the padding that rounds
  the prompt up to a multiple of the hop; later hops grow by `stream_scale_factor` up to `token_max_hop_len`. A
  chunk is made while at least hop + pre_lookahead_len tokens remain after the offset; it passes the tokens up to
  offset + hop + lookahead to the flow (streaming=True, finalize=False). The last call passes every token with
  streaming=False, finalize=True.
- Vocoder (CosyVoice 3's own): call k's flow mel is cut from frame token_mel_ratio * offset on and appended to
  all mel kept so far; the causal HiFT re-runs over that whole mel with the call's finalize flag, and the chunk is
  its output past the samples already yielded. No source cache, no cross-fade.
- Silence filter: from the (max_run + 1)-th consecutive silent token on, tokens are dropped before token2wav.

Everything here is per-request state in small objects or pure functions, so an engine can drive many requests.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, replace

import torch

from vocalis.config import CV3_MAX_SILENT_RUN, CV3_SILENT_TOKEN_IDS, StreamConfig
from vocalis.models.cv3.flow import CausalMaskedDiffWithDiT
from vocalis.models.cv3.hift import CausalHiFTGenerator


@dataclass(frozen=True, slots=True)
class FlowCall:
    """One flow + vocoder call: the first `num_tokens` utterance tokens (the prompt goes in front)."""

    num_tokens: int
    token_offset: int  # the call's mel is kept from frame token_mel_ratio * token_offset on
    streaming: bool
    finalize: bool


@dataclass(frozen=True, slots=True)
class StreamSchedule:
    """Where one request's stream stands; `advance` returns the next call and the new schedule."""

    prompt_pad: int
    hop: int
    token_offset: int = 0
    finished: bool = False

    @classmethod
    def start(cls, num_prompt_tokens: int, config: StreamConfig) -> StreamSchedule:
        hop = config.token_hop_len
        return cls(prompt_pad=math.ceil(num_prompt_tokens / hop) * hop - num_prompt_tokens, hop=hop)

    def advance(
        self, num_tokens: int, llm_done: bool, config: StreamConfig
    ) -> tuple[FlowCall | None, StreamSchedule]:
        """With `num_tokens` tokens available (and `llm_done` once the LLM stopped): the call to make now, if any."""
        if self.finished:
            return None, self
        hop = self.hop + self.prompt_pad if self.token_offset == 0 else self.hop
        end = self.token_offset + hop + config.pre_lookahead_len
        if num_tokens >= end:
            call = FlowCall(end, self.token_offset, streaming=True, finalize=False)
            grown = min(config.token_max_hop_len, self.hop * config.stream_scale_factor)
            return call, replace(self, hop=grown, token_offset=self.token_offset + hop)
        if llm_done:
            return FlowCall(num_tokens, self.token_offset, streaming=False, finalize=True), replace(self, finished=True)
        return None, self


def schedule_calls(num_prompt_tokens: int, num_tokens: int, config: StreamConfig) -> list[FlowCall]:
    """Every call for an utterance whose `num_tokens` tokens are all known (e.g. voice conversion)."""
    calls, schedule = [], StreamSchedule.start(num_prompt_tokens, config)
    while True:
        call, schedule = schedule.advance(num_tokens, True, config)
        if call is None:
            return calls
        calls.append(call)


def keep_token(token: int, silent_run: int, max_run: int = CV3_MAX_SILENT_RUN,
               silent_ids: tuple[int, ...] = CV3_SILENT_TOKEN_IDS) -> tuple[bool, int]:
    """(keep this LLM token?, the new count of consecutive silent tokens)."""
    if token in silent_ids:
        return silent_run + 1 <= max_run, silent_run + 1
    return True, 0


class VocoderStream:
    """One request's vocoder side: the mel kept so far and the samples already yielded."""

    def __init__(self, hift: CausalHiFTGenerator, token_mel_ratio: int) -> None:
        self.hift = hift
        self.token_mel_ratio = token_mel_ratio
        self.mel: torch.Tensor | None = None  # (1, 80, T_kept)
        self.num_yielded = 0

    def push(self, flow_mel: torch.Tensor, call: FlowCall) -> torch.Tensor:
        """Flow output of `call` (1, 80, T) (prompt removed) -> the new audio (1, N_new)."""
        new = flow_mel[:, :, call.token_offset * self.token_mel_ratio :]
        self.mel = new if self.mel is None else torch.cat((self.mel, new), dim=2)
        speech, _ = self.hift.inference(self.mel, finalize=call.finalize)  # (1, N) from the utterance start
        chunk = speech[:, self.num_yielded :]
        self.num_yielded += chunk.shape[1]
        return chunk


def stream_token2wav(
    flow: CausalMaskedDiffWithDiT,
    hift: CausalHiFTGenerator,
    tokens: torch.Tensor,
    prompt_token: torch.Tensor,
    prompt_feat: torch.Tensor,
    embedding: torch.Tensor,
    config: StreamConfig,
) -> Iterator[torch.Tensor]:
    """Batch-1 reference: all `tokens` (1, Tt) known up front -> audio chunks (1, N_k), the official schedule."""
    vocoder = VocoderStream(hift, flow.config.token_mel_ratio)
    prompt_len = torch.tensor([prompt_token.shape[1]])
    for call in schedule_calls(prompt_token.shape[1], tokens.shape[1], config):
        mel = flow.inference(
            tokens[:, : call.num_tokens], torch.tensor([call.num_tokens]), prompt_token, prompt_len,
            prompt_feat, torch.tensor([prompt_feat.shape[1]]), embedding, streaming=call.streaming,
            finalize=call.finalize,
        )
        yield vocoder.push(mel, call)
