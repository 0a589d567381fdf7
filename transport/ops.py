"""Operations driven by the reactor thread: the base class and shared helpers.

Each operation is created by a user thread, started on the reactor thread, fed the messages whose
``(epoch, op key)`` match it, and completes its :class:`~transport.work.FutureWork` exactly once.
Every operation sends from and receives into buffers it owns or that the caller lent it; sends of
caller-visible buffers are zero-copy and *tracked*, and the operation completes only after ZeroMQ
released them (``Reactor.done``), so callers may reuse a tensor as soon as the call returns.

The concrete operations live in :mod:`transport.allreduce` (reductions),
:mod:`transport.messages` (broadcast, all-gather, barrier, send/recv) and :mod:`transport.shm`
(same-host shared memory).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Protocol, Sequence

import torch

from lowband.comm import OpStats
from lowband.errors import ConfigError, ProtocolError
from transport import wire
from transport.buffers import still_sending
from transport.wire import MsgType
from transport.work import FutureWork

if TYPE_CHECKING:
    from lowband.comm import Codec, Encoded
    from transport.buffers import BufferPool
    from transport.peers import PeerTable


class Host(Protocol):
    """What an operation needs from the reactor that drives it (``transport.reactor.Reactor``)."""

    pool: "BufferPool"
    shm_pids: dict[str, int]

    def send(
        self,
        peer: str,
        mtype: MsgType,
        meta: dict[str, Any],
        payload: Sequence[Any] = (),
        *,
        stripe: int | None = None,
        track: bool = False,
    ) -> list[Any]: ...

    def count(self, sent: int = 0, received: int = 0) -> None: ...

    def done(self, op: "Op") -> None: ...

    def forget(self, op: "Op") -> None: ...

    def tick(self) -> None: ...

    def shm_slabs(self) -> Any: ...

    def shm_peers(self) -> Any: ...


class Mismatch(ProtocolError):
    """Ranks disagree about an operation (shape, dtype, root...): the operation fails everywhere."""

    fatal = True


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    if dtype == torch.float64:
        return torch.float64
    if dtype.is_floating_point:
        return torch.float32
    return torch.int64


def check_out(tensor: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor | None:
    """``out`` of an all-reduce (see :mod:`lowband.comm`), checked before anything is sent: a
    mismatch is the caller's error and must not fail the collective on the other ranks."""
    if out is None:
        return None
    if out.shape != tensor.shape or out.dtype != tensor.dtype or out.device != tensor.device:
        raise ConfigError(
            "out",
            f"{tuple(out.shape)} {out.dtype} on {out.device} cannot hold the result of an "
            f"all_reduce of {tuple(tensor.shape)} {tensor.dtype} on {tensor.device}",
        )
    if not out.is_contiguous():
        raise ConfigError("out", "must be contiguous (the result is written into it flat)")
    return out


def decode_into(codec: Codec, encoded: Encoded, out: torch.Tensor) -> None:
    """``out[:] = codec.decode(encoded)``: chunk by chunk where the codec can (int8's
    ``decode_into``), else through one decoded copy."""
    into = getattr(codec, "decode_into", None)
    if into is not None and out.dtype == torch.float32:
        into(encoded, out)
    else:
        out.view(-1).copy_(codec.decode(encoded).reshape(-1))


