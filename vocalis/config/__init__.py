"""Architecture and runtime configuration: frozen dataclasses, presets, named constants.

`shared` holds what every model family is built from; `cv2` (CosyVoice 2, the released CosyVoice2-0.5B's
defaults) and `cv3` (CosyVoice 3, Fun-CosyVoice3-0.5B's) one family each. The names below are the package's face.
"""

from vocalis.config.cv2 import (
    PRESETS,
    EstimatorConfig,
    FlowConfig,
    FlowEncoderConfig,
    ModelConfig,
    SpeechLMConfig,
    builtin_config,
    phone_config,
    tiny_config,
)
from vocalis.config.cv3 import (
    CV3_MAX_SILENT_RUN,
    CV3_NUM_EXTRA_SPEECH_IDS,
    CV3_PRESETS,
    CV3_SILENT_TOKEN_IDS,
    CV3_SOURCE_NOISE_SAMPLES,
    CausalHiFTConfig,
    CosyVoice3Config,
    CV3FlowConfig,
    CV3SpeechLMConfig,
    DiTConfig,
)
from vocalis.config.shared import (
    CAMPPLUS_ONNX,
    CV3_SPEECH_TOKENIZER_ONNX,
    ENDOFPROMPT_TOKEN,
    ENDOFSYSTEM_TOKEN,
    MAX_PROMPT_SECONDS,
    MEL_RATE,
    PHONE_LABELS,
    PHONE_TEXT_IDS,
    PROMPT_SAMPLE_RATE_16K,
    SAMPLE_RATE,
    SAMPLES_PER_MEL_FRAME,
    SPEAKER_EMBEDDINGS,
    SPEECH_TOKENIZER_ONNX,
    TEXT_FRONTENDS,
    TOKEN_MEL_RATIO,
    TOKEN_RATE,
    CFMConfig,
    ConfigIO,
    HiFTConfig,
    QwenConfig,
    SamplingConfig,
    SpeechLMShape,
    StreamConfig,
    check_speaker_embedding,
    config_from_dict,
)

__all__ = [
    "CAMPPLUS_ONNX", "CV3_MAX_SILENT_RUN", "CV3_NUM_EXTRA_SPEECH_IDS", "CV3_PRESETS", "CV3_SILENT_TOKEN_IDS",
    "CV3_SOURCE_NOISE_SAMPLES", "CV3_SPEECH_TOKENIZER_ONNX", "ENDOFPROMPT_TOKEN", "ENDOFSYSTEM_TOKEN",
    "MAX_PROMPT_SECONDS", "MEL_RATE", "PHONE_LABELS", "PHONE_TEXT_IDS", "PRESETS", "PROMPT_SAMPLE_RATE_16K",
    "SAMPLES_PER_MEL_FRAME", "SAMPLE_RATE", "SPEAKER_EMBEDDINGS", "SPEECH_TOKENIZER_ONNX", "TEXT_FRONTENDS",
    "TOKEN_MEL_RATIO", "TOKEN_RATE", "CFMConfig", "CV3FlowConfig", "CV3SpeechLMConfig", "CausalHiFTConfig",
    "ConfigIO", "CosyVoice3Config", "DiTConfig", "EstimatorConfig", "FlowConfig", "FlowEncoderConfig", "HiFTConfig",
    "ModelConfig", "QwenConfig", "SamplingConfig", "SpeechLMConfig", "SpeechLMShape", "StreamConfig",
    "builtin_config", "check_speaker_embedding", "config_from_dict", "phone_config", "tiny_config",
]
