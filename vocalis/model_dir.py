"""Find, load and convert model directories.

Two layouts are read:
- official: an unchanged CosyVoice2-0.5B directory (`cosyvoice2.yaml`, `llm.pt`, `flow.pt`, `hift.pt`,
  `CosyVoice-BlankEN/`, optional `campplus.onnx`, `speech_tokenizer_v2.onnx`, `spk2info.pt`);
- vocalis: `vocalis.json` (architecture) + `{llm,flow,hift}.safetensors` + `tokenizer/` + optional ONNX
  frontend models and `voices/*.safetensors`. `vocalis convert` writes it from an official directory.
Both load strictly by parameter name.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import torch

from vocalis.checkpoint import load_strict, read_safetensors, read_torch_state_dict, write_safetensors
from vocalis.config import CAMPPLUS_ONNX, PRESETS, SPEECH_TOKENIZER_ONNX, ModelConfig
from vocalis.errors import ModelLoadError
from vocalis.frontend.phones import PhoneTokenizer
from vocalis.frontend.speaker import CampplusSpeakerEncoder, SpeakerEncoder
from vocalis.frontend.speech_tokenizer import OnnxSpeechTokenizer, SpeechTokenizer
from vocalis.frontend.tokenizer import TextTokenizer
from vocalis.frontend.voice import Voice, voice_from_spk2info
from vocalis.models.flow.flow import CausalMaskedDiffWithXvec
from vocalis.models.hift.generator import HiFTGenerator
from vocalis.models.hift.generator import prepare_official_state_dict as prepare_hift_state_dict
from vocalis.models.speech_lm import Qwen2LM
from vocalis.models.speech_lm import prepare_official_state_dict as prepare_llm_state_dict
from vocalis.models.speech_tokenizer.labeller import LABELLER_JSON, LABELLER_WEIGHTS
from vocalis.official_yaml import model_config_from_official, read_official_yaml, read_qwen_config

log = logging.getLogger(__name__)
_SAFE_FILE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,63}$")

FORMAT_VERSION = 1
OFFICIAL_YAML = "cosyvoice2.yaml"
VOCALIS_JSON = "vocalis.json"
TORCH_SPEECH_TOKENIZER = "speech_tokenizer.safetensors"  # ours; speech_tokenizer.json sits beside it
SPEAKER_ENCODER_JSON = "speaker_encoder.json"  # {"kind": "resemblyzer"}: a pip-shipped speaker encoder
BUNDLED_TOKENIZER = Path(__file__).resolve().parent / "assets" / "tokenizer"
BUILTIN_MODEL = Path(__file__).resolve().parent / "assets" / "model"
_TOKENIZER_FILES = ("vocab.json", "merges.txt", "tokenizer_config.json", "tokenizer.json")


@dataclass
class LoadedModel:
    """Every part of a model directory, ready for inference (modules in eval mode)."""

    config: ModelConfig
    llm: Qwen2LM
    flow: CausalMaskedDiffWithXvec
    hift: HiFTGenerator
    tokenizer: TextTokenizer | PhoneTokenizer | None  # None: a directory without tokenizer files (token-level use only)
    speech_tokenizer: SpeechTokenizer | None = None
    speaker_encoder: SpeakerEncoder | None = None
    voices: dict[str, Voice] = field(default_factory=dict)
    kind: str = "vocalis"  # "official" | "vocalis" | "random"
    path: Path | None = None

    def describe(self) -> str:
        where = str(self.path) if self.path else "built in"
        return f"{self.kind} model ({where})"

    def to(self, device: str | torch.device) -> LoadedModel:
        """Move the three networks to `device` in place (the frontends stay on the CPU); returns self."""
        if torch.device(device).type != "cpu":
            for m in (self.llm, self.flow, self.hift):
                m.to(device)
        return self


def build_modules(config: ModelConfig) -> tuple[Qwen2LM, CausalMaskedDiffWithXvec, HiFTGenerator]:
    return Qwen2LM(config.llm), CausalMaskedDiffWithXvec(config.flow), HiFTGenerator(config.hift)


def _eval(*modules: torch.nn.Module) -> None:
    for m in modules:
        m.eval().requires_grad_(False)


def _speech_tokenizer(directory: Path, config: ModelConfig) -> SpeechTokenizer | None:
    weights, onnx = directory / TORCH_SPEECH_TOKENIZER, directory / SPEECH_TOKENIZER_ONNX
    if (directory / LABELLER_WEIGHTS).is_file():  # a phone model's prompt tokenizer: its ids are the labels
        from vocalis.frontend.speech_tokenizer import LabellerSpeechTokenizer

        tok: SpeechTokenizer = LabellerSpeechTokenizer.load(directory)
    elif weights.is_file():  # ours takes precedence: it is only there on purpose
        from vocalis.frontend.speech_tokenizer import TorchSpeechTokenizer

        if onnx.is_file():
            log.warning("%s holds both %s and %s: using %s", directory, weights.name, onnx.name, weights.name)
        tok = TorchSpeechTokenizer.load(weights)
    else:
        return OnnxSpeechTokenizer(onnx) if onnx.is_file() else None
    if tok.codebook_size != config.llm.speech_token_size:
        raise ModelLoadError(
            f"{directory}: speech tokenizer codebook {tok.codebook_size} != the LLM's speech_token_size "
            f"{config.llm.speech_token_size}"
        )
    return tok


def speaker_encoder_of(directory: Path) -> SpeakerEncoder | None:
    """`speaker_encoder.json` (our built-in model: resemblyzer) or `campplus.onnx`, else None."""
    marker = directory / SPEAKER_ENCODER_JSON
    if marker.is_file():
        from vocalis.frontend.speaker_resemblyzer import speaker_encoder_from_json

        return speaker_encoder_from_json(marker)
    spk = directory / CAMPPLUS_ONNX
    return CampplusSpeakerEncoder(spk) if spk.is_file() else None


def _text_tokenizer(config: ModelConfig, tokenizer_dir: Path) -> TextTokenizer | PhoneTokenizer | None:
    """What the LLM reads text with: the phone frontend when the config says so, else the BPE files (if any)."""
    if config.text_frontend == "phones":
        return PhoneTokenizer()
    return TextTokenizer.from_dir(tokenizer_dir) if (tokenizer_dir / "vocab.json").is_file() else None


def _frontend_models(directory: Path, config: ModelConfig) -> tuple[SpeechTokenizer | None, SpeakerEncoder | None]:
    return _speech_tokenizer(directory, config), speaker_encoder_of(directory)


def load_official(directory: Path) -> LoadedModel:
    """An unchanged official CosyVoice2 directory."""
    qwen_dir = directory / "CosyVoice-BlankEN"
    config = model_config_from_official(
        read_official_yaml(directory / OFFICIAL_YAML), read_qwen_config(qwen_dir / "config.json")
    )
    llm, flow, hift = build_modules(config)
    load_strict(llm, prepare_llm_state_dict(read_torch_state_dict(directory / "llm.pt")), "llm.pt")
    load_strict(flow, read_torch_state_dict(directory / "flow.pt"), "flow.pt")
    load_strict(hift, prepare_hift_state_dict(read_torch_state_dict(directory / "hift.pt")), "hift.pt")
    _eval(llm, flow, hift)
    tokenizer = TextTokenizer.from_dir(qwen_dir) if (qwen_dir / "vocab.json").is_file() else None
    if tokenizer is None:
        log.warning("%s has no tokenizer files (vocab.json, merges.txt): text input is unavailable", qwen_dir)
    speech_tokenizer, speaker_encoder = _frontend_models(directory, config)
    voices: dict[str, Voice] = {}
    spk2info = directory / "spk2info.pt"
    if spk2info.is_file():
        try:
            info = torch.load(spk2info, map_location="cpu", weights_only=True)
        except Exception as exc:  # a corrupt optional file is reported, not fatal
            raise ModelLoadError(f"cannot read {spk2info}: {exc}") from exc
        voices = {str(k): voice_from_spk2info(str(k), v) for k, v in info.items()}
    return LoadedModel(config, llm, flow, hift, tokenizer, speech_tokenizer, speaker_encoder, voices, "official", directory)


def load_vocalis(directory: Path) -> LoadedModel:
    """Our own layout (see module docstring)."""
    try:
        meta = json.loads((directory / VOCALIS_JSON).read_text(encoding="utf-8"))
        config = ModelConfig.from_dict(meta["config"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ModelLoadError(f"cannot read {directory / VOCALIS_JSON}: {exc}") from exc
    llm, flow, hift = build_modules(config)
    for name, module in (("llm", llm), ("flow", flow), ("hift", hift)):
        load_strict(module, read_safetensors(directory / f"{name}.safetensors"), f"{name}.safetensors")
    _eval(llm, flow, hift)
    tok_dir = directory / "tokenizer"
    speech_tokenizer, speaker_encoder = _frontend_models(directory, config)
    voices = {v.name: v for v in (Voice.load(p) for p in sorted((directory / "voices").glob("*.safetensors")))}
    return LoadedModel(
        config, llm, flow, hift, _text_tokenizer(config, tok_dir), speech_tokenizer, speaker_encoder, voices,
        meta.get("kind", "vocalis"), directory,
    )


def random_model(preset: str = "tiny", seed: int = 0) -> LoadedModel:
    """Random weights at a preset's shapes, with the bundled tokenizer and one embedding-only voice.

    It makes noise, not speech: it exists so every code path runs on a fresh machine.
    """
    config = PRESETS[preset]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        llm, flow, hift = build_modules(config)
        embedding = torch.randn(config.spk_embed_dim)
    _eval(llm, flow, hift)
    voice = Voice("default", "", (), (), torch.zeros(0, config.flow.output_size), embedding)
    return LoadedModel(config, llm, flow, hift, _text_tokenizer(config, BUNDLED_TOKENIZER), voices={"default": voice},
                       kind="random")


def load_model(path: str | Path | None = None) -> LoadedModel:
    """A model directory of either layout; None = the built-in model (random tiny weights until one ships)."""
    if path is None:
        if (BUILTIN_MODEL / VOCALIS_JSON).is_file():
            return load_vocalis(BUILTIN_MODEL)
        return random_model()
    directory = Path(path).expanduser()
    if not directory.is_dir():
        from vocalis.hub import is_hub_id, resolve_model

        if not is_hub_id(path):
            raise ModelLoadError(f"model directory not found: {directory}")
        directory = resolve_model(path)  # a hub id: downloaded once into the hub's cache, verified
    if (directory / VOCALIS_JSON).is_file():
        return load_vocalis(directory)
    if (directory / "cosyvoice3.yaml").is_file():  # CosyVoice 3: its own modules (model_dir_cv3.py)
        from vocalis.model_dir_cv3 import load_cosyvoice3

        return load_cosyvoice3(directory)
    if (directory / OFFICIAL_YAML).is_file():
        return load_official(directory)
    raise ModelLoadError(f"{directory} is not a model directory: it has neither {VOCALIS_JSON} nor {OFFICIAL_YAML}")


def save_vocalis(model: LoadedModel, out: Path, tokenizer_src: Path, frontend_src: Path | None = None) -> None:
    """Write our layout. The directory is built beside `out` and renamed into place at the end."""
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
    """`vocalis convert`: official directory -> our layout; returns the loaded source model."""
    model = load_official(src)
    save_vocalis(model, out, tokenizer_src=src / "CosyVoice-BlankEN", frontend_src=src)
    return model
