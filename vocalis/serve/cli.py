"""`vocalis serve` and `vocalis export-triton`: argument parsing and start-up (kept out of vocalis/cli.py)."""

from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path

from vocalis.errors import InputError
from vocalis.kernels.build import BUILD_ENV
from vocalis.model_options import add_model_arguments, model_options

log = logging.getLogger("vocalis")


def add_serve_commands(sub: argparse._SubParsersAction) -> None:
    sv = sub.add_parser("serve", help="HTTP server: OpenAI-compatible /v1/audio/speech, voices, web page")
    sv.add_argument("--model", help="model directory (default: the built-in model)")
    sv.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1: this machine only)")
    sv.add_argument("--port", type=int, default=8000)
    sv.add_argument("--api-key", default=os.environ.get("VOCALIS_API_KEY"),
                    help="require 'Authorization: Bearer KEY' (default: $VOCALIS_API_KEY; none = open)")
    sv.add_argument("--voices-dir", help="folder of saved voices (default: $XDG_DATA_HOME/vocalis/voices)")
    sv.add_argument("--voice-alias", action="append", default=[], metavar="NAME=VOICE",
                    help="map a requested voice name onto a voice, e.g. alloy=my_voice (repeatable)")
    sv.add_argument("--adapter", action="append", default=[], metavar="NAME=PATH",
                    help="a LoRA adapter of the model, served per request by its name (repeatable)")
    sv.add_argument("--voice-adapter", action="append", default=[], metavar="VOICE=ADAPTER",
                    help="the adapter a voice speaks with when a request names none (repeatable)")
    sv.add_argument("--max-queue", type=int, default=64, help="queued requests before answering 503")
    sv.add_argument("--max-input-chars", type=int, default=4096,
                    help="the cap on every text field (input, instructions, prompt/ref text, a WebSocket's text)")
    sv.add_argument("--max-prompt-tokens", type=int, default=3072,
                    help="LLM prompt a request may make: prompt text or instruction + text + prompt speech tokens")
    sv.add_argument("--max-upload-mb", type=float, default=10.0)
    sv.add_argument("--max-voices", type=int, default=1000, help="saved voices the voices folder may hold")
    sv.add_argument("--queue-timeout", type=float, default=120.0, help="seconds a request may wait to start (503)")
    sv.add_argument("--request-timeout", type=float, default=300.0, help="seconds a synthesis may run (504)")
    sv.add_argument("--ws-idle-timeout", type=float, default=30.0,
                    help="close a WebSocket session that sends nothing for this many seconds (4408)")
    sv.add_argument("--ws-max-duration", type=float, default=600.0,
                    help="the longest a WebSocket session may last, in seconds (4504)")
    sv.add_argument("--header-timeout", type=float, default=10.0, help="seconds a request head may take (408)")
    sv.add_argument("--body-timeout", type=float, default=60.0, help="seconds a request body may take (408)")
    sv.add_argument("--shutdown-grace", type=float, default=10.0,
                    help="after SIGTERM, seconds running requests get to finish; the rest get 503")
    sv.add_argument("--allowed-hosts", default="", metavar="NAMES",
                    help="comma-separated Host names to accept besides loopback and the bound address ('*': any)")
    sv.add_argument("--allowed-origins", default="", metavar="ORIGINS",
                    help="comma-separated browser origins (https://app.example) that may call the API ('*': any)")
    sv.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    add_model_arguments(sv)
    sv.add_argument("--no-web-page", action="store_true", help="do not serve the web page at /")
    sv.add_argument("--keep-silence", action="store_true",
                    help="send a response's trailing silence as made (default: trimmed, the end faded)")
    sv.add_argument("--aligner", default="auto", metavar="SPEC",
                    help="word timestamps' aligner: auto (the built-in model's labels; pocketsphinx for English) "
                         "or module:factory (docs/serving.md)")
    sv.add_argument("--ray", action="store_true", help="run as a Ray Serve deployment (needs ray[serve])")
    sv.add_argument("--replicas", type=int, default=1, help="Ray Serve replicas (with --ray)")
    sv.set_defaults(func=serve_command)

    tr = sub.add_parser("export-triton", help="write a Triton model repository (Python backend, decoupled)")
    tr.add_argument("out_dir", help="model repository folder to create")
    tr.add_argument("--model", help="model directory the Triton model loads (default: the built-in model)")
    tr.add_argument("--name", default="vocalis", help="Triton model name")
    tr.add_argument("--max-batch-size", type=int, default=8)
    tr.add_argument("--gpu", action="store_true", help="instances on the GPU (KIND_GPU; default KIND_CPU)")
    add_model_arguments(tr, device=None)
    tr.set_defaults(func=export_triton_command)


