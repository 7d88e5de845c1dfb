"""English text with a real vocabulary for the phone-based corpus: Debian's WordNet example sentences, `fortunes`
one-liners and the number/date templates of `text.py`.

Every source is a Debian package read from its installed files (`wordnet-base`, `fortunes`, `fortunes-min`), so
the recipe is rebuilt on any machine from package names alone. `recipe(n, seed)` is a pure function of the
installed files and its arguments: sources are read, filtered and de-duplicated, sorted, then drawn with a seeded
Random. The 50 held-out WordNet sentences (`heldout_wordnet`) are drawn first, with their own seed, and never enter
a training recipe.

Filter (both sources): plain ASCII letters, spaces and the punctuation ``, ; : ' ? ! . -`` only (no digits: the
teacher and the phone frontend would read them differently), 4 to 24 words, no abbreviation-like tokens (an inner
period, a capitalised word of more than one letter in capitals).
"""

from __future__ import annotations

import os
import random
import re
from functools import lru_cache
from pathlib import Path

from vocalis.corpus.text import sentences as template_sentences
from vocalis.errors import InputError

# Debian's data packages; VOCALIS_SHARE_DIR stands for /usr/share where they were unpacked elsewhere (a machine that
# cannot install them)
SHARE_DIR = Path(os.environ.get("VOCALIS_SHARE_DIR", "/usr/share"))
WORDNET_DIR = SHARE_DIR / "wordnet"
FORTUNE_DIR = SHARE_DIR / "games" / "fortunes"
FORTUNE_FILES = ("fortunes", "literature", "riddles", "wisdom", "people", "platitudes", "humorists", "men-women",
                 "work", "love", "food", "pets", "sports", "science", "education", "kids", "miscellaneous")
# A fixed sentence a teacher speaks as a voice prompt (the measurement's prompts, the phone model's default voice).
PROMPT_SENTENCE = "Please read the next sentence slowly and clearly, as if you were talking to a friend."
HELDOUT_SEED = 1_000_021
NUM_HELDOUT = 50
MIN_WORDS, MAX_WORDS = 4, 24
_ALLOWED = re.compile(r"^[A-Za-z ,;:'?!.\-]+$")
_TERMINAL = ".?!"


def clean(text: str) -> str | None:
    """One candidate line -> a corpus sentence (capitalised, terminal punctuation), or None if filtered out."""
    text = " ".join(text.replace("`", "'").split())
    text = text.strip(" -'")
    if not text or not _ALLOWED.match(text) or "--" in text or "''" in text:
        return None
    words = text.split()
    if not MIN_WORDS <= len(words) <= MAX_WORDS:
        return None
    for w in words:
        core = w.strip(",;:'?!.-")
        if not core or "." in core or (len(core) > 1 and core.isupper()) or core.startswith("-") or "'" in core[:1]:
            return None
    if text[-1] not in _TERMINAL:
        text = text.rstrip(",;:-") + "."
    return text[0].upper() + text[1:]


def wordnet_examples(root: Path = WORDNET_DIR) -> list[str]:
    """The quoted example sentences of WordNet's glosses, filtered, de-duplicated and sorted."""
    if not (root / "data.noun").is_file():
        raise InputError(f"WordNet not found in {root}: apt-get install wordnet-base")
    found: set[str] = set()
    for pos in ("noun", "verb", "adj", "adv"):
        for line in (root / f"data.{pos}").read_text(encoding="latin-1").splitlines():
            if line.startswith("  ") or " | " not in line:
                continue
            for quoted in re.findall(r'"([^"]+)"', line.split(" | ", 1)[1]):
                if (s := clean(quoted)) is not None:
                    found.add(s)
    return sorted(found)


def fortune_one_liners(root: Path = FORTUNE_DIR, files: tuple[str, ...] = FORTUNE_FILES) -> list[str]:
    """Fortunes of one or two lines without an attribution, filtered, de-duplicated and sorted."""
    found: set[str] = set()
    for name in files:
        path = root / name
        if not path.is_file():
            continue
        for entry in re.split(r"^%$", path.read_text(encoding="latin-1"), flags=re.MULTILINE):
            lines = [ln for ln in entry.strip().splitlines() if ln.strip()]
            if 1 <= len(lines) <= 2 and (s := clean(" ".join(lines))) is not None:
                found.add(s)
    if not found:
        raise InputError(f"no fortunes found in {root}: apt-get install fortunes fortunes-min")
    return sorted(found)


@lru_cache(maxsize=2)
def _wordnet_split(root: str = str(WORDNET_DIR)) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(held-out, training) WordNet sentences: the held-out 50 drawn once with HELDOUT_SEED."""
    pool = wordnet_examples(Path(root))
    heldout = set(random.Random(HELDOUT_SEED).sample(pool, NUM_HELDOUT))
    return tuple(sorted(heldout)), tuple(s for s in pool if s not in heldout)


def heldout_wordnet() -> list[str]:
    """The 50 WordNet sentences that no training recipe contains (rung L7 of docs/builtin-model.md)."""
    return list(_wordnet_split()[0])


def recipe(n: int, seed: int = 0, shares: tuple[float, float, float] = (0.7, 0.2, 0.1)) -> list[str]:
    """`n` training sentences: WordNet examples, fortune one-liners and number/date templates in `shares`.

    Deterministic for (installed packages, seed), and `recipe(n)` is the first n of `recipe(m)` for m > n, so a
    corpus grows by asking for more. Each sentence's source is drawn per position; within a source no sentence
    repeats while the source lasts.
    """
    heldout, wordnet = _wordnet_split()
    fortunes = [s for s in fortune_one_liners() if s not in set(heldout)]
    mix = random.Random(f"mix:{seed}")
    kinds = [mix.choices((0, 1, 2), weights=shares)[0] for _ in range(n)]
    pools = [_draw(list(wordnet), kinds.count(0), random.Random(f"wordnet:{seed}")),
             _draw(fortunes, kinds.count(1), random.Random(f"fortunes:{seed}")),
             template_sentences("en", kinds.count(2), seed=seed, exclude=frozenset(heldout))]
    taken = [0, 0, 0]
    out = []
    for k in kinds:
        out.append(pools[k][taken[k]])
        taken[k] += 1
    return out


def _draw(pool: list[str], k: int, r: random.Random) -> list[str]:
    """The first k of an endless sequence of shuffled passes over `pool` (a prefix of any larger k's)."""
    out: list[str] = []
    while len(out) < k:
        block = pool[:]
        r.shuffle(block)
        out += block[: k - len(out)]
    return out
