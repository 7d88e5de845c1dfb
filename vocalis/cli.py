"""`vocalis` command line: speak, convert, info, infer, eval."""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

import numpy as np

from vocalis.errors import VocalisError
from vocalis.model_options import add_model_arguments, at_least, model_options
from vocalis.playback import PlaybackUnavailable, Player

log = logging.getLogger("vocalis")


def _speak(args: argparse.Namespace) -> int:
    from vocalis.audio_file import check_output_path, write_audio

    if args.output is None and not args.play:
        raise VocalisError("say where the speech goes: -o FILE, --play, or both")
    if args.output is not None:
        check_output_path(args.output)
    text = sys.stdin.read() if args.text == "-" else args.text
    if args.source_wav is None and text is None:
        raise VocalisError("nothing to say: give TEXT (or '-' to read stdin), or --source-wav for voice conversion")
    if args.prompt_text and not args.prompt_wav:
        raise VocalisError("--prompt-text needs --prompt-wav")
    start = time.perf_counter()
    adapters = {Path(args.adapter).name: args.adapter} if args.adapter else None
    tts = model_options(args, "speak").load(args.model, adapters=adapters)
    if tts.model.kind == "random":
        log.warning(
            "no trained model is installed: using the tiny preset with RANDOM weights, so the output is noise, not "
            "speech. Pass --model DIR with a CosyVoice2-0.5B or Vocalis model directory for real speech."
        )
    log.info("loaded %s in %.1f s", tts.model.describe(), time.perf_counter() - start)
    start = time.perf_counter()
    if args.source_wav is not None:
        chunks = tts.convert_voice(args.source_wav, voice=args.voice, prompt_wav=args.prompt_wav, speed=args.speed,
                                   seed=args.seed, stream=args.stream)
    else:
        kwargs = {"voice": args.voice, "prompt_wav": args.prompt_wav, "prompt_text": args.prompt_text,
                  "instruct": args.instruct, "speed": args.speed, "seed": args.seed, "language": args.language,
                  "text_frontend": not args.no_text_frontend}
        chunks = tts.stream(text, **kwargs) if args.stream else iter([_whole(tts, text, kwargs)])
    player = _player(tts.sample_rate) if args.play else None
    parts: list[np.ndarray] = []
    first = None
    for chunk in chunks:
        if first is None:
            first = time.perf_counter() - start
            if args.stream:
                log.info("first chunk after %.2f s", first)
        parts.append(chunk.samples)
        if player is not None:
            player.play(chunk.samples)  # a stream sounds from its first chunk
    audio = np.concatenate(parts)
    elapsed = time.perf_counter() - start
    seconds = len(audio) / tts.sample_rate
    made = f"{seconds:.2f} s of audio in {elapsed:.2f} s (RTF {elapsed / max(seconds, 1e-9):.2f})"
    if args.output is not None:
        log.info("wrote %s: %s", write_audio(args.output, audio, tts.sample_rate), made)
    else:
        log.info("made %s", made)
    if player is not None:
        player.finish(timeout=seconds + 5.0)
        log.info("played on %s", player.device_name or "the default output device")
    return 0


def _player(sample_rate: int) -> Player | None:
    """A `Player`, or None with one warning line saying why nothing will play (no library, no device)."""
    try:
        return Player(sample_rate)
    except PlaybackUnavailable as e:
        log.warning("not played: %s", e)
        return None


def _whole(tts: object, text: str, kwargs: dict) -> object:
    from vocalis.frontend.request import AudioChunk

    samples = tts.synthesize(text, **kwargs)  # type: ignore[attr-defined]
    return AudioChunk(samples, tts.sample_rate, 0, True)  # type: ignore[attr-defined]


def _convert(args: argparse.Namespace) -> int:
    from vocalis.model_dir import convert_official

    model = convert_official(Path(args.official_dir), Path(args.out_dir))
    log.info("converted %s -> %s (%d voices)", args.official_dir, args.out_dir, len(model.voices))
    return 0


def _info(args: argparse.Namespace) -> int:
    from vocalis.model_dir import load_model

    model = load_model(args.model)
    counts = {name: sum(p.numel() for p in m.parameters()) for name, m in
              (("llm", model.llm), ("flow", model.flow), ("hift", model.hift))}
    print(f"model: {model.describe()}")
    for name, n in counts.items():
        print(f"  {name}: {n / 1e6:.2f} M parameters")
    q = model.config.llm.qwen
    print(f"  llm body: {q.num_hidden_layers} layers, hidden {q.hidden_size}, text vocab {q.vocab_size}, "
          f"speech tokens {model.config.llm.speech_token_size}")
    print(f"  text tokenizer: {f'{len(model.tokenizer)} ids' if model.tokenizer else 'none (token input only)'}")
    print(f"  speech tokenizer: {'yes' if model.speech_tokenizer else 'no'}; "
          f"speaker encoder: {'yes' if model.speaker_encoder else 'no'}")
    print(f"  voices: {', '.join(sorted(model.voices)) or 'none'}")
    return 0


def _infer(args: argparse.Namespace) -> int:
    from vocalis.batch.infer import InferOptions, describe_summary, run_batch

    options = InferOptions(Path(args.manifest), Path(args.out), args.model, args.stream,
                           model_options(args, "infer"), args.seed, progress=not args.no_progress,
                           in_flight=args.in_flight)
    summary = run_batch(options)
    for line in describe_summary(summary) if summary is not None else ():
        log.info("%s", line)
    return 0


