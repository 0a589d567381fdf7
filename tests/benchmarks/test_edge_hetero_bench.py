"""Smoke-run of the heterogeneous-split benchmark at a tiny size: it runs, cleans up its cgroup,
and its JSON has every figure."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import PY


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_hetero_bench_tiny(spawn) -> None:
    p = spawn(
        [
            PY,
            "-m",
            "benchmarks.edge_hetero",
            "--preset",
            "tiny",
            "--repeats",
            "1",
            "--tokens",
            "2",
            "--warmup",
            "1",
            "--prompt-len",
            "4",
            "--hand",
            "2",
            "--json",
        ],
        stdout=-1,
    )
    out, _ = p.communicate(timeout=280)
    assert p.returncode == 0
    res = json.loads(out.decode().strip().splitlines()[-1])
    ms = res["ms_per_token"]
    assert set(ms) == {"auto", "even", "hand 2.0", "master alone"}
    assert all(v["median"] > 0 for v in ms.values())
    assert res["best_hand"] in ("2.0:1", "master alone") and res["auto_over_best_hand"] > 0
    assert len(res["auto_weights"]) == 1 and res["auto_predicted_ms"][0] > 0
    assert "split over" in res["auto_explanation"]
    assert not list(Path("/sys/fs/cgroup/cpu").glob(f"lowband-hetero-{p.pid}"))
