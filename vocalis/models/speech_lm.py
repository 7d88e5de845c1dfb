"""CosyVoice 2 text-speech language model (`Qwen2LM`): Qwen2 body + speech embedding + speech head.

Id spaces: text ids index Qwen's own `embed_tokens`; speech ids index `speech_embedding` (speech_token_size
codes, then eos, an unused stop id, and the bistream fill id); `llm_embedding` rows are sos (0) and task id (1).
The head `llm_decoder` scores the speech_token_size + 3 speech ids.

Prefill layout (unistream): [sos] + text(prompt_text + text) + [task_id] + speech(prompt_speech).

Inference is stateless on the module: the KV cache, decoded ids and the RNG live in the generator's locals or
in objects the caller passes in. Training lives in `speech_lm_train.py`.

Legend: B batch, T positions, D hidden, V = speech_token_size + 3.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator, Sequence

import torch
from torch import nn

from vocalis.config import QwenConfig, SamplingConfig, SpeechLMConfig
from vocalis.errors import ModelLoadError
from vocalis.models.qwen2 import KVCache, Qwen2Model
from vocalis.sampling import SampleFn, make_sampler

logger = logging.getLogger(__name__)

SOS_ROW = 0  # llm_embedding row that starts every sequence
TASK_ID_ROW = 1  # llm_embedding row between the text and the speech
_QWEN_PREFIX = "llm.model.model."
_LM_HEAD_KEY = "llm.model.lm_head.weight"

IdsLike = Sequence[int] | torch.Tensor


class Qwen2CausalLMBody(nn.Module):
    """Stands where HF `Qwen2ForCausalLM` stands in the official module tree, minus the text lm_head."""

    def __init__(self, config: QwenConfig) -> None:
        super().__init__()
        self.model = Qwen2Model(config)


class Qwen2Encoder(nn.Module):
    """Official `Qwen2Encoder` naming: its `model.model` is the Qwen2 body (keys `llm.model.model.*`)."""

    def __init__(self, config: QwenConfig) -> None:
        super().__init__()
        self.model = Qwen2CausalLMBody(config)


def prepare_official_state_dict(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Official `llm.pt` -> our state_dict: drops `llm.model.lm_head.weight`, which must be a tied copy of
    `embed_tokens` (or absent); nothing else changes. Raises ModelLoadError when the head is untied.
    """
    out = dict(sd)
    head = out.pop(_LM_HEAD_KEY, None)
    if head is None:
        return out
    table = out.get(_QWEN_PREFIX + "embed_tokens.weight")
    if table is None or head.shape != table.shape or not torch.equal(head, table):
        raise ModelLoadError(
            f"{_LM_HEAD_KEY} is not a copy of {_QWEN_PREFIX}embed_tokens.weight: this checkpoint has an untied "
            "text head, which CosyVoice 2 does not use and Vocalis cannot represent"
        )
    return out


def _ids(ids: IdsLike, device: torch.device) -> torch.Tensor:
    """Any id list, (N,) or (1, N) tensor -> (1, N) int64 on `device`."""
    return torch.as_tensor(ids, dtype=torch.long, device=device).reshape(1, -1)


