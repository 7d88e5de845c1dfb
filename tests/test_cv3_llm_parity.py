"""CosyVoice 3 LM parity with the official `CosyVoice3LM` on the compat_cv3 fixture (ref_llm).

Strict loading of `llm.pt`, the prefill layout (rows and embeddings), cached step log-probs, uncached log-probs
and the 16 greedy tokens (every stop id masked, exactly 16 steps) for the zero-shot, no-prompt and instruct runs.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from cv3_support import ATOL, cv3_reference, max_diff, state_dict_shapes

from vocalis.models.cv3.speech_lm import CosyVoice3LM, prepare_official_state_dict
from vocalis.reference.sampling import greedy_sampling

STEPS = 16
RUNS = ("", "noprompt_", "instruct_")


@pytest.fixture(scope="module")
def ref(cv3_dir: Path) -> dict[str, torch.Tensor]:
    return cv3_reference(cv3_dir, "ref_llm")


@pytest.fixture(scope="module")
def official_sd(cv3_dir: Path) -> dict[str, torch.Tensor]:
    return torch.load(cv3_dir / "llm.pt", map_location="cpu", weights_only=True)


def _inputs(ref: dict[str, torch.Tensor], run: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    empty = torch.zeros(1, 0, dtype=torch.int32)
    if run == "":
        return ref["text"], ref["prompt_text"], ref["prompt_speech_token"]
    if run == "noprompt_":
        return ref["noprompt_text"], empty, empty
    return ref["instruct_text"], ref["instruct_prompt_text"], empty


def test_head_layout(cv3_model) -> None:
    llm = cv3_model.llm
    c = llm.config
    assert isinstance(llm, CosyVoice3LM)
    assert (c.sos_token, c.eos_token, c.task_id_token, c.fill_token) == (300, 301, 302, 303)
    assert c.stop_token_ids == tuple(range(300, 500))
    assert llm.llm_decoder.bias is None and llm.llm_decoder.out_features == 500
    assert llm.speech_embedding.num_embeddings == 500
    assert not hasattr(llm, "llm_embedding")


def test_state_dict_keys_and_shapes(cv3_model, official_sd: dict[str, torch.Tensor]) -> None:
    prepared = prepare_official_state_dict(official_sd)
    assert set(official_sd) - set(prepared) == {"llm.model.lm_head.weight"}  # the tied text head, dropped
    assert state_dict_shapes(prepared) == state_dict_shapes(CosyVoice3LM(cv3_model.config.llm).state_dict())


@pytest.mark.parametrize("run", RUNS)
def test_reference_decoding(cv3_model, ref: dict[str, torch.Tensor], run: str) -> None:
    llm = cv3_model.llm
    text, prompt_text, prompt_speech = _inputs(ref, run)
    stops = llm.config.stop_token_ids
    with torch.inference_mode():
        rows = llm.prefill_ids(text, prompt_text, prompt_speech)
        lm_input = llm.prefill_embeddings(text, prompt_text, prompt_speech)
        input_diff = max_diff(f"{run}lm_input", lm_input, ref[f"{run}lm_input"])

        logps, tokens, cache, x = [], [], None, lm_input
        for _ in range(STEPS):  # the reference's loop: greedy after masking every stop id
            logp, cache = llm.step(x, cache)
            logps.append(logp[0])
            tokens.append(greedy_sampling(logp[0], stops))
            x = llm.embed_speech([tokens[-1]])
        step_diff = max_diff(f"{run}step_logp", torch.stack(logps), ref[f"{run}step_logp"])

        full = torch.cat((lm_input, llm.embed_speech(ref[f"{run}tokens"][:-1])), dim=1)
        logp_full = llm(full).log_softmax(dim=-1)[0, lm_input.shape[1] - 1 :]
        nocache_diff = max_diff(f"{run}nocache_logp", logp_full, ref[f"{run}nocache_logp"])

    assert rows == [tuple(r) for r in ref[f"{run}lm_input_rows"].tolist()]
    assert input_diff <= ATOL and step_diff <= ATOL and nocache_diff <= ATOL
    assert tokens == ref[f"{run}tokens"].tolist()


def test_meta_build_and_assign_load(cv3_model, official_sd: dict[str, torch.Tensor],
                                    ref: dict[str, torch.Tensor]) -> None:
    """Built on the meta device and loaded with assign=True, the LM needs no other state (no buffers)."""
    with torch.device("meta"):
        meta = CosyVoice3LM(cv3_model.config.llm)
    meta.load_state_dict(prepare_official_state_dict(official_sd), strict=True, assign=True)
    assert not list(meta.buffers())
    with torch.inference_mode():
        x = meta.prefill_embeddings(ref["text"], ref["prompt_text"], ref["prompt_speech_token"])
        assert torch.equal(meta.step(x, None)[0], cv3_model.llm.step(x, None)[0])
