"""The LLM's precision applied at load, piece by piece (`model_dir.layerwise`, `precision.llm_precision`), and
the text table in reduced precision (`precision.embedding`).

- A layer-wise build equals the whole build: fp32 weights bit for bit, and in int8 / bf16 the converted model's
  outputs equal those of the whole fp32 build converted afterwards (`apply_backend`'s path), bit for bit; so does
  a layer-wise load of the official fixture directory and of our layout, and `TTS.load` in int8 synthesises the
  same audio as a model loaded whole and converted after.
- Reduced rows: int8 within half a quantisation step of each row (max|row| / 254), bf16 within 2^-8 relative.
- Memory: building the LLM layer-wise in int8, a fresh process's peak resident growth stays below the final
  model's growth plus its largest fp32 piece (with slack for the allocator), and below the whole fp32 build's
  [measured: peak 139 MB, final 96 MB, whole fp32 build 337 MB].
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from tiny_assets import make_tiny_model_dir
from vocalis.backends.choice import apply_backend
from vocalis.errors import ModelLoadError
from vocalis.model_dir import layerwise, load_model, random_model
from vocalis.precision.embedding import ReducedEmbedding
from vocalis.precision.llm_precision import LLMConverter, convert_llm


def _logits(llm: nn.Module) -> torch.Tensor:
    v, s = llm.config.qwen.vocab_size, llm.config.speech_token_size
    emb = llm.prefill_embeddings([5, 17, 400 % v, v - 1], [9, 3], [1, 2, 3, 44 % s])
    return llm(emb)


@pytest.fixture(params=[False, True], ids=["pieces", "split-fine"])
def split(request, monkeypatch):
    """Default pieces, or every module split down to its leaves (each Linear its own piece)."""
    if request.param:
        monkeypatch.setattr(layerwise, "PIECE_ELEMENTS", 0)
    return request.param


def test_fp32_layerwise_equals_whole_build(split) -> None:
    whole = random_model("tiny", seed=3)
    pieces = random_model("tiny", seed=3, llm_convert=lambda parent, name: None)
    for part in ("llm", "flow", "hift"):
        a, b = getattr(whole, part).state_dict(), getattr(pieces, part).state_dict()
        assert a.keys() == b.keys()
        for k in a:
            assert torch.equal(a[k], b[k]), f"{part}.{k}"
    assert not any(p.requires_grad for p in pieces.llm.parameters())


@pytest.mark.parametrize("precision", ["int8", "bf16"])
def test_converted_at_load_equals_converted_after(split, precision: str) -> None:
    whole = random_model("tiny", seed=1)
    note = convert_llm(whole.llm, precision)
    converter = LLMConverter.for_precision(precision)
    assert converter is not None
    loaded = random_model("tiny", seed=1, llm_convert=converter.convert)
    assert convert_llm(loaded.llm, precision) == note  # nothing left to convert, the same layers
    assert isinstance(loaded.llm.qwen.embed_tokens, ReducedEmbedding)
    assert not any(type(m) is nn.Linear for m in loaded.llm.modules())
    with torch.inference_mode():
        assert torch.equal(_logits(whole.llm), _logits(loaded.llm))


@pytest.fixture(scope="module")
def ours(tmp_path_factory) -> Path:
    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny") / "model")


@pytest.mark.parametrize("which", ["official", "vocalis"])
def test_layerwise_load_equals_whole_load(request, which: str) -> None:
    directory = request.getfixturevalue("compat_dir" if which == "official" else "ours")
    whole = load_model(directory)
    note = convert_llm(whole.llm, "int8")
    converter = LLMConverter.for_precision("int8")
    assert converter is not None
    loaded = load_model(directory, llm_convert=converter.convert)
    assert convert_llm(loaded.llm, "int8") == note
    with torch.inference_mode():
        assert torch.equal(_logits(whole.llm), _logits(loaded.llm))
    for part in ("flow", "hift"):  # loaded as before
        a, b = getattr(whole, part).state_dict(), getattr(loaded, part).state_dict()
        assert all(torch.equal(a[k], b[k]) for k in a)


def test_layerwise_load_checks_names_first(ours: Path, tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    broken = tmp_path / "broken"
    shutil.copytree(ours, broken)
    state = load_file(str(broken / "llm.safetensors"))
    state.pop(next(k for k in state if "layers.1." in k))
    save_file(state, str(broken / "llm.safetensors"))
    converter = LLMConverter.for_precision("int8")
    assert converter is not None
    with pytest.raises(ModelLoadError, match="missing"):
        load_model(broken, llm_convert=converter.convert)


def test_tts_load_int8_converts_at_load(ours: Path) -> None:
    from vocalis.tts import TTS

    tts = TTS.load(ours, precision="int8")
    assert isinstance(tts.model.llm.qwen.embed_tokens, ReducedEmbedding)
    whole = load_model(ours)
    apply_backend(whole, "torch", "int8")
    with torch.inference_mode():
        assert torch.equal(_logits(whole.llm), _logits(tts.model.llm))


@pytest.mark.parametrize("dtype", [torch.int8, torch.bfloat16])
def test_reduced_rows_within_bounds(dtype: torch.dtype) -> None:
    table = nn.Embedding(3000, 64)
    with torch.no_grad():
        table.weight[7] = 0.0  # an all-zero row: scale clamped, rows stay zero
        table.weight[8] *= 1e3
    reduced = ReducedEmbedding(table, dtype)
    ids = torch.tensor([[0, 7, 8, 2999], [5, 5, 100, 1]])
    got, want = reduced(ids), table(ids).detach()
    assert got.shape == want.shape and got.dtype == torch.float32
    if dtype == torch.int8:
        bound = want.abs().amax(-1, keepdim=True) / 254 * (1 + 1e-6)
        assert reduced.rows.dtype == torch.int8 and reduced.nbytes() == 3000 * 64 + 3000 * 4
    else:
        bound = want.abs() * 2.0 ** -8
    assert ((got - want).abs() <= bound).all()
    assert torch.equal(got[0, 1], torch.zeros(64))


_PEAK_SCRIPT = """
import dataclasses, json, sys, torch
from vocalis.config import PRESETS
from vocalis.model_dir.layerwise import build_layerwise, random_fill
from vocalis.models.speech_lm import Qwen2LM
from vocalis.precision.llm_precision import LLMConverter

