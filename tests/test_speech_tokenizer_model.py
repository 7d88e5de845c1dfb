"""Vocalis's supervised speech tokenizer: FSQ, 25 Hz rate, CTC learning, symbols, save/load, the front-end contract."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from system_deps import need_program

from vocalis.errors import AudioError, ModelLoadError
from vocalis.frontend.audio import whisper_log_mel
from vocalis.frontend.speech_tokenizer import SpeechTokenizer, TorchSpeechTokenizer
from vocalis.models.speech_tokenizer import (
    FSQ,
    SpeechTokenizerConfig,
    SupervisedSpeechTokenizer,
    SymbolTable,
    char_units,
    greedy_ctc_decode,
    latin_units,
    load_speech_tokenizer,
    pad_mels,
    preset_config,
    save_speech_tokenizer,
)
from vocalis.models.speech_tokenizer.model import edit_distance

SR = 16000
LETTERS = "abcdef"


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny tensors: a second intra-op thread only adds synchronisation (on a loaded 2-core machine the
    CTC test took 43 s of CPU with 2 threads against 4.5 s with 1)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _tiny(num_symbols: int = 10, seed: int = 0, **overrides) -> SupervisedSpeechTokenizer:
    torch.manual_seed(seed)
    return SupervisedSpeechTokenizer(preset_config("tiny", num_symbols, **overrides))


def _noise(seconds: float, seed: int = 0) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal(int(seconds * SR)) * 0.1).astype(np.float32)


# ---------------------------------------------------------------------------------------------------
# FSQ


@pytest.mark.parametrize(("levels", "dim"), [(3, 8), (4, 3), (5, 2)])
def test_fsq_round_trip_and_index_range(levels: int, dim: int) -> None:
    fsq = FSQ(levels, dim)
    z = torch.randn(4000, dim) * 3  # wide enough to reach every level
    quantised, idx = fsq(z)
    assert idx.dtype == torch.int64 and int(idx.min()) >= 0 and int(idx.max()) < levels**dim
    assert fsq.codebook_size == levels**dim
    # index -> vector -> index is the identity, and equals the forward's quantised vector
    assert torch.equal(fsq.indices_to_codes(idx), quantised)
    all_idx = torch.arange(levels**dim)
    # a pre-image of every code (tanh inverted, kept off +-1) quantises back to its own index
    levels_value = fsq.indices_to_codes(all_idx) * fsq.half_width  # integers in [-L/2, L/2)
    pre_image = torch.atanh(((levels_value + fsq.offset) / fsq.bound).clamp(-0.9999, 0.9999)) - fsq.shift
    back_codes, back = fsq(pre_image)
    assert torch.equal(back, all_idx) and torch.equal(back_codes, fsq.indices_to_codes(all_idx))
    # index = sum digit_i * L^i, digits in [0, L)
    digits = fsq.indices_to_digits(idx)
    assert int(digits.min()) >= 0 and int(digits.max()) == levels - 1
    assert torch.equal((digits * levels ** torch.arange(dim)).sum(-1), idx)
    # every level is used on each axis; z = 0 maps to the middle code
    assert all(len(torch.unique(digits[:, i])) == levels for i in range(dim))
    assert torch.equal(fsq(torch.zeros(1, dim))[1], (torch.full((1, dim), levels // 2) * fsq.powers).sum(-1))


def test_fsq_straight_through_gradient() -> None:
    fsq = FSQ(3, 8)
    z = torch.randn(16, 8, requires_grad=True)
    quantised, _ = fsq(z)
    quantised.sum().backward()
    # rounding is skipped in the backward pass: the gradient is that of bounded(z) / half_width
    z2 = z.detach().clone().requires_grad_()
    (fsq.bounded(z2) / fsq.half_width).sum().backward()
    assert z.grad is not None and bool((z.grad.abs() > 0).all())
    assert torch.allclose(z.grad, z2.grad)


def test_fsq_unrounded_warmup() -> None:
    """quantize=False passes the bounded values on (same indices); the model's loss runs either way."""
    fsq = FSQ(3, 6)
    z = torch.randn(10, 6)
    soft, idx_soft = fsq(z, quantize=False)
    hard, idx_hard = fsq(z)
    assert torch.equal(idx_soft, idx_hard)
    assert torch.allclose(soft, fsq.bounded(z) / fsq.half_width)
    assert torch.allclose(hard, torch.round(fsq.bounded(z)) / fsq.half_width)
    assert not torch.allclose(soft, hard)


