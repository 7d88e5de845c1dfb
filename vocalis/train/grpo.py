"""GRPO: group-relative policy optimisation of the speech LM from engine rollouts and reward scorers.

Each rollout round takes global_batch / G prompts (epochs of a seeded shuffle) and samples G sequences of each
through the engine, every sample seeded by (seed, round, its index in the round), so the round is the same
however its samples are spread over ranks. Rewards are weighted sums of the scorers'; each rank scores its own
samples, then every rank sees all rewards (a sum over ranks) and normalises each group: A = (r - mean) / (std +
1e-4). The loss per sample is the token mean of
    -min(rho A, clip(rho, 1 - eps, 1 + eps) A) + kl_coef * (exp(ref - logp) - (ref - logp) - 1)
with rho = exp(logp - logp_old) (logp_old: the policy when the round was sampled) and ref the frozen reference's
log-probs (the KL estimator is 0 while the policy equals the reference). A round serves
`grpo.updates_per_rollout` optimizer steps.
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from vocalis.errors import InputError
from vocalis.train.distributed import gather_objects, sum_over_ranks
from vocalis.train.policy_data import Prompt, SpeechSequence, read_prompts, shuffled_positions
from vocalis.train.policy_trainer import PolicyObjective, PolicyTrainer
from vocalis.train.rewards import Rollout, build_scorers
from vocalis.train.rollout import RolloutAudio, RolloutEngine, RolloutPrompt
from vocalis.train.sequence_logp import token_logprobs

ROLLOUTS = "rollouts.jsonl"  # per round: each group's best and worst sample, as DPO pairs


@dataclass(frozen=True, slots=True)
class Sample:
    sequence: SpeechSequence
    advantage: float
    old_logp: torch.Tensor | None  # (L,) when updates_per_rollout > 1


class GRPOObjective(PolicyObjective):
    name = "grpo"

    def __init__(self, trainer: PolicyTrainer) -> None:
        self.trainer = trainer
        config = trainer.config
        self.cfg = g = config.grpo
        self.group = g.group_size
        if config.policy.global_batch % self.group:
            raise InputError(f"policy.global_batch {config.policy.global_batch} is not a multiple of "
                             f"grpo.group_size {self.group}")
        self.prompts_per_round = config.policy.global_batch // self.group
        self.model = None
        if config.model.init_from:
            from vocalis.model_dir import load_model

            self.model = load_model(config.model.init_from)
        encoder = self.model.speaker_encoder if self.model is not None else None
        self.scorers = build_scorers(g, encoder.embed if encoder is not None else None)
        self.needs_audio = any(getattr(s, "needs_audio", False) for s in self.scorers)
        if self.needs_audio and self.model is None:
            raise InputError("rewards that listen (wer, similarity) need model.init_from: a model directory whose "
                             "flow and vocoder make the audio")
        self.audio = RolloutAudio(self.model) if self.needs_audio and self.model else None
        self.prompts = [self._resolve(p, i) for i, p in enumerate(read_prompts(config.policy.data))]
        share = config.policy.global_batch // trainer.info.world_size
        self.engine = RolloutEngine(trainer.policy, trainer.model_config.sampling, g, share,
                                    [p.sequence for p in self.prompts])
        self.round = -1
        self.batch: list[Sample] = []
        self.metrics: dict[str, float] = {}
        self._prompt_of: dict[int, int] = {}  # sample index in the round -> prompt index

    def _resolve(self, p: Prompt, index: int) -> RolloutPrompt:
        """Text and voice -> the LM's inputs (the model's frontend) and the flow prompt."""
        if p.text_ids and not (self.needs_audio or p.voice):
            return RolloutPrompt(p.text, SpeechSequence(p.text_ids, (), p.prompt_text_ids, p.prompt_speech_ids))
        if self.model is None:
            raise InputError(f"prompt {index + 1}: text and voices need model.init_from (a model directory)")
        from vocalis.frontend.family import frontend_for
        from vocalis.frontend.request import Mode, SynthesisRequest

        frontend = frontend_for(self.model)
        voices = self.model.voices
        name = p.voice or (min(voices) if voices else None)
        if name is None or name not in voices:
            raise InputError(f"prompt {index + 1}: no voice {name!r} in the model (voices: {sorted(voices)})")
        voice = voices[name]
        mode = Mode.SFT if not voice.has_prompt_speech else Mode.ZERO_SHOT if voice.prompt_text_ids else \
            Mode.CROSS_LINGUAL
        request = SynthesisRequest(voice, mode, p.text or "-", language=self.cfg.language)
        text_ids = p.text_ids or tuple(i for seg in frontend.segments(request) for i in seg)
        prompt_text, prompt_speech = frontend.llm_prompt(request)
        return RolloutPrompt(p.text, SpeechSequence(text_ids, (), tuple(prompt_text), tuple(prompt_speech)),
                             voice, voice.embedding.numpy().astype(np.float32))

    # ---- rounds ----------------------------------------------------------------------------------------------
    def items_for_step(self, step: int) -> list[tuple[int, int, int]]:
        """(round, sample index in the round, prompt index) for every sample of the step's round."""
        rnd = step // self.cfg.updates_per_rollout
        k = self.prompts_per_round
        order = shuffled_positions(len(self.prompts), self.trainer.config.trainer.seed, rnd * k, k)
        return [(rnd, j * self.group + g, p) for j, p in enumerate(order) for g in range(self.group)]

    def _seed(self, rnd: int, index: int) -> int:
        return zlib.crc32(f"{self.trainer.config.trainer.seed}-{rnd}-{index}".encode())

    def prepare(self, items: Sequence[tuple[int, int, int]], step: int) -> list[Sample]:
        rnd = step // self.cfg.updates_per_rollout
        if rnd == self.round:
            return self.batch
        info = self.trainer.info
        self.engine.sync(self.trainer.policy)
        prompts = [self.prompts[p] for _, _, p in items]
        seqs = self.engine.generate([p.sequence for p in prompts], [self._seed(rnd, i) for _, i, _ in items])
        rollouts = [Rollout(p.text, s) for p, s in zip(prompts, seqs)]
        if self.audio is not None:
            waves = self.audio.render([(r.sequence.speech_ids, p.voice, self._seed(rnd, i))  # type: ignore[misc]
                                       for r, p, (_, i, _) in zip(rollouts, prompts, items)])
            for r, p, wav in zip(rollouts, prompts, waves):
                r.audio, r.voice_embedding = wav, p.voice_embedding
        scores = np.array([s(rollouts) for s in self.scorers], dtype=np.float64).reshape(len(self.scorers), -1)
        rewards = np.asarray(self.cfg.weights()) @ scores  # (n_mine,)
        # every rank sees every reward: each fills its own samples' places of a zero vector, then a sum over ranks
        total = self.prompts_per_round * self.group
        rows = 2 + len(self.scorers)
        full = np.zeros((rows, total))
        idx = [i for _, i, _ in items]
        full[0, idx], full[1, idx] = rewards, [len(s.speech_ids) for s in seqs]
        full[2:, idx] = scores
        full = np.asarray(sum_over_ranks(full.reshape(-1).tolist(), info)).reshape(rows, total)
        grouped = full[0].reshape(-1, self.group)  # (prompts, G)
        adv = ((grouped - grouped.mean(1, keepdims=True)) / (grouped.std(1, keepdims=True) + 1e-4)).reshape(-1)
        old = self._old_logp(seqs) if self.cfg.updates_per_rollout > 1 else [None] * len(seqs)
        self.batch = [Sample(s, float(adv[i]), o) for s, i, o in zip(seqs, idx, old)]
        self.round = rnd
        self.metrics = {"reward": float(full[0].mean()), "reward_group_std": float(grouped.std(1).mean()),
                        "length": float(full[1].mean())}
        self.metrics.update({f"reward_{name.split(':')[-1]}": float(full[2 + j].mean())
                             for j, name in enumerate(self.cfg.rewards)})
        self._prompt_of = {i: p for _, i, p in self.items_for_step(step)}
        self._write_pairs(seqs, rewards, idx)
        return self.batch

    @torch.no_grad()
    def _old_logp(self, seqs: Sequence[SpeechSequence]) -> list[torch.Tensor]:
        mb = self.trainer.config.policy.micro_batch
        out: list[torch.Tensor] = []
        for j in range(0, len(seqs), mb):
            logp, mask = token_logprobs(self.trainer.policy, seqs[j:j + mb])
            out += [row[m] for row, m in zip(logp, mask)]
        return out

    def _write_pairs(self, seqs: Sequence[SpeechSequence], rewards: np.ndarray, idx: list[int]) -> None:
        """Each group's best and worst rollout as a DPO pair in `<out>/rollouts.jsonl` (rank 0)."""
        mine = [(i, float(r), list(s.speech_ids)) for i, s, r in zip(idx, seqs, rewards)]  # plain data: gathered
        every = sorted((x for part in gather_objects(mine, self.trainer.info) for x in part), key=lambda x: x[0])
        if not self.trainer.info.is_main:
            return
        lines = []
        for g in range(0, len(every), self.group):
            group = every[g:g + self.group]
            best, worst = max(group, key=lambda x: x[1]), min(group, key=lambda x: x[1])
            if best[1] > worst[1]:
                s = self.prompts[self._prompt_of[best[0]]].sequence
                lines.append(json.dumps({"round": self.round, "text_token": list(s.text_ids),
                                         "prompt_text_token": list(s.prompt_text_ids),
                                         "prompt_speech_token": list(s.prompt_speech_ids),
                                         "chosen": best[2], "rejected": worst[2],
                                         "reward_chosen": best[1], "reward_rejected": worst[1]}))
        self.trainer.out_dir.mkdir(parents=True, exist_ok=True)
        with open(self.trainer.out_dir / ROLLOUTS, "a", encoding="utf-8") as f:
            f.write("".join(line + "\n" for line in lines))

    # ---- loss --------------------------------------------------------------------------------------------
    def loss(self, items: Sequence[Sample], micro_batch: int) -> tuple[torch.Tensor, dict[str, float]]:
        seqs = [s.sequence for s in items]
        logp, mask = self.trainer.scorer(seqs)  # (b, L)
        with torch.no_grad():
            ref, _ = token_logprobs(self.trainer.reference, seqs)
        if items[0].old_logp is None:
            old = logp.detach()
        else:
            old = torch.zeros_like(logp)
            for row, s in enumerate(items):
                assert s.old_logp is not None
                old[row, :s.old_logp.shape[0]] = s.old_logp.to(old.device)
        adv = torch.tensor([s.advantage for s in items], device=logp.device)[:, None]  # (b, 1)
        ratio = torch.exp(logp - old)
        eps = self.cfg.clip_eps
        pg = -torch.minimum(ratio * adv, ratio.clamp(1 - eps, 1 + eps) * adv)
        d = ref - logp
        kl = torch.exp(d) - d - 1
        count = mask.sum(1).clamp(min=1)
        per_sample = ((pg + self.cfg.kl_coef * kl) * mask).sum(1) / count  # (b,)
        clipped = ((ratio - 1).abs() > eps) & mask
        return per_sample.sum() / micro_batch, {
            "loss": float(per_sample.detach().sum()),
            "kl": float(((kl.detach() * mask).sum(1) / count).sum()),
            "clip_fraction": float((clipped.sum(1) / count).sum()),
        }

    def step_metrics(self) -> dict[str, float]:
        return dict(self.metrics)

    # ---- resume ------------------------------------------------------------------------------------------
    def extra_state(self) -> dict[str, Any]:
        return {"round": self.round, "metrics": self.metrics,
                "batch": [{"sequence": [list(s.sequence.text_ids), list(s.sequence.speech_ids),
                                        list(s.sequence.prompt_text_ids), list(s.sequence.prompt_speech_ids),
                                        s.sequence.stopped], "advantage": s.advantage, "old_logp": s.old_logp}
                          for s in self.batch]}

    def load_extra_state(self, state: dict[str, Any]) -> None:
        self.round = int(state.get("round", -1))
        self.metrics = dict(state.get("metrics", {}))
        self.batch = []
        for s in state.get("batch", []):
            text, speech, pt, ps, stopped = s["sequence"]
            seq = SpeechSequence(tuple(text), tuple(speech), tuple(pt), tuple(ps), bool(stopped))
            self.batch.append(Sample(seq, float(s["advantage"]), s["old_logp"]))
