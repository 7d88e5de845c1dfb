"""The bench's bandwidth-limit arithmetic and probes (no timing asserted beyond "positive")."""

from __future__ import annotations

import numpy as np
import pytest

from vocalis.bench.bandwidth import BandwidthProbe, copy_gbps, decode_fraction, read_gbps, spread
from vocalis.bench.decode_bytes import kv_bytes_per_position, llm_bytes_per_token
from vocalis.config import PRESETS


def test_decode_fraction_is_decode_bytes_per_s_over_median_probe() -> None:
    segments = [(10, 0.5), (10, 0.25)]  # 20 tokens in 0.75 s
    probes = [30.0, 10.0, 20.0]  # median 20 GB/s
    step_bytes = [1e9, 2e9]  # GB per step in each segment
    d = decode_fraction(segments, probes, step_bytes)
    read = 10 * 1e9 + 10 * 2e9
    assert d["tokens"] == 20 and d["decode_tps"] == pytest.approx(20 / 0.75)
    assert d["segment_tps"] == pytest.approx([20.0, 40.0])
    assert d["bytes_per_token"] == pytest.approx(read / 20)
    assert d["decode_gbps"] == pytest.approx(read / 0.75 / 1e9)
    assert d["bandwidth_gbps"] == 20.0
    assert d["fraction_of_limit"] == pytest.approx(read / 0.75 / 1e9 / 20.0)
    # the limit in tok/s and the fraction agree: decode tok/s / limit tok/s == fraction
    assert d["decode_tps"] / d["decode_limit_tps"] == pytest.approx(d["fraction_of_limit"])
    # each segment against the mean of the probes on either side of it
    assert d["segment_fractions"] == pytest.approx([20.0 / 20.0, 80.0 / 15.0])
    assert d["segment_fraction_spread"] == pytest.approx({"min": 1.0, "median": (1.0 + 80 / 15) / 2, "max": 80 / 15})


def test_decode_fraction_needs_a_probe_around_every_segment() -> None:
    with pytest.raises(AssertionError):
        decode_fraction([(1, 1.0)], [1.0], [1.0])


def test_spread() -> None:
    assert spread([3.0, 1.0, 2.0]) == {"min": 1.0, "median": 2.0, "max": 3.0}


def test_bytes_per_step_at_the_official_shapes() -> None:
    cfg = PRESETS["cosyvoice2-0.5b"].llm
    q = cfg.qwen
    fp32, int8 = llm_bytes_per_token(cfg, "fp32"), llm_bytes_per_token(cfg, "int8")
    norms = (2 * q.num_hidden_layers + 1) * q.hidden_size * 4
    assert fp32 - norms == 4 * (int8 - norms)  # same weights, 4 bytes vs 1
    assert 1.3e9 < fp32 < 1.6e9  # ~0.36 G linear parameters in fp32
    assert kv_bytes_per_position(cfg, "fp32") == 24 * 2 * 2 * 64 * 4 == 2 * kv_bytes_per_position(cfg, "bf16")
    assert kv_bytes_per_position(cfg, "int8") == kv_bytes_per_position(cfg, "fp32")  # fp32 cache under int8


def test_probes_in_process_and_in_a_worker() -> None:
    buf = np.ones(4 * 2**20, dtype=np.uint8)
    assert read_gbps(buf, 2) > 0 and copy_gbps(buf, np.empty_like(buf), 1) > 0
    with BandwidthProbe(threads=1, read_mib=8, copy_mib=4) as probe:
        a, b = probe.measure(), probe.measure()
    assert set(a) == {"read_gbps", "copy_gbps"} and a["read_gbps"] > 0 and b["copy_gbps"] > 0
    assert probe.samples == [a, b]
