"""CosyVoice 3 streaming token2wav vs the official `CosyVoice3Model.tts` (compat_cv3 ref_stream).

The call schedule (tokens, offsets, flags), every call's flow mel, the mel the vocoder re-runs over, its waveform
and the yielded chunk, the source, the one-shot path, and the silent-token filter of `llm_job`.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from cv3_support import ATOL, cv3_reference, max_diff

from vocalis.config import StreamConfig
from vocalis.config.cv3 import CV3_SILENT_TOKEN_IDS
from vocalis.reference.cv3 import stream_token2wav
from vocalis.token2wav.cv3.schedule import FlowCall, StreamSchedule, keep_token, schedule_calls


@pytest.fixture(scope="module")
def ref(cv3_dir: Path) -> dict[str, torch.Tensor]:
    return cv3_reference(cv3_dir, "ref_stream")


def _recorded_calls(ref: dict[str, torch.Tensor]) -> list[FlowCall]:
    return [
        FlowCall(int(n), int(o), bool(s), bool(f))
        for n, o, s, f in zip(ref["call_n_tokens"], ref["call_token_offset"], ref["call_streaming"],
                              ref["call_finalize"])
    ]


def test_schedule(ref: dict[str, torch.Tensor]) -> None:
    assert schedule_calls(ref["prompt_token"].shape[1], ref["token"].shape[1], StreamConfig()) == _recorded_calls(ref)


def test_schedule_waits_for_tokens() -> None:
    """Tokens arriving one by one give the same calls as all at once, each as soon as its tokens exist."""
    config = StreamConfig()
    calls, schedule = [], StreamSchedule.start(7, config)
    for available in range(211):
        call, schedule = schedule.advance(available, available == 210, config)
        if call is not None:
            assert call.finalize or call.num_tokens == available
            calls.append(call)
    assert calls == schedule_calls(7, 210, config)


def test_stream(cv3_model, ref: dict[str, torch.Tensor]) -> None:
    """One run of the batch-1 driver; the flow output of every call is captured at the decoder."""
    flow, hift = cv3_model.flow, cv3_model.hift
    num_prompt_frames = ref["prompt_feat"].shape[1]
    flow_mels: list[torch.Tensor] = []
    handle = flow.decoder.register_forward_hook(lambda _m, _a, out: flow_mels.append(out[:, :, num_prompt_frames:]))
    try:
        chunks = list(stream_token2wav(flow, hift, ref["token"], ref["prompt_token"], ref["prompt_feat"],
                                       ref["embedding"], StreamConfig()))
    finally:
        handle.remove()
    calls = _recorded_calls(ref)
    assert len(chunks) == len(flow_mels) == len(calls)
    diffs, kept = [], None
    for k, call in enumerate(calls):
        diffs.append(max_diff(f"flow_mel_{k}", flow_mels[k], ref[f"flow_mel_{k}"]))
        new = flow_mels[k][:, :, 2 * call.token_offset :]
        kept = new if kept is None else torch.cat((kept, new), dim=2)
        diffs.append(max_diff(f"hift_in_mel_{k}", kept, ref[f"hift_in_mel_{k}"]))
        diffs.append(max_diff(f"chunk_speech_{k}", chunks[k], ref[f"chunk_speech_{k}"]))
        # the vocoder output of call k covers the utterance so far: the chunks yielded up to k
        diffs.append(max_diff(f"hift_out_speech_{k}", torch.cat(chunks[: k + 1], dim=1), ref[f"hift_out_speech_{k}"]))
        with torch.inference_mode():  # the source of every call is a prefix of the last one
            f0 = hift.f0(kept, finalize=call.finalize)
            source = hift.source(f0, kept.dtype)
        assert source.shape[2] == int(ref["call_source_len"][k])
        diffs.append(max_diff(f"source_{k}", source, ref["hift_source_last"][:, :, : source.shape[2]]))
    assert max(diffs) <= ATOL
    # the last call is the one-shot flow call (all tokens, streaming=False, finalize=True)
    assert max_diff("full_flow_mel", flow_mels[-1], ref["full_flow_mel"]) <= ATOL
    with torch.inference_mode():
        speech, _ = hift.inference(flow_mels[-1], finalize=True)
    assert max_diff("full_speech", speech, ref["full_speech"]) <= ATOL


def test_silent_token_filter(ref: dict[str, torch.Tensor]) -> None:
    assert [t for t in CV3_SILENT_TOKEN_IDS if t < 300] == ref["silent_tokens"].tolist()
    kept, run = [], 0
    for token in ref["silent_filter_in"].tolist():
        keep, run = keep_token(token, run)
        if keep:
            kept.append(token)
    assert kept == ref["silent_filter_out"].tolist()
