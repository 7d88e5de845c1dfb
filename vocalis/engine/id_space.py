"""One integer id space for everything the speech LM reads, so the engine speaks plain ints.

The LLM reads up to three embedding tables; the engine numbers their rows consecutively. Where sos and the task id
live is the family's (its LM config: `sos_id`, `task_id`, `num_special_rows`):

CosyVoice 2 (`Qwen2LM`):

    [0, S)            speech ids (speech_embedding rows: S = speech_token_size + 3, incl. eos/stop/fill)
    S, S + 1          sos, task id (llm_embedding rows)
    [S + 2, S + 2 + V) text ids (Qwen's embed_tokens rows, V = text vocabulary)

CosyVoice 3 (`CosyVoice3LM`) has no `llm_embedding`: sos and task id are rows of `speech_embedding`
(speech_token_size + 0 and + 2), so there is no special range:

    [0, S)            speech ids (S = speech_token_size + 200; sos, eos, task id, fill among the extra rows)
    [S, S + V)        text ids

A text id and a speech id with the same table row never share an engine id, so block hashes over engine
ids keep text and speech apart by construction (the "namespace" of a token is its range).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from vocalis.config import SpeechLMShape


@dataclass(frozen=True, slots=True)
class IdSpace:
    num_speech: int  # S: speech_embedding rows
    num_text: int  # V
    sos: int
    task: int
    text_offset: int  # first text id; num_speech + the special (llm_embedding) rows

    @classmethod
    def for_config(cls, config: SpeechLMShape) -> IdSpace:
        s = config.num_speech_rows
        return cls(s, config.qwen.vocab_size, sos=config.sos_id, task=config.task_id,
                   text_offset=s + config.num_special_rows)

    @property
    def size(self) -> int:
        return self.text_offset + self.num_text

    def text(self, ids: Sequence[int]) -> list[int]:
        off = self.text_offset
        return [off + int(i) for i in ids]

    def speech(self, ids: Sequence[int]) -> list[int]:
        return [int(i) for i in ids]

    def prompt(self, text_ids: Sequence[int], prompt_text_ids: Sequence[int] = (),
               prompt_speech_ids: Sequence[int] = ()) -> list[int]:
        """Unistream prefill layout, as `prefill_embeddings` of both families:
        [sos] + prompt_text + text + [task] + prompt_speech.

        Only [sos] + prompt_text is the same for every text spoken with one voice, so that is the prefix the
        block manager can share between requests (in whole blocks).
        """
        return [self.sos, *self.text(prompt_text_ids), *self.text(text_ids), self.task, *self.speech(prompt_speech_ids)]

    def split(self, ids: Sequence[int]) -> tuple[list[int], list[int], list[int]]:
        """Indices into `ids` of its speech, special (llm_embedding; none for CosyVoice 3) and text ids."""
        speech, special, text = [], [], []
        s, off = self.num_speech, self.text_offset
        for i, t in enumerate(ids):
            (speech if t < s else special if t < off else text).append(i)
        return speech, special, text
