"""Files of the supervised speech tokenizer (the front end serving it is `frontend.speech_tokenizer`).

A model directory carries two files in place of `speech_tokenizer_v2.onnx`:
- `speech_tokenizer.safetensors`: the weights;
- `speech_tokenizer.json`: `{"format_version", "config": SpeechTokenizerConfig, "symbols": SymbolTable}`.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

import torch

from vocalis.checkpoint import load_strict, read_safetensors, write_safetensors
from vocalis.errors import ModelLoadError
from vocalis.models.speech_tokenizer.config import SpeechTokenizerConfig
from vocalis.models.speech_tokenizer.model import SupervisedSpeechTokenizer
from vocalis.models.speech_tokenizer.symbols import SymbolTable

logger = logging.getLogger(__name__)

WEIGHTS_FILE = "speech_tokenizer.safetensors"
CONFIG_FILE = "speech_tokenizer.json"
FORMAT_VERSION = 1


def _files(path: str | os.PathLike) -> tuple[Path, Path]:
    """A directory or the weights file -> (weights path, json path)."""
    path = Path(path)
    weights = path / WEIGHTS_FILE if path.is_dir() else path
    return weights, weights.with_suffix(".json")


def save_speech_tokenizer(
    model: SupervisedSpeechTokenizer, symbols: SymbolTable, path: str | os.PathLike
) -> tuple[Path, Path]:
    """Write weights and JSON (each atomically) to directory `path` or to the weights file `path`."""
    if len(symbols) != model.config.num_symbols:
        raise ValueError(f"symbol table has {len(symbols)} symbols, the model's CTC head {model.config.num_symbols}")
    weights, meta = _files(path)
    weights.parent.mkdir(parents=True, exist_ok=True)
    write_safetensors(model.state_dict(), weights)
    data = {"format_version": FORMAT_VERSION, "config": model.config.to_dict(), "symbols": symbols.to_dict()}
    tmp = meta.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(data, ensure_ascii=False, indent=1), encoding="utf-8")
    tmp.replace(meta)
    return weights, meta


def _read_meta(meta: Path) -> dict[str, Any]:
    try:
        data = json.loads(meta.read_text(encoding="utf-8"))
    except FileNotFoundError as exc:
        raise ModelLoadError(f"missing {meta.name} beside the speech tokenizer weights: {meta}") from exc
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot read speech tokenizer config {meta}: {exc}") from exc
    if not isinstance(data, dict) or data.get("format_version") != FORMAT_VERSION:
        found = data.get("format_version") if isinstance(data, dict) else None
        raise ModelLoadError(
            f"{meta}: unsupported speech tokenizer format_version {found!r}, expected {FORMAT_VERSION}"
        )
    return data


def load_speech_tokenizer(
    path: str | os.PathLike, device: str | torch.device = "cpu"
) -> tuple[SupervisedSpeechTokenizer, SymbolTable]:
    """Directory or weights file -> (model in eval mode without gradients, symbol table)."""
    weights, meta = _files(path)
    data = _read_meta(meta)
    try:
        config = SpeechTokenizerConfig.from_dict(data["config"])
        symbols = SymbolTable.from_dict(data["symbols"])
    except (KeyError, TypeError, ValueError) as exc:
        raise ModelLoadError(f"{meta}: invalid speech tokenizer config: {exc}") from exc
    if len(symbols) != config.num_symbols:
        raise ModelLoadError(f"{meta}: {len(symbols)} symbols but num_symbols is {config.num_symbols}")
    model = SupervisedSpeechTokenizer(config)
    load_strict(model, read_safetensors(weights), weights.name)
    model.to(device).eval().requires_grad_(False)
    return model, symbols
