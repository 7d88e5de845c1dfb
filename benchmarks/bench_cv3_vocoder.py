"""CosyVoice 3's causal HiFT in a stream: the windowed decoder (`token2wav.cv3.vocoder`) against the official
re-run over all mel so far, on the calls of the official streaming schedule.

Random weights at the released HiFT shapes (or `--base-channels`), a mel of `--seconds` of audio after a prompt of
`--prompt-tokens`; each call vocodes the mel its schedule has made by then, as `CV3Token2WavEngine` does. Both
forms run in one process, alternating rounds; printed: the median seconds of a whole utterance's vocoder calls,
the frames decoded, and the largest sample difference between the forms.

    python benchmarks/bench_cv3_vocoder.py --seconds 10 30 --rounds 3 --threads 2
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from vocalis.config import StreamConfig
from vocalis.config.cv3 import CausalHiFTConfig
from vocalis.models.cv3.hift import CausalHiFTGenerator
from vocalis.token2wav.cv3.schedule import schedule_calls
from vocalis.token2wav.cv3.vocoder import VocoderRow, left_context_frames, vocode

TOKEN_MEL_RATIO = 2  # mel frames per speech token (50 Hz mel, 25 Hz tokens)


def utterance(hift: CausalHiFTGenerator, mel: torch.Tensor, prompt_tokens: int, tokens: int, window: bool
              ) -> tuple[float, int, torch.Tensor]:
    """Every call of one stream: seconds, frames decoded, the audio."""
    stream = StreamConfig()
    yielded, frames, chunks = 0, 0, []
    start = time.perf_counter()
    for call in schedule_calls(prompt_tokens, tokens, stream):
        # the utterance's mel so far: a non-final call's last look-ahead tokens give their frames later
        kept = TOKEN_MEL_RATIO * (call.num_tokens - (0 if call.finalize else stream.pre_lookahead_len))
        row = VocoderRow(mel[:, :kept], call.finalize, yielded)
        chunk = vocode(hift, [row], window)[0]
        yielded += chunk.shape[0]
        frames += row.decoded_frames
        chunks.append(chunk)
    return time.perf_counter() - start, frames, torch.cat(chunks)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, nargs="+", default=[10.0, 30.0])
    ap.add_argument("--prompt-tokens", type=int, default=75)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--base-channels", type=int, default=512)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    config = CausalHiFTConfig(base_channels=args.base_channels)
    hift = CausalHiFTGenerator(config).eval()
    print(f"causal HiFT, base channels {args.base_channels}, decoder context {left_context_frames(config)} frames, "
          f"{args.threads} threads, prompt {args.prompt_tokens} tokens")
    for seconds in args.seconds:
        tokens = int(seconds * 25)
        mel = torch.randn(80, 2 * tokens) * 0.5
        times: dict[bool, list[float]] = {True: [], False: []}
        frames, audio = {}, {}
        utterance(hift, mel[:, :100], args.prompt_tokens, 50, True)  # warm-up
        for _ in range(args.rounds):
            for window in (True, False):
                t, frames[window], audio[window] = utterance(hift, mel, args.prompt_tokens, tokens, window)
                times[window].append(t)
        w, r = statistics.median(times[True]), statistics.median(times[False])
        diff = (audio[True] - audio[False]).abs().max().item()
        print(f"{seconds:5.1f} s: windowed {w:6.2f} s ({frames[True]} frames), re-run {r:6.2f} s "
              f"({frames[False]} frames): {r / w:.2f}x, RTF {w / seconds:.3f} vs {r / seconds:.3f}, "
              f"max sample difference {diff:.1e}")


if __name__ == "__main__":
    main()
