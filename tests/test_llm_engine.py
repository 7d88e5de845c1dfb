"""LLM engine on the tiny preset: batched, paged, chunked, preempted decoding equals one-at-a-time decoding."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from vocalis.config import PRESETS
from vocalis.engine.config import EngineConfig
from vocalis.engine.llm_engine import LLMEngine
from vocalis.engine.request import Request, RequestStatus, SamplingParams
from vocalis.errors import InputError
from vocalis.models.speech_lm import Qwen2LM
from vocalis.reference.decode import generate
from vocalis.reference.sampling import make_greedy_sampler, make_sampler

VOICE_TEXT = [300 + i for i in range(9)]  # a saved voice's prompt text: [sos] + 9 ids = 10 positions
VOICE_SPEECH = [11, 12, 13, 14, 15, 16]
TEXTS = [[40, 41, 42], [50, 51, 52, 53, 54, 55, 56], [60], [70, 71, 72, 73, 74], [80, 81]]


@pytest.fixture(scope="module")
def lm() -> Qwen2LM:
    torch.manual_seed(0)
    return Qwen2LM(PRESETS["tiny"].llm).eval().requires_grad_(False)


def _engine(lm: Qwen2LM, **kw: object) -> LLMEngine:
    cfg: dict[str, object] = {"block_size": 4, "max_num_batched_tokens": 16, "num_kv_blocks": 256}
    cfg.update(kw)
    return LLMEngine(lm, EngineConfig(**cfg))  # type: ignore[arg-type]


def _prompt(i: int) -> tuple[list[int], list[int]]:
    """Requests 0, 2, 4 use the saved voice (zero-shot); 1 and 3 have no prompt."""
    return (VOICE_TEXT, VOICE_SPEECH) if i % 2 == 0 else ([], [])


def test_greedy_batch_equals_generate_one_at_a_time(lm: Qwen2LM) -> None:
    eng = _engine(lm)
    reqs = []
    for i, text in enumerate(TEXTS):
        pt, ps = _prompt(i)
        reqs.append(eng.make_request(text, pt, ps, SamplingParams(greedy=True, min_len=5, max_len=12 + 3 * i)))
    got = eng.generate(reqs)
    for i, (text, req) in enumerate(zip(TEXTS, reqs)):
        pt, ps = _prompt(i)
        want = list(generate(lm, text, pt, ps, min_len=5, max_len=12 + 3 * i, sample_fn=make_greedy_sampler()))
        assert got[req.request_id] == want, f"request {i}"
    # the voice's [sos] + prompt text (10 positions) gives 2 shared blocks of 4 to later voice requests
    assert eng.block_manager.num_prefix_hits >= 4
    assert reqs[2].num_cached_tokens == 8 and reqs[4].num_cached_tokens == 8
    assert eng.block_manager.num_free_blocks == 256 and not eng.has_unfinished()


def test_seeded_ras_does_not_depend_on_the_batch(lm: Qwen2LM) -> None:
    params = SamplingParams(seed=123, min_len=10, max_len=25)

    def run(with_others: bool) -> list[int]:
        eng = _engine(lm)
        others = [eng.make_request(t, *_prompt(i), SamplingParams(seed=i, max_len=20))
                  for i, t in enumerate(TEXTS)] if with_others else []
        target = eng.make_request([90, 91, 92, 93], VOICE_TEXT, VOICE_SPEECH, params)
        return eng.generate([*others[:2], target, *others[2:]])[target.request_id]

    alone, crowded = run(False), run(True)
    assert alone == crowded and len(alone) == 25
    gen = torch.Generator()
    gen.manual_seed(123)
    ref = generate(lm, [90, 91, 92, 93], VOICE_TEXT, VOICE_SPEECH, min_len=10, max_len=25,
                      sample_fn=make_sampler(PRESETS["tiny"].sampling, gen))
    assert list(ref) == alone  # and it reproduces the reference sampler for the same seed


def test_paged_logits_equal_dense_path(lm: Qwen2LM) -> None:
    """Chunked prefill, prefix hits and batched decodes give the dense KVCache path's log-probs."""
    eng = _engine(lm, max_num_batched_tokens=8)
    reqs = [eng.make_request(t, *_prompt(i), SamplingParams(greedy=True, min_len=6, max_len=6))
            for i, t in enumerate(TEXTS[:4])]
    for r in reqs:
        eng.add_request(r)
    rows: dict[str, list[torch.Tensor]] = {r.request_id: [] for r in reqs}
    while eng.scheduler.has_unfinished():
        out = eng.scheduler.schedule()
        sampled = out.sampled
        logp = eng.runner.execute(out.scheduled)
        new_ids = eng.sampler(logp, sampled)
        for r, row in zip(sampled, logp):
            rows[r.request_id].append(row)
        eng.scheduler.update(out, new_ids)
    assert reqs[2].num_cached_tokens > 0  # a prefix hit was exercised
    for i, (text, req) in enumerate(zip(TEXTS, reqs)):
        pt, ps = _prompt(i)
        with torch.inference_mode():
            logp, cache = lm.step(lm.prefill_embeddings(text, pt, ps), None)
            dense = [logp[0]]
            for tok in req.output_ids[:-1]:
                logp, cache = lm.step(lm.speech_embedding.weight[tok].reshape(1, 1, -1), cache)
                dense.append(logp[0])
        assert len(rows[req.request_id]) == len(dense) == 6
        for paged, ref in zip(rows[req.request_id], dense):
            torch.testing.assert_close(paged, ref, atol=1e-4, rtol=0)


