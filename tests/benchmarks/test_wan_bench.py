"""``benchmarks.wan``: rate scaling, arm order and the summary are pure and tested here; one tiny
profile over the TUN emulator (2 sites, 0.4 MB, 1 repeat) needs root + iproute2 + /dev/net/tun."""

from __future__ import annotations

import pytest

from benchmarks.wan import (
    PROFILES,
    DilocoWan,
    WanBench,
    arm_order,
    parse_arm,
    run_rate,
    summarize,
    summarize_torchft,
    tcp_buffer_sysctls,
)
from lowband.errors import ConfigError
from tests.conftest import run_json_module
from transport.links.tun.testbed import available

pytestmark = pytest.mark.timeout(240)


def test_fast_profiles_are_capped_and_labelled_slow_ones_kept():
    assert run_rate(PROFILES["continent"], 50.0) == (50.0, "1 Gbit/s profile run at 50 Mbit/s")
    assert run_rate(PROFILES["home"], 200.0) == (100.0, "100 Mbit/s (as configured)")
    assert PROFILES["intercontinental"].rtt_ms == 160.0 and PROFILES["home"].loss == 0.005


def test_every_arm_takes_every_position():
    arms = ["a", "b", "c"]
    assert [arm_order(arms, i) for i in range(3)] == [
        ["a", "b", "c"],
        ["b", "c", "a"],
        ["c", "a", "b"],
    ]


def test_summary_takes_the_slowest_site_and_compares_with_gloo():
    # rows: per arm, per iteration (seconds, bytes the site's TUN sent)
    ranks = [
        {"rows": {"lowband_k1": [(2.0, 10**6), (4.0, 10**6)], "gloo": [(3.0, 10**6)] * 2}},
        {"rows": {"lowband_k1": [(3.0, 3 * 10**6), (1.0, 3 * 10**6)], "gloo": [(6.0, 10**6)] * 2}},
    ]
    s = summarize(ranks, ["lowband_k1", "gloo"], rate_mbit=8.0)
    assert s["lowband_k1"]["all_seconds"] == [3.0, 4.0]
    assert s["lowband_k1"]["seconds"] == {"median": 3.5, "min": 3.0, "max": 4.0}
    assert s["lowband_k1"]["site_tx_bytes"] == 2 * 10**6
    # 2 MB in 3 s at 8 Mbit/s: 16e6 bits / 3 s / 8e6 = 0.667; in 4 s: 0.5
    assert s["lowband_k1"]["link_utilisation"] == {"median": 0.583, "min": 0.5, "max": 0.667}
    assert s["best_k"] == 1 and s["ratio_vs_gloo"] == {"k1": round(6.0 / 3.5, 3)}


def test_arms_name_k_and_the_schedule_and_the_best_is_named():
    cfg = WanBench(connections=(1, 4), algorithms=("auto", "ring"), gloo=False)
    assert cfg.arms == ["lowband_k1", "lowband_k4", "lowband_k1_ring", "lowband_k4_ring"]
    assert [parse_arm(a) for a in cfg.arms] == [(1, "auto"), (4, "auto"), (1, "ring"), (4, "ring")]
    ranks = [
        {"rows": {"lowband_k1": [(2.0, 1)], "lowband_k4_ring": [(1.0, 1)], "gloo": [(3.0, 1)]}}
    ]
    s = summarize(ranks, ["lowband_k1", "lowband_k4_ring", "gloo"], rate_mbit=8.0)
    assert s["best_arm"] == "lowband_k4_ring" and s["best_k"] == 4
    assert s["ratio_vs_gloo"] == {"k1": 1.5, "k4_ring": 3.0} and s["best_ratio_vs_gloo"] == 3.0


def test_scale_size_keeps_the_bytes_per_bandwidth_delay_product():
    assert WanBench(size_mb=64).nbytes(50.0, 1000.0) == 64 << 20  # not scaled unless asked
    scaled = WanBench(size_mb=64, scale_size=True)
    assert scaled.nbytes(50.0, 1000.0) == int(3.2 * (1 << 20)) // 4 * 4
    assert scaled.nbytes(100.0, 100.0) == 64 << 20 and scaled.nbytes() == 64 << 20


