"""The labels a phone model may write next when its labels follow its text (`SamplingConfig.follow_phones`).

A phone model's 25 Hz labels spell its input's phones in order: each phone begins once and continues for the rest
of its frames, pauses fall only where words meet (or before the first phone and after the last), and the
utterance ends in a pause (`vocalis.corpus.alignment`; the corpus has no other kind). A model that loses its place
skips, repeats or invents words; the labels it may write are therefore only those that continue the spelling:

- the current phone again (inside), the next phone (begin), a pause where a word ends after the current phone;
- in a pause: the pause again (inside, or a new pause), the next phone;
- at the start: a pause or the first phone; eos once the last phone has begun.

A pause lasts at most `MAX_PAUSE_FRAMES`: the teacher's pauses last 1-5 frames (0.2 s at most), and a model
that pauses far longer has lost its place: left free it goes on pausing until the text's length bound, its words
unsaid (the rest of the sentence dropped into silence) or, after the last word, the sentence never ended. Past the
bound only the next phone may follow (after the last phone: eos, once `min_len` ids are out, as eos is masked
before).

What the model does choose among them (how long each phone lasts, where it pauses) stays its own. `LabelPath` is
per-request state: the engine's sampler and the reference decoder ask it for the ids to mask before each draw,
giving it the ids drawn so far.

Legend: V speech ids (labels, eos and the model's other stop ids).
"""

from __future__ import annotations

from collections.abc import Sequence

from vocalis.frontend.phones import NUM_TEXT_IDS, PAUSE, PUNCTUATION, TEXT_SYMBOLS, UNIT_IDS, WORD_BOUNDARY, label_id

_PAUSE_BEGIN, _PAUSE_INSIDE = label_id(PAUSE, False), label_id(PAUSE, True)
MAX_PAUSE_FRAMES = 10  # 0.4 s at 25 Hz: twice the teacher's longest pause


class LabelPath:
    def __init__(self, text_ids: Sequence[int], eos_id: int, num_ids: int, min_len: int = 0) -> None:
        """text_ids: the phone model's text ids (`phones.text_ids`); eos_id: its end of speech; num_ids: V;
        min_len: ids before which eos is masked (a final pause may then outlast `MAX_PAUSE_FRAMES`)."""
        self.eos_id, self.num_ids, self.min_len = eos_id, num_ids, min_len
        self.units: list[str] = []
        self.pause_after: list[bool] = []  # a pause may follow phone k: a word ends there
        for i in text_ids:
            symbol = TEXT_SYMBOLS[i] if 0 <= i < NUM_TEXT_IDS else ""
            if symbol in UNIT_IDS and symbol != PAUSE:
                self.units.append(symbol)
                self.pause_after.append(False)
            elif (symbol == WORD_BOUNDARY or symbol in PUNCTUATION) and self.pause_after:
                self.pause_after[-1] = True
        if self.pause_after:
            self.pause_after[-1] = True
        self._phone = -1  # index of the phone begun last (-1: none yet)
        self._in_pause = False
        self._pause_run = 0  # pause labels in a row up to the last one read
        self._seen = 0  # how many of the request's ids the state has read (0: at the start)

    def _read(self, label: int) -> None:
        if label in (_PAUSE_BEGIN, _PAUSE_INSIDE):
            self._in_pause = True
            self._pause_run += 1
            return
        self._pause_run = 0
        if self._phone + 1 < len(self.units) and label == label_id(self.units[self._phone + 1], False):
            self._phone += 1
            self._in_pause = False

    def allowed(self, output_ids: Sequence[int]) -> list[int]:
        """The ids the model may write after `output_ids` (every id it wrote, in order; read once each)."""
        for label in output_ids[self._seen:]:
            self._read(label)
        self._seen = len(output_ids)
        k, n = self._phone, len(self.units)
        ids = []
        started = self._seen > 0
        pause_over = self._pause_run >= MAX_PAUSE_FRAMES and (k + 1 < n or self._seen >= self.min_len)
        if not started:
            ids.append(_PAUSE_BEGIN)
        elif self._in_pause:
            if not pause_over:
                ids += [_PAUSE_INSIDE, _PAUSE_BEGIN]
        else:
            ids.append(label_id(self.units[k], True))
            if self.pause_after[k]:
                ids.append(_PAUSE_BEGIN)
        if k + 1 < n:
            ids.append(label_id(self.units[k + 1], False))
        if k == n - 1 and (started or n == 0):
            ids.append(self.eos_id)
        return ids

    def masked_ids(self, output_ids: Sequence[int]) -> list[int]:
        """Every id of V but the allowed ones."""
        allowed = set(self.allowed(output_ids))
        return [i for i in range(self.num_ids) if i not in allowed]
