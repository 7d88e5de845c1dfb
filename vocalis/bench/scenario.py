"""What `vocalis bench` measures on, shared by both sides: the configuration (`BenchConfig`), a model with random
weights at a preset's shapes (`build`), and the inputs. Every utterance is forced to a fixed speech-token count
(min_len = max_len, all stop ids masked), so no trained model is needed and both sides do the same work.

The scenario is a saved zero-shot voice (a prompt of `prompt_tokens` speech tokens with its transcript), the
common cloning case; every request speaks `tokens` speech tokens (25 per second of audio).
"""

from __future__ import annotations

import dataclasses
import resource
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from vocalis.backends.choice import apply_backend
from vocalis.backends.load_precision import llm_load_converter
from vocalis.config import SamplingConfig
from vocalis.engine.request import SamplingParams
from vocalis.frontend.voice import Voice
from vocalis.model_dir import LoadedModel, random_model
from vocalis.reference.decode import generate
from vocalis.reference.sampling import make_sampler
from vocalis.runtime.async_engine import AsyncEngine

if TYPE_CHECKING:
    from vocalis.backends.choice import Runtime

WORDS = ("the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "while", "seven", "bright", "birds",
         "sing", "near", "old", "river", "banks")


PARTS = ("llm", "token2wav", "e2e")
REPEAT_SALT = 1000  # text salt step between repeated end-to-end requests (distinct texts, same length)


@dataclass(frozen=True)
class BenchConfig:
    preset: str = "cosyvoice2-0.5b"
    precisions: tuple[str, ...] = ("fp32",)
    backend: str = "torch"
    threads: int = 2
    batches: tuple[int, ...] = (1, 4, 16)
    concurrency: tuple[int, ...] = (1, 4, 8, 16)
    decode_tokens: int = 16  # decode steps timed per LLM measurement at batch > 1
    b1_decode_tokens: int = 64  # batch-1 decode steps timed against the bandwidth limit (bench_bandwidth)
    b1_segments: int = 4  # ... in this many segments, a bandwidth probe before each and after the last
    b1_warmup_tokens: int = 4  # untimed batch-1 decode steps first (the first steps after prefill ran slower)
    e2e_repeats: int = 3  # single-stream end-to-end requests per side; their medians are reported (one varies ~10 %)
    stream_repeats: int = 1  # engine batches per concurrency above 1; their medians are reported
    rounds: int = 1  # reference then engine sides, this many times; each round's ratios, their medians reported
    tokens: int = 75  # speech tokens per utterance (3 s)
    prompt_tokens: int = 75  # the voice's prompt speech (3 s)
    text_words: int = 12
    seed: int = 0
    parts: tuple[str, ...] = ("llm", "token2wav", "e2e")  # what each side measures (PARTS)
    device: str = "cpu"  # both sides run there ("cuda": the decode limit comes from the GPU's memory bandwidth)
    max_streams: int | None = None  # the engine's cap on requests in flight (Token2WavConfig.max_streams)
    t2w_step: int | None = None  # the engine's requests per token2wav step (Token2WavConfig.max_batch)
    t2w_workers: int | None = None  # threads sharing a token2wav step's requests (Token2WavConfig.workers)
    flow_steps: int | None = None  # the engine's Euler steps (Token2WavConfig.flow_steps); the reference keeps the model's

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> BenchConfig:
        return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in data.items()})


def peak_gpu_mib(device: str) -> float | None:
    """The peak of torch's CUDA allocations in this process (None off CUDA): what the model, caches and
    activations held at most."""
    return torch.cuda.max_memory_allocated(device) / 2**20 if device.startswith("cuda") else None


