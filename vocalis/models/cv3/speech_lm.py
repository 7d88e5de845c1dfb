"""CosyVoice 3 text-speech language model (`CosyVoice3LM`): Qwen2 body + speech embedding + bias-free speech head.

Id spaces: text ids index Qwen's `embed_tokens`; speech ids index `speech_embedding`, whose rows are the
speech_token_size codes followed by `num_extra_ids` (200) extra rows: sos (V + 0), eos (V + 1), task id (V + 2),
fill (V + 3) and unused ones. There is no `llm_embedding`. The head `llm_decoder` scores all V + 200 rows; every id
>= V stops decoding.

Prefill layout (unistream): speech_embedding[sos] + text(prompt_text + text) + speech_embedding[task_id]
+ speech_embedding(prompt_speech). Each decode step feeds the chosen id back through `speech_embedding`.

Stateless: the caller owns the `KVCache`, the decoded ids and the sampler (see `step`).

Legend: B batch, T positions, D hidden, V = speech_token_size + num_extra_ids.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from vocalis.config.cv3 import CV3SpeechLMConfig
from vocalis.models.qwen2 import KVCache, Qwen2Model
from vocalis.models.speech_lm import Qwen2Encoder, prepare_official_state_dict

__all__ = ["CosyVoice3LM", "prepare_official_state_dict"]

IdsLike = Sequence[int] | torch.Tensor


def _ids(ids: IdsLike, device: torch.device) -> torch.Tensor:
    """Any id list, (N,) or (1, N) tensor -> (1, N) int64 on `device`."""
    return torch.as_tensor(ids, dtype=torch.long, device=device).reshape(1, -1)


class CosyVoice3LM(nn.Module):
    def __init__(self, config: CV3SpeechLMConfig) -> None:
        super().__init__()
        self.config = config
        d = config.qwen.hidden_size
        self.llm = Qwen2Encoder(config.qwen)
        self.llm_decoder = nn.Linear(d, config.num_speech_rows, bias=False)
        self.speech_embedding = nn.Embedding(config.num_speech_rows, d)

    @property
    def qwen(self) -> Qwen2Model:
        return self.llm.model.model

    # ---- embeddings --------------------------------------------------------------------------------------
    def embed_text(self, ids: IdsLike) -> torch.Tensor:
        """Text ids -> (1, N, D) from Qwen's token table."""
        return self.qwen.embed_tokens(_ids(ids, self.speech_embedding.weight.device))

    def embed_speech(self, ids: IdsLike) -> torch.Tensor:
        """Speech ids (codes or the extra ids) -> (1, N, D)."""
        return self.speech_embedding(_ids(ids, self.speech_embedding.weight.device))

    def prefill_embeddings(
        self, text_ids: IdsLike, prompt_text_ids: IdsLike = (), prompt_speech_ids: IdsLike = ()
    ) -> torch.Tensor:
        """[sos] + embed(prompt_text + text) + [task_id] + speech_embedding(prompt_speech): (1, L, D)."""
        c = self.config
        device = self.speech_embedding.weight.device
        text = torch.cat((_ids(prompt_text_ids, device), _ids(text_ids, device)), dim=1)  # (1, Nt)
        return torch.cat(
            (
                self.embed_speech([c.sos_token]),
                self.qwen.embed_tokens(text),
                self.embed_speech([c.task_id_token]),
                self.embed_speech(prompt_speech_ids),
            ),
            dim=1,
        )

    def prefill_ids(
        self, text_ids: IdsLike, prompt_text_ids: IdsLike = (), prompt_speech_ids: IdsLike = ()
    ) -> list[tuple[int, int]]:
        """Source of every prefill row as (table, row): table 0 = `speech_embedding`, 1 = Qwen `embed_tokens`.

        The id-space view of `prefill_embeddings`, for engines that embed rows themselves.
        """
        c = self.config
        cpu = torch.device("cpu")
        text = _ids(prompt_text_ids, cpu)[0].tolist() + _ids(text_ids, cpu)[0].tolist()
        speech = _ids(prompt_speech_ids, cpu)[0].tolist()
        return [(0, c.sos_token), *((1, t) for t in text), (0, c.task_id_token), *((0, s) for s in speech)]

    # ---- scoring -----------------------------------------------------------------------------------------
    def forward(self, inputs_embeds: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Uncached causal pass: inputs_embeds (B, T, D), attention_mask (B, T) true = real (right padding)
        -> speech logits (B, T, V)."""
        return self.llm_decoder(self.qwen(inputs_embeds, attention_mask))

    def step(self, inputs_embeds: torch.Tensor, cache: KVCache | None) -> tuple[torch.Tensor, KVCache]:
        """Feed inputs_embeds (B, T, D) after `cache`; return log-probs of the last position (B, V), nothing
        masked, and the new cache. The caller owns both caches and masks what it must (e.g. `min_len_mask`)."""
        hidden, cache = self.qwen.forward_cached(inputs_embeds, cache)
        return self.llm_decoder(hidden[:, -1]).log_softmax(dim=-1), cache

    def length_bounds(self, num_text_tokens: int) -> tuple[int, int]:
        """(min_len, max_len) speech tokens for a text of that many tokens (prompt text excluded)."""
        c = self.config
        return int(num_text_tokens * c.min_token_text_ratio), int(num_text_tokens * c.max_token_text_ratio)

    def min_len_mask_id(self) -> int:
        """[official] Before min_len the official decoder masks only row V (sos in this layout), not eos: any
        other stop id still ends decoding early. Engines that want parity mask this id alone."""
        return self.config.sos_token