def test_official_codebook_by_default() -> None:
    cfg = SpeechTokenizerConfig(num_symbols=40)
    assert cfg.codebook_size == 6561
    with pytest.raises(ValueError, match="preset"):
        preset_config("huge", 10)
    with pytest.raises(ValueError, match="heads"):
        SpeechTokenizerConfig(num_symbols=10, d_model=65, num_heads=2)


# ---------------------------------------------------------------------------------------------------
# Rate and batching


@pytest.mark.parametrize(("seconds", "expected"), [(1.0, 25), (2.5, 63), (0.2, 5)])
def test_25_hz_rate(seconds: float, expected: int) -> None:
    model = _tiny()
    ids = TorchSpeechTokenizer(model).tokenize(_noise(seconds))
    assert len(ids) == expected
    assert all(0 <= i < 6561 for i in ids)


def test_batched_equals_single() -> None:
    model = _tiny(seed=1).eval()
    wavs = [_letter_clip(w) for w in ("abcd", "fedcbaabc", "ab")]  # lengths 0.69, 1.49, 0.37 s
    batched = TorchSpeechTokenizer(model).tokenize_batch(wavs)
    assert [len(b) for b in batched] == [18, 38, 10]
    assert batched == [TorchSpeechTokenizer(model).tokenize(w) for w in wavs]
    # the continuous path too: padding must not leak into valid frames
    mels = [whisper_log_mel(w) for w in wavs]
    with torch.no_grad():
        _, logits, lens = model(*pad_mels(mels))
        for i, mel in enumerate(mels):
            _, single, _ = model(mel[None], torch.tensor([mel.shape[1]]))
            torch.testing.assert_close(logits[i, : int(lens[i])], single[0], atol=1e-5, rtol=1e-5)


def test_forward_shapes() -> None:
    model = _tiny(num_symbols=12)
    mel, lens = pad_mels([whisper_log_mel(_noise(1.0)), whisper_log_mel(_noise(0.5))])
    codes, logits, out_lens = model(mel, lens)
    assert codes.shape == (2, 25) and logits.shape == (2, 25, 12)
    assert out_lens.tolist() == [25, 13]
    assert bool((codes[1, 13:] == 0).all())


# ---------------------------------------------------------------------------------------------------
# CTC training on a synthetic "language": each letter is a tone of its own pitch


def _letter_clip(word: str) -> np.ndarray:
    t = np.arange(int(0.12 * SR)) / SR
    parts = [np.zeros(800)]
    for c in word:
        f = 200 * 1.35 ** LETTERS.index(c)
        parts += [0.2 * sum(np.sin(2 * np.pi * f * k * t) / k for k in (1, 2, 3)), np.zeros(int(0.04 * SR))]
    return np.concatenate(parts).astype(np.float32)


def test_ctc_loss_decreases_and_transcribes() -> None:
    rng = np.random.default_rng(0)
    words = ["".join(rng.choice(list(LETTERS), rng.integers(3, 7))) for _ in range(16)]
    table = SymbolTable.from_texts(words)
    assert len(table) == 2 + len(LETTERS)
    mel, mel_lens = pad_mels([whisper_log_mel(_letter_clip(w)) for w in words])
    ids = [torch.tensor(table.encode_text(w)) for w in words]
    targets = torch.nn.utils.rnn.pad_sequence(ids, batch_first=True)
    target_lens = torch.tensor([len(i) for i in ids])

    model = _tiny(num_symbols=len(table))
    opt = torch.optim.Adam(model.parameters(), lr=2e-3)
    losses = []
    for _ in range(150):
        loss, metrics = model.loss(mel, mel_lens, targets, target_lens)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(metrics["ctc"])
    print(
        f"[speech tokenizer] CTC {losses[0]:.3f} -> {losses[-1]:.3f}, code perplexity {metrics['code_perplexity']:.1f}"
    )
    # ~2.1 is the plateau of a model that only predicts blanks; well below it the codes carry the letters
    assert losses[-1] < 0.3 < losses[0]
    assert metrics["ctc_infeasible"] == 0 and metrics["code_perplexity"] > len(LETTERS)
    model.eval()
    with torch.no_grad():
        _, logits, lens = model(mel, mel_lens)
    hyps = greedy_ctc_decode(logits, lens)
    errors = sum(edit_distance(h, r.tolist()) for h, r in zip(hyps, ids))
    assert errors / int(target_lens.sum()) < 0.1


