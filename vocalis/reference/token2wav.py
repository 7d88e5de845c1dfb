"""Speech tokens -> waveform on the reference path: flow + HiFT, non-streaming and streaming.

Streaming follows the released model's schedule: the first hop is 25 tokens plus the padding that puts the
prompt and the first chunk on a 25-token chunk-mask boundary, later hops grow 25 -> 50 -> 100; each chunk needs
3 look-ahead tokens beyond its hop. HiFT keeps 8 mel frames, 3840 source samples and 3840 speech samples
between chunks and cross-fades the seam with a Hamming window. All of that lives on `StreamState`, one per
request; `Token2Wav` holds only the shared modules.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from vocalis.config import StreamConfig
from vocalis.frontend.prompt import FlowPrompt
from vocalis.models.flow.flow import CausalMaskedDiffWithXvec
from vocalis.models.hift.generator import HiFTGenerator


@dataclass
class StreamState:
    """Per-request streaming progress and HiFT caches."""

    prompt: FlowPrompt
    token_offset: int = 0
    hop: int = 25
    chunks_done: int = 0
    generator: torch.Generator | None = None
    cache_mel: torch.Tensor | None = None  # (1, 80, mel_cache_len)
    cache_source: torch.Tensor | None = None  # (1, 1, source_cache_len)
    cache_speech: torch.Tensor | None = None  # (1, source_cache_len)
    finished: bool = False
    hops: list[int] = field(default_factory=list)


class Token2Wav:
    """Stateless orchestration of the flow and HiFT modules for one request at a time."""

    def __init__(self, flow: CausalMaskedDiffWithXvec, hift: HiFTGenerator, stream: StreamConfig | None = None):
        self.flow = flow
        self.hift = hift
        self.stream = stream or StreamConfig()
        # float64 like the released pipeline's numpy window; the seam product is formed in float64
        self.window = torch.from_numpy(np.hamming(2 * self.stream.source_cache_len))

    # ---- scheduling -------------------------------------------------------------------------------
    def new_state(self, prompt: FlowPrompt, generator: torch.Generator | None = None) -> StreamState:
        return StreamState(prompt=prompt, hop=self.stream.token_hop_len, generator=generator)

    def this_hop(self, state: StreamState) -> int:
        """Tokens the next chunk advances by."""
        if state.chunks_done == 0:
            p = state.prompt.speech_ids.shape[1]
            chunk = self.stream.token_hop_len
            return state.hop + math.ceil(p / chunk) * chunk - p
        return state.hop

    def ready(self, state: StreamState, num_tokens: int) -> bool:
        """Whether `num_tokens` generated tokens suffice for the next non-final chunk."""
        return num_tokens - state.token_offset >= self.this_hop(state) + self.stream.pre_lookahead_len

    # ---- flow -------------------------------------------------------------------------------------
    @torch.inference_mode()
    def _flow(self, tokens: torch.Tensor, prompt: FlowPrompt, streaming: bool, finalize: bool) -> torch.Tensor:
        """tokens (1, N) -> mel (1, 80, 2N) or (1, 80, 2(N - lookahead)) when not finalizing."""
        dev = self.flow.input_embedding.weight.device
        return self.flow.inference(
            token=tokens.to(dev),
            token_len=torch.tensor([tokens.shape[1]], dtype=torch.int32, device=dev),
            prompt_token=prompt.speech_ids.to(dev),
            prompt_token_len=torch.tensor([prompt.speech_ids.shape[1]], dtype=torch.int32, device=dev),
            prompt_feat=prompt.mel.to(dev),
            prompt_feat_len=torch.tensor([prompt.mel.shape[1]], dtype=torch.int32, device=dev),
            embedding=prompt.embedding.to(dev),
            streaming=streaming,
            finalize=finalize,
        ).float()

    # ---- HiFT with caches ---------------------------------------------------------------------------
    @torch.inference_mode()
    def _vocode(self, state: StreamState, mel: torch.Tensor, finalize: bool, speed: float = 1.0) -> torch.Tensor:
        """New mel frames (1, 80, T) -> the audio to emit (1, N), updating the caches on `state`."""
        if speed != 1.0:
            # stretched before the cached frames are put in front, so HiFT sees one continuous stretched mel
            mel = F.interpolate(mel, size=max(1, int(mel.shape[2] / speed)), mode="linear")
        if state.cache_mel is not None:
            mel = torch.cat([state.cache_mel.to(mel.device), mel], dim=2)
        source = state.cache_source.to(mel.device) if state.cache_source is not None else None
        speech, new_source = self.hift.inference(mel, cache_source=source, generator=state.generator)
        speech = speech.float().cpu()
        if state.cache_speech is not None:
            speech = self._crossfade(speech, state.cache_speech)
        if finalize:
            state.cache_mel = state.cache_source = state.cache_speech = None
            return speech
        n = self.stream.source_cache_len
        state.cache_mel = mel[:, :, -self.stream.mel_cache_len :].clone()
        state.cache_source = new_source[:, :, -n:].clone()
        state.cache_speech = speech[:, -n:].clone()
        return speech[:, :-n]

    def _crossfade(self, speech: torch.Tensor, previous_tail: torch.Tensor) -> torch.Tensor:
        """Rising half of the window on the new audio, falling half on the held-back tail."""
        n = self.stream.source_cache_len
        out = speech.clone()
        out[:, :n] = (speech[:, :n].double() * self.window[:n] + previous_tail.double() * self.window[n:]).float()
        return out

    # ---- public steps -------------------------------------------------------------------------------
    def stream_step(self, state: StreamState, tokens: torch.Tensor, speed: float = 1.0) -> torch.Tensor:
        """Emit the next chunk. tokens: (1, N) all tokens so far, N >= offset + hop + lookahead -> (1, samples)."""
        hop = self.this_hop(state)
        end = state.token_offset + hop + self.stream.pre_lookahead_len
        if tokens.shape[1] < end:
            raise ValueError(f"stream_step needs {end} tokens, got {tokens.shape[1]}")
        mel = self._flow(tokens[:, :end], state.prompt, streaming=True, finalize=False)
        mel = mel[:, :, state.token_offset * self.flow.config.token_mel_ratio :]
        audio = self._vocode(state, mel, finalize=False, speed=speed)
        state.hops.append(hop)
        state.token_offset += hop
        state.chunks_done += 1
        state.hop = min(self.stream.token_max_hop_len, state.hop * self.stream.stream_scale_factor)
        return audio

    def finish(self, state: StreamState, tokens: torch.Tensor, speed: float = 1.0) -> torch.Tensor:
        """Emit everything after the last chunk (or the whole utterance if no chunk was made) -> (1, samples).

        The final call uses full attention over all tokens, like the released pipeline.
        """
        if state.finished:
            raise RuntimeError("stream already finished")
        mel = self._flow(tokens, state.prompt, streaming=False, finalize=True)
        mel = mel[:, :, state.token_offset * self.flow.config.token_mel_ratio :]
        state.finished = True
        return self._vocode(state, mel, finalize=True, speed=speed)

    def offline(
        self, tokens: torch.Tensor, prompt: FlowPrompt, speed: float = 1.0, generator: torch.Generator | None = None
    ) -> torch.Tensor:
        """Non-streaming: tokens (1, N) -> waveform (1, 960 N / speed)."""
        return self.finish(self.new_state(prompt, generator), tokens, speed)
