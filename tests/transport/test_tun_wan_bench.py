"""``python -m benchmarks.tun_wan``: its configuration, and smoke runs on tiny transfers (root +
iproute2 + TUN)."""

from __future__ import annotations

import pytest

from benchmarks.tun_wan import TunWanBench
from lowband.errors import ConfigError
from tests.conftest import run_json_module
from transport.links.tun.testbed import available

needs_tun = pytest.mark.skipif(available() is not None, reason=f"tun: {available()}")


@pytest.mark.parametrize(
    "bad",
    [
        {"delays_ms": ()},
        {"losses": ()},
        {"connections": ()},
        {"rounds": 0},
        {"rate_mbit": 100.0, "as_rate_mbit": 50.0},
    ],
)
def test_bad_sweeps_are_config_errors(bad):
    with pytest.raises(ConfigError):
        TunWanBench(**bad)


@pytest.mark.slow
@pytest.mark.netns
@pytest.mark.timeout(200)
@needs_tun
def test_a_sweep_moves_bytes_over_each_cells_rtt_and_scales_the_buffers():
    args = ["--size-mb", "1", "--rate-mbit", "20", "--delay-ms", "2", "25", "--loss", "0"]
    more = ["--connections", "1", "2", "--rounds", "1", "--as-rate-mbit", "200", "--json"]
    out = run_json_module("benchmarks.tun_wan", *args, *more, timeout=190)
    assert out["bytes"] == 1 << 20
    assert [(c["configured_rtt_ms"], c["loss"]) for c in out["cells"]] == [(4.0, 0.0), (50.0, 0.0)]
    short, long_ = (c["measured_rtt_ms"]["median_ms"] for c in out["cells"])
    assert abs(long_ - 50.0) <= 0.15 * 50.0 + 2.0 and short < 25.0  # the path changed between cells
    # a stock host's buffers at 200 Mbit/s, scaled to the 20 Mbit/s run: a tenth
    assert out["tcp_buffers"]["net.ipv4.tcp_wmem"].split()[-1] == str(4 * (1 << 20) // 10)
    assert "200 Mbit/s" in out["link"]
    for cell in out["cells"]:  # the bottleneck really binds lowband's transfers
        assert [r["connections"] for r in cell["results"]] == [1, 2]
        assert all(0 < r["goodput_mbit"]["max"] <= 20.0 for r in cell["results"])
