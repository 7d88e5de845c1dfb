"""Vocalis's own supervised speech tokenizer (mel encoder + FSQ + CTC), an alternative to the official ONNX one."""

from vocalis.models.speech_tokenizer.config import PRESETS, SpeechTokenizerConfig, preset_config
from vocalis.models.speech_tokenizer.fsq import FSQ
from vocalis.models.speech_tokenizer.model import SupervisedSpeechTokenizer, greedy_ctc_decode, pad_mels
from vocalis.models.speech_tokenizer.runtime import (
    CONFIG_FILE,
    WEIGHTS_FILE,
    load_speech_tokenizer,
    save_speech_tokenizer,
)
from vocalis.models.speech_tokenizer.symbols import EspeakPhonemizer, SymbolTable, char_units, latin_units

__all__ = [
    "CONFIG_FILE",
    "FSQ",
    "PRESETS",
    "WEIGHTS_FILE",
    "EspeakPhonemizer",
    "SpeechTokenizerConfig",
    "SupervisedSpeechTokenizer",
    "SymbolTable",
    "char_units",
    "greedy_ctc_decode",
    "latin_units",
    "load_speech_tokenizer",
    "pad_mels",
    "preset_config",
    "save_speech_tokenizer",
]
