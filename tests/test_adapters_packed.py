"""Per-request LoRA adapters on the engine's packed weights (`adapters.packed`): a batch mixing two adapters and
rows with none gives, step by step, the log-probs of the module path (`BankedLinear`s called as modules) and of
each adapter merged into the weights, in prefill chunks and decode steps; a step with no adapter row still runs the
fused native decode step, and gives the base model's log-probs."""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence

import pytest
import torch
from fused_decode_support import dense_kernel, tiny_lm

from vocalis.adapters.batched import AdapterBank, bank_linears
from vocalis.adapters.lora_file import LoraAdapter, merge_adapter, random_adapter
from vocalis.engine.config import EngineConfig
from vocalis.engine.llm_engine import LLMEngine
from vocalis.engine.request import Request, SamplingParams
from vocalis.models.speech_lm import Qwen2LM
from vocalis.precision.layers import cast_linears

# (text ids, adapter): prompts of different lengths (chunked prefill over several steps, contexts ending mid-block)
JOBS = [([40, 41, 42, 43, 44, 45, 46], "a"), ([50, 51, 52], "b"), ([60, 61, 62, 63, 64], None),
        ([70, 71, 72, 73], "b"), ([80, 81], "a"), ([90, 91, 92, 93, 94, 95], None)]
MODULE_PATH = {"pack_weights": False, "fused_decode": ()}

Record = dict[tuple[str, int], torch.Tensor]  # (request id, k-th sampled row of it) -> its log-probs (V,)


class Steps:
    """What an engine's steps did: log-probs per request and sample, and per step whether it had prefill chunks,
    whether a row had an adapter, and whether the fused native step ran."""

    def __init__(self) -> None:
        self.logprobs: Record = {}
        self.kinds: list[tuple[bool, bool, bool]] = []  # (prefill, adapter row, fused)


def _engine(lm: torch.nn.Module, **kw: object) -> LLMEngine:
    return LLMEngine(lm, EngineConfig(block_size=4, max_num_batched_tokens=16, num_kv_blocks=128, **kw))


