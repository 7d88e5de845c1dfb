"""Word timestamps: when each word of the text is said in the audio made from it.

An `Aligner` times the words of one sentence in that sentence's audio. Two ship:

- `LabelAligner`, for a model that reads phones (the built-in model): its speech ids are 25 Hz phone labels that
  follow the text's phones (`engine.label_path`), so a word starts on the frame its first phone begins and ends
  where a pause or the next word begins: exact, no audio analysis.
- `PocketsphinxAligner`, for every other model in English: forced alignment of the text against the audio with
  CMU pocketsphinx's US English model (`pip install 'vocalis[eval]'`); words its dictionary lacks are added with
  the festival CMU lexicon's (or its letter-to-sound rules') phones.

Another aligner (another language, a better model) is any callable of the `Aligner` protocol; `load_aligner`
takes its import path as `module:factory` (the factory is called once, with no arguments):

    # my_aligner.py
    from vocalis.frontend.word_times import WordTime

    def make():
        def align(text, wav, sample_rate, speech_ids):
            ...  # -> [WordTime(word, start_s, end_s), ...] for the words of `text` said in `wav`
        return align

    $ vocalis serve --aligner my_aligner:make

`WordTimer` runs one over a request's chunks: it keeps each sentence's audio until the sentence's last chunk
(which carries its speech ids, `AudioChunk.speech_ids`), times its words and shifts them by where the sentence
starts in the request's audio.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from vocalis.errors import InputError
from vocalis.frontend.phones import PAUSE, PhoneTokenizer, label_id, lookup
from vocalis.frontend.request import AudioChunk

ALIGN_RATE = 16000  # Hz: pocketsphinx's acoustic model
_PS_FRAME_S = 0.01  # pocketsphinx's frame rate: 100 Hz


@dataclass(frozen=True)
class WordTime:
    """One word said: `word` as spoken (normalised: "eighteen" for "18"); start/end in seconds from the start of
    the audio."""

    word: str
    start: float
    end: float

    def as_dict(self) -> dict[str, object]:
        return {"word": self.word, "start": round(self.start, 3), "end": round(self.end, 3)}


class Aligner(Protocol):
    """text: one sentence as the model read it (normalised); wav (N,) float32 mono at `sample_rate`: its audio;
    speech_ids: the LLM's ids for it (a phone model's labels; an aligner working from the audio ignores them)
    -> its words in order, times in seconds from the start of `wav` (words it cannot place left out)."""

    def __call__(self, text: str, wav: np.ndarray, sample_rate: int, speech_ids: Sequence[int]) -> list[WordTime]: ...


class LabelAligner:
    """Exact word times of a phone model from its labels (see the module docstring)."""

    def __init__(self, tokenizer: PhoneTokenizer | None = None) -> None:
        self.tokenizer = tokenizer or PhoneTokenizer()

    def __call__(self, text: str, wav: np.ndarray, sample_rate: int, speech_ids: Sequence[int]) -> list[WordTime]:
        if not speech_ids:
            return []
        words = self.tokenizer.spoken_words(text)
        units = [(w, label_id(p, False)) for w, word in enumerate(words) for p in word.phones]
        pauses = (label_id(PAUSE, False), label_id(PAUSE, True))
        frame_s = len(wav) / sample_rate / len(speech_ids)  # 40 ms, or less / more at another speed
        start: dict[int, int] = {}  # word -> frame its first phone begins
        end: dict[int, int] = {}  # word -> frame after its last frame
        phone, current = -1, -1  # the phone begun last, and its word (-1: none / in a pause)
        for f, label in enumerate(speech_ids):
            if label in pauses:
                if current >= 0:
                    end[current] = f
                current = -1
            elif phone + 1 < len(units) and label == units[phone + 1][1]:
                phone += 1
                w = units[phone][0]
                if w != current:
                    if current >= 0:
                        end[current] = f
                    start.setdefault(w, f)
                    current = w
        if current >= 0:
            end[current] = len(speech_ids)
        return [WordTime(words[w].text, f * frame_s, end[w] * frame_s) for w, f in sorted(start.items())]


_PS_TOKEN = re.compile(r"[a-z]+(?:'[a-z]+)*|[,.;:!?]")  # words and the punctuation a pause may follow
_SIL = "<sil>"  # pocketsphinx's silence word


class PocketsphinxAligner:
    """Forced alignment with CMU pocketsphinx's US English model (see the module docstring). English only."""

    def __init__(self) -> None:
        try:
            from pocketsphinx import Decoder
        except ImportError:
            raise InputError("word timestamps of this model need pocketsphinx: pip install 'vocalis[eval]'") from None
        self._decoder_class = Decoder

    def __call__(self, text: str, wav: np.ndarray, sample_rate: int, speech_ids: Sequence[int]) -> list[WordTime]:
        import soxr

        if sample_rate != ALIGN_RATE:
            wav = soxr.resample(wav, sample_rate, ALIGN_RATE)
        # a fresh decoder per sentence: one reused carries its cepstral-mean normalisation over from the last
        decoder = self._decoder_class(samprate=ALIGN_RATE, loglevel="FATAL")
        tokens: list[str] = []  # the words it knows, and a silence where punctuation may make a pause
        for token in _PS_TOKEN.findall(text.lower()):
            if token[0].isalpha():
                if self._known(decoder, token):
                    tokens.append(token)
            elif tokens and tokens[-1] != _SIL:  # else the pause is heard as part of the next word
                tokens.append(_SIL)
        while tokens and tokens[-1] == _SIL:
            tokens.pop()
        if not tokens or len(wav) < ALIGN_RATE // 10:
            return []
        pcm = (np.clip(wav, -1.0, 1.0) * 32767).astype("<i2").tobytes()  # 16-bit little-endian PCM
        try:
            decoder.set_align_text(" ".join(tokens))
            decoder.start_utt()
            decoder.process_raw(pcm, full_utt=True)
            decoder.end_utt()
            segments = list(decoder.seg())
        except RuntimeError:  # the audio cannot hold the text (far too short): nothing to place
            return []
        out = []
        for seg in segments:
            word = re.sub(r"\(\d+\)$", "", seg.word)  # "the(2)": the dictionary's second pronunciation
            if word.startswith(("<", "[")):  # silence, sentence marks, noise
                continue
            out.append(WordTime(word, seg.start_frame * _PS_FRAME_S, (seg.end_frame + 1) * _PS_FRAME_S))
        return out

    @staticmethod
    def _known(decoder: object, word: str) -> bool:
        """Whether the decoder can say `word`, adding it from the festival CMU lexicon when its dictionary lacks it."""
        if decoder.lookup_word(word) is not None:  # type: ignore[attr-defined]
            return True
        phones = [re.sub(r"\d", "", p).replace("ax", "ah").upper() for p in lookup(word)]
        if not phones:
            return False
        try:
            decoder.add_word(word, " ".join(phones), True)  # type: ignore[attr-defined]
        except RuntimeError:
            return False
        return True


