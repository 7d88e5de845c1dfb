"""Async engine on the tiny preset: concurrent requests equal the reference path; abort frees everything."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator

import numpy as np
import pytest

from vocalis.engine.config import EngineConfig
from vocalis.errors import InputError
from vocalis.frontend.request import AudioChunk, Mode, SynthesisRequest
from vocalis.kernels.heap import release_free_heap
from vocalis.model_dir import LoadedModel, random_model
from vocalis.reference.synthesizer import Synthesizer
from vocalis.runtime.async_engine import AsyncEngine
from vocalis.runtime.handle import StreamHandle
from vocalis.token2wav.config import Token2WavConfig

TEXTS = ["Hello there, how are you today?", "Short one.", "The quick brown fox jumps over the lazy dog again."]
ATOL = 1e-5  # audio in [-1, 1]; float summation order only (measured ~2e-7)


@pytest.fixture(scope="module")
def model() -> LoadedModel:
    return random_model("tiny")


def _request(model: LoadedModel, text: str, seed: int) -> SynthesisRequest:
    # text_frontend=False keeps wetext (slow to load) out of these tests; the text path is the same
    return SynthesisRequest(model.voices["default"], Mode.SFT, text, seed=seed, text_frontend=False)


async def _collect(handle: StreamHandle) -> list[AudioChunk]:
    return [c async for c in handle]


def test_concurrent_requests_equal_the_reference_path(model: LoadedModel) -> None:
    """Batched LLM + batched token2wav (full-attention final chunk) == Synthesizer one at a time, same seeds."""
    requests = [_request(model, t, seed=i) for i, t in enumerate(TEXTS)]

    async def run() -> list[list[AudioChunk]]:
        with AsyncEngine.from_model(model, token2wav_config=Token2WavConfig(final_attention="full")) as eng:
            handles = [eng.submit(r, stream=(i != 1)) for i, r in enumerate(requests)]  # #1 non-streaming
            out = await asyncio.gather(*[_collect(h) for h in handles])
            assert all(h.first_chunk_latency is not None for h in handles)
            assert eng.llm.block_manager.num_free_blocks == eng.llm.block_manager.num_blocks
            assert eng.stats()["jobs"] == 0
            return out

    got = asyncio.run(run())
    synth = Synthesizer(model)
    for i, (req, chunks) in enumerate(zip(requests, got)):
        ref = list(synth.run(req, stream=(i != 1)))
        assert [c.final for c in chunks] == [False] * (len(chunks) - 1) + [True]
        assert len(chunks) == len(ref)
        a = np.concatenate([c.samples for c in chunks])
        b = np.concatenate([c.samples for c in ref])
        assert a.shape == b.shape
        np.testing.assert_allclose(a, b, atol=ATOL, rtol=0)
    assert len(got[0]) > 1  # streaming really produced several chunks


def test_abort_mid_stream_frees_blocks_and_stream_state(model: LoadedModel) -> None:
    long_text = "This sentence is long enough to keep the language model busy for a good while. " * 2

    async def run() -> None:
        with AsyncEngine.from_model(model) as eng:
            bm = eng.llm.block_manager
            handle = eng.submit(_request(model, long_text, seed=0))
            other = eng.submit(_request(model, TEXTS[1], seed=1))
            first = await handle.__anext__()
            assert not first.final
            job = eng._jobs[handle.request_id]  # still running: its LLM request holds blocks
            assert job.llm_request is not None and job.llm_request.block_table
            await handle.aclose()
            assert job.llm_request is None and all(s.finished and s.enc_cache is None for s in job.states)
            assert [c async for c in handle] == []  # an aborted handle just ends
            rest = await _collect(other)  # the other request is unaffected
            assert rest[-1].final
            assert bm.num_free_blocks == bm.num_blocks and eng.llm.num_unfinished == 0

    asyncio.run(run())


def test_cancelled_consumer_aborts_its_request(model: LoadedModel) -> None:
    async def run() -> None:
        with AsyncEngine.from_model(model) as eng:
            handle = eng.submit(_request(model, TEXTS[2] * 3, seed=3))
            task = asyncio.create_task(_collect(handle))
            while eng.stats()["llm_steps"] < 3:
                await asyncio.sleep(0.01)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            await handle.aclose()
            bm = eng.llm.block_manager
            assert bm.num_free_blocks == bm.num_blocks and eng.stats()["jobs"] == 0

    asyncio.run(run())


PIECES = ["Sure, ", "", "here it ", "is."]  # few text ids: random weights rarely say eos, so 20x text is the length


def _pieces_request(model: LoadedModel, pieces: object, seed: int) -> SynthesisRequest:
    return SynthesisRequest(model.voices["default"], Mode.SFT, pieces, seed=seed)  # type: ignore[arg-type]


def test_text_in_pieces_equals_the_reference_bistream(model: LoadedModel) -> None:
    """Bi-streaming: a blocking iterable and an async one (pieces trickling in) give the reference's audio."""

    async def slow_pieces() -> AsyncIterator[str]:
        for p in PIECES:
            await asyncio.sleep(0.02)
            yield p

    async def run() -> tuple[list[AudioChunk], list[AudioChunk], float]:
        with AsyncEngine.from_model(model, token2wav_config=Token2WavConfig(final_attention="full")) as eng:
            a = eng.submit(_pieces_request(model, iter(PIECES), seed=4))
            b = eng.submit(_pieces_request(model, slow_pieces(), seed=4))
            got_a, got_b = await asyncio.gather(_collect(a), _collect(b))
            return got_a, got_b, eng.stats()["llm_steps"]

    got_a, got_b, _ = asyncio.run(run())
    ref = list(Synthesizer(model).run(_pieces_request(model, iter(PIECES), seed=4), stream=True))
    want = np.concatenate([c.samples for c in ref])
    for got in (got_a, got_b):
        assert got[-1].final
        np.testing.assert_allclose(np.concatenate([c.samples for c in got]), want, atol=ATOL, rtol=0)


