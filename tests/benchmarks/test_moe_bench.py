"""Smoke run of ``python -m benchmarks.moe --json --tiny``: every reported key, sane values."""

from __future__ import annotations

import json
import math
import subprocess
from pathlib import Path

import pytest

from tests.conftest import PY

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]


def test_bench_smoke_prints_every_figure(tmp_path: Path, spawn) -> None:
    p = spawn(
        # 20 of the tiny preset's 40 training steps: the same figures, a less trained MoE
        [PY, "-m", "benchmarks.moe", "--json", "--tiny", "--train-steps", "20"]
        + ["--cache-dir", str(tmp_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    out, err = p.communicate(timeout=280)
    assert p.returncode == 0, err[-3000:]
    res = json.loads(out.strip().splitlines()[-1])
    for b in (8, 4, 3, 2):
        for kind in ("nested", "independent"):
            assert 0 <= res[f"{kind}.{b}.rel_err"] < 1
            assert 1 < res[f"{kind}.{b}.ppl"] < 256
    # The 8-bit slice is the int8 model itself; lower widths lose more.
    assert res["nested.8.rel_err"] < res["nested.4.rel_err"] < res["nested.2.rel_err"]
    for policy in ("hebf", "lru_int8", "int8_resident", "lru_int8_prefetch"):
        assert res[f"{policy}.tokens_per_s"] > 0
        assert res[f"{policy}.peak_rss_mb"] > res[f"{policy}.model_rss_mb"] > 0
        assert math.isfinite(res[f"{policy}.ppl"])
    assert res["lru_int8.hit_rate"] < 1.0 and res["int8_resident.hit_rate"] == 1.0
    assert res["lru_int8.mean_bits"] == 8.0 and 2.0 <= res["hebf.mean_bits"] < 8.0
    # the headline is against the faster int8 LRU (prefetch on or off), both on plain int8 codes
    best = res["best_lru"]
    assert best in ("lru_int8", "lru_int8_prefetch")
    assert res[f"{best}.tokens_per_s"] == max(
        res["lru_int8.tokens_per_s"], res["lru_int8_prefetch.tokens_per_s"]
    )
    assert res["throughput_ratio"] == pytest.approx(
        res["hebf.tokens_per_s"] / res[f"{best}.tokens_per_s"]
    )
    # the unpaced (page-cache) ratio is always there, beside the paced headline
    assert res["throughput_ratio_unpaced"] == res["sweep_io.0.throughput_ratio"] > 0
    assert res["memory_ratio"] == pytest.approx(
        res["hebf.model_rss_mb"] / res["int8_resident.model_rss_mb"]
    )
    # The trained model sits in the cache directory for the next run to reuse.
    models = list(tmp_path.glob("tiny-*/model/train_log.json"))
    assert len(models) == 1
