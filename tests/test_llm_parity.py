"""Speech LM parity with the official `Qwen2LM` on the compat fixture (ref_llm).

Covers strict loading of `llm.pt`, the prefill layout, cached step log-probs, uncached full-forward
log-probs and the 16 greedy tokens of the reference decoding (stop ids masked, exactly 16 steps), with and
without a prompt.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import load_reference

from vocalis.config import SpeechLMConfig
from vocalis.errors import ModelLoadError
from vocalis.models.speech_lm import Qwen2LM, prepare_official_state_dict
from vocalis.reference.decode import generate
from vocalis.reference.sampling import greedy_sampling, make_greedy_sampler

ATOL = 1e-4
STEPS = 16


def _config(compat_model) -> SpeechLMConfig:
    return compat_model.config.llm  # read from cosyvoice2.yaml + CosyVoice-BlankEN/config.json


@pytest.fixture(scope="module")
def official_sd(compat_dir: Path) -> dict[str, torch.Tensor]:
    return torch.load(compat_dir / "llm.pt", map_location="cpu", weights_only=True)


@pytest.fixture(scope="module")
def model(compat_model) -> Qwen2LM:
    return compat_model.llm  # loaded by the official-layout loader


@pytest.fixture(scope="module")
def ref(compat_dir: Path) -> dict[str, torch.Tensor]:
    return load_reference(compat_dir, "ref_llm")


def test_state_dict_keys_and_shapes(compat_model, official_sd: dict[str, torch.Tensor]) -> None:
    ours = Qwen2LM(_config(compat_model)).state_dict()
    prepared = prepare_official_state_dict(official_sd)
    assert "llm.model.lm_head.weight" in official_sd and "llm.model.lm_head.weight" not in prepared
    assert set(prepared) == set(ours)
    assert {k: tuple(v.shape) for k, v in prepared.items()} == {k: tuple(v.shape) for k, v in ours.items()}


def test_prepare_rejects_untied_head(official_sd: dict[str, torch.Tensor]) -> None:
    bad = dict(official_sd)
    bad["llm.model.lm_head.weight"] = bad["llm.model.lm_head.weight"] + 1.0
    with pytest.raises(ModelLoadError, match="lm_head"):
        prepare_official_state_dict(bad)
    absent = {k: v for k, v in official_sd.items() if k != "llm.model.lm_head.weight"}
    assert set(prepare_official_state_dict(absent)) == set(absent)


def _inputs(ref: dict[str, torch.Tensor], run: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if run == "prompt":
        return ref["text"], ref["prompt_text"], ref["prompt_speech_token"]
    empty = torch.zeros(1, 0, dtype=torch.int32)
    return ref["noprompt_text"], empty, empty


@pytest.mark.parametrize("run", ["prompt", "noprompt"])
def test_reference_decoding(model: Qwen2LM, ref: dict[str, torch.Tensor], run: str) -> None:
    key = "" if run == "prompt" else "noprompt_"
    text, prompt_text, prompt_speech = _inputs(ref, run)
    stops = model.config.stop_token_ids
    with torch.inference_mode():
        lm_input = model.prefill_embeddings(text, prompt_text, prompt_speech)
        input_diff = (lm_input - ref[f"{key}lm_input"]).abs().max().item()

        # Cached path: the reference's loop (greedy after masking every stop id), recording raw log-probs.
        rows, tokens, cache, x = [], [], None, lm_input
        for _ in range(STEPS):
            logp, cache = model.step(x, cache)
            rows.append(logp[0])
            tokens.append(greedy_sampling(logp[0], stops))
            x = model.speech_embedding.weight[tokens[-1]].reshape(1, 1, -1)
        step_diff = (torch.stack(rows) - ref[f"{key}step_logp"]).abs().max().item()

        # Uncached path: one causal pass over the prefill and the fed-back tokens.
        ref_tokens = ref[f"{key}tokens"]
        full = torch.cat((lm_input, model.embed_speech(ref_tokens[:-1])), dim=1)
        logp_full = model(full).log_softmax(dim=-1)[0, lm_input.shape[1] - 1 :]
        nocache_diff = (logp_full - ref[f"{key}nocache_logp"]).abs().max().item()

    generated = list(
        generate(model, 
            text, prompt_text, prompt_speech, min_len=STEPS, max_len=STEPS, sample_fn=make_greedy_sampler(stops)
        )
    )
    print(f"[{run}] max abs diff lm_input {input_diff:.3g} step_logp {step_diff:.3g} nocache_logp {nocache_diff:.3g}")
    assert input_diff <= ATOL, input_diff
    assert step_diff <= ATOL, step_diff
    assert nocache_diff <= ATOL, nocache_diff
    assert tokens == ref_tokens.tolist()
    assert generated == ref_tokens.tolist()


def test_meta_build_and_assign_load(compat_model, official_sd: dict[str, torch.Tensor], model: Qwen2LM,
                                    ref: dict[str, torch.Tensor]) -> None:
    """Built on the meta device and loaded with assign=True, the model needs no other state (no buffers)."""
    with torch.device("meta"):
        meta = Qwen2LM(_config(compat_model))
    meta.load_state_dict(prepare_official_state_dict(official_sd), strict=True, assign=True)
    assert not list(meta.buffers())
    with torch.inference_mode():
        x = meta.prefill_embeddings(ref["text"], ref["prompt_text"], ref["prompt_speech_token"])
        assert torch.equal(meta.step(x, None)[0], model.step(x, None)[0])
