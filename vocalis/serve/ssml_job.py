"""An SSML request on the server (`input_format: "ssml"`): its parts (`vocalis.frontend.ssml.parse_ssml`) said one
after the other as ordinary jobs of the backend, at each part's rate, with each part's pause after it as silence:
the joining `render_ssml` does, streamed. Seen from the routes it is one `JobHandle`."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import AsyncIterator

import numpy as np

from vocalis.errors import InputError
from vocalis.frontend.request import MAX_SPEED, MIN_SPEED, AudioChunk
from vocalis.frontend.ssml import SsmlPart, parse_ssml
from vocalis.serve.backend import Backend, JobHandle, SpeechJob
from vocalis.serve.errors import Aborted


def ssml_parts(markup: str, speed: float) -> tuple[SsmlPart, ...]:
    """The parts to say, each part's rate times the request's `speed`; InputError (a 400) for bad markup or a
    combined speed out of range."""
    parts = parse_ssml(markup)
    for part in parts:
        if part.text and not MIN_SPEED <= part.rate * speed <= MAX_SPEED:
            raise InputError(f"SSML prosody rate {part.rate:g} with speed {speed:g} gives {part.rate * speed:g}; "
                             f"it must be between {MIN_SPEED} and {MAX_SPEED}")
    return tuple(dataclasses.replace(p, rate=p.rate * speed) for p in parts)


class SsmlHandle:
    """The parts' jobs run in order (the next one is submitted when the one before has sent its last chunk), their
    chunks passed on, a part's pause sent as a chunk of zeros; the last chunk sent is the one marked final."""

    def __init__(self, backend: Backend, job: SpeechJob, parts: tuple[SsmlPart, ...]) -> None:
        self.backend = backend
        self.job = job
        self.parts = parts
        self._current: JobHandle | None = self._submit(0) if parts[0].text else None
        self._first = self._current
        self._submitted = time.monotonic()
        self._finished: float | None = None
        self._aborted = False
        self._chunks = self._run()

    def _submit(self, i: int) -> JobHandle:
        return self.backend.submit(dataclasses.replace(self.job, text=self.parts[i].text, speed=self.parts[i].rate))

    @property
    def id(self) -> str:
        return f"ssml-{self._first.id if self._first is not None else id(self)}"

    @property
    def submitted(self) -> float:
        return self._first.submitted if self._first is not None else self._submitted

    @property
    def started(self) -> float | None:
        return self._first.started if self._first is not None else self._submitted

    @property
    def finished(self) -> float | None:
        return self._finished

    @property
    def done(self) -> bool:
        return self._finished is not None

    @property
    def warnings(self) -> list[str]:
        return self._first.warnings if self._first is not None else []

    def abort(self) -> None:
        self._aborted = True
        if self._current is not None:
            self._current.abort()

    async def _run(self) -> AsyncIterator[AudioChunk]:
        rate = self.backend.sample_rate
        segment = 0
        last = len(self.parts) - 1
        for i, part in enumerate(self.parts):
            if part.text:
                if self._current is None:
                    if self._aborted:
                        raise Aborted("aborted")
                    self._current = self._submit(i)
                seen = 0
                async for chunk in self._current:
                    seen = max(seen, chunk.segment + 1)
                    final = chunk.final and i == last and not part.pause_s
                    yield dataclasses.replace(chunk, segment=segment + chunk.segment, final=final)
                segment += seen
                self._current = None
            if part.pause_s:
                silence = np.zeros(round(part.pause_s * rate), dtype=np.float32)  # (N,)
                yield AudioChunk(silence, rate, max(segment - 1, 0), final=i == last)

    def __aiter__(self) -> AsyncIterator[AudioChunk]:
        return self

    async def __anext__(self) -> AudioChunk:
        try:
            return await self._chunks.__anext__()
        except BaseException:
            self._finished = time.monotonic()
            raise
