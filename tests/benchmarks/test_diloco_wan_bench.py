"""``benchmarks.diloco_wan``: the run order, the wall-time decomposition and the summary are pure
and tested here; one tiny run over real tbf-shaped namespaces needs root + iproute2."""

from __future__ import annotations

import dataclasses

import pytest

from benchmarks.diloco import BenchConfig
from benchmarks.diloco_wan import WanBench, decompose, run_order, run_wanbench, summarize
from lowband.errors import ConfigError
from transport.links.netns import available

pytestmark = pytest.mark.timeout(240)


def test_every_variant_takes_every_position():
    order = run_order(("a", "b", "c"), 3)
    assert [v for _, v in order] == ["a", "b", "c", "b", "c", "a", "c", "a", "b"]
    assert [r for r, _ in order] == [0] * 3 + [1] * 3 + [2] * 3


def test_decomposition_splits_wall_into_compute_wait_and_rest():
    finals = [
        {"wall_s": 10.0, "compute_s": 8.0, "sync_s": 1.5, "bytes_sent": 100},
        {"wall_s": 9.0, "compute_s": 7.0, "sync_s": 1.0, "bytes_sent": 300},
    ]
    d = decompose(finals, waits=[1.0, 0.6], steps=20)
    assert (d["wall_s"], d["compute_s"], d["wait_s"], d["sync_s"]) == (10.0, 7.5, 0.8, 1.25)
    assert d["other_s"] == pytest.approx(10.0 - 7.5 - 0.8)
    assert d["steps_per_s"] == 2.0 and d["bytes_per_worker"] == 200
    assert decompose(finals, waits=[], steps=20)["wait_s"] == 1.25  # DDP: the sync is the wait


def _run(wall: float, wait: float) -> dict:
    return {
        "steps": 10,
        "wall_s": wall,
        "steps_per_s": 10 / wall,
        "compute_s": wall - wait - 0.1,
        "wait_s": wait,
        "other_s": 0.1,
        "bytes_per_worker": 1.0,
    }


def test_summary_pairs_repeats_and_explains_the_gain_from_the_wait():
    no = [_run(10.0, 2.0), _run(12.0, 2.0), _run(11.0, 2.0)]
    ov = [_run(8.0, 0.0), _run(11.0, 1.0), _run(10.0, 1.0)]
    s = summarize({"diloco_no_overlap": no, "streaming_overlap": ov})
    assert s["diloco_no_overlap"]["wall_s"] == {"median": 11.0, "min": 10.0, "max": 12.0}
    ratios = sorted(n["wall_s"] / o["wall_s"] for n, o in zip(no, ov))
    assert s["speedup_overlap_vs_no_overlap"]["median"] == pytest.approx(ratios[1], abs=1e-3)
    # explained: the no-overlap wall over the same minus the wait overlap removed
    assert s["explained_speedup"]["max"] == pytest.approx(10.0 / 8.0, abs=1e-3)
    assert s["wait_removed_s"] == {"median": 1.0, "min": 1.0, "max": 2.0}
    assert s["no_overlap_wall_spread"] == pytest.approx(2 / 11, abs=1e-3)


def test_config_is_validated():
    with pytest.raises(ConfigError, match="repeats"):
        WanBench(repeats=0)
    with pytest.raises(ConfigError, match="variants"):
        WanBench(variants=("ddp", "nope"))


@pytest.mark.slow
@pytest.mark.netns
@pytest.mark.skipif(available() is not None, reason=f"netns: {available()}")
def test_wan_bench_tiny_over_real_links():
    w = WanBench(
        workers=2,
        rate_mbit=20,
        steps=30,
        repeats=1,
        net=178,
        variants=("diloco_no_overlap", "streaming_overlap"),
    )
    out = run_wanbench(w, dataclasses.replace(BenchConfig(), inner_steps=15, tau=2))
    assert out["link"].startswith("REAL") and out["repeats"] == 1
    for v in w.variants:
        r = out["raw"][v][0]
        assert r["steps"] == 30 and r["wall_s"] > 0 and r["compute_s"] > 0
        assert r["wait_s"] <= r["sync_s"] + 1e-6
    assert out["speedup_overlap_vs_no_overlap"]["median"] > 0
