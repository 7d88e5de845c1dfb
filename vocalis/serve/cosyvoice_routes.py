"""CosyVoice-style endpoints, one per inference mode, with the official FastAPI server's form field names.

POST /inference_sft           tts_text, spk_id
POST /inference_zero_shot     tts_text, prompt_text, prompt_wav (file)
POST /inference_cross_lingual tts_text, prompt_wav
POST /inference_instruct      tts_text, spk_id, instruct_text
POST /inference_instruct2     tts_text, instruct_text, prompt_wav
POST /inference_vc            source_wav, and prompt_wav or spk_id (a voice made from a recording)

All take optional speed, seed, response_format (default pcm: 16-bit little-endian mono at the X-Sample-Rate
header's rate, what the official client expects) and stream the audio as it is made. Unlike the official server
they are POST only, declare their media type, and abort on disconnect. Every text field has the server's one
length cap, and the LLM prompt a request makes is bounded before it is queued (limits.py).
"""

from __future__ import annotations

import time
from typing import Annotated

from fastapi import APIRouter, File, Form, Request, UploadFile
from fastapi.responses import StreamingResponse

from vocalis.errors import InputError
from vocalis.frontend.request import MAX_SPEED, MIN_SPEED
from vocalis.frontend.voice import Voice
from vocalis.serve.audio_encoding import check_format
from vocalis.serve.backend import SpeechJob
from vocalis.serve.context import ctx_of
from vocalis.serve.limits import check_text_fields
from vocalis.serve.schemas import MAX_SEED
from vocalis.serve.streaming import audio_response, start_job
from vocalis.serve.uploads import audio_seconds, read_upload

Text = Annotated[str, Form(min_length=1)]
Speed = Annotated[float, Form(ge=MIN_SPEED, le=MAX_SPEED)]
Seed = Annotated[int | None, Form(ge=0, le=MAX_SEED)]
Fmt = Annotated[str, Form()]
Wav = Annotated[UploadFile, File()]
OptionalWav = Annotated[UploadFile | None, File()]


def cosyvoice_router() -> APIRouter:
    router = APIRouter(tags=["cosyvoice"])  # the API key is checked by ApiKeyMiddleware, before the form is read

    async def run(request: Request, route: str, t0: float, fmt: str, job: SpeechJob) -> StreamingResponse:
        ctx = ctx_of(request)
        check_format(fmt)
        assert isinstance(job.text, str)
        check_text_fields(ctx.config, tts_text=job.text, prompt_text=job.prompt_text, instruct_text=job.instruct)
        if (job.prompt_wav is not None or job.source_wav is not None) and not ctx.backend.can_clone:
            raise InputError(f"the {ctx.model_label} cannot use prompt audio ({ctx.clone_blocker})")
        if job.source_wav is None:  # voice conversion has no LLM
            seconds = audio_seconds(job.prompt_wav) if job.prompt_wav is not None else 0.0
            ctx.budget.check(text=job.text, voice=job.voice, prompt_text=job.prompt_text, instruct=job.instruct,
                             prompt_seconds=seconds)
        return audio_response(await start_job(ctx, job, request, route, t0), fmt)

    def voice(request: Request, name: str) -> Voice | None:
        return ctx_of(request).voices.resolve(name)

    async def upload(request: Request, file: UploadFile, what: str) -> bytes:
        return await read_upload(file, ctx_of(request).config, what)

    @router.post("/inference_sft")
    async def sft(request: Request, tts_text: Text, spk_id: Annotated[str, Form()], speed: Speed = 1.0,
                  seed: Seed = None, response_format: Fmt = "pcm") -> StreamingResponse:
        t0 = time.perf_counter()
        v = voice(request, spk_id)
        job = SpeechJob(text=tts_text, voice=v, speed=speed, seed=seed, adapter=ctx_of(request).adapter_for(None, v))
        return await run(request, "/inference_sft", t0, response_format, job)

    @router.post("/inference_zero_shot")
    async def zero_shot(request: Request, tts_text: Text, prompt_text: Text, prompt_wav: Wav, speed: Speed = 1.0,
                        seed: Seed = None, response_format: Fmt = "pcm") -> StreamingResponse:
        t0 = time.perf_counter()
        wav = await upload(request, prompt_wav, "prompt_wav")
        job = SpeechJob(text=tts_text, prompt_wav=wav, prompt_text=prompt_text, speed=speed, seed=seed)
        return await run(request, "/inference_zero_shot", t0, response_format, job)

    @router.post("/inference_cross_lingual")
    async def cross_lingual(request: Request, tts_text: Text, prompt_wav: Wav, speed: Speed = 1.0,
                            seed: Seed = None, response_format: Fmt = "pcm") -> StreamingResponse:
        t0 = time.perf_counter()
        wav = await upload(request, prompt_wav, "prompt_wav")
        job = SpeechJob(text=tts_text, prompt_wav=wav, speed=speed, seed=seed)
        return await run(request, "/inference_cross_lingual", t0, response_format, job)

    @router.post("/inference_instruct")
    async def instruct(request: Request, tts_text: Text, spk_id: Annotated[str, Form()], instruct_text: Text,
                       speed: Speed = 1.0, seed: Seed = None, response_format: Fmt = "pcm") -> StreamingResponse:
        t0 = time.perf_counter()
        v = voice(request, spk_id)
        job = SpeechJob(text=tts_text, voice=v, instruct=instruct_text, speed=speed, seed=seed,
                        adapter=ctx_of(request).adapter_for(None, v))
        return await run(request, "/inference_instruct", t0, response_format, job)

    @router.post("/inference_instruct2")
    async def instruct2(request: Request, tts_text: Text, instruct_text: Text, prompt_wav: Wav, speed: Speed = 1.0,
                        seed: Seed = None, response_format: Fmt = "pcm") -> StreamingResponse:
        t0 = time.perf_counter()
        wav = await upload(request, prompt_wav, "prompt_wav")
        job = SpeechJob(text=tts_text, prompt_wav=wav, instruct=instruct_text, speed=speed, seed=seed)
        return await run(request, "/inference_instruct2", t0, response_format, job)

    @router.post("/inference_vc")
    async def vc(request: Request, source_wav: Wav, prompt_wav: OptionalWav = None,
                 spk_id: Annotated[str | None, Form()] = None, speed: Speed = 1.0, seed: Seed = None,
                 response_format: Fmt = "pcm") -> StreamingResponse:
        t0 = time.perf_counter()
        if (prompt_wav is None) == (spk_id is None):
            raise InputError("voice conversion needs the target voice: give prompt_wav or spk_id (not both)")
        src = await upload(request, source_wav, "source_wav")
        wav = await upload(request, prompt_wav, "prompt_wav") if prompt_wav is not None else None
        v = voice(request, spk_id) if spk_id is not None else None
        job = SpeechJob(source_wav=src, prompt_wav=wav, voice=v, speed=speed, seed=seed)
        return await run(request, "/inference_vc", t0, response_format, job)

    return router
