"""The bytes one LLM decode step reads (weights, and K/V per context position): the numerator of the decode's
fraction of its memory-bandwidth limit (`bench.bandwidth`)."""

from __future__ import annotations

from vocalis.config import SpeechLMConfig
from vocalis.model_dir.layerwise import meta_build
from vocalis.models.speech_lm import Qwen2LM


def llm_bytes_per_token(config: SpeechLMConfig, precision: str) -> int:
    """Weight bytes one decode step reads: the Qwen2 layers' Linear weights and biases and the speech head at the
    precision's width, the norms in fp32 (not the embedding tables: a step reads one row). Counted on a meta-device
    model, since a quantised module no longer lists its weights as parameters. (int8's per-channel scales and
    offsets, 8 bytes per output channel, are left out: under 0.2 % of its weight bytes.)"""
    per = {"fp32": 4, "bf16": 2, "fp16": 2, "int8": 1}[precision]
    with meta_build():
        llm = Qwen2LM(config)
    linear = sum(p.numel() for n, p in llm.qwen.layers.named_parameters() if "layernorm" not in n)
    linear += sum(p.numel() for p in llm.llm_decoder.parameters())
    norms = sum(p.numel() for n, p in llm.qwen.named_parameters() if "norm" in n)
    return linear * per + norms * 4


def kv_bytes_per_position(config: SpeechLMConfig, precision: str) -> int:
    """K/V cache bytes a decode step reads per context position: every layer's keys and values. The engine's
    cache has the model's activation dtype (fp32 for fp32 and int8, 16-bit for bf16/fp16)."""
    q = config.qwen
    width = 2 if precision in ("bf16", "fp16") else 4
    return q.num_hidden_layers * 2 * q.num_key_value_heads * q.head_dim * width
