"""What every model family's configuration is built from: the audio rates, file names and vocabularies they share,
the Qwen2 body, sampling, the flow-matching solver, the HiFT vocoder, the streaming schedule, and reading a
frozen dataclass back from plain data."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Self

# Audio rates shared by every stage.
SAMPLE_RATE = 24000  # HiFT output rate
TOKEN_RATE = 25  # speech tokens per second
MEL_RATE = 50  # mel frames per second
TOKEN_MEL_RATIO = 2  # mel frames per speech token
SAMPLES_PER_MEL_FRAME = SAMPLE_RATE // MEL_RATE  # 480
PROMPT_SAMPLE_RATE_16K = 16000  # speech tokenizer and speaker encoder input rate
MAX_PROMPT_SECONDS = 30.0  # speech tokenizer limit
ENDOFPROMPT_TOKEN = "<|endofprompt|>"
ENDOFSYSTEM_TOKEN = "<|endofsystem|>"  # CosyVoice 3 only
# The frontend models of a released model directory (ONNX): speech tokenizer (CosyVoice 2, CosyVoice 3: the same
# interface) and the CAM++ speaker encoder.
SPEECH_TOKENIZER_ONNX = "speech_tokenizer_v2.onnx"
CV3_SPEECH_TOKENIZER_ONNX = "speech_tokenizer_v3.onnx"
CAMPPLUS_ONNX = "campplus.onnx"
# What the LLM reads text as: Qwen2 BPE ids (the official model) or the built-in model's phone ids.
TEXT_FRONTENDS = ("bpe", "phones")
# Where a prompt's x-vector comes from: the directory's speaker encoder (CAM++), or zeros for a flow trained with
# zero x-vectors (the phone model: a cloned voice is its prompt mel alone and needs no encoder).
SPEAKER_EMBEDDINGS = ("encoder", "zeros")
# The phone frontend's vocabularies (`vocalis.frontend.phones`: NUM_TEXT_IDS, NUM_LABELS; a test checks they agree).
PHONE_TEXT_IDS = 67
PHONE_LABELS = 114  # 25 Hz phone-state labels: the phone-based model's speech ids



@dataclass(frozen=True, slots=True)
class QwenConfig:
    """Qwen2 decoder body (Qwen2.5-0.5B shapes by default)."""

    vocab_size: int = 151936
    hidden_size: int = 896
    intermediate_size: int = 4864
    num_hidden_layers: int = 24
    num_attention_heads: int = 14
    num_key_value_heads: int = 2
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1e6
    max_position_embeddings: int = 32768
    tie_word_embeddings: bool = True

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_attention_heads:
            raise ValueError("hidden_size must be divisible by num_attention_heads")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be divisible by num_key_value_heads")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads


@dataclass(frozen=True, slots=True)
class SpeechLMShape:
    """What the families' text-speech LMs share: a Qwen2 body reading text ids, then speech ids.

    Each family's subclass declares what differs (the LLM engine reads only these): its speech rows and stop ids,
    the id masked before min_len, where sos and the task id live in the engine's one id space (`sos_id`,
    `task_id`, and `num_special_rows` rows of a separate table numbered after the speech rows), and what of a
    prompt text is fed right after sos when text arrives in pieces (`split_prompt_text`).
    """

    qwen: QwenConfig = field(default_factory=QwenConfig)
    speech_token_size: int = 6561
    mix_ratio: tuple[int, int] = (5, 15)  # text:speech interleaving for bi-streaming
    min_token_text_ratio: float = 2.0
    max_token_text_ratio: float = 20.0
    lsm_weight: float = 0.0

    @property
    def num_speech_rows(self) -> int:
        """Rows of `speech_embedding` and outputs of `llm_decoder`: the speech codes, then the family's extra ids."""
        raise NotImplementedError

    @property
    def eos_token(self) -> int:
        raise NotImplementedError

    @property
    def fill_token(self) -> int:
        """The id that ends each run of generated speech when text arrives in pieces."""
        raise NotImplementedError

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        raise NotImplementedError

    @property
    def min_len_mask_id(self) -> int:
        """The one id masked while fewer than min_len ids were produced."""
        raise NotImplementedError

    @property
    def sos_id(self) -> int:
        """sos in the engine's id space (`vocalis.engine.id_space`)."""
        raise NotImplementedError

    @property
    def task_id(self) -> int:
        raise NotImplementedError

    @property
    def num_special_rows(self) -> int:
        """Rows of the separate sos / task id table (`llm_embedding`), numbered after the speech rows; 0: none."""
        return 0

    def split_prompt_text(self, prompt_text_ids: Sequence[int]) -> tuple[list[int], list[int]]:
        """(fed right after sos when text arrives in pieces, text like any other): nothing before by default."""
        return [], [int(i) for i in prompt_text_ids]


