"""Smoke-run of the edge benchmark at a tiny size: it runs and its JSON has every figure."""

from __future__ import annotations

import json

import pytest

import transport.zmq_comm  # noqa: F401 - the project's own module: never a skip
from tests.conftest import PY


@pytest.mark.slow
def test_bench_tiny(spawn, tmp_path) -> None:
    p = spawn(
        [
            PY,
            "-m",
            "benchmarks.edge",
            "--preset",
            "tiny",
            "--tokens",
            "2",
            "--warmup",
            "1",
            "--repeats",
            "1",
            "--prompt-len",
            "8",
            "--no-decomposition",
            "--workdir",
            str(tmp_path),
            "--json",
        ],
        stdout=-1,
    )
    out, _ = p.communicate(timeout=280)
    assert p.returncode == 0
    res = json.loads(out.decode().strip().splitlines()[-1])
    assert res["parity_max_abs"] <= 1e-4 and res["tp_parity_max_abs"] <= 1e-4
    assert res["same_greedy_tokens"] is True
    for k in ("1", "2"):
        assert res["decode_ms_per_token"][k] > 0
    assert res["tp_speedup"] > 0 and res["bytes_per_token_wire"] > 0
    assert 0 < res["window"]["rss_ratio"] and res["window"]["peak_rss_mb"] > 0
    assert res["full"]["peak_rss_mb"] > 0 and res["window"]["blocks"] == 2
    paced = res["window"]["paced"]  # block reads paced to storage speeds, beside warm and cold
    assert set(paced) == {"microSD", "eMMC", "NVMe"}
    assert all(v["decode_ms_per_token"] > 0 and v["latency_ratio"] > 0 for v in paced.values())
    assert 0 <= res["profile_1dev"]["matmul_frac"] <= 1.5
