"""The async engine's live counters (`AsyncEngine.stats`, read by `/metrics`): read from any thread, so values may
be one step old."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from vocalis.runtime.async_engine import AsyncEngine


def engine_stats(engine: AsyncEngine, jobs: int, queued: int) -> dict[str, float]:
    """Jobs running and queued (given), LLM requests running and waiting, KV-cache usage, steps, the last steps'
    batch sizes, generated tokens (total and per second over the last few seconds), runaway stops."""
    bm = engine.llm.block_manager
    scheduler = getattr(engine.llm, "scheduler", None)
    running = len(scheduler.running) if scheduler is not None else engine.llm.num_unfinished
    waiting = len(scheduler.waiting) if scheduler is not None else 0
    return {"jobs": jobs, "jobs_queued": queued, "llm_requests": engine.llm.num_unfinished,
            "llm_running": running, "llm_waiting": waiting, "kv_usage": 1.0 - bm.num_free_blocks / bm.num_blocks,
            "llm_steps": engine.num_llm_steps, "token2wav_steps": engine.num_token2wav_steps,
            "llm_batch": engine.last_llm_batch, "token2wav_batch": engine.last_token2wav_batch,
            "token2wav_waiting": engine.token2wav.held,
            "generated_tokens": engine.generated.total, "tokens_per_s": engine.generated.rate(),
            **{f"runaway_{reason}": float(n) for reason, n in engine.runaway_stops.items()}}
