"""The TUN forwarder's per-direction packet model (pure: a clock value in, a due time out)."""

from __future__ import annotations

import math
import random
import socket

import pytest

from lowband.errors import ConfigError
from transport.links.tun.shape import AccessConfig, GilbertElliott, Path, PathConfig

pytestmark = pytest.mark.timeout(30)


def _path(**kw: object) -> Path:
    return Path(PathConfig(**kw), rng=random.Random(7))  # type: ignore[arg-type]


def test_delay_and_rate_serialise_packets_back_to_back():
    p = _path(delay_ms=20, rate_mbit=8)  # 1000 bytes take 1 ms at 8 Mbit/s
    dues = [p.admit(10.0, 1000) for _ in range(5)]
    assert dues == pytest.approx([10.0 + 0.020 + 0.001 * (i + 1) for i in range(5)])
    # After the queue has drained, a packet waits only its own serialisation time.
    assert p.admit(11.0, 1000) == pytest.approx(11.021)


def test_unlimited_rate_only_delays():
    p = _path(delay_ms=5)
    assert [p.admit(1.0, 1500) for _ in range(3)] == pytest.approx([1.005] * 3)


def test_queue_longer_than_queue_ms_is_tail_dropped():
    p = _path(rate_mbit=8, queue_ms=10.5)  # 1 ms per packet: waits of 0..10 ms fit
    dues = [p.admit(0.0, 1000) for _ in range(20)]
    kept = [d for d in dues if d is not None]
    assert len(kept) == 11 and p.stats.queue_drops == 9
    assert dues[11:] == [None] * 9


def test_random_loss_is_binomial():
    n, q = 20000, 0.01
    p = _path(loss=q)
    lost = sum(p.admit(0.0, 100) is None for _ in range(n))
    assert abs(lost - n * q) <= 4 * math.sqrt(n * q * (1 - q))
    assert p.stats.lost == lost and p.stats.received == n


def test_gilbert_elliott_losses_come_in_bursts():
    ge = GilbertElliott(p=0.005, r=0.25)  # 2 % stationary loss, bursts of 4 packets on average
    p = _path(burst=ge)
    drops = [p.admit(0.0, 100) is None for _ in range(200_000)]
    rate = sum(drops) / len(drops)
    assert ge.mean_loss == pytest.approx(0.0196, abs=1e-3)
    assert rate == pytest.approx(ge.mean_loss, rel=0.15)
    runs, run = [], 0
    for d in drops:
        if d:
            run += 1
        elif run:
            runs.append(run)
            run = 0
    assert sum(runs) / len(runs) == pytest.approx(1 / ge.r, rel=0.15)  # independent: ~1.0


def test_jitter_spreads_delays_but_never_reorders():
    p = _path(delay_ms=20, jitter_ms=5)
    dues = [p.admit(i * 1e-4, 100) for i in range(2000)]
    assert all(b >= a for a, b in zip(dues, dues[1:]))  # type: ignore[operator]
    delays = [d - i * 1e-4 for i, d in enumerate(dues)]  # type: ignore[operator]
    assert min(delays) >= 0.015 - 1e-9 and max(delays) <= 0.025 + 1e-9
    assert max(delays) - min(delays) > 0.005


def test_reordered_packets_are_overtaken():
    p = _path(delay_ms=10, reorder=0.1, reorder_ms=2)
    dues = [p.admit(i * 1e-4, 100) for i in range(1000)]
    overtaken = sum(a > b for a, b in zip(dues, dues[1:]))  # type: ignore[operator]
    assert p.stats.reordered == pytest.approx(100, abs=40)
    assert overtaken >= p.stats.reordered * 0.8


def test_down_drops_arrivals_and_packets_in_flight():
    p = _path(delay_ms=10)
    assert p.admit(0.0, 100) is not None
    p.config = PathConfig(delay_ms=10, down=True)
    assert p.admit(0.001, 100) is None
    assert not p.deliverable()  # the packet admitted before the cut dies with the link
    assert p.stats.down_drops == 2
    p.config = PathConfig(delay_ms=10)
    assert p.admit(0.002, 100) is not None and p.deliverable()


