"""`create_app(backend, config)`: the FastAPI app (OpenAI-compatible speech, voices, health, metrics, web page).

Routes: POST /v1/audio/speech, GET|POST /v1/audio/voices, GET|DELETE /v1/audio/voices/{name}, GET /v1/models,
CosyVoice-style /inference_* (cosyvoice_routes.py), WebSocket /v1/audio/speech/ws (websocket.py), GET /health,
GET /metrics, and the web page at / (static/). The backend is any `serve.backend.Backend`.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from fastapi import APIRouter, FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import FileResponse, JSONResponse, Response
from fastapi.staticfiles import StaticFiles
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from vocalis.errors import InputError, VocalisError
from vocalis.frontend.word_times import WordTimer
from vocalis.serve.audio_encoding import check_format, supported_formats
from vocalis.serve.backend import Backend, SpeechJob
from vocalis.serve.config import ServeConfig
from vocalis.serve.context import ServerContext, ctx_of
from vocalis.serve.cosyvoice_routes import cosyvoice_router
from vocalis.serve.errors import Aborted, JobTimeout, error_status
from vocalis.serve.guards import (
    ApiKey,
    ApiKeyMiddleware,
    BodyLimitMiddleware,
    QueryKeyMiddleware,
    RequestMetricsMiddleware,
)
from vocalis.serve.hosts import HostOriginMiddleware, HostPolicy
from vocalis.serve.limits import PromptBudget, check_text_fields
from vocalis.serve.metrics import ServeMetrics
from vocalis.serve.schemas import SpeechRequest, error_body, validation_message
from vocalis.serve.ssml_job import ssml_parts
from vocalis.serve.streaming import audio_response, sse_response, start_job, whole_response
from vocalis.serve.uploads import audio_seconds, read_body
from vocalis.serve.voices import OPENAI_VOICES, VoiceNotFound, VoiceStore
from vocalis.serve.websocket import websocket_router

log = logging.getLogger(__name__)
STATIC_DIR = Path(__file__).resolve().parent / "static"


# ---- errors ------------------------------------------------------------------------------------------
def _json_error(status: int, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
    kind = "invalid_request_error" if status < 500 else ("server_busy" if status == 503 else "server_error")
    return JSONResponse(error_body(message, kind, code=str(status)), status_code=status, headers=headers)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(VocalisError)
    async def _vocalis(request: Request, exc: VocalisError) -> JSONResponse:
        status, headers = error_status(exc), {}
        ctx: ServerContext = request.app.state.ctx
        message = ctx.public(str(exc))
        if status == 503:
            headers = {"Retry-After": str(ctx.config.retry_after_s)}
            if ctx.shutdown.draining:
                headers["Connection"] = "close"
        route = getattr(request.scope.get("route"), "path", "unmatched")
        if isinstance(exc, Aborted):  # the client left before the first chunk: nobody reads this answer
            ctx.metrics.aborted.inc()
            return _json_error(status, message)
        ctx.metrics.errors.labels(route, type(exc).__name__).inc()
        if status >= 500 and status != 503:
            log.error("%s %s: %s", request.method, request.url.path, message)
        return _json_error(status, message, headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return _json_error(400, validation_message(exc))

    @app.exception_handler(StarletteHTTPException)  # also FastAPI's subclass; covers router 404/405
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return _json_error(exc.status_code, str(exc.detail), dict(exc.headers or {}))

    @app.exception_handler(ClientDisconnect)
    async def _gone(request: Request, exc: ClientDisconnect) -> JSONResponse:
        # The client left while sending its body: nobody reads the answer, and it is no server error.
        log.info("%s %s: the client left before sending its whole body", request.method, request.url.path)
        return _json_error(499, "the client disconnected", {"Connection": "close"})

    @app.exception_handler(Exception)
    async def _bug(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error in %s %s", request.method, request.url.path)
        return _json_error(500, f"internal error ({type(exc).__name__}); see the server log")


async def word_timer(ctx: ServerContext, req: SpeechRequest) -> WordTimer:
    """The timer of a request's words (its sentences read as synthesis reads them, off the loop)."""
    if req.input_format == "ssml":
        raise InputError("timestamps are given for input_format text, not ssml")
    return await asyncio.get_running_loop().run_in_executor(None, ctx.backend.word_timer, req.input, req.language)


