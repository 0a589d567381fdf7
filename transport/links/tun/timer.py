"""Waking the TUN forwarder at a packet's due time with sub-millisecond precision.

``epoll.poll(timeout)`` counts in whole milliseconds (Python rounds the timeout up), so a
forwarder that only sleeps in ``poll`` delivers a packet up to a millisecond late and cannot make
a path of 0.2–1 ms round trip (a switch, a good Wi-Fi hop). Two remedies, combined:

1. **A high-resolution timer in the poll set.** A Linux ``timerfd`` armed at the absolute due
   time (``CLOCK_MONOTONIC``, the clock of :func:`time.monotonic`) becomes readable then, to the
   kernel's hrtimer resolution; the process's timer slack is set to 1 ns so the kernel does not
   defer the wake-up by its default 50 µs. Python 3.11 has no ``os.timerfd_create``: it is
   called through ``ctypes``. Where it is missing (another OS), :class:`Deadline` falls back to
   the millisecond poll timeout, rounded *down* so the wake-up is never late by the rounding.
2. **A bounded spin.** The wake-up itself is late by the scheduler's latency (tens of µs on an
   idle machine, more on a loaded one), so the forwarder wakes ``spin_s`` early and polls
   without blocking until the due time. That spin is the whole CPU cost: at most ``spin_s`` per
   distinct due time, so a busy path (a packet due every few µs) keeps the forwarder's core
   busy, an idle one costs nothing. ``spin_s = 0`` turns it off.

:func:`poll_timeout` is the pure decision (tested); :class:`Deadline` owns the timer.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import math
import os
import struct

logger = logging.getLogger(__name__)

_CLOCK_MONOTONIC = 1
_TFD_NONBLOCK = 0o4000
_TFD_CLOEXEC = 0o2000000
_TFD_TIMER_ABSTIME = 1
_PR_SET_TIMERSLACK = 29


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


class _Itimerspec(ctypes.Structure):
    _fields_ = [("it_interval", _Timespec), ("it_value", _Timespec)]


def poll_timeout(due: float | None, now: float, spin_s: float, *, timer: bool) -> float | None:
    """The ``epoll.poll`` timeout (seconds, None: block) for the next wake-up.

    ``due`` is the earliest packet's due time (None: nothing in flight). Within ``spin_s`` of it
    the answer is 0 (spin). Otherwise, with a timer armed at ``due - spin_s`` the poll blocks
    (the timer wakes it); without one it sleeps whole milliseconds, rounded down, and spins
    the rest (at most ``spin_s`` + 1 ms); without a timer and with ``spin_s = 0`` it returns the
    exact wait, which ``poll`` rounds up to a millisecond (late, but no spinning at all)."""
    if due is None:
        return None
    wake = due - spin_s
    if wake <= now:
        return 0.0
    if timer:
        return None
    if spin_s <= 0:
        return wake - now
    return math.floor((wake - now) * 1e3) / 1e3


class Deadline:
    """A ``timerfd`` to put in the poll set, armed at the next wake-up time (or none)."""

    def __init__(self) -> None:
        self.fd: int | None = None
        self._armed: float | None = None
        self._libc: ctypes.CDLL | None = None
        name = ctypes.util.find_library("c")
        try:
            libc = ctypes.CDLL(name, use_errno=True)
            fd = libc.timerfd_create(_CLOCK_MONOTONIC, _TFD_NONBLOCK | _TFD_CLOEXEC)
        except (OSError, AttributeError):  # no libc by that name, or no timerfd in it
            return
        if fd < 0:
            logger.info("timerfd_create failed (errno %d): millisecond polls", ctypes.get_errno())
            return
        libc.prctl(_PR_SET_TIMERSLACK, 1, 0, 0, 0)  # best effort: wake when asked, not +50 µs
        self._libc, self.fd = libc, fd

    def arm(self, at: float | None) -> None:
        """Fire at monotonic time ``at`` (None: disarm); a no-op when already armed there."""
        if self._libc is None or at == self._armed:
            return
        spec = _Itimerspec()
        if at is not None:
            at = max(at, 1e-9)  # an all-zero it_value would disarm instead of firing
            sec = int(at)
            spec.it_value = _Timespec(sec, int((at - sec) * 1e9))
        if self._libc.timerfd_settime(self.fd, _TFD_TIMER_ABSTIME, ctypes.byref(spec), None) < 0:
            raise OSError(ctypes.get_errno(), "timerfd_settime failed")
        self._armed = at

    def fired(self) -> None:
        """Consume the expiry (the fd polled readable); the timer is disarmed until re-armed."""
        assert self.fd is not None
        try:
            struct.unpack("Q", os.read(self.fd, 8))
        except BlockingIOError:  # re-armed after it fired and before we read it
            pass
        self._armed = None

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
