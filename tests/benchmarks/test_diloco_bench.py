"""Smoke run of ``python -m benchmarks.diloco`` at its tiny size: the JSON line and its invariants."""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.timeout(180)


def test_bench_tiny_prints_its_json_line(capsys, tmp_path):
    from benchmarks.diloco import main

    assert main(["--json", "--tiny", "--seeds", "2", "--plot", str(tmp_path / "p.png")]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    cfg = out["config"]
    for key in ("workers", "H", "P", "tau", "alpha", "codec", "steps", "tokens"):
        assert key in cfg
    assert cfg["tokens"] == cfg["workers"] * cfg["steps"] * cfg["batch_size"] * cfg["seq_len"]
    ddp, dl = out["ddp"], out["diloco"]
    # DDP all-reduces fp32 gradients every step; DiLoCo sends 4-bit fragments every H/P steps
    assert ddp["outer_syncs"] == cfg["steps"]
    assert dl["outer_syncs"] == cfg["steps"] // (cfg["H"] // cfg["P"])
    assert out["bytes_ratio"] == pytest.approx(ddp["bytes_per_worker"] / dl["bytes_per_worker"])
    assert out["bytes_ratio"] > 20
    assert out["loss_gap"] == pytest.approx((dl["eval_loss"] - ddp["eval_loss"]) / ddp["eval_loss"])
    seeds = out["seeds"]
    assert [s["seed"] for s in seeds] == [0, 1] and seeds[0]["ddp_eval"] != seeds[1]["ddp_eval"]
    assert dl["eval_loss"] == pytest.approx((seeds[0]["diloco_eval"] + seeds[1]["diloco_eval"]) / 2)
    assert 0 < dl["peak_sync_bytes"] < ddp["peak_sync_bytes"]
    wc = out["wallclock"]
    assert wc["link"].startswith("MODELLED")
    assert {"ddp", "diloco_no_overlap", "streaming_overlap"} <= set(wc)
    assert (tmp_path / "p.png").stat().st_size > 1000
