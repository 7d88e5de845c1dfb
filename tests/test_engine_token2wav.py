"""Batched, cached token2wav engine against the reference streaming path (tiny preset, random weights)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from vocalis.config import PRESETS
from vocalis.models.flow.flow import CausalMaskedDiffWithXvec
from vocalis.models.hift.generator import HiFTGenerator
from vocalis.reference.token2wav import FlowPrompt, Token2Wav
from vocalis.token2wav.config import Token2WavConfig
from vocalis.token2wav.cv2.engine import Token2WavEngine
from vocalis.token2wav.cv2.state import StreamState

ATOL = 1e-5  # audio samples in [-1, 1]; measured ~1e-7 (float summation order only)
EXACT = Token2WavConfig(cache_dtype=None)  # fp32 caches: equal to the reference up to summation order
P, N = 35, 100  # prompt tokens (25 of them cacheable), generated tokens: chunks of 40 and 50, then a final 10


@pytest.fixture(scope="module")
def modules() -> tuple[CausalMaskedDiffWithXvec, HiFTGenerator]:
    cfg = PRESETS["tiny"]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return CausalMaskedDiffWithXvec(cfg.flow).eval(), HiFTGenerator(cfg.hift).eval()


def _prompt(num_tokens: int, seed: int) -> FlowPrompt:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 6561, (1, num_tokens), generator=g, dtype=torch.int32)
    return FlowPrompt(ids, torch.randn(1, 2 * num_tokens, 80, generator=g), torch.randn(1, 192, generator=g))


def _tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, 6561, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


class _Counter:
    """Counts estimator frames (x Euler steps, per request) on the reference path."""

    def __init__(self, est: torch.nn.Module) -> None:
        self.frames = 0
        self.handle = est.register_forward_hook(self._hook)

    def _hook(self, module: torch.nn.Module, args: tuple, out: torch.Tensor) -> None:
        self.frames += out.shape[0] // 2 * out.shape[-1]


def _reference(modules, prompt: FlowPrompt, tokens: list[int], seed: int, final_streaming: bool = False,
               speed: float = 1.0) -> tuple[list[np.ndarray], list[int], int]:
    """The reference streaming loop (tokens arrive one at a time) -> chunks, hops, estimator frames."""
    t2w = Token2Wav(*modules)
    if final_streaming:  # the reference with block-causal masks on its last call too
        flow_call = t2w._flow
        t2w._flow = lambda tok, pr, streaming, finalize: flow_call(tok, pr, True, finalize)  # type: ignore[method-assign]
    counter = _Counter(modules[0].decoder.estimator)
    try:
        state = t2w.new_state(prompt, torch.Generator().manual_seed(seed))
        ids = torch.tensor([tokens], dtype=torch.int32)
        out = []
        for i in range(1, len(tokens) + 1):
            if t2w.ready(state, i):
                out.append(t2w.stream_step(state, ids[:, :i], speed)[0].numpy())
        out.append(t2w.finish(state, ids, speed)[0].numpy())
    finally:
        counter.handle.remove()
    return out, state.hops, counter.frames


def _drive(engine: Token2WavEngine, states: list[StreamState], tokens: list[list[int]], rates: list[int],
           hold_new: bool = False, peak: list[int] | None = None) -> dict[str, list[np.ndarray]]:
    """Feed each request `rate` tokens per step (end_input when all are in) until every request is finished;
    `peak` collects the cache bytes held after each step."""
    out: dict[str, list[np.ndarray]] = {s.request_id: [] for s in states}
    fed = [0] * len(states)
    while not all(s.finished for s in states):
        for i, s in enumerate(states):
            if not s.input_done:
                s.add_tokens(tokens[i][fed[i] : fed[i] + rates[i]])
                fed[i] += rates[i]
                if fed[i] >= len(tokens[i]):
                    s.end_input()
        for chunk in engine.step(states, hold_new=hold_new and not all(s.input_done for s in states)):
            out[chunk.request_id].append(chunk.samples)
        if peak is not None:
            peak.append(engine.live_cache_bytes())
    return out


def _assert_chunks_equal(got: list[np.ndarray], want: list[np.ndarray]) -> float:
    assert [len(g) for g in got] == [len(w) for w in want]
    worst = max(float(np.abs(g - w).max()) if len(g) else 0.0 for g, w in zip(got, want))
    assert worst <= ATOL, worst
    return worst


SPECS: list[tuple[str, FlowPrompt, list[int], bool, float, int]] = [
    # name, prompt, tokens, streaming, speed, tokens fed per step
    ("zero-shot", _prompt(P, 1), _tokens(N, 2), True, 1.0, 1),
    ("sft", _prompt(0, 5), _tokens(80, 6), True, 1.0, 5),
    ("short-prompt", _prompt(12, 8), _tokens(70, 9), True, 1.25, 70),
    ("offline", _prompt(30, 10), _tokens(40, 11), False, 1.0, 40),
]


def _make(engine: Token2WavEngine, spec) -> StreamState:
    name, prompt, _, streaming, speed, _ = spec
    return engine.new_stream(name, prompt, streaming=streaming, speed=speed,
                             generator=torch.Generator().manual_seed(len(name)))


@pytest.fixture(scope="module")
def alone(modules) -> dict[str, tuple[list[np.ndarray], StreamState]]:
    """Each spec on its own fresh engine (causal final, voice cache on, exact caches)."""
    out = {}
    for spec in SPECS:
        engine = Token2WavEngine(*modules, EXACT)
        state = _make(engine, spec)
        out[spec[0]] = (_drive(engine, [state], [spec[2]], [spec[5]])[spec[0]], state)
    return out


@pytest.fixture(scope="module")
def reference_runs(modules) -> dict[str, tuple[list[np.ndarray], list[int], int]]:
    prompt, tokens = SPECS[0][1], SPECS[0][2]
    seed = len(SPECS[0][0])
    return {
        "full": _reference(modules, prompt, tokens, seed),
        "causal": _reference(modules, prompt, tokens, seed, final_streaming=True),
    }


def _check_against_reference(got: list[np.ndarray], state: StreamState, want, mode: str, reference_runs) -> None:
    chunks, hops, _ = want
    assert state.hops == hops == [40, 50]
    _assert_chunks_equal(got, chunks)
    assert state.finished and state.enc_cache is None and not state.est_caches  # caches released
    # Seams: the same samples as the reference on both sides of every seam, so no jump beyond its own.
    got_wav, want_wav = np.concatenate(got), np.concatenate(chunks)
    seams = np.cumsum([len(c) for c in got[:-1]])
    assert np.all(np.abs(np.diff(got_wav)[seams - 1]) <= np.abs(np.diff(want_wav)[seams - 1]) + 2 * ATOL)
    if mode == "causal":  # its non-final chunks are also the full-attention reference's
        _assert_chunks_equal(got[:-1], reference_runs["full"][0][:-1])


def test_streaming_causal_final_matches_reference(alone, reference_runs) -> None:
    """Default final_attention="causal": equal to the reference run with block-causal masks on its last call
    too; non-final chunks equal the plain reference's."""
    got, state = alone["zero-shot"]
    _check_against_reference(got, state, reference_runs["causal"], "causal", reference_runs)


