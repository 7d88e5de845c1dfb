"""Training manifests: a JSON-lines file or a Kaldi-style data directory -> a list of `Utterance`.

JSON lines: one object per line with `wav` (path, relative paths are taken from the manifest's folder) and
`text`, optional `speaker` (default: the utterance id), `language` (default "auto") and `utt` (default: the
wav file's stem, made unique). Kaldi directory: `wav.scp` (`utt path`; relative paths from the working directory,
else from the data directory), `text` (`utt words...`), optional `utt2spk` and `utt2lang`. Malformed lines are reported, not guessed at.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from vocalis.errors import InputError


@dataclass(frozen=True, slots=True)
class Utterance:
    utt: str
    wav: str
    text: str
    speaker: str
    language: str = "auto"


def read_manifest(path: str | Path) -> list[Utterance]:
    """A `.jsonl` file or a Kaldi data directory; InputError naming the line for anything malformed."""
    path = Path(path)
    if path.is_dir():
        return _read_kaldi(path)
    if not path.is_file():
        raise InputError(f"manifest not found: {path}")
    return _read_jsonl(path)


def _read_jsonl(path: Path) -> list[Utterance]:
    out: list[Utterance] = []
    seen: set[str] = set()
    for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise InputError(f"{path}:{lineno}: not valid JSON ({exc.msg})") from exc
        if not isinstance(row, dict) or "wav" not in row:
            raise InputError(f"{path}:{lineno}: expected an object with at least 'wav' and 'text'")
        wav = Path(str(row["wav"]))
        wav = wav if wav.is_absolute() else path.parent / wav
        utt = str(row.get("utt") or wav.stem)
        base, n = utt, 1
        while utt in seen:  # [dup] stems repeat across speaker folders; ids must not
            n += 1
            utt = f"{base}#{n}"
        seen.add(utt)
        text = row.get("text")
        out.append(Utterance(utt, str(wav), "" if text is None else str(text), str(row.get("speaker") or utt),
                             str(row.get("language") or "auto")))
    return out


def _read_table(path: Path, required: bool) -> dict[str, str]:
    if not path.is_file():
        if required:
            raise InputError(f"Kaldi data directory lacks {path.name}: {path}")
        return {}
    table: dict[str, str] = {}
    for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        key, _, value = line.strip().partition(" ")
        if key in table:
            raise InputError(f"{path}:{lineno}: utterance {key!r} appears twice")
        table[key] = value.strip()
    return table


def _read_kaldi(directory: Path) -> list[Utterance]:
    wavs = _read_table(directory / "wav.scp", required=True)
    texts = _read_table(directory / "text", required=True)
    spks = _read_table(directory / "utt2spk", required=False)
    langs = _read_table(directory / "utt2lang", required=False)
    out = []
    for utt, wav in wavs.items():
        p = Path(wav)
        # Kaldi paths are relative to the recipe folder (the working directory); fall back to the data folder.
        if not (p.is_absolute() or wav.endswith("|") or p.exists()):
            p = directory / p
        out.append(Utterance(utt, str(p), texts.get(utt, ""), spks.get(utt, utt), langs.get(utt, "auto")))
    return out
