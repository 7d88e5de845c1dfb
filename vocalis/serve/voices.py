"""Voices a server offers: the model's built-in voices, saved voices on disk, and OpenAI's voice names.

Lookup order for a requested name: saved voice, built-in voice, configured alias, OpenAI voice name. OpenAI's
names (alloy, echo, ...) map onto the built-in voices deterministically (the i-th name in OpenAI's list -> the
(i mod n)-th built-in voice in sorted order), so an unchanged OpenAI client always gets the same voice.

Saved voices are `<name>.safetensors` files (`Voice.save/load`) in one folder. The folder is indexed once (each
file's header: name, transcript, lengths; no tensors) and re-indexed only when its modification time changes,
which other processes sharing it (Ray replicas, a restarted server) cause when they add or delete a voice, so a
lookup costs one `stat`. A voice's tensors are read when it is first used, and only the most recently used stay
in memory. The folder holds at most `max_saved` voices. Names pass `check_name` (the whole string: letters,
digits, `_ . -`, no `..`, no trailing dot, no Windows device names) and paths are checked to stay inside.
"""

from __future__ import annotations

import json
import logging
import os
import re
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

from vocalis.config import TOKEN_RATE
from vocalis.errors import InputError, VocalisError
from vocalis.frontend.voice import Voice, check_voice_name

log = logging.getLogger(__name__)

# OpenAI's text-to-speech voice names, in the order their docs list them.
OPENAI_VOICES: tuple[str, ...] = (
    "alloy", "ash", "ballad", "coral", "echo", "fable", "nova", "onyx", "sage", "shimmer", "verse", "marin", "cedar",
)
VOICE_SUFFIX = ".safetensors"
LOADED_VOICES = 64  # saved voices whose tensors stay in memory (least recently used dropped first)
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.\-]{0,63}")
# Device names Windows reserves whatever the extension: a file "nul.safetensors" cannot be made there.
_WINDOWS_RESERVED = frozenset({"con", "prn", "aux", "nul", *(f"com{i}" for i in range(10)),
                               *(f"lpt{i}" for i in range(10))})


class VoiceNotFound(InputError):
    """No voice by that name (HTTP 404 on the voices routes, 400 inside a synthesis request)."""


class VoiceConflict(VocalisError):
    """The name is taken or read-only, or the folder is full (HTTP 409)."""


def check_name(name: str) -> str:
    """A voice name that is safe as a file name on every system; InputError (400) otherwise."""
    bad = (not isinstance(name, str) or not _NAME.fullmatch(name) or ".." in name or name.endswith(".")
           or name.split(".", 1)[0].lower() in _WINDOWS_RESERVED)
    if bad:
        raise InputError(f"invalid voice name {name!r}: use 1-64 letters, digits, '_', '.', '-', starting with a "
                         "letter or digit, not ending in '.', and not a Windows device name (con, nul, com1, ...)")
    return check_voice_name(name)


@dataclass(frozen=True)
class VoiceEntry:
    """What listing a voice shows; the tensors are not part of it."""

    name: str
    kind: str  # "builtin" | "saved"
    prompt_text: str
    num_text_ids: int
    num_speech_ids: int
    created: float = 0.0

    @classmethod
    def of(cls, voice: Voice, kind: str, created: float = 0.0) -> VoiceEntry:
        return cls(voice.name, kind, voice.prompt_text, len(voice.prompt_text_ids), len(voice.prompt_speech_ids),
                   created)

    def info(self) -> dict[str, object]:
        modes = ["sft"] if not self.num_speech_ids else (
            ["zero_shot", "cross_lingual", "instruct", "vc"] if self.num_text_ids else ["cross_lingual", "instruct", "vc"]
        )
        return {
            "object": "voice", "id": self.name, "name": self.name, "kind": self.kind, "prompt_text": self.prompt_text,
            "prompt_seconds": round(self.num_speech_ids / TOKEN_RATE, 2), "modes": modes,
            "created_at": int(self.created),
        }


