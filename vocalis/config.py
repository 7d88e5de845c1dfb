"""Architecture and runtime configuration: frozen dataclasses, presets, named constants.

Defaults equal the released CosyVoice2-0.5B model. Derived values are computed by properties or
returned by functions; nothing here is mutated after construction.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

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
class SpeechLMConfig:
    """CosyVoice 2 text-speech LM (`Qwen2LM`): Qwen2 body + speech embedding + speech head."""

    qwen: QwenConfig = field(default_factory=QwenConfig)
    speech_token_size: int = 6561
    mix_ratio: tuple[int, int] = (5, 15)  # text:speech interleaving for bi-streaming
    min_token_text_ratio: float = 2.0
    max_token_text_ratio: float = 20.0
    lsm_weight: float = 0.0

    @property
    def eos_token(self) -> int:
        return self.speech_token_size

    @property
    def fill_token(self) -> int:
        return self.speech_token_size + 2

    @property
    def stop_token_ids(self) -> tuple[int, int, int]:
        n = self.speech_token_size
        return (n, n + 1, n + 2)

    @property
    def num_speech_rows(self) -> int:
        return self.speech_token_size + 3


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


@dataclass(frozen=True, slots=True)
class FlowEncoderConfig:
    """`UpsampleConformerEncoder`: pre-lookahead conv, rel-pos conformer layers, x2 upsample, more layers."""

    input_size: int = 512
    output_size: int = 512
    attention_heads: int = 8
    linear_units: int = 2048
    num_blocks: int = 6
    num_up_blocks: int = 4
    pre_lookahead_len: int = 3
    up_stride: int = 2
    static_chunk_size: int = 25
    dropout_rate: float = 0.1
    positional_dropout_rate: float = 0.1
    attention_dropout_rate: float = 0.1


@dataclass(frozen=True, slots=True)
class EstimatorConfig:
    """`CausalConditionalDecoder`: causal 1-D U-Net with transformer blocks."""

    in_channels: int = 320
    out_channels: int = 80
    channels: tuple[int, ...] = (256,)
    dropout: float = 0.0
    attention_head_dim: int = 64
    n_blocks: int = 4
    num_mid_blocks: int = 12
    num_heads: int = 8
    act_fn: str = "gelu"
    static_chunk_size: int = 50


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
class FlowConfig:
    """`CausalMaskedDiffWithXvec`: speech tokens -> 80-bin mel at 50 Hz."""

    vocab_size: int = 6561
    input_size: int = 512
    output_size: int = 80
    spk_embed_dim: int = 192
    token_mel_ratio: int = TOKEN_MEL_RATIO
    pre_lookahead_len: int = 3
    encoder: FlowEncoderConfig = field(default_factory=FlowEncoderConfig)
    estimator: EstimatorConfig = field(default_factory=EstimatorConfig)
    cfm: CFMConfig = field(default_factory=CFMConfig)


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


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Whole-model architecture; saved as JSON beside the weights."""

    llm: SpeechLMConfig = field(default_factory=SpeechLMConfig)
    flow: FlowConfig = field(default_factory=FlowConfig)
    hift: HiFTConfig = field(default_factory=HiFTConfig)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    sample_rate: int = SAMPLE_RATE
    spk_embed_dim: int = 192
    text_frontend: str = "bpe"  # TEXT_FRONTENDS; "phones": text ids from `vocalis.frontend.phones.text_ids`
    speaker_embedding: str = "encoder"  # SPEAKER_EMBEDDINGS

    def __post_init__(self) -> None:
        if self.text_frontend not in TEXT_FRONTENDS:
            raise ValueError(f"text_frontend must be one of {', '.join(TEXT_FRONTENDS)}, not {self.text_frontend!r}")
        check_speaker_embedding(self.speaker_embedding)
        if self.text_frontend == "phones" and self.llm.qwen.vocab_size < PHONE_TEXT_IDS:
            raise ValueError(f"a phones model needs a text vocabulary of >= {PHONE_TEXT_IDS} ids, "
                             f"this one has {self.llm.qwen.vocab_size}")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelConfig:
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


