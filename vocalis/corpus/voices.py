"""Teacher voices of the synthetic corpus: Debian's festival voices and espeak-ng voice variants.

A `TeacherVoice` is one corpus speaker: an engine, a voice, and fixed prosody settings (rate, pitch), so
the same speaker always sounds the same. `synthesize(voice, text, out)` writes a wav via the engine's
command line. Mandarin goes through pypinyin (Hanzi -> numbered-tone pinyin) to espeak-ng's
`cmn-latn-pinyin` voice, because espeak-ng's own Hanzi reading is wrong for many characters.

Licences (see docs/builtin-model.md): festival and its kal/ked diphone voices and the CMU ARCTIC SLT HTS
voice are under permissive BSD-style/MIT-style terms that allow redistribution and derived works; espeak-ng
is GPL-3.0+, and its output audio is not covered by the GPL.
"""

from __future__ import annotations

import os
import random
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from vocalis.errors import InputError

FESTIVAL_VOICES = ("kal_diphone", "ked_diphone", "cmu_us_slt_arctic_hts")
ESPEAK_LANG_VOICES = {"en": ("en-us", "en-gb", "en-gb-scotland", "en-029"), "zh": ("cmn-latn-pinyin",),
                      "de": ("de",), "fr": ("fr",), "es": ("es",)}
ESPEAK_VARIANTS = ("m1", "m2", "m3", "m4", "m5", "m6", "m7", "f1", "f2", "f3", "f4", "f5", "klatt", "klatt2",
                   "adam", "anika", "linda", "steph", "paul", "robert")
_SYNTH_TIMEOUT_S = 60.0


@dataclass(frozen=True, slots=True)
class TeacherVoice:
    speaker: str  # corpus speaker id, e.g. "fest-kal" or "esp-en-us-f2-170-55"
    engine: str  # "festival" | "espeak"
    voice: str  # festival voice name, or espeak-ng voice (+variant)
    language: str  # "en", "zh", ...
    rate: float = 1.0  # festival: 1/Duration_Stretch; espeak: words per minute / 175
    pitch: int = 50  # espeak only, 0-99


def festival_voices(available_only: bool = True) -> list[TeacherVoice]:
    out = []
    for name in FESTIVAL_VOICES:
        if available_only and not _festival_voice_installed(name):
            continue
        out.append(TeacherVoice(f"fest-{name.split('_')[0] if 'diphone' in name else 'slt'}", "festival", name, "en"))
    return out


def espeak_voices(language: str, count: int, seed: int = 0) -> list[TeacherVoice]:
    """`count` distinct espeak-ng speakers of `language`: base voice x variant x rate x pitch, seeded."""
    if language not in ESPEAK_LANG_VOICES:
        raise InputError(f"no espeak-ng voices configured for {language!r}; known: {', '.join(ESPEAK_LANG_VOICES)}")
    r = random.Random(f"voices:{language}:{seed}")
    out: dict[str, TeacherVoice] = {}
    while len(out) < count:
        base, variant = r.choice(ESPEAK_LANG_VOICES[language]), r.choice(ESPEAK_VARIANTS)
        wpm, pitch = r.choice((140, 155, 170, 185)), r.choice((30, 40, 50, 60, 70))
        spk = f"esp-{base}-{variant}-{wpm}-{pitch}"
        out.setdefault(spk, TeacherVoice(spk, "espeak", f"{base}+{variant}", language, wpm / 175.0, pitch))
    return list(out.values())


def _festival_voice_installed(name: str) -> bool:
    return any(Path(root, lang, name).is_dir() for root in ("/usr/share/festival/voices",)
               for lang in ("english", "us"))


def check_engines(voices: list[TeacherVoice]) -> None:
    need = {"festival": "text2wave", "espeak": "espeak-ng"}
    for engine in sorted({v.engine for v in voices}):
        if shutil.which(need[engine]) is None:
            raise InputError(f"{need[engine]} is not installed (apt-get install festival espeak-ng)")


