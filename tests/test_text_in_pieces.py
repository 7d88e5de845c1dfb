"""Text in pieces starts on the first complete sentence: a writer that pauses after a sentence does not hold its
audio back (the sentence's LLM request is ended at the pause), and text written without pauses stays one
bi-stream, equal to the reference's."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator

import numpy as np
import pytest

from vocalis.frontend.request import AudioChunk, Mode, SynthesisRequest
from vocalis.frontend.text import ends_sentence
from vocalis.model_dir import LoadedModel, random_model
from vocalis.reference.synthesizer import Synthesizer
from vocalis.runtime.async_engine import AsyncEngine
from vocalis.token2wav.config import Token2WavConfig

ATOL = 1e-5
PAUSE_LIMIT_S = 120.0  # the writer's pause ends when the first audio comes, or after this (a failure)


@pytest.fixture(scope="module")
def model() -> LoadedModel:
    return random_model("tiny")


def _pieces_request(model: LoadedModel, pieces: object, seed: int) -> SynthesisRequest:
    return SynthesisRequest(model.voices["default"], Mode.SFT, pieces, seed=seed)  # type: ignore[arg-type]


def _reference(model: LoadedModel, pieces: list[str], seed: int) -> np.ndarray:
    chunks = Synthesizer(model).run(_pieces_request(model, iter(pieces), seed), stream=True)
    return np.concatenate([c.samples for c in chunks])


@pytest.mark.parametrize(("text", "done"), [
    ("Hello there.", True), ("Hello there. ", True), ("Is it?\n", True), ('He said "stop!"', True), ("好的。", True),
    ("Hello there", False), ("Hello, ", False), ("", False),
    ("A clause long enough to be said on its own before the rest comes, ", True),
])
def test_ends_sentence(text: str, done: bool) -> None:
    assert ends_sentence(text) is done


def test_a_paused_sentence_is_said_before_more_text_comes(model: LoadedModel) -> None:
    """The first audio comes while the writer still pauses after "Hello there. "; that sentence's audio is the
    reference's for it alone, and the text after the pause is said after it, to a final chunk."""
    first, second = "Hello there. ", "And goodbye."

    async def run() -> tuple[list[AudioChunk], float, float]:
        heard = asyncio.Event()
        times: dict[str, float] = {}

        async def writer() -> AsyncIterator[str]:
            yield first
            times["sentence"] = time.monotonic()
            try:
                await asyncio.wait_for(heard.wait(), PAUSE_LIMIT_S)
            except TimeoutError:
                pass
            times["resumed"] = time.monotonic()
            yield second

        with AsyncEngine.from_model(model, token2wav_config=Token2WavConfig(final_attention="full")) as eng:
            chunks: list[AudioChunk] = []
            async for chunk in eng.submit(_pieces_request(model, writer(), seed=3)):
                if not chunks:
                    times["audio"] = time.monotonic()
                    heard.set()
                chunks.append(chunk)
            assert eng.llm.block_manager.num_free_blocks == eng.llm.block_manager.num_blocks
            assert eng.stats()["jobs"] == 0
        return chunks, times["audio"] - times["sentence"], times["resumed"] - times["audio"]

    chunks, latency, _ = asyncio.run(run())
    assert latency < PAUSE_LIMIT_S  # the audio came during the pause: nothing waited for more text
    assert [c.final for c in chunks] == [False] * (len(chunks) - 1) + [True]
    assert {c.segment for c in chunks} == {0, 1}
    said_first = np.concatenate([c.samples for c in chunks if c.segment == 0])
    np.testing.assert_allclose(said_first, _reference(model, [first], seed=3), atol=ATOL, rtol=0)
    assert sum(len(c.samples) for c in chunks if c.segment == 1) > 0


def test_text_ending_after_a_cut_sentence_ends_the_stream(model: LoadedModel) -> None:
    """The writer pauses after its one sentence (the sentence is said) and only then ends its text: the stream
    still ends with a final chunk, and its audio is the sentence's."""
    sentence = "Hello there. "

    async def run() -> list[AudioChunk]:
        chunks: list[AudioChunk] = []

        async def writer() -> AsyncIterator[str]:
            yield sentence
            deadline = time.monotonic() + PAUSE_LIMIT_S
            while time.monotonic() < deadline:  # until its audio stopped growing: all said
                count = len(chunks)
                await asyncio.sleep(1.0)
                if count and len(chunks) == count:
                    break

        with AsyncEngine.from_model(model, token2wav_config=Token2WavConfig(final_attention="full")) as eng:
            async for chunk in eng.submit(_pieces_request(model, writer(), seed=5)):
                chunks.append(chunk)
            assert eng.stats()["jobs"] == 0
        return chunks

    chunks = asyncio.run(run())
    assert chunks[-1].final and not any(c.final for c in chunks[:-1])
    got = np.concatenate([c.samples for c in chunks])
    np.testing.assert_allclose(got, _reference(model, [sentence], seed=5), atol=ATOL, rtol=0)


def test_text_written_without_pauses_is_one_bistream(model: LoadedModel) -> None:
    """Sentence ends inside text that keeps coming cut nothing: the reference's one bi-stream, exactly."""
    pieces = ["One thing. ", "Then another. ", "And the end."]

    async def writer() -> AsyncIterator[str]:
        for p in pieces:
            yield p

    async def run() -> list[AudioChunk]:
        with AsyncEngine.from_model(model, token2wav_config=Token2WavConfig(final_attention="full")) as eng:
            return [c async for c in eng.submit(_pieces_request(model, writer(), seed=2))]

    chunks = asyncio.run(run())
    assert {c.segment for c in chunks} == {0}
    got = np.concatenate([c.samples for c in chunks])
    np.testing.assert_allclose(got, _reference(model, pieces, seed=2), atol=ATOL, rtol=0)


def test_builtin_model_speaks_a_paused_sentence_within_a_second() -> None:
    """The built-in model, text in pieces with the writer pausing after its first sentence: the first audio comes
    within 1 s of the sentence's end."""
    from vocalis import TTS

    sentence = "The weather today is mild. "
    with TTS.load() as tts:
        tts.synthesize("Warm up.", seed=0)
        start = time.monotonic()
        next(iter(tts.stream(sentence.strip(), seed=1)))
        whole = time.monotonic() - start

        heard = threading.Event()
        ended: list[float] = []

        def writer():
            yield sentence
            ended.append(time.monotonic())
            heard.wait(PAUSE_LIMIT_S)
            yield "Tomorrow brings rain."

        chunks = []
        for chunk in tts.stream(writer(), seed=1):
            if not chunks:
                latency = time.monotonic() - ended[0]
                heard.set()
            chunks.append(chunk)
    print(f"[text in pieces] built-in model: first audio {latency:.2f} s after the sentence ended "
          f"(the sentence whole: {whole:.2f} s)")
    assert chunks[-1].final and {c.segment for c in chunks} == {0, 1}
    assert latency <= 1.0

