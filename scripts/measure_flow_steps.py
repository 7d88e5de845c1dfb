"""The flow's Euler step count (`Token2WavConfig.flow_steps`, `--flow-steps`) against its default of 10: mel error and
token2wav time per count, on the CPU with random weights.

Per preset, one request (a `--prompt-tokens` prompt, `--tokens` generated speech tokens, the same for every count)
goes through the token2wav engine (fp32, exact caches) at every count in two modes: streaming (cached block-causal
chunks and a block-causal final chunk, the engine's default) and whole (one full-attention pass, as
`TTS.synthesize`). Reported per count: the relative mel error against 10 steps, ||mel_k - mel_10|| / ||mel_10||
over all of the request's frames, and the best wall and CPU (process, all threads) time of the request (flow and
HiFT) over `--repeats` rounds of every count, after a warm-up run.

With random weights the errors say how far fewer steps move the solve's end point, not how the audio sounds; the
figure to compare across counts is the error against 10 steps.

    python scripts/measure_flow_steps.py [--presets tiny,cosyvoice2-0.5b] [--steps 1,2,3,5,10] [--tokens 75]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from vocalis.config import PRESETS
from vocalis.models.flow.flow import CausalMaskedDiffWithXvec
from vocalis.models.hift.generator import HiFTGenerator
from vocalis.reference.token2wav import FlowPrompt
from vocalis.token2wav.config import Token2WavConfig
from vocalis.token2wav.cv2.engine import Token2WavEngine

REFERENCE_STEPS = 10  # CosyVoice 2's cfm.n_timesteps


def build(preset: str, seed: int = 0) -> tuple[CausalMaskedDiffWithXvec, HiFTGenerator]:
    config = PRESETS[preset]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        flow, hift = CausalMaskedDiffWithXvec(config.flow).eval(), HiFTGenerator(config.hift).eval()
    flow.requires_grad_(False)
    hift.requires_grad_(False)
    return flow, hift


def request(prompt_tokens: int, tokens: int) -> tuple[FlowPrompt, list[int]]:
    g = torch.Generator().manual_seed(1000)
    prompt = FlowPrompt(torch.randint(0, 6561, (1, prompt_tokens), generator=g, dtype=torch.int32),
                        torch.randn(1, 2 * prompt_tokens, 80, generator=g), torch.randn(1, 192, generator=g))
    return prompt, torch.randint(0, 6561, (tokens,), generator=g).tolist()


def run(flow: CausalMaskedDiffWithXvec, hift: HiFTGenerator, steps: int, streaming: bool, prompt: FlowPrompt,
        tokens: list[int]) -> tuple[torch.Tensor, float, float]:
    """One request on a fresh engine (its voice prefix computed, as a new voice's first request) -> mel (80, frames)
    over all chunks, wall seconds, CPU seconds of this process (all threads)."""
    engine = Token2WavEngine(flow, hift, Token2WavConfig(cache_dtype=None, flow_steps=steps))
    mels: list[torch.Tensor] = []
    vocode = engine._vocode

    def capture(items, chunk_mels):
        mels.extend(m.clone() for m in chunk_mels)
        return vocode(items, chunk_mels)

    engine._vocode = capture  # type: ignore[method-assign]
    start, cpu = time.perf_counter(), time.process_time()
    state = engine.new_stream("r", prompt, streaming=streaming, generator=torch.Generator().manual_seed(1))
    state.add_tokens(tokens)
    state.end_input()
    while not state.finished:
        engine.step([state])
    return torch.cat(mels, dim=1), time.perf_counter() - start, time.process_time() - cpu


def measure(preset: str, counts: list[int], args: argparse.Namespace) -> list[dict[str, float | int | str]]:
    flow, hift = build(preset)
    prompt, tokens = request(args.prompt_tokens, args.tokens)
    rows = []
    for streaming in (True, False):
        mode = "streaming" if streaming else "whole"
        run(flow, hift, 2, streaming, prompt, tokens[:30])  # warm-up: first-use allocations and thread pools
        mels: dict[int, torch.Tensor] = {}
        times: dict[int, tuple[float, float]] = {}
        for _ in range(args.repeats):  # rounds over every count, so a burst of load on a shared host hits them all
            for k in sorted({*counts, REFERENCE_STEPS}):
                mels[k], wall, cpu = run(flow, hift, k, streaming, prompt, tokens)
                best = times.get(k, (wall, cpu))
                times[k] = (min(wall, best[0]), min(cpu, best[1]))
        ref = mels[REFERENCE_STEPS]
        for k in counts:
            wall, cpu = times[k]
            rows.append({"preset": preset, "mode": mode, "steps": k, "seconds": wall, "cpu_seconds": cpu,
                         "rtf": wall / (len(tokens) / 25), "mel_rel_error": float((mels[k] - ref).norm() / ref.norm())})
            print(f"{preset} {mode} steps {k}: {wall:.3f} s ({cpu:.3f} CPU s), mel rel error "
                  f"{rows[-1]['mel_rel_error']:.3e}", flush=True)
    return rows


def table(rows: list[dict[str, float | int | str]]) -> str:
    lines = ["| preset | steps | mel rel. error vs 10: streaming / whole | token2wav s, CPU s: streaming | whole |",
             "|---|---|---|---|---|"]
    by = {(r["preset"], r["mode"], r["steps"]): r for r in rows}
    for preset, _, k in (key for key in by if key[1] == "streaming"):
        s, w = by[(preset, "streaming", k)], by[(preset, "whole", k)]
        lines.append(f"| {preset} | {k} | {s['mel_rel_error']:.2e} / {w['mel_rel_error']:.2e} | "
                     f"{s['seconds']:.2f}, {s['cpu_seconds']:.2f} | {w['seconds']:.2f}, {w['cpu_seconds']:.2f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--presets", default="tiny,cosyvoice2-0.5b")
    parser.add_argument("--steps", default="1,2,3,5,10", help="Euler step counts (10 is always run: the reference)")
    parser.add_argument("--tokens", type=int, default=75, help="generated speech tokens (25 per second of audio)")
    parser.add_argument("--prompt-tokens", type=int, default=75)
    parser.add_argument("--repeats", type=int, default=2, help="timed runs per count and mode (best reported)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", help="also write the rows here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    counts = [int(k) for k in args.steps.split(",")]
    rows = [row for preset in args.presets.split(",") for row in measure(preset.strip(), counts, args)]
    print(table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
