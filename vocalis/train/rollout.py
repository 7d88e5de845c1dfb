"""GRPO rollouts: the policy's current weights in a plain copy of the speech LM, sampled by the LLM engine (all of
a rank's prompts x G samples in one continuously batched run, each request with its own seed), and the
token2wav of a model directory when a reward listens to the audio.

The copy is refreshed in place before each round of rollouts (LoRA folded in); the engine runs without prefix
caching, since the weights behind any cached prefix change between rounds.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from vocalis.config import SAMPLE_RATE, SamplingConfig
from vocalis.engine.config import EngineConfig
from vocalis.engine.llm_engine import LLMEngine
from vocalis.engine.request import RequestStatus
from vocalis.frontend.prompt import FlowPrompt
from vocalis.models.speech_lm import Qwen2LM
from vocalis.train.lora import merged_state_dict
from vocalis.train.policy_config import GRPOConfig
from vocalis.train.policy_data import SpeechSequence
from vocalis.train.rewards import AUDIO_RATE


@dataclass(frozen=True, slots=True)
class RolloutPrompt:
    """What one prompt samples from: its text, the LM's inputs (speech_ids empty), and for audio rewards the flow
    prompt and the voice's speaker embedding."""

    text: str
    sequence: SpeechSequence
    flow_prompt: FlowPrompt | None = None
    voice_embedding: np.ndarray | None = None


class RolloutEngine:
    def __init__(self, policy: Qwen2LM, sampling: SamplingConfig, config: GRPOConfig, max_num_seqs: int) -> None:
        device = policy.speech_embedding.weight.device
        self.llm = Qwen2LM(policy.config).to(device).eval().requires_grad_(False)
        self.sync(policy)
        self.sampling = dataclasses.replace(sampling, temperature=sampling.temperature * config.temperature)
        self.max_len = config.max_len
        self.engine = LLMEngine(self.llm, EngineConfig(
            enable_prefix_caching=False, pack_weights=False, cuda_graphs=False, fused_decode=(), huge_pages=False,
            max_num_seqs=max(1, max_num_seqs), kv_cache_bytes=1 << 30))

    @torch.no_grad()
    def sync(self, policy: Qwen2LM) -> None:
        """Copy the policy's current (LoRA-merged) weights into the rollout model, in place."""
        self.llm.load_state_dict(merged_state_dict(policy))

    def generate(self, prompts: Sequence[SpeechSequence], seeds: Sequence[int]) -> list[SpeechSequence]:
        """One sampled continuation per prompt (its `speech_ids` filled, `stopped` when it ended on eos)."""
        requests = []
        for i, (p, seed) in enumerate(zip(prompts, seeds)):
            params = self.engine.sampling_params(len(p.text_ids), self.sampling, seed=seed)
            if self.max_len > 0 and params.max_len > self.max_len:
                params = dataclasses.replace(params, max_len=self.max_len, min_len=min(params.min_len, self.max_len))
            requests.append(self.engine.make_request(p.text_ids, p.prompt_text_ids, p.prompt_speech_ids, params,
                                                     request_id=f"rollout-{i}"))
        out = self.engine.generate(requests)
        return [dataclasses.replace(p, speech_ids=tuple(out[r.request_id]),
                                    stopped=r.status is RequestStatus.FINISHED_STOPPED)
                for p, r in zip(prompts, requests)]


class RolloutAudio:
    """speech ids -> 16 kHz waveform through a model's flow and vocoder (non-streaming, seeded noise)."""

    def __init__(self, flow: torch.nn.Module, hift: torch.nn.Module) -> None:
        from vocalis.reference.token2wav import Token2Wav

        self.token2wav = Token2Wav(flow, hift)  # type: ignore[arg-type]

    @torch.no_grad()
    def __call__(self, speech_ids: Sequence[int], prompt: FlowPrompt, seed: int) -> np.ndarray:
        import soxr

        if not speech_ids:
            return np.zeros(0, np.float32)
        gen = torch.Generator().manual_seed(seed)
        wav = self.token2wav.offline(torch.tensor([list(speech_ids)], dtype=torch.int32), prompt, 1.0, gen)
        return soxr.resample(wav.reshape(-1).float().cpu().numpy(), SAMPLE_RATE, AUDIO_RATE).astype(np.float32)
