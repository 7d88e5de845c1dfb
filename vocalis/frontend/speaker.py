"""Speaker encoder: 16 kHz audio -> x-vector (192-d for CAM++), used by the flow as a speaker condition."""

from __future__ import annotations

import abc
import logging
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from vocalis.errors import ModelLoadError
from vocalis.frontend.audio import kaldi_fbank
from vocalis.frontend.speech_tokenizer import open_onnx_session, reopen_for

logger = logging.getLogger(__name__)


class SpeakerEncoder(abc.ABC):
    """Contract: mono float32 16 kHz audio (N,) -> speaker embedding (D,) float32, not normalised."""

    @abc.abstractmethod
    def embed(self, wav16k: np.ndarray | torch.Tensor) -> np.ndarray:
        """Embedding (D,) of `wav16k` (N,)."""

    def __call__(self, wav16k: np.ndarray | torch.Tensor) -> np.ndarray:
        return self.embed(wav16k)

    def to(self, device: str | torch.device) -> SpeakerEncoder:
        """Run on `device` from now on where this encoder can; returns self."""
        return self


class CampplusSpeakerEncoder(SpeakerEncoder):
    """`campplus.onnx`: Kaldi fbank (80 bins, dither 0) minus its time mean -> (1, T, 80) -> (192,).

    Runs on the CPU provider by default, as the official frontend does; `to("cuda")` moves it to the GPU.
    """

    def __init__(
        self,
        path: str | Path,
        *,
        intra_op_num_threads: int = 1,
        providers: Sequence[str] | None = ("CPUExecutionProvider",),
    ) -> None:
        self.path, self.threads = Path(path), intra_op_num_threads
        self.session = open_onnx_session(path, intra_op_num_threads=intra_op_num_threads, providers=providers)
        inputs = self.session.get_inputs()
        if len(inputs) != 1:
            raise ModelLoadError(f"{path}: expected 1 input (fbank), found {len(inputs)}")
        self.input_name = inputs[0].name

    def to(self, device: str | torch.device) -> CampplusSpeakerEncoder:
        """On a GPU: ONNX Runtime's CUDA provider where it has one (the CPU provider otherwise)."""
        self.session = reopen_for(self.session, self.path, self.threads, device)
        return self

    def embed(self, wav16k: np.ndarray | torch.Tensor) -> np.ndarray:
        feats = kaldi_fbank(wav16k, num_mel_bins=80, cmn=True).unsqueeze(0).numpy()  # (1, T, 80)
        embedding = self.session.run(None, {self.input_name: feats})[0]  # (1, D)
        return np.asarray(embedding, dtype=np.float32).reshape(-1)  # (D,)
