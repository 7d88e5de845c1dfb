"""HiFT's conv body alone (`token2wav.cv2.hift.hift_body`) at a preset's shapes (random weights): the module's NCL fp32
convs against the same convs time-major (`CastConv(time_major=True)`, what bf16 and int8 run on CPUs without AMX),
and their largest difference. Rows x mel frames per call: one stream's chunk, two streams' first chunks (50 frames
plus the 8-frame seam), four streams' chunks.

    python benchmarks/bench_hift.py --threads 2
    # as on an AVX2 CPU:
    VOCALIS_CPU_ISA=avx2 ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 FBGEMM_ENABLE_INSTRUCTIONS=AVX2 \
        python benchmarks/bench_hift.py --threads 2
"""

from __future__ import annotations

import argparse
import copy

import torch
from bench_attention import per_call_ms

from vocalis.config import PRESETS
from vocalis.kernels.heap import cap_mmap_threshold
from vocalis.models.hift.generator import HiFTGenerator
from vocalis.precision.layers import cast_hift_convs
from vocalis.token2wav.cv2.hift import hift_body

SHAPES = ((1, 50), (2, 58), (4, 50))  # (rows, mel frames)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="cosyvoice2-0.5b", choices=sorted(PRESETS))
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seconds", type=float, default=2.0, help="timing per variant and shape")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    cap_mmap_threshold()  # as the engine runs
    torch.manual_seed(0)
    config = PRESETS[args.preset].hift
    ncl = HiFTGenerator(config).eval()
    time_major = copy.deepcopy(ncl)
    cast_hift_convs(time_major, torch.float32, time_major=True)
    samples_per_frame = config.hop_samples // config.istft_hop_len  # source STFT frames per mel frame
    print("rows x frames | NCL ms | time-major ms | speed-up | max |difference| / max |output|")
    with torch.inference_mode():
        for rows, frames in SHAPES:
            mel = torch.randn(rows, config.in_channels, frames)
            stft = 0.1 * torch.randn(rows, config.istft_n_fft + 2, frames * samples_per_frame + 1)
            lens = torch.full((rows,), frames)
            a, b = (per_call_ms(lambda h=h, m=mel, s=stft, n=lens: hift_body(h, m, s, n), args.seconds)
                    for h in (ncl, time_major))
            ya, yb = hift_body(ncl, mel, stft, lens), hift_body(time_major, mel, stft, lens)
            err = float((ya - yb).abs().max() / ya.abs().max())
            print(f"{rows} x {frames} | {a:.1f} | {b:.1f} | {a / b:.2f}x | {err:.1e}")


if __name__ == "__main__":
    main()
