"""Speech LM training objective: sequence layouts, loss normalisation, label smoothing, padding."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from vocalis.config import QwenConfig, SpeechLMConfig
from vocalis.models.speech_lm import Qwen2LM
from vocalis.models.speech_lm_train import IGNORE_ID, build_sequence, label_smoothing_loss, lm_training_forward

SPEECH = 20
EOS, FILL = SPEECH, SPEECH + 2


def _tiny(lsm: float = 0.0) -> Qwen2LM:
    torch.manual_seed(0)
    qwen = QwenConfig(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2)
    return Qwen2LM(SpeechLMConfig(qwen=qwen, speech_token_size=SPEECH, lsm_weight=lsm))


def _batch(text_lens: list[int], speech_lens: list[int]) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(1)
    text = torch.zeros(len(text_lens), max(text_lens), dtype=torch.int32)
    speech = torch.zeros(len(speech_lens), max(speech_lens), dtype=torch.int32)
    for i, (nt, ns) in enumerate(zip(text_lens, speech_lens)):
        text[i, :nt] = torch.randint(0, 50, (nt,), generator=g)
        speech[i, :ns] = torch.randint(0, SPEECH, (ns,), generator=g)
    return text, torch.tensor(text_lens), speech, torch.tensor(speech_lens)


def test_unistream_layout() -> None:
    model = _tiny()
    text, _, speech, _ = _batch([4], [9])
    x, y = build_sequence(model, model.qwen.embed_tokens(text[0]), speech[0].long(), model.speech_embedding(speech[0]),
                          bistream=False)
    assert x.shape[0] == y.shape[0] == 1 + 4 + 1 + 9
    assert y.tolist() == [IGNORE_ID] * 5 + speech[0].tolist() + [EOS]
    assert torch.equal(x[0], model.llm_embedding.weight[0]) and torch.equal(x[5], model.llm_embedding.weight[1])


def test_bistream_layout() -> None:
    model = _tiny()
    text, _, speech, _ = _batch([7], [25])
    s = speech[0].tolist()
    x, y = build_sequence(model, model.qwen.embed_tokens(text[0]), speech[0].long(), model.speech_embedding(speech[0]),
                          bistream=True)
    assert y.tolist() == [IGNORE_ID] + [IGNORE_ID] * 4 + s[:15] + [FILL] + [IGNORE_ID] * 2 + s[15:] + [EOS]
    assert x.shape[0] == y.shape[0]
    assert torch.equal(x[1 + 20 + 2], model.llm_embedding.weight[1])  # task id after the 2 remaining text tokens
    # text_len a multiple of 5: the last block holds no text, only task id + remaining speech.
    text, _, speech, _ = _batch([5], [17])
    x, y = build_sequence(model, model.qwen.embed_tokens(text[0]), speech[0].long(), model.speech_embedding(speech[0]),
                          bistream=True)
    assert y.tolist()[-4:] == [FILL] + speech[0].tolist()[15:] + [EOS]
    assert torch.equal(x[21], model.llm_embedding.weight[1])


def test_loss_is_token_mean_cross_entropy_over_padded_batch() -> None:
    model = _tiny()
    batch = _batch([4, 6], [9, 20])
    out = lm_training_forward(model, *batch, rng=random.Random(0), bistream_prob=0.0)
    # Same value from each sample alone: summed CE over both, divided by the total number of targets.
    total, count = 0.0, 0
    text, text_len, speech, speech_len = batch
    for i in range(2):
        nt, ns = int(text_len[i]), int(speech_len[i])
        x, y = build_sequence(model, model.qwen.embed_tokens(text[i, :nt]), speech[i, :ns].long(),
                              model.speech_embedding(speech[i, :ns]), bistream=False)
        logits = model(x[None])[0]
        total = total + F.cross_entropy(logits, y, ignore_index=IGNORE_ID, reduction="sum")
        count += int((y != IGNORE_ID).sum())
    assert torch.allclose(out.loss, total / count, atol=1e-5)
    assert 0.0 <= out.acc.item() <= 1.0
    out.loss.backward()
    assert model.qwen.layers[0].self_attn.q_proj.weight.grad is not None


def test_bistream_choice_needs_enough_speech() -> None:
    model = _tiny()
    rng_out = lm_training_forward(model, *_batch([6], [18]), rng=random.Random(0), bistream_prob=1.0)
    uni = lm_training_forward(model, *_batch([6], [18]), rng=random.Random(0), bistream_prob=0.0)
    assert torch.equal(rng_out.loss, uni.loss)  # 18 / 6 is not > 3: always unistream
    bi = lm_training_forward(model, *_batch([6], [19]), rng=random.Random(0), bistream_prob=1.0)
    uni = lm_training_forward(model, *_batch([6], [19]), rng=random.Random(0), bistream_prob=0.0)
    assert not torch.allclose(bi.loss, uni.loss)


def test_label_smoothing_matches_kl_to_smoothed_target() -> None:
    logits = torch.randn(1, 3, 5, generator=torch.Generator().manual_seed(2))
    target = torch.tensor([[2, IGNORE_ID, 4]])
    eps = 0.1
    dist = torch.full((2, 5), eps / 4)
    dist[0, 2] = dist[1, 4] = 1 - eps
    logp = logits[0, [0, 2]].log_softmax(-1)
    expected = (dist * (dist.log() - logp)).sum() / 2
    assert torch.allclose(label_smoothing_loss(logits, target, eps), expected, atol=1e-6)
    ce = F.cross_entropy(logits[0], target[0], ignore_index=IGNORE_ID)
    assert torch.allclose(label_smoothing_loss(logits, target, 0.0), ce, atol=1e-6)


def test_residual_dropout_acts_in_training_only() -> None:
    text, tl, speech, sl = _batch([4, 3], [6, 5])
    plain, dropped = _tiny(), _tiny()
    dropped.qwen.set_residual_dropout(0.3)
    for m in (plain, dropped):
        m.eval()
    ref = lm_training_forward(plain, text, tl, speech, sl, rng=random.Random(0), bistream_prob=0.0).loss
    same = lm_training_forward(dropped, text, tl, speech, sl, rng=random.Random(0), bistream_prob=0.0).loss
    assert torch.equal(ref, same)  # eval mode: no dropout, the released numerics
    dropped.train()
    torch.manual_seed(1)
    a = lm_training_forward(dropped, text, tl, speech, sl, rng=random.Random(0), bistream_prob=0.0).loss
    b = lm_training_forward(dropped, text, tl, speech, sl, rng=random.Random(0), bistream_prob=0.0).loss
    assert not torch.equal(a, b) and not torch.equal(a, ref)
    with pytest.raises(ValueError, match="dropout"):
        dropped.qwen.set_residual_dropout(1.0)
