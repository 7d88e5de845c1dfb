"""Issue 25, item 4: text normalisation never rejects speakable text. A corpus of awkward LLM-style text
(citations, markdown, code, URLs, emoji, mixed scripts) passes normalisation in every language, and the
reported inputs are spoken by a real loopback server."""

from __future__ import annotations

import httpx
import pytest
from serve_support import quick_tts, serve

from vocalis.frontend.text import normalize_text

AWKWARD_TEXTS = [
    # citations and references
    "See [1] for details.", "As shown in [2, 3] and [4-7], it works.", "Sources: [1][2][3].", "[31m", "[5kg",
    "Einstein (1905) [citation needed] showed it.", "See ref.[12], p. 4.", "(see Fig. 3b)", "[^1]: a footnote.",
    # markdown
    "# Heading\n\n**Bold** and *italic* and __under__.", "- item one\n- item two\n- item 3",
    "1. first\n2. second\n3. third", "> quoted text here", "| a | b |\n|---|---|\n| 1 | 2 |", "~~struck~~ text",
    "[a link](https://example.com/page?x=1&y=2)", "![alt text](img.png)", "Some `inline code` here.",
    # code
    "```python\nprint('hi')\nfor i in range(10): pass\n```", "Run `pip install -e '.[dev]'` first.",
    "x = arr[0] + arr[-1] * 2; y = {\"a\": [1, 2]}", "if (a < b && c > d) { return a[i]; }", "C:\\Users\\me\\file.txt",
    "def f(x): return x**2  # square", "SELECT * FROM t WHERE id = 5;", "<div class=\"x\">Hi</div>",
    # URLs, emails, paths, numbers, units
    "Visit https://example.com/a/b?c=1#frag now.", "Mail me at someone@example.org.", "Go to www.example.co.uk.",
    "It costs $1,234.56 (about €1.1k).", "Call +1 (555) 123-4567.", "3.14159 and 2e10 and 1/3 and 50%.",
    "On 2024-03-05 at 14:30, 5kg, 10km/h, 37°C, 2nd place.", "Version v1.2.3-rc1 of 0x1F.",
    # emoji and symbols
    "Great job! 🎉🎉 👍", "I ❤️ this 😀.", "→ next ← prev ↑ up", "★★★☆☆ (3/5)", "Temperature ≈ 20 ± 2 °C.",
    "Symbols ™ © ® § ¶ … — – • in a line.", "a\u200bzero\u200cwidth\ufeffchars", "tab\tseparated\tvalues",
    # mixed scripts
    "Hello 你好 world 世界!", "今天是2024年3月5日，温度25°C。", "東京タワーは333メートルです。", "Привет, мир! 123",
    "مرحبا بالعالم 42", "Ελληνικά και English", "한국어 텍스트 그리고 English 5개", "नमस्ते दुनिया 7",
    "Café naïve résumé coöperate", "日本語とEnglishのmix [1] です。", "中文[1]引用，见【2】。",
    # odd punctuation and spacing
    "Wait... what?!?! Really??", "\"Quoted\" and 'single' and «guillemets»", "Multiple     spaces   here.",
    "Line one.\nLine two.\r\nLine three.", "((nested (parens) here))", "a/b/c\\d|e", "\\n literal backslash-n",
    "[laughter] Ha, that was [breath] funny.", "<strong>Stress</strong> this.", "Trailing backslash \\",
]


@pytest.mark.parametrize("language", ["auto", "en", "zh", "ja"])
def test_awkward_text_normalises_without_error(language: str) -> None:
    for text in AWKWARD_TEXTS:
        result = normalize_text(text, language, token_len=len)
        assert result.pieces and all(p.strip() for p in result.pieces), text


def test_only_the_failing_part_is_kept_as_written() -> None:
    # wetext's English grammar fails on these as a whole; the rest of the sentence is still normalised
    assert normalize_text("See [1] for details.", "en", split=False).text == "See [one] for details."
    assert normalize_text("It weighs 5kg [5kg", "en", split=False).text == "It weighs five kilograms [five kilograms"
    assert normalize_text("a [12] b and 3 cats", "en", split=False).text == "a [twelve] b and three cats"


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    with serve(quick_tts(tmp_path_factory)) as srv, httpx.Client(base_url=srv.url, timeout=120) as c:
        yield c


@pytest.mark.parametrize("text", ["See [1] for details.", "[31m", "[5kg", "Use `x[0]`, see [2][3]: 你好 🎉."])
def test_server_speaks_the_reported_inputs(client: httpx.Client, text: str) -> None:
    r = client.post("/v1/audio/speech", json={"input": text, "response_format": "pcm", "seed": 1})
    assert r.status_code == 200, r.text
    assert len(r.content) > 0
