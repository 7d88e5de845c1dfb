"""Training configuration: frozen dataclasses built from plain data (TOML, JSON or YAML) plus CLI overrides.

A file holds nested tables named like the fields below (`[trainer]`, `[optim]`, `[data]`, ...); an override
`section.key=value` replaces one value, the value parsed as YAML (`3`, `1e-4`, `true`, `[1, 2]`, `null`).
Unknown keys are errors that name the key path. YAML is read with `safe_load`: data only, no object tags.
"""

from __future__ import annotations

import dataclasses
import json
import tomllib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from vocalis.errors import InputError
from vocalis.train.data import TASKS, DataConfig
from vocalis.train.lora import LoraConfig
from vocalis.train.policy_config import DPOConfig, GRPOConfig, PolicyConfig
from vocalis.train.schedulers import SchedulerConfig

PRECISIONS = ("fp32", "bf16", "fp16")
ENGINES = ("ddp", "deepspeed")


@dataclass(frozen=True, slots=True)
class OptimConfig:
    name: str = "adamw"  # adam | adamw
    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0


@dataclass(frozen=True, slots=True)
class ModelInitConfig:
    init_from: str | None = None  # a model directory (official CosyVoice2 or Vocalis) to fine-tune
    preset: str = "tiny"  # architecture of a random initialisation (when init_from is None)
    checkpoint: str | None = None  # a training checkpoint whose weights start this run (not a resume)
    hift_channels: int | None = None  # HiFT base channels of a random initialisation when not the preset's

    def __post_init__(self) -> None:
        if self.hift_channels is not None and self.hift_channels < 8:
            raise ValueError(f"model.hift_channels must be >= 8, got {self.hift_channels}")


@dataclass(frozen=True, slots=True)
class LLMTaskConfig:
    bistream_prob: float = 0.5  # share of eligible samples trained as 5:15 text-speech interleaving
    label_smoothing: float | None = None  # None: the model config's lsm_weight
    dropout: float = 0.0  # residual dropout in the Qwen2 layers while training (Qwen2Model.set_residual_dropout)

    def __post_init__(self) -> None:
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"llm.dropout must be in [0, 1), got {self.dropout}")


@dataclass(frozen=True, slots=True)
class HiFTTaskConfig:
    discriminator_lr: float | None = None  # None: optim.lr
    mel_weight: float = 45.0
    feature_weight: float = 2.0
    tpr_weight: float = 1.0
    f0_weight: float = 1.0
    adversarial: str = "lsgan"  # lsgan (official) | hinge | none (warm-up: mel and F0 losses only, no critic)
    extra_mel_ffts: tuple[int, ...] = ()  # more log-mel L1 windows beside the official 1920 (e.g. [512, 1024])
    stft_weight: float = 0.0  # multi-resolution STFT loss (spectral convergence + log magnitude); 0: off (official)
    stft_resolutions: tuple[tuple[int, int, int], ...] = ((512, 50, 240), (1024, 120, 600), (2048, 240, 1200))
    # discriminator sizes (defaults: the official recipe; tests shrink them)
    periods: tuple[int, ...] = (2, 3, 5, 7, 11)
    period_channels: tuple[int, ...] = (32, 128, 512, 1024, 1024)
    spec_channels: int = 32
    # the spectrogram critics' STFTs (n_fft, hop, win); [] leaves the multi-period critic alone, ~10x cheaper on a
    # CPU (the spectrogram critics' wide 2-D convolutions cost most of a GAN step there)
    spec_resolutions: tuple[tuple[int, int, int], ...] = ((1024, 120, 600), (2048, 240, 1200), (512, 50, 240))


@dataclass(frozen=True, slots=True)
class TokenizerTaskConfig:
    preset: str = "tiny"  # architecture of a new speech tokenizer ("tiny", "small")
    unit: str = "char"  # CTC targets: "char", "latin" (Hanzi as pinyin letters) or "phoneme" (espeak-ng)
    init_from: str | None = None  # start from a saved tokenizer (speech_tokenizer.safetensors + .json)
    # False: FSQ values pass unrounded (a warm-up run; a later run with init_from makes them discrete). A cold
    # start through the rounding tends to collapse to one constant code before CTC leaves its blank plateau.
    quantize: bool = True


@dataclass(frozen=True, slots=True)
class LabellerTaskConfig:
    preset: str = "builtin"  # architecture (models.speech_tokenizer.labeller.LABELLER_PRESETS)


@dataclass(frozen=True, slots=True)
class TrainerConfig:
    out_dir: str = "exp"
    max_steps: int = 0  # optimizer steps; 0 = run max_epochs
    max_epochs: int = 1
    accum_grad: int = 1
    grad_clip: float = 5.0  # 0 = no clipping (the norm is still logged)
    precision: str = "fp32"
    gradient_checkpointing: bool = False
    log_every: int = 10
    save_every: int = 0  # steps; 0 = at the end of each epoch only
    keep_checkpoints: int = 0  # 0 = keep all
    seed: int = 0
    device: str = "auto"  # auto | cpu | cuda
    num_threads: int = 0  # torch intra-op threads per process; 0 = torch's default
    engine: str = "ddp"
    tensorboard: bool = True
    resume: str | None = None  # "auto" = the newest checkpoint in out_dir, or a checkpoint path
    deepspeed_config: str | None = None  # a DeepSpeed JSON; default: ZeRO-2 built from these settings

    def __post_init__(self) -> None:
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, not {self.precision!r}")
        if self.engine not in ENGINES:
            raise ValueError(f"engine must be one of {', '.join(ENGINES)}, not {self.engine!r}")
        if self.accum_grad < 1:
            raise ValueError("accum_grad must be >= 1")


