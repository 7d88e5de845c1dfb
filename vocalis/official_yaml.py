"""Read an official `cosyvoice2.yaml` as plain data and map it to a `ModelConfig`.

The official file is hyperpyyaml: its tags (`!new:`, `!name:`, `!apply:`, `!ref`) would build objects.
Here every tag is ignored except `!ref`, which is resolved against the file's own top-level values; nothing
is imported or instantiated.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import yaml

from vocalis.config import (
    CFMConfig,
    EstimatorConfig,
    FlowConfig,
    FlowEncoderConfig,
    HiFTConfig,
    ModelConfig,
    QwenConfig,
    SamplingConfig,
    SpeechLMConfig,
)
from vocalis.config.cv3 import CausalHiFTConfig, CosyVoice3Config, CV3FlowConfig, CV3SpeechLMConfig, DiTConfig
from vocalis.errors import ModelLoadError


class _Ref(str):
    """An unresolved `!ref` expression, e.g. `<chunk_size> * <token_mel_ratio>`."""


class _DataLoader(yaml.SafeLoader):
    pass


def _construct_tagged(loader: yaml.Loader, tag_suffix: str, node: yaml.Node) -> Any:
    if isinstance(node, yaml.MappingNode):
        return loader.construct_mapping(node, deep=True)
    if isinstance(node, yaml.SequenceNode):
        return loader.construct_sequence(node, deep=True)
    return loader.construct_scalar(node)


def _construct_ref(loader: yaml.Loader, node: yaml.Node) -> _Ref:
    return _Ref(loader.construct_scalar(node))


_DataLoader.add_constructor("!ref", _construct_ref)
_DataLoader.add_multi_constructor("!", _construct_tagged)
# hyperpyyaml writes floats like 1e-06, which plain YAML 1.1 reads as strings
_DataLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)$"),
    list("-+0123456789."),
)

_REF_NAME = re.compile(r"<([A-Za-z_][A-Za-z0-9_]*)>")
_ARITHMETIC = re.compile(r"^[\d\s.+\-*/()]+$")


def _resolve(value: Any, top: dict[str, Any]) -> Any:
    if isinstance(value, _Ref):
        expr = _REF_NAME.sub(lambda m: repr(_resolve(top[m.group(1)], top)), str(value))
        if _ARITHMETIC.match(expr):
            return eval(expr, {"__builtins__": {}}, {})  # digits and operators only, checked above
        return expr.strip("'\"")
    if isinstance(value, dict):
        return {k: _resolve(v, top) for k, v in value.items()}
    if isinstance(value, list):
        return [_resolve(v, top) for v in value]
    return value


def read_official_yaml(path: Path) -> dict[str, Any]:
    """The yaml as nested dicts/lists with `!ref` values resolved."""
    try:
        raw = yaml.load(path.read_text(encoding="utf-8"), Loader=_DataLoader)  # noqa: S506 (data-only loader)
    except (OSError, yaml.YAMLError) as exc:
        raise ModelLoadError(f"cannot read {path}: {exc}") from exc
    if not isinstance(raw, dict):
        raise ModelLoadError(f"{path} is not a CosyVoice2 yaml (top level is not a mapping)")
    return _resolve(raw, raw)


def read_qwen_config(path: Path) -> QwenConfig:
    """`CosyVoice-BlankEN/config.json` (a Hugging Face Qwen2 config) as a `QwenConfig`."""
    try:
        hf = json.loads(path.read_text(encoding="utf-8"))
        return QwenConfig(
            vocab_size=int(hf["vocab_size"]),
            hidden_size=int(hf["hidden_size"]),
            intermediate_size=int(hf["intermediate_size"]),
            num_hidden_layers=int(hf["num_hidden_layers"]),
            num_attention_heads=int(hf["num_attention_heads"]),
            num_key_value_heads=int(hf.get("num_key_value_heads", hf["num_attention_heads"])),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_theta=float(hf.get("rope_theta", 1e6)),
            max_position_embeddings=int(hf.get("max_position_embeddings", 32768)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", True)),
        )
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ModelLoadError(f"cannot read the Qwen2 config {path}: {exc}") from exc


def _tuple(values: list[Any]) -> tuple[Any, ...]:
    return tuple(tuple(v) if isinstance(v, list) else v for v in values)


def _check_llm_input_size(yaml_data: dict[str, Any], qwen: QwenConfig) -> None:
    if qwen.hidden_size != int(yaml_data.get("llm_input_size", qwen.hidden_size)):
        raise ModelLoadError(
            f"llm_input_size {yaml_data['llm_input_size']} in the yaml differs from the Qwen2 hidden size "
            f"{qwen.hidden_size} in CosyVoice-BlankEN/config.json"
        )


def _speech_lm_fields(llm: dict[str, Any], qwen: QwenConfig) -> dict[str, Any]:
    """The speech LM arguments both generations share."""
    return {"qwen": qwen, "speech_token_size": int(llm["speech_token_size"]),
            "mix_ratio": tuple(llm.get("mix_ratio", (5, 15))), "lsm_weight": float(llm.get("lsm_weight", 0.0))}


def _sampling_config(llm: dict[str, Any]) -> SamplingConfig:
    sampling = llm.get("sampling", {})
    return SamplingConfig(top_p=float(sampling.get("top_p", 0.8)), top_k=int(sampling.get("top_k", 25)),
                          win_size=int(sampling.get("win_size", 10)), tau_r=float(sampling.get("tau_r", 0.1)))


def _cfm_config(cfm: dict[str, Any]) -> CFMConfig:
    params = cfm.get("cfm_params", {})
    params = params.get("content", params)
    return CFMConfig(sigma_min=float(params.get("sigma_min", 1e-6)),
                     training_cfg_rate=float(params.get("training_cfg_rate", 0.2)),
                     inference_cfg_rate=float(params.get("inference_cfg_rate", 0.7)))


def model_config_from_official(yaml_data: dict[str, Any], qwen: QwenConfig) -> ModelConfig:
    """Map the model sections of a CosyVoice2 yaml onto our dataclasses."""
    try:
        llm, flow, hift = yaml_data["llm"], yaml_data["flow"], yaml_data["hift"]
        enc, cfm = flow["encoder"], flow["decoder"]
        est = cfm["estimator"]
        _check_llm_input_size(yaml_data, qwen)
        return ModelConfig(
            llm=SpeechLMConfig(**_speech_lm_fields(llm, qwen)),
            sampling=_sampling_config(llm),
            flow=FlowConfig(
                vocab_size=int(flow["vocab_size"]),
                input_size=int(flow["input_size"]),
                output_size=int(flow["output_size"]),
                spk_embed_dim=int(flow["spk_embed_dim"]),
                token_mel_ratio=int(flow.get("token_mel_ratio", 2)),
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
                cfm=_cfm_config(cfm),
            ),
            hift=HiFTConfig(**_hift_fields(hift)),
            sample_rate=int(yaml_data.get("sample_rate", 24000)),
            spk_embed_dim=int(yaml_data.get("spk_embed_dim", 192)),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise ModelLoadError(f"the CosyVoice2 yaml lacks or mangles a model field: {exc!r}") from exc


def _hift_fields(hift: dict[str, Any]) -> dict[str, Any]:
    """The HiFT arguments both generations share, as `HiFTConfig` fields."""
    return {
        "in_channels": int(hift["in_channels"]),
        "base_channels": int(hift["base_channels"]),
        "nb_harmonics": int(hift["nb_harmonics"]),
        "sampling_rate": int(hift["sampling_rate"]),
        "nsf_alpha": float(hift["nsf_alpha"]),
        "nsf_sigma": float(hift["nsf_sigma"]),
        "nsf_voiced_threshold": float(hift["nsf_voiced_threshold"]),
        "upsample_rates": _tuple(hift["upsample_rates"]),
        "upsample_kernel_sizes": _tuple(hift["upsample_kernel_sizes"]),
        "istft_n_fft": int(hift["istft_params"]["n_fft"]),
        "istft_hop_len": int(hift["istft_params"]["hop_len"]),
        "resblock_kernel_sizes": _tuple(hift["resblock_kernel_sizes"]),
        "resblock_dilation_sizes": _tuple(hift["resblock_dilation_sizes"]),
        "source_resblock_kernel_sizes": _tuple(hift["source_resblock_kernel_sizes"]),
        "source_resblock_dilation_sizes": _tuple(hift["source_resblock_dilation_sizes"]),
        "lrelu_slope": float(hift["lrelu_slope"]),
        "audio_limit": float(hift["audio_limit"]),
        "f0_num_class": int(hift["f0_predictor"].get("num_class", 1)),
        "f0_cond_channels": int(hift["f0_predictor"]["cond_channels"]),
    }


def cosyvoice3_config_from_official(yaml_data: dict[str, Any], qwen: QwenConfig) -> CosyVoice3Config:
    """Map the model sections of a `cosyvoice3.yaml` (CosyVoice3LM, CausalMaskedDiffWithDiT, CausalHiFTGenerator)
    onto our dataclasses. Values the official code fixes (80 mel bins, look-ahead conv kernels) keep our defaults."""
    try:
        llm, flow, hift = yaml_data["llm"], yaml_data["flow"], yaml_data["hift"]
        pre, cfm = flow["pre_lookahead_layer"], flow["decoder"]
        est = cfm["estimator"]
        _check_llm_input_size(yaml_data, qwen)
        lookahead = int(flow.get("pre_lookahead_len", 3))
        if int(pre.get("pre_lookahead_len", lookahead)) != lookahead:
            raise ModelLoadError("flow.pre_lookahead_len differs from flow.pre_lookahead_layer.pre_lookahead_len")
        if int(pre["in_channels"]) != int(flow["input_size"]):
            raise ModelLoadError("flow.pre_lookahead_layer.in_channels differs from flow.input_size")
        return CosyVoice3Config(
            llm=CV3SpeechLMConfig(**_speech_lm_fields(llm, qwen)),
            sampling=_sampling_config(llm),
            flow=CV3FlowConfig(
                vocab_size=int(flow["vocab_size"]),
                input_size=int(flow["input_size"]),
                output_size=int(flow["output_size"]),
                spk_embed_dim=int(flow["spk_embed_dim"]),
                token_mel_ratio=int(flow.get("token_mel_ratio", 2)),
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
                cfm=_cfm_config(cfm),
            ),
            hift=CausalHiFTConfig(**_hift_fields(hift), conv_pre_look_right=int(hift.get("conv_pre_look_right", 4))),
            sample_rate=int(yaml_data.get("sample_rate", 24000)),
            spk_embed_dim=int(yaml_data.get("spk_embed_dim", 192)),
            chunk_size=int(yaml_data.get("chunk_size", 25)),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise ModelLoadError(f"the CosyVoice3 yaml lacks or mangles a model field: {exc!r}") from exc