@dataclass(frozen=True, slots=True)
class SamplingConfig:
    """Repetition-aware sampling (RAS) defaults of the released model."""

    top_p: float = 0.8
    top_k: int = 25
    win_size: int = 10
    tau_r: float = 0.1
    temperature: float = 1.0
    # A phone model's labels spell its text's phones in order: draw only labels that continue the spelling
    # (`vocalis.engine.label_path`), so that the model chooses durations and pauses, never skips or repeats words
    follow_phones: bool = False
    # Runaway guard: a sentence stops once its last this many speech ids (5 s) repeat one short cycle of ids,
    # a degenerate loop that RAS alone does not always break (0: off). Long enough never to cut real speech
    stop_cycle_span: int = 125


@dataclass(frozen=True, slots=True)
class CFMConfig:
    """Conditional flow matching: Euler solver, cosine schedule, classifier-free guidance."""

    n_timesteps: int = 10
    sigma_min: float = 1e-6
    training_cfg_rate: float = 0.2
    inference_cfg_rate: float = 0.7
    noise_frames: int = 15000  # fixed start noise, 5 minutes of mel
    noise_seed: int = 0


@dataclass(frozen=True, slots=True)
class HiFTConfig:
    """`HiFTGenerator`: NSF source + iSTFT HiFi-GAN vocoder."""

    in_channels: int = 80
    base_channels: int = 512
    nb_harmonics: int = 8
    sampling_rate: int = SAMPLE_RATE
    nsf_alpha: float = 0.1
    nsf_sigma: float = 0.003
    nsf_voiced_threshold: float = 10.0
    upsample_rates: tuple[int, ...] = (8, 5, 3)
    upsample_kernel_sizes: tuple[int, ...] = (16, 11, 7)
    istft_n_fft: int = 16
    istft_hop_len: int = 4
    resblock_kernel_sizes: tuple[int, ...] = (3, 7, 11)
    resblock_dilation_sizes: tuple[tuple[int, ...], ...] = ((1, 3, 5), (1, 3, 5), (1, 3, 5))
    source_resblock_kernel_sizes: tuple[int, ...] = (7, 7, 11)
    source_resblock_dilation_sizes: tuple[tuple[int, ...], ...] = ((1, 3, 5), (1, 3, 5), (1, 3, 5))
    lrelu_slope: float = 0.1
    audio_limit: float = 0.99
    f0_num_class: int = 1
    f0_cond_channels: int = 512

    @property
    def hop_samples(self) -> int:
        """Output samples per input mel frame."""
        n = self.istft_hop_len
        for r in self.upsample_rates:
            n *= r
        return n


@dataclass(frozen=True, slots=True)
class StreamConfig:
    """Streaming token2wav schedule and caches (per request; never written back)."""

    token_hop_len: int = 25
    token_max_hop_len: int = 100
    stream_scale_factor: int = 2
    pre_lookahead_len: int = 3
    mel_cache_len: int = 8
    source_cache_len: int = 8 * SAMPLES_PER_MEL_FRAME

    def grown_hop(self, hop: int) -> int:
        """The hop after a chunk of hop `hop` (its prompt padding aside): grown by the scale factor, up to the most."""
        return min(self.token_max_hop_len, hop * self.stream_scale_factor)


class ConfigIO:
    """A whole-model config's plain-data face (JSON beside the weights)."""

    __slots__ = ()

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)  # type: ignore[call-overload]

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Self:
        return config_from_dict(cls, data)


def check_speaker_embedding(value: str) -> None:
    if value not in SPEAKER_EMBEDDINGS:
        raise ValueError(f"speaker_embedding must be one of {', '.join(SPEAKER_EMBEDDINGS)}, not {value!r}")


def config_from_dict(cls: type, data: dict[str, Any]) -> Any:
    """Rebuild a (nested) frozen dataclass from plain data; unknown keys are an error."""
    names = {f.name: f for f in dataclasses.fields(cls)}
    unknown = set(data) - set(names)
    if unknown:
        raise ValueError(f"unknown {cls.__name__} fields: {sorted(unknown)}")
    kwargs: dict[str, Any] = {}
    for name, value in data.items():
        default = names[name].default_factory if names[name].default_factory is not dataclasses.MISSING else None
        proto = default() if default is not None else names[name].default
        if dataclasses.is_dataclass(proto) and isinstance(value, dict):
            kwargs[name] = config_from_dict(type(proto), value)
        elif isinstance(value, list):
            kwargs[name] = tuple(tuple(v) if isinstance(v, list) else v for v in value)
        else:
            kwargs[name] = value
    return cls(**kwargs)
