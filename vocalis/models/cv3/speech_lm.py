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

import torch
from torch import nn

from vocalis.config.cv3 import CV3SpeechLMConfig
from vocalis.models.speech_lm import IdsLike, Qwen2Encoder, SpeechLMBody, id_row, prepare_official_state_dict

__all__ = ["CosyVoice3LM", "IdsLike", "prepare_official_state_dict"]


class CosyVoice3LM(SpeechLMBody):
    config: CV3SpeechLMConfig

    def __init__(self, config: CV3SpeechLMConfig) -> None:
        super().__init__()
        self.config = config
        d = config.qwen.hidden_size
        self.llm = Qwen2Encoder(config.qwen)
        self.llm_decoder = nn.Linear(d, config.num_speech_rows, bias=False)
        self.speech_embedding = nn.Embedding(config.num_speech_rows, d)

    # ---- embeddings --------------------------------------------------------------------------------------
    def sos_embedding(self) -> torch.Tensor:
        return self.embed_speech([self.config.sos_token])

    def task_embedding(self) -> torch.Tensor:
        return self.embed_speech([self.config.task_id_token])

    def prefill_ids(
        self, text_ids: IdsLike, prompt_text_ids: IdsLike = (), prompt_speech_ids: IdsLike = ()
    ) -> list[tuple[int, int]]:
        """Source of every prefill row as (table, row): table 0 = `speech_embedding`, 1 = Qwen `embed_tokens`.

        The id-space view of `prefill_embeddings`, for engines that embed rows themselves.
        """
        c = self.config
        cpu = torch.device("cpu")
        text = id_row(prompt_text_ids, cpu)[0].tolist() + id_row(text_ids, cpu)[0].tolist()
        speech = id_row(prompt_speech_ids, cpu)[0].tolist()
        return [(0, c.sos_token), *((1, t) for t in text), (0, c.task_id_token), *((0, s) for s in speech)]