def test_waiting_for_text_does_not_spin(model: LoadedModel) -> None:
    async def run() -> None:
        gate = asyncio.Event()

        async def pieces() -> AsyncIterator[str]:
            yield "Hello there. And "  # a sentence (read at once) and the start of one (kept: no cut)
            await gate.wait()
            yield "goodbye."

        with AsyncEngine.from_model(model) as eng:
            handle = eng.submit(_pieces_request(model, pieces(), seed=0))
            # the first piece's work done (however slow the machine): no step for 0.3 s; a loop that kept
            # stepping (spinning) while waiting never gets there
            loop = asyncio.get_running_loop()
            steps, quiet_since = eng.stats()["llm_steps"], loop.time()
            for _ in range(400):  # (the sentence is normalised before its first step: wait for that too)
                await asyncio.sleep(0.05)
                count = eng.stats()["llm_steps"]
                if count != steps:
                    steps, quiet_since = count, loop.time()
                elif steps and loop.time() - quiet_since >= 0.3:
                    break
            await asyncio.sleep(0.3)  # the stream waits for text: the loop sleeps, no steps, no polling
            assert steps > 0 and eng.stats()["llm_steps"] == steps
            gate.set()
            chunks = await _collect(handle)
            assert chunks[-1].final and eng.stats()["llm_steps"] > steps

    asyncio.run(run())


def test_input_errors_surface_from_the_iteration(model: LoadedModel) -> None:
    async def run() -> None:
        with AsyncEngine.from_model(model, EngineConfig(max_model_len=24)) as eng:
            with pytest.raises(InputError, match="positions"):
                await _collect(eng.submit(_request(model, TEXTS[2] * 4, seed=0)))
            ok = await _collect(eng.submit(_request(model, "Hi.", seed=0)))  # the engine keeps serving
            assert ok[-1].final

    asyncio.run(run())


def test_grouped_token2wav_steps_give_the_same_audio_in_fewer_steps(model: LoadedModel) -> None:
    """Requests prefilled in different LLM steps become ready a few steps apart: the grouping policy holds the
    first for the others (fewer token2wav steps, each over more requests) and the audio is unchanged."""
    import dataclasses

    from vocalis.engine.request import SamplingParams
    from vocalis.runtime.step_grouping import StepGrouping

    class FixedLength(AsyncEngine):
        def llm_params(self, text_ids: list[int]) -> SamplingParams:
            return dataclasses.replace(super().llm_params(text_ids), min_len=60, max_len=60, stop_all_masked=True)

    requests = [_request(model, t, seed=i) for i, t in enumerate(TEXTS)]

    async def run(grouping: StepGrouping) -> tuple[list[list[AudioChunk]], list[int]]:
        # a step wide enough for every request: the grouping is under test, not the step width
        eng = FixedLength.from_model(model, EngineConfig(max_num_batched_tokens=24),
                                     token2wav_config=Token2WavConfig(max_batch=len(requests)), grouping=grouping)
        sizes: list[int] = []
        step = eng.token2wav.step
        eng.token2wav.step = lambda states, **kw: (  # type: ignore[method-assign]
            sizes.append(len(states)), step(states, **kw))[1]
        with eng:
            out = await asyncio.gather(*[_collect(eng.submit(r)) for r in requests])
        return out, sizes

    grouped, grouped_sizes = asyncio.run(run(StepGrouping(max_wait_steps=16, max_wait_s=60.0)))
    alone, alone_sizes = asyncio.run(run(StepGrouping(enabled=False)))
    assert sum(grouped_sizes) == sum(alone_sizes)  # the same chunks...
    assert len(grouped_sizes) < len(alone_sizes)  # ...in fewer token2wav steps
    for a, b in zip(grouped, alone):
        assert [c.final for c in a] == [c.final for c in b]
        np.testing.assert_allclose(np.concatenate([c.samples for c in a]), np.concatenate([c.samples for c in b]),
                                   atol=ATOL, rtol=0)


