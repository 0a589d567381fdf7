"""Smoke-run of benchmarks.edge_window_gguf on a tiny K-quant GGUF file: every arm reports,
the window arms map no more than their blocks and report the blocks and fixed bytes."""

from __future__ import annotations

import json

import pytest

from tests.conftest import PY
from tests.edge.test_gguf_kquants import TYPES, write_mixed


@pytest.mark.timeout(300)
def test_bench_tiny(spawn, tmp_path) -> None:
    _, path = write_mixed(tmp_path / "m.gguf", TYPES, num_hidden_layers=4)
    p = spawn(
        [
            PY,
            "-m",
            "benchmarks.edge_window_gguf",
            "--model",
            str(path),
            "--windows",
            "4,1",
            "--eager-arm",
        ]
        + ["--repeats", "1", "--tokens", "2", "--warmup", "1", "--prompt-len", "4"]
        + ["--paced-mbps", "400", "--paced-tokens", "1", "--json"],
        stdout=-1,
    )
    out, _ = p.communicate(timeout=280)
    assert p.returncode == 0
    res = json.loads(out.decode().strip().splitlines()[-1])
    arms = res["arms"]
    assert set(arms) == {"resident", "eager", "W=4", "W=1"}
    assert not arms["eager"]["compiled"] and "mapped_mb" not in arms["eager"]
    assert arms["W=4"]["window"] == 4 and arms["W=1"]["window"] == 1
    assert arms["W=4"]["compiled"] and not arms["W=1"]["compiled"]
    assert arms["W=1"]["mapped_mb"]["max"] < arms["W=4"]["mapped_mb"]["min"]
    assert arms["W=1"]["paced_ms_per_token"]["median"] > 0
    assert 0 < arms["W=1"]["block_mb_max"] <= arms["W=1"]["blocks_mb"]
