"""Error of a reduced-precision or other-backend model against its fp32 original, on the same inputs.

Measured per stage so a regression points at its part:
- LLM: teacher-forced next-token agreement (argmax of the speech head at every position of one random
  sequence) and the largest log-probability difference;
- flow: mel from `CausalMaskedDiffWithXvec.inference` (full attention, with a prompt): max abs error and that
  relative to the reference's max |mel|;
- token2wav: waveform from the reference path with the same vocoder seed: max abs error and RMS of the
  difference relative to the reference's RMS (HiFT's sine source turns small F0 changes into phase drift, so
  waveform error is much larger than mel error by nature).
"""

from __future__ import annotations

from typing import Any

import torch

from vocalis.reference.token2wav import FlowPrompt, Token2Wav


def _inputs(model: Any, seed: int, num_tokens: int, num_prompt: int) -> tuple[torch.Tensor, FlowPrompt]:
    g = torch.Generator().manual_seed(seed)
    vocab = model.config.flow.vocab_size
    tokens = torch.randint(0, vocab, (1, num_tokens), generator=g, dtype=torch.int32)
    prompt = FlowPrompt(torch.randint(0, vocab, (1, num_prompt), generator=g, dtype=torch.int32),
                        torch.randn(1, 2 * num_prompt, model.config.flow.output_size, generator=g),
                        torch.randn(1, model.config.spk_embed_dim, generator=g))
    return tokens, prompt


@torch.inference_mode()
def outputs(model: Any, seed: int = 0, llm: bool = True, num_tokens: int = 60, num_prompt: int = 30
            ) -> dict[str, torch.Tensor]:
    """What the measures compare, for one model: speech-head log-probs over a random teacher-forced sequence
    (L, V), the flow's mel (1, 80, T) and the reference path's waveform (1, N) with a fixed vocoder seed."""
    out: dict[str, torch.Tensor] = {}
    if llm:
        g = torch.Generator().manual_seed(seed)
        text = torch.randint(0, model.config.llm.qwen.vocab_size, (20,), generator=g).tolist()
        speech = torch.randint(0, model.config.llm.speech_token_size, (60,), generator=g).tolist()
        emb = model.llm.prefill_embeddings(text, (), speech)  # (1, L, D)
        out["logp"] = model.llm(emb)[0].float().log_softmax(-1).cpu()  # (L, V)
    tokens, prompt = _inputs(model, seed, num_tokens, num_prompt)  # drawn on the CPU: the same on any device
    dev = model.flow.input_embedding.weight.device
    tokens = tokens.to(dev)
    prompt = FlowPrompt(prompt.speech_ids.to(dev), prompt.mel.to(dev), prompt.embedding.to(dev))
    t2w = Token2Wav(model.flow, model.hift)
    mel = t2w._flow(tokens, prompt, streaming=False, finalize=True)
    out["mel"] = mel.cpu()
    gen = torch.Generator(device=dev).manual_seed(seed)
    out["wav"] = t2w._vocode(t2w.new_state(prompt, gen), mel, finalize=True).double().cpu()
    return out


def errors(ref: dict[str, torch.Tensor], other: dict[str, torch.Tensor]) -> dict[str, float]:
    """Measures (module doc) between two `outputs` dicts."""
    res: dict[str, float] = {}
    if "logp" in ref and "logp" in other:
        res["llm_token_agreement"] = (ref["logp"].argmax(-1) == other["logp"].argmax(-1)).float().mean().item()
        res["llm_logprob_max_abs"] = (ref["logp"] - other["logp"]).abs().max().item()
    diff = (ref["mel"] - other["mel"]).abs().max().item()
    res["mel_max_abs"], res["mel_max_rel"] = diff, diff / ref["mel"].abs().max().item()
    d = ref["wav"] - other["wav"]
    res["wav_max_abs"] = d.abs().max().item()
    res["wav_rel_rms"] = (d.pow(2).mean().sqrt() / ref["wav"].pow(2).mean().sqrt()).item()
    return res


def compare(ref: Any, other: Any, seed: int = 0, llm: bool = True) -> dict[str, float]:
    """Every measure, for two models on the same inputs."""
    return errors(outputs(ref, seed, llm), outputs(other, seed, llm))
