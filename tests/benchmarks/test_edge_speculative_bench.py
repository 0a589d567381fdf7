"""Smoke run of benchmarks.edge_speculative on a tiny random model (ours only)."""

from __future__ import annotations

import json

import pytest

import cli
from benchmarks import edge_speculative


@pytest.mark.timeout(300)
def test_edge_speculative_tiny(capsys: pytest.CaptureFixture[str]) -> None:
    assert (
        edge_speculative.main(
            ["--tiny", "--tokens", "12", "--repeats", "1", "--settle", "0", "--json"]
        )
        == 0
    )
    rec = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rec["benchmark"] == "edge_speculative"
    # the arms ran under the command line's OpenMP wait (in a child where this process lacked it)
    assert rec["result"]["omp_wait"] == {"policy": "cli", **cli.OPENMP_WAIT}
    for w in ("code-edit", "free-text"):
        res = rec["result"]["workloads"][w]
        assert all(res["identical"].values()) and len(res["identical"]) == 3
        assert res["lowband-tiny/draft"]["acceptance"] == 1.0  # the target drafting for itself
        assert res["lowband-tiny/off"]["tok_s"]["median"] > 0
    streams = rec["result"]["workloads"]["8-streams"]  # 8 requests decoding together
    assert streams["lowband-tiny/off"]["tok_s"]["median"] > 0
    assert streams["lowband-tiny/lookup"]["speedup"] > 0
