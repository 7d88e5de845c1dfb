#!/usr/bin/env python3
"""Mel error of the int8 flow estimator against fp32 on a trained model (default the built-in one), by which convs
run in int8 (`Int8Conv1d`): none (Linears only), the conv blocks' (what `apply_backend` does), or every causal and
residual conv. Each of the model's saved voices prompts the flow for another voice's prompt tokens, streaming and
whole; the error is the max / mean absolute difference over the fp32 mel's range.

    python scripts/measure_int8_convs.py [--model DIR] [--each]

--each also quantizes one conv at a time (everything else fp32) on the first voice pair: which convs one
activation scale per call serves badly. Run with the AVX2 switches (docs/benchmarks.md) for an AVX2 CPU's 7-bit
weights.
"""

from __future__ import annotations

import argparse
import copy
from itertools import permutations
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import nn

from vocalis.model_dir import load_model
from vocalis.models.flow.estimator import CausalConv1d
from vocalis.precision.dynamic_int8 import Int8Conv1d, quantize_estimator_int8
from vocalis.precision.module_swap import swap_modules

BUILTIN = Path(__file__).resolve().parent.parent / "vocalis" / "assets" / "model"


def _every_conv(module: nn.Module) -> bool:
    return type(module) is CausalConv1d or (type(module) is nn.Conv1d and module.kernel_size == (1,))


@torch.inference_mode()
def mel(flow: nn.Module, prompt: dict[str, torch.Tensor], target: dict[str, torch.Tensor], streaming: bool
        ) -> torch.Tensor:
    ids, pid = target["prompt_speech_ids"][None].long(), prompt["prompt_speech_ids"][None].long()
    pmel = prompt["prompt_mel"][None].float()
    torch.manual_seed(0)  # the flow's start noise
    return flow.inference(ids, torch.tensor([ids.shape[1]]), pid, torch.tensor([pid.shape[1]]), pmel,
                          torch.tensor([pmel.shape[1]]), torch.zeros(1, prompt["embedding"].shape[-1]),
                          streaming=streaming, finalize=True)


def error(out: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    span = float(ref.max() - ref.min())
    d = (out - ref).abs()
    return float(d.max()) / span, float(d.mean()) / span


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=BUILTIN)
    ap.add_argument("--each", action="store_true", help="also one conv at a time (first voice pair)")
    args = ap.parse_args()
    flow = load_model(str(args.model)).flow.float().eval()
    voices = {p.stem: load_file(str(p)) for p in sorted((args.model / "voices").glob("*.safetensors"))
              if p.stem != "default"}
    if len(voices) < 2:
        raise SystemExit(f"{args.model}: needs two saved voices besides 'default' (voices/NAME.safetensors)")
    forms = {"Linears": copy.deepcopy(flow), "+ conv blocks": copy.deepcopy(flow), "+ every conv": copy.deepcopy(flow)}
    quantize_estimator_int8(forms["Linears"].decoder.estimator)
    quantize_estimator_int8(forms["+ conv blocks"].decoder.estimator, convs=True)
    every = forms["+ every conv"].decoder.estimator
    quantize_estimator_int8(every)
    swap_modules(every, _every_conv, Int8Conv1d)
    pairs = list(permutations(voices, 2))[:3]
    print("| prompt -> target | mode | " + " | ".join(f"{f} max / mean" for f in forms) + " |")
    print("|---|---|" + "---|" * len(forms))
    for a, b in pairs:
        for streaming in (True, False):
            ref = mel(flow, voices[a], voices[b], streaming)
            cells = [error(mel(f, voices[a], voices[b], streaming), ref) for f in forms.values()]
            print(f"| {a} -> {b} | {'streaming' if streaming else 'whole'} | "
                  + " | ".join(f"{m:.2e} / {n:.2e}" for m, n in cells) + " |")
    if args.each:
        a, b = pairs[0]
        ref = mel(flow, voices[a], voices[b], True)
        print(f"\none conv in int8 at a time ({a} -> {b}, streaming): max / mean")
        est = flow.decoder.estimator
        for name, conv in [(n, m) for n, m in est.named_modules() if _every_conv(m)]:
            parent, _, leaf = name.rpartition(".")
            owner = est.get_submodule(parent) if parent else est
            setattr(owner, leaf, Int8Conv1d(conv))
            m, n = error(mel(flow, voices[a], voices[b], True), ref)
            setattr(owner, leaf, conv)
            print(f"  {name:40s} {m:.2e} / {n:.2e}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
