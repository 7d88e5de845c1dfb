"""What a test needs from outside Python (Debian packages, a browser): skipped with the reason on a machine without
it, a failure under `CI=true`, where `.ci/run` installs it. One place, so that the README's test command passes on a
machine with nothing but Python."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from vocalis.corpus.sentences import FORTUNE_DIR, WORDNET_DIR

FESTIVAL_VOICES = Path("/usr/share/festival/voices")
# voice -> (folder under FESTIVAL_VOICES, Debian package)
FESTIVAL_VOICE_DIRS = {"slt": ("us/cmu_us_slt_arctic_hts", "festvox-us-slt-hts"),
                       "kal": ("english/kal_diphone", "festvox-kallpc16k"),
                       "ked": ("english/ked_diphone", "festvox-kdlpc16k")}
FESTIVAL_CMU = Path("/usr/share/festival/dicts/cmu")


def in_ci() -> bool:
    return os.environ.get("CI") == "true"


def require(ok: bool, what: str) -> None:
    """Skip (a failure under CI=true) unless `ok`; `what` names what is missing and how to install it."""
    if ok:
        return
    if in_ci():
        pytest.fail(f"{what} is missing: broken CI set-up (.ci/run installs it)")
    pytest.skip(f"{what} is not installed (.ci/run installs it)")


def need_program(name: str, package: str) -> str:
    """The path of executable `name` (from Debian package `package`)."""
    path = shutil.which(name)
    require(path is not None, f"{name} (apt-get install {package})")
    return path or name


def need_festival(*voices: str) -> None:
    """festival itself and the named voices (`slt`, `kal`, `ked`)."""
    need_program("festival", "festival")
    for voice in voices:
        folder, package = FESTIVAL_VOICE_DIRS[voice]
        require((FESTIVAL_VOICES / folder).is_dir(), f"festival's {voice} voice (apt-get install {package})")


def need_wordnet() -> None:
    """WordNet's glosses (the held-out sentences come from their examples)."""
    require((WORDNET_DIR / "data.noun").is_file(), f"WordNet in {WORDNET_DIR} (apt-get install wordnet-base)")


def need_text_sources() -> None:
    """WordNet's example sentences and the fortunes one-liners, which the built-in corpus's text recipe reads."""
    need_wordnet()
    require(all((FORTUNE_DIR / name).is_file() for name in ("fortunes", "literature")),
            f"fortunes in {FORTUNE_DIR} (apt-get install fortunes fortunes-min)")