# ---- routes ------------------------------------------------------------------------------------------
def api_router() -> APIRouter:
    router = APIRouter()  # the API key is checked by ApiKeyMiddleware, before any body is read

    @router.post("/v1/audio/speech", summary="OpenAI-compatible text to speech (JSON or multipart)",
                 openapi_extra={"requestBody": {"content": {"application/json": {
                     "schema": SpeechRequest.model_json_schema()}}}})
    async def speech(request: Request) -> Response:
        t0 = time.perf_counter()
        ctx = ctx_of(request)
        fields, audio = await read_body(request, ctx.config, ("ref_audio",))
        try:
            req = SpeechRequest.model_validate(fields)
        except ValidationError as exc:
            raise InputError(validation_message(exc)) from None
        check_text_fields(ctx.config, input=req.input, instructions=req.instructions, ref_text=req.ref_text)
        fmt = check_format(req.response_format)
        prompt = audio.get("ref_audio")
        if prompt is not None and not ctx.backend.can_clone:
            raise InputError(f"the {ctx.model_label} cannot clone voices ({ctx.clone_blocker})")
        if req.ref_text and prompt is None:
            raise InputError("ref_text needs ref_audio")
        # ref_audio takes precedence over voice: OpenAI clients always send a voice.
        voice = ctx.voices.resolve(req.voice_name) if prompt is None else None
        ssml = ssml_parts(req.input, req.speed) if req.input_format == "ssml" else None
        said = req.input if ssml is None else " ".join(p.text for p in ssml if p.text)
        ctx.budget.check(text=said, voice=voice, prompt_text=req.ref_text or "", instruct=req.instructions or "",
                         prompt_seconds=audio_seconds(prompt) if prompt is not None else 0.0)
        adapter = ctx.adapter_for(req.adapter, voice)
        timer = await word_timer(ctx, req) if req.timestamps else None
        job = SpeechJob(text=req.input, voice=voice, prompt_wav=prompt, prompt_text=req.ref_text or "",
                        instruct=req.instructions or "", speed=req.speed, seed=req.seed, language=req.language,
                        stream=req.stream or req.stream_format == "sse", adapter=adapter)
        stream = await start_job(ctx, job, request, "/v1/audio/speech", t0, ssml, timer)
        if req.stream_format == "sse":
            return sse_response(stream, fmt, len(req.input))
        if not req.stream or timer is not None:
            return await whole_response(stream, fmt)
        return audio_response(stream, fmt)

    @router.get("/v1/audio/voices", summary="List voices (built-in, saved) and the OpenAI-name mapping")
    async def list_voices(request: Request) -> dict[str, Any]:
        store = ctx_of(request).voices
        aliases = {name: store.alias_target(name) for name in (*store.aliases, *OPENAI_VOICES)}
        return {"object": "list", "data": [e.info() for e in store.entries()],
                "aliases": {k: v for k, v in aliases.items() if v is not None}}

    @router.post("/v1/audio/voices", status_code=201, summary="Save a voice from a clip (+ its transcript)")
    async def create_voice(request: Request) -> JSONResponse:
        ctx = ctx_of(request)
        fields, audio = await read_body(request, ctx.config, ("audio", "file"))
        clip = audio.get("audio", audio.get("file"))
        name = str(fields.pop("name", "") or "")
        text = str(fields.pop("text", fields.pop("prompt_text", "")) or "")
        language = str(fields.pop("language", "auto") or "auto")
        if fields:
            raise InputError(f"unknown field(s): {', '.join(sorted(fields))}; use name, audio, text, language")
        if not name:
            raise InputError("name is required")
        if clip is None:
            raise InputError("audio is required: the voice's reference clip (file or base64)")
        check_text_fields(ctx.config, text=text, language=language)
        if not ctx.backend.can_clone:
            raise InputError(f"the {ctx.model_label} cannot make voices ({ctx.clone_blocker})")
        ctx.shutdown.check_open()
        ctx.voices.reserve(name)
        limit = ctx.config.queue_timeout_s + ctx.config.request_timeout_s
        try:
            try:
                voice = await asyncio.wait_for(ctx.backend.make_voice(name, clip, text, language), limit)
            except TimeoutError:
                raise JobTimeout(f"making the voice took longer than {limit:g} s") from None
        except BaseException:
            ctx.voices.release(name)
            raise
        entry = ctx.voices.add(voice)
        return JSONResponse(entry.info(), status_code=201)

    @router.get("/v1/audio/voices/{name}")
    async def get_voice(name: str, request: Request) -> dict[str, Any]:
        try:
            return ctx_of(request).voices.entry(name).info()
        except VoiceNotFound as exc:
            raise HTTPException(404, str(exc)) from None

    @router.delete("/v1/audio/voices/{name}")
    async def delete_voice(name: str, request: Request) -> dict[str, Any]:
        try:
            ctx_of(request).voices.delete(name)
        except VoiceNotFound as exc:
            raise HTTPException(404, str(exc)) from None
        return {"object": "voice.deleted", "id": name, "deleted": True}

    @router.get("/v1/models")
    async def models(request: Request) -> dict[str, Any]:
        ctx = ctx_of(request)
        return {"object": "list", "data": [{"id": "vocalis", "object": "model", "owned_by": "vocalis",
                                            "name": ctx.config.model_name,
                                            "description": ctx.public(ctx.backend.describe)}]}

    @router.get("/metrics", include_in_schema=False)
    async def metrics(request: Request) -> Response:
        m = ctx_of(request).metrics
        return Response(m.render(), media_type=m.content_type)

    return router


