"""Load an unchanged CosyVoice 3 model directory (Fun-CosyVoice3-0.5B layout).

`cosyvoice3.yaml`, `llm.pt`, `flow.pt`, `hift.pt`, `CosyVoice-BlankEN/` (Qwen2 config; tokenizer files optional),
optional `campplus.onnx`, `speech_tokenizer_v3.onnx`, `spk2info.pt`; the TensorRT/vLLM exports and `llm.rl.pt` are
ignored. Every state dict loads strictly by parameter name. `model_dir.load_model` calls `load_cosyvoice3` for a
directory holding `cosyvoice3.yaml`.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import torch

from vocalis.checkpoint import load_strict, read_torch_state_dict
from vocalis.config import CV3_SPEECH_TOKENIZER_ONNX
from vocalis.config.cv3 import CosyVoice3Config
from vocalis.errors import ModelLoadError
from vocalis.models.cv3.flow import CausalMaskedDiffWithDiT
from vocalis.models.cv3.hift import CausalHiFTGenerator, SourceTables
from vocalis.models.cv3.hift import prepare_official_state_dict as prepare_hift_state_dict
from vocalis.models.cv3.speech_lm import CosyVoice3LM
from vocalis.models.cv3.speech_lm import prepare_official_state_dict as prepare_llm_state_dict
from vocalis.official_yaml import cosyvoice3_config_from_official, read_official_yaml, read_qwen_config

log = logging.getLogger(__name__)

CV3_YAML = "cosyvoice3.yaml"
CV3_KIND = "cosyvoice3"
# what a complete released directory holds (hub downloads are checked against it); the rest is optional
CV3_REQUIRED_FILES = (CV3_YAML, "llm.pt", "flow.pt", "hift.pt", "CosyVoice-BlankEN/config.json")


def build_cv3_modules(config: CosyVoice3Config) -> tuple[CosyVoice3LM, CausalMaskedDiffWithDiT, CausalHiFTGenerator]:
    """The three networks at `config`'s shapes, random weights. The vocoder's fixed source tables follow the
    flow's shapes, as the official constructors draw them (see `models/cv3/source.py`)."""
    f = config.flow
    tables = SourceTables((f.vocab_size, f.input_size, f.spk_embed_dim, f.output_size), config.hift)
    return CosyVoice3LM(config.llm), CausalMaskedDiffWithDiT(config.flow), CausalHiFTGenerator(config.hift, tables)


def read_cosyvoice3_config(directory: Path) -> CosyVoice3Config:
    qwen = read_qwen_config(directory / "CosyVoice-BlankEN" / "config.json")
    return cosyvoice3_config_from_official(read_official_yaml(directory / CV3_YAML), qwen)


def load_cosyvoice3(directory: Path):  # -> vocalis.model_dir.LoadedModel
    """An unchanged official CosyVoice 3 directory as a `LoadedModel` of kind "cosyvoice3" (modules in eval mode).

    The text tokenizer (with CosyVoice 3's special tokens) is loaded when `CosyVoice-BlankEN/` has tokenizer files.
    """
    from vocalis.model_dir import LoadedModel, speaker_encoder_of  # model_dir imports this module lazily

    directory = Path(directory)
    config = read_cosyvoice3_config(directory)
    qwen_dir = directory / "CosyVoice-BlankEN"
    tokenizer = None
    if (qwen_dir / "vocab.json").is_file():
        from vocalis.frontend.tokenizer import TextTokenizer

        tokenizer = TextTokenizer.from_dir(qwen_dir, family=CV3_KIND)
        if tokenizer.endofprompt_id != config.llm.endofprompt_id:  # the LM splits prompts where the frontend ends them
            config = dataclasses.replace(
                config, llm=dataclasses.replace(config.llm, endofprompt_id=tokenizer.endofprompt_id))
    else:
        log.warning("%s has no tokenizer files (vocab.json, merges.txt): text input is unavailable", qwen_dir)
    llm, flow, hift = build_cv3_modules(config)
    load_strict(llm, prepare_llm_state_dict(read_torch_state_dict(directory / "llm.pt")), "llm.pt")
    load_strict(flow, read_torch_state_dict(directory / "flow.pt"), "flow.pt")
    load_strict(hift, prepare_hift_state_dict(read_torch_state_dict(directory / "hift.pt")), "hift.pt")
    for m in (llm, flow, hift):
        m.eval().requires_grad_(False)
    speech_tokenizer = None
    if (directory / CV3_SPEECH_TOKENIZER_ONNX).is_file():  # the v2 file's interface: feats (1, 128, T), lengths
        from vocalis.frontend.speech_tokenizer import OnnxSpeechTokenizer

        speech_tokenizer = OnnxSpeechTokenizer(directory / CV3_SPEECH_TOKENIZER_ONNX)
    voices = {}
    spk2info = directory / "spk2info.pt"
    if spk2info.is_file():
        from vocalis.frontend.voice import voice_from_spk2info

        try:
            info = torch.load(spk2info, map_location="cpu", weights_only=True)
        except Exception as exc:  # a corrupt optional file is reported, not fatal
            raise ModelLoadError(f"cannot read {spk2info}: {exc}") from exc
        voices = {str(k): voice_from_spk2info(str(k), v) for k, v in info.items()}
    return LoadedModel(config, llm, flow, hift, tokenizer, speech_tokenizer, speaker_encoder_of(directory), voices,  # type: ignore[arg-type]
                       CV3_KIND, directory)
