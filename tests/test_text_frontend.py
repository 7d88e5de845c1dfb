"""Text normalisation and splitting: official rules, tag survival, no sentence lost or repeated."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from vocalis.errors import InputError
from vocalis.frontend.text import (
    NormalizedText,
    check_text_length,
    detect_language,
    is_only_punctuation,
    normalize_text,
    number_to_words,
    replace_blank,
    resolve_language,
    spell_out_numbers,
    split_paragraph,
)
from vocalis.frontend.tokenizer import TextTokenizer

ASSET_TOKENIZER = Path(__file__).resolve().parents[1] / "vocalis" / "assets" / "tokenizer"


@pytest.fixture(scope="module")
def token_len():
    return TextTokenizer.from_dir(ASSET_TOKENIZER).count


def _squash(text: str) -> str:
    return re.sub(r"\s+", "", text)


def assert_lossless(result: NormalizedText) -> None:
    """Concatenated pieces == normalised text, modulo whitespace and one appended end mark."""
    joined = _squash("".join(result.pieces))
    full = _squash(result.text)
    assert joined == full or (joined[:-1] == full and joined[-1] in "。."), (joined, full)


# ---------------------------------------------------------------------------------------------------
# Language


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("你好，世界", "zh"),
        ("Hello world", "en"),
        ("今日はいい天気です", "ja"),
        ("カタカナ", "ja"),
        ("Hello 世界", "zh"),
        ("约翰・史密斯", "zh"),  # katakana middle dot alone is not Japanese
        ("12345", "en"),
        ("[laughter] hi", "en"),
    ],
)
def test_detect_language(text: str, expected: str) -> None:
    assert detect_language(text) == expected


def test_language_is_explicit_and_returned() -> None:
    assert resolve_language("en", "你好") == "en"
    assert normalize_text("你好，世界。", "auto").language == "zh"
    assert normalize_text("今日は3時です。", "auto").language == "ja"
    with pytest.raises(InputError, match="unknown language 'fr'"):
        normalize_text("Bonjour", "fr")


# ---------------------------------------------------------------------------------------------------
# Normalisation


def test_zh_tn_and_rules() -> None:
    out = normalize_text("今天是2024年3月5日，气温25.5度。", "zh")
    assert out.text == "今天是二零二四年三月五日，气温二十五点五度。"
    # newline dropped, blanks next to CJK removed, ²/³, brackets, em dash, trailing comma -> 。
    out = normalize_text("面积 10m² 和 体积 3m³（约）【注】\n好的——对,", "zh")
    assert "平方" in out.text and "立方" in out.text
    assert not set("（）【】\n") & set(out.text)
    assert "——" not in out.text and out.text.endswith("。")
    assert normalize_text("A - B 很好", "zh").text.startswith("A，B")


def test_replace_blank() -> None:
    assert replace_blank("hello world 你好 世界 ok") == "hello world你好世界ok"
    assert replace_blank(" a b ") == "a b"


def test_en_tn_and_numbers(token_len) -> None:
    out = normalize_text("I have 3 cats and 12 dogs.", "en", token_len=token_len)
    assert out.text == "I have three cats and twelve dogs."
    assert not re.search(r"\d", normalize_text("Room 101, call 42  now.", "en", split=False).text)


@pytest.mark.parametrize(
    ("digits", "words"),
    [
        ("0", "zero"),
        ("7", "seven"),
        ("13", "thirteen"),
        ("42", "forty-two"),
        ("100", "one hundred"),
        ("123", "one hundred and twenty-three"),
        ("1000", "one thousand"),
        ("1005", "one thousand five"),
        ("2024", "two thousand twenty-four"),
        ("1234567", "one million two hundred and thirty-four thousand five hundred and sixty-seven"),
        ("007", "zero zero seven"),
    ],
)
def test_number_to_words(digits: str, words: str) -> None:
    assert number_to_words(digits) == words


def test_spell_out_numbers() -> None:
    assert spell_out_numbers("a 5 b 10c") == "a five b tenc"


def test_ja_tn() -> None:
    out = normalize_text("りんごが3個あります。", "ja")
    assert out.text == "りんごが三個あります。"


@pytest.mark.parametrize(
    ("text", "language"),
    [
        ("在他讲述那个荒诞故事的过程中，他突然[laughter]停下来，因为他自己也被逗笑了[laughter]。", "zh"),
        ("追求卓越不是终点，它需要你每天都<strong>付出</strong>和<strong>精进</strong>，最终才能达到巅峰。", "zh"),
        ("[breath] I have 3 cats <strong>now</strong>, [laughter] really.", "en"),
        ("用四川话说这句话<|endofprompt|>我买了3个苹果。", "zh"),
        ("Say it happily.<|endofprompt|>I have 12 apples.", "en"),
        ("これは[laughter]テストです<strong>3</strong>回。", "ja"),
        ("[vocalized-noise]你好[quick_breath][lipsmack][mn]", "zh"),
    ],
)
def test_control_tags_survive(text: str, language: str, token_len) -> None:
    out = normalize_text(text, language, token_len=token_len)
    tags = re.findall(r"<\|[^|]+\|>|</?[a-z]+>|\[[a-z_-]+\]", text)
    assert re.findall(r"<\|[^|]+\|>|</?[a-z]+>|\[[a-z_-]+\]", out.text) == tags
    assert re.findall(r"<\|[^|]+\|>|</?[a-z]+>|\[[a-z_-]+\]", "".join(out.pieces)) == tags


def test_pipe_special_keeps_text_whole(token_len) -> None:
    text = "用四川话说这句话<|endofprompt|>" + "今天天气很好，我们一起去公园散步吧。" * 10
    out = normalize_text(text, "zh", token_len=token_len)
    assert len(out.pieces) == 1 and out.pieces[0].startswith("用四川话说这句话<|endofprompt|>")


def test_text_frontend_off_and_no_split() -> None:
    raw = "I have 3 cats."
    assert normalize_text(raw, "en", text_frontend=False).pieces == (raw,)
    out = normalize_text("第一句。第二句有3个字。" * 20, "zh", split=False)
    assert out.pieces == (out.text,)


# ---------------------------------------------------------------------------------------------------
# Splitting

ZH_LONG = (
    "收到好友从远方寄来的生日礼物，那份意外的惊喜与深深的祝福让我心中充满了甜蜜的快乐，笑容如花儿般绽放。"
    "今天天气很好！我们一起去公园散步吧？好的；那就出发：带上水、雨伞和相机。"
    "他说：“明天见。”然后转身离开了……真的吗？！是的。"
    "希望你以后能够做的比我还好呦。我们走的每一步，都是我们策略的一部分；你看到的所有一切，包括我此刻与你交谈，"
    "所做的一切，所说的每一句话，都有深远的含义。"
)
EN_LONG = (
    "The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with a single step! "
    'Is it raining?! "Where are you going?" she asked. "Home," he replied... I will be waiting by the phone; '
    "reading books, listening to podcasts and talking with friends are great ways to learn a language: "
    "the children laughed loudly when the clown slipped on the banana peel, and everyone clapped. Ok. Fine"
)


def test_split_zh_thresholds_and_lossless() -> None:
    out = normalize_text(ZH_LONG, "zh")
    assert len(out.pieces) > 1
    assert_lossless(out)
    # every piece but the last was flushed above the minimum; none grossly above the maximum
    assert all(len(p) > 60 for p in out.pieces[:-1])
    assert len(out.pieces) == len(set(out.pieces))


def test_split_en_counts_tokens_and_lossless(token_len) -> None:
    out = normalize_text(EN_LONG, "en", token_len=token_len)
    assert len(out.pieces) > 1
    assert_lossless(out)
    assert all(token_len(p) > 60 for p in out.pieces[:-1])
    assert out.pieces[-1].endswith("Fine.")  # end mark appended


def test_split_en_needs_token_len() -> None:
    with pytest.raises(ValueError, match="token_len"):
        split_paragraph("Hello there. General Kenobi.", "en")


def test_split_paragraph_rules() -> None:
    # greedy merge: flush when buffer > min and buffer + next > max
    sentences = ["一" * 30 + "。", "二" * 35 + "。", "三" * 30 + "。", "四" * 25 + "。"]
    pieces = split_paragraph("".join(sentences), "zh")
    assert pieces == [sentences[0] + sentences[1], sentences[2] + sentences[3]]
    # a short leftover (< merge_len) joins the previous piece
    pieces = split_paragraph("一" * 70 + "。" + "二" * 70 + "。" + "短句。", "zh")
    assert pieces == ["一" * 70 + "。", "二" * 70 + "。短句。"]
    # punctuation runs stay whole, closing quotes attach to their sentence, nothing is dropped
    text = "他说：“走吧。”真的吗？！是的……好。"
    assert "".join(split_paragraph(text, "zh", token_max_n=4, token_min_n=2, merge_len=1)) == text
    assert split_paragraph("Wait... what?! \"Yes.\" Ok", "en", len, token_max_n=4, token_min_n=2, merge_len=1) == [
        "Wait...",
        "what?!",
        '"Yes."',
        "Ok.",
    ]
    assert split_paragraph('He said "go."Then', "en", len, token_max_n=4, token_min_n=2, merge_len=1) == [
        'He said "go."',
        "Then.",
    ]
    assert split_paragraph("   ", "zh") == []


def test_ellipsis_and_quotes_not_lost(token_len) -> None:
    text = "Really?! Yes... \"Fine.\" ok"
    out = normalize_text(text, "en", token_len=token_len)
    assert_lossless(out)
    assert "?!" in out.text and "..." in "".join(out.pieces)


# ---------------------------------------------------------------------------------------------------
# Errors


@pytest.mark.parametrize("text", ["", "   \n\t", "...", "。！？", "!!! ---", "😀"])
def test_empty_or_punctuation_only_is_input_error(text: str) -> None:
    with pytest.raises(InputError, match="empty|punctuation"):
        normalize_text(text, "auto")


def test_punctuation_only_helper() -> None:
    assert is_only_punctuation("，。！ ...")
    assert not is_only_punctuation("[laughter]")
    assert not is_only_punctuation("a.")


def test_max_chars() -> None:
    check_text_length("a" * 10, max_chars=10)
    with pytest.raises(InputError, match="limit is 10"):
        check_text_length("a" * 11, max_chars=10)
    with pytest.raises(InputError, match="20000"):
        normalize_text("a" * 20001, "en")


def test_non_string_is_input_error() -> None:
    with pytest.raises(InputError):
        normalize_text(None, "en")  # type: ignore[arg-type]
