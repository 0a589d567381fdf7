"""``python -m benchmarks.ship_wan``: its configuration, and a smoke run on a tiny file (root +
iproute2 + TUN)."""

from __future__ import annotations

import pytest

from benchmarks.ship_wan import ShipBench
from lowband.errors import ConfigError
from tests.conftest import run_json_module
from transport.links.tun.testbed import available


@pytest.mark.parametrize(
    "bad", [{"size_mb": 0}, {"repeats": 0}, {"chunks_mb": ()}, {"chunks_mb": (8.0,)}]
)
def test_bad_benches_are_config_errors(bad):
    with pytest.raises(ConfigError):
        ShipBench(**bad)


def test_arms():
    assert ShipBench(chunks_mb=(1.0, 0.5)).arms == ["ship_1mb", "ship_0.5mb", "bulk", "cached"]


@pytest.mark.slow
@pytest.mark.netns
@pytest.mark.timeout(200)
@pytest.mark.skipif(available() is not None, reason=f"tun: {available()}")
def test_a_tiny_shipment_over_the_emulated_wifi_path():
    args = ["--size-mb", "1", "--repeats", "1", "--chunk-mb", "0.25", "--loss", "0", "--json"]
    out = run_json_module("benchmarks.ship_wan", *args, timeout=190)
    assert out["bytes"] == 1 << 20
    assert set(out["arms"]) == {"ship_0.25mb", "bulk", "cached"}
    for arm in ("ship_0.25mb", "bulk"):  # the 100 Mbit/s bottleneck binds both
        assert 0 < out["arms"][arm]["goodput_mbit"]["max"] <= 100.0
    assert "goodput_mbit" not in out["arms"]["cached"]  # nothing moves: no goodput to report
    assert abs(out["measured_rtt_ms"]["median_ms"] - 4.0) <= 1.5  # 1 ms of jitter each way
