"""Find, load and convert model directories.

Three layouts are read, each in its module, strictly by parameter name:
- `official_cv2`: an unchanged CosyVoice2-0.5B directory (`cosyvoice2.yaml`, `llm.pt`, `flow.pt`, `hift.pt`, ...);
- `official_cv3`: an unchanged Fun-CosyVoice3-0.5B directory (`cosyvoice3.yaml`, ...);
- `vocalis_layout`: ours, `vocalis.json` + `{llm,flow,hift}.safetensors` (`vocalis convert` writes it).
`load_model` picks the layout by the file that marks it (`LAYOUTS`: a new family's layout is one entry).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from vocalis.config import CAMPPLUS_ONNX, SPEECH_TOKENIZER_ONNX
from vocalis.errors import ModelLoadError
from vocalis.hub import is_hub_id, resolve_model
from vocalis.model_dir.loaded import (
    QWEN_DIR,
    SPEAKER_ENCODER_JSON,
    TORCH_SPEECH_TOKENIZER,
    LoadedModel,
    speaker_encoder_of,
)
from vocalis.model_dir.layerwise import Convert
from vocalis.model_dir.official_cv2 import OFFICIAL_YAML, build_modules, load_official, model_config_from_official
from vocalis.model_dir.official_cv3 import (
    CV3_KIND,
    CV3_REQUIRED_FILES,
    CV3_YAML,
    build_cv3_modules,
    cosyvoice3_config_from_official,
    load_cosyvoice3,
    read_cosyvoice3_config,
)
from vocalis.model_dir.official_yaml import read_official_yaml, read_qwen_config
from vocalis.model_dir.vocalis_layout import (
    BUILTIN_MODEL,
    BUNDLED_TOKENIZER,
    FORMAT_VERSION,
    VOCALIS_JSON,
    convert_official,
    load_vocalis,
    random_model,
    save_vocalis,
)

# The file that marks a layout, and its loader, in the order they are tried (ours first: a converted directory
# may keep the official yaml beside it).
LAYOUTS: tuple[tuple[str, Callable[..., LoadedModel]], ...] = (
    (VOCALIS_JSON, load_vocalis),
    (CV3_YAML, load_cosyvoice3),
    (OFFICIAL_YAML, load_official),
)


def load_model(path: str | Path | None = None, llm_convert: Convert | None = None) -> LoadedModel:
    """A model directory of any layout, or a hub id; None = the built-in model (random tiny weights until one
    ships). llm_convert: the LLM loaded piece by piece, each converted as it is read (a precision's
    `LLMConverter.convert`), so its whole fp32 form never exists; CosyVoice 3 directories load whole."""
    if path is None:
        if (BUILTIN_MODEL / VOCALIS_JSON).is_file():
            return load_vocalis(BUILTIN_MODEL, llm_convert)
        return random_model(llm_convert=llm_convert)
    directory = Path(path).expanduser()
    if not directory.is_dir():
        if not is_hub_id(path):
            raise ModelLoadError(f"model directory not found: {directory}")
        directory = resolve_model(path)  # a hub id: downloaded once into the hub's cache, verified
    for marker, load in LAYOUTS:
        if (directory / marker).is_file():
            return load(directory) if marker == CV3_YAML else load(directory, llm_convert)
    raise ModelLoadError(f"{directory} is not a model directory: it has neither {VOCALIS_JSON} nor {OFFICIAL_YAML}")


__all__ = [
    "BUILTIN_MODEL",
    "BUNDLED_TOKENIZER",
    "CAMPPLUS_ONNX",
    "CV3_KIND",
    "CV3_REQUIRED_FILES",
    "CV3_YAML",
    "FORMAT_VERSION",
    "LAYOUTS",
    "OFFICIAL_YAML",
    "QWEN_DIR",
    "SPEAKER_ENCODER_JSON",
    "SPEECH_TOKENIZER_ONNX",
    "TORCH_SPEECH_TOKENIZER",
    "VOCALIS_JSON",
    "LoadedModel",
    "build_cv3_modules",
    "build_modules",
    "convert_official",
    "cosyvoice3_config_from_official",
    "load_cosyvoice3",
    "load_model",
    "load_official",
    "load_vocalis",
    "model_config_from_official",
    "random_model",
    "read_cosyvoice3_config",
    "read_official_yaml",
    "read_qwen_config",
    "save_vocalis",
    "speaker_encoder_of",
]
