"""In-process loopback communicator: ranks are threads, a shared rendezvous table is the network.

It implements the full :class:`lowband.comm.Communicator` contract, including membership
epochs, so algorithm code (DiLoCo, tensor parallelism) can be tested with many ranks, with
failures (:meth:`LoopbackGroup.kill`) and newcomers (:meth:`LoopbackGroup.join`), without
sockets.

How it matches collectives: every call registers its contribution under ``(epoch, tag)`` and
returns a handle at once (so ``*_async`` is genuinely asynchronous). The rank that completes the
set computes the result outside the group lock and completes everyone's handle. Sums run in rank
order, so every rank gets bit-identical results, as the contract requires.

Byte counters are *modelled*: they report what the chosen algorithm (ring or star) would put on
a real wire for the encoded payload, which keeps metrics comparable with the ZeroMQ transport.
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import torch

from lowband.comm import (
    ALGORITHMS,
    Algorithm,
    Codec,
    Encoded,
    Membership,
    OpStats,
    ReduceOp,
    ring_bytes,
)
from lowband.errors import CommClosed, ConfigError, PeerLost, ProtocolError, TransportTimeout
from transport.blocking import BlockingCollectives
from transport.ops import acc_dtype, check_out, decode_into
from transport.work import FutureWork

logger = logging.getLogger(__name__)

STAR_THRESHOLD_BYTES = 256 * 1024
"""``algorithm="auto"`` uses star below this payload size (latency-bound), ring above."""


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


@dataclass
class _Rendezvous:
    kind: str
    participants: tuple[str, ...]
    contributions: dict[int, Any] = field(default_factory=dict)
    works: dict[int, FutureWork] = field(default_factory=dict)
    failed: BaseException | None = None


class LoopbackGroup:
    """A group of in-process ranks. Create it, then hand ``comms()[r]`` to the thread of rank r."""

    def __init__(
        self,
        world_size: int,
        *,
        timeout: float = 60.0,
        star_threshold_bytes: int = STAR_THRESHOLD_BYTES,
    ) -> None:
        if world_size < 1:
            raise ConfigError("world_size", f"must be >= 1, got {world_size}")
        if timeout <= 0:
            raise ConfigError("timeout", f"must be > 0 seconds, got {timeout}")
        self.timeout = timeout
        self.star_threshold_bytes = star_threshold_bytes
        self._cv = threading.Condition()
        self._ids = itertools.count()
        self._alive: set[str] = set()
        self._closed: set[str] = set()
        self._epoch = 0
        self._view: tuple[str, ...] = ()
        self._ops: dict[tuple[int, str], _Rendezvous] = {}
        self._mail: dict[tuple[str, str, str], deque] = {}
        self._q_gen = 0
        self._q_arrived: dict[str, int] = {}  # peer -> arrival order
        self._joined: dict[str, int] = {}  # newcomer -> registration order
        self._q_min_world: dict[str, int] = {}  # peer -> min_world it asked for
        self._q_results: dict[int, dict[str, Membership]] = {}
        self._comms: list[LoopbackComm] = []
        ids = tuple(self._new_id() for _ in range(world_size))
        self._view = ids
        self._alive.update(ids)
        for rank, pid in enumerate(ids):
            self._comms.append(LoopbackComm(self, pid, Membership(0, rank, world_size, ids)))

    def _new_id(self) -> str:
        return f"loop-{next(self._ids)}"

    def comms(self) -> list["LoopbackComm"]:
        """The founding members, indexed by rank of epoch 0."""
        return list(self._comms)

    def join(self) -> "LoopbackComm":
        """Register a newcomer. The next quorum waits for it and admits it."""
        with self._cv:
            pid = self._new_id()
            self._alive.add(pid)
            self._joined[pid] = len(self._joined)
        return LoopbackComm(self, pid, Membership(-1, 0, 1, (pid,)))

    def kill(self, who: "int | str | LoopbackComm") -> None:
        """Simulate a crash (kill -9) of a peer: everything involving it raises PeerLost."""
        pid = self._resolve(who)
        self._remove(pid, PeerLost(f"peer {pid} died", peers=(pid,)), closed=False)

    # ---- internals shared with LoopbackComm -------------------------------------------------
    def _resolve(self, who: "int | str | LoopbackComm") -> str:
        if isinstance(who, LoopbackComm):
            return who.peer_id
        if isinstance(who, int):
            return self._view[who]
        return who

    def _remove(self, pid: str, error: BaseException, *, closed: bool) -> None:
        doomed: list[tuple[FutureWork, BaseException]] = []
        with self._cv:
            if pid not in self._alive:
                return
            self._alive.discard(pid)
            if closed:
                self._closed.add(pid)
            for rv in self._ops.values():
                if pid in rv.participants and rv.failed is None:
                    rv.failed = error
                    doomed.extend((w, error) for w in rv.works.values())
            self._q_arrived.pop(pid, None)
            self._q_min_world.pop(pid, None)
            self._try_complete_quorum()
            self._cv.notify_all()
        for work, err in doomed:
            work.set_error(err)

    def _try_complete_quorum(self) -> None:
        """Called with the lock held. Completes the current quorum generation once every live
        member of the current view and every live registered newcomer has arrived. Awaiting
        registered newcomers (rather than admitting whoever happens to be there) makes admission
        deterministic: a newcomer is always in the first quorum after it registered."""
        if not self._q_arrived:
            return
        required = [p for p in self._view if p in self._alive]
        joiners = sorted(
            (p for p in self._alive if p not in self._view), key=self._joined.__getitem__
        )
        if any(p not in self._q_arrived for p in required + joiners):
            return
        if len(required) + len(joiners) < max(self._q_min_world.values(), default=1):
            return
        new_view = tuple(required) + tuple(joiners)
        if new_view != self._view:
            self._epoch += 1
        old_view = set(self._view)
        results: dict[str, Membership] = {}
        for rank, pid in enumerate(new_view):
            first = pid not in old_view
            joined = () if first else tuple(p for p in new_view if p not in old_view)
            left = () if first else tuple(p for p in self._view if p not in new_view)
            results[pid] = Membership(self._epoch, rank, len(new_view), new_view, joined, left)
        self._view = new_view
        self._q_results[self._q_gen] = results
        self._q_gen += 1
        self._q_arrived = {}
        self._q_min_world = {}
        self._cv.notify_all()

    def _quorum(self, pid: str, min_world: int, timeout: float) -> Membership:
        with self._cv:
            self._check_alive(pid)
            gen = self._q_gen
            self._q_arrived.setdefault(pid, len(self._q_arrived))
            self._q_min_world[pid] = min_world
            self._try_complete_quorum()
            ok = self._cv.wait_for(
                lambda: gen in self._q_results or pid not in self._alive, timeout
            )
            if not ok:
                self._q_arrived.pop(pid, None)
                self._q_min_world.pop(pid, None)
                raise TransportTimeout(
                    f"quorum: within {timeout:.1f}s not every live member arrived or the group "
                    f"stayed below min_world={min_world}"
                )
            self._check_alive(pid)
            return self._q_results[gen][pid]

    def _check_alive(self, pid: str) -> None:
        if pid not in self._alive:
            raise (
                CommClosed(f"peer {pid} has left the group")
                if pid in self._closed
                else PeerLost(f"peer {pid} is not a member", peers=(pid,))
            )

    def _contribute(
        self,
        comm: "LoopbackComm",
        kind: str,
        tag: str,
        value: Any,
        description: str,
        timeout: float,
    ) -> FutureWork:
        m = comm.membership
        work: FutureWork = FutureWork(description, timeout)
        key = (m.epoch, tag)
        ready: _Rendezvous | None = None
        with self._cv:
            self._check_alive(comm.peer_id)
            rv = self._ops.get(key)
            if rv is None:
                rv = _Rendezvous(kind, m.peers)
                self._ops[key] = rv
                dead = tuple(p for p in m.peers if p not in self._alive)
                if dead:
                    rv.failed = PeerLost(
                        f"{kind} '{tag}': peer(s) {', '.join(dead)} lost", peers=dead
                    )
            if rv.failed is None and rv.kind != kind:
                rv.failed = ProtocolError(
                    f"ranks disagree on the operation tagged '{tag}': {rv.kind} vs {kind}"
                )
                for w in rv.works.values():
                    w.set_error(rv.failed)
            if rv.failed is not None:
                work.set_error(rv.failed)
                return work
            rv.contributions[m.rank] = value
            rv.works[m.rank] = work
            if len(rv.contributions) == len(rv.participants):
                ready = self._ops.pop(key)
        if ready is not None:
            self._complete(ready)
        return work

    def _complete(self, rv: _Rendezvous) -> None:
        try:
            outcomes = _COMPLETERS[rv.kind](self, rv)
        except Exception as exc:  # a bad contribution fails the whole op on every rank
            for w in rv.works.values():
                w.set_error(exc if isinstance(exc, ProtocolError) else ProtocolError(str(exc)))
            return
        for rank, (result, stats) in outcomes.items():
            rv.works[rank].set_result(result, stats)

    # ---- point to point ------------------------------------------------------------------------
    def _send(self, src: str, dst: str, tag: str, message: tuple[list[torch.Tensor], dict]) -> None:
        with self._cv:
            self._check_alive(src)
            if dst not in self._alive:
                raise PeerLost(f"send '{tag}': peer {dst} lost", peers=(dst,))
            self._mail.setdefault((src, dst, tag), deque()).append(message)
            self._cv.notify_all()

    def _recv(
        self, src: str, dst: str, tag: str, timeout: float
    ) -> tuple[list[torch.Tensor], dict]:
        key = (src, dst, tag)
        with self._cv:
            ok = self._cv.wait_for(
                lambda: (
                    bool(self._mail.get(key)) or src not in self._alive or dst not in self._alive
                ),
                timeout,
            )
            self._check_alive(dst)
            box = self._mail.get(key)
            if box:
                return box.popleft()
            if not ok:
                raise TransportTimeout(f"recv '{tag}' from {src}: nothing within {timeout:.1f}s")
            raise PeerLost(f"recv '{tag}': peer {src} lost", peers=(src,))


# ---- what each collective computes once all contributions are in ---------------------------
Outcomes = dict[int, tuple[Any, OpStats]]


def _complete_all_reduce(group: LoopbackGroup, rv: _Rendezvous) -> Outcomes:
    n = len(rv.participants)
    contribs = [rv.contributions[r] for r in range(n)]
    shape, dtype, op, codec, algorithm = contribs[0][1:6]
    outs: list[torch.Tensor | None] = [c[6] for c in contribs]
    for r, c in enumerate(contribs):
        if c[1] != shape or c[2] != dtype or c[3] != op:
            raise ProtocolError(
                f"all_reduce: rank {r} sent shape {tuple(c[1])} {c[2]} op={c[3]}, "
                f"rank 0 sent shape {tuple(shape)} {dtype} op={op}"
            )
    payload = contribs[0][0].nbytes if codec is not None else _nbytes(contribs[0][0])
    acc = _sum(contribs, codec, dtype, outs)
    if op == "avg":
        if acc.dtype.is_floating_point:
            acc.div_(n)
        else:
            acc = torch.div(acc, n, rounding_mode="floor")
    if codec is not None:  # the owner of the result re-encodes it; everyone decodes that encoding
        encoded = codec.encode(acc)
        del acc  # before a decode allocates its twin (unless acc is the last rank's out)
        results = [_decoded(codec, encoded, dtype, shape, out) for out in outs]
    else:
        results = _delivered(acc, dtype, shape, outs)
    algo = algorithm
    if algo == "auto":
        algo = "star" if payload < group.star_threshold_bytes else "ring"
    outcomes: Outcomes = {}
    for r in range(n):
        if algo in ("ring", "scatter"):  # the same bytes: 2(n-1)/n of the payload each way
            b = ring_bytes(payload, n)
            stats = OpStats(b, b)
        elif r == 0:
            stats = OpStats((n - 1) * payload, (n - 1) * payload)
        else:
            stats = OpStats(payload, payload)
        outcomes[r] = (results[r], stats)
    return outcomes


def _sum(
    contribs: list[tuple], codec: Codec | None, dtype: torch.dtype, outs: list[torch.Tensor | None]
) -> torch.Tensor:
    """Σ of the contributions in rank order, in float32 (the accumulation dtype), decoded one
    at a time (not all n at once: a worker's peak memory is measured through this group). The
    accumulator is a caller's ``out=`` where one fits: the last rank's with a codec (every
    input was encoded at submission, so no ``out`` is still read), rank 0's without (its
    contribution is the sum's first term, copied in unless ``out`` is that input itself)."""
    flat_dtype = acc_dtype(dtype)
    if codec is not None:
        acc = outs[-1] if outs[-1] is not None and dtype == torch.float32 else None
        if acc is None:
            acc = codec.decode(contribs[0][0])  # a fresh tensor
        else:
            decode_into(codec, contribs[0][0], acc)
        add = getattr(codec, "decode_add_", None)  # in place, chunk by chunk (int8)
        for c in contribs[1:]:
            if add is not None:
                add(c[0], acc)
            else:
                acc += codec.decode(c[0])
        return acc
    first = contribs[0][0]
    if outs[0] is not None and dtype == flat_dtype:
        acc = outs[0]
        if acc.data_ptr() != first.data_ptr():
            acc.copy_(first)
    else:
        acc = first.to(flat_dtype).clone()
    for c in contribs[1:]:
        acc += c[0].to(flat_dtype)
    return acc


def _decoded(
    codec: Codec, encoded: Encoded, dtype: torch.dtype, shape: tuple[int, ...], out: Any
) -> torch.Tensor:
    """One rank's result from the owner's encoding: decoded into its ``out`` where it gave one."""
    if out is None:
        return codec.decode(encoded).to(dtype).reshape(shape)
    decode_into(codec, encoded, out)
    return out


def _delivered(
    acc: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...], outs: list[torch.Tensor | None]
) -> list[torch.Tensor]:
    """Every rank's copy of the sum ``acc`` (which may be rank 0's ``out`` already): written
    into its ``out`` where it gave one, else a tensor of its own (the last such rank takes
    ``acc`` itself when it is nobody's ``out``)."""
    results: list[torch.Tensor] = []
    free = [r for r, out in enumerate(outs) if out is None]
    shared = any(out is acc for out in outs)
    for r, out in enumerate(outs):
        if out is None:
            t = acc.to(dtype).reshape(shape)
            last = not shared and r == free[-1]
            results.append(t if last or t.data_ptr() != acc.data_ptr() else t.clone())
        else:
            if out is not acc:
                out.view(-1).copy_(acc.reshape(-1))
            results.append(out)
    return results


