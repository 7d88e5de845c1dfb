"""Our `Qwen2LM` as a Hugging Face-format Qwen2 directory that vLLM can load (the `vllm` backend's model).

vLLM only ever sees speech ids: the prefill (text, sos/task and prompt speech embeddings) is computed on our side
(`Qwen2LM.prefill_embeddings`) and passed as `prompt_embeds`, and every id vLLM generates and feeds back is a
speech id. So the exported "vocabulary" is the speech table:

    model.embed_tokens.weight   <- speech_embedding.weight   (S, D), S = speech_token_size + 3
    model.layers.*, model.norm  <- the Qwen2 body, same names
    lm_head.weight, lm_head.bias <- llm_decoder (the speech head has a bias, which stock Qwen2 has not: the
                                    worker registers `VocalisSpeechLM`, a Qwen2 model with a biased head)

Qwen's own text table (151936 x D at the 0.5B shapes) and `llm_embedding` are not exported: vLLM never
embeds a text id. Weights are written fp32; vLLM casts them to its `dtype` on load.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from vocalis.models.speech_lm import Qwen2LM

ARCHITECTURE = "VocalisSpeechLM"  # the name the worker registers with vLLM's ModelRegistry
WEIGHTS_FILE = "model.safetensors"


def hf_config(llm: Qwen2LM) -> dict[str, object]:
    """config.json for the exported model (HF Qwen2 field names)."""
    q = llm.config.qwen
    return {
        "architectures": [ARCHITECTURE],
        "model_type": "qwen2",
        "vocab_size": llm.config.num_speech_rows,
        "hidden_size": q.hidden_size,
        "intermediate_size": q.intermediate_size,
        "num_hidden_layers": q.num_hidden_layers,
        "num_attention_heads": q.num_attention_heads,
        "num_key_value_heads": q.num_key_value_heads,
        "head_dim": q.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": q.rms_norm_eps,
        "rope_theta": q.rope_theta,
        "max_position_embeddings": q.max_position_embeddings,
        "tie_word_embeddings": False,
        "use_sliding_window": False,
        "attention_dropout": 0.0,
        "torch_dtype": "float32",
        # no eos: stopping is per request (stop ids in the sampling parameters), never the model's default
        "bos_token_id": None,
        "eos_token_id": None,
    }


def export_state_dict(llm: Qwen2LM) -> dict[str, torch.Tensor]:
    """The tensors of the exported model, HF names -> fp32 CPU copies."""
    out: dict[str, torch.Tensor] = {"model.embed_tokens.weight": llm.speech_embedding.weight}
    for name, tensor in llm.qwen.state_dict().items():
        if name != "embed_tokens.weight":  # the text table: never read by vLLM (see the module doc)
            out["model." + name] = tensor
    out["lm_head.weight"] = llm.llm_decoder.weight
    out["lm_head.bias"] = llm.llm_decoder.bias
    # clone: the engine's packed layout leaves q/k/v and gate/up weights as views of one storage, and
    # safetensors refuses tensors that share storage
    return {k: v.detach().to("cpu", torch.float32).clone() for k, v in out.items()}


def export_for_vllm(llm: Qwen2LM, directory: str | Path) -> Path:
    """Write config.json + model.safetensors for `llm` into `directory` (created); returns it.

    `llm` must hold plain float Linear layers (the vllm backend never swaps the LLM's; int8 ones are refused).
    """
    tensors = export_state_dict(llm)
    layers = [n for n in tensors if n.startswith("model.layers.0.")]
    if len(layers) != 12:  # q/k/v weight+bias, o_proj, gate/up/down, 2 norms: a quantized layer has other names
        raise TypeError(f"layer 0 exports {sorted(layers)}: export the float model, before a precision swap")
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / WEIGHTS_FILE), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(hf_config(llm), indent=2) + "\n")
    return path
