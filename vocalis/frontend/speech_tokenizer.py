"""Speech tokenizer: 16 kHz audio -> 25 Hz discrete speech ids (S3Tokenizer v2, codebook 6561).

`SpeechTokenizer` states the contract; `OnnxSpeechTokenizer` runs the released `speech_tokenizer_v2.onnx`,
`TorchSpeechTokenizer` our own supervised tokenizer, and `LabellerSpeechTokenizer` the phone model's frame
labeller (its ids are the 25 Hz phone-state labels).
"""

from __future__ import annotations

import abc
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from vocalis.config import MAX_PROMPT_SECONDS, PROMPT_SAMPLE_RATE_16K
from vocalis.errors import AudioError, ModelLoadError
from vocalis.frontend.audio import whisper_log_mel
from vocalis.models.speech_tokenizer.labeller import load_labeller
from vocalis.models.speech_tokenizer.runtime import load_speech_tokenizer

if TYPE_CHECKING:
    from vocalis.models.speech_tokenizer.labeller import FrameLabeller
    from vocalis.models.speech_tokenizer.model import SupervisedSpeechTokenizer
    from vocalis.models.speech_tokenizer.symbols import SymbolTable

logger = logging.getLogger(__name__)


def open_onnx_session(
    path: str | Path, *, intra_op_num_threads: int = 1, providers: Sequence[str] | None = None
):  # -> onnxruntime.InferenceSession
    """ORT session with full graph optimisation; `providers=None` means CUDA when available, else CPU."""
    import onnxruntime as ort

    path = Path(path)
    if not path.is_file():
        raise ModelLoadError(f"ONNX model not found: {path}")
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.intra_op_num_threads = intra_op_num_threads
    available = ort.get_available_providers()
    if providers is None:
        providers = [p for p in ("CUDAExecutionProvider", "CPUExecutionProvider") if p in available]
    try:
        return ort.InferenceSession(str(path), sess_options=options, providers=list(providers))
    except Exception as exc:  # ORT raises its own exception types for bad files
        raise ModelLoadError(f"cannot load ONNX model {path}: {exc}") from exc


class SpeechTokenizer(abc.ABC):
    """Contract: mono float32 16 kHz audio (N,), at most 30 s -> list of 25 Hz speech ids in [0, codebook)."""

    sample_rate: int = PROMPT_SAMPLE_RATE_16K
    max_seconds: float = MAX_PROMPT_SECONDS
    codebook_size: int = 6561  # the released tokenizer's; ours say their own

    def tokenize(self, wav16k: np.ndarray | torch.Tensor) -> list[int]:
        """Speech ids of `wav16k` (N,); AudioError beyond the 30 s limit of the released tokenizer."""
        seconds = len(wav16k) / self.sample_rate
        if seconds > self.max_seconds:
            raise AudioError(
                f"audio of {seconds:.1f} s is too long for the speech tokenizer (limit {self.max_seconds:g} s)"
            )
        return self._tokenize(wav16k)

    def __call__(self, wav16k: np.ndarray | torch.Tensor) -> list[int]:
        return self.tokenize(wav16k)

    def to(self, device: str | torch.device) -> SpeechTokenizer:
        """Run on `device` from now on where this tokenizer can (a torch model moves, an ONNX session takes the
        CUDA provider where ONNX Runtime has it); returns self."""
        return self

    @abc.abstractmethod
    def _tokenize(self, wav16k: np.ndarray | torch.Tensor) -> list[int]:
        """Speech ids of audio already checked against the length limit."""


def _on(wav16k: np.ndarray | torch.Tensor, device: torch.device) -> torch.Tensor:
    """The clip as a float tensor on `device` (its features are then computed there)."""
    return torch.as_tensor(wav16k, dtype=torch.float32).to(device)


def reopen_for(session, path: Path, threads: int, device: str | torch.device):  # type: ignore[no-untyped-def]
    """`session`, or a new one on `device`'s provider (CUDA where ONNX Runtime has it, else the CPU) when it runs
    elsewhere."""
    import onnxruntime as ort

    cuda = torch.device(device).type == "cuda" and "CUDAExecutionProvider" in ort.get_available_providers()
    wanted = ["CUDAExecutionProvider", "CPUExecutionProvider"] if cuda else ["CPUExecutionProvider"]
    if session.get_providers()[0] == wanted[0]:
        return session
    return open_onnx_session(path, intra_op_num_threads=threads, providers=wanted)


