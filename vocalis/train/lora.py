"""LoRA on the speech LM through `peft`: inject adapters into the LLM's Linear layers (the base frozen), expose
only the adapter weights to the optimizer and the checkpoints, and turn them into an adapter folder
(`vocalis.adapters.lora_file`) that inference merges or serves.

peft wraps each targeted `nn.Linear` in place (its weight moves to `<path>.base_layer.weight`); the adapter's own
names drop peft's `base_layer` / adapter-name levels, so a saved adapter does not depend on peft.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from vocalis.adapters.lora_file import LORA_TARGETS, AdapterConfig, LoraAdapter, llm_digest

ADAPTER_NAME = "default"


@dataclass(frozen=True, slots=True)
class LoraConfig:
    """`[lora]`: enabled (`vocalis train llm --lora`), rank r, alpha (updates scaled by alpha / r), the Linear
    layers to adapt (names, in every decoder layer), and dropout on the adapter's input while training."""

    enabled: bool = False
    rank: int = 16
    alpha: float = 32.0
    target_modules: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj")
    dropout: float = 0.0

    def __post_init__(self) -> None:
        if self.rank < 1:
            raise ValueError(f"lora.rank must be >= 1, got {self.rank}")
        if self.alpha <= 0:
            raise ValueError(f"lora.alpha must be > 0, got {self.alpha}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"lora.dropout must be in [0, 1), got {self.dropout}")
        unknown = sorted(set(self.target_modules) - set(LORA_TARGETS))
        if unknown or not self.target_modules:
            raise ValueError(f"unknown lora.target_modules {unknown or '(none given)'}; "
                             f"choose from {', '.join(LORA_TARGETS)}")


class LoraWeights(nn.Module):
    """The adapter parameters of a peft-wrapped LLM, shared (not copied), under stable names: what the trainer
    optimises and checkpoints instead of the whole LLM. Keys: `<linear path with / for .>.lora_A.weight`."""

    def __init__(self, llm: nn.Module) -> None:
        super().__init__()
        self.layers = nn.ModuleDict()
        for path, module in _lora_layers(llm).items():
            self.layers[path.replace(".", "/")] = nn.ModuleDict({"lora_A": module.lora_A[ADAPTER_NAME],
                                                                 "lora_B": module.lora_B[ADAPTER_NAME]})

    def tensors(self) -> dict[str, torch.Tensor]:
        """Adapter-file tensors: `<path>.lora_A` (r, in), `<path>.lora_B` (out, r)."""
        out = {}
        for key, pair in self.layers.items():
            path = key.replace("/", ".")
            out[f"{path}.lora_A"] = pair["lora_A"].weight.detach().cpu().clone()
            out[f"{path}.lora_B"] = pair["lora_B"].weight.detach().cpu().clone()
        return out


def _lora_layers(llm: nn.Module) -> dict[str, nn.Module]:
    """Linear path (its name before wrapping) -> peft's LoRA layer."""
    from peft.tuners.lora import LoraLayer

    return {name: m for name, m in llm.named_modules() if isinstance(m, LoraLayer)}


def attach_lora(llm: nn.Module, config: LoraConfig, base_model: str = "") -> tuple[LoraWeights, AdapterConfig]:
    """Freeze `llm` and wrap its target layers with LoRA (in place); returns the adapter weights (the only
    trainable parameters) and the adapter's config, which records the base LLM's digest (taken before wrapping).
    The adapter starts as the identity (B = 0), as LoRA prescribes."""
    from peft import LoraConfig as PeftLoraConfig
    from peft.tuners.lora import LoraModel

    digest = llm_digest(llm)
    llm.requires_grad_(False)
    peft_config = PeftLoraConfig(r=config.rank, lora_alpha=config.alpha, lora_dropout=config.dropout,
                                 target_modules=list(config.target_modules), bias="none")
    LoraModel(llm, peft_config, ADAPTER_NAME)  # injects into `llm` in place; the wrapper itself is not needed
    weights = LoraWeights(llm)
    adapter_config = AdapterConfig(config.rank, config.alpha, tuple(config.target_modules), config.dropout, digest,
                                   base_model)
    return weights, adapter_config


def adapter_of(weights: LoraWeights, config: AdapterConfig, name: str = "") -> LoraAdapter:
    return LoraAdapter(config, weights.tensors(), name)


def merged_state_dict(llm: nn.Module) -> dict[str, torch.Tensor]:
    """The LLM's weights under their plain names, LoRA folded in (W + (alpha / r) B A): what a plain `Qwen2LM`
    loads to run the adapted model (the GRPO rollout copy). A model without LoRA layers: its state_dict."""
    layers = _lora_layers(llm)
    state = llm.state_dict()
    if not layers:
        return state
    out = {k.replace(".base_layer.", "."): v for k, v in state.items() if ".lora_" not in k}
    with torch.no_grad():
        for path, layer in layers.items():
            a, b = layer.lora_A[ADAPTER_NAME].weight, layer.lora_B[ADAPTER_NAME].weight
            out[f"{path}.weight"] = out[f"{path}.weight"] + layer.scaling[ADAPTER_NAME] * (b @ a)
    return out
