"""The vLLM side of the `vllm` backend: a process run by the vLLM venv's python, serving one step-based engine.

vLLM pins its own torch/transformers/numpy, so it lives in a separate venv and this file runs there as a script:
it imports only the standard library and vLLM (never `vocalis`, whose dependencies that venv may lack).
`vocalis.backends.vllm.engine` starts it as

    $VOCALIS_VLLM_PYTHON vllm_worker.py FD

where FD is its end of a socket pair (private to the two processes: no address, no key), wrapped on both sides
in a `multiprocessing.connection.Connection` carrying plain-`pickle` messages (tensors included: both venvs run
torch 2.13). Plain pickle, not the connection's own `send`: torch registers reductions with multiprocessing's
pickler that pass tensors as shared memory through a helper server keyed by the sender's process authkey, which
this unrelated process does not share. Protocol, one reply per message:

    -> settings dict (first message)             <- ("ready", info dict) | ("error", traceback)
    -> ("add", request_id, prompt_embeds (L, D), sampling dict)   <- ("ok", None)
    -> ("abort", [request_id, ...])              <- ("ok", None)
    -> ("step",)                                 <- ("ok", ([(request_id, [new ids], finished), ...], kv usage))
    -> ("shutdown",)                             <- ("ok", None), then the process exits

A failing command answers ("error", traceback) and the worker keeps serving. The model directory holds the
export of `vllm_export` (architecture `VocalisSpeechLM`: Qwen2 whose lm_head has a bias).
"""

from __future__ import annotations

import os
import pickle
import sys
import traceback
from multiprocessing.connection import Connection
from typing import Any

ARCHITECTURE = "VocalisSpeechLM"  # = vllm_export.ARCHITECTURE (not imported: no vocalis here)


def _model_class() -> type:
    """Qwen2ForCausalLM with a biased lm_head: CosyVoice 2's speech head `llm_decoder` has a bias."""
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead
    from vllm.model_executor.models.qwen2 import Qwen2ForCausalLM
    from vllm.model_executor.models.utils import maybe_prefix

    class VocalisSpeechLM(Qwen2ForCausalLM):
        def __init__(self, *, vllm_config: Any, prefix: str = "") -> None:
            super().__init__(vllm_config=vllm_config, prefix=prefix)
            cfg = self.config
            self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, bias=True, quant_config=self.quant_config,
                                          prefix=maybe_prefix(prefix, "lm_head"))

        def compute_logits(self, hidden_states: Any) -> Any:
            # the logits processor takes the bias as an argument: the stock Qwen2 passes none
            return self.logits_processor(self.lm_head, hidden_states, self.lm_head.bias)

    return VocalisSpeechLM


def _usage_logger() -> tuple[type, dict[str, float]]:
    """A vLLM stat logger that keeps the last KV-cache usage (0..1), the one figure the engine reports."""
    from vllm.v1.metrics.loggers import StatLoggerBase

    last = {"kv_usage": 0.0}

    class KVUsage(StatLoggerBase):
        def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
            pass

        def record(self, scheduler_stats: Any, iteration_stats: Any, mm_cache_stats: Any = None,
                   engine_idx: int = 0) -> None:
            if scheduler_stats is not None:
                last["kv_usage"] = float(scheduler_stats.kv_cache_usage)

        def log_engine_initialized(self) -> None:
            pass

    return KVUsage, last


def build_engine(settings: dict[str, Any]) -> tuple[Any, dict[str, float], dict[str, Any]]:
    """The vLLM engine for `settings` (the dict `backends/vllm/engine.py` sends) -> (engine, usage, info)."""
    # before vLLM reads its environment: the engine core runs in this process (no third process, no IPC per
    # step), and the KV cache gets the caller's budget (whole GiB on CPU)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(settings["kv_cache_gib"]))
    import vllm
    from vllm import EngineArgs, LLMEngine, ModelRegistry

    ModelRegistry.register_model(ARCHITECTURE, _model_class())
    usage_cls, usage = _usage_logger()
    args = EngineArgs(
        model=settings["model_dir"],
        dtype=settings["dtype"],
        max_model_len=settings["max_model_len"],
        max_num_seqs=settings["max_num_seqs"],
        max_num_batched_tokens=settings["max_num_batched_tokens"],
        enable_prefix_caching=settings["enable_prefix_caching"],
        enforce_eager=settings["enforce_eager"],
        skip_tokenizer_init=True,  # the ids are speech ids; there is no tokenizer to load
        enable_prompt_embeds=True,  # the prefill is computed by vocalis (text + prompt speech embeddings)
        generation_config="vllm",  # no defaults from files: every request says how it samples
        seed=0,
        # the speech head in fp32 even when the body runs bf16: sampling reads the head's scores
        hf_overrides={"head_dtype": "float32"} if settings["dtype"] != "float32" else {},
        disable_log_stats=False,  # feeds the usage logger
    )
    engine = LLMEngine.from_engine_args(args, stat_loggers=[usage_cls])
    cache = engine.vllm_config.cache_config
    info = {"vllm_version": vllm.__version__, "num_blocks": cache.num_gpu_blocks, "block_size": cache.block_size}
    return engine, usage, info


def sampling_params(spec: dict[str, Any]) -> Any:
    """vLLM SamplingParams from the plain dict `backends/vllm/engine.py` sends (new ids only, no detokenizing)."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    return SamplingParams(
        temperature=spec["temperature"],  # 0: greedy (arg-max)
        top_p=spec["top_p"],
        top_k=spec["top_k"],
        seed=spec["seed"],
        min_tokens=spec["min_tokens"],
        max_tokens=spec["max_tokens"],
        stop_token_ids=spec["stop_token_ids"],
        ignore_eos=True,  # the model has no eos of its own: stop_token_ids say when to stop
        detokenize=False,
        output_kind=RequestOutputKind.DELTA,
    )


def send(conn: Connection, message: object) -> None:
    conn.send_bytes(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))


def receive(conn: Connection) -> Any:
    return pickle.loads(conn.recv_bytes())


def serve(conn: Connection, engine: Any, usage: dict[str, float]) -> None:
    while True:
        message = receive(conn)
        kind = message[0]
        try:
            if kind == "step":
                events = []
                for out in engine.step():
                    ids = list(out.outputs[0].token_ids) if out.outputs else []
                    events.append((out.request_id, ids, bool(out.finished)))
                send(conn, ("ok", (events, usage["kv_usage"])))
            elif kind == "add":
                _, request_id, embeds, spec = message
                engine.add_request(request_id, {"prompt_embeds": embeds}, sampling_params(spec))
                send(conn, ("ok", None))
            elif kind == "abort":
                engine.abort_request(list(message[1]))
                send(conn, ("ok", None))
            elif kind == "shutdown":
                send(conn, ("ok", None))
                return
            else:
                send(conn, ("error", f"unknown message {kind!r}"))
        except Exception:  # noqa: BLE001 -- reported to the caller, who raises it; the worker keeps serving
            send(conn, ("error", traceback.format_exc()))


def main() -> None:
    conn = Connection(int(sys.argv[1]))
    try:
        settings = receive(conn)
        engine, usage, info = build_engine(settings)
    except Exception:  # noqa: BLE001 -- start-up failures go back to the caller, who raises them
        send(conn, ("error", traceback.format_exc()))
        return
    send(conn, ("ready", info))
    try:
        serve(conn, engine, usage)
    except (EOFError, OSError):  # the caller went away: nothing left to serve
        pass
    finally:
        conn.close()


if __name__ == "__main__":  # vLLM may spawn helpers that re-import the main module
    main()
