"""What one request may ask for: the cap on every text field, and the bound on the LLM prompt it makes.

Every route checks its text fields here (one limit, `ServeConfig.max_input_chars`), so no field is left
unbounded. The LLM prompt (prompt text or instruction + text + prompt speech tokens) is counted before the job
is queued and refused with a 400 when it is over `max_prompt_tokens`, as an LLM server refuses a prompt longer
than its context: a request that would only fail (or crawl) deep in the engine never takes a worker.
"""

from __future__ import annotations

from collections.abc import Callable

from vocalis.config import MAX_PROMPT_SECONDS, TOKEN_RATE
from vocalis.errors import InputError
from vocalis.frontend.text import longest_sentence_tokens
from vocalis.frontend.voice import Voice
from vocalis.serve.config import ServeConfig


class PromptTooLong(InputError):
    """The LLM prompt a request would make is over the limit (HTTP 400)."""


def check_text_fields(config: ServeConfig, **fields: str | None) -> None:
    """400 for the first field longer than `max_input_chars` (None and absent fields pass)."""
    limit = config.max_input_chars
    for name, value in fields.items():
        if value is not None and len(value) > limit:
            raise InputError(f"{name} is {len(value)} characters; the limit is {limit}")


class PromptBudget:
    """Counts the LLM prompt of a request before it is queued; `check` raises `PromptTooLong` over the limit."""

    def __init__(self, count: Callable[[str], int], max_tokens: int) -> None:
        self.count = count
        self.max_tokens = max_tokens

    def check(self, *, text: str = "", voice: Voice | None = None, prompt_text: str = "", instruct: str = "",
              prompt_seconds: float = 0.0, extra_text_tokens: int = 0) -> int:
        """The prompt's token count. A zero-shot request (prompt text, no instruction) also feeds the LLM the
        clip's speech tokens; an instruction replaces both (as the synthesiser lays the prompt out).

        voice: a saved/built-in voice (its stored ids are counted exactly); prompt_seconds: a one-off clip's
        length (25 speech tokens a second, at most the 30 s a prompt may be); extra_text_tokens: text already
        counted (a WebSocket session's earlier pieces).
        """
        # a text is spoken sentence by sentence, each its own LLM prompt: its longest sentence is what counts
        parts = {"text": longest_sentence_tokens(text, self.count) + extra_text_tokens if text else extra_text_tokens}
        if instruct:
            parts["instruction"] = self.count(instruct)
        elif voice is not None and voice.prompt_text_ids:
            parts["prompt text"] = len(voice.prompt_text_ids)
            parts["prompt speech"] = len(voice.prompt_speech_ids)
        elif prompt_text and prompt_seconds > 0:
            parts["prompt text"] = self.count(prompt_text)
            parts["prompt speech"] = int(min(prompt_seconds, MAX_PROMPT_SECONDS) * TOKEN_RATE) + 1
        total = sum(parts.values())
        if total > self.max_tokens:
            detail = ", ".join(f"{k} {v}" for k, v in parts.items())
            raise PromptTooLong(f"the LLM prompt would be {total} tokens ({detail}); the limit is {self.max_tokens}: "
                                "shorten the text, the instruction or the prompt clip")
        return total
