"""TextTokenizer: Qwen2 layout loading, CosyVoice special-token ids, encode/decode behaviour."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import AddedToken, pre_tokenizers, trainers
from tokenizers.models import BPE

from vocalis.errors import ModelLoadError
from vocalis.frontend.tokenizer import (
    COSYVOICE_SPECIAL_TOKENS,
    QWEN_SPECIAL_TOKENS,
    TextTokenizer,
    qwen2_pipeline,
)

ASSET_TOKENIZER = Path(__file__).resolve().parents[1] / "vocalis" / "assets" / "tokenizer"
CORPUS = [
    "The quick brown fox jumps over the lazy dog. It's 12 o'clock, isn't it?",
    "Hello world! Hello there, general Kenobi. We'll see 2024 and 1999.",
    "今天天气很好，我们一起去公园散步吧。你好世界！",
    "今日はとても良い天気ですね。ありがとうございます。",
] * 3
NEW_SPECIALS = COSYVOICE_SPECIAL_TOKENS[2:]


def _config(base: int) -> dict:
    added = {
        str(base + i): {"content": t, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False,
                        "special": True}
        for i, t in enumerate(QWEN_SPECIAL_TOKENS)
    }
    return {"added_tokens_decoder": added, "eos_token": "<|endoftext|>", "tokenizer_class": "Qwen2Tokenizer"}


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small Qwen2-layout directory trained on the fly: vocab.json + merges.txt + tokenizer_config.json."""
    directory = tmp_path_factory.mktemp("qwen_tok")
    tokenizer = qwen2_pipeline(BPE(unk_token=None))
    trainer = trainers.BpeTrainer(
        vocab_size=400, show_progress=False, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tokenizer.train_from_iterator(CORPUS, trainer=trainer)
    tokenizer.model.save(str(directory))
    base = tokenizer.get_vocab_size()
    (directory / "tokenizer_config.json").write_text(json.dumps(_config(base)))
    return directory


@pytest.fixture(scope="module")
def qwen_json_dir(qwen_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same vocabulary as a single `tokenizer.json` with the 3 Qwen specials (how Qwen repos ship it)."""
    directory = tmp_path_factory.mktemp("qwen_tok_json")
    vocab, merges = BPE.read_file(str(qwen_dir / "vocab.json"), str(qwen_dir / "merges.txt"))
    tokenizer = qwen2_pipeline(BPE(vocab, merges, unk_token=None))
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in QWEN_SPECIAL_TOKENS])
    tokenizer.save(str(directory / "tokenizer.json"))
    return directory


def test_special_token_layout(qwen_dir: Path) -> None:
    tok = TextTokenizer.from_dir(qwen_dir)
    base = tok.base_vocab_size
    assert [tok.token_to_id(t) for t in QWEN_SPECIAL_TOKENS] == [base, base + 1, base + 2]
    assert [tok.token_to_id(t) for t in NEW_SPECIALS] == list(range(base + 3, base + 3 + 17))
    assert tok.endofprompt_id == base + 3
    assert len(tok) == base + 3 + 17


def test_real_vocab_ids_would_match_official() -> None:
    # With Qwen2's 151643 BPE entries the same rule gives the official constants.
    base = 151643
    assert base + len(QWEN_SPECIAL_TOKENS) == 151646  # <|endofprompt|>
    assert base + len(QWEN_SPECIAL_TOKENS) + len(NEW_SPECIALS) == 151663  # len(tokenizer)


def test_encode_decode_roundtrip(qwen_dir: Path) -> None:
    tok = TextTokenizer.from_dir(qwen_dir)
    for text in ["Hello world!", "今天天气很好[laughter]。", "emoji 😀 and ümlaut", "  two  spaces\nnewline"]:
        ids = tok.encode(text)
        assert tok.decode(ids) == text
        assert tok.count(text) == len(ids)


def test_specials_are_single_ids_and_no_bos(qwen_dir: Path) -> None:
    tok = TextTokenizer.from_dir(qwen_dir)
    ids = tok.encode("用四川话说<|endofprompt|>你好[laughter]<strong>好</strong>")
    for t in ("<|endofprompt|>", "[laughter]", "<strong>", "</strong>"):
        assert ids.count(tok.token_to_id(t)) == 1
    assert ids[0] != tok.token_to_id("<|endoftext|>")
    assert tok.encode("[breath]") == [tok.token_to_id("[breath]")]
    assert tok.decode(ids, skip_special_tokens=True) == "用四川话说你好好"


def test_qwen_pretokenizer_splits_digits(qwen_dir: Path) -> None:
    tok = TextTokenizer.from_dir(qwen_dir)
    # "12" and "1999" appear in the corpus, yet Qwen2 splits numbers into single digits.
    pieces = [tok.decode([i]) for i in tok.encode("12 1999")]
    assert pieces == ["1", "2", " ", "1", "9", "9", "9"]
    # contractions are their own pre-tokens
    assert "'s" in [tok.decode([i]) for i in tok.encode("It's")]


def test_tokenizer_json_and_files_agree(qwen_dir: Path, qwen_json_dir: Path) -> None:
    from_files = TextTokenizer.from_dir(qwen_dir)
    from_json = TextTokenizer.from_dir(qwen_json_dir)
    assert len(from_files) == len(from_json)
    assert from_files.endofprompt_id == from_json.endofprompt_id
    for text in CORPUS + ["Mixed 中文 and English 123 [cough] <|endofprompt|> テスト", "x\r\n\ty  z"]:
        assert from_files.encode(text) == from_json.encode(text)


def test_bundled_tiny_tokenizer() -> None:
    tok = TextTokenizer.from_dir(ASSET_TOKENIZER)
    assert len(tok) <= 4096
    assert tok.endofprompt_id == tok.base_vocab_size + 3
    assert sorted(p.name for p in ASSET_TOKENIZER.iterdir()) == ["merges.txt", "tokenizer_config.json", "vocab.json"]
    text = "Hello, 世界! 今日は良い天気です。 I have 3 apples."
    assert tok.decode(tok.encode(text)) == text
    assert len(tok.encode("The quick brown fox jumps over the lazy dog.")) < 15  # merges are learned


def test_missing_files_and_mismatched_config(qwen_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="does not exist"):
        TextTokenizer.from_dir(tmp_path / "nope")
    (tmp_path / "vocab.json").write_text((qwen_dir / "vocab.json").read_text())
    with pytest.raises(ModelLoadError, match="merges.txt"):
        TextTokenizer.from_dir(tmp_path)
    (tmp_path / "merges.txt").write_text((qwen_dir / "merges.txt").read_text())
    base = len(json.loads((qwen_dir / "vocab.json").read_text()))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(_config(base + 5)))
    with pytest.raises(ModelLoadError, match="declared as id"):
        TextTokenizer.from_dir(tmp_path)


def test_extra_native_specials_shift_like_the_official_tokenizer(qwen_dir: Path, tmp_path: Path) -> None:
    # e.g. a Qwen2.5 tokenizer.json with more native specials: the official add_special_tokens appends the
    # CosyVoice tokens after them, and so do we (with a warning), rather than refusing the directory.
    vocab, merges = BPE.read_file(str(qwen_dir / "vocab.json"), str(qwen_dir / "merges.txt"))
    tokenizer = qwen2_pipeline(BPE(vocab, merges, unk_token=None))
    extra = [*QWEN_SPECIAL_TOKENS, "<|object_ref_start|>"]
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in extra])
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    tok = TextTokenizer.from_dir(tmp_path)
    base = tok.base_vocab_size
    assert tok.token_to_id("<|object_ref_start|>") == base + 3
    assert tok.endofprompt_id == base + 4
    assert tok.encode("<|endofprompt|>") == [base + 4]


def test_cosyvoice3_specials_land_on_the_official_ids(tmp_path: Path, cv3_dir: Path) -> None:
    """A vocabulary of Qwen2's real size (151643 BPE entries + its 3 specials) with CosyVoice 3's special tokens: every
    one on the id the official CosyVoice3Tokenizer gave it (the fixture's table), and the fixture's encode example."""
    table = json.loads((cv3_dir / "reference" / "tiny_config.json").read_text())["special_tokens"]
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {c: i for i, c in enumerate(sorted(alphabet))}
    vocab.update({f"w{i}": i for i in range(len(vocab), 151643)})  # w<i> is one entry, id i (ids >= 256)
    (tmp_path / "vocab.json").write_text(json.dumps(vocab), encoding="utf-8")
    (tmp_path / "merges.txt").write_text("#version: 0.2\n", encoding="utf-8")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(_config(151643)))
    tok = TextTokenizer.from_dir(tmp_path, family="cosyvoice3")
    assert {t: tok.token_to_id(t) for t in table["ids"]} == table["ids"]
    assert len(tok) == table["tokenizer_len_cosyvoice3"]
    assert tok.endofprompt_id == table["ids"]["<|endofprompt|>"]
    assert len(TextTokenizer.from_dir(tmp_path)) == table["tokenizer_len_cosyvoice2"]  # the CosyVoice 2 family
    specials = [table["ids"][t] for t in ("[AA1]", "<|endofsystem|>", "[iǎng]", "[breath]")]
    assert tok.encode("[AA1]<|endofsystem|>[iǎng] [breath]") == [*specials[:3], vocab["\u0120"], specials[3]]  # Ġ: " "
    with pytest.raises(ValueError, match="unknown model family"):
        TextTokenizer.from_dir(tmp_path, family="cosyvoice1")
