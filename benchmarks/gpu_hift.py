"""HiFT's body in each precision `backends.choice` can give it on a device (fp32, or its convs bf16 / fp16 via
`CastConv`): per-call time and the output's error against fp32, the measure behind the VOCALIS_HIFT_HALF choice.

    python benchmarks/gpu_hift.py --device cuda --json hift.json      # (gpu_report.py runs it)
    python benchmarks/gpu_hift.py --device cpu --preset tiny          # the rehearsal: bf16 only

Random weights at the preset's shapes; by default 16 rows x 50 mel frames (a GPU token2wav step's chunk).
"""

from __future__ import annotations

import argparse
import copy
import json
import time
from pathlib import Path

import torch

from vocalis.config import PRESETS
from vocalis.models.hift.generator import HiFTGenerator
from vocalis.precision.layers import cast_hift_convs
from vocalis.token2wav.cv2.hift import hift_body


def _ms(fn, device: torch.device, seconds: float = 1.0) -> float:  # type: ignore[no-untyped-def]
    fn()
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    n, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        fn()
        n += 1
    sync()
    return (time.perf_counter() - start) / n * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="cosyvoice2-0.5b", choices=sorted(PRESETS))
    p.add_argument("--device", default="cuda")
    p.add_argument("--rows", type=int, default=16, help="rows per call (a GPU token2wav step's requests)")
    p.add_argument("--frames", type=int, default=50, help="mel frames per row (a first chunk's)")
    p.add_argument("--json", help="write the figures here")
    args = p.parse_args()
    device = torch.device(args.device)
    torch.manual_seed(0)
    config = PRESETS[args.preset].hift
    fp32 = HiFTGenerator(config).eval().to(device)
    variants = {"fp32": fp32}
    for name, dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16)):
        if device.type == "cuda" or dtype == torch.bfloat16:
            variants[name] = copy.deepcopy(fp32)
            cast_hift_convs(variants[name], dtype)
    per_frame = config.hop_samples // config.istft_hop_len  # source STFT frames per mel frame
    mel = torch.randn(args.rows, config.in_channels, args.frames, device=device)
    stft = 0.1 * torch.randn(args.rows, config.istft_n_fft + 2, args.frames * per_frame + 1, device=device)
    lens = torch.full((args.rows,), args.frames, device=device)
    out = {}
    with torch.inference_mode():
        ref = hift_body(fp32, mel, stft, lens)
        for name, hift in variants.items():
            y = hift_body(hift, mel, stft, lens)
            rel = float((y - ref).float().pow(2).mean().sqrt() / ref.float().pow(2).mean().sqrt())
            ms = _ms(lambda h=hift: hift_body(h, mel, stft, lens), device)
            out[name] = {"rows": args.rows, "frames": args.frames, "ms": ms, "rel_rms": rel}
            print(f"HiFT body, convs {name}: {ms:.2f} ms per {args.rows} x {args.frames} call, rel RMS {rel:.2e}")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
