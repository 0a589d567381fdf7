"""Same-host all-reduce through shared memory (``ZmqConfig.same_host``: ``auto``, the default).

When every rank of an epoch runs on one host, sockets only add copies: each byte would be
copied into the kernel and out again, and ZeroMQ allocates a fresh buffer for every message.
Here each rank publishes its input in a shared-memory *slab* (a ``memfd`` that the other ranks map
through ``/proc/<pid>/fd/<fd>``, so nothing is ever left behind in ``/dev/shm``), and

1. every rank copies its input into its slab and announces the slab (phase 0);
2. rank r sums segment r of every rank's slab, in rank order, into the final area of its own
   slab and its result, and announces it (phase 1) — segment r has exactly one owner, so all
   ranks end with bit-identical values;
3. every rank copies the other final segments into its result and says so (phase 2); a slab
   is reused only after every peer has said phase 2 (it no longer reads it).

The announcements are tiny ZeroMQ messages on connection 0 (so they stay in order). Memory
traffic per rank is ~6 N bytes for N bytes of input, against ~10 N for a ring over loopback
TCP (two kernel copies per transferred byte). Slabs and peers' mappings are cached, so steady
state has no page faults. A slab of a failed operation is dropped, never reused: a slow peer
may still be reading it.
"""

from __future__ import annotations

import logging
import mmap
import os
import uuid
from collections import OrderedDict

import torch

from lowband.errors import ProtocolError
from transport import wire
from transport.ops import Host, Mismatch, ReduceBase, acc_dtype, bounds
from transport.wire import MsgType

logger = logging.getLogger(__name__)

_ALIGN = 4096
_PIECE = 1 << 22  # elements reduced per step