def test_config_round_trips_and_validates():
    cfg = PathConfig(delay_ms=3, burst=GilbertElliott(p=0.01, r=0.5), reorder=0.2)
    assert PathConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ConfigError, match="loss"):
        PathConfig(loss=1.5)
    with pytest.raises(ConfigError, match="delay_ms"):
        PathConfig(delay_ms=-1)
    with pytest.raises(ConfigError, match="burst.r"):
        GilbertElliott(p=0.1, r=0.0)
    with pytest.raises(ConfigError, match="access.rate_mbit"):
        AccessConfig(rate_mbit=0)
    with pytest.raises(ConfigError, match="access.queue_ms"):
        AccessConfig(rate_mbit=10, queue_ms=-1)


# ---- the forwarder with access links (socket pairs stand in for the TUN devices) -------------
def _packet(dst: int, size: int = 1000) -> bytes:
    head = bytes([0x45]) + bytes(15) + bytes([10, 9, 0, dst + 1])  # IPv4, destination 10.9.0.x
    return head + bytes(size - len(head))


@pytest.fixture
def sites():
    pairs = [socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET) for _ in range(3)]
    for fwd_end, _ in pairs:
        fwd_end.setblocking(False)  # as Forwarder.run sets the TUNs
    yield pairs
    for a, b in pairs:
        a.close()
        b.close()


def _forwarder(sites, access):
    from transport.links.tun.forward import Forwarder

    paths = {
        (s, d): Path(PathConfig(delay_ms=10), rng=random.Random(1))
        for s in range(3)
        for d in range(3)
        if s != d
    }
    addrs = [f"10.9.0.{i + 1}" for i in range(3)]
    return Forwarder([fwd.fileno() for fwd, _ in sites], addrs, paths, access)


@pytest.mark.parametrize("access", [None, AccessConfig(rate_mbit=8, queue_ms=1000)])
def test_an_access_link_is_shared_by_every_path_of_its_site(sites, access):
    fwd = _forwarder(sites, access)
    for _ in range(20):  # site 0 sends 20 packets of 1000 bytes (1 ms each at 8 Mbit/s) to 1 and 2
        sites[0][1].send(_packet(1))
        sites[0][1].send(_packet(2))
    fwd._read(sites[0][0].fileno(), 0, now=100.0)
    dues = sorted(e[0] for e in fwd.heap)
    assert len(dues) == 40
    if access is None:  # dedicated circuits with no rate: only the delay
        assert dues == pytest.approx([100.010] * 40)
        return
    # One uplink: the 40 packets leave back to back, whatever their destination.
    assert dues == pytest.approx([100.010 + 0.001 * (k + 1) for k in range(40)])
    assert not any(e[5] for e in fwd.heap)  # each still has its destination's downlink ahead
    fwd._deliver(1e9)
    # Each downlink gets a packet every 2 ms and passes it in 1: its last leaves 1 ms after it
    # arrived (site 1's is the 39th off the uplink, site 2's the 40th).
    assert fwd.downlinks[1].free_at == pytest.approx(100.010 + 0.039 + 0.001)
    assert fwd.downlinks[2].free_at == pytest.approx(100.010 + 0.040 + 0.001)
    got = [len(sites[d][1].recv(2000)) for d in (1, 2) for _ in range(20)]
    assert got == [1000] * 40 and fwd.write_errors == 0


def test_a_downlink_serialises_what_several_sites_send_it(sites):
    fwd = _forwarder(sites, AccessConfig(rate_mbit=8, queue_ms=1000))
    for src in (1, 2):
        for _ in range(20):
            sites[src][1].send(_packet(0))
        fwd._read(sites[src][0].fileno(), src, now=100.0)
    fwd._deliver(1e9)
    # Two uplinks deliver a packet each per ms, 10 ms later; site 0's downlink takes 1 ms per
    # packet: the last of the 40 leaves 40 ms after the first arrived (and a ms for the first).
    assert fwd.downlinks[0].free_at == pytest.approx(100.010 + 0.001 + 0.040)
    assert [len(sites[0][1].recv(2000)) for _ in range(40)] == [1000] * 40


def test_a_full_access_queue_tail_drops(sites):
    fwd = _forwarder(sites, AccessConfig(rate_mbit=8, queue_ms=10.5))
    for _ in range(10):
        sites[0][1].send(_packet(1))
        sites[0][1].send(_packet(2))
    fwd._read(sites[0][0].fileno(), 0, now=5.0)
    assert len(fwd.heap) == 11 and fwd.uplinks[0].drops == 9
    assert fwd.stats()["access_drops"]["0"] == {"up": 9, "down": 0}
