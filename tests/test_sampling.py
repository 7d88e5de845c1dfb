"""Sampling rules and speech-LM decoding behaviour on tiny random models (no fixture needed)."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch

from vocalis.config import QwenConfig, SamplingConfig, SpeechLMConfig
from vocalis.models.qwen2 import KVCache
from vocalis.models.speech_lm import SOS_ROW, TASK_ID_ROW, Qwen2LM
from vocalis.models.speech_lm_train import build_sequence
from vocalis.reference.decode import generate, generate_bistream
from vocalis.reference.sampling import (
    apply_temperature,
    make_greedy_sampler,
    make_sampler,
    nucleus_sampling,
    random_sampling,
    ras_sampling,
)

SPEECH = 20  # speech_token_size of the tiny models: eos 20, unused stop 21, fill 22
EOS, UNUSED, FILL = SPEECH, SPEECH + 1, SPEECH + 2


def _tiny(seed: int = 0, **qwen: int | float) -> Qwen2LM:
    base: dict[str, int | float] = dict(
        vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2,
    )
    base.update(qwen)
    torch.manual_seed(seed)
    return Qwen2LM(SpeechLMConfig(qwen=QwenConfig(**base), speech_token_size=SPEECH)).eval()  # type: ignore[arg-type]


def _log_probs(probs: Sequence[float]) -> torch.Tensor:
    return torch.tensor(probs, dtype=torch.float32).log()


# ---- sampling functions --------------------------------------------------------------------------------------
def test_nucleus_respects_top_p_and_top_k() -> None:
    scores = _log_probs([0.05, 0.5, 0.1, 0.2, 0.15])
    gen = torch.Generator().manual_seed(0)
    # Mass before each sorted item: 0, .5, .7, .85 -> ids 1, 3, 4 are kept at top_p 0.8.
    seen = {nucleus_sampling(scores, 0.8, 25, gen) for _ in range(400)}
    assert seen == {1, 3, 4}
    seen = {nucleus_sampling(scores, 0.8, 2, gen) for _ in range(400)}
    assert seen == {1, 3}
    assert {nucleus_sampling(scores, 0.3, 25, gen) for _ in range(50)} == {1}  # the first item is always kept


def test_nucleus_stable_order_on_ties() -> None:
    scores = torch.zeros(100)  # uniform: mass limit allows 80, top_k keeps the first 25 ids in index order
    gen = torch.Generator().manual_seed(1)
    seen = {nucleus_sampling(scores, 0.8, 25, gen) for _ in range(2000)}
    assert seen == set(range(25))


def test_ras_excludes_a_repeat_and_resamples_full_distribution() -> None:
    scores = _log_probs([0.97, 0.01, 0.01, 0.01])
    gen = torch.Generator().manual_seed(2)
    assert all(ras_sampling(scores, [], generator=gen) == 0 for _ in range(50))
    before = scores.clone()
    redraws = [ras_sampling(scores, [3, 0], generator=gen) for _ in range(300)]
    assert 0 not in redraws and set(redraws) == {1, 2, 3}  # full distribution minus the repeat
    assert torch.equal(scores, before)  # input untouched
    # Outside the window (last 10) the id is not a repeat.
    assert ras_sampling(scores, [0] + [1] * 10, generator=torch.Generator().manual_seed(3)) == 0


def test_random_sampling_and_seed_reproducibility() -> None:
    scores = torch.randn(30, generator=torch.Generator().manual_seed(4))

    def draw(seed: int) -> list[int]:
        gen = torch.Generator().manual_seed(seed)
        return [random_sampling(scores, gen) for _ in range(40)]

    assert draw(5) == draw(5)
    assert draw(5) != draw(6)
    s1 = make_sampler(SamplingConfig(), torch.Generator().manual_seed(7))
    s2 = make_sampler(SamplingConfig(), torch.Generator().manual_seed(7))
    assert [s1(scores, []) for _ in range(30)] == [s2(scores, []) for _ in range(30)]


def test_temperature() -> None:
    scores = _log_probs([0.6, 0.3, 0.1])
    assert apply_temperature(scores, 1.0) is scores
    sharp = apply_temperature(scores, 0.5).softmax(0)
    assert sharp[0] > 0.6 and torch.allclose(sharp, scores.softmax(0) ** 2 / (scores.softmax(0) ** 2).sum())
    with pytest.raises(ValueError):
        apply_temperature(scores, 0.0)


# ---- Qwen2 body --------------------------------------------------------------------------------------------
def test_cached_equals_uncached_other_size() -> None:
    model = _tiny(seed=3, hidden_size=48, intermediate_size=96, num_hidden_layers=3, num_attention_heads=6,
                  num_key_value_heads=2, rope_theta=10000.0)
    x = torch.randn(2, 17, 48, generator=torch.Generator().manual_seed(8))
    with torch.inference_mode():
        full = model(x).log_softmax(-1)  # (2, 17, V)
        # Prefill 9, one single step, then a 4-position chunk on top of the cache, then 3 single steps.
        cache: KVCache | None = None
        rows = []
        for start, stop in [(0, 9), (9, 10), (10, 14), (14, 15), (15, 16), (16, 17)]:
            logp, cache = model.step(x[:, start:stop], cache)
            rows.append((stop - 1, logp))
        assert cache is not None and cache.seq_len == 17 and len(cache.keys) == 3
        diff = max((full[:, pos] - lp).abs().max().item() for pos, lp in rows)
        # Padded batch: row 1 right-padded to 17 gives the same outputs on its real positions.
        valid = torch.ones(2, 17, dtype=torch.bool)
        valid[1, 11:] = False
        padded = model(x, valid).log_softmax(-1)
        alone = model(x[1:, :11]).log_softmax(-1)
    pad_diff = (padded[1, :11] - alone[0]).abs().max().item()
    print(f"cached vs uncached {diff:.3g}, padded vs alone {pad_diff:.3g}")
    assert diff < 1e-5 and pad_diff < 1e-5
    assert not torch.isnan(padded).any()


# ---- unistream generation ------------------------------------------------------------------------------------
def _bias_head(model: Qwen2LM, eos: float, specials: float = -30.0) -> None:
    with torch.no_grad():
        model.llm_decoder.weight.zero_()
        model.llm_decoder.bias.zero_()
        model.llm_decoder.bias[EOS] = eos
        model.llm_decoder.bias[UNUSED:] = specials


def test_min_len_masks_eos_and_max_len_stops() -> None:
    model = _tiny()
    _bias_head(model, eos=30.0)
    gen = torch.Generator().manual_seed(0)
    assert len(list(generate(model, [1, 2, 3], min_len=5, max_len=50, generator=gen))) == 5
    assert len(list(generate(model, [1, 2, 3], generator=gen))) == 6  # default min_len = 2 x text tokens
    assert list(generate(model, [1, 2, 3], min_len=0, generator=gen)) == []
    _bias_head(model, eos=-30.0)
    assert len(list(generate(model, [1, 2, 3], generator=gen))) == 60  # default max_len = 20 x text tokens
    assert len(list(generate(model, [1, 2, 3], max_len=7, generator=gen))) == 7


def test_generate_seed_reproducible() -> None:
    model = _tiny(seed=1)

    def run(seed: int) -> list[int]:
        gen = torch.Generator().manual_seed(seed)
        return list(generate(model, [4, 5, 6], [7], [1, 2], max_len=25, generator=gen))

    assert run(11) == run(11)
    assert run(11) != run(12)


# ---- bistream ------------------------------------------------------------------------------------------------
class _Spy(Qwen2LM):
    """Records every embedding chunk fed to `step`."""

    fed: list[torch.Tensor]

    def step(self, inputs_embeds: torch.Tensor, cache: KVCache | None) -> tuple[torch.Tensor, KVCache]:
        self.fed.append(inputs_embeds[0].clone())
        return super().step(inputs_embeds, cache)


def _spy(seed: int = 2) -> _Spy:
    model = _tiny(seed)
    spy = _Spy(model.config)
    spy.load_state_dict(model.state_dict())
    spy.fed = []
    return spy.eval()


def _rows(model: Qwen2LM, *parts: tuple[str, Sequence[int]]) -> torch.Tensor:
    """Expected fed rows (N, D) from ('text'|'speech'|'sos'|'task', ids) parts."""
    out = []
    for kind, ids in parts:
        if kind == "text":
            out.append(model.embed_text(ids)[0])
        elif kind == "speech":
            out.append(model.embed_speech(ids)[0])
        else:
            out.append(model.llm_embedding.weight[SOS_ROW if kind == "sos" else TASK_ID_ROW][None])
    return torch.cat(out)


def test_bistream_no_prompt_layout_and_forced_fills() -> None:
    model = _spy()
    text = list(range(30, 42))  # 12 tokens, one piece each
    greedy = make_greedy_sampler((EOS, UNUSED, FILL))  # never samples a special id: every fill is forced
    with torch.inference_mode():
        speech = list(generate_bistream(model, ([t] for t in text), max_len=34, sample_fn=greedy))
    assert len(speech) == 34 and all(0 <= s < SPEECH for s in speech)
    lengths = [x.shape[0] for x in model.fed]
    # [sos + 5 text], 15 speech steps (the 15th input forces fill), [5 text], 15 speech steps, then the
    # final chunk [last speech again (official quirk), 2 text, task id] and 3 more steps for 34 tokens.
    assert lengths == [6] + [1] * 15 + [5] + [1] * 15 + [4] + [1] * 3
    with torch.inference_mode():
        expected = _rows(
            model,
            ("sos", []), ("text", text[:5]), ("speech", speech[:15]),
            ("text", text[5:10]), ("speech", speech[15:30]),
            ("speech", speech[29:30]), ("text", text[10:]), ("task", []), ("speech", speech[30:33]),
        )
    assert torch.equal(torch.cat(model.fed), expected)


def test_bistream_prompt_layout_matches_training_blocks() -> None:
    model = _spy(seed=4)
    prompt_text, prompt_speech = [40, 41, 42], list(range(20))  # P = 20 -> first fill after 10 generated ids
    pieces = [[30, 31], [32, 33], [34, 35], [36, 37]]
    greedy = make_greedy_sampler((EOS, UNUSED, FILL))
    with torch.inference_mode():
        speech = list(generate_bistream(model, pieces, prompt_text, prompt_speech, max_len=12, sample_fn=greedy))
    assert len(speech) == 12
    lengths = [x.shape[0] for x in model.fed]
    assert lengths == [1 + 5 + 15 + 5 + 5] + [1] * 10 + [3] + [1] * 1
    text = prompt_text + sum(pieces, [])
    with torch.inference_mode():
        streamed = torch.cat(model.fed)
        # Without the official re-fed row, the stream is the training-time bistream layout of the same ids.
        dup = 1 + 5 + 15 + 5 + 5 + 10
        no_dup = torch.cat((streamed[:dup], streamed[dup + 1 :]))
        all_speech = torch.tensor(prompt_speech + speech)
        train_in, train_target = build_sequence(
            model, model.embed_text(text)[0], all_speech, model.embed_speech(all_speech)[0], bistream=True
        )
    assert torch.equal(no_dup, train_in[: no_dup.shape[0]])
    assert train_target[1 + 5 + 15 + 5 + 15 - 1].item() == FILL  # the forced fill sits where training puts it


def test_bistream_sampled_fill_restarts_schedule_and_unused_special_is_masked() -> None:
    model = _spy(seed=5)

    def fill_at_third(scores: torch.Tensor, decoded: Sequence[int]) -> int:
        return FILL if len(decoded) == 3 else 1 + len(decoded) % 7

    with torch.inference_mode():
        speech = list(generate_bistream(model, ([t] for t in range(30, 40)), max_len=18, sample_fn=fill_at_third))
    # sos+5 text, 3 steps give 3 ids + a sampled fill; 5 text, then 15 ids and a forced fill at index 19.
    lengths = [x.shape[0] for x in model.fed]
    assert lengths[:4] == [6, 1, 1, 1] and lengths[4] == 5 and lengths[5:20] == [1] * 15
    assert len(speech) == 18 and FILL not in speech

    # the unused special id is masked in both phases, however strongly the head prefers it
    _bias_head(model, eos=-30.0)
    with torch.no_grad():
        model.llm_decoder.bias[UNUSED] = 50.0
    greedy = make_greedy_sampler()
    with torch.inference_mode():
        speech = list(generate_bistream(model, ([t] for t in range(30, 40)), max_len=20, sample_fn=greedy))
    assert speech and UNUSED not in speech


def test_bistream_stops_on_eos_after_text_ends() -> None:
    model = _spy(seed=6)
    _bias_head(model, eos=30.0)
    with torch.inference_mode():
        speech = list(generate_bistream(model, [[30, 31, 32, 33, 34, 35]], generator=torch.Generator().manual_seed(0)))
    # EOS is masked while text streams: 15 ids, a forced fill, then the final chunk ends at eos immediately.
    assert len(speech) == 15