def test_streaming_full_final_matches_reference(modules, reference_runs) -> None:
    """final_attention="full": every chunk equals the reference's, the last one included."""
    spec = SPECS[0]
    engine = Token2WavEngine(*modules, Token2WavConfig(final_attention="full", cache_dtype=None))
    state = _make(engine, spec)
    got = _drive(engine, [state], [spec[2]], [spec[5]])[spec[0]]
    _check_against_reference(got, state, reference_runs["full"], "full", reference_runs)


def test_caches_no_chunk_reads_are_not_kept(modules, reference_runs) -> None:
    """final_attention="full" with the whole input given up front: the chunk before the final full pass keeps no
    caches and the earlier chunk's are dropped after it (the voice's prefix alone stays), with the reference's
    audio. Fed token by token, the input ends after that chunk, so it extends its caches like any other."""
    spec = SPECS[0]
    for rate in (len(spec[2]), 1):
        engine = Token2WavEngine(*modules, Token2WavConfig(final_attention="full", cache_dtype=None))
        state = _make(engine, spec)
        held: list[int] = []
        got = _drive(engine, [state], [spec[2]], [rate], peak=held)[spec[0]]
        _check_against_reference(got, state, reference_runs["full"], "full", reference_runs)
        prefix = engine.voice_cache_bytes()
        levels = [h for k, h in enumerate(held) if k == 0 or h != held[k - 1]]  # the held bytes as they changed
        own = [h - prefix for h in levels if h > prefix]  # a request's own caches after its chunks
        assert prefix > 0 and levels[-1] == prefix
        assert len(own) == (1 if rate > 1 else 2) and own == sorted(own), (rate, levels, prefix)


