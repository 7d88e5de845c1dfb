"""LLM-style text read as a person would say it: markdown, numbers, money, dates, units, phone numbers, other
scripts. Each case's expected reading is written out; the built-in model's phone frontend reads every case."""

from __future__ import annotations

from pathlib import Path

import pytest

from vocalis.errors import InputError
from vocalis.frontend.markdown import markdown_to_speech
from vocalis.frontend.numbers import english_numbers, ordinal_words, year_words
from vocalis.frontend.phones import PhoneTokenizer
from vocalis.frontend.reading import reading_warnings
from vocalis.frontend.text import normalize_text
from vocalis.frontend.tokenizer import TextTokenizer

ASSET_TOKENIZER = Path(__file__).resolve().parents[1] / "vocalis" / "assets" / "tokenizer"


@pytest.fixture(scope="module")
def bpe() -> TextTokenizer:
    return TextTokenizer.from_dir(ASSET_TOKENIZER)


# (what an LLM writes, what is read)
CORPUS = [
    ('## What changed\n- **Faster** start-up\n- *Smaller* downloads',
     'What changed. Faster start-up. Smaller downloads.'),
    ('# Release notes\n\nVersion 2 is out.',
     'Release notes. Version two is out.'),
    ("Here's the plan:\n\n1. Install the package\n2. Run `vocalis serve`\n3. Open the page",
     "Here's the plan: Install the package. Run vocalis serve. Open the page."),
    ('See [the docs](https://example.com/docs) for details.',
     'See the docs for details.'),
    ('| Item | Price |\n|------|------:|\n| Tea | $3.50 |\n| Cake | $12 |',
     'Item, Price. Tea, three dollars and fifty cents. Cake, twelve dollars.'),
    ('Run this:\n\n```bash\npip install vocalis\n```\n\nThen restart.',
     'Run this: Then restart.'),
    ('> **Note:** the cache is ~~optional~~ required.',
     'Note: the cache is required.'),
    ('Use the `--seed` flag.',
     'Use the --seed flag.'),
    ("---\n\nThat's all.",
     "That's all."),
    ('![A diagram of the pipeline](pipeline.png)',
     'A diagram of the pipeline.'),
    ('It costs $3.50.',
     'It costs three dollars and fifty cents.'),
    ('1,234 units for $1,234.56.',
     ('one thousand two hundred and thirty-four units for one thousand two hundred and thirty-four dollars and '
     'fifty-six cents.')),
    ('We shipped 1,000 orders.',
     'We shipped one thousand orders.'),
    ('We shipped 1000 orders.',
     'We shipped one thousand orders.'),
    ('A coffee is $0.99 and a book is £12.',
     'A coffee is ninety-nine cents and a book is twelve pounds.'),
    ('Revenue reached $1.2 million in Q3 2024.',
     'Revenue reached one point two million dollars in Q three twenty twenty-four.'),
    ('The startup raised $5M from 10k investors.',
     'The startup raised five million dollars from ten thousand investors.'),
    ('Prices rose 3.5% in 2023.',
     'Prices rose three point five percent in twenty twenty-three.'),
    ('The meeting is at 3:30 pm on March 5, 2024.',
     'The meeting is at three thirty PM on the fifth of march, twenty twenty four.'),
    ('The 1990s were different.',
     'The nineteen nineties were different.'),
    ('He was born in 1905.',
     'He was born in nineteen oh five.'),
    ('She finished 1st, he came 2nd and I was 21st.',
     'She finished first, he came second and I was twenty first.'),
    ('The trail is 12 km long and climbs 1,500 m.',
     'The trail is twelve kilometers long and climbs one thousand five hundred meters.'),
    ('Call 555-123-4567 or +44 20 7946 0958.',
     ('Call five five five, one two three, four five six seven or plus four four, two zero, seven nine four six, '
     'zero nine five eight.')),
    ('Call 555-1234 today.',
     'Call five five five, one two three four today.'),
    ('It was 25°C and the file was 2.5 GB.',
     'It was twenty five degrees Celsius and the file was two point five gigabytes.'),
    ('Support is 24/7 for 100+ customers.',
     'Support is twenty-four seven for one hundred plus customers.'),
    ("That's about 3x faster, e.g. for long texts.",
     "That's about three times faster, for example for long texts."),
    ('Apples, pears, etc.',
     'Apples, pears, et cetera.'),
    ('Email support@example.com or visit www.example.com.',
     'Email support at example dot com or visit example dot com.'),
    ('The value is 3.14159.',
     'The value is three point one four one five nine.'),
    ('今天是2024年3月5日，气温25.5度。',
     '今天是二零二四年三月五日，气温二十五点五度。'),
    ('这个东西卖1,234元。',
     '这个东西卖一千二百三十四元。'),
    ('**注意**：价格上涨了3.5%。',
     '注意：价格上涨了百分之三点五。'),
]


