"""Synthesis manifests: what to say, in which voice, under which id. Read by `vocalis infer` and `vocalis eval`.

Two line formats, chosen per line (a line starting with `{` is JSON):

- jsonl: `{"id": "utt1", "text": "...", "prompt_wav": "p.wav", "prompt_text": "...", "voice": "name"}`;
  optional `instruct`, `seed`, `speed`, `language`, `reference_wav` (the ground-truth recording of `text`);
  other fields are ignored, so metadata can ride along.
  Give either `voice` or `prompt_wav` (with or without `prompt_text`), or neither for the model's default voice.
- seed-tts-eval: `id|prompt text|prompt wav|target text`, optionally a 5th field with the ground-truth wav.

Relative wav paths are resolved against the manifest's folder. Empty lines and lines starting with `#` are
ignored. A bad line becomes an item with `error` set (that item fails, never the whole run).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from vocalis.errors import InputError

_ID = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.\-]{0,199}$")


@dataclass(frozen=True)
class ManifestItem:
    """One utterance. `line` is 1-based; `error` is None for a valid item."""

    line: int
    id: str
    text: str = ""
    prompt_wav: Path | None = None
    prompt_text: str = ""
    voice: str | None = None
    instruct: str = ""
    seed: int | None = None
    speed: float = 1.0
    language: str = "auto"
    reference_wav: Path | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


def check_item_id(item_id: str) -> str:
    """Ids become file names: letters, digits, `_ . -`, no path separators, no leading dot, <= 200 chars."""
    if not _ID.match(item_id) or ".." in item_id:
        raise ValueError(f"invalid id {item_id!r}: use 1-200 letters, digits, '_', '.', '-' (no leading '.')")
    return item_id


def _resolve(base: Path, value: str) -> Path:
    path = Path(value).expanduser()
    return path if path.is_absolute() else base / path


def _parse_json(obj: object, base: Path, line: int) -> ManifestItem:
    if not isinstance(obj, dict):
        raise ValueError(f"expected a JSON object, got {type(obj).__name__}")
    def text_field(key: str) -> str:
        value = obj.get(key, "")
        if value is None:
            return ""
        if not isinstance(value, str):
            raise ValueError(f"{key!r} must be a string, got {type(value).__name__}")
        return value

    item_id = obj.get("id")
    if isinstance(item_id, int) and not isinstance(item_id, bool):
        item_id = str(item_id)
    if not isinstance(item_id, str):
        raise ValueError("missing 'id' (a string)")
    check_item_id(item_id)
    seed = obj.get("seed")
    if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
        raise ValueError(f"'seed' must be an integer, got {seed!r}")
    speed = obj.get("speed", 1.0)
    if not isinstance(speed, (int, float)) or isinstance(speed, bool):
        raise ValueError(f"'speed' must be a number, got {speed!r}")
    prompt_wav, voice = text_field("prompt_wav"), text_field("voice")
    if prompt_wav and voice:
        raise ValueError("give either 'voice' or 'prompt_wav', not both")
    if text_field("prompt_text") and not prompt_wav:
        raise ValueError("'prompt_text' needs 'prompt_wav'")
    reference = text_field("reference_wav")
    return ManifestItem(
        line, item_id, text_field("text"),
        prompt_wav=_resolve(base, prompt_wav) if prompt_wav else None,
        prompt_text=text_field("prompt_text"), voice=voice or None, instruct=text_field("instruct"),
        seed=seed, speed=float(speed), language=text_field("language") or "auto",
        reference_wav=_resolve(base, reference) if reference else None,
    )


def _parse_seed_tts(raw: str, base: Path, line: int) -> ManifestItem:
    fields = raw.split("|")
    if len(fields) not in (4, 5):
        raise ValueError(
            f"expected 'id|prompt text|prompt wav|target text[|target wav]' (4 or 5 fields), got {len(fields)}"
        )
    item_id, prompt_text, prompt_wav, text = (f.strip() for f in fields[:4])
    check_item_id(item_id)
    if not prompt_wav:
        raise ValueError("empty prompt wav field")
    reference = fields[4].strip() if len(fields) == 5 else ""
    return ManifestItem(line, item_id, text, prompt_wav=_resolve(base, prompt_wav), prompt_text=prompt_text,
                        reference_wav=_resolve(base, reference) if reference else None)


def _guess_id(raw: str, line: int) -> str:
    """An id for a line that could not be parsed: its own id when readable, else `line<N>`."""
    candidate = raw.split("|", 1)[0].strip() if not raw.lstrip().startswith("{") else ""
    if not candidate:
        match = re.search(r'"id"\s*:\s*"([^"]+)"', raw)
        candidate = match.group(1) if match else ""
    return candidate if candidate and _ID.match(candidate) and ".." not in candidate else f"line{line}"


def parse_line(raw: str, base: Path, line: int) -> ManifestItem | None:
    """One manifest line -> item (with `error` set when bad), or None for blank/comment lines."""
    stripped = raw.strip()
    if not stripped or stripped.startswith("#"):
        return None
    try:
        if stripped.startswith("{"):
            try:
                obj = json.loads(stripped)
            except json.JSONDecodeError as exc:
                raise ValueError(f"invalid JSON ({exc.msg} at column {exc.colno})") from None
            item = _parse_json(obj, base, line)
        else:
            item = _parse_seed_tts(stripped, base, line)
    except ValueError as exc:
        return ManifestItem(line, _guess_id(stripped, line), error=f"line {line}: {exc}")
    if not item.text.strip():
        return ManifestItem(line, item.id, error=f"line {line}: empty text")
    return item


def read_manifest(path: str | Path) -> list[ManifestItem]:
    """Every item of the manifest in file order. Duplicate ids: later ones get an error.

    Raises InputError only when the file itself cannot be read.
    """
    manifest = Path(path)
    try:
        lines = manifest.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        raise InputError(f"manifest not found: {manifest}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise InputError(f"cannot read manifest {manifest}: {exc}") from None
    base = manifest.resolve().parent
    items: list[ManifestItem] = []
    seen: dict[str, int] = {}
    for number, raw in enumerate(lines, start=1):
        item = parse_line(raw, base, number)
        if item is None:
            continue
        if item.ok and item.id in seen:
            item = ManifestItem(number, item.id,
                                error=f"line {number}: duplicate id {item.id!r} (first on line {seen[item.id]})")
        elif item.ok:
            seen[item.id] = number
        items.append(item)
    return items