def tiny_config() -> ModelConfig:
    """A few-MB model with the same structure: tests and the random-weight fallback."""
    return ModelConfig(
        llm=SpeechLMConfig(
            qwen=QwenConfig(
                vocab_size=4096,  # the bundled small BPE (see vocalis/frontend/tokenizer.py)
                hidden_size=64,
                intermediate_size=128,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                max_position_embeddings=4096,
            ),
            speech_token_size=6561,
        ),
        flow=FlowConfig(
            input_size=64,
            encoder=FlowEncoderConfig(
                input_size=64, output_size=64, attention_heads=2, linear_units=128, num_blocks=1, num_up_blocks=1
            ),
            estimator=EstimatorConfig(channels=(32,), attention_head_dim=8, n_blocks=1, num_mid_blocks=1, num_heads=2),
        ),
        hift=HiFTConfig(base_channels=16, f0_cond_channels=16),
    )


def builtin_config() -> ModelConfig:
    """The built-in model shipped in `vocalis/assets/model` (trained on CPU by scripts/train_builtin.sh).

    ~50 MB of fp32 weights in all (with the speech tokenizer): a 729-id speech vocabulary (our FSQ tokenizer's 3^6 "builtin" preset),
    256-d resemblyzer speaker embeddings, the bundled 4096-id BPE.
    """
    speech_vocab, spk_dim = 729, 256
    return ModelConfig(
        llm=SpeechLMConfig(
            qwen=QwenConfig(vocab_size=4096, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096),
            speech_token_size=speech_vocab,
        ),
        flow=FlowConfig(
            vocab_size=speech_vocab,
            input_size=256,
            spk_embed_dim=spk_dim,
            encoder=FlowEncoderConfig(input_size=256, output_size=256, attention_heads=4, linear_units=512,
                                      num_blocks=2, num_up_blocks=2),
            estimator=EstimatorConfig(channels=(128,), attention_head_dim=32, n_blocks=1, num_mid_blocks=2,
                                      num_heads=4),
        ),
        hift=HiFTConfig(base_channels=64, f0_cond_channels=64),
        spk_embed_dim=spk_dim,
    )


def phone_config(config: ModelConfig) -> ModelConfig:
    """`config` reading phones: the phone set as its text vocabulary, the 25 Hz phone-state labels as its speech
    vocabulary (docs/builtin-model.md); every other shape unchanged."""
    qwen = dataclasses.replace(config.llm.qwen, vocab_size=PHONE_TEXT_IDS)
    # Length bounds per text id: a phone (or boundary) id lasts ~1.9 labels (1.5-2.9 over the SLT corpus), so the
    # BPE model's minimum of 2 would force most utterances longer than spoken.
    llm = dataclasses.replace(config.llm, qwen=qwen, speech_token_size=PHONE_LABELS, min_token_text_ratio=1.0,
                              max_token_text_ratio=4.0)
    flow = dataclasses.replace(config.flow, vocab_size=PHONE_LABELS)
    # RAS excludes an id drawn again within its window; a label repeats for each 40 ms of its phone, so only runs
    # longer than the window (0.4 s) may trigger it (the released tau_r cut held-out lengths in range 90 -> 46 %).
    # The LLM samples durations here, not a voice's free prosody: sampled cooler, the labels keep closer to the
    # typical timing of each phone (held-out SLT sentences through the whole model: WER 42.1 % at temperature 1.0
    # and at 0.6, 38.2 % at 0.3, 38.8 % at 0.15).
    sampling = dataclasses.replace(config.sampling, tau_r=1.0, temperature=0.3, follow_phones=True)
    return dataclasses.replace(config, llm=llm, flow=flow, text_frontend="phones", sampling=sampling,
                               speaker_embedding="zeros")


PRESETS: dict[str, ModelConfig] = {
    "cosyvoice2-0.5b": ModelConfig(),
    "tiny": tiny_config(),
    "builtin": builtin_config(),
    "tiny-phones": phone_config(tiny_config()),
    "builtin-phones": phone_config(builtin_config()),  # the phone-based built-in model (the ladder's L2 on)
}