def _eval(args: argparse.Namespace) -> int:
    from vocalis.eval.runner import EvalOptions, evaluate

    evaluate(EvalOptions(Path(args.manifest), Path(args.audio), Path(args.out) if args.out else None, args.asr,
                         args.model, args.language, similarity=not args.no_similarity, baseline=args.baseline,
                         plots=not args.no_plots))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vocalis", description="Fast CosyVoice 2-compatible speech generation.")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)

    sp = sub.add_parser("speak", help="text -> speech file")
    sp.add_argument("text", nargs="?", help="text to say ('-' reads standard input)")
    sp.add_argument("-o", "--output", help="output file (.wav, .flac, .ogg)")
    sp.add_argument("--play", action="store_true",
                    help="play it on the default sound output as it is made (pip install 'vocalis[play]')")
    sp.add_argument("--model", help="model directory (default: the built-in model)")
    sp.add_argument("--voice", help="a named voice of the model")
    sp.add_argument("--prompt-wav", help="recording of the voice to clone")
    sp.add_argument("--prompt-text", help="transcript of --prompt-wav (zero-shot); omit for cross-lingual")
    sp.add_argument("--instruct", help="instruction, e.g. 'speak slowly and warmly'")
    sp.add_argument("--source-wav", help="voice conversion: re-voice this recording (TEXT not needed)")
    sp.add_argument("--stream", action="store_true", help="synthesise chunk by chunk (reports first-chunk latency)")
    sp.add_argument("--speed", type=float, default=1.0, help="0.25-4.0")
    sp.add_argument("--seed", type=int, help="random seed for reproducible output")
    sp.add_argument("--language", default="auto", help="text normalisation language: auto, en, zh, ja")
    sp.add_argument("--no-text-frontend", action="store_true", help="skip text normalisation and sentence split")
    sp.add_argument("--adapter", help="a LoRA adapter of this model (folder, or name under the model's adapters/)")
    add_model_arguments(sp)
    sp.set_defaults(func=_speak)

    cv = sub.add_parser("convert", help="official CosyVoice2 directory -> Vocalis directory (safetensors + json)")
    cv.add_argument("official_dir")
    cv.add_argument("out_dir")
    cv.set_defaults(func=_convert)

    inf = sub.add_parser("info", help="describe a model directory")
    inf.add_argument("model", nargs="?", help="model directory (default: the built-in model)")
    inf.set_defaults(func=_info)

    bi = sub.add_parser("infer", help="synthesise a manifest (jsonl or seed-tts-eval list); runs under torchrun")
    bi.add_argument("--manifest", required=True, help="jsonl (id, text, prompt_wav, prompt_text, voice) or id|pt|pw|t")
    bi.add_argument("--out", required=True, help="output folder: <id>.wav per item and summary.json")
    bi.add_argument("--model", help="model directory (default: the built-in model)")
    bi.add_argument("--stream", action="store_true", help="synthesise chunk by chunk (records first-chunk latency)")
    bi.add_argument("--seed", type=int, default=0, help="base seed; an item's seed is this + crc32(id)")
    add_model_arguments(bi, device="auto")  # auto: cuda:LOCAL_RANK where CUDA is visible
    bi.add_argument("--in-flight", type=at_least(1), default=8,
                    help="items synthesised at once per rank (batched by the engine; default 8)")
    bi.add_argument("--no-progress", action="store_true", help="no progress bar")
    bi.set_defaults(func=_infer)

    ev = sub.add_parser("eval", help="WER/CER, speaker similarity, durations and RTF of a folder of outputs")
    ev.add_argument("--manifest", required=True, help="the manifest the audio was made from")
    ev.add_argument("--audio", required=True, help="folder with <id>.wav (and summary.json from `vocalis infer`)")
    ev.add_argument("--asr", default="pocketsphinx",
                    help="pocketsphinx (English, offline), none, or module:factory for your own transcriber")
    ev.add_argument("--out", help="report folder (default: <audio>/eval)")
    ev.add_argument("--model", help="model directory: its campplus.onnx adds CAM++ speaker similarity")
    ev.add_argument("--language", default="auto", help="text language for normalisation: auto, en, zh, ...")
    ev.add_argument("--no-similarity", action="store_true", help="skip speaker similarity")
    ev.add_argument("--baseline", action="store_true",
                    help="also score each item's ground-truth recording (reference_wav / 5th field) as a baseline")
    ev.add_argument("--no-plots", action="store_true", help="no PNG plots")
    ev.set_defaults(func=_eval)

    from vocalis.train.cli import add_training_commands  # parsers only; training code loads when a command runs

    add_training_commands(sub)
    from vocalis.corpus.cli import add_corpus_command  # parser only

    add_corpus_command(sub)
    from vocalis.serve.cli import add_serve_commands  # parsers only; the server loads when `serve` runs

    add_serve_commands(sub)
    from vocalis.bench.cli import add_bench_command  # parser only; measurements load when `bench` runs

    add_bench_command(sub)
    from vocalis.hub import add_download_command  # parser only

    add_download_command(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO, stream=sys.stderr,
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except VocalisError as exc:
        print(f"vocalis: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("vocalis: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
