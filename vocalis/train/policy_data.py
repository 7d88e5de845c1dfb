"""Inputs of preference and reinforcement fine-tuning: speech-token sequences, preference pairs and prompts.

Pairs (`vocalis train dpo`), one JSON object per line, ids as the model reads them:
    {"text_token": [...], "chosen": [...], "rejected": [...], "prompt_text_token": [...], "prompt_speech_token": [...]}
(the prompt fields are optional: a zero-shot voice's transcript ids and speech ids). `vocalis train grpo` appends
each round's best and worst rollout of every group to `<out>/rollouts.jsonl` in this form.

Prompts (`vocalis train grpo`), one per line: {"text": "..."} read with the model's text frontend, or
{"text_token": [...]} ids; optionally "voice" (a voice of the model: its prompt) or "prompt_text_token" /
"prompt_speech_token".
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

from vocalis.errors import InputError


def shuffled_positions(n: int, seed: int, start: int, count: int) -> list[int]:
    """Item indices at positions start .. start + count of a stream of epochs over n items, each epoch a seeded
    shuffle (the same on every rank and after a resume): what DPO's pairs and GRPO's prompts are read in."""
    out: list[int] = []
    orders: dict[int, list[int]] = {}
    for j in range(start, start + count):
        epoch, i = divmod(j, n)
        if epoch not in orders:
            orders[epoch] = list(range(n))
            random.Random(f"{seed}-{epoch}").shuffle(orders[epoch])
        out.append(orders[epoch][i])
    return out


@dataclass(frozen=True, slots=True)
class SpeechSequence:
    """One unistream sequence the LM scores: [sos] prompt_text + text [task] prompt_speech, then speech_ids (and
    eos when `stopped`)."""

    text_ids: tuple[int, ...]
    speech_ids: tuple[int, ...]
    prompt_text_ids: tuple[int, ...] = ()
    prompt_speech_ids: tuple[int, ...] = ()
    stopped: bool = True


@dataclass(frozen=True, slots=True)
class Pair:
    chosen: SpeechSequence
    rejected: SpeechSequence


@dataclass(frozen=True, slots=True)
class Prompt:
    text: str  # "" when given as ids
    text_ids: tuple[int, ...]  # empty: read `text` with the model's frontend
    voice: str | None = None
    prompt_text_ids: tuple[int, ...] = ()
    prompt_speech_ids: tuple[int, ...] = ()


def _lines(path: str | Path) -> list[tuple[int, dict]]:
    p = Path(path)
    if not str(path) or not p.is_file():
        raise InputError(f"policy.data: no such file {str(path)!r} (JSON lines)")
    rows = []
    for n, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise InputError(f"{p}:{n}: not JSON ({exc})") from None
        if not isinstance(row, dict):
            raise InputError(f"{p}:{n}: expected an object")
        rows.append((n, row))
    if not rows:
        raise InputError(f"{p} holds no lines")
    return rows


def _ids(row: dict, key: str, where: str, required: bool = True) -> tuple[int, ...]:
    value = row.get(key, [] if not required else None)
    if not isinstance(value, list) or not all(isinstance(i, int) and i >= 0 for i in value):
        raise InputError(f"{where}: {key!r} must be a list of ids (whole numbers >= 0)")
    if required and not value:
        raise InputError(f"{where}: {key!r} is empty")
    return tuple(value)


def read_pairs(path: str | Path, num_speech: int) -> list[Pair]:
    """Preference pairs; speech ids must be < num_speech (the model's speech token count)."""
    pairs = []
    for n, row in _lines(path):
        where = f"{path}:{n}"
        text = _ids(row, "text_token", where)
        pt, ps = _ids(row, "prompt_text_token", where, False), _ids(row, "prompt_speech_token", where, False)
        seqs = []
        for key in ("chosen", "rejected"):
            ids = _ids(row, key, where)
            if max(ids + ps) >= num_speech:
                raise InputError(f"{where}: speech id {max(ids + ps)} is out of range (< {num_speech})")
            seqs.append(SpeechSequence(text, ids, pt, ps))
        pairs.append(Pair(*seqs))
    return pairs


def read_prompts(path: str | Path) -> list[Prompt]:
    prompts = []
    for n, row in _lines(path):
        where = f"{path}:{n}"
        text = row.get("text", "")
        ids = _ids(row, "text_token", where, required=False)
        if not ids and not (isinstance(text, str) and text.strip()):
            raise InputError(f"{where}: give \"text\" or \"text_token\"")
        voice = row.get("voice")
        prompts.append(Prompt(text if isinstance(text, str) else "", ids, voice if isinstance(voice, str) else None,
                              _ids(row, "prompt_text_token", where, False),
                              _ids(row, "prompt_speech_token", where, False)))
    return prompts