def test_streams_beyond_the_cache_budget_wait_instead_of_recomputing(model: LoadedModel) -> None:
    """Three concurrent 100-token streams with token2wav cache room for about one, `wait_for_cache`: the later
    ones start their caches as earlier ones end (none falls back to recomputing) and the audio equals an unbounded
    engine's."""
    import dataclasses

    from vocalis.engine.request import SamplingParams

    class FixedLength(AsyncEngine):
        def llm_params(self, text_ids: list[int]) -> SamplingParams:
            return dataclasses.replace(super().llm_params(text_ids), min_len=100, max_len=100, stop_all_masked=True)

    requests = [_request(model, t, seed=i) for i, t in enumerate(TEXTS)]

    async def run(config: Token2WavConfig) -> tuple[list[list[AudioChunk]], FixedLength]:
        eng = FixedLength.from_model(model, token2wav_config=config)
        with eng:
            out = await asyncio.gather(*[_collect(eng.submit(r)) for r in requests])
            assert eng.stats()["token2wav_waiting"] == 0
        return out, eng

    # ~113 tokens at the tiny shapes
    tight, tight_eng = asyncio.run(run(Token2WavConfig(max_cache_mib=1, wait_for_cache=True)))
    free, _ = asyncio.run(run(Token2WavConfig()))
    stats = tight_eng.token2wav.stats
    assert stats.held_steps > 0 and stats.cache_fallbacks == 0
    for a, b in zip(tight, free):
        assert [c.final for c in a] == [c.final for c in b] and len(a) == 3  # chunks of 25 and 50 tokens, final
        np.testing.assert_allclose(np.concatenate([c.samples for c in a]), np.concatenate([c.samples for c in b]),
                                   atol=ATOL, rtol=0)


def test_requests_beyond_max_streams_queue_in_order(model: LoadedModel) -> None:
    """`max_streams=1`: while a bi-stream waits for its text the others queue; an aborted queued request just ends;
    each request starts when the one before it has ended (its first chunk after the other's last); a queued
    bi-stream keeps the text pieces that arrived while it waited; the audio equals the uncapped engine's."""

    async def run(cap: int | None) -> tuple[list[list[AudioChunk]], list[tuple[float, float]]]:
        gate = asyncio.Event()

        async def held_pieces() -> AsyncIterator[str]:  # in flight until the test lets its text go on
            yield "Sure, "
            await gate.wait()
            for p in PIECES[1:]:
                yield p

        async def until(what: str, value: int) -> None:
            deadline = time.monotonic() + 60
            while eng.stats()[what] != value:
                assert time.monotonic() < deadline, (what, eng.stats()[what], value)
                await asyncio.sleep(0.01)

        with AsyncEngine.from_model(model, token2wav_config=Token2WavConfig(max_streams=cap)) as eng:
            handles = [eng.submit(_pieces_request(model, held_pieces(), seed=4))]
            await until("jobs", 1)  # in flight first; the rest are prepared in any order but start in submit order
            handles += [eng.submit(_request(model, TEXTS[0], seed=0)),
                        eng.submit(_pieces_request(model, iter(PIECES), seed=5))]
            dropped = eng.submit(_request(model, TEXTS[2], seed=9))
            if cap == 1:
                await until("jobs_queued", 3)
            await dropped.aclose()
            await until("jobs_queued", 2 if cap == 1 else 0)
            gate.set()

            async def timed(h: StreamHandle) -> tuple[list[AudioChunk], tuple[float, float]]:
                chunks, first = [], None
                async for c in h:
                    first = first or time.monotonic()
                    chunks.append(c)
                return chunks, (first, time.monotonic())

            out = await asyncio.gather(*[timed(h) for h in handles])
            assert [c async for c in dropped] == [] and eng.stats()["jobs"] == eng.stats()["jobs_queued"] == 0
            assert eng.llm.block_manager.num_free_blocks == eng.llm.block_manager.num_blocks
            return [o[0] for o in out], [o[1] for o in out]

    capped, spans = asyncio.run(asyncio.wait_for(run(1), 300))  # a lost text piece would wait forever
    free, free_spans = asyncio.run(asyncio.wait_for(run(None), 300))
    assert spans[0][1] <= spans[1][0] and spans[1][1] <= spans[2][0]  # one at a time, in order
    assert free_spans[1][0] < free_spans[0][1]  # uncapped, they overlap
    for a, b in zip(capped, free):
        assert a[-1].final and len(a) == len(b)
        np.testing.assert_allclose(np.concatenate([c.samples for c in a]), np.concatenate([c.samples for c in b]),
                                   atol=ATOL, rtol=0)


