"""Text arriving in pieces (bi-streaming) as a per-request state machine: the official `inference_bistream`
schedule (`reference.decode.generate_bistream` for CosyVoice 2, `reference.cv3.generate_bistream` for CosyVoice 3)
driven by events (a piece arrived, the text ended, an id was sampled) instead of a blocking loop.

Schedule (5:15 text:speech): the prompt speech is laid out in blocks of 5 text + 15 speech ids as text
arrives; then decoding runs, a fill id is forced (or sampled) after every 15 speech ids, and after each fill
the next 5 text ids are fed. Like the reference loop, one new piece is taken at each point where it waits
(the start, and after every fill), so the ids depend on the pieces, never on when they arrive. When the text
ends, the rest of it and the task id are fed (after the last input once more, as the released code does) and
decoding runs to eos. While text arrives every extra id but fill is masked; after the task id every one but eos
(where the released code raises). Pure Python over engine ids; the request's `token_ids` is exactly what was fed.

The families differ only at the start: CosyVoice 2 starts from sos; CosyVoice 3 feeds the prompt text up to
`<|endofprompt|>` (the system part) right after sos, and the rest of it (a transcript) is text like any other.
Without prompt speech both take a text block before the first decode.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

from vocalis.config import SpeechLMShape
from vocalis.engine.id_space import IdSpace


class BistreamInput:
    def __init__(self, config: SpeechLMShape, prompt_text_ids: Sequence[int] = (),
                 prompt_speech_ids: Sequence[int] = (), max_len: int | None = None) -> None:
        self.ids = IdSpace.for_config(config)
        self.config = config
        self.n_text, self.n_speech = config.mix_ratio
        self.pieces: deque[list[int]] = deque()  # arrived, not yet taken (text ids)
        self.ended = False
        system, prompt_text = config.split_prompt_text(prompt_text_ids)
        self.text_cache = self.ids.text(prompt_text)  # engine ids not yet fed
        self.prompt_speech = list(prompt_speech_ids)  # not yet laid out
        self.lm_input = [self.ids.sos, *self.ids.text(system)]  # the last input decided on (fed or about to be)
        p = len(self.prompt_speech)
        self.has_prompt_speech = p > 0
        self.next_fill_index = (p // self.n_speech + 1) * self.n_speech - p
        self.num_text = 0  # non-prompt text ids received
        self.final = False  # the text has ended and its rest was fed
        self.waiting = True  # blocked on the next piece (nothing to compute)
        self.max_len = max_len
        self.limit = 0
        self.num_yielded = 0
        extra = range(config.speech_token_size, config.num_speech_rows)
        self._masked_while_text = [i for i in extra if i != config.fill_token]
        self._masked_after_text = [i for i in extra if i != config.eos_token]

    # ---- input events ------------------------------------------------------------------------------------
    def push(self, text_ids: Sequence[int]) -> None:
        self.pieces.append(list(text_ids))

    def end(self) -> None:
        self.ended = True

    def advance(self, output_ids: Sequence[int]) -> list[int] | None:
        """While waiting, take arrived pieces as the reference loop would; returns the ids to feed when decoding
        (re)starts, else None. `output_ids`: ids sampled so far (fill ids included)."""
        if not self.waiting:
            return None
        while self.pieces:
            piece = self.pieces.popleft()
            self.text_cache += self.ids.text(piece)
            self.num_text += len(piece)
            while self.prompt_speech and len(self.text_cache) >= self.n_text:
                self.lm_input += self.text_cache[:self.n_text] + self.prompt_speech[:self.n_speech]
                self.text_cache = self.text_cache[self.n_text:]
                self.prompt_speech = self.prompt_speech[self.n_speech:]
            if self.prompt_speech:
                continue  # [wait] more text needed to lay out the prompt speech
            after_fill = bool(output_ids) and output_ids[-1] == self.config.fill_token
            if after_fill or (not output_ids and not self.has_prompt_speech):
                if len(self.text_cache) < self.n_text:
                    continue  # [wait] a fill (or the bare start) must be followed by a full text block
                block = self.text_cache[:self.n_text]
                self.text_cache = self.text_cache[self.n_text:]
                self.lm_input = block if after_fill else self.lm_input + block
            self.waiting = False
            return list(self.lm_input)
        if self.ended:
            # [official] the last input is fed once more before the rest of the text and the task id;
            # prompt speech not yet laid out is dropped
            self.final, self.waiting = True, False
            self.limit = self.max_len if self.max_len is not None else \
                int(self.num_text * self.config.max_token_text_ratio)
            self.num_yielded = sum(1 for t in output_ids if t < self.config.speech_token_size)
            return self.lm_input + self.text_cache + [self.ids.task]
        return None

    # ---- sampling rules ----------------------------------------------------------------------------------
    def forced(self, num_output: int) -> int | None:
        """The fill id when the block already holds its 15 speech ids (no draw is made then)."""
        if not self.final and num_output == self.next_fill_index:
            return self.config.fill_token
        return None

    @property
    def masked_ids(self) -> list[int]:
        """Ids never drawn now: while text arrives every extra id but fill; after the task id every one but eos."""
        return self._masked_after_text if self.final else self._masked_while_text

    def accept(self, token: int, num_output: int) -> tuple[bool, bool, bool]:
        """A sampled (or forced) id, `num_output` ids sampled before it -> (yield it, feed it, finished)."""
        c = self.config
        if not self.final:
            if token == c.fill_token:
                self.next_fill_index = num_output + self.n_speech + 1
                self.waiting = True
                return False, False, False
            if token >= c.speech_token_size:
                return False, False, True  # a stop id where only speech or fill may come (reference: error)
            self.lm_input = [token]
            return True, True, False
        if token >= c.speech_token_size:  # eos, or a special id where only speech or eos may follow
            return False, False, True
        self.num_yielded += 1
        return True, True, self.num_yielded >= self.limit

    @property
    def over_limit(self) -> bool:
        """The final phase may start with the limit already reached (nothing more to decode)."""
        return self.final and self.num_yielded >= self.limit
