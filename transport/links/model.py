"""A *modelled* slow link in front of the loopback communicator (benchmarks only).

The loopback group moves tensors instantly; this wrapper makes each worker's collectives finish
as if they had crossed a link of ``bandwidth`` bytes/s and ``latency`` seconds one way, so
compute/communication overlap can be measured on one machine without sockets. It is a model,
not an emulation of TCP:

* an operation starts when every rank has launched it (that is when the loopback completes it)
  or when this worker's link is free, whichever is later — one link per worker, used serially;
* it occupies the link for ``max(bytes sent, bytes received) / bandwidth`` plus one latency per
  communication round: ``2(n-1)`` for a ring all-reduce, 2 otherwise (request/answer);
* ``quorum`` costs one round trip (the coordinator).

The byte counts are the communicator's own (``Work.stats``), the same the bench reports.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import torch

from lowband.comm import Membership, OpStats
from transport.loopback import LoopbackComm
from transport.work import FutureWork


class _Link:
    def __init__(self, bandwidth: float, latency: float) -> None:
        self.bandwidth, self.latency = bandwidth, latency
        self.free_at = 0.0
        self.lock = threading.Lock()

    def occupy(self, stats: OpStats, rounds: int) -> float:
        """Reserve the link for one operation finishing now; returns when it is through."""
        duration = (
            rounds * self.latency + max(stats.bytes_sent, stats.bytes_received) / self.bandwidth
        )
        with self.lock:
            start = max(time.perf_counter(), self.free_at)
            self.free_at = start + duration
            return self.free_at


class _ShapedWork:
    """Completes ``ready_at`` seconds (perf_counter) after the inner operation does."""

    def __init__(self, inner: FutureWork, link: _Link, world: int, ring: bool) -> None:
        self._inner = inner
        self._ready_at: float | None = None
        self._event = threading.Event()

        def done(w: FutureWork) -> None:
            rounds = 2 * (world - 1) if ring else 2
            self._ready_at = link.occupy(w.stats, rounds) if w.exception() is None else 0.0
            self._event.set()

        inner.add_done_callback(done)

    def wait(self, timeout: float | None = None) -> Any:
        result = self._inner.wait(timeout)
        self._event.wait()
        delay = (self._ready_at or 0.0) - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        return result

    def done(self) -> bool:
        return (
            self._inner.done()
            and self._event.is_set()
            and time.perf_counter() >= (self._ready_at or 0.0)
        )

    @property
    def stats(self) -> OpStats:
        return self._inner.stats


class ShapedComm:
    """A :class:`LoopbackComm` whose collectives take modelled link time (see module doc)."""

    def __init__(
        self,
        inner: LoopbackComm,
        *,
        bandwidth_bytes_s: float,
        latency_s: float,
        ring_threshold_bytes: int = 256 * 1024,
    ) -> None:
        self._inner = inner
        self._link = _Link(bandwidth_bytes_s, latency_s)
        self._ring_threshold = ring_threshold_bytes

    def __getattr__(self, name: str) -> Any:  # rank, world_size, stats, send, recv, close...
        return getattr(self._inner, name)

    @property
    def membership(self) -> Membership:
        return self._inner.membership

    @property
    def rank(self) -> int:
        return self._inner.rank

    @property
    def world_size(self) -> int:
        return self._inner.world_size

    def _shape(self, work: FutureWork, ring: bool) -> _ShapedWork:
        return _ShapedWork(work, self._link, self._inner.world_size, ring)

    def quorum(self, **kw: Any) -> Membership:
        m = self._inner.quorum(**kw)
        time.sleep(2 * self._link.latency)
        return m

    def all_reduce_async(self, tensor: torch.Tensor, op: str = "sum", **kw: Any) -> _ShapedWork:
        work = self._inner.all_reduce_async(tensor, op, **kw)  # type: ignore[arg-type]
        return self._shape(work, ring=self._is_ring(tensor, kw))

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum", **kw: Any) -> torch.Tensor:
        return self.all_reduce_async(tensor, op, **kw).wait()

    def all_gather_async(self, tensor: torch.Tensor, **kw: Any) -> _ShapedWork:
        return self._shape(self._inner.all_gather_async(tensor, **kw), ring=False)

    def all_gather(self, tensor: torch.Tensor, **kw: Any) -> list[torch.Tensor]:
        return self.all_gather_async(tensor, **kw).wait()

    def _is_ring(self, tensor: torch.Tensor, kw: dict) -> bool:
        """The loopback's own choice: ring at or above the star threshold (encoded payload)."""
        algorithm = kw.get("algorithm", "auto")
        if algorithm != "auto":
            return algorithm == "ring"
        codec = kw.get("codec")
        nbytes = (
            codec.encode(tensor).nbytes
            if codec is not None
            else tensor.numel() * tensor.element_size()
        )
        return nbytes >= self._ring_threshold
