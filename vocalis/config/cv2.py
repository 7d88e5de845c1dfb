"""CosyVoice 2 (CosyVoice2-0.5B) architecture: frozen dataclasses whose defaults equal the released model, and the
smaller presets built on it (tiny, built-in, phone-reading). Derived values are properties or functions; nothing
here is mutated after construction."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from vocalis.config.shared import (
    PHONE_LABELS,
    PHONE_TEXT_IDS,
    SAMPLE_RATE,
    TEXT_FRONTENDS,
    TOKEN_MEL_RATIO,
    CFMConfig,
    ConfigIO,
    HiFTConfig,
    QwenConfig,
    SamplingConfig,
    SpeechLMShape,
    check_speaker_embedding,
)


@dataclass(frozen=True, slots=True)
class SpeechLMConfig(SpeechLMShape):
    """CosyVoice 2 text-speech LM (`Qwen2LM`): Qwen2 body + speech embedding + speech head."""

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

    @property
    def min_len_mask_id(self) -> int:
        """Masked while fewer than min_len ids were produced: eos (the other stop ids may still end)."""
        return self.eos_token

    @property
    def num_special_rows(self) -> int:
        return 2  # sos, task id: `llm_embedding` rows 0 and 1

    @property
    def sos_id(self) -> int:
        return self.num_speech_rows

    @property
    def task_id(self) -> int:
        return self.num_speech_rows + 1


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
class ModelConfig(ConfigIO):
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
    """The built-in model shipped in `vocalis/assets/model` (trained by recipes/builtin/train_builtin.py).

    ~50 MB of fp32 weights in all (with the speech tokenizer): a 729-id speech vocabulary (our FSQ tokenizer's 3^6
    "builtin" preset),
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
