"""Training objective of `CausalMaskedDiffWithXvec` (kept off the inference import path).

One model serves streaming and non-streaming synthesis because each batch draws, with probability 1/2,
block-causal (chunk) attention masks for both the encoder and the estimator. Each sample also draws, with
probability 1/2, an in-context prompt: a random prefix (up to 30 %) of its own target mel given as the
condition, as at inference. Guidance dropout (zeroing mu, speaker and condition) happens inside the CFM loss.

Legend: B batch, Tt tokens, T mel frames (= token_mel_ratio * Tt), 80 mel bins.
"""

from __future__ import annotations

import torch

from vocalis.models.flow.flow import CausalMaskedDiffWithXvec

# Probability that a batch trains with chunk (streaming) masks, and that a sample gets a prompt prefix.
STREAMING_PROB = 0.5
PROMPT_PROB = 0.5
MAX_PROMPT_FRACTION = 0.3


def _device(generator: torch.Generator | None) -> torch.device | None:
    # Draws happen on the generator's device, so a CUDA generator works as well as a CPU one.
    return generator.device if generator is not None else None


def _uniform(generator: torch.Generator | None) -> float:
    return float(torch.rand((), generator=generator, device=_device(generator)))


def random_prompt_condition(
    feat: torch.Tensor, feat_lens: torch.Tensor, generator: torch.Generator | None = None
) -> tuple[torch.Tensor, list[int]]:
    """Condition (B, T, 80) and prompt lengths: per sample, zeros, or (probability 1/2) a prefix of its mel of
    length uniform in [0, int(0.3 * len)] followed by zeros."""
    cond = torch.zeros_like(feat)
    prompt_lens = []
    for i, length in enumerate(feat_lens.tolist()):
        n = 0
        if _uniform(generator) >= PROMPT_PROB:
            n = int(torch.randint(0, int(MAX_PROMPT_FRACTION * length) + 1, (), generator=generator,
                                  device=_device(generator)))
        cond[i, :n] = feat[i, :n]
        prompt_lens.append(n)
    return cond, prompt_lens


def flow_matching_loss(
    flow: CausalMaskedDiffWithXvec,
    token: torch.Tensor,
    token_len: torch.Tensor,
    feat: torch.Tensor,
    feat_len: torch.Tensor,
    embedding: torch.Tensor,
    generator: torch.Generator | None = None,
    streaming: bool | None = None,
    exclude_prompt: bool = True,
) -> torch.Tensor:
    """Scalar flow-matching loss for a batch.

    token (B, Tt) ids, token_len (B,), feat (B, T, 80) target mel with T = token_mel_ratio * Tt, feat_len (B,),
    embedding (B, spk_embed_dim). streaming=None draws it (probability 1/2); all randomness comes from
    `generator` (streaming flag, prompts, then the CFM's time, noise and guidance dropout), so a seeded
    generator makes a step reproducible.

    The loss counts the non-prompt frames only (`exclude_prompt`): the prompt is given, not predicted. The
    official CosyVoice 2 recipe counts every valid frame; `exclude_prompt=False` does that.
    """
    ratio = flow.config.token_mel_ratio
    if feat.size(1) != ratio * token.size(1):
        raise ValueError(f"target mel has {feat.size(1)} frames, expected {ratio} x {token.size(1)} tokens")
    if streaming is None:
        streaming = _uniform(generator) < STREAMING_PROB
    spks = flow.speaker_projection(embedding)  # (B, 80)
    mu, mask = flow.encode(token, token_len, streaming=streaming)  # (B, T, 80), (B, 1, T)
    cond, prompt_lens = random_prompt_condition(feat, feat_len, generator)  # (B, T, 80)
    loss_mask = None
    if exclude_prompt and any(prompt_lens):
        loss_mask = mask.to(feat.dtype).clone()  # (B, 1, T)
        for i, n in enumerate(prompt_lens):
            loss_mask[i, :, :n] = 0
    return flow.decoder.compute_loss(
        feat.transpose(1, 2).contiguous(),
        mask.to(feat.dtype),
        mu.transpose(1, 2).contiguous(),
        spks,
        cond.transpose(1, 2).contiguous(),
        streaming=streaming,
        generator=generator,
        loss_mask=loss_mask,
    )
