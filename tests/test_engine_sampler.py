"""Batched sampler: per-row parameters, min-length masking, and the same draws as the reference sampler."""

from __future__ import annotations

import torch

from vocalis.config import SamplingConfig
from vocalis.engine.request import Request, SamplingParams
from vocalis.engine.sampler import Sampler
from vocalis.reference.sampling import greedy_sampling, make_sampler

V = 40
EOS, STOPS = 37, (37, 38, 39)


def _req(params: SamplingParams, outputs: list[int] = ()) -> Request:  # type: ignore[assignment]
    r = Request([1, 2, 3], params)
    r.token_ids.extend(outputs)
    r.output_ids.extend(outputs)
    return r


def _reference(scores: torch.Tensor, req: Request) -> int:
    """What Qwen2LM.generate's sample function picks for this row (own generator, same seed)."""
    p = req.params
    row = scores.clone()
    if req.num_output_tokens < p.min_len:
        row[list(STOPS) if p.stop_all_masked else [EOS]] = float("-inf")
    if p.greedy:
        return greedy_sampling(row)
    gen = torch.Generator()
    gen.manual_seed(p.seed)  # type: ignore[arg-type]
    cfg = SamplingConfig(top_p=p.top_p, top_k=p.top_k, win_size=p.win_size, tau_r=p.tau_r, temperature=p.temperature)
    return make_sampler(cfg, gen)(row, req.output_ids)


def test_mixed_rows_match_reference_per_row() -> None:
    torch.manual_seed(0)
    logp = torch.randn(6, V).mul(3).log_softmax(dim=-1)
    reqs = [
        _req(SamplingParams(seed=1)),
        _req(SamplingParams(greedy=True)),
        _req(SamplingParams(seed=2, temperature=0.7, top_k=5, top_p=0.5)),
        _req(SamplingParams(seed=3, top_k=40, top_p=1.0, temperature=1.3), outputs=[4, 5]),
        _req(SamplingParams(seed=4, greedy=True, min_len=3), outputs=[1]),
        _req(SamplingParams(seed=5, min_len=9, stop_all_masked=True)),
    ]
    logp[4, EOS] = 10.0  # greedy would pick eos, but min_len masks it
    before = logp.clone()
    got = Sampler(EOS, STOPS)(logp, reqs)
    assert torch.equal(logp, before)  # scores are not modified
    assert got == [_reference(logp[i], r) for i, r in enumerate(reqs)]
    assert got[4] != EOS


def test_rows_do_not_depend_on_the_batch() -> None:
    torch.manual_seed(1)
    logp = torch.randn(5, V).log_softmax(dim=-1)

    def run(rows: list[int]) -> list[int]:
        reqs = [_req(SamplingParams(seed=10 + i, top_k=10 + i)) for i in rows]
        return Sampler(EOS, STOPS)(logp[rows], reqs)

    alone = [run([i])[0] for i in range(5)]
    assert run([0, 1, 2, 3, 4]) == alone
    assert run([4, 2, 0]) == [alone[4], alone[2], alone[0]]


def test_repetition_window_redraws() -> None:
    logp = torch.full((1, V), -20.0)
    logp[0, 7] = 0.0  # nucleus picks 7 for sure
    logp = logp.log_softmax(dim=-1)
    req = _req(SamplingParams(seed=0, top_k=1), outputs=[7, 3, 3])  # 7 already in the window: redraw
    got = Sampler(EOS, STOPS)(logp, [req])[0]
    assert got != 7 and got == _reference(logp[0], req)


def test_min_len_masks_eos_only_unless_asked() -> None:
    logp = torch.full((2, V), -30.0)
    logp[:, 38] = 0.0  # a stop id other than eos
    logp[:, EOS] = 0.0
    reqs = [_req(SamplingParams(greedy=True, min_len=5)), _req(SamplingParams(greedy=True, min_len=5,
                                                                               stop_all_masked=True))]
    got = Sampler(EOS, STOPS)(logp, reqs)
    assert got[0] == 38  # eos masked, the other stop id still wins (the released behaviour)
    assert got[1] not in STOPS


def test_top_entries_are_the_stable_sort_prefix() -> None:
    """`_top` (topk, then re-sorted) == the first k of the full stable descending sort, ties included."""
    from vocalis.engine.sampler import _top

    torch.manual_seed(1)
    coarse = torch.randint(0, 6, (5, V)).float()  # many ties, also at the k-th value
    fine = torch.randn(5, V).softmax(dim=-1)
    fine[1, [3, 9, 20]] = fine[1].max()  # a tied maximum
    fine[2, :] = 0.0  # all equal (fully masked row)
    for probs in (coarse, fine):
        ref_v, ref_i = probs.sort(dim=-1, descending=True, stable=True)
        for k in (1, 3, 7, V - 1, V, V + 5):
            v, i = _top(probs, k)
            assert torch.equal(v, ref_v[:, :k]) and torch.equal(i, ref_i[:, :k]), k


def test_single_rows_match_reference() -> None:
    """One row at a time (the batch-1 path: index_fill masking, no thread switch), min-length masking on or off,
    nucleus cuts from one item to all top_k: the reference sampler's ids."""
    torch.manual_seed(2)
    logp = torch.randn(12, V).mul(2).log_softmax(dim=-1)
    for i in range(12):
        params = SamplingParams(seed=20 + i, top_k=(1, 5, 25)[i % 3], top_p=(0.05, 0.5, 0.8, 1.0)[i % 4],
                                min_len=(0, 9)[i % 2], stop_all_masked=i % 4 == 1, temperature=(1.0, 0.7)[i % 2])
        req = _req(params, outputs=[3, 4])
        assert Sampler(EOS, STOPS)(logp[i:i + 1], [req]) == [_reference(logp[i], req)]
