"""The CosyVoice 3 reference path: one request at a time, the official order of work. The engine's batched LLM
decoding and its batched streaming token2wav (`token2wav/cv3/`) are checked against these.

- `generate`: `CosyVoice3LM.inference` (unistream), the one loop both families share (`reference.decode`): before
  min_len only sos (row V) is masked, as officially, so any other extra id still ends decoding; every id >= V
  stops.
- `generate_bistream`: text arriving in pieces, the official `inference_bistream` as it runs for `CosyVoice3LM`
  (the loop both families share, `reference.decode`): sos and task id are rows V and V + 2 of `speech_embedding`,
  the fill id is V + 3; the prompt text up to `<|endofprompt|>` (the system part) is fed right after sos and the
  rest of it (a transcript) is laid out with the prompt speech in blocks of 5 text + 15 speech. Two differences
  from the released loop, both for a stream that would otherwise go wrong: with no prompt speech the first 5 text
  ids are fed before decoding, as after sos alone in CosyVoice 2 and as in training (sos, system, 5 text,
  15 speech, ...; the released test for that start never holds once the system part is fed, so it would decode
  15 ids before any text); and where the released loop raises on an extra id other than fill (eos once the text
  ended), that id is masked instead, which keeps a user's stream alive.
- `VocoderStream` / `stream_token2wav`: the official streaming token2wav (schedule in `token2wav/cv3/schedule.py`):
  every call re-runs the flow over prompt + tokens so far and the causal HiFT over all mel kept so far.

Legend: L prefill rows, D hidden, V = speech_token_size + 200, Tt tokens, N samples.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from vocalis.config import StreamConfig
from vocalis.models.cv3.flow import CausalMaskedDiffWithDiT
from vocalis.models.cv3.hift import CausalHiFTGenerator
from vocalis.reference.decode import generate, generate_bistream
from vocalis.token2wav.cv3.schedule import FlowCall, schedule_calls

__all__ = ["VocoderStream", "generate", "generate_bistream", "stream_token2wav"]


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
    streaming: bool = True,
) -> Iterator[torch.Tensor]:
    """All `tokens` (1, Tt) known up front -> audio chunks (1, N_k), the official schedule; streaming=False: the
    one-shot path (one call, full attention, finalize)."""
    vocoder = VocoderStream(hift, flow.config.token_mel_ratio)
    prompt_len = torch.tensor([prompt_token.shape[1]])
    calls = (schedule_calls(prompt_token.shape[1], tokens.shape[1], config) if streaming
             else [FlowCall(tokens.shape[1], 0, streaming=False, finalize=True)])
    for call in calls:
        mel = flow.inference(
            tokens[:, : call.num_tokens], torch.tensor([call.num_tokens]), prompt_token, prompt_len,
            prompt_feat, torch.tensor([prompt_feat.shape[1]]), embedding, streaming=call.streaming,
            finalize=call.finalize,
        )
        yield vocoder.push(mel, call)
