"""Smoke run of benchmarks.diloco_memory on a tiny model: both arms, the JSON line, sane sizes."""

from __future__ import annotations

import json
import subprocess
import sys


def test_memory_bench_prints_bytes_per_param() -> None:
    argv = [sys.executable, "-m", "benchmarks.diloco_memory", "--model", "llama:128:2"]
    argv += ["--repeats", "1", "--steps", "8", "--json"]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=240, check=True)
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["benchmark"] == "diloco_memory" and set(res["arms"]) == {"diloco", "ddp"}
    assert 0 < res["params"] < 10_000_000
    for arm in res["arms"].values():
        peak, base = arm["peak_bytes"]["median"], arm["baseline_bytes"]["median"]
        assert peak >= base > 0