def test_kept_caches_live_in_one_block_per_step(modules, alone) -> None:
    """After each chunk a request's keys and values of one Euler step lie in one tensor (`cache_storage.compact`:
    out of malloc's arenas), the voice prefix's too, and the chunks are the ones a fresh engine gives alone."""
    spec = SPECS[0]
    engine = Token2WavEngine(*modules, EXACT)
    state = _make(engine, spec)
    state.add_tokens(spec[2][:60])
    got = [c.samples for c in engine.step([state])]
    assert got and state.est_caches and state.voice is not None
    for cache in [*state.est_caches, *state.voice.est]:
        storages = {t.untyped_storage().data_ptr() for t in (*cache.keys, *cache.values)}
        assert len(storages) == 1 and cache.keys
    _assert_chunks_equal(got, alone[spec[0]][0][:1])


def test_cost_is_linear_in_length(modules, alone, reference_runs) -> None:
    """Every frame after the voice prefix goes through the 10 Euler steps exactly once (so the work is linear in
    the length), while the reference re-runs every earlier frame at every chunk."""
    steps = modules[0].config.cfm.n_timesteps
    for name, prompt, tokens, streaming, _, _ in SPECS:
        state = alone[name][1]
        p = prompt.speech_ids.shape[1]
        prefix = 25 * ((p - 3) // 25) if streaming and p > 3 else 0
        assert state.estimator_frames == 2 * (p + len(tokens) - prefix) * steps, name
        assert state.encoder_tokens == (p + len(tokens) - prefix if streaming else 0), name
    ref_frames = reference_runs["causal"][2]
    assert ref_frames == 2 * steps * ((P + 40) + (P + 90) + (P + N))  # three calls over growing prefixes
    assert ref_frames > 2 * alone["zero-shot"][1].estimator_frames


def test_voice_prefix_is_shared_and_exact(modules) -> None:
    prompt, tokens = _prompt(P, 1), _tokens(45, 4)
    cached = Token2WavEngine(*modules, EXACT)
    plain = Token2WavEngine(*modules, Token2WavConfig(voice_cache_size=0, cache_dtype=None))
    outs = []
    for engine in (cached, cached, plain):
        state = engine.new_stream("a", prompt, generator=torch.Generator().manual_seed(3))
        outs.append((_drive(engine, [state], [tokens], [45])["a"], state.estimator_frames))
    assert cached.stats.voice_cache_misses == 1 and cached.stats.voice_cache_hits == 1
    assert cached.cacheable_prefix(P) == 25 and cached.cacheable_prefix(27) == 0
    steps = modules[0].config.cfm.n_timesteps
    for got, frames in outs[:2]:
        _assert_chunks_equal(got, outs[2][0])
        assert frames == outs[2][1] - 2 * 25 * steps
    assert cached.voice_cache_bytes() > 0


def test_batched_equals_one_at_a_time(modules, alone) -> None:
    """Requests with different prompts, lengths, speeds, token rates and modes, in one batch or alone."""
    engine = Token2WavEngine(*modules, EXACT)
    together = _drive(engine, [_make(engine, s) for s in SPECS], [s[2] for s in SPECS], [s[5] for s in SPECS])
    assert engine.stats.rows > engine.stats.steps  # steps really batched several requests
    for spec in SPECS:
        _assert_chunks_equal(together[spec[0]], alone[spec[0]][0])


def test_a_step_in_parts_on_core_workers_equals_one_at_a_time(modules, alone) -> None:
    """A step's requests split over two worker threads (one core each) give each request the audio it gets alone;
    two of them start from one voice in the same step (its prefix computed once, before the split)."""
    twin = ("zero-shoT", *SPECS[0][1:])  # the first request again: same voice, tokens and noise seed
    specs = [*SPECS, twin]
    engine = Token2WavEngine(*modules, replace(EXACT, workers=2, max_batch=len(specs)))
    assert engine.workers == 2
    out = _drive(engine, [_make(engine, s) for s in specs], [s[2] for s in specs], [s[5] for s in specs])
    assert engine._core_workers is not None  # steps really ran in parts
    assert engine.stats.voice_cache_misses == 1 and engine.stats.voice_cache_hits == 1  # the shared voice
    for spec in specs:
        _assert_chunks_equal(out[spec[0]], alone[SPECS[0][0] if spec is twin else spec[0]][0])


def test_a_step_takes_at_most_max_batch_and_the_rest_follow_unchanged(modules, alone) -> None:
    """More streams ready than one step takes: the rest run in the next steps, oldest first, with the same audio
    as alone."""
    engine = Token2WavEngine(*modules, replace(EXACT, max_batch=2))
    states = [_make(engine, s) for s in SPECS]
    for state, spec in zip(states, SPECS):  # every stream has its whole input: all are ready at once
        state.add_tokens(spec[2])
        state.end_input()
    first = engine.step(states)
    assert [c.request_id for c in first] == [s[0] for s in SPECS[:2]]
    out = _drive(engine, states, [s[2] for s in SPECS], [s[5] for s in SPECS])
    for chunk in first:
        out[chunk.request_id].insert(0, chunk.samples)
    for spec in SPECS:
        _assert_chunks_equal(out[spec[0]], alone[spec[0]][0])


def test_offline_request_matches_reference_offline(modules, alone) -> None:
    _, prompt, tokens, _, _, _ = SPECS[3]
    want = Token2Wav(*modules).offline(torch.tensor([tokens], dtype=torch.int32), prompt, 1.0,
                                       torch.Generator().manual_seed(len("offline")))[0].numpy()
    got = alone["offline"][0]
    assert len(got) == 1
    _assert_chunks_equal(got, [want])


def test_lifecycle(modules) -> None:
    engine = Token2WavEngine(*modules)
    state = engine.new_stream("a", _prompt(P, 1))
    assert engine.step([state]) == []  # nothing yet
    state.add_tokens(_tokens(43, 2))
    (chunk,) = engine.step([state])
    assert not chunk.final and chunk.index == 0 and state.cache_bytes() > 0
    engine.abort(state)
    assert state.finished and state.cache_bytes() == 0 and engine.step([state]) == []
    empty = engine.new_stream("b", _prompt(P, 1))
    empty.end_input()
    (chunk,) = engine.step([empty])
    assert chunk.final and chunk.samples.size == 0
    with pytest.raises(RuntimeError):
        empty.add_tokens([1])
    with pytest.raises(ValueError):
        Token2WavConfig(final_attention="sometimes")


def test_reduced_cache_dtype(modules, alone) -> None:
    """Default bf16-stored keys/values: half the cache memory; audio within 1e-3 of the exact cache [measured
    1e-7 here; mel max rel 3.6e-5 at the 0.5B shapes]."""
    spec = SPECS[0]
    engine = Token2WavEngine(*modules)
    assert engine.config.cache_dtype == "bf16"
    state = _make(engine, spec)
    state.add_tokens(spec[2][:43])
    got = [c.samples for c in engine.step([state])]
    exact = Token2WavEngine(*modules, EXACT)
    ref_state = _make(exact, spec)
    ref_state.add_tokens(spec[2][:43])
    exact.step([ref_state])
    assert state.cache_bytes() < 0.6 * ref_state.cache_bytes()
    state.add_tokens(spec[2][43:])
    state.end_input()
    while not state.finished:
        got += [c.samples for c in engine.step([state])]
    want = alone[spec[0]][0]
    assert [len(g) for g in got] == [len(w) for w in want]
    err = max(float(np.abs(g - w).max()) for g, w in zip(got, want))
    print("bf16 cache max abs error", err)
    assert err <= 1e-3


def test_cache_budget_falls_back_to_recompute(modules, alone) -> None:
    """Over budget, requests drop their caches and recompute chunks like the reference: same audio, no growth."""
    specs = SPECS[:3]
    none = Token2WavEngine(*modules, Token2WavConfig(cache_dtype=None, max_cache_mib=0))
    states = [_make(none, s) for s in specs]
    out = _drive(none, states, [s[2] for s in specs], [s[5] for s in specs])
    assert none.stats.cache_fallbacks == 3 and none.live_cache_bytes() == none.voice_cache_bytes()
    for spec, state in zip(specs, states):
        _assert_chunks_equal(out[spec[0]], alone[spec[0]][0])
        assert state.estimator_frames > alone[spec[0]][1].estimator_frames  # recomputed prefixes
    per_token = none.cache_bytes_per_token()
    steps, blocks = modules[0].config.cfm.n_timesteps, 3  # tiny estimator: 1 down + 1 mid + 1 up block
    assert per_token == 2 * blocks * 2 * 2 * 8 * steps * 4 * 2 + 2 * (1 + 1 * 2) * 64 * 4
    tight = Token2WavEngine(*modules, Token2WavConfig(cache_dtype=None, max_cache_mib=1))
    spec = SPECS[1]  # 80 tokens: chunks of 25 and 50 tokens; the second would pass 1 MiB
    state = _make(tight, spec)
    got = _drive(tight, [state], [spec[2]], [spec[5]])[spec[0]]
    assert tight.stats.cache_fallbacks == 1 and not state.cached
    _assert_chunks_equal(got, alone[spec[0]][0])


def test_new_streams_wait_for_cache_room(modules, alone) -> None:
    """With room for one stream's caches, three ready streams start one after another (first come, first served)
    while the caller has other work (`hold_new`): none recomputes, the caches never pass the budget, the audio
    equals each stream alone. Without `hold_new` a step with nothing else to do starts a waiting stream anyway
    (no stream waits on an idle engine), still with the same audio."""
    spec = SPECS[1]  # no prompt, 80 tokens: chunks of 25 and 50, then a final 5
    want = alone[spec[0]][0]
    for hold in (True, False):
        engine = Token2WavEngine(*modules, Token2WavConfig(cache_dtype=None, max_cache_mib=2, wait_for_cache=True))
        assert 75 * engine.cache_bytes_per_token() <= engine.cache_budget < 150 * engine.cache_bytes_per_token()
        states = [engine.new_stream(f"{spec[0]}{i}", spec[1], generator=torch.Generator().manual_seed(3))
                  for i in range(3)]
        peak: list[int] = []
        out = _drive(engine, states, [spec[2]] * 3, [spec[5]] * 3, hold_new=hold, peak=peak)
        for s in states:
            _assert_chunks_equal(out[s.request_id], want)
        if hold:
            assert engine.stats.cache_fallbacks == 0 and max(peak) <= engine.cache_budget
            assert all(s.cached for s in states)
        assert engine.stats.held_steps > 0 and engine.held == 0


def test_shared_prefix_streams_equal_unshared(modules) -> None:
    """Three concurrent streams of one voice read its prompt prefix from one read-only copy (stored once, never
    written) and hold only their own frames; their audio equals streams computing the whole prompt themselves
    (voice_cache_size=0) within ATOL. The prefix is reference-counted by live streams: with room for one idle
    prefix, a voice in use is kept while another is added, and dropped once its last stream ends."""
    prompt, other = _prompt(P, 1), _prompt(P, 21)
    tokens = [_tokens(45, 30 + i) for i in range(3)]
    shared = Token2WavEngine(*modules, Token2WavConfig(cache_dtype=None, voice_cache_size=1, max_batch=3))
    plain = Token2WavEngine(*modules, Token2WavConfig(cache_dtype=None, voice_cache_size=0, max_batch=3))
    runs = {}
    for name, engine in (("shared", shared), ("plain", plain)):
        states = [engine.new_stream(f"s{i}", prompt, generator=torch.Generator().manual_seed(i)) for i in range(3)]
        for s, t in zip(states, tokens):
            s.add_tokens(t[:43])  # the first chunk (40 tokens + 3 look-ahead), all three in one step
        first = engine.step(states)
        assert [c.index for c in first] == [0, 0, 0]
        runs[name] = (states, {c.request_id: [c.samples] for c in first}, [s.cache_bytes() for s in states])
    (states, out, own), (_, plain_out, plain_own) = runs["shared"], runs["plain"]
    (voice,) = shared._voices.values()
    assert shared.voice_users() == {voice.key: 3} and all(s.voice is voice for s in states)
    assert shared.stats.voice_cache_misses == 1 and shared.stats.voice_cache_hits == 2
    snapshot = [t.clone() for c in voice.est for t in c.keys]
    # own frames only: the unshared streams also hold the prefix's 25 tokens; the prefix is counted once
    tails = sum(t.numel() * t.element_size() for c in voice.est for t in c.tails)  # per stream in both cases
    assert all(o == p - (voice.nbytes() - tails) for o, p in zip(own, plain_own))
    assert shared.live_cache_bytes() == sum(own) + voice.nbytes()

    # another voice while the first is in use: both kept (one idle prefix fits, in-use ones do not count)
    b = shared.new_stream("b", other, generator=torch.Generator().manual_seed(9))
    b.add_tokens(_tokens(43, 40))
    shared.step([b])
    assert len(shared._voices) == 2 and shared.voice_users() == {voice.key: 3, b.voice.key: 1}
    shared.abort(b)  # b's voice idle: the one idle prefix kept
    assert len(shared._voices) == 2

    for engine, (sts, got) in ((shared, (states, out)), (plain, (runs["plain"][0], plain_out))):
        for s, t in zip(sts, tokens):
            s.add_tokens(t[43:])
            s.end_input()
        while not all(s.finished for s in sts):
            for chunk in engine.step(sts):
                got[chunk.request_id].append(chunk.samples)
    for i in range(3):
        _assert_chunks_equal(out[f"s{i}"], plain_out[f"s{i}"])
    assert all(torch.equal(a, b) for a, b in zip(snapshot, (t for c in voice.est for t in c.keys)))
    # every stream ended: two idle prefixes, room for one: b's (least recently used) goes
    assert list(shared._voices.values()) == [voice] and shared.voice_users() == {voice.key: 0}
    assert shared.live_cache_bytes() == voice.nbytes()


def test_native_bf16_batched_equals_one_at_a_time(modules, monkeypatch: pytest.MonkeyPatch) -> None:
    """The bf16 estimator on our native kernels (AMX CPUs): the requests above, all streaming, in one batch
    (different offsets and lengths: the two-part attention on `bf16_attention`, per-row limits, padding frames)
    against each request alone (one-call blocks). A lone request attends over its keys as one sequence, the batch
    merges a prefix part and an own part by log-sum-exp: bf16 rounding turns those last-bit differences into
    bf16-sized ones; audio within 5e-4 [measured 7.0e-6]."""
    from vocalis.kernels import bf16_gemm
    from vocalis.precision.layers import cast_linears

    if not bf16_gemm.available():
        pytest.skip("our bf16 kernels run on AMX CPUs only (with the native extension built)")
    flow, hift = modules
    flow16 = CausalMaskedDiffWithXvec(flow.config).eval()
    flow16.load_state_dict(flow.state_dict())
    cast_linears(flow16.decoder.estimator, torch.bfloat16)
    # every token at once: each step batches every request's next chunk, at different offsets and lengths
    streaming = [(name, prompt, tokens, True, speed, len(tokens)) for name, prompt, tokens, _, speed, _ in SPECS]

    def engine() -> Token2WavEngine:
        eng = Token2WavEngine(flow16, hift)
        assert eng.compute is not None and eng.compute.native
        return eng

    from vocalis.token2wav.cv2.chunk_run import ChunkRun

    attention_batched, mixed = ChunkRun._attention_batched, []

    def spy(self, i, q, k, v):  # the two-part attention of requests at different offsets
        mixed.append(len(self.caches))
        return attention_batched(self, i, q, k, v)

    monkeypatch.setattr(ChunkRun, "_attention_batched", spy)
    eng = engine()
    together = _drive(eng, [_make(eng, s) for s in streaming], [s[2] for s in streaming], [s[5] for s in streaming])
    assert eng.stats.rows > eng.stats.steps and mixed and max(mixed) >= 2
    assert any(w is not None for _, w in eng.compute._blocks.values())  # one-call blocks ran
    worst = 0.0
    for spec in streaming:
        e = engine()
        alone16 = _drive(e, [_make(e, spec)], [spec[2]], [spec[5]])[spec[0]]
        assert [len(c) for c in together[spec[0]]] == [len(c) for c in alone16]
        worst = max(worst, max(float(np.abs(a - b).max()) for a, b in zip(together[spec[0]], alone16) if len(a)))
    print("native bf16 batched vs alone, audio max abs", worst)
    assert worst <= 5e-4