def create_app(backend: Backend, config: ServeConfig | None = None) -> FastAPI:
    """The server around `backend` (e.g. `EngineBackend(TTS.load(...))`); the lifespan starts/stops it."""
    config = config or ServeConfig()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        backend.start()
        log.info("serving %s; formats: %s", backend.describe, ", ".join(supported_formats()))  # the log may say where
        try:
            yield
        finally:
            backend.close()

    app = FastAPI(title="Vocalis", version="0.1.0", lifespan=lifespan,
                  description="CosyVoice 2-compatible speech generation with an OpenAI-compatible API.")
    metrics = ServeMetrics(lambda: backend.queue_depth, lambda: backend.active, backend.kv_usage, backend.stats)
    api_key = ApiKey(config.api_key)
    voices = VoiceStore(backend.builtin_voices, config.voices_dir, config.voice_aliases, config.max_saved_voices)
    budget = PromptBudget(backend.count_tokens, config.max_prompt_tokens)
    app.state.ctx = ctx = ServerContext(backend, config, voices, metrics, api_key, budget,
                                        hidden=_hidden_paths(backend, config))
    install_error_handlers(app)
    # Starlette runs the last added outermost: metrics see every answer; the key is out of the query string before
    # anything can log it; the Host/Origin check, the CORS preflight (which carries no key) and the API key come
    # before any body is read.
    policy = HostPolicy(config.bind_host, config.allowed_hosts, config.allowed_origins)
    app.add_middleware(BodyLimitMiddleware, max_bytes=config.max_body_bytes, timeout_s=config.body_timeout_s)
    app.add_middleware(ApiKeyMiddleware, api_key=api_key)
    app.add_middleware(CORSMiddleware, **policy.cors_options())  # type: ignore[arg-type]
    app.add_middleware(HostOriginMiddleware, policy=policy)
    app.add_middleware(QueryKeyMiddleware)
    app.add_middleware(RequestMetricsMiddleware, metrics=metrics)

    replica = secrets.token_hex(4)  # tells replicas behind one address apart, and reveals nothing about the host

    @app.get("/health", summary="Liveness and load (no API key needed)")
    async def health() -> JSONResponse:
        draining = ctx.shutdown.draining
        body = {"status": "shutting_down" if draining else "ok", "model": config.model_name, "replica": replica,
                "sample_rate": backend.sample_rate, "queue_depth": backend.queue_depth, "running": backend.active,
                "formats": list(supported_formats())}
        return JSONResponse(body, status_code=503 if draining else 200)

    app.include_router(api_router())
    app.include_router(cosyvoice_router())
    app.include_router(websocket_router())
    if config.web_page:
        app.mount("/web", StaticFiles(directory=STATIC_DIR), name="web")

        @app.get("/", include_in_schema=False)
        async def page() -> FileResponse:
            return FileResponse(STATIC_DIR / "index.html")

    return app


def _hidden_paths(backend: Backend, config: ServeConfig) -> tuple[tuple[str, str], ...]:
    """Paths no answer may show, with what to say instead: the model directory, the voices folder."""
    path = backend.model_path
    hidden = []
    if path:
        hidden.append((str(path), config.model_name))
        hidden.append((str(Path(path).resolve()), config.model_name))
    if config.voices_dir is not None:
        hidden.append((str(config.voices_dir), "the voices folder"))
    return tuple(sorted(set(hidden), key=lambda p: -len(p[0])))
