"""CosyVoice 3 streaming token2wav, the per-request parts an engine and the reference share: the call schedule and
the silent-token filter (the official pipeline's, `CosyVoice3Model.tts` / `llm_job`).

- Schedule (shared with CosyVoice 2): the first chunk takes `token_hop_len` tokens plus the padding that rounds
  the prompt up to a multiple of the hop; later hops grow by `stream_scale_factor` up to `token_max_hop_len`. A
  chunk is made while at least hop + pre_lookahead_len tokens remain after the offset; it passes the tokens up to
  offset + hop + lookahead to the flow (streaming=True, finalize=False). The last call passes every token with
  streaming=False, finalize=True.
- Vocoder (CosyVoice 3's own; see `token2wav/cv3/engine.py` and `reference/cv3.py`): call k's flow mel is cut from frame
  token_mel_ratio * offset on and appended to all mel kept so far; the causal HiFT re-runs over that whole mel
  with the call's finalize flag, and the chunk is its output past the samples already yielded.
- Silence filter: from the (max_run + 1)-th consecutive silent LLM token on, tokens are dropped before token2wav
  (voice conversion's given tokens are not filtered, as officially).

Pure data and functions, so an engine can keep one schedule per request.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from vocalis.config import StreamConfig
from vocalis.config.cv3 import CV3_MAX_SILENT_RUN, CV3_SILENT_TOKEN_IDS


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

    def this_hop(self) -> int:
        """Tokens the next non-final chunk emits (the first one also pads the prompt to a whole hop)."""
        return self.hop + self.prompt_pad if self.token_offset == 0 else self.hop

    def tokens_needed(self, config: StreamConfig) -> int:
        """Utterance tokens the next non-final call needs (its hop plus the look-ahead)."""
        return self.token_offset + self.this_hop() + config.pre_lookahead_len

    def advance(
        self, num_tokens: int, llm_done: bool, config: StreamConfig
    ) -> tuple[FlowCall | None, StreamSchedule]:
        """With `num_tokens` tokens available (and `llm_done` once the LLM stopped): the call to make now, if any."""
        if self.finished:
            return None, self
        hop = self.this_hop()
        end = self.tokens_needed(config)
        if num_tokens >= end:
            call = FlowCall(end, self.token_offset, streaming=True, finalize=False)
            grown = config.grown_hop(self.hop)
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
