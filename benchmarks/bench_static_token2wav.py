"""A/B of CosyVoice 2's token2wav paths on one request: the default cached engine against the static-shape path
(`Token2WavConfig(graphs=...)`), interleaved in one process, random weights. Prints seconds per utterance (median
of the rounds) and the ratio to the cached engine.

    nice python benchmarks/bench_static_token2wav.py --preset tiny --tokens 200 --rounds 3 --modes eager
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from vocalis.config import PRESETS
from vocalis.frontend.prompt import FlowPrompt
from vocalis.models.flow.flow import CausalMaskedDiffWithXvec
from vocalis.models.hift.generator import HiFTGenerator
from vocalis.token2wav.config import Token2WavConfig
from vocalis.token2wav.cv2.engine import Token2WavEngine


def _utterance(engine: Token2WavEngine, prompt: FlowPrompt, tokens: list[int]) -> float:
    state = engine.new_stream("bench", prompt, generator=torch.Generator().manual_seed(0))
    start = time.perf_counter()
    for t in tokens:  # tokens arrive one at a time, as from the LLM
        state.add_tokens([t])
        engine.step([state])
    state.end_input()
    while not state.finished:
        engine.step([state])
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="tiny", choices=[p for p in PRESETS if not p.endswith("phones")])
    ap.add_argument("--tokens", type=int, default=200)
    ap.add_argument("--prompt", type=int, default=35)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--modes", default="eager", help="comma-separated `graphs` modes against the cached engine")
    args = ap.parse_args()
    cfg = PRESETS[args.preset]
    torch.manual_seed(0)
    flow, hift = CausalMaskedDiffWithXvec(cfg.flow).eval(), HiFTGenerator(cfg.hift).eval()
    g = torch.Generator().manual_seed(1)
    prompt = FlowPrompt(torch.randint(0, cfg.flow.vocab_size, (1, args.prompt), generator=g),
                        torch.randn(1, 2 * args.prompt, 80, generator=g), torch.randn(1, cfg.flow.spk_embed_dim))
    tokens = torch.randint(0, cfg.flow.vocab_size, (args.tokens,), generator=g).tolist()
    engines = {"cached": Token2WavEngine(flow, hift, Token2WavConfig())}
    engines.update({m: Token2WavEngine(flow, hift, Token2WavConfig(graphs=m)) for m in args.modes.split(",")})
    for engine in engines.values():  # warm-up: kernels, buckets (compiled or captured once)
        _utterance(engine, prompt, tokens)
    times: dict[str, list[float]] = {name: [] for name in engines}
    for _ in range(args.rounds):
        for name, engine in engines.items():
            times[name].append(_utterance(engine, prompt, tokens))
    base = statistics.median(times["cached"])
    print(f"{args.preset}, prompt {args.prompt} + {args.tokens} tokens, {torch.get_num_threads()} threads")
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"{name:>16}: {med:8.3f} s per utterance   cached / this = {base / med:5.2f}")


if __name__ == "__main__":
    main()
