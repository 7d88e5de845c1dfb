"""GRPO rollouts: the policy's current weights in a plain copy of the speech LM, sampled by the LLM engine (all of
a rank's prompts x G samples in one continuously batched run, each request with its own seed), and the
audio of a model directory's flow and vocoder (on the inference engine) when a reward listens.

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
from vocalis.frontend.request import Mode, SynthesisRequest
from vocalis.frontend.voice import Voice
from vocalis.model_dir import LoadedModel
from vocalis.models.speech_lm import Qwen2LM
from vocalis.train.lora import merged_state_dict
from vocalis.train.policy_config import GRPOConfig
from vocalis.train.policy_data import SpeechSequence
from vocalis.train.rewards import AUDIO_RATE


@dataclass(frozen=True, slots=True)
class RolloutPrompt:
    """What one prompt samples from: its text, the LM's inputs (speech_ids empty), and for audio rewards the voice
    (the flow's prompt) and its speaker embedding."""

    text: str
    sequence: SpeechSequence
    voice: Voice | None = None
    voice_embedding: np.ndarray | None = None


class RolloutEngine:
    """max_num_seqs: the rollouts sampled at once (a rank's share of a round); prompts: every prompt the run may
    sample from, which with the length bound sizes the KV cache (every sequence at its longest at once)."""

    def __init__(self, policy: Qwen2LM, sampling: SamplingConfig, config: GRPOConfig, max_num_seqs: int,
                 prompts: Sequence[SpeechSequence]) -> None:
        device = policy.speech_embedding.weight.device
        self.llm = Qwen2LM(policy.config).to(device).eval().requires_grad_(False)
        self.sync(policy)
        self.sampling = dataclasses.replace(sampling, temperature=sampling.temperature * config.temperature)
        self.max_len = config.max_len
        # [sos] prompt text + text [task] prompt speech, then the speech ids and the fed-back last one
        longest = max((2 + len(p.prompt_text_ids) + len(p.text_ids) + len(p.prompt_speech_ids) + 1
                       + self._max_len(len(p.text_ids)) for p in prompts), default=2)
        seqs, block = max(1, max_num_seqs), EngineConfig().block_size
        self.engine = LLMEngine(self.llm, EngineConfig(
            enable_prefix_caching=False, pack_weights=False, cuda_graphs=False, fused_decode=(), huge_pages=False,
            max_num_seqs=seqs, max_model_len=max(2, longest), num_kv_blocks=seqs * -(-longest // block)))

    def _max_len(self, num_text_ids: int) -> int:
        """Most speech ids one rollout of a text this long may sample (the model's bound, or grpo.max_len)."""
        bound = self.llm.length_bounds(num_text_ids)[1]
        return min(bound, self.max_len) if self.max_len > 0 else bound

    @torch.no_grad()
    def sync(self, policy: Qwen2LM) -> None:
        """Copy the policy's current (LoRA-merged) weights into the rollout model, in place."""
        self.llm.load_state_dict(merged_state_dict(policy))

    def generate(self, prompts: Sequence[SpeechSequence], seeds: Sequence[int]) -> list[SpeechSequence]:
        """One sampled continuation per prompt (its `speech_ids` filled, `stopped` when it ended on eos)."""
        requests = []
        for i, (p, seed) in enumerate(zip(prompts, seeds)):
            params = self.engine.sampling_params(len(p.text_ids), self.sampling, seed=seed)
            if params.max_len > self._max_len(len(p.text_ids)):
                limit = self._max_len(len(p.text_ids))
                params = dataclasses.replace(params, max_len=limit, min_len=min(params.min_len, limit))
            requests.append(self.engine.make_request(p.text_ids, p.prompt_text_ids, p.prompt_speech_ids, params,
                                                     request_id=f"rollout-{i}"))
        out = self.engine.generate(requests)
        return [dataclasses.replace(p, speech_ids=tuple(out[r.request_id]),
                                    stopped=r.status is RequestStatus.FINISHED_STOPPED)
                for p, r in zip(prompts, requests)]


class RolloutAudio:
    """speech ids -> 16 kHz waveforms through a model's flow and vocoder: voice-conversion requests (no LLM) on the
    inference engine, all of a round's at once from threads, so that its token2wav batches them. A voice without a
    prompt recording (an embedding only, which voice conversion does not take) goes through the reference
    token2wav with an empty flow prompt. At most `workers` render at once (the token2wav engine batches what they
    submit; more threads would only wait)."""

    def __init__(self, model: LoadedModel, workers: int = 8) -> None:
        from vocalis.reference.token2wav import Token2Wav
        from vocalis.tts import TTS

        self.tts = TTS(model)
        self.reference = Token2Wav(model.flow, model.hift)
        self.mel_bins = model.config.flow.output_size
        self.workers = max(1, workers)

    def render(self, items: Sequence[tuple[Sequence[int], Voice, int]]) -> list[np.ndarray]:
        """(speech ids, voice, seed) per rollout -> waveform (N,) float32 at AUDIO_RATE (empty ids: empty)."""
        from concurrent.futures import ThreadPoolExecutor

        import soxr

        def one(item: tuple[Sequence[int], Voice, int]) -> np.ndarray:
            ids, voice, seed = item
            if not ids:
                return np.zeros(0, np.float32)
            if voice.has_prompt_speech:
                request = SynthesisRequest(voice, Mode.VC, "", "", tuple(ids), 1.0, seed)
                wav = np.concatenate([c.samples for c in self.tts.run(request, stream=False)])
            else:
                prompt = FlowPrompt.empty(voice.embedding.reshape(1, -1), self.mel_bins)
                with torch.no_grad():
                    out = self.reference.offline(torch.tensor([list(ids)], dtype=torch.int32), prompt, 1.0,
                                                 torch.Generator().manual_seed(seed))
                wav = out.reshape(-1).float().cpu().numpy()
            return soxr.resample(wav, SAMPLE_RATE, AUDIO_RATE).astype(np.float32)

        with ThreadPoolExecutor(max_workers=max(1, min(len(items), self.workers))) as pool:
            return list(pool.map(one, items))

    def close(self) -> None:
        self.tts.close()
