"""A LoRA adapter of the speech LM on disk and in memory: `adapter.safetensors` + `adapter.json` in one folder.

The tensors are named by the adapted `nn.Linear`'s path in `Qwen2LM` (`llm.model.model.layers.0.self_attn.q_proj`)
plus `.lora_A` (r, in) and `.lora_B` (out, r); the adapted layer computes W x + b + (alpha / r) B A x. The JSON
holds the LoRA settings and the identity of the base LLM it was trained on (a digest of its weights), so an
adapter is never applied to another base model by mistake.

Legend: r rank, in/out the adapted Linear's widths.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from vocalis.errors import InputError

ADAPTER_WEIGHTS = "adapter.safetensors"
ADAPTER_JSON = "adapter.json"
FORMAT = "vocalis-lora"
# Linear layers of the speech LM that may carry an adapter (names of the modules, as in the checkpoints)
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "llm_decoder")


@dataclass(frozen=True, slots=True)
class AdapterConfig:
    """rank r, alpha (the update is scaled by alpha / r), the adapted module names, the training dropout, and the
    base LLM's identity: `base_digest` (`llm_digest`) and `base_model` (where it was loaded from, for messages)."""

    rank: int
    alpha: float
    target_modules: tuple[str, ...]
    dropout: float
    base_digest: str
    base_model: str = ""

    def __post_init__(self) -> None:
        if self.rank < 1:
            raise ValueError(f"LoRA rank must be >= 1, got {self.rank}")
        unknown = sorted(set(self.target_modules) - set(LORA_TARGETS))
        if unknown or not self.target_modules:
            raise ValueError(f"unknown LoRA target module(s) {unknown or '(none given)'}; "
                             f"choose from {', '.join(LORA_TARGETS)}")

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


@dataclass(frozen=True, slots=True)
class LoraAdapter:
    config: AdapterConfig
    tensors: dict[str, torch.Tensor]  # "<linear path>.lora_A" (r, in) and "<linear path>.lora_B" (out, r)
    name: str = ""

    def layers(self) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """Linear path -> (A (r, in), B (out, r))."""
        paths = sorted({k.rsplit(".", 1)[0] for k in self.tensors})
        return {p: (self.tensors[f"{p}.lora_A"], self.tensors[f"{p}.lora_B"]) for p in paths}


