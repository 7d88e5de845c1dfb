"""The official CosyVoice 2 layout: an unchanged CosyVoice2-0.5B directory (`cosyvoice2.yaml`, `llm.pt`, `flow.pt`,
`hift.pt`, `CosyVoice-BlankEN/`, optional `campplus.onnx`, `speech_tokenizer_v2.onnx`, `spk2info.pt`), loaded
strictly by parameter name."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from vocalis.config import (
    EstimatorConfig,
    FlowConfig,
    FlowEncoderConfig,
    HiFTConfig,
    ModelConfig,
    QwenConfig,
    SpeechLMConfig,
)
from vocalis.errors import ModelLoadError
from vocalis.model_dir import official_yaml
from vocalis.model_dir.layerwise import Convert, load_layerwise
from vocalis.model_dir.loaded import (
    QWEN_DIR,
    LoadedModel,
    load_official_flow_hift,
    official_llm_state,
    official_tokenizer,
    official_voices,
    speaker_encoder_of,
    speech_tokenizer_of,
)
from vocalis.models.flow.flow import CausalMaskedDiffWithXvec
from vocalis.models.hift.generator import HiFTGenerator
from vocalis.models.speech_lm import Qwen2LM

OFFICIAL_YAML = "cosyvoice2.yaml"
OFFICIAL_KIND = "official"


def build_modules(config: ModelConfig) -> tuple[Qwen2LM, CausalMaskedDiffWithXvec, HiFTGenerator]:
    return Qwen2LM(config.llm), CausalMaskedDiffWithXvec(config.flow), HiFTGenerator(config.hift)


def model_config_from_official(yaml_data: dict[str, Any], qwen: QwenConfig) -> ModelConfig:
    """Map the model sections of a CosyVoice2 yaml onto our dataclasses."""
    try:
        llm, flow, hift = yaml_data["llm"], yaml_data["flow"], yaml_data["hift"]
        enc, cfm = flow["encoder"], flow["decoder"]
        est = cfm["estimator"]
        official_yaml.check_llm_input_size(yaml_data, qwen)
        return ModelConfig(
            llm=SpeechLMConfig(**official_yaml.speech_lm_fields(llm, qwen)),
            sampling=official_yaml.sampling_config(llm),
            flow=FlowConfig(
                **official_yaml.flow_fields(flow),
                pre_lookahead_len=int(flow.get("pre_lookahead_len", 3)),
                encoder=FlowEncoderConfig(
                    input_size=int(enc["input_size"]),
                    output_size=int(enc["output_size"]),
                    attention_heads=int(enc["attention_heads"]),
                    linear_units=int(enc["linear_units"]),
                    num_blocks=int(enc["num_blocks"]),
                    num_up_blocks=4,  # fixed in the official encoder, not read from the yaml
                    pre_lookahead_len=int(flow.get("pre_lookahead_len", 3)),
                    static_chunk_size=int(enc.get("static_chunk_size", 25)),
                    dropout_rate=float(enc.get("dropout_rate", 0.1)),
                    positional_dropout_rate=float(enc.get("positional_dropout_rate", 0.1)),
                    attention_dropout_rate=float(enc.get("attention_dropout_rate", 0.1)),
                ),
                estimator=EstimatorConfig(
                    in_channels=int(est["in_channels"]),
                    out_channels=int(est["out_channels"]),
                    channels=tuple(int(c) for c in est["channels"]),
                    dropout=float(est.get("dropout", 0.0)),
                    attention_head_dim=int(est["attention_head_dim"]),
                    n_blocks=int(est["n_blocks"]),
                    num_mid_blocks=int(est["num_mid_blocks"]),
                    num_heads=int(est["num_heads"]),
                    act_fn=str(est.get("act_fn", "gelu")),
                    static_chunk_size=int(est.get("static_chunk_size", 50)),
                ),
                cfm=official_yaml.cfm_config(cfm),
            ),
            hift=HiFTConfig(**official_yaml.hift_fields(hift)),
            **official_yaml.top_fields(yaml_data),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise ModelLoadError(f"the CosyVoice2 yaml lacks or mangles a model field: {exc!r}") from exc




def load_official(directory: Path, llm_convert: Convert | None = None) -> LoadedModel:
    """An unchanged official CosyVoice2 directory. llm_convert: load the LLM piece by piece, each converted as it
    is loaded (a precision's `LLMConverter.convert`: `model_dir.layerwise`)."""
    config = model_config_from_official(
        official_yaml.read_official_yaml(directory / OFFICIAL_YAML),
        official_yaml.read_qwen_config(directory / QWEN_DIR / "config.json"),
    )
    llm = load_layerwise(lambda: Qwen2LM(config.llm), official_llm_state(directory), "llm.pt", llm_convert)
    flow, hift = CausalMaskedDiffWithXvec(config.flow), HiFTGenerator(config.hift)
    load_official_flow_hift(directory, flow, hift)
    tokenizer = official_tokenizer(directory, "cosyvoice2")
    speech_tokenizer = speech_tokenizer_of(directory, config.llm.speech_token_size)
    return LoadedModel(config, llm, flow, hift, tokenizer, speech_tokenizer, speaker_encoder_of(directory),
                       official_voices(directory), OFFICIAL_KIND, directory)