def pinyin_text(hanzi: str) -> str:
    """Hanzi -> numbered-tone pinyin for espeak-ng's cmn-latn-pinyin ("你好。" -> "ni3 hao3."); neutral tone 5."""
    try:
        from pypinyin import Style, lazy_pinyin
    except ImportError:
        raise InputError("Mandarin corpus text needs pypinyin: pip install pypinyin") from None
    syllables = lazy_pinyin(hanzi, style=Style.TONE3, neutral_tone_with_five=True, errors="default")
    text = " ".join(syllables)
    text = re.sub(r"\s*[，、；：]\s*", ", ", text)
    text = re.sub(r"\s*[。！]\s*", ". ", text)
    text = re.sub(r"\s*？\s*", "? ", text)
    return text.strip()


def _scheme_string(text: str) -> str:
    return '"' + text.replace("\\", " ").replace('"', '\\"') + '"'


def synthesize_batch(voice: TeacherVoice, items: list[tuple[str, Path]]) -> dict[Path, str]:
    """Many texts in one process (festival loads its voice once, which costs more than a short sentence);
    espeak-ng starts fast and runs one process per text. Returns {out: error} for the items that failed."""
    if voice.engine != "festival":
        failed = {}
        for text, out in items:
            try:
                synthesize(voice, text, out)
            except (RuntimeError, subprocess.TimeoutExpired) as exc:
                failed[out] = str(exc)
        return failed
    lines = [f"(voice_{voice.voice})", f"(Parameter.set 'Duration_Stretch {1.0 / voice.rate:.3f})"]
    for text, out in items:
        tmp = out.with_name(out.name + ".tmp.wav")
        lines.append(f"(utt.save.wave (SynthText {_scheme_string(text)}) {_scheme_string(str(tmp))} 'riff)")
    script = items[0][1].with_name(f".batch-{os.getpid()}-{items[0][1].stem}.scm")
    script.write_text("\n".join(lines) + "\n", encoding="utf-8")
    try:
        proc = subprocess.run(["festival", "-b", str(script)], check=False, capture_output=True,
                              timeout=_SYNTH_TIMEOUT_S * max(1, len(items) // 4))
    finally:
        script.unlink(missing_ok=True)
    failed = {}
    for _, out in items:
        tmp = out.with_name(out.name + ".tmp.wav")
        if tmp.is_file() and tmp.stat().st_size > 44:
            os.replace(tmp, out)
        else:
            tmp.unlink(missing_ok=True)
            err = proc.stderr.decode("utf-8", "replace").strip().splitlines()
            failed[out] = f"festival failed for {voice.speaker}: {err[-1] if err else 'no audio written'}"
    return failed


def synthesize(voice: TeacherVoice, text: str, out: Path) -> None:
    """Write `text` spoken by `voice` to wav `out` (atomically: written beside, then renamed)."""
    tmp = out.with_name(out.name + ".tmp.wav")
    if voice.engine == "festival":
        stretch = 1.0 / voice.rate
        cmd = ["text2wave", "-eval", f"(voice_{voice.voice})",
               "-eval", f"(Parameter.set 'Duration_Stretch {stretch:.3f})", "-o", str(tmp)]
        stdin = text
    elif voice.engine == "espeak":
        spoken = pinyin_text(text) if voice.language == "zh" else text
        cmd = ["espeak-ng", "-v", voice.voice, "-s", str(round(175 * voice.rate)), "-p", str(voice.pitch),
               "-w", str(tmp), "--stdin"]
        stdin = spoken
    else:
        raise InputError(f"unknown engine {voice.engine!r}")
    env = {**os.environ, "LC_ALL": "C.UTF-8"}
    proc = subprocess.run(cmd, check=False, input=stdin.encode("utf-8"), capture_output=True,
                          timeout=_SYNTH_TIMEOUT_S, env=env)
    if proc.returncode != 0 or not tmp.is_file() or tmp.stat().st_size <= 44:
        tmp.unlink(missing_ok=True)
        err = proc.stderr.decode("utf-8", "replace").strip().splitlines()
        raise RuntimeError(f"{cmd[0]} failed for {voice.speaker}: {err[-1] if err else 'no audio written'}")
    os.replace(tmp, out)
