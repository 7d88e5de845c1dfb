"""The reference ThreadedBackend on the real tiny pipeline: one job at a time, bounded queue, aborts, timeouts, shutdown."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from serve_support import quick_tts

from vocalis.reference.threaded_backend import ReferenceTTS, ThreadedBackend
from vocalis.serve.backend import SpeechJob, TextFeed
from vocalis.serve.errors import Aborted, JobTimeout, Overloaded


@pytest.fixture(scope="module")
def tts(tmp_path_factory):
    return ReferenceTTS(quick_tts(tmp_path_factory).model)


async def collect(handle) -> np.ndarray:
    return np.concatenate([chunk.samples async for chunk in handle])


def test_jobs_run_in_order_and_queue_is_bounded(tts) -> None:
    async def main() -> None:
        backend = ThreadedBackend(tts, max_queue=2)
        with pytest.raises(Overloaded, match="not running"):
            backend.submit(SpeechJob(text="Hi."))
        backend.start()
        try:
            feed = TextFeed(idle_timeout_s=30)
            blocker = backend.submit(SpeechJob(text=feed))  # holds the worker until its text ends
            while backend.active == 0:
                await asyncio.sleep(0.01)
            a = backend.submit(SpeechJob(text="Hi.", seed=1))
            b = backend.submit(SpeechJob(text="Hi.", seed=1))
            assert backend.queue_depth == 2
            with pytest.raises(Overloaded, match="busy"):
                backend.submit(SpeechJob(text="Hi."))
            b.abort()  # aborted while queued: never runs
            feed.put("Done now.")
            feed.end()
            assert len(await collect(blocker)) > 0
            assert len(await collect(a)) > 0
            with pytest.raises(Aborted):
                await collect(b)
            assert backend.queue_depth == 0 and backend.active == 0
            assert (backend.completed, backend.aborted) == (2, 1)
        finally:
            backend.close()

    asyncio.run(main())


def test_timeouts_and_shutdown(tts) -> None:
    async def main() -> None:
        backend = ThreadedBackend(tts, queue_timeout_s=0.2)
        backend.start()
        feed = TextFeed(idle_timeout_s=0.3)
        idle = backend.submit(SpeechJob(text=feed))
        late = backend.submit(SpeechJob(text="Hi."))  # waits 0.3 s (> 0.2 s) behind `idle`
        with pytest.raises(JobTimeout, match="no text arrived"):
            await collect(idle)
        with pytest.raises(Overloaded, match="waited"):
            await collect(late)
        backend.queue_timeout_s = 60
        feed2 = TextFeed(idle_timeout_s=30)
        running = backend.submit(SpeechJob(text=feed2))
        queued = backend.submit(SpeechJob(text="Hi."))
        while backend.active == 0:
            await asyncio.sleep(0.01)
        await asyncio.to_thread(backend.close)  # aborts both and stops the worker
        with pytest.raises(Overloaded, match="shutting down"):
            await collect(queued)
        with pytest.raises(Aborted):
            await collect(running)

    asyncio.run(main())