def test_torchft_summary_reports_eval_loss_and_the_goal():
    def row(wall: float, loss: float) -> dict[str, float]:
        return {"wall_s": wall, "site_tx_bytes": 100, "eval_loss": loss}

    runs = {
        "lowband": [row(2.0, 3.0), row(4.0, 3.2), row(3.0, 3.1)],
        "torchft": [row(10.0, 3.3), row(8.0, 3.1), row(12.0, 3.2)],
    }
    s = summarize_torchft(runs)
    assert s["lowband"]["eval_loss"] == {"median": 3.1, "min": 3.0, "max": 3.2}
    assert s["torchft"]["eval_loss"]["median"] == 3.2
    # paired lowband/torchft walls 0.2, 0.5, 0.25: median 0.25
    assert s["wall_ratio_lowband_over_torchft"] == 0.25
    assert s["eval_loss_gap"] == round((3.1 - 3.2) / 3.2, 4)
    assert s["goal_wall_le_0.8x_at_le_loss"] and s["must_wall_le_1.0x_at_le_loss"]
    # a higher loss fails the comparison whatever the wall clock
    runs["lowband"] = [row(1.0, 3.5)] * 3
    s = summarize_torchft(runs)
    assert not s["goal_wall_le_0.8x_at_le_loss"] and not s["must_wall_le_1.0x_at_le_loss"]


def test_scaled_tcp_buffers_keep_the_stock_window_share_of_the_bdp():
    # 1 Gbit/s run at 50 Mbit/s: the stock maxima (4 MiB send, 6 MiB receive) times 1/20
    wmem, rmem = dict(tcp_buffer_sysctls(50.0 / 1000.0)).values()
    assert wmem == "4096 16384 209715" and rmem == "4096 131072 314572"
    assert dict(tcp_buffer_sysctls(0.001))["net.ipv4.tcp_wmem"] == "4096 4194 4194"


def test_config_is_validated():
    with pytest.raises(ConfigError, match="profiles"):
        WanBench(profiles=("moon",))
    with pytest.raises(ConfigError, match="connections"):
        WanBench(connections=(0,))
    assert WanBench(gloo=False, connections=(4, 4), algorithms=("auto",)).arms == ["lowband_k4"]
    with pytest.raises(ConfigError, match="algorithms"):
        WanBench(algorithms=("tree",))
    with pytest.raises(ConfigError, match="topology"):
        WanBench(topology="bus")
    with pytest.raises(ConfigError, match="profile"):
        DilocoWan(profile="moon")
    with pytest.raises(ConfigError, match="workers"):
        DilocoWan(workers=1)


@pytest.mark.slow
@pytest.mark.netns
@pytest.mark.skipif(available() is not None, reason=f"tun: {available()}")
def test_tiny_profile_over_the_tun_emulator():
    args = ["--profiles", "home", "--sites", "2", "--size-mb", "2", "--repeats", "1"]
    args += ["--connections", "1", "2", "--calib-seconds", "1", "--udp-count", "500"]
    args += ["--algorithms", "auto", "scatter", "--scale-size", "--max-rate-mbit", "20"]
    out = run_json_module("benchmarks.wan", *args, "--json", timeout=220)
    assert out["bytes"] == 2 << 20 and out["max_rate_mbit"] == 20.0
    assert out["topology"] == "access"
    home = out["profiles"]["home"]
    assert home["rate_mbit_run"] == 20.0
    assert home["bytes"] == int(0.4 * (1 << 20)) // 4 * 4  # scaled with the rate: a scale model
    assert home["rate_label"] == "100 Mbit/s profile run at 20 Mbit/s"
    calib = home["calibration"]
    assert abs(calib["rtt_ms"]["median_ms"] - 30.0) <= 0.15 * 30.0 + 2.0
    assert 0 < calib["tcp_flow"]["goodput_mbit"] <= 20.0 * 1.05
    assert calib["udp"]["sent"] == 500 and 0 <= calib["udp"]["loss"] < 0.05
    ar = home["allreduce"]
    arms = ("lowband_k1", "lowband_k2", "lowband_k1_scatter", "lowband_k2_scatter", "gloo")
    assert set(ar) >= {*arms, "best_k", "best_arm", "ratio_vs_gloo"}
    assert ar["algorithm"]["lowband_k1"] == "ring"  # auto
    assert ar["algorithm"]["lowband_k1_scatter"] == "scatter"
    for arm in arms:
        assert len(ar[arm]["all_seconds"]) == 1 and ar[arm]["seconds"]["median"] > 0
        # two sites: each sends its whole tensor once (plus headers/ACKs/retransmissions); a
        # rank may return while its last chunks are still leaving, so a little can be missing
        assert ar[arm]["site_tx_bytes"] >= 0.9 * home["bytes"]
        assert ar[arm]["link_utilisation"]["median"] > 0
    assert ar["best_k"] in (1, 2) and ar["best_ratio_vs_gloo"] > 0
