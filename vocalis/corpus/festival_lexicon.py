"""Build the built-in model's pronunciation asset from festival's CMU lexicon (Debian `festlex-cmu`).

`vocalis/assets/builtin/cmulex.txt.xz` holds festival's `cmudict-0.4.out` and the `cmulex.scm` addenda as
`word<TAB>pos<TAB>phones` lines (vowels carry their syllable's stress digit, e.g. `hh ax0 l ow1`), addenda first
(festival looks them up first); `vocalis/assets/builtin/cmults.json.xz` holds `cmu_lts_rules.scm`'s letter-to-sound
CART trees as nested lists: a question node `[offset, letter, yes, no]` asks whether the letter `offset` places
away is `letter` (`#` the word edge, `0` beyond it); a leaf is the predicted phone string (`_epsilon_` for none,
`k-s` for two). `vocalis.frontend.phones` reads both; festival is not needed at inference.

    python -m vocalis.corpus.festival_lexicon [--dicts /usr/share/festival/dicts/cmu] [--out vocalis/assets/builtin]

Licence: festival's CMU lexicon and rules carry the CSTR/CMU X11-style notice (use, copy, modify, distribute,
keeping the notice), reproduced in the asset folder's LICENSE.
"""

from __future__ import annotations

import argparse
import json
import lzma
import re
from pathlib import Path

DICTS = Path("/usr/share/festival/dicts/cmu")
OUT = Path(__file__).resolve().parents[1] / "assets" / "builtin"
_FEATURES = {"p.p.p.name": -3, "p.p.name": -2, "p.name": -1, "name": 0, "n.name": 1, "n.n.name": 2, "n.n.n.name": 3}
_ENTRY = re.compile(r'\("((?:[^"\\]|\\.)*)"\s+(\S+)\s+\((.*)\)\)\s*$')
_SYLLABLE = re.compile(r"\(\(([^()]*)\)\s*(\d)\)")


def _phones(syllables: str) -> str:
    """`((hh ax) 0) ((l ow) 1)` -> `hh ax0 l ow1` (vowels take their syllable's stress)."""
    out = []
    for phones, stress in _SYLLABLE.findall(syllables):
        out += [p + stress if p[0] in "aeiou" else p for p in phones.split()]
    return " ".join(out)


def lexicon_lines(dicts: Path = DICTS) -> list[str]:
    lines = []
    for form in _walk(_parse(_tokens((dicts / "cmulex.scm").read_text(encoding="latin-1")))):
        if len(form) < 3 or not isinstance(form[2], list):  # the `" "` entry (split by this reader): no word
            continue
        word, pos, syllables = form[:3]  # a fourth item (letter features of symbols) is not needed
        phones = [p + str(stress) if p[0] in "aeiou" else p for ps, stress in syllables for p in ps]
        lines.append("\t".join((word.strip('"'), pos or "nil", " ".join(phones))))
    for raw in (dicts / "cmudict-0.4.out").read_text(encoding="latin-1").splitlines():
        if e := _ENTRY.match(raw):
            lines.append(f"{e.group(1)}\t{e.group(2)}\t{_phones(e.group(3))}")
    return lines


def _tokens(text: str) -> list[str]:
    text = "\n".join(ln for ln in text.splitlines() if not ln.lstrip().startswith(";"))
    return re.findall(r"\(|\)|[^\s()]+", text)


def _parse(tokens: list[str]) -> list:
    stack: list[list] = [[]]
    for t in tokens:
        if t == "(":
            stack.append([])
        elif t == ")":
            done = stack.pop()
            stack[-1].append(done)
        else:
            stack[-1].append(t)
    return stack[0]


def _walk(node: list):
    """The entries of every `(lex.add.entry '(word pos syllables))` form inside `node`."""
    for i, item in enumerate(node):
        if isinstance(item, list):
            yield from _walk(item)
        elif item == "lex.add.entry" and i == 0 and node[1:2] == ["'"]:
            yield node[2]


def _tree(node: list) -> object:
    if len(node) == 1:  # leaf: ((dist ...) class)
        return node[0][-1]
    (feat, op, value), yes, no = node
    if op != "is":
        raise ValueError(f"unexpected LTS question {feat} {op} {value}")
    return [_FEATURES[feat], value, _tree(yes), _tree(no)]


def lts_rules(dicts: Path = DICTS) -> dict[str, object]:
    top = _parse(_tokens((dicts / "cmu_lts_rules.scm").read_text(encoding="latin-1")))
    head = top[0]  # (set! cmu_lts_rules ' ((a tree) (b tree) ...))
    if head[:3] != ["set!", "cmu_lts_rules", "'"]:
        raise ValueError("cmu_lts_rules.scm: unexpected layout")
    rules = head[3]
    return {letter_tree[0]: _tree(letter_tree[1]) for letter_tree in rules}


def build(dicts: Path = DICTS, out: Path = OUT) -> tuple[Path, Path]:
    out.mkdir(parents=True, exist_ok=True)
    lex, lts = out / "cmulex.txt.xz", out / "cmults.json.xz"
    lex.write_bytes(lzma.compress(("\n".join(lexicon_lines(dicts)) + "\n").encode("utf-8"), preset=9))
    lts.write_bytes(lzma.compress(json.dumps(lts_rules(dicts), separators=(",", ":")).encode("utf-8"), preset=9))
    return lex, lts


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dicts", type=Path, default=DICTS)
    ap.add_argument("--out", type=Path, default=OUT)
    a = ap.parse_args()
    for p in build(a.dicts, a.out):
        print(p, p.stat().st_size)
