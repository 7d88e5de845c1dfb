"""The official CosyVoice 3 layout: an unchanged Fun-CosyVoice3-0.5B directory.

`cosyvoice3.yaml`, `llm.pt`, `flow.pt`, `hift.pt`, `CosyVoice-BlankEN/` (Qwen2 config; tokenizer files optional),
optional `campplus.onnx`, `speech_tokenizer_v3.onnx`, `spk2info.pt`; the TensorRT/vLLM exports and `llm.rl.pt` are
ignored. Every state dict loads strictly by parameter name.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from vocalis.config import (
    CV3_SPEECH_TOKENIZER_ONNX,
    CausalHiFTConfig,
    CosyVoice3Config,
    CV3FlowConfig,
    CV3SpeechLMConfig,
    DiTConfig,
    QwenConfig,
)
from vocalis.errors import ModelLoadError
from vocalis.frontend.speech_tokenizer import OnnxSpeechTokenizer
from vocalis.model_dir import official_yaml
from vocalis.model_dir.loaded import (
    QWEN_DIR,
    LoadedModel,
    load_official_weights,
    official_tokenizer,
    official_voices,
    speaker_encoder_of,
)
from vocalis.models.cv3.flow import CausalMaskedDiffWithDiT
from vocalis.models.cv3.hift import CausalHiFTGenerator, SourceTables
from vocalis.models.cv3.speech_lm import CosyVoice3LM

CV3_YAML = "cosyvoice3.yaml"
CV3_KIND = "cosyvoice3"
# what a complete released directory holds (hub downloads are checked against it); the rest is optional
CV3_REQUIRED_FILES = (CV3_YAML, "llm.pt", "flow.pt", "hift.pt", f"{QWEN_DIR}/config.json")


def build_cv3_modules(config: CosyVoice3Config) -> tuple[CosyVoice3LM, CausalMaskedDiffWithDiT, CausalHiFTGenerator]:
    """The three networks at `config`'s shapes, random weights. The vocoder's fixed source tables follow the
    flow's shapes, as the official constructors draw them (see `models/cv3/source.py`)."""
    f = config.flow
    tables = SourceTables((f.vocab_size, f.input_size, f.spk_embed_dim, f.output_size), config.hift)
    return CosyVoice3LM(config.llm), CausalMaskedDiffWithDiT(config.flow), CausalHiFTGenerator(config.hift, tables)


def cosyvoice3_config_from_official(yaml_data: dict[str, Any], qwen: QwenConfig) -> CosyVoice3Config:
    """Map the model sections of a `cosyvoice3.yaml` (CosyVoice3LM, CausalMaskedDiffWithDiT, CausalHiFTGenerator)
    onto our dataclasses. Values the official code fixes (80 mel bins, look-ahead conv kernels) keep our defaults."""
    try:
        llm, flow, hift = yaml_data["llm"], yaml_data["flow"], yaml_data["hift"]
        pre, cfm = flow["pre_lookahead_layer"], flow["decoder"]
        est = cfm["estimator"]
        official_yaml.check_llm_input_size(yaml_data, qwen)
        lookahead = int(flow.get("pre_lookahead_len", 3))
        if int(pre.get("pre_lookahead_len", lookahead)) != lookahead:
            raise ModelLoadError("flow.pre_lookahead_len differs from flow.pre_lookahead_layer.pre_lookahead_len")
        if int(pre["in_channels"]) != int(flow["input_size"]):
            raise ModelLoadError("flow.pre_lookahead_layer.in_channels differs from flow.input_size")
        return CosyVoice3Config(
            llm=CV3SpeechLMConfig(**official_yaml.speech_lm_fields(llm, qwen)),
            sampling=official_yaml.sampling_config(llm),
            flow=CV3FlowConfig(
                **official_yaml.flow_fields(flow),
                pre_lookahead_len=lookahead,
                pre_lookahead_channels=int(pre["channels"]),
                estimator=DiTConfig(
                    dim=int(est["dim"]),
                    depth=int(est["depth"]),
                    heads=int(est["heads"]),
                    dim_head=int(est["dim_head"]),
                    ff_mult=int(est.get("ff_mult", 4)),
                    dropout=float(est.get("dropout", 0.1)),
                    mel_dim=int(est.get("mel_dim", 80)),
                    mu_dim=int(est.get("mu_dim", est.get("mel_dim", 80))),
                    spk_dim=int(est["spk_dim"]),
                    out_channels=int(est.get("out_channels", 80)),
                    static_chunk_size=int(est.get("static_chunk_size", 50)),
                    num_decoding_left_chunks=int(est.get("num_decoding_left_chunks", -1)),
                ),
                cfm=official_yaml.cfm_config(cfm),
            ),
            hift=CausalHiFTConfig(**official_yaml.hift_fields(hift),
                                  conv_pre_look_right=int(hift.get("conv_pre_look_right", 4))),
            **official_yaml.top_fields(yaml_data),
            chunk_size=int(yaml_data.get("chunk_size", 25)),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise ModelLoadError(f"the CosyVoice3 yaml lacks or mangles a model field: {exc!r}") from exc


def read_cosyvoice3_config(directory: Path) -> CosyVoice3Config:
    qwen = official_yaml.read_qwen_config(directory / QWEN_DIR / "config.json")
    return cosyvoice3_config_from_official(official_yaml.read_official_yaml(directory / CV3_YAML), qwen)


def load_cosyvoice3(directory: Path) -> LoadedModel:
    """An unchanged official CosyVoice 3 directory as a `LoadedModel` of kind "cosyvoice3" (modules in eval mode).

    The text tokenizer (with CosyVoice 3's special tokens) is loaded when `CosyVoice-BlankEN/` has tokenizer files.
    """
    directory = Path(directory)
    config = read_cosyvoice3_config(directory)
    tokenizer = official_tokenizer(directory, CV3_KIND)
    if tokenizer is not None and tokenizer.endofprompt_id != config.llm.endofprompt_id:
        # the LM splits prompts where the frontend ends them
        llm = dataclasses.replace(config.llm, endofprompt_id=tokenizer.endofprompt_id)
        config = dataclasses.replace(config, llm=llm)
    llm, flow, hift = build_cv3_modules(config)
    load_official_weights(directory, llm, flow, hift)
    onnx = directory / CV3_SPEECH_TOKENIZER_ONNX  # the v2 file's interface: feats (1, 128, T), lengths
    speech_tokenizer = OnnxSpeechTokenizer(onnx) if onnx.is_file() else None
    return LoadedModel(config, llm, flow, hift, tokenizer, speech_tokenizer, speaker_encoder_of(directory),
                       official_voices(directory), CV3_KIND, directory)
