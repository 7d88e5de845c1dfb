"""Voices a server offers: the model's built-in voices, saved voices on disk, and OpenAI's voice names.

Lookup order for a requested name: saved voice, built-in voice, configured alias, OpenAI voice name. OpenAI's
names (alloy, echo, ...) map onto the built-in voices deterministically (the i-th name in OpenAI's list -> the
(i mod n)-th built-in voice in sorted order), so an unchanged OpenAI client always gets the same voice.

Saved voices are `<name>.safetensors` files (`Voice.save/load`) in one folder; names pass `check_voice_name`
(no separators, no `..`) and the resolved path is checked to stay inside the folder.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

from vocalis.errors import InputError, VocalisError
from vocalis.frontend.voice import Voice, check_voice_name

log = logging.getLogger(__name__)

# OpenAI's text-to-speech voice names, in the order their docs list them.
OPENAI_VOICES: tuple[str, ...] = (
    "alloy", "ash", "ballad", "coral", "echo", "fable", "nova", "onyx", "sage", "shimmer", "verse", "marin", "cedar",
)
VOICE_SUFFIX = ".safetensors"


class VoiceNotFound(InputError):
    """No voice by that name (HTTP 404 on the voices routes, 400 inside a synthesis request)."""


class VoiceConflict(VocalisError):
    """The name is taken or read-only (HTTP 409)."""


@dataclass(frozen=True)
class VoiceEntry:
    voice: Voice
    kind: str  # "builtin" | "saved"
    created: float = 0.0

    def info(self) -> dict[str, object]:
        v = self.voice
        modes = ["sft"] if not v.has_prompt_speech else (
            ["zero_shot", "cross_lingual", "instruct", "vc"] if v.prompt_text_ids else ["cross_lingual", "instruct", "vc"]
        )
        return {
            "object": "voice", "id": v.name, "name": v.name, "kind": self.kind, "prompt_text": v.prompt_text,
            "prompt_seconds": round(len(v.prompt_speech_ids) / 25.0, 2), "modes": modes,
            "created_at": int(self.created),
        }


class VoiceStore:
    """Built-in + saved voices, with OpenAI-name mapping. Mutated only from the event loop thread."""

    def __init__(self, builtin: dict[str, Voice], folder: Path | None = None,
                 aliases: dict[str, str] | None = None) -> None:
        self.builtin = {name: VoiceEntry(v, "builtin") for name, v in builtin.items()}
        self.folder = folder
        self.aliases = dict(aliases or {})
        self.saved: dict[str, VoiceEntry] = {}
        self._pending: set[str] = set()  # names being created right now
        self._mtimes: dict[str, float] = {}  # saved voice -> file mtime when loaded
        if folder is not None:
            folder.mkdir(parents=True, exist_ok=True)
            self._sync()
            log.info("loaded %d saved voices from %s", len(self.saved), folder)

    def _sync(self) -> None:
        """Follow the folder: other processes (Ray replicas, a restarted server) may add or delete voices."""
        if self.folder is None:
            return
        on_disk: dict[str, float] = {}
        for path in self.folder.glob(f"*{VOICE_SUFFIX}"):
            try:
                on_disk[path.name[: -len(VOICE_SUFFIX)]] = path.stat().st_mtime
            except OSError:  # deleted meanwhile
                continue
        for name in [n for n in self.saved if n not in on_disk]:
            del self.saved[name]
            self._mtimes.pop(name, None)
        for name, mtime in sorted(on_disk.items()):
            if self._mtimes.get(name) == mtime:
                continue
            self._mtimes[name] = mtime  # also for a bad file, so it is not re-read on every request
            try:
                check_voice_name(name)
                voice = Voice.load(self.folder / f"{name}{VOICE_SUFFIX}")
            except Exception as exc:  # noqa: BLE001  one bad file must not stop the server (safetensors raises
                # its own SafetensorError for a corrupt header, which Voice.load does not wrap)
                log.warning("skipping voice file %s: %s", name, exc)
                self.saved.pop(name, None)
                continue
            self.saved[name] = VoiceEntry(voice, "saved", mtime)

    # ---- lookup -------------------------------------------------------------------------------------
    def entries(self) -> list[VoiceEntry]:
        self._sync()
        return [self.builtin[n] for n in sorted(self.builtin)] + [self.saved[n] for n in sorted(self.saved)]

    def entry(self, name: str) -> VoiceEntry:
        self._sync()
        found = self.saved.get(name) or self.builtin.get(name)
        if found is None:
            raise VoiceNotFound(f"no voice named {name!r}")
        return found

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
        self._sync()
        if name in self.saved or name in self.builtin:
            return self.entry(name).voice
        target = self.alias_target(name)
        if target is not None:
            return self.entry(target).voice
        known = ", ".join(sorted({*self.saved, *self.builtin})) or "none"
        if name.lower() in OPENAI_VOICES:
            raise VoiceNotFound(
                f"voice {name!r} is an OpenAI voice name, and this model has no built-in voice to map it to; "
                f"create a voice with POST /v1/audio/voices or pick one of: {known}"
            )
        raise VoiceNotFound(f"unknown voice {name!r} (known voices: {known}; OpenAI names map to built-in voices)")

    # ---- changes ------------------------------------------------------------------------------------
    def reserve(self, name: str) -> str:
        """Claim a new name before the (slow) voice computation, so two creations cannot race."""
        check_voice_name(name)
        self._sync()
        if name in self.builtin:
            raise VoiceConflict(f"{name!r} is a built-in voice of the model; choose another name")
        if name in self.saved or name in self._pending:
            raise VoiceConflict(f"a voice named {name!r} already exists; delete it first or choose another name")
        self._pending.add(name)
        return name

    def release(self, name: str) -> None:
        self._pending.discard(name)

    def add(self, voice: Voice) -> VoiceEntry:
        """Save a voice reserved with `reserve` (written atomically, so a failure leaves no file)."""
        try:
            created = time.time()
            if self.folder is not None:
                path = self._path(voice.name)
                voice.save(path)
                created = self._mtimes[voice.name] = path.stat().st_mtime
            entry = VoiceEntry(voice, "saved", created)
            self.saved[voice.name] = entry
            return entry
        finally:
            self.release(voice.name)

    def delete(self, name: str) -> None:
        if name in self.builtin:
            raise VoiceConflict(f"{name!r} is a built-in voice of the model and cannot be deleted")
        check_voice_name(name)
        self._sync()
        if name not in self.saved:
            raise VoiceNotFound(f"no saved voice named {name!r}")
        if self.folder is not None:
            self._path(name).unlink(missing_ok=True)
        del self.saved[name]
        self._mtimes.pop(name, None)

    def _path(self, name: str) -> Path:
        assert self.folder is not None
        path = (self.folder / f"{check_voice_name(name)}{VOICE_SUFFIX}").resolve()
        if path.parent != self.folder.resolve():  # belt and braces: the name check already forbids this
            raise InputError(f"invalid voice name {name!r}")
        return path
