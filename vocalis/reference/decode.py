"""The reference LLM decode loops of both model families: one request, the official order of work (prefill, then
one id per step with the module's own KV cache). The engine's batched decoding is checked against these.

Legend: D hidden, V speech rows (speech_token_size + 3 for CosyVoice 2, + 200 for CosyVoice 3).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator

import torch

from vocalis.config import SamplingConfig
from vocalis.models.cv3.speech_lm import CosyVoice3LM
from vocalis.models.qwen2 import KVCache
from vocalis.models.speech_lm import IdsLike, Qwen2LM
from vocalis.reference.sampling import SampleFn, make_sampler

log = logging.getLogger(__name__)


@torch.inference_mode()
def generate(
    lm: Qwen2LM | CosyVoice3LM,
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
    """Yield speech ids one by one (unistream, the official `Qwen2LM.inference` / `CosyVoice3LM.inference`).

    Stops at any stop id or after `max_len` ids; during the first `min_len` steps only the family's
    `min_len_mask_id` is masked (CosyVoice 2: eos; CosyVoice 3: sos, so any other extra id still ends). With
    `sampling.follow_phones` (a phone model) only labels that continue the text's phones are drawn
    (`vocalis.engine.label_path`).
    The bounds default to `length_bounds(len(text_ids))`. `sample_fn` replaces RAS (then `sampling` and
    `generator` are unused), e.g. `make_greedy_sampler(stop ids)` with min_len = max_len = N decodes
    exactly N ids.
    """
    default_min, default_max = lm.length_bounds(torch.as_tensor(text_ids).numel())
    min_len = default_min if min_len is None else min_len
    max_len = default_max if max_len is None else max_len
    choose = sample_fn or make_sampler(sampling or SamplingConfig(), generator)
    eos, stops, masked = lm.config.eos_token, frozenset(lm.config.stop_token_ids), lm.min_len_mask_id()
    path = None
    if sampling is not None and sampling.follow_phones and sample_fn is None:
        from vocalis.engine.label_path import LabelPath

        path = LabelPath(torch.as_tensor(text_ids).flatten().tolist(), eos, lm.config.num_speech_rows, min_len)
    lm_input = lm.prefill_embeddings(text_ids, prompt_text_ids, prompt_speech_ids)  # (1, L, D)
    cache: KVCache | None = None
    out: list[int] = []
    for i in range(max_len):
        logp, cache = lm.step(lm_input, cache)  # (1, V)
        if i < min_len:
            logp[0, masked] = float("-inf")
        if path is not None:
            logp[0, path.masked_ids(out)] = float("-inf")
        top = choose(logp[0], out)
        if top in stops:
            return
        yield top
        out.append(top)
        lm_input = lm.speech_embedding.weight[top].reshape(1, 1, -1)

@torch.inference_mode()
def generate_bistream(
    lm: Qwen2LM | CosyVoice3LM,
    text_pieces: Iterable[IdsLike],
    prompt_text_ids: IdsLike = (),
    prompt_speech_ids: IdsLike = (),
    sampling: SamplingConfig | None = None,
    generator: torch.Generator | None = None,
    *,
    max_len: int | None = None,
    sample_fn: SampleFn | None = None,
) -> Iterator[int]:
    """Text-in streaming (the official `inference_bistream`): yields speech ids while text pieces arrive.

    Text and speech are interleaved `mix_ratio` (5:15): the prompt speech is laid out in blocks of 5 text
    + 15 speech embeddings; afterwards each run of 15 generated speech ids ends in a fill id (forced by
    position, or sampled), after which the next 5 text embeddings are fed. Fill ids are never yielded.
    While text arrives every extra id but fill is masked (eos must wait for the end of the text; the official code
    raises on the others, masking them keeps a user's stream alive); once the pieces are exhausted, the rest of
    the text and the task id are fed and decoding runs to eos, every extra id but eos masked. `max_len` bounds
    the yielded ids (default: max_token_text_ratio x the non-prompt text tokens received); the official code has
    no bound there. The families differ in what follows sos before the text (`split_prompt_text`: CosyVoice 3's
    system part; see `reference.cv3`) and in where sos and the task id live (`sos_embedding`, `task_embedding`).
    """
    c = lm.config
    extra = list(range(c.speech_token_size, c.num_speech_rows))
    choose = sample_fn or make_sampler(sampling or SamplingConfig(), generator)
    system, transcript = c.split_prompt_text(torch.as_tensor(prompt_text_ids).reshape(-1).tolist())
    start = lm.sos_embedding()  # (1, T, D)
    if system:
        start = torch.cat((start, lm.embed_text(system)), dim=1)
    yield from bistream_loop(lm, start, transcript, prompt_speech_ids, text_pieces, choose,
                             masked_while_text=[i for i in extra if i != c.fill_token],
                             masked_after_text=[i for i in extra if i != c.eos_token],
                             task=lm.task_embedding(), max_len=max_len)


def bistream_loop(
    lm: Qwen2LM | CosyVoice3LM,
    start: torch.Tensor,
    transcript_ids: IdsLike,
    prompt_speech_ids: IdsLike,
    text_pieces: Iterable[IdsLike],
    choose: SampleFn,
    *,
    masked_while_text: list[int],
    masked_after_text: list[int],
    task: torch.Tensor,
    max_len: int | None,
) -> Iterator[int]:
    """The official `inference_bistream` loop (`generate_bistream`), from the start input `start` (1, T, D), with
    the task embedding `task` (1, 1, D) and the extra ids masked while text arrives and after the task id."""
    c = lm.config
    n_text, n_speech = c.mix_ratio
    fill, eos = c.fill_token, c.eos_token
    lm_input = start  # (1, T, D): embeddings to feed next (see final phase)
    text_cache = lm.embed_text(transcript_ids)  # (1, Nt, D) text not yet fed
    prompt_speech = lm.embed_speech(prompt_speech_ids)  # (1, P, D) prompt speech not yet fed
    num_prompt = prompt_speech.shape[1]
    next_fill_index = (num_prompt // n_speech + 1) * n_speech - num_prompt
    cache: KVCache | None = None
    out: list[int] = []  # generated ids, fill ids included (they count for the fill schedule)
    num_text = 0
    for piece in text_pieces:
        piece_emb = lm.embed_text(piece)
        num_text += piece_emb.shape[1]
        text_cache = torch.cat((text_cache, piece_emb), dim=1)
        while prompt_speech.shape[1] > 0 and text_cache.shape[1] >= n_text:
            lm_input = torch.cat((lm_input, text_cache[:, :n_text], prompt_speech[:, :n_speech]), dim=1)
            text_cache, prompt_speech = text_cache[:, n_text:], prompt_speech[:, n_speech:]
        if prompt_speech.shape[1] > 0:
            continue  # [wait] more text needed to lay out the prompt speech
        after_fill = bool(out) and out[-1] == fill
        if after_fill or (not out and num_prompt == 0):
            if text_cache.shape[1] < n_text:
                continue  # [wait] a fill (or the bare start) must be followed by a full text block
            block, text_cache = text_cache[:, :n_text], text_cache[:, n_text:]
            lm_input = block if after_fill else torch.cat((lm_input, block), dim=1)
        while True:
            logp, cache = lm.step(lm_input, cache)  # (1, V)
            if len(out) == next_fill_index:
                top = fill  # [forced] the block already holds n_speech speech ids
            else:
                logp[0, masked_while_text] = float("-inf")
                top = choose(logp[0], out)
            if top == fill:
                next_fill_index = len(out) + n_speech + 1
            out.append(top)
            if top == fill:
                break
            yield top
            lm_input = lm.speech_embedding.weight[top].reshape(1, 1, -1)

    # [official] `lm_input` is not cleared after a fill break, so the last speech embedding (already in the
    # cache) is fed once more here; remaining prompt speech (text ran out before it was laid out) is
    # dropped. Both match `inference_bistream` exactly.
    lm_input = torch.cat((lm_input, text_cache, task), dim=1)
    limit = lm.length_bounds(num_text)[1] if max_len is None else max_len
    num_yielded = sum(1 for t in out if t < c.speech_token_size)
    while num_yielded < limit:
        logp, cache = lm.step(lm_input, cache)
        logp[0, masked_after_text] = float("-inf")
        top = choose(logp[0], out)
        out.append(top)
        if top == eos:
            return
        yield top
        num_yielded += 1
        lm_input = lm.speech_embedding.weight[top].reshape(1, 1, -1)
    log.warning("bistream decoding stopped at %d speech tokens without eos", num_yielded)
