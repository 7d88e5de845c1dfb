"""CosyVoice 3 (Fun-CosyVoice3-0.5B) architecture: frozen dataclasses whose field names follow its checkpoints and
yaml, built from the pieces both families share (`vocalis.config.shared`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from vocalis.config.shared import (
    SAMPLE_RATE,
    TOKEN_MEL_RATIO,
    CFMConfig,
    ConfigIO,
    HiFTConfig,
    SamplingConfig,
    SpeechLMShape,
    check_speaker_embedding,
)
from vocalis.errors import InputError

# Extra LLM output rows after the speech codes (sos, eos, task id, fill, then unused); every one of them stops decoding.
CV3_NUM_EXTRA_SPEECH_IDS = 200
# Speech ids the official pipeline treats as silence: from the 6th in a row on they are dropped before token2wav.
CV3_SILENT_TOKEN_IDS = (1, 2, 28, 29, 55, 248, 494, 2241, 2242, 2322, 2323)
CV3_MAX_SILENT_RUN = 5
CV3_SOURCE_NOISE_SAMPLES = 300 * SAMPLE_RATE  # the causal HiFT's fixed source noise: 5 minutes of audio


@dataclass(frozen=True, slots=True)
class CV3SpeechLMConfig(SpeechLMShape):
    """`CosyVoice3LM`: Qwen2 body; sos/eos/task/fill are rows of `speech_embedding`, not a separate table."""

    num_extra_ids: int = CV3_NUM_EXTRA_SPEECH_IDS
    # `<|endofprompt|>` (the official tokenizer's id, hard-coded in `CosyVoice3LM`): bi-streaming feeds the prompt
    # text up to it right after sos; a directory whose tokenizer numbers it otherwise sets this at load
    endofprompt_id: int = 151646

    def __post_init__(self) -> None:
        if self.num_extra_ids < 4:
            raise ValueError("CosyVoice 3 needs at least 4 extra speech ids (sos, eos, task id, fill)")

    @property
    def sos_token(self) -> int:
        return self.speech_token_size

    @property
    def eos_token(self) -> int:
        return self.speech_token_size + 1

    @property
    def task_id_token(self) -> int:
        return self.speech_token_size + 2

    @property
    def fill_token(self) -> int:
        return self.speech_token_size + 3

    @property
    def num_speech_rows(self) -> int:
        """Rows of `speech_embedding` and outputs of `llm_decoder`."""
        return self.speech_token_size + self.num_extra_ids

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        """Every id past the speech codes ends decoding (sos included)."""
        return tuple(range(self.speech_token_size, self.num_speech_rows))

    @property
    def min_len_mask_id(self) -> int:
        """[official] Before min_len the official decoder masks only row V (sos in this layout), not eos: any
        other stop id still ends decoding early."""
        return self.sos_token

    @property
    def sos_id(self) -> int:
        return self.sos_token

    @property
    def task_id(self) -> int:
        return self.task_id_token

    def split_prompt_text(self, prompt_text_ids: Sequence[int]) -> tuple[list[int], list[int]]:
        """The system part up to and including `<|endofprompt|>`, then the rest (a transcript or nothing);
        InputError when the marker is missing (the official loop asserts it)."""
        ids = [int(i) for i in prompt_text_ids]
        if self.endofprompt_id not in ids:
            raise InputError("CosyVoice 3 bi-streaming needs <|endofprompt|> in the prompt text (the system part)")
        k = ids.index(self.endofprompt_id) + 1
        return ids[:k], ids[k:]


@dataclass(frozen=True, slots=True)
class DiTConfig:
    """The CosyVoice 3 flow estimator `DiT`: adaLN-zero transformer over [x, cond, mu, spks]."""

    dim: int = 1024
    depth: int = 22
    heads: int = 16
    dim_head: int = 64
    ff_mult: int = 2
    dropout: float = 0.1  # training only
    mel_dim: int = 80
    mu_dim: int = 80
    spk_dim: int = 80
    out_channels: int = 80
    static_chunk_size: int = 50  # streaming attention block, mel frames (chunk_size 25 tokens * token_mel_ratio 2)
    num_decoding_left_chunks: int = -1  # read from the yaml; the released DiT attends to all left blocks anyway
    time_freq_dim: int = 256  # sinusoidal timestep embedding width (fixed in the official code)
    conv_pos_kernel: int = 31
    conv_pos_groups: int = 16

    def __post_init__(self) -> None:
        if self.dim % self.conv_pos_groups:
            raise ValueError(f"DiT dim {self.dim} must be a multiple of {self.conv_pos_groups} "
                             "(grouped position convs)")
        if self.dim_head % 2:
            raise ValueError("DiT dim_head must be even (rotary pairs)")


@dataclass(frozen=True, slots=True)
class CV3FlowConfig:
    """`CausalMaskedDiffWithDiT`: token embedding -> pre-lookahead layer -> x token_mel_ratio -> CFM with a DiT."""

    vocab_size: int = 6561
    input_size: int = 80
    output_size: int = 80
    spk_embed_dim: int = 192
    token_mel_ratio: int = TOKEN_MEL_RATIO
    pre_lookahead_len: int = 3
    pre_lookahead_channels: int = 1024
    estimator: DiTConfig = field(default_factory=DiTConfig)
    cfm: CFMConfig = field(default_factory=CFMConfig)

    def __post_init__(self) -> None:
        if self.input_size != self.output_size:
            raise ValueError("the CosyVoice 3 flow feeds its token embedding to the decoder: input_size == output_size")


@dataclass(frozen=True, slots=True)
class CausalHiFTConfig(HiFTConfig):
    """`CausalHiFTGenerator`: HiFT with causal convolutions, a causal F0 predictor and fixed source noise."""

    conv_pre_look_right: int = 4  # mel frames conv_pre reads to the right
    f0_look_right: int = 3  # mel frames the F0 predictor's first conv reads to the right (kernel 4)
    source_noise_samples: int = CV3_SOURCE_NOISE_SAMPLES


@dataclass(frozen=True, slots=True)
class CosyVoice3Config(ConfigIO):
    """Whole CosyVoice 3 architecture (Fun-CosyVoice3-0.5B shapes by default)."""

    llm: CV3SpeechLMConfig = field(default_factory=CV3SpeechLMConfig)
    flow: CV3FlowConfig = field(default_factory=CV3FlowConfig)
    hift: CausalHiFTConfig = field(default_factory=CausalHiFTConfig)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    sample_rate: int = SAMPLE_RATE
    spk_embed_dim: int = 192
    chunk_size: int = 25  # streaming token hop (tokens)
    speaker_embedding: str = "encoder"  # SPEAKER_EMBEDDINGS (the official model reads CAM++ x-vectors)

    def __post_init__(self) -> None:
        check_speaker_embedding(self.speaker_embedding)


CV3_PRESETS: dict[str, CosyVoice3Config] = {
    "cosyvoice3-0.5b": CosyVoice3Config(),
}