def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) * 1024
def build(config):
    if sys.argv[1] == "whole":
        return Qwen2LM(config)
    return build_layerwise(lambda: Qwen2LM(config), random_fill, LLMConverter.for_precision("int8").convert)
tiny = PRESETS["tiny"].llm
config = dataclasses.replace(tiny, qwen=dataclasses.replace(tiny.qwen, **json.loads(sys.argv[2])))
torch.manual_seed(0)
# the same path once at small shapes first: libraries, thread pools and arenas it brings up are not the model's
small = build(dataclasses.replace(tiny, qwen=dataclasses.replace(tiny.qwen, vocab_size=1000)))
base = status("VmRSS:")
llm = build(config)
print(json.dumps({"peak": status("VmHWM:") - base, "final": status("VmRSS:") - base}))
"""
# 16 layers of 512 x 2048 (17 MB fp32 each) and a 32,000-row table (65 MB fp32): 335 MB whole in fp32
_SHAPES = {"vocab_size": 32000, "hidden_size": 512, "intermediate_size": 2048, "num_hidden_layers": 16,
           "num_attention_heads": 8, "num_key_value_heads": 2}


def _grown(how: str) -> dict[str, int]:
    """Resident bytes a fresh process grows by while building the LLM at `_SHAPES`: at its peak, and at the end."""
    out = subprocess.run([sys.executable, "-c", _PEAK_SCRIPT, how, json.dumps(_SHAPES)], capture_output=True,
                         text=True, check=True)
    return json.loads(out.stdout)


def test_layerwise_int8_peak_stays_near_the_final_size() -> None:
    whole, pieces = _grown("whole"), _grown("layerwise")
    largest_piece = 32000 * 512 * 4  # the text table, materialised fp32 before it is converted
    slack = 48 << 20  # allocator arenas, the int8 packing's temporaries
    assert pieces["final"] < whole["final"] / 2  # the reduced model really is smaller
    assert pieces["peak"] <= pieces["final"] + largest_piece + slack, pieces
    assert pieces["peak"] < 0.6 * whole["peak"], (pieces, whole)


def test_layerwise_build_leaves_the_compiler_unimported() -> None:
    """Building on the meta device draws no initial values: torch's meta `normal_` would import torch._dynamo
    (about a second of every reduced-precision load) for values that do not exist."""
    script = ("import sys\n"
              "from vocalis.model_dir import random_model\n"
              "from vocalis.backends.load_precision import llm_load_converter\n"
              "random_model('tiny', llm_convert=llm_load_converter('torch', 'int8', 'cpu'))\n"
              "print('torch._dynamo' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False", out.stderr[-2000:]