def default_aligner(tokenizer: object, language: str) -> Aligner:
    """The built-in choice for a model: its labels when it reads phones, else pocketsphinx for English text;
    InputError for another language (pass an aligner of your own: `load_aligner`)."""
    if isinstance(tokenizer, PhoneTokenizer):
        return LabelAligner(tokenizer)
    if language not in ("auto", "en"):
        raise InputError(f"word timestamps in {language!r} need an aligner for that language (--aligner "
                         "module:factory); the built-in one aligns English")
    return PocketsphinxAligner()


def load_aligner(spec: str) -> Callable[[], Aligner] | None:
    """`auto` (None: `default_aligner` per model and language), or `module:factory` -> that factory."""
    if spec == "auto":
        return None
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise InputError(f"aligner must be 'auto' or 'module:factory', got {spec!r}")
    try:
        factory = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise InputError(f"cannot load aligner {spec!r}: {exc}") from None
    if not callable(factory):
        raise InputError(f"aligner {spec!r} is not callable")
    return factory


class WordTimer:
    """One request's word times, from its chunks in order: `push` each chunk, get the words its sentence end
    completed (times from the start of the request's audio)."""

    def __init__(self, aligner: Aligner, texts: Sequence[str]) -> None:
        """texts: each sentence's text as the model read it (`Frontend.segment_texts`)."""
        self.aligner, self.texts = aligner, list(texts)
        self._parts: list[np.ndarray] = []
        self._start = 0  # samples before the sentence being collected
        self.words: list[WordTime] = []  # every word timed so far

    def push(self, chunk: AudioChunk) -> list[WordTime]:
        self._parts.append(chunk.samples)
        if not (chunk.speech_ids or chunk.final):
            return []
        wav = np.concatenate(self._parts) if self._parts else np.zeros(0, np.float32)
        self._parts = []
        offset = self._start / chunk.sample_rate
        self._start += len(wav)
        if chunk.segment >= len(self.texts) or not len(wav):
            return []
        words = [WordTime(w.word, w.start + offset, w.end + offset)
                 for w in self.aligner(self.texts[chunk.segment], wav, chunk.sample_rate, chunk.speech_ids)]
        self.words += words
        return words