def _run(engine: LLMEngine, jobs: Sequence[tuple[list[int], str | None]], lengths: Sequence[int] | None = None
         ) -> Steps:
    """Greedy, fixed lengths (10 speech ids each by default: every engine schedules the same steps); records each
    step."""
    runner, steps, count = engine.runner, Steps(), {}
    execute, fused = runner.execute, runner.fused_decode
    calls = [0]

    def counting(f: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        def counted(*args: torch.Tensor) -> torch.Tensor:
            calls[0] += 1
            return f(*args)

        return counted

    if fused is not None:
        for name in ("forward", "forward_logits"):
            setattr(fused, name, counting(getattr(fused, name)))

    def recorded(scheduled: Sequence[tuple[Request, int]]) -> torch.Tensor:
        sampled = [r.request_id for r, n in scheduled
                   if r.sample_at_end and r.num_computed_tokens + n == r.num_tokens]  # as `prepare` orders them
        before = calls[0]
        y = execute(scheduled)
        steps.kinds.append((any(n > 1 for _, n in scheduled), any(r.adapter is not None for r, _ in scheduled),
                            calls[0] > before))
        for rid, row in zip(sampled, y):
            k = count[rid] = count.get(rid, -1) + 1
            steps.logprobs[(rid, k)] = row.clone()
        return y

    runner.execute = recorded  # type: ignore[method-assign]
    lengths = lengths or [10] * len(jobs)
    reqs = [engine.make_request(text, params=SamplingParams(greedy=True, min_len=n, max_len=n), request_id=f"r{i}",
                                adapter=adapter) for i, ((text, adapter), n) in enumerate(zip(jobs, lengths))]
    engine.generate(reqs)
    return steps


@pytest.fixture(scope="module")
def models() -> tuple[Qwen2LM, LoraAdapter, LoraAdapter]:
    lm = tiny_lm(128, 4, 2, 256)  # widths the fused fp32 step takes
    # ranks differ (the bank pads); a adapts k and v, b the o projection, gate and up and the speech head
    a = random_adapter(lm, "a", 2, ("q_proj", "k_proj", "v_proj", "down_proj"), 1)
    b = random_adapter(lm, "b", 4, ("q_proj", "o_proj", "gate_proj", "up_proj", "llm_decoder"), 2)
    return lm, a, b


def _banked(lm: Qwen2LM, *adapters: LoraAdapter) -> Qwen2LM:
    m = copy.deepcopy(lm)
    bank_linears(m, AdapterBank(list(adapters)))
    return m


def _merged(lm: Qwen2LM, adapter: LoraAdapter | None) -> Qwen2LM:
    m = copy.deepcopy(lm)
    if adapter is not None:
        merge_adapter(m, adapter)
    return m


def _close(got: Record, want: Record, keys: Sequence[tuple[str, int]], bound: float = 1e-4) -> None:
    assert keys
    for key in keys:
        assert float((got[key] - want[key]).abs().max()) <= bound, key


@dense_kernel
def test_packed_path_equals_module_path_and_merged_models(models) -> None:
    lm, a, b = models
    engine = _engine(_banked(lm, a, b))
    assert all(pk is not None for pk in engine.runner.packed) and engine.runner.packed_lora is not None
    assert engine.runner.fused_decode is not None  # kept for the steps with no adapter row
    packed = _run(engine, JOBS)
    module_engine = _engine(_banked(lm, a, b), **MODULE_PATH)
    assert all(pk is None for pk in module_engine.runner.packed)
    modules = _run(module_engine, JOBS)
    assert packed.kinds == modules.kinds
    # both kinds of step, with adapter rows, on the packed path (never the fused step)
    with_adapters = [(prefill, fused) for prefill, adapter, fused in packed.kinds if adapter]
    assert (True, False) in with_adapters and (False, False) in with_adapters
    assert not any(fused for _, fused in with_adapters)
    _close(packed.logprobs, modules.logprobs, list(modules.logprobs))
    # each adapter (and none) merged into the weights: the rows of that adapter's requests
    for name, adapter in (("a", a), ("b", b), (None, None)):
        merged = _run(_engine(_merged(lm, adapter)), [(text, None) for text, _ in JOBS])
        ids = {f"r{i}" for i, (_, ad) in enumerate(JOBS) if ad == name}
        _close(packed.logprobs, merged.logprobs, [k for k in merged.logprobs if k[0] in ids])
    # the adapters matter: a's rows differ from the base model's
    base = _run(_engine(_merged(lm, None)), [(text, None) for text, _ in JOBS])
    assert float((packed.logprobs[("r0", 3)] - base.logprobs[("r0", 3)]).abs().max()) > 1e-2


@dense_kernel
def test_steps_without_adapter_rows_run_fused(models) -> None:
    lm, a, b = models
    jobs = [(text, None) for text, _ in JOBS]
    banked = _run(_engine(_banked(lm, a, b)), jobs)
    base = _run(_engine(_merged(lm, None)), jobs)
    decodes = [fused for prefill, _, fused in banked.kinds if not prefill]
    assert decodes and all(decodes)  # every decode step ran fused, as the base model's do
    assert banked.kinds == base.kinds
    # (not bit for bit: b adapts the speech head, so the banked engine runs the head in torch, not in the step)
    _close(banked.logprobs, base.logprobs, list(base.logprobs), bound=1e-5)
    # a mixed batch: once the adapter requests are done, the remaining base-model decode steps run fused again
    mixed = _run(_engine(_banked(lm, a, b)), [(JOBS[0][0], "a"), ([90, 91], None)], lengths=[4, 12])
    kinds = [(adapter, fused) for prefill, adapter, fused in mixed.kinds if not prefill]
    assert (True, False) in kinds and (False, True) in kinds
    assert all(fused != adapter for adapter, fused in kinds)


def test_bf16_layers_packed_with_their_bank_equal_the_module_path(models) -> None:
    """The bf16 backend casts the banked Linears' base layers (`CastLinear`): they pack in bf16 and the updates are
    added to those GEMMs' outputs as the modules add them."""
    lm, a, b = models
    outs = []
    for kw in ({}, MODULE_PATH):
        m = _banked(lm, a, b)
        cast_linears(m, torch.bfloat16)
        engine = _engine(m, **kw)
        packed = engine.runner.packed
        assert all(pk is not None and pk.qkv_t.dtype == torch.bfloat16 for pk in packed) if not kw else \
            all(pk is None for pk in packed)
        outs.append(_run(engine, JOBS))
    assert outs[0].kinds == outs[1].kinds and any(adapter for _, adapter, _ in outs[0].kinds)
    _close(outs[0].logprobs, outs[1].logprobs, list(outs[1].logprobs))
