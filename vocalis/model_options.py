"""How an entry point loads its model: one set of options (and command-line flags) for `vocalis speak`,
`vocalis infer`, `vocalis serve` (each Ray Serve replica too) and the Triton model that `vocalis export-triton`
writes, so that every entry point runs the same engine with the same choices."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from typing import TYPE_CHECKING

from vocalis.backends import BACKENDS, PRECISIONS
from vocalis.errors import InputError

if TYPE_CHECKING:
    from vocalis.tts import TTS

FINAL_CHUNKS = ("full", "causal")
CPU_STREAMS = 16  # default requests in flight on a CPU (`ModelOptions.max_streams`)
# KV positions the LLM's pool holds per admitted stream (a minute of speech at 25 ids/s, its prompt included): a
# small model's pool is sized by its streams, not by the fixed budget a large one fills (a longer request waits
# for free blocks, as on a full pool)
KV_POSITIONS_PER_STREAM = 1536


@dataclass(frozen=True, slots=True)
class ModelOptions:
    """What `TTS.load` and the token2wav config take.

    device: cpu, cuda, cuda:N, or "auto" (cuda when one is visible, else cpu).
    precision / backend: `vocalis.backends.choice` ("auto" picks by the CPU or GPU).
    flow_steps: Euler steps of the flow (None: the model's).
    token2wav_cache_mib: the streams' token2wav cache budget (None: a quarter of the device's memory).
    final_chunk: "full" (the reference's last call exactly: one more full-attention flow pass per streamed
        request) or "causal" (block-causal like the earlier chunks: linear cost; the last hop may differ from
        the reference by how much the model's two attention modes disagree on it). None: the model's default
        (`TTS.default_token2wav`: full for a CosyVoice model, causal for the built-in one).
    max_streams: most requests synthesised at once, more wait in order (`Token2WavConfig.max_streams`). None:
        `CPU_STREAMS` on a CPU (more in flight only wait for token2wav steps while holding their flow caches:
        docs/benchmarks.md, "Requests in flight"); no cap on a GPU. 0: no cap.
    """

    device: str = "cpu"
    precision: str = "fp32"
    backend: str = "torch"
    flow_steps: int | None = None
    token2wav_cache_mib: int | None = None
    final_chunk: str | None = None
    max_streams: int | None = None

    def __post_init__(self) -> None:
        if self.precision not in PRECISIONS:
            raise ValueError(f"--precision must be one of {', '.join(PRECISIONS)}, got {self.precision!r}")
        if self.backend not in BACKENDS:
            raise ValueError(f"--backend must be one of {', '.join(BACKENDS)}, got {self.backend!r}")
        if self.flow_steps is not None and self.flow_steps < 1:
            raise ValueError(f"--flow-steps must be at least 1, got {self.flow_steps}")
        if self.token2wav_cache_mib is not None and self.token2wav_cache_mib < 0:
            raise ValueError(f"--token2wav-cache-mib must be at least 0, got {self.token2wav_cache_mib}")
        if self.max_streams is not None and self.max_streams < 0:
            raise ValueError(f"--max-streams must be at least 0, got {self.max_streams}")
        if self.final_chunk is not None and self.final_chunk not in FINAL_CHUNKS:
            raise ValueError(f"--final-chunk must be 'full' or 'causal', got {self.final_chunk!r}")

    def resolved_device(self, local_rank: int = 0) -> str:
        """The device to load on: "auto" is cuda:<local_rank> when CUDA is visible, else cpu."""
        if self.device != "auto":
            return self.device
        import torch

        return f"cuda:{local_rank}" if torch.cuda.is_available() else "cpu"

    def check(self) -> None:
        """Raise InputError now when this machine cannot run the precision/backend on the device (what to install)."""
        import torch

        from vocalis.backends.choice import resolve

        try:
            device = torch.device(self.resolved_device())
        except RuntimeError:
            raise InputError(f"unknown device {self.device!r}; use cpu, cuda, cuda:N or auto") from None
        resolve(self.backend, self.precision, device)

    def streams_cap(self, device: str) -> int | None:
        """The engine's cap on requests in flight on `device` (None: no cap)."""
        if self.max_streams is not None:
            return self.max_streams or None
        return None if device.startswith("cuda") else CPU_STREAMS

    def load(self, model: str | None, local_rank: int = 0, adapters: dict[str, str] | None = None) -> TTS:
        """adapters: LoRA adapters to merge at load (`TTS.load`)."""
        from vocalis.engine.config import EngineConfig
        from vocalis.tts import TTS

        device = self.resolved_device(local_rank)
        tts = TTS.load(model, device=device, backend=self.backend, precision=self.precision,
                       flow_steps=self.flow_steps, adapters=adapters)
        cap = self.streams_cap(device)
        final = self.final_chunk or tts.token2wav_config.final_attention
        tts.token2wav_config = replace(tts.token2wav_config, final_attention=final, max_streams=cap,
                                       **({} if self.token2wav_cache_mib is None
                                          else {"max_cache_mib": self.token2wav_cache_mib}))
        if cap is not None:  # the LLM never holds more requests than are admitted: its KV pool is sized for those
            from vocalis.engine.model_runner import kv_bytes_per_block

            engine = tts.engine_config or EngineConfig()
            per_position = kv_bytes_per_block(tts.model.llm, engine.block_size) // engine.block_size
            budget = min(engine.kv_cache_bytes, cap * KV_POSITIONS_PER_STREAM * per_position)
            tts.engine_config = replace(engine, max_num_seqs=cap, kv_cache_bytes=budget)
        return tts

    def as_params(self) -> dict[str, str]:
        """String parameters (Triton's config.pbtxt); `from_params` reads them back. The device is left out: the
        serving host decides it."""
        return {k: "" if v is None else str(v) for k, v in asdict(self).items() if k != "device"}

    @classmethod
    def from_params(cls, params: dict[str, str], device: str = "cpu") -> ModelOptions:
        def number(key: str) -> int | None:
            value = params.get(key, "").strip()
            try:
                return int(value) if value else None
            except ValueError:
                raise ValueError(f"parameter {key!r} must be a whole number or empty, got {value!r}") from None

        return cls(device=device, precision=params.get("precision") or "fp32",
                   backend=params.get("backend") or "torch", flow_steps=number("flow_steps"),
                   token2wav_cache_mib=number("token2wav_cache_mib"),
                   final_chunk=params.get("final_chunk") or None, max_streams=number("max_streams"))


def at_least(low: int) -> Callable[[str], int]:
    """An argparse type: a whole number >= low."""

    def parse(value: str) -> int:
        try:
            n = int(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{value!r} is not a whole number") from None
        if n < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}, got {n}")
        return n

    return parse


def add_model_arguments(parser: argparse.ArgumentParser, *, device: str | None = "cpu") -> None:
    """The flags `ModelOptions` reads. device=None leaves --device out (the serving host decides it)."""
    if device is not None:
        parser.add_argument("--device", default=device,
                            help="cpu, cuda, cuda:N or auto (cuda when visible)" + f" (default: {device})")
    parser.add_argument("--precision", default="fp32",
                        help="fp32 (default), bf16, fp16 (GPU), int8 (CPU) or auto (the fastest here)")
    parser.add_argument("--backend", default="torch",
                        help="torch (default), onnx, tensorrt (GPU), compile, vllm (needs VOCALIS_VLLM_PYTHON) "
                             "or auto")
    parser.add_argument("--flow-steps", type=at_least(1), metavar="N",
                        help="Euler steps of the flow: fewer is faster, the mel coarser (default: the model's, 10)")
    parser.add_argument("--final-chunk", choices=FINAL_CHUNKS,
                        help="a stream's last chunk: full = the reference's full-attention pass, exactly; causal = "
                             "block-causal like the others, one flow pass cheaper per request (default: full for a "
                             "CosyVoice model, causal for the built-in one)")
    parser.add_argument("--token2wav-cache-mib", type=at_least(0), metavar="MIB",
                        help="memory for the streams' token2wav caches; beyond it the largest recompute their chunks "
                             "(default: a quarter of the device's memory)")
    parser.add_argument("--max-streams", type=at_least(0), metavar="N",
                        help=f"most requests synthesised at once; more wait in order (0: no cap; default: "
                             f"{CPU_STREAMS} on a CPU, no cap on a GPU)")


def model_options(args: argparse.Namespace, command: str, *, check: bool = True) -> ModelOptions:
    """ModelOptions from the flags of `add_model_arguments`; with `check`, a choice this machine cannot run is an
    InputError now, before any model, rank or replica loads."""
    try:
        options = ModelOptions(device=getattr(args, "device", "cpu"), precision=args.precision,
                               backend=args.backend, flow_steps=args.flow_steps,
                               token2wav_cache_mib=args.token2wav_cache_mib, final_chunk=args.final_chunk,
                               max_streams=args.max_streams)
    except ValueError as exc:
        raise InputError(f"vocalis {command}: {exc}") from None
    if check:
        options.check()
    return options
