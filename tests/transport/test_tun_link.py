"""Calibration of the TUN WAN emulator with kernel TCP/UDP in namespaces (tier 3: root +
iproute2 + /dev/net/tun). The tolerances are the point: the emulator must give the sites' TCP the
configured RTT, rate and loss."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import time
from dataclasses import replace

import pytest

from lowband.errors import ConfigError
from transport.links.tun.calibrate import (
    measure_goodput,
    measure_outage,
    measure_rtt,
    measure_udp_loss,
)
from transport.links.tun.shape import AccessConfig, GilbertElliott, PathConfig
from transport.links.tun.testbed import TunConfig, TunTestbed, available

pytestmark = [
    pytest.mark.slow,
    pytest.mark.netns,
    pytest.mark.timeout(120),
    pytest.mark.skipif(available() is not None, reason=f"tun: {available()}"),
]

WAN = PathConfig(delay_ms=20.0, rate_mbit=50.0)  # RTT 40 ms, BDP 250 kB


def _namespaces() -> str:
    return subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout


@pytest.fixture(scope="module")
def wan():
    with TunTestbed(TunConfig(path=WAN, seed=3)) as bed:
        yield bed
    assert not any(ns in _namespaces() for ns in bed.ns)


def test_rtt_is_twice_the_one_way_delay(wan):
    rtt = measure_rtt(wan)["median_ms"]
    assert abs(rtt - 40.0) <= 0.15 * 40.0 + 2.0, rtt


@pytest.mark.parametrize("cc", ["", "cubic"])
def test_one_flow_fills_the_rate_when_the_window_allows(wan, cc):
    # Default socket buffers: autotuning grows the window past the 250 kB BDP. The 50 ms queue
    # (1.25 BDP) keeps even cubic's window above the BDP after it halves.
    out = measure_goodput(wan, 4.0, cc=cc, port=5313 if cc else 5302)
    assert out["goodput_mbit"] <= 50.0  # IP rate: TCP/IP headers come out of it
    assert out["steady_goodput_mbit"] >= 0.85 * 50.0, out


def test_a_small_window_caps_one_flow_at_window_over_rtt(wan):
    # SO_RCVBUF 32 KiB (the kernel doubles it): at most 64 KiB in flight per 40 ms RTT, 13 Mbit/s,
    # far under the rate. A link that hid the RTT from TCP (a relay) would give ~48 Mbit/s here.
    out = measure_goodput(wan, 3.0, rcvbuf=32 << 10, port=5310)
    bound = 2 * (32 << 10) * 8 / 0.040 / 1e6
    assert out["steady_goodput_mbit"] <= bound * 1.1, out
    assert out["steady_goodput_mbit"] >= 0.1 * bound, out  # the flow did run


def test_nothing_passes_while_the_link_is_down_and_tcp_resumes(wan):
    out = measure_outage(wan, at=1.0, down_s=1.0, seconds=4.0)
    assert out["down_s"] >= 1.0
    assert out["packets_forwarded_while_down"] == 0
    assert out["bytes_received_while_down"] == 0
    assert out["bytes_received_after_up"] > 0 and out["resumed_after_s"] is not None, out


def test_random_loss_matches_the_configured_rate():
    n, q = 4000, 0.01
    with TunTestbed(TunConfig(path=replace(WAN, loss=q), seed=5)) as bed:
        out = measure_udp_loss(bed, count=n)
    assert out["queue_drops"] == 0  # paced: every missing datagram is the link's loss
    assert out["forwarder_lost"] == n - out["received"]
    assert abs(out["loss"] - q) <= 4 * math.sqrt(q * (1 - q) / n), out


def test_bursty_loss_and_reordering_reach_the_sites():
    ge = GilbertElliott(p=0.01, r=0.25)  # ~3.8 % loss in bursts of 4 on average
    path = replace(WAN, burst=ge, reorder=0.05, reorder_ms=3.0)
    with TunTestbed(TunConfig(path=path, seed=11)) as bed:
        out = measure_udp_loss(bed, count=6000, pps=3000)
    assert out["forwarder_lost"] == 6000 - out["received"]
    assert out["loss"] == pytest.approx(ge.mean_loss, rel=0.35), out
    assert out["mean_loss_run"] == pytest.approx(1 / ge.r, rel=0.35), out  # independent: ~1
    # A held-back datagram arrives after those sent in the next 3 ms (9 at 3000/s) overtook it.
    assert out["reordered"] >= 0.8 * out["forwarder_reordered"] > 0, out


def test_each_direction_of_each_pair_has_its_own_path():
    near = PathConfig(delay_ms=5.0)
    cfg = TunConfig(sites=3, path=WAN, paths={(2, 0): near, (0, 2): near}, seed=1)
    with TunTestbed(cfg) as bed:
        far = measure_rtt(bed, count=10, src=1, dst=0)["median_ms"]
        close = measure_rtt(bed, count=10, src=2, dst=0, port=5311)["median_ms"]
        forwarded = bed.stats()["paths"]
    assert abs(far - 40.0) <= 0.15 * 40.0 + 2.0
    assert abs(close - 10.0) <= 0.15 * 10.0 + 2.0
    assert forwarded["1->2"]["received"] == 0  # nothing crossed a path it was not addressed to


def test_an_access_link_limits_paths_that_have_no_rate_of_their_own():
    # The forwarder's sharing of one access link by several paths is tested without root in
    # test_tun_shape; here the testbed hands the access link to the forwarder.
    cfg = TunConfig(path=PathConfig(delay_ms=10.0), access=AccessConfig(rate_mbit=20.0), seed=2)
    with TunTestbed(cfg) as bed:
        out = measure_goodput(bed, 3.0, port=5316)
        drops = bed.stats()["access_drops"]
    assert 0.85 * 20.0 <= out["steady_goodput_mbit"] and out["goodput_mbit"] <= 20.0, out
    assert out["queue_drops"] == 0  # the path itself queues nothing
    assert set(drops) == {"0", "1"}


def test_congestion_control_is_set_per_site_where_the_host_allows_it():
    allowed = subprocess.run(
        ["sysctl", "-n", "net.ipv4.tcp_allowed_congestion_control"], capture_output=True, text=True
    ).stdout.split()
    assert "reno" in allowed  # the kernel always allows reno
    with TunTestbed(TunConfig(path=WAN, congestion="reno")) as bed:
        got = bed.run_in(
            1, ["sysctl", "-n", "net.ipv4.tcp_congestion_control"], capture_output=True
        )
    assert got.stdout.strip() == b"reno"
    if "cubic" not in allowed:  # a namespace cannot default to it: said, not ignored
        with pytest.raises(ConfigError, match="TCP_CONGESTION"):
            with TunTestbed(TunConfig(path=WAN, congestion="cubic")):
                pass


def test_namespace_sysctls_are_set_in_every_site_and_checked():
    wmem = "4096 16384 204800"
    with TunTestbed(TunConfig(path=WAN, sysctls=(("net.ipv4.tcp_wmem", wmem),))) as bed:
        got = [
            bed.run_in(i, ["sysctl", "-n", "net.ipv4.tcp_wmem"], capture_output=True, text=True)
            for i in range(2)
        ]
    assert [g.stdout.split() for g in got] == [wmem.split()] * 2
    with pytest.raises(ConfigError, match="sysctls"):
        TunConfig(sysctls=(("kernel.hostname", "x"),))
    with pytest.raises(ConfigError, match="sysctls"):  # the kernel refuses it: said, not ignored
        with TunTestbed(TunConfig(path=WAN, sysctls=(("net.ipv4.no_such_knob", "1"),))):
            pass


def test_the_host_joins_as_one_more_endpoint():
    cfg = TunConfig(path=WAN, host=True, paths={(2, 0): PathConfig(delay_ms=10.0)}, seed=2)
    with TunTestbed(cfg) as bed:
        assert bed.addr(2) == bed.host and bed.command(2, ["true"]) == ["true"]
        rtt = measure_rtt(bed, count=10, src=0, dst=2, port=5312)["median_ms"]  # sink in the host
        forwarded = bed.stats()["paths"]
    assert abs(rtt - 30.0) <= 0.15 * 30.0 + 2.0  # 20 ms there, 10 ms back
    assert forwarded["0->2"]["delivered"] >= 10 and forwarded["2->0"]["delivered"] >= 10
    links = subprocess.run(["ip", "link"], capture_output=True, text=True).stdout
    assert bed.host_tun not in links


def test_a_site_setting_its_tun_down_does_not_stop_the_forwarder():
    with TunTestbed(TunConfig(path=PathConfig(delay_ms=5.0))) as bed:
        bed.run_in(0, ["ip", "link", "set", bed.tuns[0], "down"], check=True)
        send = "import socket,sys; s=socket.socket(socket.AF_INET, socket.SOCK_DGRAM); " + (
            "[s.sendto(b'x', (sys.argv[1], 9)) for _ in range(5)]"
        )
        bed.run_in(1, [sys.executable, "-c", send, bed.addr(0)], check=True)
        deadline = time.monotonic() + 10
        while bed.stats()["write_errors"] < 5 and time.monotonic() < deadline:
            time.sleep(0.01)  # polling the forwarder's counter: the 5 ms delay must pass
        assert bed.stats()["write_errors"] == 5
        bed.run_in(0, ["ip", "link", "set", bed.tuns[0], "up"], check=True)
        assert abs(measure_rtt(bed, count=5, port=5314)["median_ms"] - 10.0) <= 3.5


def test_everything_is_removed_even_if_the_body_fails():
    with pytest.raises(RuntimeError, match="boom"):
        with TunTestbed(TunConfig(path=WAN)) as bed:
            names, fwd = bed.ns, bed._fwd
            raise RuntimeError("boom")
    assert fwd is not None and fwd.poll() is not None  # the forwarder is gone
    assert not any(ns in _namespaces() for ns in names)
    links = subprocess.run(["ip", "link"], capture_output=True, text=True).stdout
    assert not any(t in links for t in bed.tuns)


def test_calibrate_cli_prints_one_json_line():
    proc = subprocess.run(
        [sys.executable, "-m", "transport.links.tun", "--calibrate", "--json", "--seconds", "1"],
        capture_output=True,
        text=True,
        timeout=110,
    )
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert abs(out["rtt"]["median_ms"] - 40.0) <= 8.0
    assert out["outage"]["packets_forwarded_while_down"] == 0
    assert out["ceiling"]["goodput_mbit"] > 0
