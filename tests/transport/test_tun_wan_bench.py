"""Smoke run of ``python -m benchmarks.tun_wan`` on a tiny transfer (root + iproute2 + TUN)."""

from __future__ import annotations

import pytest

from tests.conftest import run_json_module
from transport.links.tun.testbed import available

pytestmark = [
    pytest.mark.slow,
    pytest.mark.netns,
    pytest.mark.timeout(150),
    pytest.mark.skipif(available() is not None, reason=f"tun: {available()}"),
]


def test_tun_wan_bench_moves_bytes_over_a_real_rtt():
    args = ["--size-mb", "1", "--rate-mbit", "20", "--delay-ms", "10", "--connections", "1", "2"]
    out = run_json_module("benchmarks.tun_wan", *args, "--rounds", "1", "--json", timeout=140)
    assert out["bytes"] == 1 << 20
    assert abs(out["measured_rtt_ms"]["median_ms"] - 20.0) <= 0.15 * 20.0 + 2.0
    assert [r["connections"] for r in out["results"]] == [1, 2]
    for row in out["results"]:  # the bottleneck really binds lowband's transfers
        assert 0 < row["goodput_mbit"]["max"] <= 20.0