def read_entry(path: Path, name: str) -> VoiceEntry:
    """A saved voice's entry from its file header alone (no tensor data is read)."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
        speech = f.get_slice("prompt_speech_ids").get_shape()
    text_ids = json.loads(meta.get("prompt_text_ids", "[]"))
    return VoiceEntry(name, "saved", meta.get("prompt_text", ""), len(text_ids), int(speech[0]) if speech else 0,
                      path.stat().st_mtime)


class VoiceStore:
    """Built-in + saved voices, with OpenAI-name mapping. Used only from the event loop thread."""

    def __init__(self, builtin: dict[str, Voice], folder: Path | None = None,
                 aliases: dict[str, str] | None = None, max_saved: int = 1000) -> None:
        self.builtin = dict(builtin)
        self._builtin_entries = {name: VoiceEntry.of(v, "builtin") for name, v in builtin.items()}
        self.folder = folder
        self.aliases = dict(aliases or {})
        self.max_saved = max_saved
        self._index: dict[str, VoiceEntry] = {}  # saved voices by name
        self._memory: dict[str, Voice] = {}  # saved voices of a store without a folder
        self._loaded: OrderedDict[str, tuple[float, Voice]] = OrderedDict()  # name -> (file mtime, voice)
        self._pending: set[str] = set()  # names being created right now
        self._folder_mtime: int | None = None
        if folder is not None:
            folder.mkdir(parents=True, exist_ok=True)
            self._reindex()
            log.info("indexed %d saved voices in %s", len(self._index), folder)

    # ---- the folder index -----------------------------------------------------------------------------
    def _stat_folder(self) -> int | None:
        try:
            return os.stat(self.folder).st_mtime_ns if self.folder is not None else None
        except OSError:
            return None

    def _refresh(self) -> None:
        """Re-index when the folder changed (another process added or deleted a voice); else one `stat`."""
        if self.folder is not None and self._stat_folder() != self._folder_mtime:
            self._reindex()

    def _reindex(self) -> None:
        assert self.folder is not None
        self._folder_mtime = self._stat_folder()
        index: dict[str, VoiceEntry] = {}
        with os.scandir(self.folder) as it:
            for item in it:
                if not item.name.endswith(VOICE_SUFFIX):
                    continue
                name = item.name[: -len(VOICE_SUFFIX)]
                try:
                    mtime = item.stat().st_mtime
                    known = self._index.get(name)
                    index[name] = known if known is not None and known.created == mtime else self._read(name)
                except Exception as exc:  # noqa: BLE001  one bad file must not stop the server (safetensors
                    # raises its own SafetensorError for a corrupt header)
                    log.warning("skipping voice file %s: %s", item.name, exc)
        self._index = index
        for name in [n for n in self._loaded if n not in index]:
            del self._loaded[name]

    def _read(self, name: str) -> VoiceEntry:
        check_name(name)
        return read_entry(self._path(name), name)

    def _saved_names(self) -> set[str]:
        return set(self._index) | set(self._memory)

    # ---- lookup -------------------------------------------------------------------------------------
    def entries(self) -> list[VoiceEntry]:
        self._refresh()
        saved = {**self._index, **{n: VoiceEntry.of(v, "saved") for n, v in self._memory.items()}}
        return [self._builtin_entries[n] for n in sorted(self._builtin_entries)] + [saved[n] for n in sorted(saved)]

    def entry(self, name: str) -> VoiceEntry:
        self._refresh()
        if name in self._memory:
            return VoiceEntry.of(self._memory[name], "saved")
        found = self._index.get(name) or self._builtin_entries.get(name)
        if found is None:
            raise VoiceNotFound(f"no voice named {name!r}")
        return found

    def _voice(self, name: str) -> Voice:
        """A saved or built-in voice's tensors (a saved one read from its file when not in memory)."""
        if name in self._memory:
            return self._memory[name]
        entry = self._index.get(name)
        if entry is None:
            if name in self.builtin:
                return self.builtin[name]
            raise VoiceNotFound(f"no voice named {name!r}")
        cached = self._loaded.get(name)
        if cached is not None and cached[0] == entry.created:
            self._loaded.move_to_end(name)
            return cached[1]
        try:
            voice = Voice.load(self._path(name))
        except Exception as exc:  # noqa: BLE001  deleted or broken meanwhile (another process): as if absent
            log.warning("cannot load saved voice %s: %s", name, exc)
            self._index.pop(name, None)
            raise VoiceNotFound(f"no voice named {name!r}") from None
        self._loaded[name] = (entry.created, voice)
        while len(self._loaded) > LOADED_VOICES:
            self._loaded.popitem(last=False)
        return voice

    def alias_target(self, name: str) -> str | None:
        """The voice an alias or OpenAI voice name stands for, or None."""
        if name in self.aliases:
            return self.aliases[name]
        key = name.lower()
        if key in OPENAI_VOICES and self.builtin:
            names = sorted(self.builtin)
            return names[OPENAI_VOICES.index(key) % len(names)]
        return None

    def resolve(self, name: str | None) -> Voice | None:
        """A request's voice name -> `Voice` (None: let the model pick its default voice)."""
        if name is None or name == "":
            return None
        self._refresh()
        if name in self._saved_names() or name in self.builtin:
            return self._voice(name)
        target = self.alias_target(name)
        if target is not None:
            return self._voice(target)
        names = sorted(self._saved_names() | set(self.builtin))
        known = ", ".join(names[:20]) + (f" and {len(names) - 20} more" if len(names) > 20 else "") or "none"
        if name.lower() in OPENAI_VOICES:
            raise VoiceNotFound(
                f"voice {name!r} is an OpenAI voice name, and this model has no built-in voice to map it to; "
                f"create a voice with POST /v1/audio/voices or pick one of: {known}"
            )
        raise VoiceNotFound(f"unknown voice {name!r} (known voices: {known}; OpenAI names map to built-in voices)")

    # ---- changes ------------------------------------------------------------------------------------
    def reserve(self, name: str) -> str:
        """Claim a new name before the (slow) voice computation, so two creations cannot race."""
        check_name(name)
        self._refresh()
        if name in self.builtin:
            raise VoiceConflict(f"{name!r} is a built-in voice of the model; choose another name")
        if name in self._saved_names() or name in self._pending:
            raise VoiceConflict(f"a voice named {name!r} already exists; delete it first or choose another name")
        if len(self._saved_names()) + len(self._pending) >= self.max_saved:
            raise VoiceConflict(f"this server keeps at most {self.max_saved} saved voices; delete one first")
        self._pending.add(name)
        return name

    def release(self, name: str) -> None:
        self._pending.discard(name)

    def add(self, voice: Voice) -> VoiceEntry:
        """Save a voice reserved with `reserve` (written atomically, so a failure leaves no file)."""
        try:
            if self.folder is None:
                self._memory[voice.name] = voice
                return VoiceEntry.of(voice, "saved", time.time())
            path = self._path(voice.name)
            changed_before = self._stat_folder() == self._folder_mtime
            voice.save(path)
            entry = VoiceEntry.of(voice, "saved", path.stat().st_mtime)
            self._index[voice.name] = entry
            self._loaded[voice.name] = (entry.created, voice)
            if changed_before:  # only our own write changed the folder: no need to re-read it
                self._folder_mtime = self._stat_folder()
            return entry
        finally:
            self.release(voice.name)

    def delete(self, name: str) -> None:
        if name in self.builtin:
            raise VoiceConflict(f"{name!r} is a built-in voice of the model and cannot be deleted")
        check_name(name)
        self._refresh()
        if name not in self._saved_names():
            raise VoiceNotFound(f"no saved voice named {name!r}")
        if name in self._memory:
            del self._memory[name]
            return
        changed_before = self._stat_folder() == self._folder_mtime
        self._path(name).unlink(missing_ok=True)
        self._index.pop(name, None)
        self._loaded.pop(name, None)
        if changed_before:
            self._folder_mtime = self._stat_folder()

    def _path(self, name: str) -> Path:
        assert self.folder is not None
        path = (self.folder / f"{check_name(name)}{VOICE_SUFFIX}").resolve()
        if path.parent != self.folder.resolve():  # belt and braces: the name check already forbids this
            raise InputError(f"invalid voice name {name!r}")
        return path