def _aliases(pairs: list[str], flag: str = "--voice-alias NAME=VOICE") -> dict[str, str]:
    out = {}
    for pair in pairs:
        name, sep, voice = pair.partition("=")
        if not sep or not name or not voice:
            raise InputError(f"{flag.split()[0]} wants {flag.split()[1]}, got {pair!r}")
        out[name] = voice
    return out


def _names(value: str) -> tuple[str, ...]:
    return tuple(v.strip() for v in value.split(",") if v.strip())


def model_name(model: str | None) -> str:
    """What the server calls the model: its directory's name, never the path."""
    return Path(model).resolve().name if model else "built-in"


def serve_config(args: argparse.Namespace):  # -> ServeConfig
    from vocalis.serve.config import ServeConfig, default_voices_dir

    upload = int(args.max_upload_mb * 1024 * 1024)
    try:
        return ServeConfig(
            max_input_chars=args.max_input_chars, max_prompt_tokens=args.max_prompt_tokens, max_upload_bytes=upload,
            max_body_bytes=max(16 * 1024 * 1024, upload * 3 // 2), api_key=args.api_key or None,
            queue_timeout_s=args.queue_timeout, request_timeout_s=args.request_timeout,
            ws_idle_timeout_s=args.ws_idle_timeout, ws_max_duration_s=args.ws_max_duration,
            header_timeout_s=args.header_timeout, body_timeout_s=args.body_timeout,
            shutdown_grace_s=args.shutdown_grace, max_saved_voices=args.max_voices, bind_host=args.host,
            allowed_hosts=_names(args.allowed_hosts), allowed_origins=_names(args.allowed_origins),
            model_name=model_name(args.model),
            voices_dir=Path(args.voices_dir) if args.voices_dir else default_voices_dir(),
            voice_aliases=_aliases(args.voice_alias), web_page=not args.no_web_page,
            voice_adapters=_aliases(args.voice_adapter, "--voice-adapter VOICE=ADAPTER"),
            trim_silence=not args.keep_silence,
        )
    except ValueError as exc:
        raise InputError(f"vocalis serve: {exc}") from None


def serve_command(args: argparse.Namespace) -> int:
    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError:
        raise InputError("serving needs the serve extra: pip install 'vocalis[serve]'") from None
    config = serve_config(args)
    from vocalis.frontend.word_times import load_aligner

    aligner = load_aligner(args.aligner)  # a bad spec fails before the model loads
    options = model_options(args, "serve")
    backend_opts = {"max_queue": args.max_queue}  # the app's deadlines apply the queue and request timeouts
    if args.ray:
        if args.adapter or args.voice_adapter or aligner is not None:
            raise InputError("--adapter, --voice-adapter and --aligner are not served with --ray yet: "
                             "serve without --ray")
        from vocalis.serve.ray_app import run_ray

        return run_ray(args.model, config, backend_opts, options, host=args.host, port=args.port,
                       replicas=args.replicas, threads=args.threads)
    from vocalis.serve.app import create_app
    from vocalis.serve.engine_backend import EngineBackend

    if args.threads > 0:
        import torch

        torch.set_num_threads(args.threads)
    os.environ.setdefault(BUILD_ENV, "wait")  # a server starts once: its requests run on our kernels from the first
    tts = options.load(args.model, adapters=_aliases(args.adapter, "--adapter NAME=PATH") or None)
    unknown = sorted(set(config.voice_adapters.values()) - set(tts.adapters))
    if unknown:
        raise InputError(f"--voice-adapter names adapters not loaded with --adapter: {', '.join(unknown)}")
    if aligner is not None:
        tts.aligner = aligner()
    if tts.model.kind == "random":
        log.warning("no trained model is installed: the built-in model has RANDOM weights and makes noise")
    app = create_app(EngineBackend(tts, **backend_opts), config)
    if config.api_key is None and args.host not in ("127.0.0.1", "localhost", "::1"):
        log.warning("listening on %s without an API key: anyone who can reach it can use it", args.host)
    from vocalis.serve.server import make_server

    make_server(app, host=args.host, port=args.port).run()
    return 0


def export_triton_command(args: argparse.Namespace) -> int:
    from vocalis.serve.triton_export import export_triton

    # not checked against this machine: the repository is served on another host
    options = model_options(args, "export-triton", check=False)
    out = export_triton(Path(args.out_dir), args.model, name=args.name, max_batch_size=args.max_batch_size,
                        gpu=args.gpu, options=options)
    log.info("wrote Triton model repository %s", out)
    return 0