def test_preemption_does_not_change_outputs(lm: Qwen2LM) -> None:
    eng = _engine(lm, num_kv_blocks=14, max_num_batched_tokens=64)
    reqs = [eng.make_request(t, *_prompt(i), SamplingParams(greedy=True, min_len=20, max_len=20))
            for i, t in enumerate(TEXTS[:4])]
    got = eng.generate(reqs)
    assert sum(r.num_preemptions for r in reqs) > 0
    for i, (text, req) in enumerate(zip(TEXTS, reqs)):
        want = list(generate(lm, text, *_prompt(i), min_len=20, max_len=20, sample_fn=make_greedy_sampler()))
        assert got[req.request_id] == want
    assert eng.block_manager.num_free_blocks == 14


def test_abort_frees_blocks_and_tells_the_sink(lm: Qwen2LM) -> None:
    eng = _engine(lm)
    heard: list[tuple[int | None, bool]] = []
    a = eng.make_request(TEXTS[1], params=SamplingParams(seed=0, min_len=50, max_len=50),
                         sink=lambda r, t, done: heard.append((t, done)))
    b = eng.make_request(TEXTS[0], params=SamplingParams(seed=1, min_len=50, max_len=50))
    eng.add_request(a)
    eng.add_request(b)
    for _ in range(5):
        eng.step()
    assert len(heard) == 5 and not any(done for _, done in heard)
    free_before = eng.block_manager.num_free_blocks
    assert eng.abort(a.request_id)
    assert a.status is RequestStatus.FINISHED_ABORTED and a.block_table == []
    assert eng.block_manager.num_free_blocks == free_before + 4  # 10 + 5 positions -> 4 blocks of 4
    assert heard[-1] == (None, True)
    assert not eng.abort(a.request_id)
    while eng.has_unfinished():
        eng.step()
    assert b.num_output_tokens == 50 and eng.block_manager.num_free_blocks == 256


def test_length_limits(lm: Qwen2LM) -> None:
    eng = _engine(lm, max_model_len=32)
    with pytest.raises(InputError, match="positions"):
        eng.add_request(Request(list(range(40))))
    r = eng.make_request(TEXTS[0], params=SamplingParams(greedy=True, max_len=100))
    eng.add_request(r)
    assert r.params.max_len == 32 - r.num_prompt_tokens  # clamped to what the engine holds
    done = eng.make_request(TEXTS[0], params=SamplingParams(max_len=0))
    eng.add_request(done)
    assert done.status is RequestStatus.FINISHED_LENGTH and done.output_ids == []


def test_packed_weights_are_views_with_the_same_values() -> None:
    torch.manual_seed(1)
    lm = Qwen2LM(PRESETS["tiny"].llm).eval().requires_grad_(False)
    before = {k: v.clone() for k, v in lm.state_dict().items()}
    x = lm.prefill_embeddings([5, 6, 7])
    with torch.inference_mode():
        want = lm(x)
    eng = LLMEngine(lm, EngineConfig(num_kv_blocks=8))
    after = lm.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    layer, packed = lm.qwen.layers[0], eng.runner.packed[0]
    assert packed is not None  # the modules now read views into the fused storage: no copy kept
    assert layer.self_attn.q_proj.weight.data_ptr() == packed.qkv_t.data_ptr()
    assert layer.mlp.gate_proj.weight.data_ptr() == packed.gate_up_t.data_ptr()
    with torch.inference_mode():
        torch.testing.assert_close(lm(x), want, atol=1e-5, rtol=0)
    assert LLMEngine(lm, EngineConfig(num_kv_blocks=8)).runner.packed[0] is packed  # packed once per model


