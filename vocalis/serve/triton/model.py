"""Triton Python-backend model for Vocalis: decoupled streaming, one response per audio chunk.

Written into a model repository by `vocalis export-triton` (as `<name>/1/model.py`); the Python environment
Triton runs the stub in must have `vocalis` installed. Parameters (config.pbtxt): `model_dir` (empty: the
built-in model), `torch_threads`, and `precision`, `backend`, `flow_steps`, `final_chunk`, `token2wav_cache_mib`,
`max_streams` (`vocalis serve`'s flags of the same names; empty: the default).

Inputs (each request is one utterance; batch dimension of 1 per request):
  TEXT (BYTES)          text to say
  VOICE (BYTES, opt.)   a voice of the model (empty: its first voice)
  INSTRUCT (BYTES, opt.) instruction (instruct mode)
  SPEED (FP32, opt.)    0.25-4.0
  SEED (INT64, opt.)    reproducible sampling
Outputs per response: AUDIO (FP32, samples in [-1, 1] at SAMPLE_RATE), SAMPLE_RATE (INT32). The last response
carries the COMPLETE_FINAL flag. Requests run on the batching engine (`TTS`): `execute` hands each to a
thread that streams its chunks and returns at once (decoupled mode), so requests in flight together share the
engine's LLM and token2wav steps. A cancelled request is aborted at its next chunk, freeing what it holds.
"""

from __future__ import annotations

import json
import logging
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import triton_python_backend_utils as pb_utils  # provided by Triton's Python backend

log = logging.getLogger("vocalis.triton")


def _optional(request, name: str):
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    return None if tensor is None else tensor.as_numpy().reshape(-1)


def _text(request, name: str) -> str:
    value = _optional(request, name)
    if value is None or value.size == 0:
        return ""
    item = value[0]
    return item.decode("utf-8") if isinstance(item, bytes) else str(item)


class TritonPythonModel:
    def initialize(self, args: dict) -> None:
        import torch

        from vocalis.model_options import ModelOptions

        config = json.loads(args["model_config"])
        params = {k: v["string_value"] for k, v in config.get("parameters", {}).items()}
        threads = int(params.get("torch_threads", "0") or 0)
        if threads > 0:
            torch.set_num_threads(threads)
        # the instance's device; precision, backend, flow steps, final chunk, cache budget from the parameters
        device = f"cuda:{args.get('model_instance_device_id', '0')}" if args.get("model_instance_kind") == "GPU" else "cpu"
        self.tts = ModelOptions.from_params(params, device=device).load(params.get("model_dir") or None)
        self.tts.hold_kv_budget()  # a server: RSS flat from the first requests on
        self.sample_rate = np.array([self.tts.sample_rate], dtype=np.int32)
        # one thread per request in flight: each only waits on its chunks, the engine loop does the work
        self.pool = ThreadPoolExecutor(max_workers=int(params.get("max_in_flight", "64") or 64),
                                       thread_name_prefix="vocalis-triton")
        log.info("vocalis Triton model ready: %s", self.tts.model.describe())

    def execute(self, requests: list) -> None:
        for request in requests:
            self.pool.submit(self._one, request)
        # decoupled: every response goes through the request's sender

    def _one(self, request) -> None:
        from vocalis.errors import VocalisError

        sender = request.get_response_sender()
        final = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        try:
            speed = _optional(request, "SPEED")
            seed = _optional(request, "SEED")
            chunks = self.tts.stream(
                _text(request, "TEXT"),
                voice=_text(request, "VOICE") or None,
                instruct=_text(request, "INSTRUCT") or None,
                speed=float(speed[0]) if speed is not None and speed.size else 1.0,
                seed=int(seed[0]) if seed is not None and seed.size else None,
            )
            for chunk in chunks:
                if hasattr(request, "is_cancelled") and request.is_cancelled():
                    chunks.close()  # aborts the engine request: its KV blocks and stream state are freed
                    sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(
                        "cancelled", pb_utils.TritonError.CANCELLED)), flags=final)
                    return
                audio = pb_utils.Tensor("AUDIO", chunk.samples.astype(np.float32).reshape(1, -1))
                rate = pb_utils.Tensor("SAMPLE_RATE", self.sample_rate.reshape(1, 1))
                sender.send(pb_utils.InferenceResponse(output_tensors=[audio, rate]))
            sender.send(flags=final)
        except VocalisError as exc:  # bad input: the client gets the message
            sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(str(exc))), flags=final)
        except Exception as exc:
            log.exception("synthesis failed")
            sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(f"internal error: {exc}")), flags=final)

    def finalize(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
        self.tts.close()
        self.tts = None