@dataclass(frozen=True, slots=True)
class TrainConfig:
    task: str = "llm"
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    model: ModelInitConfig = field(default_factory=ModelInitConfig)
    llm: LLMTaskConfig = field(default_factory=LLMTaskConfig)
    hift: HiFTTaskConfig = field(default_factory=HiFTTaskConfig)
    tokenizer: TokenizerTaskConfig = field(default_factory=TokenizerTaskConfig)
    labeller: LabellerTaskConfig = field(default_factory=LabellerTaskConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    dpo: DPOConfig = field(default_factory=DPOConfig)
    grpo: GRPOConfig = field(default_factory=GRPOConfig)

    def __post_init__(self) -> None:
        if self.task not in TASKS:
            raise ValueError(f"task must be one of {', '.join(TASKS)}, not {self.task!r}")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def read_data_file(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise InputError(f"config file not found: {path}")
    text = path.read_text(encoding="utf-8")
    try:
        if path.suffix == ".toml":
            data = tomllib.loads(text)
        elif path.suffix == ".json":
            data = json.loads(text)
        elif path.suffix in (".yaml", ".yml"):
            data = yaml.safe_load(text) or {}
        else:
            raise InputError(f"config {path}: use .toml, .json or .yaml")
    except (tomllib.TOMLDecodeError, json.JSONDecodeError, yaml.YAMLError) as exc:
        raise InputError(f"config {path} does not parse: {exc}") from exc
    if not isinstance(data, dict):
        raise InputError(f"config {path} must hold a table/object at the top level")
    return data


def apply_override(data: dict[str, Any], override: str) -> None:
    """`a.b.c=value` -> data["a"]["b"]["c"] = yaml(value), creating tables on the way."""
    key, sep, raw = override.partition("=")
    if not sep or not key:
        raise InputError(f"override {override!r} is not key=value (e.g. trainer.max_steps=100)")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    node = data
    parts = key.strip().split(".")
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise InputError(f"override {override!r}: {part!r} is a value, not a table")
    node[parts[-1]] = value


def _coerce(tp: Any, value: Any, where: str) -> Any:
    origin = typing.get_origin(tp)
    if origin in (types.UnionType, typing.Union):
        if value is None and type(None) in typing.get_args(tp):
            return None
        inner = [a for a in typing.get_args(tp) if a is not type(None)]
        return _coerce(inner[0], value, where)
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise InputError(f"config {where}: expected a table")
        return from_plain(tp, value, where)
    if origin is tuple:
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, (list, tuple)):
            raise InputError(f"config {where}: expected a list")
        args = typing.get_args(tp)
        item = args[0] if args else Any
        return tuple(_coerce(item if args[-1] is Ellipsis or len(args) == 1 else args[i], v, where)
                     for i, v in enumerate(value))
    if tp is float and isinstance(value, (int, float, str)) and not isinstance(value, bool):
        try:
            return float(value)  # YAML 1.1 reads `1e-4` (no dot) as a string
        except ValueError:
            raise InputError(f"config {where}: expected a number, got {value!r}") from None
    if tp in (int, str, bool) and not isinstance(value, tp) or (tp is int and isinstance(value, bool)):
        raise InputError(f"config {where}: expected {tp.__name__}, got {value!r}")
    return value


def from_plain(cls: type, data: dict[str, Any], where: str = "") -> Any:
    """Nested plain data -> frozen dataclass `cls`; unknown keys and wrong types are InputErrors."""
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise InputError(f"config {where or 'top level'}: unknown keys {unknown}; known: {sorted(names)}")
    kwargs = {k: _coerce(hints[k], v, f"{where}.{k}" if where else k) for k, v in data.items()}
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as exc:
        raise InputError(f"config {where or 'top level'}: {exc}") from exc


# A preference or policy run fine-tunes a trained model for tens to hundreds of steps: its learning rate holds from
# the first step, where the pretraining schedule's default warmup (2500 steps) would keep it near zero throughout
POLICY_SCHEDULER = {"name": "constant", "warmup_steps": 0}


def load_config(path: str | Path | None, overrides: list[str] | tuple[str, ...] = (), task: str | None = None) -> TrainConfig:
    data = read_data_file(path) if path else {}
    if task is not None:
        data["task"] = task
    if data.get("task") in ("dpo", "grpo"):
        data["scheduler"] = {**POLICY_SCHEDULER, **data.get("scheduler", {})}
    for override in overrides:
        apply_override(data, override)
    return from_plain(TrainConfig, data)
