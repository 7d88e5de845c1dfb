"""ONNX export of the flow estimator and the HiFT conv body, run by ONNX Runtime on CPU.

Exported with the legacy TorchScript exporter (`dynamo=False`, no onnxscript needed), dynamic batch and time.
The estimator gets two graphs, one per attention mask (full, block-causal), since the mask mode is a Python
flag. HiFT's body is `hift_batch.hift_body` (mel + source STFT + lengths -> conv_post output, masks built from
the lengths inside the graph); the NSF source (random draws) and the STFT/iSTFT stay in torch. With int8, ONNX
Runtime's dynamic quantization rewrites the MatMuls (weights int8, activations quantized per call to u8). Without
VNNI, ONNX Runtime's u8 x s8 kernel sums pair products into saturating int16, as fbgemm's does (see
`precision.dynamic_int8`): there the weights are u8 too (its u8 x u8 kernel widens to int16 first, exact), the
smallest mel error of the three weight forms (s8, 7-bit s8, u8) at the same speed.

`use_onnx` swaps `flow.decoder.estimator` for `OnnxEstimator` (the torch module stays reachable as
`torch_module` for the token2wav engine's cached path) and attaches the HiFT body to the module as
`backend_body` (read by the engine) and as its `decode` (the reference path).

Legend: B rows, T frames, F STFT frames.
"""

from __future__ import annotations

import functools
import logging
import tempfile
import warnings
from pathlib import Path

import numpy as np
import torch
from torch import nn

from vocalis.kernels import cpu
from vocalis.models.flow.estimator import CausalConditionalDecoder
from vocalis.models.flow.flow import CausalMaskedDiffWithXvec
from vocalis.models.hift.generator import HiFTGenerator
from vocalis.token2wav.cv2.hift import decode_with_body, hift_body

log = logging.getLogger(__name__)

OPSET = 17
_ESTIMATOR_INPUTS = ("x", "mask", "mu", "t", "spks", "cond")


class _EstimatorGraph(nn.Module):
    def __init__(self, estimator: CausalConditionalDecoder, streaming: bool) -> None:
        super().__init__()
        self.estimator = estimator
        self.streaming = streaming

    def forward(self, x: torch.Tensor, mask: torch.Tensor, mu: torch.Tensor, t: torch.Tensor, spks: torch.Tensor,
                cond: torch.Tensor) -> torch.Tensor:
        return self.estimator(x, mask, mu, t, spks, cond, self.streaming)


class _HiftBodyGraph(nn.Module):
    def __init__(self, hift: HiFTGenerator) -> None:
        super().__init__()
        self.hift = hift

    def forward(self, mel: torch.Tensor, s_stft: torch.Tensor, mel_lens: torch.Tensor) -> torch.Tensor:
        return hift_body(self.hift, mel, s_stft, mel_lens)


def export_estimator(estimator: CausalConditionalDecoder, path: Path, streaming: bool) -> None:
    """Write the estimator with a fixed mask mode to `path` (inputs x, mask, mu, t, spks, cond; output v)."""
    p = next(estimator.parameters())
    b, t = 2, 2 * estimator.static_chunk_size + 7  # not a block multiple, so no shape is specialised on it
    args = (torch.randn(b, 80, t), torch.ones(b, 1, t), torch.randn(b, 80, t), torch.rand(b), torch.randn(b, 80),
            torch.randn(b, 80, t))
    args = tuple(a.to(p.device) for a in args)
    axes = {name: {0: "batch", 2: "time"} for name in ("x", "mask", "mu", "cond", "v")}
    axes.update({"t": {0: "batch"}, "spks": {0: "batch"}})
    with torch.no_grad(), warnings.catch_warnings():  # the legacy exporter's deprecation/constant-folding notes
        warnings.simplefilter("ignore")
        torch.onnx.export(_EstimatorGraph(estimator, streaming).eval(), args, str(path),
                          input_names=list(_ESTIMATOR_INPUTS), output_names=["v"], dynamic_axes=axes,
                          opset_version=OPSET, dynamo=False)


def export_hift_body(hift: HiFTGenerator, path: Path) -> None:
    """Write `hift_body` to `path` (inputs mel, s_stft, mel_lens; output spec)."""
    cfg = hift.config
    t = 23
    frames = t * cfg.hop_samples // cfg.istft_hop_len + 1
    args = (torch.randn(2, cfg.in_channels, t), torch.randn(2, cfg.istft_n_fft + 2, frames), torch.tensor([t, t - 5]))
    axes = {"mel": {0: "batch", 2: "time"}, "s_stft": {0: "batch", 2: "frames"}, "mel_lens": {0: "batch"},
            "spec": {0: "batch", 2: "frames"}}
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(_HiftBodyGraph(hift).eval(), args, str(path), input_names=["mel", "s_stft", "mel_lens"],
                          output_names=["spec"], dynamic_axes=axes, opset_version=OPSET, dynamo=False)


