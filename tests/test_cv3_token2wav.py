"""Batched streaming token2wav for CosyVoice 3 (`token2wav/cv3.py`) on the compat_cv3 fixture: chunked output equals
the batch-1 reference (`reference.cv3.stream_token2wav`, itself equal to the official recording ref_stream), tokens
arriving one by one give the same chunks, a padded batch of different requests equals each alone, the one-shot
path equals the official full_speech, and LLM ids pass the silent-token filter. Tolerance: fp32, 1e-4 abs on audio
(measured: ~1e-6; the batched GEMMs of a padded solve round differently from batch 1)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from cv3_support import ATOL, cv3_reference, max_diff

from vocalis.config import StreamConfig
from vocalis.config.cv3 import CV3_SILENT_TOKEN_IDS
from vocalis.frontend.prompt import FlowPrompt
from vocalis.reference.cv3 import stream_token2wav
from vocalis.token2wav.config import Token2WavConfig
from vocalis.token2wav.cv3 import CV3StreamState, CV3Token2WavEngine
from vocalis.token2wav.cv3.dit import cache_bytes_per_frame, cache_bytes_per_stream
from vocalis.token2wav.cv3.schedule import schedule_calls
from vocalis.token2wav.cv3.vocoder import left_context_frames

OFFICIAL = Token2WavConfig(final_attention="full")  # the official last call (full attention), as `TTS` runs it


@pytest.fixture(scope="module")
def ref(cv3_dir: Path) -> dict[str, torch.Tensor]:
    return cv3_reference(cv3_dir, "ref_stream")


@pytest.fixture(scope="module")
def engine(cv3_model) -> CV3Token2WavEngine:
    return CV3Token2WavEngine(cv3_model.flow, cv3_model.hift, OFFICIAL)


def _prompt(ref: dict[str, torch.Tensor], n: int | None = None) -> FlowPrompt:
    n = ref["prompt_token"].shape[1] if n is None else n
    return FlowPrompt(ref["prompt_token"][:, :n], ref["prompt_feat"][:, : 2 * n], ref["embedding"])


def _run(engine: CV3Token2WavEngine, states: list[CV3StreamState], feed: dict[str, list[int]] | None = None,
         one_by_one: bool = False) -> dict[str, list[np.ndarray]]:
    """Step until every state is done; tokens either given up front or one per round (then input ends)."""
    out: dict[str, list[np.ndarray]] = {s.request_id: [] for s in states}
    pending = {s.request_id: list((feed or {}).get(s.request_id, [])) for s in states}
    while not all(s.finished for s in states):
        for s in states:
            left = pending[s.request_id]
            if left and one_by_one:
                s.add_source_tokens([left.pop(0)])
            elif left:
                s.add_source_tokens(left)
                left.clear()
            if not left and not s.input_done:
                s.end_input()
        ready = [s for s in states if engine.next_work(s) is not None]
        for chunk in engine.step(ready):
            out[chunk.request_id].append(chunk.samples)
    return out


def _reference(cv3_model, ref, tokens: torch.Tensor, prompt: FlowPrompt, streaming: bool = True) -> list[torch.Tensor]:
    return list(stream_token2wav(cv3_model.flow, cv3_model.hift, tokens, prompt.speech_ids, prompt.mel,
                                 prompt.embedding, StreamConfig(), streaming=streaming))


def _compare(name: str, got: list[np.ndarray], want: list[torch.Tensor]) -> float:
    assert [len(g) for g in got] == [w.shape[1] for w in want], name
    return max(max_diff(f"{name} chunk {k}", torch.from_numpy(g)[None], w) for k, (g, w) in enumerate(zip(got, want)))


def test_chunks_equal_the_reference_tokens_whole_or_one_by_one(engine, cv3_model, ref) -> None:
    """70 tokens after a 7-token prompt: a first chunk of 25 + 18 (prompt padding) tokens, then the final rest."""
    prompt, tokens = _prompt(ref), ref["token"][:, :70]
    want = _reference(cv3_model, ref, tokens, prompt)
    assert len(want) == 2
    whole = _run(engine, [engine.new_stream("w", prompt)], {"w": tokens[0].tolist()})["w"]
    assert _compare("engine vs reference", whole, want) <= ATOL
    trickled = _run(engine, [engine.new_stream("t", prompt)], {"t": tokens[0].tolist()}, one_by_one=True)["t"]
    for a, b in zip(whole, trickled, strict=True):
        np.testing.assert_array_equal(a, b)


def test_batched_equals_alone(engine, cv3_model, ref) -> None:
    """Three requests of different prompts and lengths in one engine, reaching their chunks in different steps
    (streaming and final flow calls in one padded solve), each equal to the reference of it alone."""
    cases = {"long": (None, 50), "short-prompt": (3, 52), "no-prompt": (0, 12)}
    feed = {k: ref["token"][0, :n].tolist() for k, (_, n) in cases.items()}
    states = [engine.new_stream(k, _prompt(ref, p)) for k, (p, _) in cases.items()]
    together = _run(engine, states, feed, one_by_one=True)
    worst = 0.0
    for k, (p, n) in cases.items():
        want = _reference(cv3_model, ref, ref["token"][:, :n], _prompt(ref, p))
        worst = max(worst, _compare(f"{k} vs reference", together[k], want))
    assert [len(together[k]) for k in cases] == [2, 2, 1]
    print(f"[cv3 token2wav] batched vs alone (reference): max abs diff {worst:.3e}")
    assert worst <= ATOL


def test_one_shot_equals_the_reference(engine, cv3_model, ref) -> None:
    prompt, tokens = _prompt(ref), ref["token"][:, :60]
    got = _run(engine, [engine.new_stream("full", prompt, streaming=False)], {"full": tokens[0].tolist()})["full"]
    assert _compare("one-shot", got, _reference(cv3_model, ref, tokens, prompt, streaming=False)) <= ATOL


def test_silent_filter_and_empty_input(engine, ref) -> None:
    s = engine.new_stream("f", _prompt(ref))
    s.add_tokens(ref["silent_filter_in"].tolist())
    assert s.tokens == ref["silent_filter_out"].tolist()
    s.add_source_tokens([CV3_SILENT_TOKEN_IDS[0]] * 8)  # given ids are not filtered
    assert s.tokens[-8:] == [CV3_SILENT_TOKEN_IDS[0]] * 8
    empty = engine.new_stream("e", _prompt(ref))
    empty.end_input()
    (chunk,) = engine.step([empty])
    assert chunk.final and len(chunk.samples) == 0 and empty.finished


def test_max_batch_leaves_the_rest_for_the_next_step(cv3_model, ref) -> None:
    eng = CV3Token2WavEngine(cv3_model.flow, cv3_model.hift, Token2WavConfig(max_batch=1))
    states = [eng.new_stream(f"r{i}", _prompt(ref)) for i in range(2)]
    for s in states:
        s.add_source_tokens(ref["token"][0, :10].tolist())
        s.end_input()
    assert [c.request_id for c in eng.step(states)] == ["r0"]
    assert [c.request_id for c in eng.step(states)] == ["r1"]


def test_cached_streaming_equals_the_reference_in_fewer_frames(cv3_model, ref) -> None:
    """210 tokens: three streaming calls (43, 50 and 100 tokens) and the final one (190 tokens after a 3-token
    prompt: two streaming calls and the final one). With the DiT caches a call
    runs only its new frames; two requests of different prompts batched, and each alone, equal the reference
    (exact caches, the default: fp32 rounding only); bf16-stored caches stay within 1e-3; the estimator sees fewer frames
    than recomputing (max_cache_mib=0, the reference's cost), and every cache is released at the end."""
    cases = {"long": (None, 210), "short-prompt": (3, 190)}
    feed = {k: ref["token"][0, :n].tolist() for k, (_, n) in cases.items()}
    want = {k: _reference(cv3_model, ref, ref["token"][:, :n], _prompt(ref, p)) for k, (p, n) in cases.items()}
    runs = {}
    for name, config in (("exact", OFFICIAL), ("bf16", replace(OFFICIAL, dit_cache_dtype="bf16")),
                         ("recompute", replace(OFFICIAL, max_cache_mib=0))):
        eng = CV3Token2WavEngine(cv3_model.flow, cv3_model.hift, config)
        states = [eng.new_stream(k, _prompt(ref, p)) for k, (p, _) in cases.items()]
        out = _run(eng, states, feed, one_by_one=name == "exact")  # (the others: every token at once)
        runs[name] = (out, {s.request_id: s.estimator_frames for s in states})
        assert all(s.finished and not s.dit for s in states) and eng.live_cache_bytes() == 0
    assert [len(want[k]) for k in cases] == [4, 3]  # the second streaming call on reads the caches
    for k in cases:
        assert _compare(f"{k} cached vs reference", runs["exact"][0][k], want[k]) <= ATOL
        assert _compare(f"{k} recomputed vs reference", runs["recompute"][0][k], want[k]) <= ATOL
        assert _compare(f"{k} bf16 cache vs reference", runs["bf16"][0][k], want[k]) <= 1e-3
        p = ref["prompt_token"].shape[1] if cases[k][0] is None else cases[k][0]
        frames = [2 * (p + c.num_tokens - 3) for c in schedule_calls(p, cases[k][1], StreamConfig()) if c.streaming]
        saved = sum(frames[:-1]) * cv3_model.flow.config.cfm.n_timesteps  # earlier calls' frames, not rerun
        assert runs["exact"][1][k] == runs["recompute"][1][k] - saved and saved > 0
    alone = CV3Token2WavEngine(cv3_model.flow, cv3_model.hift, OFFICIAL)
    got = _run(alone, [alone.new_stream("long", _prompt(ref))], {"long": feed["long"]})["long"]
    assert _compare("cached alone vs reference", got, want["long"]) <= ATOL


def test_caches_no_call_reads_are_not_kept(cv3_model, ref) -> None:
    """With the whole input given up front, the call before the final full pass keeps no caches and the earlier
    ones are dropped after it: the most a request holds is its first call's caches, not its last's as when fed
    token by token; the audio is the reference's either way."""
    prompt, tokens = _prompt(ref), ref["token"][0, :210].tolist()
    want = _reference(cv3_model, ref, ref["token"][:, :210], prompt)
    most = {}
    for one_by_one in (False, True):
        eng = CV3Token2WavEngine(cv3_model.flow, cv3_model.hift, OFFICIAL)
        s = eng.new_stream("r", prompt)
        out: list[np.ndarray] = []
        most[one_by_one] = 0
        fed = 0
        while not s.finished:
            if not s.input_done:
                step = 1 if one_by_one else len(tokens)
                s.add_source_tokens(tokens[fed : fed + step])
                fed += step
                if fed >= len(tokens):
                    s.end_input()
            out += [c.samples for c in eng.step([s])]
            most[one_by_one] = max(most[one_by_one], s.cache_bytes())
        assert _compare(f"one_by_one={one_by_one}", out, want) <= ATOL and s.cache_bytes() == 0
    assert 0 < most[False] < most[True]


def test_cache_budget_recomputes_the_largest(cv3_model, ref) -> None:
    """Room for one request's caches (~12 MB at its third call, here 16 MiB): when both grow past it, one drops
    its caches and recomputes its later calls; both give the reference's audio."""
    prompt, tokens = _prompt(ref), ref["token"][0, :210].tolist()
    eng = CV3Token2WavEngine(cv3_model.flow, cv3_model.hift, replace(OFFICIAL, max_cache_mib=16))
    states = [eng.new_stream(f"r{i}", prompt) for i in range(2)]
    # tokens one by one: with all of them given up front the last call before the final full pass keeps nothing
    out = _run(eng, states, {"r0": tokens, "r1": tokens}, one_by_one=True)
    assert sorted(s.cached for s in states) == [False, True]
    want = _reference(cv3_model, ref, ref["token"][:, :210], prompt)
    for s in states:
        assert _compare(s.request_id, out[s.request_id], want) <= ATOL


def test_voice_prefix_is_computed_once_and_equals_the_reference(cv3_model, ref) -> None:
    """A 40-token prompt: its first 50 frames (one attention block ending by frame 2 (40 - 3)) are the voice's
    prefix, computed on its first use and continued by every request of that voice; with it the first call runs
    only its other frames. Two requests of one voice and one of another (batched) equal the reference."""
    g = torch.Generator().manual_seed(7)
    vocab = cv3_model.flow.input_embedding.num_embeddings
    voices = [FlowPrompt(torch.randint(0, vocab, (1, 40), generator=g, dtype=torch.int32),
                         torch.randn(1, 80, 80, generator=g) * 0.5, torch.randn(1, 192, generator=g))
              for _ in range(2)]
    eng = CV3Token2WavEngine(cv3_model.flow, cv3_model.hift, OFFICIAL)
    assert eng.prefix_frames(40) == 50
    plan = {"a0": (0, 120), "a1": (0, 150), "b0": (1, 120)}
    states = [eng.new_stream(k, voices[v]) for k, (v, _) in plan.items()]
    feed = {k: ref["token"][0, 5 : 5 + n].tolist() for k, (_, n) in plan.items()}
    got = _run(eng, states, feed, one_by_one=True)
    assert len(eng._voices) == 2
    steps = cv3_model.flow.config.cfm.n_timesteps
    for s, (k, (v, n)) in zip(states, plan.items()):
        want = _reference(cv3_model, ref, ref["token"][:, 5 : 5 + n], voices[v])
        assert len(want) == 3
        assert _compare(f"{k} vs reference", got[k], want) <= ATOL
        calls = [c for c in schedule_calls(40, n, StreamConfig()) if c.streaming]
        last_frames = 2 * (40 + calls[-1].num_tokens - 3)
        final_frames = 2 * (40 + n)
        assert s.estimator_frames == (last_frames - 50 + final_frames) * steps  # the prefix not rerun


def test_causal_final_call_is_linear(cv3_model, ref) -> None:
    """final_attention="causal": the last call also runs over its new frames only (block-causal, keeping
    nothing), so every frame goes through the estimator once; the chunks before it equal the reference's, the
    last keeps its length and differs from the official full-attention pass by design (printed)."""
    prompt, n = _prompt(ref), 210
    tokens = ref["token"][0, :n].tolist()
    eng = CV3Token2WavEngine(cv3_model.flow, cv3_model.hift, Token2WavConfig(final_attention="causal"))
    state = eng.new_stream("causal", prompt)
    got = _run(eng, [state], {"causal": tokens})["causal"]
    want = _reference(cv3_model, ref, ref["token"][:, :n], prompt)
    assert [len(g) for g in got] == [w.shape[1] for w in want]
    assert _compare("causal final: earlier chunks", got[:-1], want[:-1]) <= ATOL
    final = float(np.abs(got[-1] - want[-1].numpy()[0]).max())
    print(f"[cv3 token2wav] causal final chunk vs the official full-attention one: max abs diff {final:.3e}")
    assert 0 < final and np.isfinite(got[-1]).all()
    p = prompt.speech_ids.shape[1]
    assert state.estimator_frames == 2 * (p + n) * cv3_model.flow.config.cfm.n_timesteps  # each frame once


def test_vocoder_decodes_a_window_with_the_full_rerun_samples(cv3_model, ref, monkeypatch) -> None:
    """The causal HiFT decodes each call's new frames plus `left_context_frames` before them: the samples equal
    the official re-run over all mel so far (`vocoder_window=False`), the decoder sees fewer frames (each call at
    most its new frames, the context and the look-ahead), and a context cut short changes the samples, so the
    bound is what keeps them equal."""
    prompt, n = _prompt(ref), 210
    tokens = ref["token"][0, :n].tolist()
    runs = {}
    for name, window in (("window", True), ("rerun", False)):
        eng = CV3Token2WavEngine(cv3_model.flow, cv3_model.hift, replace(OFFICIAL, vocoder_window=window))
        state = eng.new_stream(name, prompt)
        runs[name] = (_run(eng, [state], {name: tokens})[name], state.vocoder_frames)
    (win, win_frames), (full, full_frames) = runs["window"], runs["rerun"]
    assert len(win) == 4 and [len(a) for a in win] == [len(b) for b in full]
    worst = max(float(np.abs(a - b).max()) for a, b in zip(win, full))
    print(f"[cv3 token2wav] windowed vocoder vs re-run: max abs diff {worst:.3e}, frames {win_frames} vs {full_frames}")
    assert worst <= 1e-6
    hift = cv3_model.hift.config
    context = left_context_frames(hift)
    total = 2 * (prompt.speech_ids.shape[1] + n)  # all mel frames of the utterance, prompt included
    assert win_frames <= total + len(win) * (context + hift.conv_pre_look_right + 1) < full_frames

    monkeypatch.setattr("vocalis.token2wav.cv3.vocoder.left_context_frames", lambda config: 4)
    eng = CV3Token2WavEngine(cv3_model.flow, cv3_model.hift, OFFICIAL)
    short = _run(eng, [eng.new_stream("short", prompt)], {"short": tokens})["short"]
    assert max(float(np.abs(a - b).max()) for a, b in zip(short, full)) > 1e-4


def test_new_streams_wait_for_cache_room(cv3_model, ref) -> None:
    """`wait_for_cache` with room for one stream's caches (8 MiB; a 140-token stream peaks at 200 frames, ~6 MiB):
    three ready streams start one after another while the caller has other work (`hold_new`): none recomputes,
    the caches never pass the budget, each stream's audio equals the reference. Without `hold_new` a step with
    nothing else to do starts a waiting stream anyway (no stream waits on an idle engine), with the same audio.
    Without `wait_for_cache` all three start at once (a step of 3) and one of them recomputes (the call before
    the final full pass keeps nothing, so only the first call's caches count)."""
    prompt, tokens = _prompt(ref), ref["token"][0, :140].tolist()
    want = _reference(cv3_model, ref, ref["token"][:, :140], prompt)
    assert len(want) == 3
    for hold, wait in ((True, True), (False, True), (True, False)):
        eng = CV3Token2WavEngine(cv3_model.flow, cv3_model.hift,
                                 replace(OFFICIAL, max_cache_mib=8, wait_for_cache=wait, max_batch=3))
        states = [eng.new_stream(f"r{i}", prompt) for i in range(3)]
        for s in states:
            s.add_source_tokens(tokens)
            s.end_input()
        out: dict[str, list[np.ndarray]] = {s.request_id: [] for s in states}
        peak = held = 0
        for _ in range(100):
            if all(s.finished for s in states):
                break
            for chunk in eng.step(states, hold_new=hold):
                out[chunk.request_id].append(chunk.samples)
            peak, held = max(peak, eng.live_cache_bytes()), max(held, eng.held)
        for s in states:
            assert _compare(f"{s.request_id} hold_new={hold}", out[s.request_id], want) <= ATOL
        assert (held > 0) == wait and eng.held == 0 and eng.live_cache_bytes() == 0
        if not wait:
            assert sorted(s.cached for s in states) == [False, True, True]
        elif hold:
            assert all(s.cached for s in states) and peak <= eng.cache_budget


def test_voice_prefix_is_read_in_place(cv3_model, ref) -> None:
    """Two requests of one voice after their first calls: both continue the voice's one prefix (the same tensors),
    each holds only its own frames after it, and the live cache bytes count the prefix once."""
    g = torch.Generator().manual_seed(7)
    vocab = cv3_model.flow.input_embedding.num_embeddings
    voice = FlowPrompt(torch.randint(0, vocab, (1, 40), generator=g, dtype=torch.int32),
                       torch.randn(1, 80, 80, generator=g) * 0.5, torch.randn(1, 192, generator=g))
    eng = CV3Token2WavEngine(cv3_model.flow, cv3_model.hift, OFFICIAL)
    states = [eng.new_stream(f"v{i}", voice) for i in range(2)]
    for i, s in enumerate(states):
        s.add_source_tokens(ref["token"][0, i : i + 40].tolist())
    assert len(eng.step(states)) == 2
    (entry,) = eng._voices.values()
    per_step = cache_bytes_per_frame(cv3_model.flow.estimator, torch.float32)
    for s in states:
        assert all(c.prefix is p for c, p in zip(s.dit, entry, strict=True))
        # the first call: 25 + 10 (prompt padding) + 3 tokens -> 2 (40 + 38 - 3) = 150 frames, the prefix's 50 shared
        assert all(c.num_frames == 150 and k.shape[1] == 100 for c in s.dit for k in c.keys)
        assert s.cache_bytes() == len(s.dit) * (100 * per_step + cache_bytes_per_stream(cv3_model.flow.estimator))
    prefix = sum(p.nbytes() for p in entry)
    assert eng.live_cache_bytes() == prefix + sum(s.cache_bytes() for s in states)
