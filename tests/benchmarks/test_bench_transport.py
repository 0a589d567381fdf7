"""Smoke runs of the transport benchmarks at tiny sizes: they must print their JSON line."""

from __future__ import annotations

import json
import subprocess

import pytest

from tests.conftest import PY, REPO

pytestmark = pytest.mark.timeout(180)


def _last_json(args: list[str]) -> dict:
    out = subprocess.run([PY, "-m", *args], capture_output=True, text=True, timeout=170, cwd=REPO)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_allreduce_bench_vs_gloo_prints_its_json():
    """The default run measures what the library does (shared memory: all ranks are local)
    and, in the same run, TCP, each labelled."""
    r = _last_json(
        [
            "benchmarks.transport",
            "allreduce",
            "--world",
            "2",
            "--size-mb",
            "1",
            "--iters",
            "2",
            "--warmup",
            "1",
            "--chunk-mb",
            "0.25",
            "--vs-gloo",
            "--json",
        ]
    )
    for key in (
        "world",
        "bytes",
        "connections",
        "algorithm",
        "seconds",
        "algbw_GBps",
        "busbw_GBps",
        "gloo_busbw_GBps",
        "ratio_vs_gloo",
        "transport",
        "tcp_seconds",
        "tcp_busbw_GBps",
        "same_host_ratio_vs_gloo",
    ):
        assert key in r
    assert r["world"] == 2 and r["bytes"] == 1 << 20
    assert (r["transport_requested"], r["transport"], r["algorithm"]) == ("auto", "shm", "shm")
    assert (r["tcp_transport"], r["tcp_algorithm"]) == ("tcp", "ring")
    assert r["bytes_sent_per_rank"] < 10_000  # only slab announcements crossed a socket
    assert r["busbw_GBps"] == pytest.approx(r["algbw_GBps"], rel=0.01)  # 2(n-1)/n = 1
    # the headline is TCP against Gloo's TCP; shared memory is a separate, labelled row
    assert r["ratio_vs_gloo"] == pytest.approx(r["tcp_busbw_GBps"] / r["gloo_busbw_GBps"], rel=0.02)
    assert r["same_host_ratio_vs_gloo"] == pytest.approx(
        r["busbw_GBps"] / r["gloo_busbw_GBps"], rel=0.02
    )
    assert "not like for like" in r["same_host_ratio_vs_gloo_is"]
    assert "refilled untimed" in r["gloo_mode"]


def test_allreduce_bench_forced_tcp_measures_tcp_only():
    r = _last_json(
        [
            "benchmarks.transport",
            "allreduce",
            "--world",
            "2",
            "--size-mb",
            "1",
            "--iters",
            "1",
            "--warmup",
            "1",
            "--chunk-mb",
            "0.25",
            "--transport",
            "tcp",
            "--json",
        ]
    )
    assert (r["transport"], r["algorithm"]) == ("tcp", "ring")
    assert r["bytes_sent_per_rank"] == 1 << 20  # ring: 2(n-1)/n of the payload for n = 2
    assert "tcp_seconds" not in r
