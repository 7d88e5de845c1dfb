"""The server's engine backend on the real tiny pipeline: concurrent jobs batch, admission is bounded, an abort
frees the job's KV blocks and stream state at once, a job waiting for text holds no compute, and what a job
hears equals the reference path's."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest
from serve_support import quick_tts

from vocalis.frontend.request import Mode, SynthesisRequest
from vocalis.reference.synthesizer import Synthesizer
from vocalis.serve.backend import SpeechJob, TextFeed
from vocalis.serve.engine_backend import EngineBackend
from vocalis.serve.errors import Aborted, Overloaded
from vocalis.tts import TTS


@pytest.fixture(scope="module")
def tts(tmp_path_factory) -> TTS:
    return TTS(quick_tts(tmp_path_factory).model)


async def collect(handle) -> np.ndarray:
    return np.concatenate([chunk.samples async for chunk in handle])


def _idle(backend: EngineBackend) -> bool:
    stats = backend.stats()
    return stats["jobs"] == 0 and stats["kv_usage"] == 0.0 and stats["live_jobs"] == 0


async def _until_idle(backend: EngineBackend, timeout_s: float = 10.0) -> bool:
    """Whether the engine lets go of every job within the timeout (its loop does so after the last chunk)."""
    deadline = time.monotonic() + timeout_s
    while not _idle(backend) and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    return _idle(backend)


def test_concurrent_jobs_batch_and_equal_the_reference(tts: TTS) -> None:
    texts = ["Hello there, how are you?", "Short one.", "The quick brown fox jumps over the lazy dog."]

    async def main() -> tuple[list[np.ndarray], int, int]:
        backend = EngineBackend(tts, max_queue=8)
        backend.start()
        try:
            steps0 = tts.engine.num_llm_steps
            handles = [backend.submit(SpeechJob(text=t, seed=i, stream=True)) for i, t in enumerate(texts)]
            out = await asyncio.gather(*[collect(h) for h in handles])
            steps = tts.engine.num_llm_steps - steps0
            assert await _until_idle(backend) and backend.completed == len(texts), backend.stats()
            assert all(h.started is not None and h.finished is not None for h in handles)
            return out, steps, max(len(o) for o in out)
        finally:
            backend.close()

    got, steps, _ = asyncio.run(main())
    synth = Synthesizer(tts.model)
    total_tokens = 0
    for i, (text, audio) in enumerate(zip(texts, got)):
        request = SynthesisRequest(tts.model.voices[tts.voices[0]], Mode.SFT, text, seed=i)
        ref = np.concatenate([c.samples for c in synth.run(request, stream=True)])
        np.testing.assert_allclose(audio, ref, atol=1e-4, rtol=0)
        total_tokens += len(ref) // 960  # one speech token = 40 ms = 960 samples at 24 kHz
    # one LLM step serves every running job: far fewer steps than one job after another would take
    assert steps < 0.8 * total_tokens


def test_admission_is_bounded_and_abort_frees_everything(tts: TTS) -> None:
    async def main() -> None:
        backend = EngineBackend(tts, max_queue=2)
        with pytest.raises(Overloaded, match="not running"):
            backend.submit(SpeechJob(text="Hi."))
        backend.start()
        try:
            a = backend.submit(SpeechJob(text="A longer sentence that takes a while to say.", seed=1))
            b = backend.submit(SpeechJob(text="Another sentence, also long enough.", seed=2))
            with pytest.raises(Overloaded, match="busy"):
                backend.submit(SpeechJob(text="Hi."))
            first = await a.__anext__()
            assert len(first.samples) > 0 and not first.final
            a.abort()
            with pytest.raises(Aborted):
                await collect(a)
            assert len(await collect(b)) > 0
            assert await _until_idle(backend)  # the aborted job's KV blocks and stream state are gone
            assert (backend.completed, backend.aborted) == (1, 1)
            c = backend.submit(SpeechJob(text="Hi again.", seed=3))  # room again
            assert len(await collect(c)) > 0
        finally:
            backend.close()

    asyncio.run(main())


def test_a_job_waiting_for_text_holds_no_compute(tts: TTS) -> None:
    async def main() -> None:
        backend = EngineBackend(tts)
        backend.start()
        try:
            feed = TextFeed(idle_timeout_s=30)
            waiting = backend.submit(SpeechJob(text=feed, seed=1))
            feed.put("Hello ")
            await asyncio.sleep(0.5)  # its first piece is read and prefilled; now it waits for more text
            busy = backend.submit(SpeechJob(text="Other work goes on meanwhile.", seed=2))
            t0 = time.monotonic()
            assert len(await collect(busy)) > 0
            # the waiting session did not hold the engine: the other job finished while it still waits
            assert not waiting.done and time.monotonic() - t0 < 25
            steps = tts.engine.num_llm_steps
            await asyncio.sleep(0.5)
            assert tts.engine.num_llm_steps - steps <= 2  # no spinning while nothing is ready
            feed.put("world.")
            feed.end()
            assert len(await collect(waiting)) > 0
        finally:
            backend.close()

    asyncio.run(main())


def _metric(text: str, name: str) -> float:
    return next(float(line.split()[1]) for line in text.splitlines() if line.startswith(name + " "))


def test_metrics_show_the_engine_and_a_dropped_stream_frees_its_kv(tts: TTS, tmp_path) -> None:
    """Over HTTP: /metrics reports KV usage, running/waiting requests, batch sizes and generated tokens; a client
    that leaves after its first chunk aborts its request, and KV usage is back to 0 once idle."""
    import httpx
    from serve_support import serve

    body = {"model": "vocalis", "input": "A sentence long enough for several chunks, said slowly.", "seed": 1,
            "response_format": "pcm", "stream": True}
    with serve(tts, voices_dir=tmp_path / "voices") as srv, httpx.Client(base_url=srv.url, timeout=120) as client:
        with client.stream("POST", "/v1/audio/speech", json=body) as resp:
            assert resp.status_code == 200
            next(resp.iter_bytes())  # the first chunk, then leave
        deadline = time.monotonic() + 20
        while True:
            text = client.get("/metrics").text
            if _metric(text, "vocalis_kv_cache_usage") == 0.0 and _metric(text, "vocalis_llm_running_requests") == 0:
                break
            assert time.monotonic() < deadline, "the dropped stream kept its KV blocks"
            time.sleep(0.1)
        assert (srv.backend.aborted, srv.backend.completed) == (1, 0)  # freed by the abort, not by finishing
        assert _metric(text, "vocalis_generated_tokens") > 0
        assert _metric(text, "vocalis_llm_waiting_requests") == 0
        for name in ("vocalis_llm_batch_size", "vocalis_token2wav_batch_size", "vocalis_token2wav_waiting_streams",
                     "vocalis_generated_tokens_per_second", "vocalis_engine_queued_requests"):
            _metric(text, name)  # present
        full = client.post("/v1/audio/speech", json={**body, "stream": False, "response_format": "wav"})
        assert full.status_code == 200 and len(full.content) > 44