def _align(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


class Slab:
    """A memfd-backed shared region owned by this process."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.id = uuid.uuid4().hex[:12]
        self.fd = os.memfd_create(f"lowband-{self.id}", os.MFD_CLOEXEC)
        os.ftruncate(self.fd, size)
        self.mm = mmap.mmap(self.fd, size)
        self.busy = False

    def view(self, offset: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        if numel == 0:
            return torch.empty(0, dtype=dtype)
        return torch.frombuffer(self.mm, dtype=torch.uint8, count=nbytes, offset=offset).view(dtype)

    def close(self) -> None:
        try:
            self.mm.close()
        except BufferError:
            pass  # a view is still alive somewhere; the mapping goes when it does
        os.close(self.fd)


class SlabPool:
    """This process's slabs, reused across operations (reactor thread only)."""

    def __init__(self, capacity_bytes: int) -> None:
        self.capacity = capacity_bytes
        self._slabs: list[Slab] = []

    def take(self, nbytes: int) -> Slab:
        for slab in self._slabs:
            if not slab.busy and slab.size >= nbytes:
                slab.busy = True
                return slab
        while sum(s.size for s in self._slabs) + nbytes > self.capacity:
            idle = next((s for s in self._slabs if not s.busy), None)
            if idle is None:
                break  # all in use: exceed the soft cap rather than fail
            self._slabs.remove(idle)
            idle.close()
        slab = Slab(_align(nbytes))
        slab.busy = True
        self._slabs.append(slab)
        return slab

    def give(self, slab: Slab) -> None:
        slab.busy = False

    def drop(self, slab: Slab) -> None:
        if slab in self._slabs:
            self._slabs.remove(slab)
            slab.close()

    def close(self) -> None:
        for s in self._slabs:
            s.close()
        self._slabs = []


class PeerSlabs:
    """Mappings of other processes' slabs, cached by (pid, slab id); least recently used go."""

    def __init__(self, max_maps: int = 64) -> None:
        self._maps: OrderedDict[tuple[int, str], mmap.mmap] = OrderedDict()
        self._max = max_maps

    def map(self, pid: int, fd: int, slab_id: str, size: int) -> mmap.mmap:
        key = (pid, slab_id)
        mm = self._maps.get(key)
        if mm is not None and len(mm) >= size:
            self._maps.move_to_end(key)
            return mm
        path = f"/proc/{pid}/fd/{fd}"
        try:
            handle = os.open(path, os.O_RDWR)
        except OSError as exc:
            raise Mismatch(
                f"cannot map a peer's shared memory ({path}: {exc.strerror}); "
                "set ZmqConfig.same_host='off' if the peers cannot share memory"
            ) from None
        try:
            # The fd number may have been reused for something else (a restarted peer with a
            # recycled pid): map it only if it is the very slab announced.
            if f"memfd:lowband-{slab_id} " not in os.readlink(path) + " ":
                raise Mismatch(f"{path} is not the announced slab {slab_id}")
            if os.fstat(handle).st_size < size:
                raise Mismatch(f"peer slab {slab_id} is smaller than announced")
            mm = mmap.mmap(handle, size)
        finally:
            os.close(handle)
        self._maps[key] = mm
        self._close_over(self._max)
        return mm

    def forget(self, pid: int) -> None:
        """Unmap every slab of process ``pid`` (it died or left: its memory can go)."""
        for key in [k for k in self._maps if k[0] == pid]:
            _close(self._maps.pop(key))

    def _close_over(self, limit: int) -> None:
        while len(self._maps) > limit:
            _, old = self._maps.popitem(last=False)
            _close(old)


def _close(mm: mmap.mmap) -> None:
    try:
        mm.close()
    except BufferError:
        pass  # a view is still alive somewhere; the mapping goes when it does


def shm_key() -> str:
    """What this process offers for shared memory: ``""`` if it cannot, else a key that is
    equal exactly for processes able to open each other's slabs through ``/proc/<pid>/fd``
    (same user, same PID namespace; containers of one pod share a network namespace but
    usually not their PIDs). The host itself is compared separately (the host key)."""
    if not hasattr(os, "memfd_create"):
        return ""
    try:
        pidns = os.stat("/proc/self/ns/pid").st_ino
        fd = os.memfd_create("lowband-probe", os.MFD_CLOEXEC)
        try:
            os.close(os.open(f"/proc/{os.getpid()}/fd/{fd}", os.O_RDWR))
        finally:
            os.close(fd)
    except OSError:
        return ""
    return f"shm:{os.getuid()}:{pidns}"


def _view(mm: mmap.mmap, offset: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    if numel == 0:
        return torch.empty(0, dtype=dtype)
    size = numel * torch.empty((), dtype=dtype).element_size()
    return torch.frombuffer(mm, dtype=torch.uint8, count=size, offset=offset).view(dtype)


class ShmAllReduce(ReduceBase):
    """The three-phase shared-memory all-reduce described in the module docstring."""

    def start(self, host: "Host") -> None:
        n, numel, dtype = self.n, self.numel, self.dtype
        self.segs = bounds(numel, n)
        es = self.x.element_size()
        self.f_off = _align(numel * es)
        longest = max(hi - lo for lo, hi in self.segs)
        self.slab = host.shm_slabs().take(self.f_off + longest * es)
        self.out = host.pool.empty(numel, dtype)
        mine = self.slab.view(0, numel, dtype)
        mine.copy_(self.x)
        self.inputs: dict[int, torch.Tensor] = {self.rank: mine}
        self.finals: dict[int, torch.Tensor] = {}
        self.reduced = False
        self.gathered: set[int] = set()
        self.released: set[int] = set()
        self.said_done = False
        self._announce(host, 0, slab=[os.getpid(), self.slab.fd, self.slab.id, self.slab.size])
        self._reduce(host)

    def _announce(self, host: "Host", phase: int, **extra: object) -> None:
        for dst in range(self.n):
            if dst != self.rank:
                self.send(
                    host,
                    dst,
                    MsgType.CHUNK,
                    self.meta(ph=phase, **extra, **self.signature),
                    stripe=0,
                )

    def on_message(self, host: "Host", src: int, msg: wire.Message) -> None:
        self.check(msg)
        phase = wire.int_field(msg.meta, "ph", 0, 2)
        if phase == 0:
            if src in self.inputs:
                raise ProtocolError(f"duplicate slab announcement from rank {src}")
            slab = wire.field(msg.meta, "slab", list)
            if len(slab) != 4 or not all(isinstance(v, (int, str)) for v in slab):
                raise ProtocolError("malformed slab announcement")
            pid, fd, sid, size = slab
            es = self.x.element_size()
            if size < self.f_off + max(hi - lo for lo, hi in self.segs) * es:
                raise Mismatch(f"rank {src} announced a slab too small for this all_reduce")
            mm = host.shm_peers().map(int(pid), int(fd), str(sid), int(size))
            host.shm_pids[self.peers[src]] = int(pid)
            self.inputs[src] = _view(mm, 0, self.numel, self.dtype)
            lo, hi = self.segs[src]
            self.finals[src] = _view(mm, self.f_off, hi - lo, self.dtype)
            self._reduce(host)
        elif phase == 1:
            if src not in self.finals or src in self.gathered:
                raise ProtocolError(f"unexpected final segment from rank {src}")
            lo, hi = self.segs[src]
            self.out[lo:hi].copy_(self.finals[src])
            self.gathered.add(src)
            self._gathered(host)
        else:
            self.released.add(src)
            self._finish(host)

    def _reduce(self, host: "Host") -> None:
        if self.reduced or len(self.inputs) < self.n:
            return
        lo, hi = self.segs[self.rank]
        final = self.slab.view(self.f_off, hi - lo, self.dtype)
        # Piece by piece (4M elements, cache-sized work, heartbeats in between), each summed
        # in rank order: deterministic.
        for a in range(0, hi - lo, _PIECE):
            b = min(hi - lo, a + _PIECE)
            parts = [self.inputs[k][lo + a : lo + b] for k in range(self.n)]
            if acc_dtype(self.dtype) == self.dtype:
                torch.add(parts[0], parts[1], out=final[a:b])
                for p in parts[2:]:
                    final[a:b].add_(p)
                self.average(final[a:b])
            else:
                acc = parts[0].to(acc_dtype(self.dtype))
                for p in parts[1:]:
                    acc += p
                final[a:b].copy_(self.average(acc))
            self.out[lo + a : lo + b].copy_(final[a:b])
            host.tick()
        self.reduced = True
        self.gathered.add(self.rank)
        self._announce(host, 1)
        self._gathered(host)

    def _gathered(self, host: "Host") -> None:
        if self.said_done or len(self.gathered) < self.n:
            return
        self.said_done = True  # (stats stay 0: no payload byte crossed a network)
        self._announce(host, 2)
        self._finish(host)

    def _finish(self, host: "Host") -> None:
        if self.said_done and len(self.released) == self.n - 1 and not self.finished:
            host.shm_slabs().give(self.slab)
            self.inputs, self.finals = {}, {}
            self.finish(host, self.out.view(self.shape))

    def fail(self, host: "Host", exc: BaseException) -> None:
        if not self.finished and hasattr(self, "slab"):
            self.inputs, self.finals = {}, {}
            host.shm_slabs().drop(self.slab)  # a slow peer may still read it: never reuse
        super().fail(host, exc)
