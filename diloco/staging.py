"""Staging outer-step payloads between the device and the host buffers the transport reads.

The transport (``lowband.comm.Communicator``) reads and writes host tensors from its own
threads. On CUDA a fragment sync therefore crosses PCIe twice, and neither crossing may stall
the inner steps (Streaming DiLoCo, arXiv 2501.18512, §2.3: the sync overlaps τ inner steps):

SEND  (step t)      main stream:  … inner step t │ Δ │ inner step t+1 │ …
                    side stream:          └ wait ─ EF encode/decode ─ D2H to pinned buf ─ event E
                    sender thread:                                   E.synchronize() → all_reduce
APPLY (step t+τ)    host:   Work.wait()  (the schedule needs Δ̄ here: the one blocking point)
                    side stream:  H2D from pinned buf ─ event F
                    main stream:  wait F │ outer step │ merge │ inner step t+τ+1 …

So the main thread never waits for the device on a SEND: it records the copy and an event and
returns; the thread that hands the buffer to the transport waits on that event (only the copy
and the work queued before it, never the inner steps queued after). On the way back the main
*stream* (not the host) waits on the copy's event before the outer step reads Δ̄.

Buffers: one pinned host buffer per (key, slot), reused across rounds. A key is a fragment; at
most one sync is in flight (τ < H/P) and a fragment's next SEND comes after its APPLY has
waited for the transport, so the transport never reads a buffer that is being overwritten.
Inbound buffers are guarded by the event of their last H2D copy.

CPU twin: the same calls with no copies, streams, events or threads; the tensors already live
where the transport reads them, and ``launch`` runs the sender inline.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Hashable, TypeVar

import torch

T = TypeVar("T")


@dataclass(frozen=True)
class Outbound:
    """Host copies of one SEND's tensors and the event after which they are complete
    (``None``: complete now, the CPU twin)."""

    host: tuple[torch.Tensor, ...]
    event: Any = None  # torch.cuda.Event | None

    def ready(self) -> bool:
        """Whether the copies are complete; never blocks."""
        return self.event is None or bool(self.event.query())

    def wait(self) -> None:
        """Block this thread until the copies are complete (only they, not later work)."""
        if self.event is not None:
            self.event.synchronize()


class StagingBuffers:
    """Reusable host buffers, one per (key, slot), page-locked when ``pin`` (CUDA staging).

    A buffer is replaced only when the tensor it stages changes shape or dtype; the caller
    guarantees the previous use of a buffer is over before asking for it again (module doc)."""

    def __init__(self, pin: bool) -> None:
        self.pin = pin
        self._bufs: dict[tuple[Hashable, int], torch.Tensor] = {}
        self.allocations = 0  # buffers created so far (tests check reuse)

    def get(self, key: Hashable, slot: int, like: torch.Tensor) -> torch.Tensor:
        buf = self._bufs.get((key, slot))
        if buf is None or buf.shape != like.shape or buf.dtype != like.dtype:
            buf = torch.empty(like.shape, dtype=like.dtype, pin_memory=self.pin)
            self._bufs[(key, slot)] = buf
            self.allocations += 1
        return buf


class HostStaging:
    """Device ⇄ host staging for the outer step (see the module doc). One per worker."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.outbound = StagingBuffers(pin=True)
        self.inbound = StagingBuffers(pin=True)
        self._last_in: dict[Hashable, Any] = {}  # key -> event of its last H2D copy
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._sender: ThreadPoolExecutor | None = None

    @property
    def stream(self) -> Any:
        """The side stream (``None`` on the CPU). The SEND's error feedback is queued on it
        before the copies (``diloco.outer.FragmentSync.device_contribution``)."""
        return self._stream

    # ---- device → host ---------------------------------------------------------------------------
    def stage_out(self, key: Hashable, *tensors: torch.Tensor) -> Outbound:
        """Start copying ``tensors`` into this key's pinned buffers on the side stream; return at
        once. CPU: the tensors themselves, no copy."""
        stream = self._stream
        if stream is None:
            return Outbound(tuple(tensors))
        # The side stream starts after everything queued so far (Δ and its encode) ...
        stream.wait_stream(torch.cuda.current_stream(self.device))
        host = []
        with torch.cuda.stream(stream):
            for slot, x in enumerate(tensors):
                buf = self.outbound.get(key, slot, x)
                buf.copy_(x, non_blocking=True)
                x.record_stream(stream)  # ... and x's memory is not reused before the copy ran
                host.append(buf)
            event = torch.cuda.Event()
            event.record(stream)
        return Outbound(tuple(host), event)

    def launch(self, out: Outbound, send: Callable[[], T]) -> Future[T]:
        """Run ``send`` (which hands ``out.host`` to the transport) once the copies are complete.

        CUDA: on this staging's sender thread, which waits on ``out``'s event; the caller goes
        on queueing inner steps. CPU: inline, now. Either way the returned future holds
        ``send``'s result or exception (read it before using the sync's results)."""
        if out.event is None:
            done: Future[T] = Future()
            done.set_result(send())
            return done
        if self._sender is None:  # one thread: sends leave in the order they were staged
            self._sender = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lowband-stage")

        def run() -> T:
            out.wait()
            return send()

        return self._sender.submit(run)

    # ---- host → device ---------------------------------------------------------------------------
    def stage_in(self, host: torch.Tensor, key: Hashable) -> torch.Tensor:
        """``host`` on the device, ordered before whatever the current stream queues next.

        The host thread does not wait for the device: the copy runs on the side stream from a
        pinned buffer, and the current stream waits on its event. CPU: ``host`` itself."""
        stream = self._stream
        if stream is None:
            return host
        current = torch.cuda.current_stream(self.device)
        last = self._last_in.get(key)
        if last is not None:
            last.synchronize()  # the previous H2D from this key's buffer, rounds ago: complete
        buf = self.inbound.get(key, 0, host)
        buf.copy_(host)  # host memcpy (pageable → pinned); no device involved
        with torch.cuda.stream(stream):
            dev = torch.empty(host.shape, dtype=host.dtype, device=self.device)
            dev.copy_(buf, non_blocking=True)
            event = torch.cuda.Event()
            event.record(stream)
        current.wait_event(event)
        dev.record_stream(current)  # allocated on the side stream, used on the main one
        self._last_in[key] = event
        return dev

    # ---- blocking forms (DDP: its inner step needs the averaged gradient at once) ---------------
    def to_host(self, x: torch.Tensor, key: Hashable) -> torch.Tensor:
        """A host copy of ``x``, complete when this returns. CPU: ``x`` itself."""
        out = self.stage_out(key, x)
        out.wait()
        return out.host[0]

    def to_device(self, host: torch.Tensor, key: Hashable = "to_device") -> torch.Tensor:
        """``host`` on the device, ordered before the current stream's next work."""
        return self.stage_in(host, key)

    def close(self) -> None:
        """Stop the sender thread (after the sends already submitted)."""
        if self._sender is not None:
            self._sender.shutdown(wait=True)
            self._sender = None
