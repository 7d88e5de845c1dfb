"""The async front: one loop thread owns the models and interleaves batched LLM steps with batched token2wav steps for
every request; callers submit a `SynthesisRequest` and iterate its audio chunks asynchronously.

Threads: the engine loop thread is the only one touching the LLM engine, the token2wav engine and the jobs' stream
states (but for the token2wav worker, which owns the latter two while a step it runs is in flight). Callers (on an
asyncio event loop) only post messages ("add", "abort", "fail", and a bi-stream's "text", "text_cut", "text_end") to an
inbox guarded by a condition variable that wakes the loop; the loop sends chunks back with `call_soon_threadsafe`. Text
normalisation and tokenisation run in the default executor before a job is posted. No per-request threads, no polling:
an idle loop sleeps on the condition.

One iteration: take the inbox; one LLM step (all running requests, prefill chunks and decodes); one token2wav step over
the requests with a chunk ready, unless the grouping policy (`step_grouping`) holds them for a few more LLM steps
because other requests are about to have a chunk ready too (one token2wav step over all of them costs much less than
two); it takes the chunks due first (`deadlines`). Overlapped (`OverlapConfig`), the token2wav step runs on a worker
thread beside the LLM steps instead of after one (`overlap`, `token2wav_steps`). A job speaks its sentences in order:
sentence k + 1's LLM request starts when sentence k's ends (they share the request's RNG, as on the reference path);
only the oldest unfinished sentence of a job is vocoded, so chunks arrive in order. Text given in pieces (bi-streaming)
is read on the caller's event loop (`runtime.text_pump`) and posted to the loop piece by piece. Abort (explicit, or the
consumer cancelled) frees the job's KV blocks and token2wav caches on the loop's next iteration boundary: at once when
idle, after the step in flight otherwise. Once the loop has been out of work for `heap_release_delay_s` it gives the
heap's free memory back to the system (`kernels.heap`; `release_heap_when_idle`), so a server's RSS does not creep up
from burst to burst, while back-to-back requests keep the pages their predecessors touched; under sustained load it
does so after a step once RSS has grown past a slack (`HeapWatch`), so the holes that large batched steps free never
add up to more than the machine has; and it fixes glibc's mmap threshold when it starts (`cap_mmap_threshold`), so
large tensors leave no holes at all.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Self

import numpy as np

from vocalis.backends.choice import Runtime, make_llm_engine
from vocalis.config import StreamConfig
from vocalis.engine.config import EngineConfig
from vocalis.engine.llm_engine import LLMEngine
from vocalis.engine.request import RequestStatus, SamplingParams
from vocalis.errors import InputError
from vocalis.frontend.family import frontend_for
from vocalis.frontend.notices import collect_notices
from vocalis.frontend.request import AudioChunk, SynthesisRequest
from vocalis.kernels.heap import HeapWatch, cap_mmap_threshold
from vocalis.kernels.threads import release_openmp_pool
from vocalis.model_dir import LoadedModel
from vocalis.runtime.admission import AdmissionQueue
from vocalis.runtime.deadlines import DeadlineScheduling
from vocalis.runtime.engine_stats import engine_stats
from vocalis.runtime.handle import END, EngineClosed, Job, StreamHandle, message_job_id, new_job_id
from vocalis.runtime.job_prep import prepare_job, start_sentence
from vocalis.runtime.overlap import OverlapConfig
from vocalis.runtime.rate import RateMeter
from vocalis.runtime.readiness import vocodable
from vocalis.runtime.step_grouping import StepGrouping
from vocalis.runtime.text_pump import TextPump, route_text
from vocalis.runtime.token2wav_steps import Delivered, Token2WavSteps
from vocalis.token2wav import Token2Wav, Token2WavChunk, Token2WavConfig, Token2WavStream, token2wav_for

if TYPE_CHECKING:
    from vocalis.backends.vllm.engine import VLLMEngine

log = logging.getLogger(__name__)

# Sentences the engine stopped itself, without an end of speech: the text's length bound, or a repeating cycle
_RUNAWAY = (RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_CYCLE)
HEAP_RELEASE_DELAY_S = 1.0  # idle seconds before the loop gives the heap's free memory back (AsyncEngine)


class AsyncEngine:
    """Batched synthesis for many concurrent requests. Use as a context manager, or `start()` / `close()`."""

    def __init__(self, model: LoadedModel, llm: LLMEngine | VLLMEngine,
                 token2wav: Token2Wav[Token2WavStream],
                 grouping: StepGrouping | None = None, release_heap_when_idle: bool = True,
                 heap_release_delay_s: float = HEAP_RELEASE_DELAY_S, overlap: OverlapConfig | None = None,
                 deadlines: DeadlineScheduling | None = None) -> None:
        if not heap_release_delay_s >= 0:
            raise InputError(f"heap_release_delay_s must be >= 0 seconds, got {heap_release_delay_s}")
        self.model = model
        self.release_heap_when_idle = release_heap_when_idle
        self.heap_release_delay_s = heap_release_delay_s
        self._heap_used = False  # loop thread only: work ran since the heap was last released
        self.num_heap_releases = 0
        self.heap_watch = HeapWatch()  # loop thread only
        self.llm = llm
        self.token2wav = token2wav
        self.grouping = grouping if grouping is not None else StepGrouping()
        device = next(model.flow.parameters()).device
        self._steps = Token2WavSteps(token2wav, device, overlap or OverlapConfig(), self.grouping,
                                     deadlines or DeadlineScheduling(), self._wake)
        self._llm_step_s = 0.0  # recent seconds per LLM step (moving average), for the grouping's time bound
        self.frontend = frontend_for(model)  # text normalisation, voices, prompts (the reference path shares it)
        self.sample_rate = model.config.sample_rate
        self._cond = threading.Condition()
        self._inbox: list[tuple[str, Any]] = []
        self._jobs: dict[str, Job] = {}  # loop thread only: jobs started (LLM or token2wav work in flight)
        self._queue = AdmissionQueue(token2wav.config.max_streams)  # loop thread only: jobs not started yet
        self._handles: dict[str, StreamHandle] = {}  # under _cond: handles not yet ended, for abort by id
        self._submissions = itertools.count()  # under _cond: submission numbers (the admission order)
        self._thread: threading.Thread | None = None
        self._text: TextPump | None = None  # reads bi-streams' text pieces (runtime.text_pump)
        self._closing = False
        self.num_llm_steps = 0
        self.num_token2wav_steps = 0
        self.last_llm_batch = 0  # requests in the last LLM step
        self.last_token2wav_batch = 0  # streams in the last token2wav step
        self.generated = RateMeter()  # generated speech tokens: total and per second (for /metrics)
        self.runaway_stops = dict.fromkeys((s.value for s in _RUNAWAY), 0)  # sentences stopped by the guard

    @classmethod
    def from_model(cls, model: LoadedModel, config: EngineConfig | None = None,
                   token2wav_config: Token2WavConfig | None = None, stream: StreamConfig | None = None,
                   grouping: StepGrouping | None = None, runtime: Runtime | None = None,
                   release_heap_when_idle: bool = True, heap_release_delay_s: float = HEAP_RELEASE_DELAY_S,
                   overlap: OverlapConfig | None = None, deadlines: DeadlineScheduling | None = None
                   ) -> AsyncEngine:
        """Build the LLM engine (ours, or vLLM's when `runtime`, what `apply_backend` returned, is the vllm
        backend's) and the batched token2wav engine of the model's family (CosyVoice 2 or 3) over a loaded model's
        modules; InputError for modules neither runs."""
        if runtime is not None and not runtime.kernels.bf16_gemm:
            token2wav_config = replace(token2wav_config or Token2WavConfig(), native_kernels=False)
        token2wav = token2wav_for(model.flow, model.hift, token2wav_config, stream)
        return cls(model, make_llm_engine(model, config, runtime), token2wav, grouping, release_heap_when_idle,
                   heap_release_delay_s, overlap, deadlines)

    # ---- lifecycle ------------------------------------------------------------------------------------
    def start(self) -> Self:
        if self._thread is None:
            self._closing = False
            # the loop thread should be the one with an OpenMP pool: the caller's (it built the engine; `TTS.load`
            # gives the loading thread's back) would make every op of the loop wait for sleeping workers
            # (threads.release_openmp_pool)
            release_openmp_pool()
            cap_mmap_threshold()  # [memory] large tensors mapped whole, not left as arena holes (kernels.heap)
            self._steps.open()
            self._thread = threading.Thread(target=self._run, name="vocalis-engine", daemon=True)
            self._thread.start()
        return self

    def close(self, timeout_s: float = 30.0) -> None:
        """Stop the loop after its current step; unfinished requests get `EngineClosed`."""
        with self._cond:
            self._closing = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(timeout_s)
            self._thread = None
        if self._text is not None:
            self._text.close()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- submitting (event-loop side) ---------------------------------------------------------------
    def submit(self, request: SynthesisRequest | Callable[[], SynthesisRequest], *, stream: bool = True,
               request_id: str | None = None) -> StreamHandle:
        """Queue a synthesis; iterate the returned handle for its `AudioChunk`s (the last has final=True).

        Must be called from a running event loop. Input errors surface from the iteration. `request` may be a
        function that builds it (decoding uploaded audio, making a voice): it runs in the same worker thread as
        the rest of the preparation, off the caller's loop.
        """
        if self._thread is None:
            raise EngineClosed("the engine is not running (call start())")
        loop = asyncio.get_running_loop()
        with self._cond:
            handle = StreamHandle(self, request_id or new_job_id(), loop, next(self._submissions))
            if handle.request_id in self._handles:
                raise ValueError(f"request id {handle.request_id!r} is already in use")
            self._handles[handle.request_id] = handle
        future = loop.run_in_executor(None, self._prepare, request, stream, handle)

        def posted(f: asyncio.Future[Job]) -> None:
            if self._closing:
                handle._put(EngineClosed("the engine was closed"))
            elif f.cancelled():
                handle._put(EngineClosed("the request was cancelled before it started"))
            elif f.exception() is not None:
                handle._put(f.exception())
            else:
                job = f.result()
                self._post(("add", job))
                if job.text is not None:
                    with collect_notices(into=handle.warnings):  # what reading the pieces notes reaches the caller
                        handle._pump = loop.create_task(self._text_pump().pump(job.job_id, job.text, loop, job.reader))

        future.add_done_callback(posted)
        return handle

    def abort(self, request_id: str) -> None:
        """Abort a request by id (as its handle's `abort()`); unknown or finished ids are ignored."""
        with self._cond:
            handle = self._handles.get(request_id)
        if handle is not None:
            handle.abort()

    def _forget(self, request_id: str) -> None:
        with self._cond:
            self._handles.pop(request_id, None)

    def _post(self, message: tuple[str, Any]) -> None:
        with self._cond:
            self._inbox.append(message)
            self._cond.notify()

    def _wake(self) -> None:  # the token2wav worker: its step has ended
        with self._cond:
            self._cond.notify()

    def stats(self) -> dict[str, float]:
        """Live counters (any thread; values may be one step old): `runtime.engine_stats`."""
        return engine_stats(self, len(self._jobs), len(self._queue))

    # ---- preparing a job (executor thread; touches no engine state) ------------------------------------
    def _prepare(self, request: SynthesisRequest | Callable[[], SynthesisRequest], stream: bool,
                 handle: StreamHandle) -> Job:
        try:
            with collect_notices() as notices:  # what reading the request noted for its caller
                built = request if isinstance(request, SynthesisRequest) else request()
                job = prepare_job(self.frontend, self.token2wav, built, stream, handle)
            handle.warnings.extend(notices)
            return job
        finally:
            release_openmp_pool()  # an executor thread: keep no pool that slows the loop's (see start)

    def _text_pump(self) -> TextPump:
        with self._cond:
            if self._text is None:  # a model without a text tokenizer never gets here (prepare_job checks)
                self._text = TextPump(self._post)
            return self._text

    # ---- the loop (engine thread) -----------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._cond:
                while self._waiting():  # [no polling] the token2wav step in flight is all there is: its end wakes us
                    self._cond.wait()
                idle = self._idle()
                if idle and self._heap_used and self.release_heap_when_idle:
                    # [memory] give the heap back only after a quiet spell: the next request's first token2wav
                    # step would fault it all in again
                    deadline = time.monotonic() + self.heap_release_delay_s
                    while idle and (left := deadline - time.monotonic()) > 0:
                        self._cond.wait(left)
                        idle = self._idle()
                while idle and not self._heap_used:
                    self._cond.wait()
                    idle = self._idle()
                if not idle:
                    inbox, self._inbox = self._inbox, []
                    closing = self._closing
            if idle:  # out of work after some: free heap back to the system, outside the lock, then sleep
                self._heap_used = False
                if self.release_heap_when_idle and self.heap_watch.release():
                    self.num_heap_releases += 1
                continue
            self._heap_used = True
            for kind, payload in inbox:
                try:
                    self._handle(kind, payload)
                except Exception as exc:  # a bug: fail that message's request rather than end the loop
                    log.exception("engine message %r failed", kind)
                    self._abort(message_job_id(kind, payload), exc)
            if closing:
                self._settle()
                for job_id in [*self._queue.ids(), *self._jobs]:
                    self._abort(job_id, EngineClosed("the engine was closed"))
                self._steps.close()
                return
            try:
                self._iteration()
                if self.release_heap_when_idle:
                    self.heap_watch.after_step()
            except Exception as exc:  # a bug: fail what is running rather than hang every caller
                log.exception("engine step failed")
                self._fail_all(exc)

    def _handle(self, kind: str, payload: Any) -> None:
        if kind != "add":  # [ownership] these touch stream states: not while a token2wav step owns them
            self._settle()
        if kind == "add":
            self._add(payload)
        elif kind == "abort":
            self._abort(payload, None)
        elif kind == "fail":
            self._abort(*payload)
        else:  # "text" / "text_cut" / "text_end" of a bi-stream
            route_text(self, kind, payload)

    def _idle(self) -> bool:
        return not (self._inbox or self._closing or self._has_work())

    def _waiting(self) -> bool:
        return not (self._inbox or self._closing or self.llm.has_work()) and self._steps.waiting()

    def _has_work(self) -> bool:
        return (self.llm.has_work() or self._steps.in_flight
                or any(vocodable(self.token2wav, j) is not None for j in self._jobs.values()))

    def _iteration(self) -> None:
        steps = self._steps
        if steps.in_flight and not steps.waiting():
            self._settle()
        if steps.overlapped and not steps.in_flight:
            self._token2wav_step()  # launched: it runs beside the LLM step below
        if self.llm.has_work():
            steps.before_llm_step()
            self._llm_step()
        if not steps.overlapped:
            self._token2wav_step()

    def _settle(self) -> None:
        """Wait for the token2wav step in flight (if any) and hand out its chunks; the streams are the loop's again."""
        try:
            delivered = self._steps.collect(list(self._jobs.values()))
        except Exception as exc:  # a bug, on the worker: as one on the loop thread
            log.exception("engine step failed")
            self._fail_all(exc)
            return
        self._deliver_all(delivered)

    def _fail_all(self, exc: Exception) -> None:
        """A step failed: every running request ends with its error."""
        for job_id in list(self._jobs):
            self._abort(job_id, exc)

    def _llm_step(self) -> None:
        start = time.perf_counter()
        events = self.llm.step()
        elapsed = time.perf_counter() - start
        self.last_llm_batch = len(events)
        self.generated.add(sum(1 for _, token in events if token is not None))
        self._llm_step_s = elapsed if self.num_llm_steps == 0 else 0.8 * self._llm_step_s + 0.2 * elapsed
        self.num_llm_steps += 1
        for job in list(self._jobs.values()):
            if job.llm_request is not None and job.llm_request.finished:
                if job.llm_request.status in _RUNAWAY:
                    self.runaway_stops[job.llm_request.status.value] += 1
                job.llm_request = None
                if job.text is not None:  # [ownership] a bi-stream's next sentence makes a stream: settle first
                    self._settle()
                if job.job_id in self._jobs:
                    start_sentence(self, job)

    def _token2wav_step(self) -> None:
        ready = self._steps.plan(list(self._jobs.values()), self.llm, self.num_llm_steps, self._llm_step_s)
        if ready:
            delivered = self._steps.start(ready, self.llm.has_work())
            if delivered is not None:
                self._deliver_all(delivered)

    def _deliver_all(self, delivered: Delivered) -> None:
        if delivered:
            self.num_token2wav_steps += 1
            self.last_token2wav_batch = len(delivered)
        for job, chunk in delivered:
            job.ready_since = None
            self._deliver(job, chunk)

    def _add(self, job: Job) -> None:
        if job.handle._aborted:
            job.handle._put(END)
            return
        if not self._queue.offer(job, len(self._jobs)):  # [throughput] queued: started as one in flight ends
            self._start(job)

    def _admit(self) -> None:
        while (job := self._queue.next(len(self._jobs))) is not None:
            self._start(job)

    def _start(self, job: Job) -> None:
        self._jobs[job.job_id] = job
        job.gate = self._steps.gate
        if job.segments or job.text is not None:
            start_sentence(self, job)
        else:  # voice conversion: its tokens are given, token2wav starts on the next iteration
            job.handle.started = time.monotonic()

    def llm_params(self, text_ids: list[int]) -> SamplingParams:
        """Sampling of one sentence: the model's RAS settings and length bounds (the bench forces a count)."""
        return self.llm.sampling_params(len(text_ids), self.model.config.sampling)

    def _deliver(self, job: Job, chunk: Token2WavChunk) -> None:
        # a bi-stream's sentence ended by a cut (text_pump) is not its last while its text goes on
        last_segment = job.emitting == len(job.states) - 1 and not (job.cut and not job.text_closed)
        final = chunk.final and last_segment
        if len(chunk.samples) or chunk.final:
            if job.first_chunk_at is None:
                job.first_chunk_at = time.monotonic()
            samples = np.asarray(chunk.samples, dtype=np.float32)
            job.audio_s += len(samples) / self.sample_rate
            ids = tuple(job.states[job.emitting].tokens) if chunk.final else ()  # a sentence's end: its speech ids
            job.handle._put(AudioChunk(samples, self.sample_rate, job.emitting, final, ids))
        if chunk.final:
            if last_segment:
                self.end_job(job)
            else:
                job.emitting += 1

    # ---- the loop-side surface the bi-stream text routing (text_pump) works through (loop thread) ----------------
    def queued_job(self, job_id: str) -> Job | None:
        """A job admitted but not started yet."""
        return self._queue.get(job_id)

    def running_job(self, job_id: str) -> Job | None:
        return self._jobs.get(job_id)

    def fail(self, job_id: str, error: BaseException) -> None:
        """End a job with `error` (its caller receives it)."""
        self._abort(job_id, error)

    def end_job(self, job: Job, final_chunk: bool = False) -> None:
        """The job's output is complete (`final_chunk`: first send an empty final chunk, for a bi-stream whose text
        ended after its last sentence's audio); the next queued job may start."""
        if final_chunk:
            job.handle._put(AudioChunk(np.zeros(0, dtype=np.float32), self.sample_rate, max(job.emitting - 1, 0), True))
        del self._jobs[job.job_id]
        job.handle._put(END)
        self._admit()

    def _abort(self, job_id: str, error: BaseException | None) -> None:
        self._settle()  # [ownership] its streams may be in the token2wav step in flight
        queued = self._queue.pop(job_id)
        if queued is not None:  # nothing started: no KV blocks or caches to free
            queued.handle._put(error if error is not None else END)
            return
        job = self._jobs.pop(job_id, None)
        if job is None:
            return
        if job.llm_request is not None:
            self.llm.abort(job.llm_request.request_id)  # frees its KV blocks now
            job.llm_request = None
        for s in job.states:
            self.token2wav.abort(s)  # drops its flow and HiFT caches now
        job.handle._put(error if error is not None else END)
        self._admit()

