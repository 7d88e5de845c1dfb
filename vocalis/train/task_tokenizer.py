"""Speech tokenizer task: CTC on transcripts behind an FSQ bottleneck (`SupervisedSpeechTokenizer.loss`), so
Vocalis can build its own 25 Hz speech ids without the official ONNX tokenizer.

The symbol table (characters or espeak-ng phonemes) is built from the training transcripts when training
starts, or taken from `tokenizer.init_from`; it is saved in every checkpoint and checked on resume.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
from torch import nn

from vocalis.errors import InputError
from vocalis.models.speech_tokenizer import (
    SupervisedSpeechTokenizer,
    SymbolTable,
    load_speech_tokenizer,
    preset_config,
)
from vocalis.models.speech_tokenizer.symbols import UNITS
from vocalis.train.config import TrainConfig
from vocalis.train.data import Batch
from vocalis.train.task import StepContext, Task, Wrap

log = logging.getLogger(__name__)


def transcripts(shards: list[Path]) -> list[str]:
    import pyarrow.parquet as pq

    return [t for s in shards for t in pq.read_table(s, columns=["text"]).column("text").to_pylist()]


class TargetEncoder:
    """Picklable (text, language) -> symbol ids, for the DataLoader workers."""

    def __init__(self, symbols: SymbolTable) -> None:
        self.symbols = symbols

    def __call__(self, text: str, language: str) -> list[int]:
        return self.symbols.encode_text(text, None if language == "auto" else language)


class TokenizerObjective(nn.Module):
    def __init__(self, model: SupervisedSpeechTokenizer, quantize: bool = True) -> None:
        super().__init__()
        self.model = model
        self.quantize = quantize

    def forward(self, batch: Batch) -> tuple[torch.Tensor, dict[str, float]]:
        mel = batch.mel.transpose(1, 2)  # (B, 128, T100)
        mel_len = (batch.mel_len).clamp(min=1)
        return self.model.loss(mel, mel_len, batch.target, batch.target_len, self.quantize)


class TokenizerTask(Task):
    name = "tokenizer"
    model_config = None

    def __init__(self, config: TrainConfig, shards: list[Path]) -> None:
        c = config.tokenizer
        if c.init_from:
            model, self.symbols = load_speech_tokenizer(c.init_from)
            model.train().requires_grad_(True)
        else:
            if c.unit not in UNITS:
                raise InputError(f"tokenizer.unit must be one of {UNITS}, not {c.unit!r}")
            self.symbols = SymbolTable.from_texts(transcripts(shards), unit=c.unit)  # type: ignore[arg-type]
            try:
                model = SupervisedSpeechTokenizer(preset_config(c.preset, len(self.symbols)))
            except ValueError as exc:
                raise InputError(str(exc)) from exc
        log.info("speech tokenizer: %d symbols (%s), codebook %d", len(self.symbols), self.symbols.unit,
                 model.codebook_size)
        self.modules = {"tokenizer": model}
        self.objective: nn.Module = TokenizerObjective(model, c.quantize)

    def wrap(self, wrap: Wrap) -> None:
        self.objective = wrap(self.objective)

    def target_encoder(self) -> TargetEncoder:
        return TargetEncoder(self.symbols)

    def checkpointed_layers(self):
        m = self.modules["tokenizer"]
        for stack in (m.encoder, m.decoder):
            yield from getattr(stack, "layers", ())

    def extra_state(self) -> dict[str, Any]:
        return {"symbols": self.symbols.to_dict(), "tokenizer_config": self.modules["tokenizer"].config.to_dict()}

    def load_extra_state(self, state: dict[str, Any]) -> None:
        saved = state.get("symbols")
        if saved is not None and list(saved["symbols"]) != list(self.symbols.symbols):
            raise InputError("the checkpoint's symbol table differs from this run's (different transcripts?)")

    def micro_step(self, batch: Batch, ctx: StepContext) -> dict[str, float]:
        with ctx.autocast():
            loss, metrics = self.objective(batch)
        ctx.backward(loss, "main")
        ctx.update("main")
        return {"loss": float(loss.detach()), **{k: v for k, v in metrics.items() if k != "ctc"}}
