"""The streaming token2wav path against the official `CosyVoice2Model.tts(stream=True)` recording."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from conftest import load_reference
from vocalis.reference.token2wav import FlowPrompt, Token2Wav

ATOL = 1e-4


@pytest.fixture(scope="module")
def token2wav(compat_model) -> Token2Wav:
    return Token2Wav(compat_model.flow, compat_model.hift)  # modules from the official-layout loader


def test_streaming_schedule_and_audio_match_official(token2wav: Token2Wav, compat_dir: Path) -> None:
    ref = load_reference(compat_dir, "ref_stream")
    prompt = FlowPrompt(ref["prompt_token"], ref["prompt_feat"], ref["embedding"])
    tokens = ref["token"]
    calls: list[tuple[int, int, bool, bool]] = []
    flow_outputs: list[torch.Tensor] = []
    hift_inputs: list[torch.Tensor] = []

    flow_inference = token2wav.flow.inference
    hift_inference = token2wav.hift.inference

    def record_flow(**kw):  # observe the calls the pipeline makes; results are untouched
        out = flow_inference(**kw)
        calls.append((kw["token"].shape[1], 0, kw["streaming"], kw["finalize"]))
        flow_outputs.append(out)
        return out

    def record_hift(mel, cache_source=None, generator=None):
        hift_inputs.append(mel)
        return hift_inference(mel, cache_source=cache_source, generator=generator)

    token2wav.flow.inference = record_flow  # type: ignore[method-assign]
    token2wav.hift.inference = record_hift  # type: ignore[method-assign]
    try:
        torch.manual_seed(int(ref["rng_seed"]))
        state = token2wav.new_state(prompt)
        chunks, offsets = [], []
        n = tokens.shape[1]
        # tokens are all present from the start (voice-conversion entry), as in the recording
        while token2wav.ready(state, n):
            offsets.append(state.token_offset)
            chunks.append(token2wav.stream_step(state, tokens))
        offsets.append(state.token_offset)
        chunks.append(token2wav.finish(state, tokens))
    finally:
        del token2wav.flow.inference, token2wav.hift.inference

    assert [c[0] for c in calls] == ref["call_n_tokens"].tolist()
    assert offsets == ref["call_token_offset"].tolist()
    assert [c[2] for c in calls] == ref["call_streaming"].tolist()
    assert [c[3] for c in calls] == ref["call_finalize"].tolist()
    worst = 0.0
    for k, chunk in enumerate(chunks):
        for got, key in ((flow_outputs[k], f"flow_mel_{k}"), (hift_inputs[k], f"hift_in_mel_{k}"),
                         (chunk, f"chunk_speech_{k}")):
            assert got.shape == ref[key].shape, key
            diff = (got - ref[key]).abs().max().item()
            worst = max(worst, diff)
            assert diff <= ATOL, f"{key}: max abs diff {diff:.2e}"
    print(f"ref_stream max abs diff {worst:.2e}")