def _complete_broadcast(group: LoopbackGroup, rv: _Rendezvous) -> Outcomes:
    n = len(rv.participants)
    roots = {rv.contributions[r][1] for r in range(n)}
    if len(roots) != 1:
        raise ProtocolError(f"broadcast: ranks disagree on the root: {sorted(roots)}")
    root = roots.pop()
    if not 0 <= root < n:
        raise ProtocolError(f"broadcast: root {root} is not a rank of a world of {n}")
    tensors, meta = rv.contributions[root][0]
    if tensors is None:
        raise ProtocolError("broadcast: the root passed no tensor")
    payload = sum(_nbytes(t) for t in tensors)
    outcomes: Outcomes = {}
    for r in range(n):
        copy = [t.clone() for t in tensors]
        stats = OpStats((n - 1) * payload, 0) if r == root else OpStats(0, payload)
        outcomes[r] = ((copy, dict(meta)), stats)
    return outcomes


def _complete_all_gather(group: LoopbackGroup, rv: _Rendezvous) -> Outcomes:
    n = len(rv.participants)
    tensors = [rv.contributions[r] for r in range(n)]
    sizes = [_nbytes(t) for t in tensors]
    return {
        r: ([t.clone() for t in tensors], OpStats((n - 1) * sizes[r], sum(sizes) - sizes[r]))
        for r in range(n)
    }


