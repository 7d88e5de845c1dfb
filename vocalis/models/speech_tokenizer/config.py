"""Architecture of Vocalis's own supervised speech tokenizer (frozen, saved as JSON beside the weights)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

# The tokenizer reads the 100 Hz Whisper log-mel and writes 25 Hz ids: two stride-2 convolutions.
MEL_FRAMES_PER_TOKEN = 4


@dataclass(frozen=True, slots=True)
class SpeechTokenizerConfig:
    """Mel encoder -> FSQ bottleneck (codebook `fsq_levels ** fsq_dim`) -> CTC decoder over `num_symbols`.

    `num_symbols` counts the CTC blank; it comes from the symbol table the model is trained with.
    The defaults are the `small` preset.
    """

    num_symbols: int
    n_mels: int = 128
    d_model: int = 256
    num_heads: int = 4
    ffn_dim: int = 1024
    encoder_layers: int = 6
    decoder_layers: int = 2
    fsq_levels: int = 3
    fsq_dim: int = 8
    dropout: float = 0.1
    rope_theta: float = 10000.0

    def __post_init__(self) -> None:
        if self.num_symbols < 2:
            raise ValueError(f"num_symbols must count the blank and at least one symbol, got {self.num_symbols}")
        if self.d_model % self.num_heads or (self.d_model // self.num_heads) % 2:
            raise ValueError(f"d_model {self.d_model} must split into {self.num_heads} heads of even size (RoPE)")
        if self.fsq_levels < 2 or self.fsq_dim < 1:
            raise ValueError(f"FSQ needs at least 2 levels and 1 dimension, got {self.fsq_levels} x {self.fsq_dim}")
        if self.encoder_layers < 0 or self.decoder_layers < 0:
            raise ValueError("layer counts must be >= 0")

    @property
    def codebook_size(self) -> int:
        """Number of distinct speech ids, `fsq_levels ** fsq_dim` (6561 = 3^8 like the official tokenizer)."""
        return self.fsq_levels**self.fsq_dim

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SpeechTokenizerConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown speech tokenizer config fields: {unknown}")
        return cls(**data)


# Presets without `num_symbols` (that comes from the symbol table): see `preset_config`.
PRESETS: dict[str, dict[str, Any]] = {
    # tests and smoke runs: ~0.1 M parameters
    "tiny": {"d_model": 64, "num_heads": 2, "ffn_dim": 128, "encoder_layers": 2, "decoder_layers": 1, "dropout": 0.0},
    # the built-in model's tokenizer, trainable on CPU: ~6 M parameters
    "small": {
        "d_model": 256,
        "num_heads": 4,
        "ffn_dim": 1024,
        "encoder_layers": 6,
        "decoder_layers": 2,
        "dropout": 0.1,
    },
    # the built-in model's tokenizer (config.builtin_config): 3^6 = 729 ids, ~2 M parameters
    "builtin": {"d_model": 192, "num_heads": 4, "ffn_dim": 512, "encoder_layers": 4, "decoder_layers": 1,
                "fsq_dim": 6, "dropout": 0.1},
}


def preset_config(name: str, num_symbols: int, **overrides: Any) -> SpeechTokenizerConfig:
    """`SpeechTokenizerConfig` of preset `name` ("tiny", "small") for a symbol table of `num_symbols`."""
    if name not in PRESETS:
        raise ValueError(f"unknown speech tokenizer preset {name!r}; choose from {sorted(PRESETS)}")
    return SpeechTokenizerConfig(num_symbols=num_symbols, **{**PRESETS[name], **overrides})
