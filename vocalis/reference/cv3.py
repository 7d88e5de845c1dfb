"""The CosyVoice 3 reference path: one request at a time, the official order of work. The engine's batched LLM
decoding and its batched streaming token2wav (`token2wav/cv3.py`) are checked against these.

- `generate`: `CosyVoice3LM.inference` (unistream): prefill, then one id per step with the module's own KV cache;
  before min_len only sos (row V) is masked, as officially, so any other extra id still ends decoding; every
  id >= V stops.
- `generate_bistream`: text arriving in pieces, the official `inference_bistream` as it runs for `CosyVoice3LM`
  (5:15 text:speech blocks, fill ids, the system part fed right after sos; see the function for two deliberate
  differences).
- `VocoderStream` / `stream_token2wav`: the official streaming token2wav (schedule in `token2wav/cv3_schedule`):
  every call re-runs the flow over prompt + tokens so far and the causal HiFT over all mel kept so far.

Legend: L prefill rows, D hidden, V = speech_token_size + 200, Tt tokens, N samples.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator

import torch

from vocalis.config import SamplingConfig, StreamConfig
from vocalis.errors import InputError
from vocalis.models.cv3.flow import CausalMaskedDiffWithDiT
from vocalis.models.cv3.hift import CausalHiFTGenerator
from vocalis.models.cv3.speech_lm import CosyVoice3LM, IdsLike
from vocalis.models.qwen2 import KVCache
from vocalis.reference.decode import bistream_loop
from vocalis.reference.sampling import SampleFn, make_sampler
from vocalis.token2wav.cv3_schedule import FlowCall, schedule_calls

log = logging.getLogger(__name__)


@torch.inference_mode()
def generate(
    lm: CosyVoice3LM,
    text_ids: IdsLike,
    prompt_text_ids: IdsLike = (),
    prompt_speech_ids: IdsLike = (),
    sampling: SamplingConfig | None = None,
    generator: torch.Generator | None = None,
    *,
    min_len: int | None = None,
    max_len: int | None = None,
    sample_fn: SampleFn | None = None,
) -> Iterator[int]:
    """Yield speech ids one by one. Bounds default to `lm.length_bounds(len(text_ids))`; `sample_fn` replaces
    RAS (then `sampling` and `generator` are unused)."""
    n_text = torch.as_tensor(text_ids).reshape(-1).shape[0]
    default_min, default_max = lm.length_bounds(n_text)
    min_len = default_min if min_len is None else min_len
    max_len = default_max if max_len is None else max_len
    choose = sample_fn or make_sampler(sampling or SamplingConfig(), generator)
    masked, stops = lm.min_len_mask_id(), frozenset(lm.config.stop_token_ids)
    x = lm.prefill_embeddings(text_ids, prompt_text_ids, prompt_speech_ids)  # (1, L, D)
    cache: KVCache | None = None
    out: list[int] = []
    for i in range(max_len):
        logp, cache = lm.step(x, cache)  # (1, V)
        if i < min_len:
            logp[0, masked] = float("-inf")
        top = choose(logp[0], out)
        if top in stops:
            return
        yield top
        out.append(top)
        x = lm.speech_embedding.weight[top].reshape(1, 1, -1)


def split_system(lm: CosyVoice3LM, prompt_text_ids: IdsLike) -> tuple[list[int], list[int]]:
    """Prompt text ids -> (system part up to and including `<|endofprompt|>`, the rest: a transcript or nothing).
    InputError when the marker is missing (the official loop asserts it)."""
    ids = torch.as_tensor(prompt_text_ids).reshape(-1).tolist()
    eop = lm.config.endofprompt_id
    if eop not in ids:
        raise InputError("CosyVoice 3 bi-streaming needs <|endofprompt|> in the prompt text (the system part)")
    k = ids.index(eop) + 1
    return ids[:k], ids[k:]


@torch.inference_mode()
def generate_bistream(
    lm: CosyVoice3LM,
    text_pieces: Iterable[IdsLike],
    prompt_text_ids: IdsLike = (),
    prompt_speech_ids: IdsLike = (),
    sampling: SamplingConfig | None = None,
    generator: torch.Generator | None = None,
    *,
    max_len: int | None = None,
    sample_fn: SampleFn | None = None,
) -> Iterator[int]:
    """Text-in streaming: yields speech ids while text pieces arrive (fill ids are never yielded).

    The official `Qwen2LM.inference_bistream` for `CosyVoice3LM`: sos and task id are rows V and V + 2 of
    `speech_embedding`, the fill id is V + 3; the prompt text up to `<|endofprompt|>` is fed right after sos and
    the rest of it (a transcript) is laid out with the prompt speech in blocks of 5 text + 15 speech; then each
    run of 15 generated ids ends in a fill (forced by position, or sampled), after which the next 5 text ids are
    fed; when the pieces end, the rest of the text and the task id are fed and decoding runs to eos.

    Two differences from the released loop, both for a stream that would otherwise go wrong:
    - with no prompt speech the first 5 text ids are fed before decoding, as after sos alone in CosyVoice 2 and
      as in training (sos, system, 5 text, 15 speech, ...); the released test for that start (`lm_input` is only
      sos) never holds once the system part is fed, so it would decode 15 ids before any text;
    - where the released loop raises on an extra id other than fill (eos once the text ended), that id is
      masked instead, which keeps a user's stream alive (as `reference.decode.generate_bistream` does).
    `max_len` bounds the ids after the text ended (default: max_token_text_ratio x the text ids received).
    """
    c = lm.config
    extra = list(range(c.speech_token_size, c.num_speech_rows))
    choose = sample_fn or make_sampler(sampling or SamplingConfig(), generator)
    system, transcript = split_system(lm, prompt_text_ids)
    start = torch.cat((lm.embed_speech([c.sos_token]), lm.embed_text(system)), dim=1)  # (1, T, D)
    yield from bistream_loop(lm, start, transcript, prompt_speech_ids, text_pieces, choose,
                             masked_while_text=[i for i in extra if i != c.fill_token],
                             masked_after_text=[i for i in extra if i != c.eos_token],
                             task=lm.embed_speech([c.task_id_token]), max_len=max_len)


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
