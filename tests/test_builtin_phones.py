"""The built-in model's phone frontend (`vocalis.frontend.phones`) and its shipped festival lexicon asset."""

from __future__ import annotations

import lzma
import subprocess
import sys
from pathlib import Path

from system_deps import FESTIVAL_CMU, need_wordnet, require

from vocalis.frontend import phones
from vocalis.frontend.phones import (
    NUM_LABELS,
    NUM_TEXT_IDS,
    PUNCTUATION,
    TEXT_SYMBOLS,
    UNITS,
    WORD_BOUNDARY,
    g2p,
    label_id,
    label_unit,
    letter_to_sound,
    text_ids,
)


def test_vocabulary_is_the_phone_set() -> None:
    assert 80 <= NUM_TEXT_IDS + 13 <= 130 and NUM_TEXT_IDS == len(set(TEXT_SYMBOLS))  # 67 text ids
    assert len(UNITS) == 57 and NUM_LABELS == 114
    for unit in UNITS:
        for inside in (False, True):
            assert label_unit(label_id(unit, inside)) == (unit, inside)
    assert sorted(label_id(u, i) for u in UNITS for i in (False, True)) == list(range(NUM_LABELS))


def test_lexicon_words_letter_to_sound_and_punctuation() -> None:
    assert g2p("Hello, world.") == ["hh", "ax0", "l", "ow1", ",", "|", "w", "er1", "l", "d", "."]
    # not in the lexicon: festival's CART letter-to-sound trees (festival itself says v ow1 k ax0 l iy0 s)
    assert "vocalis" not in phones._lexicon()
    assert letter_to_sound("vocalis") == ("v", "ow1", "k", "ax0", "l", "iy0", "s")
    # hyphenated tokens split; festival's possessive rule: devoiced after an unvoiced phone, schwa kept after a
    # sibilant (festival says "r aa s ax s" for Ross's and "k er t s" for Kurt's)
    assert g2p("well-known") == ["w", "eh1", "l", "|", "n", "ow1", "n"]
    assert g2p("Kurt's") == ["k", "er1", "t", "s"] and g2p("Ross's") == ["r", "aa1", "s", "ax0", "s"]
    assert g2p("Bob's")[-2:] == ["b", "z"]
    # homographs: the noun after a determiner, the verb after a pronoun or question word
    assert g2p("the record")[-5:] == ["r", "eh1", "k", "er0", "d"]
    assert g2p("how does")[-3:] == ["d", "ah1", "z"]
    ids = text_ids("Is it?")
    assert ids[-1] == TEXT_SYMBOLS.index("?") and TEXT_SYMBOLS.index(WORD_BOUNDARY) in ids


def test_g2p_is_deterministic_across_processes() -> None:
    text = "The quick brown fox jumps over the lazy dog; zyxqort's phlogiston-fuelled reveries, again?"
    code = "import json, sys; from vocalis.frontend.phones import g2p; print(json.dumps(g2p(sys.argv[1])))"
    runs = {subprocess.run([sys.executable, "-c", code, text], capture_output=True, text=True, check=True).stdout
            for _ in range(2)}
    assert len(runs) == 1 and runs.pop().strip() == __import__("json").dumps(g2p(text))


def test_every_symbol_is_in_the_vocabulary_over_many_words() -> None:
    # every lexicon entry's phones and letter-to-sound output over its words are units of the phone set
    lex = phones._lexicon()
    seen = {p for entries in lex.values() for ps in entries.values() for p in ps}
    assert seen <= set(UNITS)
    words = sorted(w for w in lex if w.isalpha() and w.islower())[::500]
    assert len(words) > 150
    for w in words:
        assert letter_to_sound(w) and set(letter_to_sound(w)) <= set(UNITS)


def test_coverage_of_the_heldout_sentences() -> None:
    need_wordnet()
    from vocalis.corpus.sentences import heldout_wordnet

    sentences = heldout_wordnet()
    assert len(sentences) == 50
    for s in sentences:
        words = [w for w in s.split() if any(c.isalpha() for c in w)]
        symbols = g2p(s)
        assert symbols.count(WORD_BOUNDARY) + 1 >= len(words), s  # every word spoken (hyphens add words)
        assert all(x in UNITS or x == WORD_BOUNDARY or x in PUNCTUATION for x in symbols)


def test_the_shipped_asset_is_what_the_builder_makes(tmp_path: Path) -> None:
    require((FESTIVAL_CMU / "cmudict-0.4.out").is_file(), "festival's CMU lexicon (apt-get install festlex-cmu)")
    from vocalis.corpus.festival_lexicon import build

    lex, lts = build(FESTIVAL_CMU, tmp_path)
    for made, shipped in ((lex, "cmulex.txt.xz"), (lts, "cmults.json.xz")):
        assert lzma.decompress(made.read_bytes()) == lzma.decompress((phones.ASSET_DIR / shipped).read_bytes())


def test_the_lexicon_reads_every_word_as_its_file_lines_say() -> None:
    # word -> {pos: phones}, a word's first line per part of speech counting, in file order: built here from the
    # shipped file's lines as plain dicts, against the compact table every lookup reads
    want: dict[str, dict[str, tuple[str, ...]]] = {}
    text = lzma.decompress((phones.ASSET_DIR / "cmulex.txt.xz").read_bytes()).decode("utf-8")
    for line in text.splitlines():
        word, pos, ps = line.split("\t")
        want.setdefault(word, {}).setdefault(pos, tuple(ps.split()))
    lex = phones._lexicon()
    assert len(lex) == len(want) and list(lex) == list(want)
    assert all(lex[w] == e and list(lex[w]) == list(e) for w, e in want.items())
    assert "vocalis" not in lex and "record" in lex and len(lex["record"]) > 1  # a homograph keeps its readings
