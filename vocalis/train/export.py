"""`vocalis average` and `vocalis export`: training checkpoints -> an averaged checkpoint -> a model directory.

Export starts from a base model (the directory a run fine-tuned, or a random model at the run's preset),
replaces the parts the checkpoints trained (llm, flow, hift; strictly by name and shape), and writes our
layout with `save_vocalis`. A trained speech tokenizer is written beside it as `speech_tokenizer.safetensors`
+ `.json`. Discriminator weights stay in the checkpoints: inference never needs them.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from vocalis.checkpoint import load_strict
from vocalis.errors import InputError
from vocalis.train import checkpointing as ckpt

log = logging.getLogger(__name__)

TTS_PARTS = ("llm", "flow", "hift")


def average(paths: list[Path], out: Path) -> Path:
    """Mean weights of several checkpoints of one run, saved as a weights-only checkpoint (usable by export
    and as `model.checkpoint`)."""
    last = ckpt.load_checkpoint(paths[-1])
    state = {k: last.get(k) for k in ("task", "config", "model_config", "extra", "step", "epoch")}
    state["models"] = ckpt.average_models(paths)
    state["averaged_from"] = [str(p) for p in paths]
    ckpt.save_atomic(state, out)
    log.info("averaged %d checkpoints -> %s", len(paths), out)
    return out


def last_checkpoints(run_dir: Path, n: int) -> list[Path]:
    found = ckpt.list_checkpoints(run_dir)
    if not found:
        raise InputError(f"no checkpoints in {run_dir / ckpt.CHECKPOINT_DIR}")
    return found[-n:]


def _base_model(base: str | None, states: list[dict[str, Any]]):  # -> LoadedModel
    from vocalis.model_dir import load_model, random_model

    if base is None:
        for s in states:
            init = (s.get("config") or {}).get("model", {}).get("init_from")
            if init:
                base = init
                break
    if base is not None:
        return load_model(base), Path(base)
    preset = next(((s.get("config") or {}).get("model", {}).get("preset") for s in states if s.get("config")), "tiny")
    log.info("no base model directory: starting from a random %r model for the parts not trained", preset)
    return random_model(preset), None


def export(checkpoints: list[Path], out: Path, base: str | None = None) -> Path:
    from vocalis.config import ModelConfig
    from vocalis.model_dir import BUNDLED_TOKENIZER, save_vocalis
    from vocalis.train.features import find_tokenizer_dir

    if out.exists():
        raise InputError(f"output directory already exists: {out}")
    states = [ckpt.load_checkpoint(p) for p in checkpoints]
    trained: dict[str, tuple[Path, dict[str, Any]]] = {}
    for path, state in zip(checkpoints, states):
        for name in state.get("models", {}):
            if name in trained:
                raise InputError(f"both {trained[name][0]} and {path} hold {name!r} weights; pass one of them")
            trained[name] = (path, state)
    tts = [n for n in TTS_PARTS if n in trained]
    if not tts and "tokenizer" not in trained:
        raise InputError("the checkpoints hold none of llm, flow, hift or tokenizer weights")
    if tts:
        model, base_dir = _base_model(base, [trained[n][1] for n in tts])
        for name in tts:
            path, state = trained[name]
            if state.get("model_config") and ModelConfig.from_dict(state["model_config"]) != model.config:
                raise InputError(f"{path} was trained with another architecture than the base model's; "
                                 "pass --base with the directory the run started from")
            load_strict(getattr(model, name), state["models"][name], f"{path}:{name}")
        tok_src = BUNDLED_TOKENIZER
        if base_dir is not None:
            try:
                tok_src = find_tokenizer_dir(base_dir)
            except InputError:  # a token-level model directory: the export has no text tokenizer either
                log.warning("%s has no text tokenizer files; the export has none", base_dir)
                tok_src = base_dir
        save_vocalis(model, out, tokenizer_src=tok_src, frontend_src=base_dir)
        log.info("exported %s (trained: %s) -> %s", model.describe(), ", ".join(tts), out)
    if "tokenizer" in trained:
        _export_tokenizer(*trained["tokenizer"], out)
    return out


def _export_tokenizer(path: Path, state: dict[str, Any], out: Path) -> None:
    from vocalis.models.speech_tokenizer import (
        SpeechTokenizerConfig,
        SupervisedSpeechTokenizer,
        SymbolTable,
        save_speech_tokenizer,
    )

    extra = state.get("extra") or {}
    if "tokenizer_config" not in extra or "symbols" not in extra:
        raise InputError(f"{path} lacks the tokenizer's config and symbol table")
    model = SupervisedSpeechTokenizer(SpeechTokenizerConfig.from_dict(extra["tokenizer_config"]))
    load_strict(model, state["models"]["tokenizer"], f"{path}:tokenizer")
    out.mkdir(parents=True, exist_ok=True)
    weights, _ = save_speech_tokenizer(model, SymbolTable.from_dict(extra["symbols"]), out)
    log.info("exported the speech tokenizer -> %s", weights)


def merge_adapter_into(adapter_path: Path, out: Path, base: str | None = None) -> Path:
    """`vocalis train merge-adapter`: the base model with the adapter folded into its LLM weights, written as a
    model directory. The base defaults to the directory the adapter's run fine-tuned; it must be the very model
    the adapter was trained on."""
    from vocalis.adapters.lora_file import check_base, load_adapter, merge_adapter
    from vocalis.model_dir import load_model, save_vocalis
    from vocalis.train.features import find_tokenizer_dir

    if out.exists():
        raise InputError(f"output directory already exists: {out}")
    adapter = load_adapter(adapter_path)
    base = base or adapter.config.base_model
    if not base or not Path(base).is_dir():
        raise InputError(f"the base model {base!r} is not a directory: pass --base with the model the adapter was "
                         "trained on")
    model = load_model(base)
    check_base(adapter, model.llm)
    merge_adapter(model.llm, adapter)
    try:
        tok_src = find_tokenizer_dir(Path(base))
    except InputError:  # a token-level model directory: the merged one has no text tokenizer either
        tok_src = Path(base)
    save_vocalis(model, out, tokenizer_src=tok_src, frontend_src=Path(base))
    log.info("merged adapter %s into %s -> %s", adapter_path, base, out)
    return out