def _complete_barrier(group: LoopbackGroup, rv: _Rendezvous) -> Outcomes:
    return {r: (None, OpStats()) for r in range(len(rv.participants))}


_COMPLETERS = {
    "all_reduce": _complete_all_reduce,
    "broadcast": _complete_broadcast,
    "all_gather": _complete_all_gather,
    "barrier": _complete_barrier,
}


class LoopbackComm(BlockingCollectives):
    """One rank's handle on a :class:`LoopbackGroup`; satisfies
    :class:`lowband.comm.Communicator`."""

    def __init__(self, group: LoopbackGroup, peer_id: str, membership: Membership) -> None:
        self._group = group
        self.peer_id = peer_id
        self._membership = membership
        self._seq = 0
        self._lock = threading.Lock()
        self._sent = 0
        self._received = 0
        self.timeout = group.timeout

    # ---- membership ----------------------------------------------------------------------------
    @property
    def rank(self) -> int:
        return self._membership.rank

    @property
    def world_size(self) -> int:
        return self._membership.world_size

    @property
    def membership(self) -> Membership:
        return self._membership

    def quorum(self, *, min_world: int = 1, timeout: float | None = None) -> Membership:
        if min_world < 1:
            raise ConfigError("min_world", f"must be >= 1, got {min_world}")
        m = self._group._quorum(self.peer_id, min_world, self._timeout(timeout))
        with self._lock:
            if m.epoch != self._membership.epoch:
                self._seq = 0
            self._membership = m
        return m

    # ---- helpers -------------------------------------------------------------------------------
    def _timeout(self, timeout: float | None) -> float:
        return self.timeout if timeout is None else timeout

    def _tag(self, tag: str | None) -> str:
        if tag is not None:
            return tag
        with self._lock:
            self._seq += 1
            return f"auto:{self._seq}"

    def _check_member(self) -> None:
        if self._membership.epoch < 0:
            raise PeerLost(f"{self.peer_id} has not joined yet: call quorum() first")

    def _counted(self, work: FutureWork) -> FutureWork:
        def add(w: FutureWork) -> None:
            with self._lock:
                self._sent += w.stats.bytes_sent
                self._received += w.stats.bytes_received

        work.add_done_callback(add)
        return work

    def _submit(self, kind: str, tag: str | None, value: Any, timeout: float | None) -> FutureWork:
        self._check_member()
        t = self._tag(tag)
        work = self._group._contribute(
            self, kind, t, value, f"{kind} '{t}' on rank {self.rank}", self._timeout(timeout)
        )
        return self._counted(work)

    # ---- collectives ---------------------------------------------------------------------------
    def all_reduce_async(
        self,
        tensor: torch.Tensor,
        op: ReduceOp = "sum",
        *,
        codec: Codec | None = None,
        algorithm: Algorithm = "auto",
        tag: str | None = None,
        timeout: float | None = None,
        out: torch.Tensor | None = None,
    ) -> FutureWork:
        if op not in ("sum", "avg"):
            raise ConfigError("op", f"unknown reduction {op!r}; use 'sum' or 'avg'")
        if algorithm not in ALGORITHMS:
            raise ConfigError("algorithm", f"unknown algorithm {algorithm!r}; one of {ALGORITHMS}")
        check_out(tensor, out)
        # What a wire would carry, taken now: the caller may reuse ``tensor`` once this returns
        # (without a codec a copy, unless ``out`` is ``tensor``: the input is then the sum's
        # first term and not touched by the caller until the work is done).
        data: torch.Tensor | Encoded
        if codec is not None:
            data = codec.encode(tensor)
        elif out is not None and out.data_ptr() == tensor.data_ptr():
            data = tensor.detach()
        else:
            data = tensor.detach().clone()
        value = (data, tuple(tensor.shape), tensor.dtype, op, codec, algorithm, out)
        return self._submit("all_reduce", tag, value, timeout)

    def _broadcast_async(
        self,
        tensors: Sequence[torch.Tensor] | None,
        meta: Mapping | None,
        root: int,
        tag: str | None,
        timeout: float | None,
    ) -> FutureWork:
        mine = None
        if self.rank == root and tensors is not None:
            mine = [t.detach().clone() for t in tensors]
        return self._submit("broadcast", tag, ((mine, dict(meta or {})), root), timeout)

    def all_gather_async(
        self, tensor: torch.Tensor, *, tag: str | None = None, timeout: float | None = None
    ) -> FutureWork:
        return self._submit("all_gather", tag, tensor.detach().clone(), timeout)

    def barrier(self, *, tag: str | None = None, timeout: float | None = None) -> None:
        self._submit("barrier", tag, None, timeout).wait()

    # ---- point to point ------------------------------------------------------------------------
    def send(
        self,
        dst: int,
        tensors: Sequence[torch.Tensor],
        meta: Mapping[str, Any] | None = None,
        *,
        tag: str,
        timeout: float | None = None,
    ) -> None:
        self._check_member()
        peers = self._membership.peers
        if not 0 <= dst < len(peers):
            raise ConfigError("dst", f"rank {dst} is not in a world of {len(peers)}")
        msg = ([t.detach().clone() for t in tensors], dict(meta or {}))
        self._group._send(self.peer_id, peers[dst], tag, msg)
        with self._lock:
            self._sent += sum(_nbytes(t) for t in msg[0])

    def recv(
        self, src: int, *, tag: str, timeout: float | None = None
    ) -> tuple[list[torch.Tensor], dict[str, Any]]:
        self._check_member()
        peers = self._membership.peers
        if not 0 <= src < len(peers):
            raise ConfigError("src", f"rank {src} is not in a world of {len(peers)}")
        tensors, meta = self._group._recv(peers[src], self.peer_id, tag, self._timeout(timeout))
        with self._lock:
            self._received += sum(_nbytes(t) for t in tensors)
        return tensors, meta

    # ---- bookkeeping ---------------------------------------------------------------------------
    def stats(self) -> OpStats:
        with self._lock:
            return OpStats(self._sent, self._received)

    def close(self) -> None:
        self._group._remove(
            self.peer_id, PeerLost(f"peer {self.peer_id} left", peers=(self.peer_id,)), closed=True
        )


# ---- running the ranks of a group in threads ------------------------------------------------
def rank_outcomes(
    fns: list[Callable[[], Any]], timeout: float = 60.0
) -> tuple[list[Any], list[BaseException | None]]:
    """Run one callable per rank in threads; return ``(results, errors)`` by rank, an error in
    place of a result where the callable raised. A thread still running after ``timeout``
    raises :class:`TimeoutError`."""
    results: list[Any] = [None] * len(fns)
    errors: list[BaseException | None] = [None] * len(fns)

    def body(i: int) -> None:
        try:
            results[i] = fns[i]()
        except BaseException as e:  # noqa: BLE001 - reported to the caller
            errors[i] = e

    threads = [threading.Thread(target=body, args=(i,), daemon=True) for i in range(len(fns))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
        if t.is_alive():
            raise TimeoutError(f"rank thread still running after {timeout}s")
    return results, errors


def run_ranks(fns: list[Callable[[], Any]], timeout: float = 60.0) -> list[Any]:
    """Run one callable per rank in threads; return results by rank, re-raising the first error."""
    results, errors = rank_outcomes(fns, timeout)
    for e in errors:
        if e is not None:
            raise e
    return results