@pytest.mark.parametrize(("written", "read"), CORPUS, ids=[c[0][:30] for c in CORPUS])
def test_llm_text_reads_as_written_out(bpe: TextTokenizer, written: str, read: str) -> None:
    result = normalize_text(written, "auto", token_len=bpe.count)
    assert result.text == read
    assert "".join(result.pieces).replace(" ", "") == read.replace(" ", "")  # every word in a piece, once


@pytest.mark.parametrize(("written", "read"), CORPUS[:-3], ids=[c[0][:30] for c in CORPUS[:-3]])
def test_the_phone_frontend_reads_the_english_corpus_without_markup(written: str, read: str) -> None:
    """The built-in model's frontend gets the same reading, and none of it is markup or a digit."""
    tok = PhoneTokenizer()
    result = normalize_text(written, tok.language, token_len=tok.count)
    assert result.text == read
    assert not any(ch in result.text for ch in "*#|`[]$%0123456789")
    assert all(tok.encode(piece) for piece in result.pieces)


def test_the_reported_number_readings() -> None:
    """The readings the issue reported wrong, one by one."""
    assert english_numbers("$3.50") == "three dollars and fifty cents"
    assert english_numbers("1,234 units for $1,234.56") == (
        "one thousand two hundred and thirty-four units for "
        "one thousand two hundred and thirty-four dollars and fifty-six cents")
    assert english_numbers("1,000") == "one thousand"
    assert english_numbers("1000") == "one thousand"
    assert english_numbers("$1") == "one dollar" and english_numbers("$0.01") == "one cent"
    assert english_numbers("£2.01") == "two pounds and one penny"
    assert english_numbers("¥1.5") == "one point five yen"  # no hundredths spoken: read as a decimal
    assert english_numbers("-$5") == "minus five dollars"


@pytest.mark.parametrize(("digits", "words"), [
    ("1999", "nineteen ninety-nine"), ("1905", "nineteen oh five"), ("2000", "two thousand"),
    ("2008", "two thousand eight"), ("1900", "nineteen hundred"), ("2024", "twenty twenty-four"),
    ("1066", "ten sixty-six"),
])
def test_years(digits: str, words: str) -> None:
    assert year_words(digits) == words


@pytest.mark.parametrize(("digits", "words"), [
    ("1", "first"), ("2", "second"), ("3", "third"), ("5", "fifth"), ("12", "twelfth"), ("20", "twentieth"),
    ("21", "twenty-first"), ("100", "one hundredth"), ("103", "one hundred and third"),
])
def test_ordinals(digits: str, words: str) -> None:
    assert ordinal_words(digits) == words


def test_a_year_needs_a_cue_and_a_date_stays_whole() -> None:
    assert english_numbers("in 2024") == "in twenty twenty-four"
    assert english_numbers("2024 units") == "two thousand twenty-four units"
    assert english_numbers("2024-03-05") == "2024-03-05"  # wetext's date grammar reads it
    assert english_numbers("March 5, 2024") == "March 5, 2024"
    assert english_numbers("at 10:30") == "at 10:30"


def test_plain_text_is_not_parsed_as_markdown() -> None:
    text = "Plain text, with 3 - 2 = 1 and a list-like line.\n  Indented lines are prose, not code."
    assert markdown_to_speech(text).text == text
    assert markdown_to_speech("    indented prose\n*and* more").text == "indented prose and more."


