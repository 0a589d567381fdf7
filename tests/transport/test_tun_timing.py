"""Sub-millisecond paths in the TUN emulator: the forwarder's wake-up decision (pure), its
high-resolution timer, and (root) measured against configured round trips."""

from __future__ import annotations

import select
import sys
import time

import pytest

from benchmarks.tun_wan import RttLadderBench
from lowband.errors import ConfigError
from transport.links.tun.calibrate import measure_rtt, rtt_tolerance_ms, set_rtt
from transport.links.tun.testbed import TunConfig, TunTestbed, available
from transport.links.tun.timer import Deadline, poll_timeout


def test_nothing_in_flight_blocks():
    assert poll_timeout(None, 5.0, 3e-4, timer=True) is None
    assert poll_timeout(None, 5.0, 3e-4, timer=False) is None


def test_within_the_spin_window_the_poll_does_not_sleep():
    assert poll_timeout(5.0002, 5.0, 3e-4, timer=True) == 0.0
    assert poll_timeout(5.0002, 5.0, 3e-4, timer=False) == 0.0
    assert poll_timeout(4.0, 5.0, 0.0, timer=True) == 0.0  # overdue


def test_with_a_timer_the_poll_blocks_until_it_fires():
    assert poll_timeout(5.002, 5.0, 3e-4, timer=True) is None


def test_without_a_timer_the_sleep_is_whole_milliseconds_rounded_down():
    # 2.7 ms to the wake-up: sleep 2 ms (epoll's unit), spin the rest; never late by rounding
    assert poll_timeout(5.003, 5.0, 3e-4, timer=False) == pytest.approx(0.002)
    assert poll_timeout(5.0009, 5.0, 3e-4, timer=False) == 0.0
    # no spinning at all: the exact wait, which epoll rounds up (the old, late behaviour)
    assert poll_timeout(5.0005, 5.0, 0.0, timer=False) == pytest.approx(0.0005)


@pytest.mark.skipif(sys.platform != "linux", reason="timerfd is Linux-only")
@pytest.mark.timeout(10)
def test_the_timer_fires_at_an_absolute_time_and_disarms():
    d = Deadline()
    assert d.fd is not None
    ep = select.epoll()
    ep.register(d.fd, select.EPOLLIN)
    try:
        d.arm(time.monotonic() + 3600)
        assert ep.poll(0) == []  # an hour away
        d.arm(time.monotonic() - 1)  # already due: readable at once
        assert [fd for fd, _ in ep.poll(5)] == [d.fd]
        d.fired()
        assert ep.poll(0) == []  # consumed, not re-armed
        d.arm(time.monotonic() + 3600)
        d.arm(None)
        assert ep.poll(0) == []
    finally:
        ep.close()
        d.close()


@pytest.mark.parametrize("spin", [-1.0, 2001.0])
def test_spin_is_bounded(spin):
    with pytest.raises(ConfigError):
        TunConfig(spin_us=spin)


@pytest.mark.parametrize(
    "bad", [{"rtts_ms": ()}, {"rtts_ms": (-1.0,)}, {"repeats": 0}, {"count": 0}, {"busy_s": -1}]
)
def test_bad_ladders_are_config_errors(bad):
    with pytest.raises(ConfigError):
        RttLadderBench(**bad)


def test_tolerance_is_ten_percent_and_fifty_microseconds():
    assert rtt_tolerance_ms(0.5) == pytest.approx(0.1)
    assert rtt_tolerance_ms(4.0) == pytest.approx(0.45)


@pytest.mark.netns
@pytest.mark.timeout(120)
@pytest.mark.skipif(available() is not None, reason=f"tun: {available()}")
@pytest.mark.parametrize("rtt_ms", [0.5, 4.0])
def test_measured_rtt_is_the_configured_one(rtt_ms):
    # Median of 40 TCP handshakes. The forwarder and the connecting end run at real-time
    # priority: on a loaded host (CI, other jobs) their wake-ups are otherwise late by more
    # than the tolerance (0.5 ms measured 0.8-2.5 ms at load average 9 on 2 cores). A wake-up
    # delayed all the same adds to a round trip, so up to three measurements; one within
    # tolerance shows the forwarder makes the path. The millisecond-poll forwarder measured
    # 2.4 ms at 0.5 ms.
    with TunTestbed(TunConfig(realtime=True)) as bed:
        set_rtt(bed, rtt_ms)
        got = []
        for port in (5341, 5342, 5343):
            got.append(measure_rtt(bed, count=40, port=port, realtime=True)["median_ms"])
            if abs(got[-1] - rtt_ms) <= rtt_tolerance_ms(rtt_ms):
                break
        assert abs(got[-1] - rtt_ms) <= rtt_tolerance_ms(rtt_ms), got
        assert bed.stats()["late_us"]["mean"] < 1000 * rtt_tolerance_ms(rtt_ms)
