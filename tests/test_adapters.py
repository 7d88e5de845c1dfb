"""LoRA adapters at inference: several adapters in one batch (batched LoRA) give each row what its adapter alone
gives, `TTS.load(adapters=...)` and `vocalis speak --adapter` merge one, a wrong adapter is one error line."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import soundfile as sf
import torch
from tiny_assets import make_tiny_model_dir

from vocalis.adapters.batched import AdapterBank, bank_linears
from vocalis.adapters.lora_file import (
    LoraAdapter,
    load_adapter,
    merge_adapter,
    random_adapter,
    save_adapter,
)
from vocalis.model_dir import load_model, random_model


def _merged(llm: torch.nn.Module, adapter: LoraAdapter | None) -> torch.nn.Module:
    m = copy.deepcopy(llm)
    if adapter is not None:
        merge_adapter(m, adapter)
    return m


def test_two_adapters_in_one_batch_equal_each_alone() -> None:
    llm = random_model().llm
    a = random_adapter(llm, "a", 2, ("q_proj", "v_proj", "down_proj"), 1)
    b = random_adapter(llm, "b", 4, ("q_proj", "o_proj", "gate_proj", "llm_decoder"), 2)
    banked = copy.deepcopy(llm)
    bank = AdapterBank([a, b])
    assert bank_linears(banked, bank) == 2 * 5 + 1  # 2 layers x {q, v, down, o, gate} + the head
    x = torch.randn(3, 9, llm.config.qwen.hidden_size, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        bank.rows = torch.tensor([bank.index("a"), bank.index("b"), bank.index(None)])
        together = banked(x)  # (3, 9, V): row 0 with a, row 1 with b, row 2 the base model
        for row, adapter in enumerate((a, b, None)):
            alone = _merged(llm, adapter)(x[row:row + 1])
            torch.testing.assert_close(together[row:row + 1], alone, atol=3e-5, rtol=1e-5)
            bank.rows = torch.tensor([row if adapter is not None else -1])
            torch.testing.assert_close(together[row:row + 1], banked(x[row:row + 1]), atol=1e-5, rtol=1e-5)
        assert not torch.allclose(together[0], together[1], atol=1e-3)
        # the flat layout the engine's runner uses: one adapter index per position
        flat_rows = torch.tensor([0, 1, 1, -1])
        bank.rows = flat_rows
        layer = banked.qwen.layers[0].self_attn.q_proj
        h = torch.randn(4, llm.config.qwen.hidden_size)
        for i, k in enumerate(flat_rows.tolist()):
            ref = _merged(llm, (a, b)[k] if k >= 0 else None).qwen.layers[0].self_attn.q_proj(h[i:i + 1])
            torch.testing.assert_close(layer(h)[i:i + 1], ref, atol=3e-5, rtol=1e-5)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model_dir(tmp_path_factory.mktemp("adapters") / "model")


def test_tts_load_merges_one_adapter_and_speak_uses_it(model_dir: Path, tmp_path: Path) -> None:
    from vocalis.cli import main
    from vocalis.tts import TTS

    base = load_model(model_dir).llm
    adapter = random_adapter(base, "calm", 2, ("q_proj", "v_proj"), 3)
    save_adapter(adapter, model_dir / "adapters" / "calm")
    tts = TTS.load(model_dir, adapters={"calm": "calm"})  # by name, from the model's adapters/
    assert tts.adapters == ("calm",)
    expected = _merged(base, load_adapter(model_dir / "adapters" / "calm")).state_dict()
    assert all(torch.equal(v, expected[k]) for k, v in tts.model.llm.state_dict().items())

    outs = {}
    for name, extra in (("plain", []), ("adapted", ["--adapter", str(model_dir / "adapters" / "calm")])):
        outs[name] = tmp_path / f"{name}.wav"
        argv = ["speak", "Hi there.", "-o", str(outs[name]), "--model", str(model_dir), "--seed", "1", *extra]
        assert main(argv) == 0
    plain, adapted = (sf.read(outs[n])[0] for n in ("plain", "adapted"))
    assert plain.shape != adapted.shape or not (plain == adapted).all()  # the adapter changed the speech ids


def test_wrong_adapters_are_one_error_line(model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from vocalis.cli import main

    other = random_adapter(random_model(seed=1).llm, "other", 2, ("q_proj",), 4)
    save_adapter(other, tmp_path / "other")
    for adapter, words in ((str(tmp_path / "other"), "trained on another base model"),
                           ("nope", "no adapter 'nope'"), (str(model_dir), "is not a LoRA adapter")):
        out = tmp_path / "x.wav"
        assert main(["speak", "Hi.", "-o", str(out), "--model", str(model_dir), "--adapter", adapter]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert err[-1].startswith("vocalis: error:") and words in err[-1], err
        assert not out.exists()
