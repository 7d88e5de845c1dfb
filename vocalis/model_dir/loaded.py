"""What every model-directory layout loads the same way: the `LoadedModel` it returns, the frontend models beside
the weights (speech tokenizer, speaker encoder), the official directories' Qwen2 tokenizer, weights and
`spk2info.pt` voices."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch

from vocalis.checkpoint import load_strict, read_torch_state_dict
from vocalis.config import CAMPPLUS_ONNX, SPEECH_TOKENIZER_ONNX, CosyVoice3Config, ModelConfig
from vocalis.errors import ModelLoadError
from vocalis.frontend.phones import PhoneTokenizer
from vocalis.frontend.speaker import CampplusSpeakerEncoder, SpeakerEncoder
from vocalis.frontend.speaker_resemblyzer import speaker_encoder_from_json
from vocalis.frontend.speech_tokenizer import (
    LabellerSpeechTokenizer,
    OnnxSpeechTokenizer,
    SpeechTokenizer,
    TorchSpeechTokenizer,
)
from vocalis.frontend.tokenizer import TextTokenizer
from vocalis.frontend.voice import Voice, voice_from_spk2info
from vocalis.models.cv3.flow import CausalMaskedDiffWithDiT
from vocalis.models.cv3.hift import CausalHiFTGenerator
from vocalis.models.cv3.speech_lm import CosyVoice3LM
from vocalis.models.flow.flow import CausalMaskedDiffWithXvec
from vocalis.models.hift.generator import HiFTGenerator
from vocalis.models.hift.generator import prepare_official_state_dict as prepare_hift_state_dict
from vocalis.models.speech_lm import Qwen2LM
from vocalis.models.speech_lm import prepare_official_state_dict as prepare_llm_state_dict
from vocalis.models.speech_tokenizer.labeller import LABELLER_WEIGHTS

log = logging.getLogger(__name__)

TORCH_SPEECH_TOKENIZER = "speech_tokenizer.safetensors"  # ours; speech_tokenizer.json sits beside it
SPEAKER_ENCODER_JSON = "speaker_encoder.json"  # {"kind": "resemblyzer"}: a pip-shipped speaker encoder
QWEN_DIR = "CosyVoice-BlankEN"  # an official directory's Qwen2 config and tokenizer files


@dataclass
class LoadedModel:
    """Every part of a model directory, ready for inference (modules in eval mode); the config and the three
    networks are one family's (CosyVoice 2 or CosyVoice 3)."""

    config: ModelConfig | CosyVoice3Config
    llm: Qwen2LM | CosyVoice3LM
    flow: CausalMaskedDiffWithXvec | CausalMaskedDiffWithDiT
    hift: HiFTGenerator | CausalHiFTGenerator
    tokenizer: TextTokenizer | PhoneTokenizer | None  # None: a directory without tokenizer files (token-level use only)
    speech_tokenizer: SpeechTokenizer | None = None
    speaker_encoder: SpeakerEncoder | None = None
    voices: dict[str, Voice] = field(default_factory=dict)
    kind: str = "vocalis"  # "official" | "vocalis" | "random" | "cosyvoice3"
    path: Path | None = None

    def describe(self) -> str:
        where = str(self.path) if self.path else "built in"
        return f"{self.kind} model ({where})"

    def to(self, device: str | torch.device) -> LoadedModel:
        """Move the three networks, the speech tokenizer and the speaker encoder to `device` in place (each
        frontend where it can run there); returns self."""
        if torch.device(device).type != "cpu":
            for m in (self.llm, self.flow, self.hift):
                m.to(device)
            for frontend in (self.speech_tokenizer, self.speaker_encoder):
                if frontend is not None:
                    frontend.to(device)
        return self


def eval_modules(*modules: torch.nn.Module) -> None:
    for m in modules:
        m.eval().requires_grad_(False)


def speech_tokenizer_of(directory: Path, speech_token_size: int, onnx_name: str = SPEECH_TOKENIZER_ONNX
                        ) -> SpeechTokenizer | None:
    """A phone model's labeller, our torch tokenizer, or the official ONNX file (`onnx_name`), else None."""
    weights, onnx = directory / TORCH_SPEECH_TOKENIZER, directory / onnx_name
    tok: SpeechTokenizer
    if (directory / LABELLER_WEIGHTS).is_file():  # a phone model's prompt tokenizer: its ids are the labels
        tok = LabellerSpeechTokenizer.load(directory)
    elif weights.is_file():  # ours takes precedence: it is only there on purpose
        if onnx.is_file():
            log.warning("%s holds both %s and %s: using %s", directory, weights.name, onnx.name, weights.name)
        tok = TorchSpeechTokenizer.load(weights)
    else:
        return OnnxSpeechTokenizer(onnx) if onnx.is_file() else None
    if tok.codebook_size != speech_token_size:
        raise ModelLoadError(
            f"{directory}: speech tokenizer codebook {tok.codebook_size} != the LLM's speech_token_size "
            f"{speech_token_size}"
        )
    return tok


def speaker_encoder_of(directory: Path) -> SpeakerEncoder | None:
    """`speaker_encoder.json` (our built-in model: resemblyzer) or `campplus.onnx`, else None."""
    marker = directory / SPEAKER_ENCODER_JSON
    if marker.is_file():
        return speaker_encoder_from_json(marker)
    spk = directory / CAMPPLUS_ONNX
    return CampplusSpeakerEncoder(spk) if spk.is_file() else None


def official_tokenizer(directory: Path, family: str) -> TextTokenizer | None:
    """An official directory's Qwen2 tokenizer (`CosyVoice-BlankEN/`), or None (with a warning) without its files."""
    qwen_dir = directory / QWEN_DIR
    if not (qwen_dir / "vocab.json").is_file():
        log.warning("%s has no tokenizer files (vocab.json, merges.txt): text input is unavailable", qwen_dir)
        return None
    return TextTokenizer.from_dir(qwen_dir, family=family)


def load_official_weights(directory: Path, llm: torch.nn.Module, flow: torch.nn.Module, hift: torch.nn.Module
                          ) -> None:
    """`llm.pt`, `flow.pt`, `hift.pt` into the three modules, strictly by name (both families' official LLM and HiFT
    keys are renamed alike), then eval mode."""
    load_strict(llm, official_llm_state(directory), "llm.pt")
    load_official_flow_hift(directory, flow, hift)
    eval_modules(llm, flow, hift)


def official_llm_state(directory: Path) -> dict[str, torch.Tensor]:
    """`llm.pt` renamed to our module tree (mapped from the file, not read into memory)."""
    return prepare_llm_state_dict(read_torch_state_dict(directory / "llm.pt"))


def load_official_flow_hift(directory: Path, flow: torch.nn.Module, hift: torch.nn.Module) -> None:
    """`flow.pt` and `hift.pt` into the two modules, strictly by name, then eval mode."""
    load_strict(flow, read_torch_state_dict(directory / "flow.pt"), "flow.pt")
    load_strict(hift, prepare_hift_state_dict(read_torch_state_dict(directory / "hift.pt")), "hift.pt")
    eval_modules(flow, hift)


def official_voices(directory: Path) -> dict[str, Voice]:
    """The speakers of an official directory's `spk2info.pt` (none without the file)."""
    spk2info = directory / "spk2info.pt"
    if not spk2info.is_file():
        return {}
    try:
        info = torch.load(spk2info, map_location="cpu", weights_only=True)
    except Exception as exc:  # a corrupt optional file is reported, not fatal
        raise ModelLoadError(f"cannot read {spk2info}: {exc}") from exc
    return {str(k): voice_from_spk2info(str(k), v) for k, v in info.items()}
