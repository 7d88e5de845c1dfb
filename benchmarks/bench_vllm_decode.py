"""Decode speed of the LLM: our `LLMEngine` against `VLLMEngine` (vLLM in its worker), random weights.

    python benchmarks/bench_vllm_decode.py --engine ours|vllm [--preset cosyvoice2-0.5b] [--batches 1,16]
        [--precision fp32|bf16] [--steps 32] [--prompt 80] [--compile]

For each batch size: B greedy requests (prompt positions each, every stop id masked so none ends early) are
prefilled, then `steps` decode steps are timed; prints decode tokens/s (B x steps / seconds) as JSON lines.
The vllm engine needs VOCALIS_VLLM_PYTHON (see vocalis/backends/vllm/engine.py).
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from vocalis.backends.vllm.engine import VLLMEngine
from vocalis.config import PRESETS
from vocalis.engine.config import EngineConfig
from vocalis.engine.llm_engine import LLMEngine
from vocalis.engine.request import SamplingParams
from vocalis.models.speech_lm import Qwen2LM
from vocalis.precision.layers import cast_linears


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--engine", choices=("ours", "vllm"), required=True)
    ap.add_argument("--preset", default="cosyvoice2-0.5b")
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--prompt", type=int, default=80)
    ap.add_argument("--compile", action="store_true", help="vllm: its torch.compile mode (not enforce_eager)")
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    torch.manual_seed(0)
    llm = Qwen2LM(PRESETS[args.preset].llm).eval().requires_grad_(False)
    cfg = EngineConfig(max_num_seqs=max(batches), max_model_len=1024, enable_prefix_caching=False)
    start = time.perf_counter()
    if args.engine == "vllm":
        engine: LLMEngine | VLLMEngine = VLLMEngine(llm, cfg, precision=args.precision, enforce_eager=not args.compile)
    else:
        if args.precision == "bf16":
            cast_linears(llm, torch.bfloat16)
        engine = LLMEngine(llm, cfg)
    print(json.dumps({"engine": args.engine, "precision": args.precision, "compile": args.compile,
                      "start_s": round(time.perf_counter() - start, 1)}), flush=True)
    n = args.steps + 1
    params = SamplingParams(greedy=True, min_len=n, max_len=n, stop_all_masked=True)
    for b in [1, *batches]:  # the first batch-1 pass warms up
        text = [[100 + (7 * i + j) % 3000 for j in range(args.prompt - 2)] for i in range(b)]
        reqs = [engine.make_request(t, params=params) for t in text]
        for r in reqs:
            engine.add_request(r)
        while any(r.num_output_tokens == 0 for r in reqs):
            engine.step()
        t0 = time.perf_counter()
        steps = 0
        while engine.has_work():
            engine.step()
            steps += 1
        dt = time.perf_counter() - t0
        done = sum(r.num_output_tokens for r in reqs) - b
        print(json.dumps({"batch": b, "steps": steps, "decode_tok_s": round(done / dt, 1),
                          "ms_per_step": round(1000 * dt / max(steps, 1), 1)}), flush=True)
    if isinstance(engine, VLLMEngine):
        engine.close()


if __name__ == "__main__":
    main()
