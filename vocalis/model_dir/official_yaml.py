"""Read an official model yaml (`cosyvoice2.yaml`, `cosyvoice3.yaml`) as plain data, and the config fields every
family maps the same way (each family's own mapping: `official_cv2`, `official_cv3`).

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

from vocalis.config import CFMConfig, QwenConfig, SamplingConfig
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
        raw = yaml.load(path.read_text(encoding="utf-8"), Loader=_DataLoader)
    except (OSError, yaml.YAMLError) as exc:
        raise ModelLoadError(f"cannot read {path}: {exc}") from exc
    if not isinstance(raw, dict):
        raise ModelLoadError(f"{path} is not a CosyVoice yaml (top level is not a mapping)")
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


def check_llm_input_size(yaml_data: dict[str, Any], qwen: QwenConfig) -> None:
    if qwen.hidden_size != int(yaml_data.get("llm_input_size", qwen.hidden_size)):
        raise ModelLoadError(
            f"llm_input_size {yaml_data['llm_input_size']} in the yaml differs from the Qwen2 hidden size "
            f"{qwen.hidden_size} in CosyVoice-BlankEN/config.json"
        )


def speech_lm_fields(llm: dict[str, Any], qwen: QwenConfig) -> dict[str, Any]:
    """The speech LM arguments both generations share."""
    return {"qwen": qwen, "speech_token_size": int(llm["speech_token_size"]),
            "mix_ratio": tuple(llm.get("mix_ratio", (5, 15))), "lsm_weight": float(llm.get("lsm_weight", 0.0))}


def sampling_config(llm: dict[str, Any]) -> SamplingConfig:
    sampling = llm.get("sampling", {})
    return SamplingConfig(top_p=float(sampling.get("top_p", 0.8)), top_k=int(sampling.get("top_k", 25)),
                          win_size=int(sampling.get("win_size", 10)), tau_r=float(sampling.get("tau_r", 0.1)))


def cfm_config(cfm: dict[str, Any]) -> CFMConfig:
    params = cfm.get("cfm_params", {})
    params = params.get("content", params)
    return CFMConfig(sigma_min=float(params.get("sigma_min", 1e-6)),
                     training_cfg_rate=float(params.get("training_cfg_rate", 0.2)),
                     inference_cfg_rate=float(params.get("inference_cfg_rate", 0.7)))


def hift_fields(hift: dict[str, Any]) -> dict[str, Any]:
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




def flow_fields(flow: dict[str, Any]) -> dict[str, Any]:
    """The flow arguments both generations share."""
    return {"vocab_size": int(flow["vocab_size"]), "input_size": int(flow["input_size"]),
            "output_size": int(flow["output_size"]), "spk_embed_dim": int(flow["spk_embed_dim"]),
            "token_mel_ratio": int(flow.get("token_mel_ratio", 2))}


def top_fields(yaml_data: dict[str, Any]) -> dict[str, Any]:
    """The whole-model arguments both generations share."""
    return {"sample_rate": int(yaml_data.get("sample_rate", 24000)),
            "spk_embed_dim": int(yaml_data.get("spk_embed_dim", 192))}
