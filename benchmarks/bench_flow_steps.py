"""Euler steps (`--flow-steps`, `Token2WavConfig.flow_steps`) against mel error and token2wav time.

One request with a saved voice (a `--prompt-tokens` prompt whose prefix is cached by a warm-up request first, as
for a saved voice), `--tokens` generated speech tokens (25 per second), through the batched token2wav engine at
one precision, streamed; every step count's engine is built over the same modules and the counts run in turn,
`--rounds` times (on a shared machine alternating rounds keep drift out of the ratios). Reported per count: the
mel's error against the model's 10 steps (max abs over max |mel|, and RMS of the difference over the mel's RMS),
and the median token2wav wall seconds and its ratio to 10 steps. Random weights at the preset's shapes: the
errors say how far fewer steps move the solve's end point, not how the audio sounds.

    nice python benchmarks/bench_flow_steps.py --threads 2 --precision int8 --steps 10,7,5,3 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from bench_token2wav import build
from vocalis.backends.choice import apply_backend
from vocalis.reference.token2wav import FlowPrompt
from vocalis.token2wav.config import Token2WavConfig
from vocalis.token2wav.cv2.engine import Token2WavEngine


class MelEngine(Token2WavEngine):
    """The engine, keeping every chunk's mel (80, frames) as it goes to the vocoder."""

    mels: list[torch.Tensor]

    def _vocode(self, items, mels):  # type: ignore[no-untyped-def]
        self.mels.extend(m.detach().float().cpu().clone() for m in mels)
        return super()._vocode(items, mels)


def run(engine: MelEngine, prompt: FlowPrompt, tokens: list[int]) -> tuple[torch.Tensor, float]:
    """One streamed request -> its whole mel (80, frames) and the wall seconds it took."""
    engine.mels = []
    start = time.perf_counter()
    state = engine.new_stream("r", prompt, streaming=True, generator=torch.Generator().manual_seed(1))
    state.add_tokens(tokens)
    state.end_input()
    while not state.finished:
        engine.step([state])
    return torch.cat(engine.mels, dim=1), time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="cosyvoice2-0.5b")
    ap.add_argument("--precision", default="int8")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", default="10,7,5,3", help="Euler step counts; 10 (the model's) is always measured")
    ap.add_argument("--tokens", type=int, default=50, help="generated speech tokens (25 per second)")
    ap.add_argument("--prompt-tokens", type=int, default=75)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    counts = sorted({10, *(int(s) for s in args.steps.split(","))}, reverse=True)
    model = build(args.preset)
    runtime = apply_backend(model, "torch", args.precision)
    g = torch.Generator().manual_seed(3)
    vocab, p = model.config.flow.vocab_size, args.prompt_tokens
    prompt = FlowPrompt(torch.randint(0, vocab, (1, p), generator=g, dtype=torch.int32),
                        torch.randn(1, 2 * p, model.config.flow.output_size, generator=g) - 5.0,
                        torch.randn(1, model.config.spk_embed_dim, generator=g))
    tokens = torch.randint(0, vocab, (args.tokens,), generator=g).tolist()
    engines = {n: MelEngine(model.flow, model.hift, Token2WavConfig(flow_steps=n, native_kernels=runtime.kernels
                                                                    .bf16_gemm)) for n in counts}
    mels: dict[int, torch.Tensor] = {}
    times: dict[int, list[float]] = {n: [] for n in counts}
    with torch.inference_mode():
        for n, engine in engines.items():  # warm-up: caches the voice's prefix, first-use costs paid
            mels[n], _ = run(engine, prompt, tokens)
        for _ in range(args.rounds):
            for n, engine in engines.items():
                times[n].append(run(engine, prompt, tokens)[1])
    ref = mels[10]
    rows = []
    for n in counts:
        d = mels[n] - ref
        median = statistics.median(times[n])
        rows.append({"steps": n, "mel_max_rel": (d.abs().max() / ref.abs().max()).item(),
                     "mel_rel_rms": (d.pow(2).mean().sqrt() / ref.pow(2).mean().sqrt()).item(),
                     "token2wav_s": median, "time_vs_10": median / statistics.median(times[10]), "runs": times[n]})
    print(f"{runtime.describe()}; {args.threads} threads; {args.prompt_tokens}-token saved voice, {args.tokens} "
          f"tokens streamed; medians of {args.rounds} alternating rounds")
    print("| steps | mel max rel. error vs 10 | mel rel. RMS error vs 10 | token2wav s | time vs 10 |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['steps']} | {r['mel_max_rel']:.2e} | {r['mel_rel_rms']:.2e} | {r['token2wav_s']:.2f} | "
              f"{r['time_vs_10']:.2f} |")
    if args.json:
        args.json.write_text(json.dumps({"args": vars(args) | {"json": str(args.json)}, "runtime": runtime.describe(),
                                         "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
