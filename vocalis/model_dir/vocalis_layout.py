"""Our own layout: `vocalis.json` (architecture) + `{llm,flow,hift}.safetensors` + `tokenizer/` + optional frontend
models and `voices/*.safetensors`. `vocalis convert` writes it from an official CosyVoice 2 directory; the
built-in model ships in it; `random_model` builds one at a preset's shapes."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch

from vocalis.checkpoint import load_strict, read_safetensors, write_safetensors
from vocalis.config import CAMPPLUS_ONNX, PRESETS, SPEECH_TOKENIZER_ONNX, ModelConfig
from vocalis.errors import ModelLoadError
from vocalis.frontend.phones import PhoneTokenizer
from vocalis.frontend.tokenizer import TextTokenizer
from vocalis.frontend.voice import Voice
from vocalis.model_dir.loaded import (
    QWEN_DIR,
    SPEAKER_ENCODER_JSON,
    TORCH_SPEECH_TOKENIZER,
    LoadedModel,
    eval_modules,
    speaker_encoder_of,
    speech_tokenizer_of,
)
from vocalis.model_dir.layerwise import Convert, SafetensorsState, build_layerwise, load_layerwise, random_fill
from vocalis.model_dir.official_cv2 import build_modules, load_official
from vocalis.models.flow.flow import CausalMaskedDiffWithXvec
from vocalis.models.hift.generator import HiFTGenerator
from vocalis.models.speech_lm import Qwen2LM
from vocalis.models.speech_tokenizer.labeller import LABELLER_JSON, LABELLER_WEIGHTS

_SAFE_FILE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,63}$")

FORMAT_VERSION = 1
VOCALIS_JSON = "vocalis.json"
BUNDLED_TOKENIZER = Path(__file__).resolve().parents[1] / "assets" / "tokenizer"
BUILTIN_MODEL = Path(__file__).resolve().parents[1] / "assets" / "model"
_TOKENIZER_FILES = ("vocab.json", "merges.txt", "tokenizer_config.json", "tokenizer.json")


def _text_tokenizer(config: ModelConfig, tokenizer_dir: Path) -> TextTokenizer | PhoneTokenizer | None:
    """What the LLM reads text with: the phone frontend when the config says so, else the BPE files (if any)."""
    if config.text_frontend == "phones":
        return PhoneTokenizer()
    return TextTokenizer.from_dir(tokenizer_dir) if (tokenizer_dir / "vocab.json").is_file() else None


def load_vocalis(directory: Path, llm_convert: Convert | None = None) -> LoadedModel:
    """Our own layout (see module docstring). llm_convert: load the LLM piece by piece, each converted as it is
    read from its file (a precision's `LLMConverter.convert`: `model_dir.layerwise`)."""
    try:
        meta = json.loads((directory / VOCALIS_JSON).read_text(encoding="utf-8"))
        config = ModelConfig.from_dict(meta["config"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ModelLoadError(f"cannot read {directory / VOCALIS_JSON}: {exc}") from exc
    llm_file = directory / "llm.safetensors"
    if llm_convert is None:
        llm, flow, hift = build_modules(config)
        load_strict(llm, read_safetensors(llm_file), llm_file.name)
    else:
        if not llm_file.is_file():
            raise ModelLoadError(f"missing checkpoint file: {llm_file}")
        llm = load_layerwise(lambda: Qwen2LM(config.llm), SafetensorsState(llm_file), llm_file.name, llm_convert)
        flow, hift = CausalMaskedDiffWithXvec(config.flow), HiFTGenerator(config.hift)
    for name, module in (("flow", flow), ("hift", hift)):
        load_strict(module, read_safetensors(directory / f"{name}.safetensors"), f"{name}.safetensors")
    eval_modules(llm, flow, hift)
    tok_dir = directory / "tokenizer"
    speech_tokenizer = speech_tokenizer_of(directory, config.llm.speech_token_size)
    voices = {v.name: v for v in (Voice.load(p) for p in sorted((directory / "voices").glob("*.safetensors")))}
    return LoadedModel(
        config, llm, flow, hift, _text_tokenizer(config, tok_dir), speech_tokenizer, speaker_encoder_of(directory),
        voices, meta.get("kind", "vocalis"), directory,
    )


def random_model(preset: str = "tiny", seed: int = 0, llm_convert: Convert | None = None) -> LoadedModel:
    """Random weights at a preset's shapes, with the bundled tokenizer and one embedding-only voice.

    It makes noise, not speech: it exists so every code path runs on a fresh machine.
    llm_convert: build the LLM layer by layer, each piece converted by it as it is made (a precision's
    `LLMConverter.convert`), so the whole fp32 LLM never exists; the weights are those of the whole build.
    """
    config = PRESETS[preset]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if llm_convert is None:
            llm, flow, hift = build_modules(config)
        else:
            llm = build_layerwise(lambda: Qwen2LM(config.llm), random_fill, llm_convert)
            flow, hift = CausalMaskedDiffWithXvec(config.flow), HiFTGenerator(config.hift)
        embedding = torch.randn(config.spk_embed_dim)
    eval_modules(llm, flow, hift)
    voice = Voice("default", "", (), (), torch.zeros(0, config.flow.output_size), embedding)
    return LoadedModel(config, llm, flow, hift, _text_tokenizer(config, BUNDLED_TOKENIZER), voices={"default": voice},
                       kind="random")


def save_vocalis(model: LoadedModel, out: Path, tokenizer_src: Path, frontend_src: Path | None = None) -> None:
    """Write our layout. The directory is built beside `out` and renamed into place at the end."""
    if not isinstance(model.config, ModelConfig):
        raise ModelLoadError(f"{model.describe()}: the vocalis layout holds CosyVoice 2 models")
    if out.exists():
        raise ModelLoadError(f"output directory already exists: {out}")
    tmp = out.with_name(out.name + ".partial")
    if tmp.exists():
        shutil.rmtree(tmp)
    (tmp / "tokenizer").mkdir(parents=True)
    meta = {"format_version": FORMAT_VERSION, "kind": "vocalis", "config": model.config.to_dict()}
    (tmp / VOCALIS_JSON).write_text(json.dumps(meta, indent=2), encoding="utf-8")
    for name, module in (("llm", model.llm), ("flow", model.flow), ("hift", model.hift)):
        write_safetensors(module.state_dict(), tmp / f"{name}.safetensors")
    for fname in _TOKENIZER_FILES if model.config.text_frontend == "bpe" else ():
        if (tokenizer_src / fname).is_file():
            shutil.copy2(tokenizer_src / fname, tmp / "tokenizer" / fname)
    if frontend_src is not None:
        for fname in (SPEECH_TOKENIZER_ONNX, CAMPPLUS_ONNX, TORCH_SPEECH_TOKENIZER, "speech_tokenizer.json",
                      SPEAKER_ENCODER_JSON, LABELLER_WEIGHTS, LABELLER_JSON):
            if (frontend_src / fname).is_file():
                shutil.copy2(frontend_src / fname, tmp / fname)
    if model.voices:
        (tmp / "voices").mkdir()
        for i, (name, voice) in enumerate(model.voices.items()):
            # official speaker ids may be any text; the file name only has to be safe, the name lives inside
            fname = name if _SAFE_FILE.match(name) else f"voice{i:03d}"
            voice.save(tmp / "voices" / f"{fname}.safetensors")
    tmp.rename(out)


def convert_official(src: Path, out: Path) -> LoadedModel:
    """`vocalis convert`: official CosyVoice 2 directory -> our layout; returns the loaded source model."""
    model = load_official(src)
    save_vocalis(model, out, tokenizer_src=src / QWEN_DIR, frontend_src=src)
    return model