def session(path: Path, quantize: bool = False) -> object:
    """An ONNX Runtime CPU session for `path`; with `quantize`, for its dynamically int8-quantized copy."""
    import onnxruntime as ort

    if quantize:
        from onnxruntime.quantization import QuantType, quantize_dynamic

        q = path.with_name(path.stem + ".int8.onnx")
        weights = QuantType.QInt8 if cpu.features().at_least("avx512_vnni") else QuantType.QUInt8  # module doc
        logging.disable(logging.WARNING)  # the quantizer logs a line per tensor and a pre-processing hint on root
        try:
            quantize_dynamic(str(path), str(q), weight_type=weights, op_types_to_quantize=["MatMul"])
        finally:
            logging.disable(logging.NOTSET)
        path = q
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = torch.get_num_threads()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    return ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])


class OnnxEstimator(nn.Module):
    """Drop-in for `CausalConditionalDecoder.forward`, run by ONNX Runtime (one session per mask mode)."""

    def __init__(self, torch_module: CausalConditionalDecoder, sessions: dict[bool, object]) -> None:
        super().__init__()
        # Not registered as a submodule: the ONNX graphs hold their own weights.
        object.__setattr__(self, "torch_module", torch_module)
        self.sessions = sessions
        self.static_chunk_size = torch_module.static_chunk_size

    def forward(self, x: torch.Tensor, mask: torch.Tensor, mu: torch.Tensor, t: torch.Tensor, spks: torch.Tensor,
                cond: torch.Tensor, streaming: bool = False) -> torch.Tensor:
        """Same contract as the module: (B, 80, T) inputs, t (B,), spks (B, 80) -> velocity (B, 80, T)."""
        feeds = {name: v.detach().to("cpu", torch.float32).contiguous().numpy()
                 for name, v in zip(_ESTIMATOR_INPUTS, (x, mask, mu, t.reshape(-1).expand(x.shape[0]), spks, cond))}
        out = self.sessions[bool(streaming)].run(None, feeds)[0]  # type: ignore[attr-defined]
        return torch.from_numpy(out).to(device=x.device, dtype=x.dtype)


class OnnxHiftBody:
    """`hift_body` run by ONNX Runtime: (mel (B, 80, T), s_stft (B, 18, F), mel_lens (B,)) -> (B, 18, F)."""

    def __init__(self, sess: object) -> None:
        self.session = sess

    def __call__(self, mel: torch.Tensor, s_stft: torch.Tensor, mel_lens: torch.Tensor) -> torch.Tensor:
        feeds = {"mel": mel.detach().to("cpu", torch.float32).contiguous().numpy(),
                 "s_stft": s_stft.detach().to("cpu", torch.float32).contiguous().numpy(),
                 "mel_lens": mel_lens.detach().to("cpu", torch.int64).numpy()}
        out = self.session.run(None, feeds)[0]  # type: ignore[attr-defined]
        return torch.from_numpy(np.ascontiguousarray(out)).to(mel.device)


def use_onnx(flow: CausalMaskedDiffWithXvec, hift: HiFTGenerator, quantize: bool = False,
             directory: str | Path | None = None) -> list[str]:
    """Export, open sessions and swap them in (see module doc). Files go to `directory` (kept) or a temporary
    one (deleted once the sessions have loaded them). Returns notes for `Runtime`."""
    estimator = flow.decoder.estimator
    with tempfile.TemporaryDirectory(prefix="vocalis-onnx-") as tmp:
        out = Path(directory) if directory is not None else Path(tmp)
        out.mkdir(parents=True, exist_ok=True)
        sessions: dict[bool, object] = {}
        for streaming in (False, True):
            path = out / f"flow_estimator_{'streaming' if streaming else 'full'}.onnx"
            export_estimator(estimator, path, streaming)
            sessions[streaming] = session(path, quantize)
        hift_path = out / "hift_body.onnx"
        export_hift_body(hift, hift_path)
        body = OnnxHiftBody(session(hift_path, quantize=False))  # HiFT stays fp32 with this backend
    flow.decoder.estimator = OnnxEstimator(estimator, sessions)
    hift.backend_body = body
    hift.decode = functools.partial(decode_with_body, hift, body)  # the reference path's HiFTGenerator.inference
    log.debug("ONNX graphs exported (opset %d)%s", OPSET, f" to {directory}" if directory else "")
    return [f"flow estimator (full passes) and HiFT body in ONNX Runtime{' (estimator int8)' if quantize else ''}"]