def bounds(numel: int, parts: int) -> list[tuple[int, int]]:
    """Split ``range(numel)`` into ``parts`` contiguous, nearly equal ranges."""
    cuts = [(i * numel) // parts for i in range(parts + 1)]
    return list(zip(cuts[:-1], cuts[1:]))


STRIPE_PIECES = 16
"""A buffer of up to this many ``chunk_bytes`` moves as at least this many pieces."""
MIN_PIECE_BYTES = 64 * 1024
"""Pieces are not cut below this size (unless ``chunk_bytes`` itself is smaller)."""


def piece_bytes(total: int, chunk_bytes: int) -> int:
    """The size of the pieces a buffer of ``total`` bytes moves in: at most ``chunk_bytes``, and
    small enough that the buffer is at least :data:`STRIPE_PIECES` pieces, so that up to that
    many TCP connections carry it at once and a ring step pipelines instead of waiting for one
    whole segment; never below :data:`MIN_PIECE_BYTES` (per-message costs). A pure function of
    sizes every rank agrees on, so the ranks of a collective cut the same chunks."""
    return min(chunk_bytes, max(MIN_PIECE_BYTES, -(-total // STRIPE_PIECES)))


def chunked(lo: int, hi: int, step: int) -> list[tuple[int, int]]:
    return [(a, min(hi, a + step)) for a in range(lo, hi, step)]


class Op:
    """Base class: identity, bookkeeping, completion. Subclasses implement start/on_message."""

    kind = "op"
    p2p_recv = False
    """A point-to-point receive: the reactor numbers it when it starts (``Routing.bind_recv``)."""

    def __init__(self, table: "PeerTable", key: str, timeout: float, work: FutureWork) -> None:
        m = table.membership
        self.epoch = m.epoch
        self.rank = m.rank
        self.n = m.world_size
        self.peers = m.peers
        self._index = table.index
        self.key = key
        self.timeout = timeout
        self.deadline = time.monotonic() + timeout
        self.work = work
        self.trackers: list[Any] = []
        self.sent = 0
        self.received = 0
        self.finished = False
        self._result: Any = None
        self.p2p_name = ""

    # ---- identity ---------------------------------------------------------------------------
    def describe(self) -> str:
        return f"{self.kind} '{self.key}' (epoch {self.epoch}, rank {self.rank})"

    def peers_involved(self) -> tuple[str, ...]:
        return self.peers

    def needs(self, peer: str) -> bool:
        """Whether this op still waits for data that only ``peer`` can send (or forward).

        A lost peer fails exactly the ops that still need it: one that finished its part and
        left does not fail collectives it already contributed to."""
        return not self.finished

    def rank_of(self, peer: str) -> int | None:
        return self._index.get(peer)

    def meta(self, **fields: Any) -> dict[str, Any]:
        return {
            "e": self.epoch,
            "o": self.key,
            "p": self.peers[self.rank],
            "k": self.kind,
            **fields,
        }

    # ---- io ------------------------------------------------------------------------------------
    def send(
        self,
        host: "Host",
        dst: int,
        mtype: MsgType,
        meta: dict[str, Any],
        payload: Sequence[Any] = (),
        *,
        stripe: int | None = None,
        track: bool = False,
    ) -> None:
        self.trackers.extend(
            host.send(self.peers[dst], mtype, meta, payload, stripe=stripe, track=track)
        )
        self.sent += sum(memoryview(p).nbytes for p in payload)

    def check_kind(self, msg: wire.Message) -> None:
        if msg.meta.get("k") != self.kind:
            raise Mismatch(
                f"ranks disagree on the operation '{self.key}': "
                f"{msg.meta.get('k')!r} vs {self.kind!r}"
            )

    # ---- completion -----------------------------------------------------------------------------
    def finish(self, host: "Host", result: Any) -> None:
        self._result = result
        self.finished = True
        host.done(self)

    def pending_trackers(self) -> bool:
        self.trackers = still_sending(self.trackers)
        return bool(self.trackers)

    def settle(self, host: "Host") -> None:
        host.count(self.sent, self.received)
        self.work.set_result(self._result, OpStats(self.sent, self.received))

    def fail(self, host: "Host", exc: BaseException) -> None:
        self.finished = True
        host.forget(self)
        if self.work.set_error(exc, OpStats(self.sent, self.received)):
            host.count(self.sent, self.received)

    def start(self, host: "Host") -> None:
        raise NotImplementedError

    def on_message(self, host: "Host", src: int, msg: wire.Message) -> None:
        raise NotImplementedError


class ReduceBase(Op):
    """What every all-reduce shares: the signature all ranks must agree on, and averaging."""

    kind = "all_reduce"

    def __init__(
        self,
        table: "PeerTable",
        key: str,
        timeout: float,
        work: FutureWork,
        *,
        x: torch.Tensor,
        shape: tuple[int, ...],
        op: str,
        algorithm: str,
        chunk_bytes: int,
        codec: Codec | None = None,
        out: torch.Tensor | None = None,
    ) -> None:
        super().__init__(table, key, timeout, work)
        self.x = x  # flat, contiguous
        self.target = out  # the caller's ``out=`` (checked), written at ``settle`` only
        self.shape = shape
        self.op = op
        self.algorithm = algorithm
        self.codec = codec
        self.numel = x.numel()
        self.dtype = x.dtype
        elem = max(1, x.element_size())
        segment = -(-self.numel // max(1, self.n)) * elem  # the ring's / scatter's segment
        self.chunk = max(1, piece_bytes(segment, chunk_bytes) // elem)
        self.signature = {
            "n": self.numel,
            "d": wire.dtype_name(self.dtype),
            "r": op,
            "a": algorithm,
            "cn": codec.name if codec is not None else "",
            "ch": self.chunk,
        }

    def check(self, msg: wire.Message) -> None:
        self.check_kind(msg)
        for k, mine in self.signature.items():
            if msg.meta.get(k) != mine:
                raise Mismatch(
                    f"all_reduce '{self.key}': ranks disagree on {_FIELD_NAMES[k]}: "
                    f"{msg.meta.get(k)!r} here {mine!r} (every rank must pass the same shape, "
                    "dtype, op, algorithm and codec)"
                )

    def settle(self, host: "Host") -> None:
        """The caller's ``out=`` holds the result only now, on success and after every tracked
        send of the input left (it may be the input): a failed operation leaves it as it was,
        so a caller can retry from its input. The schedules keep their own result buffer
        until then and it is copied in here, except the owner schedules with a codec, which
        hold the final encodings and decode them into ``out`` once all have arrived."""
        result = self._result
        if self.target is not None and isinstance(result, torch.Tensor):
            if result.data_ptr() != self.target.data_ptr():  # else decoded into it already
                self.target.view(-1).copy_(result.reshape(-1))
            self._result = self.target
        super().settle(host)

    def average(self, acc: torch.Tensor) -> torch.Tensor:
        if self.op != "avg":
            return acc
        if acc.dtype.is_floating_point:
            return acc.div_(self.n)
        return acc.div_(self.n, rounding_mode="floor")  # in place: the ring sends from acc


_FIELD_NAMES = {
    "n": "the number of elements",
    "d": "the dtype",
    "r": "the reduction",
    "a": "the algorithm",
    "cn": "the codec",
    "ch": "the chunk size",
}
