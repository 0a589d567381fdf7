"""Smoke run of ``benchmarks.diloco_sites`` at its smallest size: 2 sites × 1 and × 2 Gloo ranks
(real processes), one repeat each; the JSON line is last and carries the issue's keys."""

from __future__ import annotations

import json

import pytest


@pytest.mark.timeout(300)
def test_sites_bench_prints_bytes_per_rank_and_outer_step(capsys) -> None:
    from benchmarks.diloco_sites import main

    out = main(["--json", "--repeats", "1", "--steps", "20"])
    line = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert line == out and set(out["configs"]) == {"2x1", "2x2"}
    for cfg in out["configs"].values():
        assert cfg["sync_bytes_per_rank"]["median"] > 0
        assert cfg["outer_step_s"]["median"] >= 0 and 0 <= cfg["overhead"]["median"] < 1
        assert cfg["tokens_per_s_site"]["median"] > 0
    # each of N ranks syncs only its shard: about 1/N of a single-rank site's bytes
    assert 0.4 < out["bytes_ratio"] < 0.6