class Qwen2LM(nn.Module):
    def __init__(self, config: SpeechLMConfig) -> None:
        super().__init__()
        self.config = config
        d = config.qwen.hidden_size
        self.llm_embedding = nn.Embedding(2, d)
        self.llm = Qwen2Encoder(config.qwen)
        self.llm_decoder = nn.Linear(d, config.num_speech_rows)
        self.speech_embedding = nn.Embedding(config.num_speech_rows, d)

    @property
    def qwen(self) -> Qwen2Model:
        return self.llm.model.model

    # ---- embeddings --------------------------------------------------------------------------------------
    def embed_text(self, ids: IdsLike) -> torch.Tensor:
        """Text ids -> (1, N, D) from Qwen's token table."""
        return self.qwen.embed_tokens(_ids(ids, self.speech_embedding.weight.device))

    def embed_speech(self, ids: IdsLike) -> torch.Tensor:
        """Speech ids -> (1, N, D)."""
        return self.speech_embedding(_ids(ids, self.speech_embedding.weight.device))

    def special_embedding(self, row: int) -> torch.Tensor:
        """`llm_embedding` row (SOS_ROW or TASK_ID_ROW) as (1, 1, D)."""
        return self.llm_embedding.weight[row].reshape(1, 1, -1)

    def prefill_embeddings(
        self, text_ids: IdsLike, prompt_text_ids: IdsLike = (), prompt_speech_ids: IdsLike = ()
    ) -> torch.Tensor:
        """[sos] + embed(prompt_text + text) + [task_id] + speech_embedding(prompt_speech): (1, L, D)."""
        device = self.speech_embedding.weight.device
        text = torch.cat((_ids(prompt_text_ids, device), _ids(text_ids, device)), dim=1)  # (1, Nt)
        return torch.cat(
            (
                self.special_embedding(SOS_ROW),
                self.qwen.embed_tokens(text),
                self.special_embedding(TASK_ID_ROW),
                self.embed_speech(prompt_speech_ids),
            ),
            dim=1,
        )

    # ---- scoring -----------------------------------------------------------------------------------------
    def forward(self, inputs_embeds: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Uncached causal pass: inputs_embeds (B, T, D), attention_mask (B, T) true = real (right padding)
        -> speech logits (B, T, V)."""
        return self.llm_decoder(self.qwen(inputs_embeds, attention_mask))

    def step(self, inputs_embeds: torch.Tensor, cache: KVCache | None) -> tuple[torch.Tensor, KVCache]:
        """Feed inputs_embeds (B, T, D) after `cache`; return log-probs of the last position (B, V) (nothing
        masked) and the new cache. The caller owns both caches."""
        hidden, cache = self.qwen.forward_cached(inputs_embeds, cache)
        return self.llm_decoder(hidden[:, -1]).log_softmax(dim=-1), cache

    def length_bounds(self, num_text_tokens: int) -> tuple[int, int]:
        """(min_len, max_len) speech tokens for a text of that many tokens (prompt text excluded)."""
        c = self.config
        return int(num_text_tokens * c.min_token_text_ratio), int(num_text_tokens * c.max_token_text_ratio)

    # ---- decoding ----------------------------------------------------------------------------------------
    @torch.inference_mode()
    def generate(
        self,
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
        """Yield speech ids one by one (unistream, `Qwen2LM.inference`).

        Stops at any stop id or after `max_len` ids; eos alone is masked during the first `min_len` steps.
        The bounds default to `length_bounds(len(text_ids))`. `sample_fn` replaces RAS (then `sampling` and
        `generator` are unused), e.g. `make_greedy_sampler(stop ids)` with min_len = max_len = N decodes
        exactly N ids.
        """
        default_min, default_max = self.length_bounds(_ids(text_ids, torch.device("cpu")).shape[1])
        min_len = default_min if min_len is None else min_len
        max_len = default_max if max_len is None else max_len
        choose = sample_fn or make_sampler(sampling or SamplingConfig(), generator)
        eos, stops = self.config.eos_token, self.config.stop_token_ids
        lm_input = self.prefill_embeddings(text_ids, prompt_text_ids, prompt_speech_ids)  # (1, L, D)
        cache: KVCache | None = None
        out: list[int] = []
        for i in range(max_len):
            logp, cache = self.step(lm_input, cache)  # (1, V)
            if i < min_len:
                logp[0, eos] = float("-inf")
            top = choose(logp[0], out)
            if top in stops:
                return
            yield top
            out.append(top)
            lm_input = self.speech_embedding.weight[top].reshape(1, 1, -1)

    @torch.inference_mode()
    def generate_bistream(
        self,
        text_pieces: Iterable[IdsLike],
        prompt_text_ids: IdsLike = (),
        prompt_speech_ids: IdsLike = (),
        sampling: SamplingConfig | None = None,
        generator: torch.Generator | None = None,
        *,
        max_len: int | None = None,
        sample_fn: SampleFn | None = None,
    ) -> Iterator[int]:
        """Text-in streaming (`Qwen2LM.inference_bistream`): yields speech ids while text pieces arrive.

        Text and speech are interleaved `mix_ratio` (5:15): the prompt speech is laid out in blocks of 5 text
        + 15 speech embeddings; afterwards each run of 15 generated speech ids ends in a fill id (forced by
        position, or sampled), after which the next 5 text embeddings are fed. Fill ids are never yielded.
        While text arrives eos is masked; once the pieces are exhausted, the rest of the text and the task id
        are fed and decoding runs to eos. `max_len` bounds the yielded ids (default: max_token_text_ratio x
        the non-prompt text tokens received); the official code has no bound there.
        """
        c = self.config
        n_text, n_speech = c.mix_ratio
        fill, eos = c.fill_token, c.eos_token
        choose = sample_fn or make_sampler(sampling or SamplingConfig(), generator)
        lm_input = self.special_embedding(SOS_ROW)  # (1, T, D): embeddings to feed next (see final phase)
        text_cache = self.embed_text(prompt_text_ids)  # (1, Nt, D) text not yet fed
        prompt_speech = self.embed_speech(prompt_speech_ids)  # (1, P, D) prompt speech not yet fed
        num_prompt = prompt_speech.shape[1]
        next_fill_index = (num_prompt // n_speech + 1) * n_speech - num_prompt
        cache: KVCache | None = None
        out: list[int] = []  # generated ids, fill ids included (they count for the fill schedule)
        num_text = 0
        for piece in text_pieces:
            piece_emb = self.embed_text(piece)
            num_text += piece_emb.shape[1]
            text_cache = torch.cat((text_cache, piece_emb), dim=1)
            while prompt_speech.shape[1] > 0 and text_cache.shape[1] >= n_text:
                lm_input = torch.cat((lm_input, text_cache[:, :n_text], prompt_speech[:, :n_speech]), dim=1)
                text_cache, prompt_speech = text_cache[:, n_text:], prompt_speech[:, n_speech:]
            if prompt_speech.shape[1] > 0:
                continue  # [wait] more text needed to lay out the prompt speech
            after_fill = bool(out) and out[-1] == fill
            if after_fill or (not out and lm_input.shape[1] == 1):
                if text_cache.shape[1] < n_text:
                    continue  # [wait] a fill (or a bare sos) must be followed by a full text block
                block, text_cache = text_cache[:, :n_text], text_cache[:, n_text:]
                lm_input = block if after_fill else torch.cat((lm_input, block), dim=1)
            while True:
                logp, cache = self.step(lm_input, cache)  # (1, V)
                if len(out) == next_fill_index:
                    top = fill  # [forced] the block already holds n_speech speech ids
                else:
                    # eos must wait for the end of the text, and the unused special id is never valid; masking
                    # them (where the official code raises on the latter) keeps a user's stream alive
                    logp[0, eos] = float("-inf")
                    logp[0, c.speech_token_size + 1] = float("-inf")
                    top = choose(logp[0], out)
                if top == fill:
                    next_fill_index = len(out) + n_speech + 1
                out.append(top)
                if top == fill:
                    break
                yield top
                lm_input = self.speech_embedding.weight[top].reshape(1, 1, -1)

        # [official] `lm_input` is not cleared after a fill break, so the last speech embedding (already in the
        # cache) is fed once more here; remaining prompt speech (text ran out before it was laid out) is
        # dropped. Both match `inference_bistream` exactly.
        lm_input = torch.cat((lm_input, text_cache, self.special_embedding(TASK_ID_ROW)), dim=1)
        limit = self.length_bounds(num_text)[1] if max_len is None else max_len
        num_yielded = sum(1 for t in out if t < c.speech_token_size)
        while num_yielded < limit:
            logp, cache = self.step(lm_input, cache)
            logp[0, c.speech_token_size + 1 :] = float("-inf")  # only speech or eos may follow the task id
            top = choose(logp[0], out)
            out.append(top)
            if top == eos:
                return
            yield top
            num_yielded += 1
            lm_input = self.speech_embedding.weight[top].reshape(1, 1, -1)
        logger.warning("bistream decoding stopped at %d speech tokens without eos", num_yielded)
