"""What one direction of an emulated WAN path does to each IP packet (pure; no sockets, no clock).

The TUN forwarder (:mod:`transport.links.tun.forward`) asks a :class:`Path` when each packet it
reads from one site should be written into the other site, or whether it is dropped. The model,
in the order a packet meets it:

1. **link down** – everything is dropped (also packets already in flight, at delivery);
2. **bottleneck** (``rate_mbit``) – packets leave back to back at the rate, like a router's
   output port; a packet that would wait more than ``queue_ms`` in that queue is tail-dropped;
3. **loss on the wire** – independent (``loss``) and bursty (:class:`GilbertElliott`);
4. **propagation** – ``delay_ms`` plus a jitter drawn uniformly from ±``jitter_ms``. Without
   reordering a packet never overtakes the one before it (its due time is at least the previous
   one's), so jitter alone reorders nothing, as on a real serial link;
5. **reordering** – with probability ``reorder`` a packet is held ``reorder_ms`` longer and
   later packets may overtake it.

``rate_mbit`` counts IP bytes (headers included, no link-layer framing): a TCP flow's goodput
tops out near ``rate * 1448 / 1500`` at MTU 1500.

A site's **access link** (:class:`AccessConfig`, optional) is a further bottleneck that every
path leaving the site (its uplink) or entering it (its downlink) shares, as a site's one line to
the internet is shared by all its flows: a packet meets its source's uplink before the path and
its destination's downlink after the path's delay. Without one, every direction of every pair
is a separate bottleneck (dedicated circuits), and a site sending to n-1 peers at once has n-1
times the rate of a site sending to one.
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass, field
from typing import Any

from lowband.errors import ConfigError


@dataclass(frozen=True, kw_only=True)
class GilbertElliott:
    """Two-state bursty loss (Gilbert-Elliott): a good and a bad state, a Markov step per packet.

    Stationary loss ``= p/(p+r) * loss_bad + r/(p+r) * loss_good``; mean burst (bad-state run)
    length ``1/r`` packets."""

    p: float
    """P(good → bad) per packet."""
    r: float
    """P(bad → good) per packet."""
    loss_bad: float = 1.0
    """Loss probability in the bad state (1 - h)."""
    loss_good: float = 0.0
    """Loss probability in the good state (1 - k)."""

    def __post_init__(self) -> None:
        for name in ("p", "r", "loss_bad", "loss_good"):
            v = getattr(self, name)
            if not 0.0 <= v <= 1.0:
                raise ConfigError(f"burst.{name}", f"a probability in [0, 1], got {v}")
        if self.r == 0.0:
            raise ConfigError("burst.r", "must be > 0 (else the bad state is never left)")

    @property
    def mean_loss(self) -> float:
        pi_bad = self.p / (self.p + self.r)
        return pi_bad * self.loss_bad + (1 - pi_bad) * self.loss_good


@dataclass
class Queue:
    """A bottleneck's output queue: packets leave back to back at a rate, tail-dropped when one
    would wait more than a bound. Holds only when the link finishes sending what it holds; the
    rate and bound are given per packet (a path's may change during a run)."""

    free_at: float = 0.0
    drops: int = 0

    def depart(self, now: float, size: int, rate_mbit: float, queue_ms: float) -> float | None:
        """When a packet of ``size`` IP bytes arriving at ``now`` has left (``now`` itself if
        ``rate_mbit`` is 0), or None if the queue drops it."""
        if rate_mbit <= 0:
            return now
        start = max(now, self.free_at)
        if start - now > queue_ms / 1e3:
            self.drops += 1
            return None
        self.free_at = start + size * 8 / (rate_mbit * 1e6)
        return self.free_at


@dataclass(frozen=True, kw_only=True)
class AccessConfig:
    """A site's access link, each direction: the rate all its paths share (see the module
    docstring)."""

    rate_mbit: float
    """Rate of the uplink and of the downlink, IP Mbit/s."""
    queue_ms: float = 50.0
    """Each direction's queue bound (tail drop)."""

    def __post_init__(self) -> None:
        if not 0.0 < self.rate_mbit <= 1e6:
            raise ConfigError("access.rate_mbit", f"must be in (0, 1e6], got {self.rate_mbit}")
        if not 0.0 <= self.queue_ms <= 1e6:
            raise ConfigError("access.queue_ms", f"must be in [0, 1e6], got {self.queue_ms}")


@dataclass(frozen=True, kw_only=True)
class PathConfig:
    """One direction of one path between two sites."""

    delay_ms: float = 0.0
    """One-way propagation delay (RTT = the two directions' delays added)."""
    jitter_ms: float = 0.0
    """Each packet's delay varies uniformly within ±jitter (never below 0, never reordering)."""
    rate_mbit: float = 0.0
    """Bottleneck rate in IP Mbit/s; 0 means unlimited (the forwarder's own ceiling)."""
    queue_ms: float = 50.0
    """Bottleneck queue: a packet that would wait longer than this is dropped (tail drop)."""
    loss: float = 0.0
    """Independent loss probability per packet."""
    burst: GilbertElliott | None = None
    """Bursty loss on top of ``loss``; None: none."""
    reorder: float = 0.0
    """Probability that a packet is held back ``reorder_ms`` so that later packets overtake it."""
    reorder_ms: float = 2.0
    """Extra delay of a reordered packet (longer than a packet time, or nothing overtakes it)."""
    down: bool = False
    """Link down: every packet is dropped, including those already in flight."""

    def __post_init__(self) -> None:
        for name in ("delay_ms", "jitter_ms", "rate_mbit", "queue_ms", "reorder_ms"):
            v = getattr(self, name)
            if not 0.0 <= v <= 1e6:
                raise ConfigError(name, f"must be in [0, 1e6], got {v}")
        for name in ("loss", "reorder"):
            v = getattr(self, name)
            if not 0.0 <= v <= 1.0:
                raise ConfigError(name, f"a probability in [0, 1], got {v}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "PathConfig":
        d = dict(d)
        if d.get("burst") is not None:
            d["burst"] = GilbertElliott(**d["burst"])
        return cls(**d)


@dataclass
class PathStats:
    received: int = 0
    delivered: int = 0
    delivered_bytes: int = 0
    lost: int = 0
    """Dropped by random or bursty loss."""
    queue_drops: int = 0
    down_drops: int = 0
    reordered: int = 0


@dataclass
class Path:
    """The state of one direction: bottleneck clock, loss state, last due time and counters."""

    config: PathConfig
    rng: random.Random = field(default_factory=random.Random)
    stats: PathStats = field(default_factory=PathStats)
    _queue: Queue = field(default_factory=Queue)
    _last_due: float = 0.0  # due time of the last in-order packet (jitter must not reorder)
    _bad: bool = False  # Gilbert-Elliott state

    def admit(self, now: float, size: int) -> float | None:
        """A packet of ``size`` IP bytes arrives at ``now`` (seconds): its due time, or None if
        it is dropped."""
        cfg, st = self.config, self.stats
        st.received += 1
        if cfg.down:
            st.down_drops += 1
            return None
        sent = self._queue.depart(now, size, cfg.rate_mbit, cfg.queue_ms)
        if sent is None:
            st.queue_drops += 1
            return None
        if self._lost():
            st.lost += 1
            return None
        due = sent + cfg.delay_ms / 1e3
        if cfg.jitter_ms > 0:
            due = max(sent, due + self.rng.uniform(-cfg.jitter_ms, cfg.jitter_ms) / 1e3)
        if cfg.reorder > 0 and self.rng.random() < cfg.reorder:
            st.reordered += 1
            return due + cfg.reorder_ms / 1e3  # _last_due untouched: the next ones overtake it
        due = max(due, self._last_due)
        self._last_due = due
        return due

    def deliverable(self) -> bool:
        """At delivery: a packet still in flight when the link went down is lost with it."""
        if self.config.down:
            self.stats.down_drops += 1
            return False
        return True

    def _lost(self) -> bool:
        cfg = self.config
        if cfg.loss > 0 and self.rng.random() < cfg.loss:
            return True
        ge = cfg.burst
        if ge is None:
            return False
        self._bad = (self.rng.random() >= ge.r) if self._bad else (self.rng.random() < ge.p)
        return self.rng.random() < (ge.loss_bad if self._bad else ge.loss_good)
