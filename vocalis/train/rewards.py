"""Reward scorers of GRPO rollouts: pluggable functions from a group of rollouts to one number each.

Built in (names for `grpo.rewards`):
- `length`: -|N - target| / target, N the speech ids produced; target `grpo.target_length`, or
  `grpo.target_tokens_per_text_token` x the text's ids.
- `repetition`: -(share of repeated n-grams of speech ids) (0 when no n-gram repeats; `grpo.repetition_ngram`).
- `wer`: -WER of an ASR transcript of the rollout's audio against its text (`grpo.asr`: the eval toolkit's
  pocketsphinx, English, offline; or `module:factory` for your own transcriber, see `vocalis.eval.asr`).
- `similarity`: cosine of the model's speaker encoder on the rollout's audio and the voice's embedding.
Your own: `module:factory`, where factory(config: GRPOConfig) returns a callable (rollouts) -> list of floats,
optionally with `needs_audio = True` to get each rollout's waveform.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from vocalis.errors import InputError
from vocalis.train.policy_config import GRPOConfig
from vocalis.train.policy_data import SpeechSequence

AUDIO_RATE = 16000  # waveforms handed to scorers


@dataclass(slots=True)
class Rollout:
    """One sampled sequence: its text (empty when the prompt gave ids), ids, and (for scorers that need it) its
    waveform at AUDIO_RATE, and the voice's speaker embedding."""

    text: str
    sequence: SpeechSequence
    audio: np.ndarray | None = None
    voice_embedding: np.ndarray | None = None


class RewardScorer(Protocol):
    needs_audio: bool

    def __call__(self, rollouts: Sequence[Rollout]) -> list[float]: ...


class LengthScorer:
    needs_audio = False

    def __init__(self, config: GRPOConfig) -> None:
        if config.target_length <= 0 and config.target_tokens_per_text_token <= 0:
            raise InputError("the length reward needs grpo.target_length or grpo.target_tokens_per_text_token")
        self.target, self.ratio = config.target_length, config.target_tokens_per_text_token

    def __call__(self, rollouts: Sequence[Rollout]) -> list[float]:
        out = []
        for r in rollouts:
            target = self.target if self.target > 0 else self.ratio * len(r.sequence.text_ids)
            out.append(-abs(len(r.sequence.speech_ids) - target) / max(target, 1.0))
        return out


class RepetitionScorer:
    needs_audio = False

    def __init__(self, config: GRPOConfig) -> None:
        self.n = config.repetition_ngram

    def __call__(self, rollouts: Sequence[Rollout]) -> list[float]:
        out = []
        for r in rollouts:
            ids = r.sequence.speech_ids
            grams = [tuple(ids[i:i + self.n]) for i in range(len(ids) - self.n + 1)]
            out.append(-(1.0 - len(set(grams)) / len(grams)) if grams else 0.0)
        return out


class WERScorer:
    needs_audio = True

    def __init__(self, config: GRPOConfig) -> None:
        from vocalis.eval.asr import load_transcriber

        transcriber = load_transcriber(config.asr, config.language)
        if transcriber is None:
            raise InputError("the wer reward needs a transcriber (grpo.asr)")
        self.transcribe = transcriber
        self.language = config.language

    def __call__(self, rollouts: Sequence[Rollout]) -> list[float]:
        from vocalis.eval.wer import wer

        out = []
        for r in rollouts:
            if not r.text:
                raise InputError("the wer reward needs prompts given as text")
            assert r.audio is not None
            hyp = self.transcribe(r.audio, AUDIO_RATE) if r.audio.size else ""
            out.append(-min(wer(r.text, hyp, self.language), 1.0))
        return out


class SimilarityScorer:
    needs_audio = True

    def __init__(self, embed: Callable[[np.ndarray], np.ndarray]) -> None:
        self.embed = embed

    def __call__(self, rollouts: Sequence[Rollout]) -> list[float]:
        from vocalis.eval.similarity import cosine

        out = []
        for r in rollouts:
            if r.voice_embedding is None:
                raise InputError("the similarity reward needs prompts with a voice")
            assert r.audio is not None
            out.append(cosine(np.asarray(self.embed(r.audio)).reshape(-1), r.voice_embedding.reshape(-1))
                       if r.audio.size >= AUDIO_RATE // 10 else 0.0)
        return out


def build_scorers(config: GRPOConfig, speaker_embed: Callable[[np.ndarray], np.ndarray] | None
                  ) -> list[RewardScorer]:
    """The scorers named in `config.rewards` (speaker_embed: the model's speaker encoder, for `similarity`)."""
    scorers: list[RewardScorer] = []
    for name in config.rewards:
        if name == "length":
            scorers.append(LengthScorer(config))
        elif name == "repetition":
            scorers.append(RepetitionScorer(config))
        elif name == "wer":
            scorers.append(WERScorer(config))
        elif name == "similarity":
            if speaker_embed is None:
                raise InputError("the similarity reward needs a model directory with a speaker encoder "
                                 "(model.init_from)")
            scorers.append(SimilarityScorer(speaker_embed))
        elif ":" in name:
            scorers.append(_plugin(name, config))
        else:
            raise InputError(f"unknown reward {name!r}; choose length, repetition, wer, similarity or module:factory")
    return scorers


def _plugin(spec: str, config: GRPOConfig) -> RewardScorer:
    module_name, _, attr = spec.partition(":")
    try:
        factory = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise InputError(f"reward {spec!r}: cannot import it ({exc})") from None
    scorer = factory(config)
    if not callable(scorer):
        raise InputError(f"reward {spec!r}: its factory returned {type(scorer).__name__}, not a callable")
    if not hasattr(scorer, "needs_audio"):
        try:
            scorer.needs_audio = False  # type: ignore[attr-defined]
        except AttributeError:
            pass
    return scorer
