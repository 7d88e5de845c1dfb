"""The overlapped engine loop (token2wav steps on a worker thread beside the LLM steps, `runtime.overlap`) gives the
serial loop's audio for both families, and abort, close and a failing step still end every request cleanly; the
deadline policy (`runtime.deadlines`) puts a new request's first chunk before a running stream's later chunks."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from pathlib import Path

import numpy as np
import pytest

from vocalis.engine.config import EngineConfig
from vocalis.engine.request import SamplingParams
from vocalis.frontend.request import AudioChunk, Mode, SynthesisRequest
from vocalis.model_dir import LoadedModel, random_model
from vocalis.runtime.async_engine import AsyncEngine
from vocalis.runtime.deadlines import DeadlineScheduling
from vocalis.runtime.handle import EngineClosed, StreamHandle
from vocalis.runtime.overlap import OverlapConfig
from vocalis.token2wav.config import Token2WavConfig

TEXTS = ["Hello there, how are you today?", "Short one.", "The quick brown fox jumps over the lazy dog again."]
ATOL = 1e-5  # audio in [-1, 1]; float summation order only (steps of other widths)
SERIAL, OVERLAP = OverlapConfig(enabled=False), OverlapConfig(enabled=True)


class Fixed(AsyncEngine):  # a random LLM may stop after 2 ids: 80 make three chunks (25, 50, the rest)
    def llm_params(self, text_ids: list[int]) -> SamplingParams:
        return dataclasses.replace(super().llm_params(text_ids), min_len=80, max_len=80, stop_all_masked=True)


class Short(AsyncEngine):  # 40 ids: a first chunk and a final one
    def llm_params(self, text_ids: list[int]) -> SamplingParams:
        return dataclasses.replace(super().llm_params(text_ids), min_len=40, max_len=40, stop_all_masked=True)


@pytest.fixture(scope="module")
def model() -> LoadedModel:
    return random_model("tiny")


@pytest.fixture(scope="module")
def cv3(cv3_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    from cv3_support import make_cv3_model_dir

    from vocalis.model_dir import load_model

    return load_model(make_cv3_model_dir(tmp_path_factory.mktemp("cv3") / "m", cv3_dir, long_spoken=False))


def _requests(model: LoadedModel) -> list[SynthesisRequest]:
    voice = model.voices["default"]
    return [SynthesisRequest(voice, Mode.SFT, t, seed=i, text_frontend=False) for i, t in enumerate(TEXTS)]


async def _collect(handle: StreamHandle) -> list[AudioChunk]:
    return [c async for c in handle]


def _run(model: LoadedModel, overlap: OverlapConfig) -> tuple[list[list[AudioChunk]], int, set[str]]:
    """Every request (the second one not streamed); with the LLM steps that ran while a token2wav step was in flight,
    and the threads the token2wav steps ran on."""
    eng = Fixed.from_model(model, EngineConfig(max_num_batched_tokens=24), overlap=overlap)
    beside, threads = 0, set()
    llm_step, t2w_step = eng.llm.step, eng.token2wav.step

    def counted_llm_step():  # type: ignore[no-untyped-def]
        nonlocal beside
        beside += eng._steps.in_flight
        return llm_step()

    def named_t2w_step(states, **kw):  # type: ignore[no-untyped-def]
        threads.add(threading.current_thread().name.split("_")[0])
        return t2w_step(states, **kw)

    eng.llm.step = counted_llm_step  # type: ignore[method-assign]
    eng.token2wav.step = named_t2w_step  # type: ignore[method-assign]

    async def run() -> list[list[AudioChunk]]:
        with eng:
            out = await asyncio.gather(*[_collect(eng.submit(r, stream=i != 1))
                                         for i, r in enumerate(_requests(model))])
            assert eng.llm.block_manager.num_free_blocks == eng.llm.block_manager.num_blocks
            assert eng.stats()["jobs"] == 0
        return out

    return asyncio.run(run()), beside, threads


@pytest.mark.parametrize("family", ["cosyvoice2", "cosyvoice3"])
def test_overlapped_loop_gives_the_serial_audio(family: str, request: pytest.FixtureRequest) -> None:
    model = request.getfixturevalue("model" if family == "cosyvoice2" else "cv3")
    serial, serial_beside, serial_threads = _run(model, SERIAL)
    overlapped, beside, threads = _run(model, OVERLAP)
    assert serial_beside == 0 and serial_threads == {"vocalis-engine"}
    assert beside > 0 and threads == {"vocalis-token2wav"}  # it did overlap, on the worker
    assert len(serial[0]) > 2  # streamed in several chunks
    for a, b in zip(overlapped, serial, strict=True):
        assert [c.final for c in a] == [c.final for c in b]
        assert [len(c.samples) for c in a] == [len(c.samples) for c in b]
        np.testing.assert_allclose(np.concatenate([c.samples for c in a]), np.concatenate([c.samples for c in b]),
                                   atol=ATOL, rtol=0)


def test_abort_close_and_a_failing_step_end_every_request(model: LoadedModel) -> None:
    """Overlapped: an aborted request ends and frees its blocks and caches while the others go on; a token2wav step
    that raises fails the requests in flight with its error and the engine serves the next; close mid-stream ends
    the rest with EngineClosed."""
    long = SynthesisRequest(model.voices["default"], Mode.SFT, TEXTS[2] * 3, seed=5, text_frontend=False)

    async def run() -> None:
        eng = Fixed.from_model(model, overlap=OVERLAP)
        with eng:
            # abort after the first chunk of one of two
            doomed, kept = eng.submit(long), eng.submit(_requests(model)[0])
            first = await doomed.__anext__()
            assert not first.final
            doomed.abort()
            rest = [c async for c in doomed]
            assert not rest or not rest[-1].final  # ended early, without its final chunk
            ok = await _collect(kept)
            assert ok[-1].final
            assert eng.llm.block_manager.num_free_blocks == eng.llm.block_manager.num_blocks
            assert not eng.token2wav.started_streams()

            # a failing token2wav step (on the worker): its error reaches the callers; the loop goes on
            step = eng.token2wav.step
            failed = []

            def failing(states, **kw):  # type: ignore[no-untyped-def]
                if not failed:
                    failed.append(True)
                    raise RuntimeError("token2wav step broke")
                return step(states, **kw)

            eng.token2wav.step = failing  # type: ignore[method-assign]
            with pytest.raises(RuntimeError, match="token2wav step broke"):
                await _collect(eng.submit(_requests(model)[1]))
            after = await _collect(eng.submit(_requests(model)[1]))
            assert after[-1].final
            assert eng.llm.block_manager.num_free_blocks == eng.llm.block_manager.num_blocks

            # close with a request mid-stream
            closing = eng.submit(long)
            await closing.__anext__()
            await asyncio.get_running_loop().run_in_executor(None, eng.close)
            with pytest.raises(EngineClosed):
                await _collect(closing)
            assert eng.llm.block_manager.num_free_blocks == eng.llm.block_manager.num_blocks  # freed before the error

    asyncio.run(run())


def test_a_new_requests_first_chunk_does_not_wait_for_a_running_streams_later_chunks(model: LoadedModel) -> None:
    """A long voice conversion (all its ids given: a later chunk is always ready, and it runs far ahead of real time)
    is under way when a request arrives: that request's first chunk comes from a token2wav step without the long
    stream, whose handed-out audio has not run out."""
    import torch

    from vocalis.frontend.voice import Voice

    default = model.voices["default"]
    recorded = Voice("recorded", "", (), tuple(i % 100 for i in range(30)), torch.full((60, 80), -5.0),
                     default.embedding)
    vc = SynthesisRequest(recorded, Mode.VC, source_speech_ids=tuple(i % 100 for i in range(1600)), seed=3)
    steps: list[list[str]] = []

    async def run(overlap: OverlapConfig) -> None:
        eng = Short.from_model(model, token2wav_config=Token2WavConfig(max_batch=4), overlap=overlap,
                               deadlines=DeadlineScheduling(enabled=True))
        step = eng.token2wav.step

        def recorded_step(states, **kw):  # type: ignore[no-untyped-def]
            chunks = step(states, **kw)
            steps.append([c.request_id for c in chunks])
            return chunks

        eng.token2wav.step = recorded_step  # type: ignore[method-assign]
        with eng:
            long = eng.submit(vc, request_id="long")
            for _ in range(12):  # ~43 s of audio handed out, far ahead of the wall clock
                await long.__anext__()
            got = await _collect(eng.submit(_requests(model)[0], request_id="new"))
            assert got[-1].final
            await long.aclose()

    for overlap in (SERIAL, OVERLAP):
        steps.clear()
        asyncio.run(run(overlap))
        i = next(i for i, ids in enumerate(steps) if "new/0" in ids)
        assert steps[i] == ["new/0"]
