"""Memory-bandwidth probes for `vocalis bench`'s decode limit, and the arithmetic that turns them into a fraction.

Why this shape: a batch-1 decode step streams every weight (and the row's K/V) from memory once, so its ceiling is
the machine's streaming *read* bandwidth with the threads the decode uses. On a shared VM that bandwidth moves
by 20-40 % from one second to the next, so one probe before and one after a short decode does not describe what
the decode got (fractions above 1 were seen). The bench therefore interleaves: probe, decode segment, probe, ...,
probe, and divides the decode's bytes/s by the *median* probe. The min/median/max of the probes and of the
per-segment fractions are reported with it, so a reader sees how much the host moved during the run.

A probe is a streaming read of a buffer 8x the 32 MiB LLC (`READ_MIB`): torch's uint8 `max()` over it on `threads`
OpenMP threads, `READ_PASSES` times. It counts the bytes read over the wall time of all passes (a sustained
figure, like the decode's; no best-of). Why native threads: the probe used to be numpy's byte max split over
`threads` Python threads, 2 passes; each thread's pass over its 128 MiB took a few ms, so thread start-up skew was
a real share of it, and it set the limit too low (a native read loop on the same threads agrees with this
probe). The
STREAM-style copy (bytes read + written, numpy copyto) is probed too and reported for context.

Page size: numpy asks for transparent huge pages on large buffers (madvise), so the probe reads from 2 MiB pages;
the engine moves its decoder weights and KV cache onto them too (`engine.huge_pages`, unless
VOCALIS_HUGE_PAGES=0), and 4 KiB pages read slower. The limit keeps the huge-page figure: it is what the memory delivers
(the report records VOCALIS_HUGE_PAGES and THP_MEM_ALLOC_ENABLE).

The probes run in a separate process (`BandwidthProbe`, spawned before the caller builds its model), so their
buffers never count in the bench side's peak RSS; the caller blocks while a probe runs, so the two never overlap.
"""

from __future__ import annotations

import multiprocessing as mp
import statistics
import threading
import time
from collections.abc import Sequence
from typing import Any, Self

import numpy as np
import torch

READ_MIB = 256  # probe buffer: 8x this machine's LLC, so every pass streams from DRAM
COPY_MIB = 128  # copy probe: source and destination each this size (read + write = 2x)
READ_PASSES = 4


def read_gbps(buf: np.ndarray, threads: int, passes: int = READ_PASSES) -> float:
    """Streaming-read bandwidth, GB/s: `passes` reads of `buf` (uint8) by torch's max() on `threads` OpenMP threads."""
    data = torch.from_numpy(buf)  # the same memory, no copy
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        start = time.perf_counter()
        for _ in range(passes):
            data.max()
        return passes * buf.nbytes / (time.perf_counter() - start) / 1e9
    finally:
        torch.set_num_threads(before)


def copy_gbps(src: np.ndarray, dst: np.ndarray, threads: int, passes: int = 1) -> float:
    """STREAM "copy" bandwidth, GB/s: bytes read + written per second, `threads` threads."""
    pairs = list(zip(np.array_split(dst, threads), np.array_split(src, threads)))
    start = time.perf_counter()
    for _ in range(passes):
        _in_threads(np.copyto, pairs)
    return passes * 2 * src.nbytes / (time.perf_counter() - start) / 1e9


def _in_threads(fn: Any, args: list[tuple[Any, ...]]) -> None:
    if len(args) == 1:
        fn(*args[0])
        return
    workers = [threading.Thread(target=fn, args=a) for a in args]
    for w in workers:
        w.start()
    for w in workers:
        w.join()


def _probe_worker(conn: Any, threads: int, read_mib: int, copy_mib: int) -> None:
    buf = np.ones(read_mib * 2**20, dtype=np.uint8)  # ones: every page really mapped before the first probe
    src = np.ones(copy_mib * 2**20, dtype=np.uint8)
    dst = np.zeros_like(src)
    read_gbps(buf, threads, 1)  # warm-up
    conn.send("ready")
    while conn.recv() == "probe":
        conn.send({"read_gbps": read_gbps(buf, threads), "copy_gbps": copy_gbps(src, dst, threads)})