class OnnxSpeechTokenizer(SpeechTokenizer):
    """`speech_tokenizer_v2.onnx`: inputs by position (feats (1, 128, T) float32, lengths (1,) int32)."""

    def __init__(
        self, path: str | Path, *, intra_op_num_threads: int = 1, providers: Sequence[str] | None = None
    ) -> None:
        self.path, self.threads = Path(path), intra_op_num_threads
        self.session = open_onnx_session(path, intra_op_num_threads=intra_op_num_threads, providers=providers)
        inputs = self.session.get_inputs()
        if len(inputs) != 2:
            raise ModelLoadError(f"{path}: expected 2 inputs (feats, lengths), found {len(inputs)}")
        self.input_names = (inputs[0].name, inputs[1].name)

    def to(self, device: str | torch.device) -> OnnxSpeechTokenizer:
        self.session = reopen_for(self.session, self.path, self.threads, device)
        return self

    def _tokenize(self, wav16k: np.ndarray | torch.Tensor) -> list[int]:
        feats = whisper_log_mel(wav16k).unsqueeze(0).cpu().numpy()  # (1, 128, T)
        lengths = np.array([feats.shape[2]], dtype=np.int32)  # (1,)
        ids = self.session.run(None, {self.input_names[0]: feats, self.input_names[1]: lengths})[0]
        return np.asarray(ids).reshape(-1).astype(np.int64).tolist()


class TorchSpeechTokenizer(SpeechTokenizer):
    """`SpeechTokenizer` contract (16 kHz float wav -> 25 Hz ids) served by a `SupervisedSpeechTokenizer`."""

    def __init__(self, model: SupervisedSpeechTokenizer, symbols: SymbolTable | None = None) -> None:
        self.model = model.eval()
        self.symbols = symbols

    @classmethod
    def load(cls, path: str | Path, device: str | torch.device = "cpu") -> TorchSpeechTokenizer:
        """From a model directory holding `speech_tokenizer.safetensors` + `.json`, or the weights file."""
        model, symbols = load_speech_tokenizer(path, device)
        logger.info("speech tokenizer: %s (codebook %d)", path, model.codebook_size)
        return cls(model, symbols)

    @property
    def codebook_size(self) -> int:
        return self.model.codebook_size

    def to(self, device: str | torch.device) -> TorchSpeechTokenizer:
        self.model.to(device)
        return self

    def _tokenize(self, wav16k: np.ndarray | torch.Tensor) -> list[int]:
        return self.tokenize_batch([wav16k])[0]

    def tokenize_batch(self, wavs16k: Sequence[np.ndarray | torch.Tensor]) -> list[list[int]]:
        """Several 16 kHz clips (N_i,) -> their 25 Hz ids (ceil((N // 160) / 4) each), one padded forward pass;
        features and model on the model's device."""
        device = self.model.ctc_head.weight.device
        return self.model.tokenize_mels([whisper_log_mel(_on(w, device)) for w in wavs16k])


class LabellerSpeechTokenizer(SpeechTokenizer):
    """The `SpeechTokenizer` contract served by a phone model's `FrameLabeller`: 16 kHz audio -> 25 Hz labels."""

    def __init__(self, model: FrameLabeller) -> None:
        self.model = model.eval()

    @classmethod
    def load(cls, directory: str | Path, device: str | torch.device = "cpu") -> LabellerSpeechTokenizer:
        """From a model directory holding `labeller.safetensors` + `labeller.json`."""
        return cls(load_labeller(directory, device))

    @property
    def codebook_size(self) -> int:
        return self.model.config.num_labels

    def to(self, device: str | torch.device) -> LabellerSpeechTokenizer:
        self.model.to(device)
        return self

    def _tokenize(self, wav16k: np.ndarray | torch.Tensor) -> list[int]:
        device = self.model.head.weight.device
        return self.model.tokenize_mels([whisper_log_mel(_on(wav16k, device))])[0]
