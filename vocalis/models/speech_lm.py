"""CosyVoice 2 text-speech language model (`Qwen2LM`): Qwen2 body + speech embedding + speech head.

Id spaces: text ids index Qwen's own `embed_tokens`; speech ids index `speech_embedding` (speech_token_size
codes, then eos, an unused stop id, and the bistream fill id); `llm_embedding` rows are sos (0) and task id (1).
The head `llm_decoder` scores the speech_token_size + 3 speech ids.

Prefill layout (unistream): [sos] + text(prompt_text + text) + [task_id] + speech(prompt_speech).

What both families compute alike is `SpeechLMBody` (CosyVoice 3's `CosyVoice3LM` is the other subclass). The module
is maths only and stateless: the KV cache, decoded ids and the RNG live with the caller (the engine,
or the reference decode loops in `vocalis.reference.decode`). Training lives in `speech_lm_train.py`.

Legend: B batch, T positions, D hidden, V = speech_token_size + 3.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch
from torch import nn

from vocalis.config import QwenConfig, SpeechLMConfig, SpeechLMShape
from vocalis.errors import ModelLoadError
from vocalis.models.qwen2 import KVCache, Qwen2Model

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


def id_row(ids: IdsLike, device: torch.device) -> torch.Tensor:
    """Any id list, (N,) or (1, N) tensor -> (1, N) int64 on `device`."""
    return torch.as_tensor(ids, dtype=torch.long, device=device).reshape(1, -1)


class SpeechLMBody(nn.Module):
    """What both families' speech LMs compute alike over a Qwen2 body (`qwen`), a speech table
    (`speech_embedding`) and a speech head (`llm_decoder`); a family's subclass makes those and says where its sos
    and task id rows live (`sos_embedding`, `task_embedding`). Maths only: the caller owns caches and sampling."""

    config: SpeechLMShape
    llm: Qwen2Encoder
    llm_decoder: nn.Linear
    speech_embedding: nn.Embedding

    @property
    def qwen(self) -> Qwen2Model:
        return self.llm.model.model

    # ---- embeddings --------------------------------------------------------------------------------------
    def sos_embedding(self) -> torch.Tensor:
        """sos as (1, 1, D)."""
        raise NotImplementedError

    def task_embedding(self) -> torch.Tensor:
        """The task id as (1, 1, D)."""
        raise NotImplementedError

    def embed_text(self, ids: IdsLike) -> torch.Tensor:
        """Text ids -> (1, N, D) from Qwen's token table."""
        return self.qwen.embed_tokens(id_row(ids, self.speech_embedding.weight.device))

    def embed_speech(self, ids: IdsLike) -> torch.Tensor:
        """Speech ids (codes or the extra ids) -> (1, N, D)."""
        return self.speech_embedding(id_row(ids, self.speech_embedding.weight.device))

    def prefill_embeddings(
        self, text_ids: IdsLike, prompt_text_ids: IdsLike = (), prompt_speech_ids: IdsLike = ()
    ) -> torch.Tensor:
        """[sos] + embed(prompt_text + text) + [task_id] + speech_embedding(prompt_speech): (1, L, D)."""
        device = self.speech_embedding.weight.device
        text = torch.cat((id_row(prompt_text_ids, device), id_row(text_ids, device)), dim=1)  # (1, Nt)
        return torch.cat(
            (self.sos_embedding(), self.qwen.embed_tokens(text), self.task_embedding(),
             self.embed_speech(prompt_speech_ids)),
            dim=1,
        )

    # ---- scoring -----------------------------------------------------------------------------------------
    def forward(self, inputs_embeds: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Uncached causal pass: inputs_embeds (B, T, D), attention_mask (B, T) true = real (right padding)
        -> speech logits (B, T, V)."""
        return self.llm_decoder(self.qwen(inputs_embeds, attention_mask))

    def step(self, inputs_embeds: torch.Tensor, cache: KVCache | None) -> tuple[torch.Tensor, KVCache]:
        """Feed inputs_embeds (B, T, D) after `cache`; return log-probs of the last position (B, V), nothing
        masked, and the new cache. The caller owns both caches and masks what it must (`min_len_mask_id`)."""
        hidden, cache = self.qwen.forward_cached(inputs_embeds, cache)
        return self.llm_decoder(hidden[:, -1]).log_softmax(dim=-1), cache

    def length_bounds(self, num_text_tokens: int) -> tuple[int, int]:
        """(min_len, max_len) speech tokens for a text of that many tokens (prompt text excluded)."""
        c = self.config
        return int(num_text_tokens * c.min_token_text_ratio), int(num_text_tokens * c.max_token_text_ratio)

    def min_len_mask_id(self) -> int:
        """The one id masked while fewer than min_len ids were produced (the family's rule: its config)."""
        return self.config.min_len_mask_id


class Qwen2LM(SpeechLMBody):
    config: SpeechLMConfig

    def __init__(self, config: SpeechLMConfig) -> None:
        super().__init__()
        self.config = config
        d = config.qwen.hidden_size
        self.llm_embedding = nn.Embedding(2, d)
        self.llm = Qwen2Encoder(config.qwen)
        self.llm_decoder = nn.Linear(d, config.num_speech_rows)
        self.speech_embedding = nn.Embedding(config.num_speech_rows, d)

    def special_embedding(self, row: int) -> torch.Tensor:
        """`llm_embedding` row (SOS_ROW or TASK_ID_ROW) as (1, 1, D)."""
        return self.llm_embedding.weight[row].reshape(1, 1, -1)

    def sos_embedding(self) -> torch.Tensor:
        return self.special_embedding(SOS_ROW)

    def task_embedding(self) -> torch.Tensor:
        return self.special_embedding(TASK_ID_ROW)