# ---------------------------------------------------------------------------------------------------
# Symbols


def test_char_units_and_table() -> None:
    assert char_units("Hello, World!  12") == list("hello") + ["|"] + list("world") + ["|", "1", "2"]
    assert char_units("你好，世界") == ["你", "好", "|", "世", "界"]
    table = SymbolTable.from_texts(["aab", "abc"], min_count=2)
    assert table.symbols == ("<blank>", "<unk>", "a", "b")
    assert table.encode_text("abz") == [2, 3, 1]
    assert table.decode([2, 3]) == ["a", "b"]
    assert SymbolTable.from_dict(json.loads(json.dumps(table.to_dict()))).symbols == table.symbols
    with pytest.raises(ValueError, match="starts with"):
        SymbolTable(["a", "b"])


def test_latin_units_romanise_hanzi() -> None:
    pytest.importorskip("pypinyin")
    assert latin_units("你好，世界 OK") == [*"ni3hao3", "|", *"shi4jie4", "|", "o", "k"]
    assert latin_units("Hello, World!") == char_units("Hello, World!")
    table = SymbolTable.from_texts(["你好", "hao"], unit="latin")
    assert table.unit == "latin" and table.encode_text("好") == table.encode_text("hao3")


def test_espeak_phoneme_units() -> None:
    need_program("espeak-ng", "espeak-ng")
    table = SymbolTable.from_texts(["Hello world.", "How are you?"], unit="phoneme")
    units = table.text_units("Hello world.")
    assert units[-1] == "d" and "|" in units and "h" in units
    assert not any("ˈ" in u or "(" in u for u in units)
    assert table.encode(units) == table.encode_text("hello, world")
    assert len(table.text_units("Guten Tag", language="de")) > 4


# ---------------------------------------------------------------------------------------------------
# Files and the front-end contract


def test_save_load_equality(tmp_path: Path) -> None:
    table = SymbolTable.from_texts(["hello world"])
    model = _tiny(num_symbols=len(table), seed=3)
    torch.nn.init.normal_(model.to_fsq.weight, std=1.0)
    weights, meta = save_speech_tokenizer(model, table, tmp_path)
    assert weights == tmp_path / "speech_tokenizer.safetensors" and meta == tmp_path / "speech_tokenizer.json"

    loaded, symbols = load_speech_tokenizer(tmp_path)
    assert symbols.symbols == table.symbols and loaded.config == model.config
    for key, value in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value), key
    wav = _noise(1.2, seed=5)
    assert TorchSpeechTokenizer(loaded).tokenize(wav) == TorchSpeechTokenizer(model).tokenize(wav)

    frontend = TorchSpeechTokenizer.load(weights)
    assert isinstance(frontend, SpeechTokenizer)
    assert frontend(wav) == TorchSpeechTokenizer(model).tokenize(wav) and frontend.codebook_size == 6561
    with pytest.raises(AudioError, match="too long"):
        frontend(np.zeros(31 * SR, dtype=np.float32))


def test_load_errors(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="missing speech_tokenizer.json"):
        load_speech_tokenizer(tmp_path)
    table = SymbolTable.from_texts(["ab"])
    save_speech_tokenizer(_tiny(num_symbols=len(table)), table, tmp_path)
    meta = json.loads((tmp_path / "speech_tokenizer.json").read_text())
    meta["config"]["d_model"] = 32
    (tmp_path / "speech_tokenizer.json").write_text(json.dumps(meta))
    with pytest.raises(ModelLoadError, match="shape mismatch"):
        load_speech_tokenizer(tmp_path)
    meta["format_version"] = 99
    (tmp_path / "speech_tokenizer.json").write_text(json.dumps(meta))
    with pytest.raises(ModelLoadError, match="format_version"):
        load_speech_tokenizer(tmp_path)