def llm_digest(llm: nn.Module) -> str:
    """sha256 over the LLM's weights (names, dtypes, shapes and bytes, in name order): the base model's identity."""
    h = hashlib.sha256()
    for name, t in sorted(llm.state_dict().items()):
        t = t.detach().cpu().contiguous()
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def save_adapter(adapter: LoraAdapter, directory: str | Path) -> Path:
    """Write `adapter.safetensors` + `adapter.json` into `directory` (created); returns the folder."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().cpu().contiguous() for k, v in adapter.tensors.items()}, str(out / ADAPTER_WEIGHTS))
    meta = {"format": FORMAT, "version": 1, **asdict(adapter.config)}
    (out / ADAPTER_JSON).write_text(json.dumps(meta, indent=1), encoding="utf-8")
    return out


def load_adapter(path: str | Path, name: str | None = None) -> LoraAdapter:
    """An adapter folder (or its `adapter.safetensors` / `adapter.json`); InputError when it is not one."""
    p = Path(path)
    folder = p.parent if p.name in (ADAPTER_WEIGHTS, ADAPTER_JSON) else p
    weights, meta_path = folder / ADAPTER_WEIGHTS, folder / ADAPTER_JSON
    if not weights.is_file() or not meta_path.is_file():
        raise InputError(f"{path} is not a LoRA adapter (needs {ADAPTER_WEIGHTS} and {ADAPTER_JSON})")
    try:
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
        if meta.get("format") != FORMAT:
            raise ValueError(f"format is {meta.get('format')!r}, not {FORMAT!r}")
        config = AdapterConfig(int(meta["rank"]), float(meta["alpha"]), tuple(meta["target_modules"]),
                               float(meta["dropout"]), str(meta["base_digest"]), str(meta.get("base_model", "")))
        tensors = load_file(str(weights))
    except (ValueError, KeyError, TypeError, OSError) as exc:
        raise InputError(f"cannot read the adapter {folder}: {exc}") from None
    adapter = LoraAdapter(config, tensors, name or folder.name)
    for path_, (a, b) in adapter.layers().items():
        if a.shape[0] != config.rank or b.shape[1] != config.rank:
            raise InputError(f"adapter {folder}: {path_} has rank {a.shape[0]}/{b.shape[1]}, its config says "
                             f"{config.rank}")
    return adapter


def check_base(adapter: LoraAdapter, llm: nn.Module, digest: str | None = None) -> None:
    """InputError unless `adapter` was trained on this very LLM (same weights) and fits its layers."""
    digest = digest or llm_digest(llm)
    if adapter.config.base_digest != digest:
        raise InputError(f"adapter {adapter.name!r} was trained on another base model "
                         f"({adapter.config.base_model or 'base digest ' + adapter.config.base_digest[:12]}), "
                         "not on the model loaded")
    modules = dict(llm.named_modules())
    for path, (a, b) in adapter.layers().items():
        linear = modules.get(path)
        if not isinstance(linear, nn.Linear) or (b.shape[0], a.shape[1]) != tuple(linear.weight.shape):
            raise InputError(f"adapter {adapter.name!r}: {path} does not match a Linear layer of the model")


@torch.no_grad()
def merge_adapter(llm: nn.Module, adapter: LoraAdapter) -> None:
    """W += (alpha / r) B A for every adapted layer, in place (the model then runs the adapted weights with no
    extra cost; the base weights are gone from it). Call `check_base` first."""
    modules = dict(llm.named_modules())
    for path, (a, b) in adapter.layers().items():
        weight = modules[path].weight  # type: ignore[union-attr]
        delta = (b.double() @ a.double()) * adapter.config.scale  # (out, in)
        weight.copy_((weight.double() + delta.to(weight.device)).to(weight.dtype))


def load_adapters(specs: Mapping[str, str | Path], llm: nn.Module) -> dict[str, LoraAdapter]:
    """name -> adapter path, each loaded and checked against `llm` (its digest computed once)."""
    digest = llm_digest(llm)
    out = {}
    for name, path in specs.items():
        adapter = load_adapter(path, name)
        check_base(adapter, llm, digest)
        out[name] = adapter
    return out


ADAPTERS_DIR = "adapters"  # a model directory's named adapters: <model>/adapters/<name>/


def resolve_adapter(spec: str | Path, model_dir: Path | None) -> Path:
    """An adapter folder by path, or by name among the model directory's `adapters/` (InputError if neither)."""
    p = Path(spec)
    if p.exists():
        return p
    if model_dir is not None and (model_dir / ADAPTERS_DIR / str(spec)).is_dir():
        return model_dir / ADAPTERS_DIR / str(spec)
    known = sorted(d.name for d in (model_dir / ADAPTERS_DIR).iterdir()) if model_dir is not None and (
        model_dir / ADAPTERS_DIR).is_dir() else []
    raise InputError(f"no adapter {str(spec)!r}: not a folder, nor a name in the model's {ADAPTERS_DIR}/ "
                     f"(known: {', '.join(known) or 'none'})")


def merge_at_load(llm: nn.Module, specs: Mapping[str, str | Path], model_dir: Path | None) -> tuple[str, ...]:
    """One adapter, checked against `llm` and merged into its weights (several: `batched.attach_at_load`)."""
    if len(specs) != 1:
        raise InputError(f"{len(specs)} adapters given; one is merged at load (several: `TTS.load` keeps them apart)")
    adapters = load_adapters({name: resolve_adapter(path, model_dir) for name, path in specs.items()}, llm)
    for adapter in adapters.values():
        merge_adapter(llm, adapter)
    return tuple(adapters)


def random_adapter(llm: nn.Module, name: str, rank: int, targets: tuple[str, ...], seed: int,
                   scale: float = 0.3) -> LoraAdapter:
    """Random A and B (a trained adapter's B is not zero) on every `targets` Linear of `llm`, for tests and
    benchmarks: `scale` sets how far it moves the outputs."""
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for path, m in llm.named_modules():
        if isinstance(m, nn.Linear) and path.rsplit(".", 1)[-1] in targets:
            tensors[f"{path}.lora_A"] = torch.randn(rank, m.in_features, generator=g) * scale
            tensors[f"{path}.lora_B"] = torch.randn(m.out_features, rank, generator=g) * scale
    return LoraAdapter(AdapterConfig(rank, 2.0 * rank, targets, 0.0, llm_digest(llm)), tensors, name)
