"""Per-family adapter of the LLM engine: what differs between the speech LMs it drives, in one place.

The engine (scheduler, block manager, model runner, sampler) speaks integer engine ids (`IdSpace`) and calls the
Qwen2 body, the final norm and `llm_decoder` the same way for every family. What a family decides (declared by
its LM config, `vocalis.config.SpeechLMShape`, and read here only):

- the id space (where sos / task id live, where text starts) and so the prefill layout;
- the embedding of engine ids (which table each row comes from);
- the stop ids, and the one id masked before min_len;
- whether text may arrive in pieces (bi-streaming).

                     CosyVoice 2 (`Qwen2LM`)            CosyVoice 3 (`CosyVoice3LM`)
    sos, task id     llm_embedding rows 0, 1           speech_embedding rows V, V + 2
    head             llm_decoder with bias, V + 3      llm_decoder without bias, V + 200
    stop ids         V, V + 1, V + 2                   V .. V + 199 (every extra id)
    before min_len   eos (V) masked                    sos (V) masked, as the official decoder (other stops end)
    bi-streaming     from sos                          from sos + the prompt text up to <|endofprompt|>
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from vocalis.engine.id_space import IdSpace
from vocalis.errors import InputError
from vocalis.models.cv3.speech_lm import CosyVoice3LM
from vocalis.models.speech_lm import Qwen2LM

SpeechLM = Qwen2LM | CosyVoice3LM


@dataclass(frozen=True)
class LMFamily:
    """What the engine needs to know about one speech-LM family (see the module table)."""

    name: str
    ids: IdSpace
    stop_ids: tuple[int, ...]
    min_len_mask_id: int  # the id masked while fewer than min_len ids were produced
    bistream: bool

    def embed(self, llm: SpeechLM, ids: torch.Tensor, all_speech: bool = False) -> torch.Tensor:
        """Engine ids (N,) -> (N, D) in the speech table's dtype, each row from the table it belongs to: row for
        row what the family's `prefill_embeddings` builds. all_speech: every id is a speech id (one lookup)."""
        if all_speech:
            return llm.speech_embedding(ids)
        space = self.ids
        dtype = llm.speech_embedding.weight.dtype
        out = torch.empty(ids.shape[0], llm.speech_embedding.embedding_dim, dtype=dtype, device=ids.device)
        s, off = space.num_speech, space.text_offset
        speech, text = ids < s, ids >= off
        out[speech] = llm.speech_embedding(ids[speech])
        if off > s:  # CosyVoice 2's sos / task id rows (`llm_embedding`); CosyVoice 3 has no such range
            special = ~(speech | text)
            out[special] = llm.llm_embedding(ids[special] - s).to(dtype)
        out[text] = llm.qwen.embed_tokens(ids[text] - off).to(dtype)
        return out


# The speech LMs the engine drives, by module type (tried in order): a new family is one entry here and an LM config
# declaring its id layout and stop rule (`vocalis.config.SpeechLMShape`).
LM_FAMILIES: tuple[tuple[type[nn.Module], str], ...] = ((CosyVoice3LM, "cosyvoice3"), (Qwen2LM, "cosyvoice2"))


def family_of(llm: nn.Module) -> LMFamily:
    """The adapter for a speech LM module; InputError for a module the engine cannot drive."""
    for module_type, name in LM_FAMILIES:
        if isinstance(llm, module_type):
            c = llm.config
            return LMFamily(name, IdSpace.for_config(c), c.stop_token_ids, c.min_len_mask_id, bistream=True)
    raise InputError(f"the LLM engine drives CosyVoice 2 (Qwen2LM) and CosyVoice 3 (CosyVoice3LM) speech LMs, "
                     f"not {type(llm).__name__}")