def test_padded_graph_decode_equals_eager_decode(lm: Qwen2LM) -> None:
    """The CUDA-graph decode path's padding (rows up to a captured batch size, context up to a bucket, padding rows
    on the scratch slot), run eagerly here: same log-probs and ids as the eager path, across a context bucket."""
    from vocalis.engine.decode_graphs import CONTEXT_SIZES, DecodeGraphs

    long_text = [100 + i % 50 for i in range(CONTEXT_SIZES[0] - 12)]  # its decode crosses the first bucket

    def run(padded: bool) -> tuple[list[list[int]], list[torch.Tensor]]:
        eng = _engine(lm, max_num_batched_tokens=512)  # every prefill in the first step
        if padded:
            eng.runner.graphs = DecodeGraphs(eng.runner, capture=False)
        texts = [*TEXTS[:3], long_text]  # 4 requests, then 3 when the first ends: a padding row
        reqs = [eng.make_request(t, *_prompt(i), SamplingParams(greedy=True, min_len=8 + 4 * i, max_len=8 + 4 * i))
                for i, t in enumerate(texts)]
        for r in reqs:
            eng.add_request(r)
        rows: list[torch.Tensor] = []
        while eng.scheduler.has_unfinished():
            out = eng.scheduler.schedule()
            logp = eng.runner.execute(out.scheduled)
            rows.extend(logp)
            eng.scheduler.update(out, eng.sampler(logp, out.sampled))
        return [r.output_ids for r in reqs], rows

    (eager_ids, eager_rows), (padded_ids, padded_rows) = run(False), run(True)
    assert padded_ids == eager_ids
    assert len(padded_rows) == len(eager_rows)
    for p, e in zip(padded_rows, eager_rows):
        torch.testing.assert_close(p, e, atol=1e-4, rtol=0)


RESIDENT_SCRIPT = """
import json, sys, torch
from vocalis.config import PRESETS
from vocalis.engine.config import EngineConfig
from vocalis.engine.llm_engine import LLMEngine
from vocalis.models.speech_lm import Qwen2LM
from vocalis.kernels.heap import rss_bytes
lm = Qwen2LM(PRESETS["tiny"].llm).eval().requires_grad_(False)
out = {}
for reserve in (False, True):
    before = rss_bytes()
    eng = LLMEngine(lm, EngineConfig(block_size=16, num_kv_blocks=8192, huge_pages=sys.argv[1] == "1",
                                     reserve_kv_cache=reserve))
    out[str(reserve)] = rss_bytes() - before
    out["pool"] = 2 * eng.runner.k_cache.numel() * eng.runner.k_cache.element_size()
    del eng
print(json.dumps(out))
"""


@pytest.mark.parametrize("huge_pages", [False, True])
def test_a_reserved_kv_cache_is_resident_from_the_start(huge_pages: bool) -> None:
    """`reserve_kv_cache` (what servers set): the whole pool is resident once the engine is built, instead of
    growing into RSS as blocks are first used. In a fresh process: one with a history may hand the pool memory
    that an earlier tensor already made resident."""
    run = subprocess.run([sys.executable, "-c", RESIDENT_SCRIPT, "1" if huge_pages else "0"], capture_output=True,
                         text=True, timeout=120, check=False)
    assert run.returncode == 0, run.stderr[-2000:]
    grown = json.loads(run.stdout.strip().splitlines()[-1])
    pool = grown["pool"]
    assert pool >= 48 << 20
    assert grown["True"] >= 0.9 * pool, grown
    assert grown["False"] <= 0.3 * pool, grown


def test_a_reserved_kv_cache_decodes_the_same(lm: Qwen2LM) -> None:
    got = {}
    for reserve in (False, True):
        eng = _engine(lm, block_size=16, reserve_kv_cache=reserve)
        reqs = [eng.make_request(text, *_prompt(i), SamplingParams(greedy=True, min_len=3, max_len=10))
                for i, text in enumerate(TEXTS)]
        out = eng.generate(reqs)
        got[reserve] = [out[r.request_id] for r in reqs]
    assert got[True] == got[False]