class BandwidthProbe:
    """A probe process: `measure()` runs one read probe and one copy probe there and returns their GB/s."""

    def __init__(self, threads: int, read_mib: int = READ_MIB, copy_mib: int = COPY_MIB) -> None:
        ctx = mp.get_context("spawn")  # no fork of a process that holds torch's thread pools
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_probe_worker, args=(child, threads, read_mib, copy_mib), daemon=True)
        self._proc.start()
        child.close()
        self.threads = threads
        self.samples: list[dict[str, float]] = []
        assert self._conn.recv() == "ready"

    def measure(self) -> dict[str, float]:
        self._conn.send("probe")
        sample: dict[str, float] = self._conn.recv()
        self.samples.append(sample)
        return sample

    def close(self) -> None:
        if self._proc.is_alive():
            self._conn.send("stop")
            self._proc.join(timeout=10)
        self._conn.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class DeviceBandwidthProbe:
    """`BandwidthProbe`'s interface for a CUDA device: the same read (uint8 max) and copy probes, on device memory,
    in this process (the buffers live in GPU memory, so they do not count in the side's peak RSS)."""

    def __init__(self, device: torch.device, read_mib: int = 4096, copy_mib: int = 2048) -> None:
        self.device = device
        self._buf = torch.ones(read_mib * 2**20, dtype=torch.uint8, device=device)
        self._src = torch.ones(copy_mib * 2**20, dtype=torch.uint8, device=device)
        self._dst = torch.zeros_like(self._src)
        self.samples: list[dict[str, float]] = []
        self._timed(lambda: self._buf.max())  # warm-up

    def _timed(self, fn: Any, passes: int = READ_PASSES) -> float:
        torch.cuda.synchronize(self.device)
        start = time.perf_counter()
        for _ in range(passes):
            fn()
        torch.cuda.synchronize(self.device)
        return (time.perf_counter() - start) / passes

    def measure(self) -> dict[str, float]:
        sample = {"read_gbps": self._buf.numel() / self._timed(lambda: self._buf.max()) / 1e9,
                  "copy_gbps": 2 * self._src.numel() / self._timed(lambda: self._dst.copy_(self._src)) / 1e9}
        self.samples.append(sample)
        return sample

    def close(self) -> None:
        del self._buf, self._src, self._dst
        torch.cuda.empty_cache()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def probe_for(device: str | torch.device, threads: int) -> BandwidthProbe | DeviceBandwidthProbe:
    """The probe matching where the decode runs: host memory (a probe process) or the CUDA device's memory."""
    dev = torch.device(device)
    return DeviceBandwidthProbe(dev) if dev.type == "cuda" else BandwidthProbe(threads)


def spread(values: Sequence[float]) -> dict[str, float]:
    return {"min": min(values), "median": statistics.median(values), "max": max(values)}


def decode_fraction(segments: Sequence[tuple[int, float]], probes: Sequence[float],
                    bytes_per_token: Sequence[float]) -> dict[str, Any]:
    """The batch-1 decode against its bandwidth limit.

    segments: (tokens, seconds) per decode segment; probes: read GB/s, one before each segment and one after the
    last (len(segments) + 1); bytes_per_token: the bytes one step of each segment reads (weights + K/V).
    Returns decode tok/s and GB/s over all segments, the limit from the median probe, the fraction (decode GB/s /
    median probe GB/s) and the per-segment fractions (each segment against the mean of the probes around it).
    """
    assert len(probes) == len(segments) + 1 and len(bytes_per_token) == len(segments)
    tokens = sum(n for n, _ in segments)
    seconds = sum(s for _, s in segments)
    read = sum(n * b for (n, _), b in zip(segments, bytes_per_token))
    mean_bytes = read / tokens
    bandwidth = statistics.median(probes)
    per_segment = [n * b / s / 1e9 / ((probes[i] + probes[i + 1]) / 2)
                   for i, ((n, s), b) in enumerate(zip(segments, bytes_per_token))]
    return {
        "tokens": tokens,
        "decode_tps": tokens / seconds,
        "segment_tps": [n / s for n, s in segments],
        "bytes_per_token": mean_bytes,
        "decode_gbps": read / seconds / 1e9,
        "bandwidth_gbps": bandwidth,
        "decode_limit_tps": bandwidth * 1e9 / mean_bytes,
        "fraction_of_limit": read / seconds / 1e9 / bandwidth,
        "segment_fractions": per_segment,
        "segment_fraction_spread": spread(per_segment),
    }


def measure_bandwidth(mib: int = 256, repeats: int = 5) -> dict[str, float]:
    """numpy copy bandwidth, bytes read + written per second (the STREAM "copy" convention), 1 and 2 threads;
    best of `repeats` (the machine's figure for the report header; the decode limit uses `bench_bandwidth`'s probes)."""
    a = np.ones(mib * 2**20 // 4, dtype=np.float32)
    b = np.empty_like(a)
    one, two = (max(copy_gbps(a, b, threads) for _ in range(repeats)) for threads in (1, 2))
    return {"copy_gbps_1_thread": one, "copy_gbps_2_threads": two, "copy_gbps": max(one, two)}