def test_control_tags_survive_markdown() -> None:
    spoken = markdown_to_speech("**Well** [laughter] that is <strong>great</strong>")
    assert spoken.text == "Well [laughter] that is <strong>great</strong>."
    assert markdown_to_speech("You are kind.<|endofprompt|>*Hi*").text == "You are kind.<|endofprompt|>Hi."


def test_a_less_than_sign_is_text_and_html_tags_are_markup() -> None:
    assert markdown_to_speech("If a<b and c>d then **x** wins.").text == "If a<b and c>d then x wins."
    assert markdown_to_speech("**Note**: 1<2<3, <b>bold</b> and <br> a <div class=\"x\">box</div>.").text == (
        "Note: 1<2<3, bold and a box.")


def test_a_one_item_ordered_list_keeps_its_number() -> None:
    """"1999. What a year." parses as a list of one item numbered 1999: the number is text, not a bullet."""
    assert markdown_to_speech("1999. What a year.").text == "1999. What a year."
    assert markdown_to_speech("1. one\n2. two").text == "one.\ntwo."


def test_skipped_code_is_noted_and_code_alone_is_read(bpe: TextTokenizer) -> None:
    result = normalize_text("Run:\n```\nls -la\n```\n```\nrm x\n```", token_len=bpe.count)
    assert result.text == "Run:" and result.notes == ("a code block was not read",)
    only_code = normalize_text("```\nprint(x)\n```", token_len=bpe.count)
    assert only_code.text == "print(x)" and only_code.notes == ("the text is only code: it is read as written",)
    with pytest.raises(InputError, match="nothing to read aloud"):
        normalize_text("![](diagram.png)\n\n---", token_len=bpe.count)


def test_wetext_dropping_text_falls_back_to_the_text(bpe: TextTokenizer) -> None:
    """wetext returns "" for some input ("x.com." at the end of a sentence); the text is kept, not lost."""
    assert normalize_text("Go to x.io now.", token_len=bpe.count).text == "Go to x dot io now."
    assert normalize_text("a.b.c.", "en", token_len=bpe.count).text.replace(" ", "") == "a.b.c."


def test_reading_warnings_name_foreign_words_for_an_english_only_model(bpe: TextTokenizer) -> None:
    text = "We should 改善 the process, привет! Then **ship** it:\n```\nmake\n```"
    assert reading_warnings(text, PhoneTokenizer()) == (
        "a code block was not read",
        "'改善' read as 'gai shan': this model reads English only",
        "'привет' read as 'privet': this model reads English only")
    assert reading_warnings(text, bpe) == ("a code block was not read",)  # CosyVoice reads every script
    assert reading_warnings("Plain English.", PhoneTokenizer()) == ()
    with pytest.raises(InputError, match="empty"):
        reading_warnings("  ", PhoneTokenizer())


def test_many_foreign_words_give_a_bounded_list_of_notes() -> None:
    words = "один два три четыре пять шесть семь восемь девять десять"
    notes = PhoneTokenizer().warnings(words)
    assert len(notes) == 9 and notes[-1] == "2 more words in other scripts read as Latin letters"


def test_a_long_answer_is_bounded_per_sentence_not_as_a_whole() -> None:
    """4,096 characters of prose (the server's default text cap) are 3,000+ phone ids in all, over a 3,072-token
    prompt bound as one prompt; spoken sentence by sentence, each prompt is a sentence's, well within it."""
    from vocalis.serve.limits import PromptBudget, PromptTooLong

    tok = PhoneTokenizer()
    prose = ("The weather today is mild, with light winds and a little sun in the afternoon. Later in the week, "
             "temperatures will rise and the chance of rain is small. ")
    text = (prose * 40)[:4096]
    assert tok.count(text) > 3072
    budget = PromptBudget(tok.count, 3072)
    assert budget.check(text=text) == max(tok.count(s) for s in prose.split(". ")) + 1  # the longest, its "."
    assert max(tok.count(p) for p in normalize_text(text, "en", token_len=tok.count).pieces) < 3072
    with pytest.raises(PromptTooLong, match="the limit is 100"):  # one sentence over the bound is still refused
        PromptBudget(tok.count, 100).check(text=prose.replace(".", ",") * 3)
