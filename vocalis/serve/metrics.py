"""Prometheus metrics of one app (its own registry, so several apps in one process do not collide)."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

_LATENCY_BUCKETS = (0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0, 20.0, 60.0)
_RTF_BUCKETS = (0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0)


_ENGINE_GAUGES = (
    ("llm_running", "vocalis_llm_running_requests", "LLM requests being decoded (or prefilled) now"),
    ("llm_waiting", "vocalis_llm_waiting_requests", "LLM requests waiting for a batch slot or KV blocks"),
    ("llm_batch", "vocalis_llm_batch_size", "Requests sampled in the last LLM step"),
    ("token2wav_batch", "vocalis_token2wav_batch_size", "Streams vocoded together in the last token2wav step"),
    ("token2wav_waiting", "vocalis_token2wav_waiting_streams", "Ready streams waiting for token2wav cache room"),
    ("jobs_queued", "vocalis_engine_queued_requests", "Requests waiting for --max-streams room in the engine"),
    ("generated_tokens", "vocalis_generated_tokens", "Speech tokens generated since start"),
    ("tokens_per_s", "vocalis_generated_tokens_per_second", "Speech tokens generated per second, last 5 s"),
)


_RUNAWAY_REASONS = ("length", "cycle")  # `AsyncEngine.stats` keys runaway_<reason>


class _RunawayStops(Collector):
    """Sentences whose LLM the engine stopped without an end of speech, by reason, read from the engine live."""

    def __init__(self, engine_stats: Callable[[], dict[str, float]]) -> None:
        self.engine_stats = engine_stats

    def collect(self) -> Iterable[CounterMetricFamily]:
        stats = self.engine_stats()
        family = CounterMetricFamily("vocalis_llm_runaway_stops", "Sentences stopped at the text's length bound "
                                     "or in a repeating cycle of speech ids, by reason", labels=["reason"])
        for reason in _RUNAWAY_REASONS:
            family.add_metric([reason], float(stats.get(f"runaway_{reason}", 0.0)))
        yield family


def _peak_rss_bytes() -> float:
    """The process's peak resident size so far (Linux `VmHWM`; 0 where there is none)."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return float(int(line.split()[1]) * 1024)  # kB
    except OSError:
        pass
    return 0.0


class ServeMetrics:
    """Counters, gauges and histograms the app updates; queue depth and running jobs read the backend live."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self, queue_depth: Callable[[], float], running: Callable[[], float],
                 kv_usage: Callable[[], float] | None = None,
                 engine_stats: Callable[[], dict[str, float]] | None = None) -> None:
        self.registry = r = CollectorRegistry()
        self.requests = Counter("vocalis_requests", "Requests by route and status code", ["route", "status"],
                                registry=r)
        self.errors = Counter("vocalis_errors", "Failed requests by route and error kind", ["route", "kind"],
                              registry=r)
        self.aborted = Counter("vocalis_aborted", "Syntheses stopped because the client left or cancelled",
                               registry=r)
        self.active_streams = Gauge("vocalis_active_streams", "Audio responses being sent now", registry=r)
        self.queue_depth = Gauge("vocalis_queue_depth", "Synthesis jobs waiting to start", registry=r)
        self.queue_depth.set_function(queue_depth)
        self.running = Gauge("vocalis_running_jobs", "Synthesis jobs running now", registry=r)
        self.running.set_function(running)
        if kv_usage is not None:  # only a backend with a KV-cache pool (the batching engine) has one
            self.kv_usage = Gauge("vocalis_kv_cache_usage", "Fraction of KV-cache blocks in use", registry=r)
            self.kv_usage.set_function(kv_usage)
        if engine_stats is not None:  # the batching engine's live counters (`AsyncEngine.stats`)
            for key, name, doc in _ENGINE_GAUGES:
                gauge = Gauge(name, doc, registry=r)
                gauge.set_function(lambda key=key: float(engine_stats().get(key, 0.0)))
            r.register(_RunawayStops(engine_stats))
        self.first_chunk = Histogram("vocalis_first_chunk_seconds", "Request arrival to first audio chunk",
                                     ["route"], buckets=_LATENCY_BUCKETS, registry=r)
        self.rtf = Histogram("vocalis_rtf", "Real-time factor: synthesis seconds per audio second", ["route"],
                             buckets=_RTF_BUCKETS, registry=r)
        self.audio_seconds = Counter("vocalis_audio_seconds", "Seconds of audio sent", registry=r)
        # the process's memory (what a model's precision and the engines' caches cost): resident now
        # (`process_resident_memory_bytes`, with the collector's CPU and file figures; Linux) and its peak
        ProcessCollector(registry=r)
        self.peak_rss = Gauge("vocalis_process_peak_resident_memory_bytes", "Peak resident memory of the process "
                              "since it started", registry=r)
        self.peak_rss.set_function(_peak_rss_bytes)

    def render(self) -> bytes:
        return generate_latest(self.registry)
