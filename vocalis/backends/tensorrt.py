"""TensorRT for the flow estimator (GPU): ONNX graph -> engine, run on torch CUDA tensors.

fp16 engines are strongly typed by default: the ONNX graph is exported from the estimator as `backends.half` casts
it (fp16 weights and activations, fp32 inputs and output cast at its edges, the time embedding fp32), with its
LayerNorms fp16 too (ONNX LayerNormalization computes mean and variance in fp32) and TensorRT's normalization
layers asked to compute in fp32; TensorRT then keeps every tensor the type the graph gives it. VOCALIS_TRT_WEAK=1
builds the weakly typed engine instead: the fp32 graph with the FP16 flag, LayerNorm, softmax and reductions pinned
to fp32 (precision constraints obeyed). Only full passes use it (the token2wav engine's cached streaming path runs
the torch module, kept as `torch_module`). Shapes: batch 2..2*GPU_STEP_BATCH rows, 4..3000 frames.

`tests/test_half_model.py` checks the fp16 graph on the CPU (ONNX Runtime against the fp32 module);
`tests/test_cuda.py` builds and runs an engine where TensorRT imports.
"""

from __future__ import annotations

import copy
import logging
import os
import tempfile
from pathlib import Path

import torch
from torch import nn

from vocalis.backends.half import cast_estimator
from vocalis.backends.onnx import export_estimator
from vocalis.models.flow.estimator import CausalConditionalDecoder
from vocalis.models.flow.flow import CausalMaskedDiffWithXvec
from vocalis.token2wav.config import GPU_STEP_BATCH

log = logging.getLogger(__name__)

MAX_ROWS = 2 * GPU_STEP_BATCH  # a GPU token2wav step's requests, each with its guidance row
MIN_FRAMES, OPT_FRAMES, MAX_FRAMES = 4, 500, 3000
_INPUTS = ("x", "mask", "mu", "t", "spks", "cond")


WEAK_ENV = "VOCALIS_TRT_WEAK"  # "1": the weakly typed fp16 build (module doc)


def strongly_typed(fp16: bool) -> bool:
    return fp16 and os.environ.get(WEAK_ENV) != "1"


def half_graph_module(estimator: CausalConditionalDecoder) -> nn.Module:
    """A copy of the estimator as the strongly typed fp16 graph is exported from (module doc)."""
    half = copy.deepcopy(estimator)
    cast_estimator(half, torch.float16)
    for m in half.modules():
        if isinstance(m, nn.LayerNorm):
            m.half()  # ONNX LayerNormalization: fp16 in and out, statistics in fp32 (stash_type)
    return half


def build_engine(onnx_path: Path, fp16: bool) -> bytes:
    import tensorrt as trt

    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    strong = strongly_typed(fp16)
    network = builder.create_network(1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED) if strong else 0)
    parser = trt.OnnxParser(network, logger)
    if not parser.parse(onnx_path.read_bytes()):
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise RuntimeError(f"TensorRT could not parse {onnx_path.name}: {errors}")
    config = builder.create_builder_config()
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, 4 << 30)
    if strong:  # types come from the graph; normalizations accumulate in fp32
        for i in range(network.num_layers):
            layer = network.get_layer(i)
            if layer.type == trt.LayerType.NORMALIZATION and hasattr(layer, "compute_precision"):
                layer.compute_precision = trt.float32
    elif fp16:
        config.set_flag(trt.BuilderFlag.FP16)
        config.set_flag(trt.BuilderFlag.OBEY_PRECISION_CONSTRAINTS)
        keep = {trt.LayerType.NORMALIZATION, trt.LayerType.SOFTMAX, trt.LayerType.REDUCE}
        for i in range(network.num_layers):
            layer = network.get_layer(i)
            if layer.type in keep:
                layer.precision = trt.float32
                layer.set_output_type(0, trt.float32)
    profile = builder.create_optimization_profile()
    for name in ("x", "mask", "mu", "cond"):
        c = 1 if name == "mask" else 80
        profile.set_shape(name, (2, c, MIN_FRAMES), (2, c, OPT_FRAMES), (MAX_ROWS, c, MAX_FRAMES))
    profile.set_shape("t", (2,), (2,), (MAX_ROWS,))
    profile.set_shape("spks", (2, 80), (2, 80), (MAX_ROWS, 80))
    config.add_optimization_profile(profile)
    plan = builder.build_serialized_network(network, config)
    if plan is None:
        raise RuntimeError("TensorRT engine build failed (see the TensorRT log above)")
    return bytes(plan)


class TrtEstimator(nn.Module):
    """Drop-in for `CausalConditionalDecoder.forward` on CUDA tensors (one engine per mask mode)."""

    def __init__(self, torch_module: CausalConditionalDecoder, plans: dict[bool, bytes]) -> None:
        import tensorrt as trt

        super().__init__()
        object.__setattr__(self, "torch_module", torch_module)
        runtime = trt.Runtime(trt.Logger(trt.Logger.WARNING))
        self.engines = {k: runtime.deserialize_cuda_engine(p) for k, p in plans.items()}
        self.contexts = {k: e.create_execution_context() for k, e in self.engines.items()}
        self.static_chunk_size = torch_module.static_chunk_size

    def forward(self, x: torch.Tensor, mask: torch.Tensor, mu: torch.Tensor, t: torch.Tensor, spks: torch.Tensor,
                cond: torch.Tensor, streaming: bool = False) -> torch.Tensor:
        ctx = self.contexts[bool(streaming)]
        inputs = [v.float().contiguous() for v in (x, mask, mu, t.reshape(-1).expand(x.shape[0]), spks, cond)]
        out = torch.empty_like(inputs[0])
        for name, v in zip(_INPUTS, inputs):
            ctx.set_input_shape(name, tuple(v.shape))
            ctx.set_tensor_address(name, v.data_ptr())
        ctx.set_tensor_address("v", out.data_ptr())
        if not ctx.execute_async_v3(torch.cuda.current_stream().cuda_stream):
            raise RuntimeError("TensorRT execution failed")
        return out.to(x.dtype)


def use_tensorrt(flow: CausalMaskedDiffWithXvec, fp16: bool, directory: str | Path | None = None) -> list[str]:
    """Build (or load cached `.plan` files from `directory`) and swap the estimator. Returns notes."""
    estimator = flow.decoder.estimator
    plans: dict[bool, bytes] = {}
    with tempfile.TemporaryDirectory(prefix="vocalis-trt-") as tmp:
        out = Path(directory) if directory is not None else Path(tmp)
        out.mkdir(parents=True, exist_ok=True)
        for streaming in (False, True):
            stem = f"flow_estimator_{'streaming' if streaming else 'full'}"
            kind = ("fp16-typed" if strongly_typed(fp16) else "fp16") if fp16 else "fp32"
            plan_path = out / f"{stem}.{kind}.plan"
            if directory is not None and plan_path.is_file():
                plans[streaming] = plan_path.read_bytes()
                continue
            onnx_path = out / f"{stem}.onnx"
            export_estimator(half_graph_module(estimator) if strongly_typed(fp16) else estimator, onnx_path, streaming)
            log.info("building the TensorRT %s engine (minutes)", stem)
            plans[streaming] = build_engine(onnx_path, fp16)
            if directory is not None:
                plan_path.write_bytes(plans[streaming])
    flow.decoder.estimator = TrtEstimator(estimator, plans)
    how = ("fp16 strongly typed, fp32 norm statistics" if strongly_typed(fp16) else "fp16, fp32 norms/softmax"
           ) if fp16 else "fp32"
    return [f"flow estimator (full passes) in TensorRT {how}"]