def _rss_mib() -> float:
    with open("/proc/self/status", encoding="ascii") as f:
        return next(int(line.split()[1]) / 1024 for line in f if line.startswith("VmRSS:"))


@pytest.mark.skipif(not release_free_heap(), reason="no glibc malloc_trim here")
def test_release_free_heap_gives_freed_holes_back() -> None:
    """Blocks below the mmap threshold freed in the middle of the heap stay resident (a live block above them
    keeps the heap from shrinking) until the release hands them back."""
    blocks = [np.ones(64 * 1024 // 8) for _ in range(3000)]  # ~190 MiB of 64 KiB heap blocks, pages touched
    keep = blocks[::100]
    del blocks
    before = _rss_mib()
    assert release_free_heap()
    after = _rss_mib()
    print(f"RSS {before:.0f} -> {after:.0f} MiB")
    assert before - after > 100
    assert all(float(b[0]) == 1.0 for b in keep)


_BURST = """
import sys
import numpy as np
from vocalis.kernels.heap import cap_mmap_threshold, rss_bytes
if sys.argv[1] == "cap":
    assert cap_mmap_threshold()
np.ones((24 << 20) // 8).sum()  # a mapped block, freed: glibc would raise its threshold past 24 MiB from here on
base = rss_bytes()
keep, blocks = [], []
for i in range(40):  # 8 MiB tensors, every other one kept alive (a step's outputs), so freed ones cannot merge
    (keep if i % 2 else blocks).append(np.ones((8 << 20) // 8))
del blocks
print((rss_bytes() - base - 20 * (8 << 20)) >> 20)  # resident beyond the kept tensors: the freed ones' holes
"""


@pytest.mark.skipif(not release_free_heap(), reason="no glibc malloc here")
@pytest.mark.parametrize("cap", [True, False])
def test_capped_mmap_threshold_leaves_no_holes_after_a_burst(cap: bool) -> None:
    """After a mapped block is freed glibc serves tensors of several MiB from the heap, and freeing them between
    ones still alive leaves ~160 MiB of resident holes; with the threshold capped (what the engine does at start)
    they are unmapped as they are freed. A fresh process each: the threshold is process-wide and set once."""
    env = {k: v for k, v in os.environ.items() if k not in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")}
    out = subprocess.run([sys.executable, "-c", _BURST, "cap" if cap else "dynamic"], env=env, check=True,
                         capture_output=True, text=True).stdout
    grown_mib = int(out)
    assert grown_mib < 40 if cap else grown_mib > 120, grown_mib


def _wait_for(cond: object, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():  # type: ignore[operator]
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


@pytest.mark.parametrize("release", [True, False])
def test_heap_is_released_once_each_time_the_loop_runs_out_of_work(model: LoadedModel, release: bool) -> None:
    async def burst(eng: AsyncEngine, seed: int) -> None:
        handles = [eng.submit(_request(model, t, seed=seed + i)) for i, t in enumerate(TEXTS[:2])]
        await asyncio.gather(*[_collect(h) for h in handles])

    with AsyncEngine.from_model(model, release_heap_when_idle=release) as eng:
        for n in (1, 2):
            asyncio.run(burst(eng, 10 * n))
            _wait_for(lambda: not eng._heap_used)  # the loop found itself out of work
            time.sleep(0.3)  # idle: no further release, no spinning
            assert eng.num_heap_releases == (n if release and release_free_heap() else 0)


def test_back_to_back_requests_keep_the_heap_until_the_loop_is_quiet(model: LoadedModel) -> None:
    """A request arriving within the delay finds the pages its predecessor touched (no release in between);
    the heap goes back once the loop has been idle for the delay."""
    async def one(eng: AsyncEngine, seed: int) -> None:
        await _collect(eng.submit(_request(model, TEXTS[0], seed=seed)))

    with pytest.raises(InputError, match="heap_release_delay_s"):
        AsyncEngine.from_model(model, heap_release_delay_s=-1.0)
    with AsyncEngine.from_model(model, heap_release_delay_s=2.0) as eng:
        for seed in range(3):
            asyncio.run(one(eng, seed))
            assert eng.num_heap_releases == 0
        _wait_for(lambda: not eng._heap_used)  # the loop found itself out of work for the delay
        time.sleep(0.3)  # the release follows
        assert eng.num_heap_releases == (1 if release_free_heap() else 0)