def peak_rss_mib() -> float:
    """This process's peak resident memory. VmHWM (Linux) starts afresh at exec; ru_maxrss would include the
    parent's resident size at fork time."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024  # kB
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB



def bench_voice(model: LoadedModel, cfg: BenchConfig) -> Voice:
    g = torch.Generator().manual_seed(cfg.seed + 7)
    n = cfg.prompt_tokens
    speech = torch.randint(0, model.config.llm.speech_token_size, (n,), generator=g).tolist()
    mel = torch.randn(2 * n, model.config.flow.output_size, generator=g) - 5.0
    assert model.tokenizer is not None
    text_ids = tuple(model.tokenizer.encode("this is the voice prompt speaking clearly"))
    return Voice("bench", "this is the voice prompt speaking clearly", text_ids, tuple(speech), mel,
                 torch.randn(model.config.spk_embed_dim, generator=g))


def bench_text(cfg: BenchConfig, salt: int) -> str:
    return " ".join(WORDS[(salt * 5 + i) % len(WORDS)] for i in range(cfg.text_words)) + "."


def forced_sampler(sampling: SamplingConfig, generator: torch.Generator | None, stop_ids: Sequence[int]):
    """RAS with every stop id masked: with min_len = max_len the reference decodes exactly that many ids."""
    ras = make_sampler(sampling, generator)
    stops = list(stop_ids)

    def sample(scores: torch.Tensor, decoded: Sequence[int]) -> int:
        scores = scores.clone()
        scores[stops] = float("-inf")
        return ras(scores, decoded)

    return sample


def build(cfg: BenchConfig, precision: str | None) -> tuple[LoadedModel, Runtime | None, str]:
    """The side's model, the `Runtime` its engines run on (None: plain torch) and a line describing it."""
    torch.set_num_threads(cfg.threads)
    # a reduced-precision LLM converted as it is built: the side never holds its fp32 form
    convert = None if precision is None else llm_load_converter(cfg.backend, precision, cfg.device)
    model = random_model(cfg.preset, seed=cfg.seed, llm_convert=convert).to(cfg.device)
    if precision is None:
        return model, None, f"reference path, fp32 torch, {cfg.device}"
    if precision == "fp32" and cfg.backend == "torch":
        return model, None, f"backend torch, precision fp32, {cfg.device}"
    runtime = apply_backend(model, cfg.backend, precision, cfg.device)
    return model, runtime, runtime.describe()


def device_generator(cfg: BenchConfig, seed: int) -> torch.Generator:
    """A seeded generator on the bench's device (sampling and the vocoder's noise draw there)."""
    return torch.Generator(device=cfg.device).manual_seed(seed)


def sync_device(cfg: BenchConfig) -> None:
    """Wait for queued GPU work before reading a clock (CPU work is synchronous)."""
    if torch.device(cfg.device).type == "cuda":
        torch.cuda.synchronize(cfg.device)


def fixed_length_generate(model: LoadedModel, tokens: int) -> Callable[..., Iterator[int]]:
    """A `Synthesizer.generate` that decodes exactly `tokens` ids per sentence (RAS with the stop ids masked)."""
    stops = model.config.llm.stop_token_ids

    def fixed(text_ids: list[int], prompt_text_ids: list[int], prompt_speech_ids: list[int],
              sampling: SamplingConfig, generator: torch.Generator) -> Iterator[int]:
        return generate(model.llm, text_ids, prompt_text_ids, prompt_speech_ids, min_len=tokens, max_len=tokens,
                        sample_fn=forced_sampler(sampling, generator, stops))

    return fixed


def fixed_length_engine(tokens: int) -> type[Any]:
    """An `AsyncEngine` whose requests decode exactly `tokens` ids per sentence (every stop id masked)."""
    class FixedLengthEngine(AsyncEngine):
        def llm_params(self, text_ids: list[int]) -> SamplingParams:
            base = super().llm_params(text_ids)
            return dataclasses.replace(base, min_len=tokens, max_len=tokens, stop_all_masked=True)

    return FixedLengthEngine


def medians(runs: list[dict[str, float]]) -> dict[str, Any]:
    """The median of every figure over repeated runs, and the runs themselves under "runs"."""
    out: dict[str, Any] = {k: float(np.median([r[k] for r in runs])) for k in runs[0]}
    out["runs"] = runs
    return out
