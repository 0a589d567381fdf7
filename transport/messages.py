"""Logical messages and the collectives built on them: broadcast, all-gather, barrier, send/recv.

A logical message is tensors plus msgpack metadata. :func:`post_message` sends a MSG (tensor
descriptors, the metadata and the first ``chunk_bytes`` of data) and then MSG_PART chunks striped
over the K connections; :class:`Assembler` places parts by (tensor, byte offset) into tensors it
allocates once the MSG arrived (parts that overtake their MSG on another connection wait).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Mapping, Sequence

import torch

from lowband.errors import ProtocolError
from transport import wire
from transport.ops import Host, Mismatch, Op, piece_bytes
from transport.wire import MsgType
from transport.work import FutureWork

if TYPE_CHECKING:
    from transport.buffers import BufferPool
    from transport.peers import PeerTable


def post_message(
    op: Op,
    host: "Host",
    dst: int,
    tensors: Sequence[torch.Tensor],
    meta: Mapping[str, Any] | None,
    *,
    index: int = 0,
    chunk_bytes: int,
    track: bool = True,
    **extra: Any,
) -> None:
    """Send tensors + metadata as one logical message: a MSG (descriptors, user metadata and the
    first ≤ chunk_bytes of data) then MSG_PART chunks striped over the K connections; a message
    of less than 16 chunks is cut smaller (:func:`transport.ops.piece_bytes`) so that several
    connections carry it."""
    bufs = [wire.tensor_bytes(t) for t in tensors]
    chunk_bytes = piece_bytes(sum(len(b) for b in bufs), chunk_bytes)
    pieces = [
        (ti, off, min(chunk_bytes, len(b) - off))
        for ti, b in enumerate(bufs)
        for off in range(0, len(b), chunk_bytes)
    ]
    parts: list[list[tuple[int, int, int]]] = [[]]
    size = 0
    for p in pieces:
        # a part is one message: within chunk_bytes and the receivers' frame limit
        if parts[-1] and (size + p[2] > chunk_bytes or len(parts[-1]) >= wire.MAX_PAYLOAD_FRAMES):
            parts.append([])
            size = 0
        parts[-1].append(p)
        size += p[2]

    def payload(part: list[tuple[int, int, int]]) -> list[memoryview]:
        return [bufs[ti][off : off + ln] for ti, off, ln in part]

    head = op.meta(
        i=index,
        t=[wire.describe(t) for t in tensors],
        m=dict(meta or {}),
        pc=[list(p) for p in parts[0]],
        np=len(parts) - 1,
        **extra,
    )
    op.send(host, dst, MsgType.MSG, head, payload(parts[0]), stripe=0, track=track)
    for j, part in enumerate(parts[1:]):
        op.send(
            host,
            dst,
            MsgType.MSG_PART,
            op.meta(i=index, j=j, pc=[list(p) for p in part]),
            payload(part),
            stripe=j + 1,
            track=track,
        )


MAX_OPEN_PER_SOURCE = 64
"""Messages of one source partly here at a time, in one operation (every collective sends one
per source and operation)."""
PARTIAL_SLACK = 64 << 20
"""Held for one source beyond ``max_bytes``: the overheads and metadata of its open messages
and of parts that came before their header (a few KiB to a few MiB for a real message)."""


class _Partial:
    def __init__(self) -> None:
        self.charged = 0  # bytes counted against its source (Assembler.held)
        self.tensors: list[torch.Tensor] | None = None
        self.flat: list[torch.Tensor] = []
        self.meta: dict[str, Any] = {}
        self.extra: dict[str, Any] = {}
        self.remaining = 0
        self.parts_left = 0
        self.seen: set[int] = set()
        self.early: list[wire.Message] = []


class Assembler:
    """Reassembles logical messages from MSG / MSG_PART, keyed by (source rank, index).

    What one source has here at a time, the tensors of its messages being filled and the
    parts that came before their header (``wire.Message.held_bytes``), plus a fixed overhead
    per open message, is bounded by ``max_bytes`` (the largest message this peer takes) plus
    ``PARTIAL_SLACK``, checked before anything is allocated: a peer cannot make this one hold
    more for it by opening many messages or sending parts with no header."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.limit = max_bytes + PARTIAL_SLACK
        self._partial: dict[tuple[int, int], _Partial] = {}
        self._held: dict[int, int] = {}  # source rank -> bytes charged to it
        self._open_count: dict[int, int] = {}  # source rank -> its messages open here

    @property
    def busy(self) -> bool:
        """Some message is partly here."""
        return bool(self._partial)

    def held(self, src: int) -> int:
        """Bytes of partial messages kept for ``src``."""
        return self._held.get(src, 0)

    def _charge(self, src: int, part: _Partial, n: int) -> None:
        held = self._held.get(src, 0) + n
        if held > self.limit:
            raise ProtocolError(
                f"rank {src} would have more than {self.limit} bytes of partial messages "
                "here (ZmqConfig.max_tensor_bytes + 64 MiB)"
            )
        self._held[src] = held
        part.charged += n

    def _release(self, src: int, part: _Partial, n: int) -> None:
        part.charged -= n
        held = self._held.get(src, 0) - n
        if held > 0:
            self._held[src] = held
        else:
            self._held.pop(src, None)

    def feed(
        self, src: int, msg: wire.Message, pool: "BufferPool"
    ) -> tuple[int, list[torch.Tensor], dict, dict] | None:
        """Returns (index, tensors, user meta, header meta) once a message is complete."""
        index = wire.int_field(msg.meta, "i", 0, 1 << 30)
        key = (src, index)
        part = self._partial.get(key)
        if part is not None:
            return self._feed(src, key, part, msg, pool)
        if self._open_count.get(src, 0) >= MAX_OPEN_PER_SOURCE:
            raise ProtocolError(f"rank {src} has {MAX_OPEN_PER_SOURCE} messages open here already")
        part = _Partial()
        self._charge(src, part, wire.MESSAGE_OVERHEAD)
        self._partial[key] = part
        self._open_count[src] = self._open_count.get(src, 0) + 1
        try:
            return self._feed(src, key, part, msg, pool)
        except ProtocolError:
            if part.tensors is None and not part.early:  # a refused first message: no trace
                self._forget(src, key, part)
            raise

    def _forget(self, src: int, key: tuple[int, int], part: _Partial) -> None:
        del self._partial[key]
        self._release(src, part, part.charged)
        left = self._open_count.get(src, 0) - 1
        if left > 0:
            self._open_count[src] = left
        else:
            self._open_count.pop(src, None)

    def _feed(
        self,
        src: int,
        key: tuple[int, int],
        part: _Partial,
        msg: wire.Message,
        pool: "BufferPool",
    ) -> tuple[int, list[torch.Tensor], dict, dict] | None:
        if msg.type == MsgType.MSG:
            if part.tensors is not None:
                raise ProtocolError(f"duplicate message header from rank {src}")
            self._open(src, part, msg, pool)
            self._place(part, msg)
            early, part.early = part.early, []
            self._release(src, part, sum(e.held_bytes for e in early))  # now in the tensors
            for e in early:
                self._part(part, e)
        elif part.tensors is None:
            if len(part.early) > 1 << 16:
                raise ProtocolError("too many message parts before their header")
            self._charge(src, part, msg.held_bytes)
            part.early.append(msg)
            return None
        else:
            self._part(part, msg)
        if part.tensors is not None and part.remaining == 0 and part.parts_left == 0:
            self._forget(src, key, part)  # the tensors are the caller's now
            return key[1], part.tensors, part.meta, part.extra
        return None

    def _open(self, src: int, part: _Partial, msg: wire.Message, pool: "BufferPool") -> None:
        descs = wire.field(msg.meta, "t", list)
        total = 0
        parsed = []
        for d in descs:  # every size is known and checked before the first allocation
            dtype, shape, size = wire.parse_descriptor(d, self.max_bytes)
            total += size
            if total > self.max_bytes:
                raise ProtocolError(f"message of more than {self.max_bytes} bytes refused")
            parsed.append((shape, dtype))
        self._charge(src, part, total)
        tensors = [pool.empty(shape, dtype) for shape, dtype in parsed]
        part.tensors = tensors
        part.flat = [
            t.reshape(-1).view(torch.uint8) if t.numel() else t.reshape(-1) for t in tensors
        ]
        part.remaining = total
        part.meta = wire.field(msg.meta, "m", dict)
        part.extra = msg.meta
        part.parts_left = wire.int_field(msg.meta, "np", 0, 1 << 30)

    def _part(self, part: _Partial, msg: wire.Message) -> None:
        j = wire.int_field(msg.meta, "j", 0, part.parts_left + len(part.seen))
        if j in part.seen:
            raise ProtocolError(f"duplicate message part {j}")
        part.seen.add(j)
        self._place(part, msg)
        part.parts_left -= 1

    def _place(self, part: _Partial, msg: wire.Message) -> None:
        pieces = wire.field(msg.meta, "pc", list)
        if len(pieces) != len(msg.payload):
            raise ProtocolError("message piece list does not match its frames")
        for piece, buf in zip(pieces, msg.payload):
            if (
                not isinstance(piece, list)
                or len(piece) != 3
                or not all(isinstance(v, int) and not isinstance(v, bool) for v in piece)
            ):
                raise ProtocolError(f"bad message piece {piece!r}")
            ti, off, ln = piece
            if (
                not 0 <= ti < len(part.flat)
                or off < 0
                or ln != len(buf)
                or off + ln > part.flat[ti].numel()
                or ln > part.remaining
            ):
                raise ProtocolError(f"message piece {piece!r} does not fit its tensor")
            if ln:
                part.flat[ti][off : off + ln].copy_(torch.frombuffer(buf, dtype=torch.uint8))
            part.remaining -= ln


class _MessageOp(Op):
    def __init__(
        self,
        table: "PeerTable",
        key: str,
        timeout: float,
        work: FutureWork,
        *,
        chunk_bytes: int,
        max_bytes: int,
    ) -> None:
        super().__init__(table, key, timeout, work)
        self.chunk_bytes = chunk_bytes
        self.assembler = Assembler(max_bytes)

    def on_message(self, host: "Host", src: int, msg: wire.Message) -> None:
        self.check_kind(msg)
        done = self.assembler.feed(src, msg, host.pool)
        self.received += sum(len(p) for p in msg.payload)
        if done is not None:
            self.on_complete(host, src, *done)

    def on_complete(
        self,
        host: "Host",
        src: int,
        index: int,
        tensors: list[torch.Tensor],
        meta: dict,
        header: dict,
    ) -> None:
        raise NotImplementedError


class BroadcastOp(_MessageOp):
    kind = "broadcast"

    def __init__(
        self,
        *args: Any,
        root: int,
        tensors: list[torch.Tensor] | None,
        user_meta: Mapping[str, Any] | None,
        **kw: Any,
    ) -> None:
        super().__init__(*args, **kw)
        self.root = root
        self.tensors = tensors
        self.user_meta = dict(user_meta or {})

    def needs(self, peer: str) -> bool:
        return not self.finished and self.rank_of(peer) == self.root

    def start(self, host: "Host") -> None:
        if self.rank != self.root:
            return
        assert self.tensors is not None
        for dst in range(self.n):
            if dst != self.root:
                post_message(
                    self,
                    host,
                    dst,
                    self.tensors,
                    self.user_meta,
                    chunk_bytes=self.chunk_bytes,
                    root=self.root,
                )
        self.finish(host, ([t.clone() for t in self.tensors], dict(self.user_meta)))

    def on_complete(
        self,
        host: "Host",
        src: int,
        index: int,
        tensors: list[torch.Tensor],
        meta: dict,
        header: dict,
    ) -> None:
        if header.get("root") != self.root or src != self.root:
            raise Mismatch(
                f"broadcast '{self.key}': ranks disagree on the root "
                f"({header.get('root')!r} vs {self.root})"
            )
        self.finish(host, (tensors, meta))


class AllGatherOp(_MessageOp):
    kind = "all_gather"

    def __init__(self, *args: Any, tensor: torch.Tensor, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.tensor = tensor
        self.results: list[torch.Tensor | None] = []

    def needs(self, peer: str) -> bool:
        r = self.rank_of(peer)
        return not self.finished and r is not None and self.results[r] is None

    def start(self, host: "Host") -> None:
        self.results = [None] * self.n
        self.results[self.rank] = self.tensor.clone()
        for dst in range(self.n):
            if dst != self.rank:
                post_message(self, host, dst, [self.tensor], None, chunk_bytes=self.chunk_bytes)
        self._maybe_done(host)

    def on_complete(
        self,
        host: "Host",
        src: int,
        index: int,
        tensors: list[torch.Tensor],
        meta: dict,
        header: dict,
    ) -> None:
        if len(tensors) != 1 or self.results[src] is not None:
            raise ProtocolError(f"unexpected all_gather message from rank {src}")
        self.results[src] = tensors[0]
        self._maybe_done(host)

    def _maybe_done(self, host: "Host") -> None:
        if all(r is not None for r in self.results):
            self.finish(host, list(self.results))


class BarrierOp(_MessageOp):
    kind = "barrier"

    def needs(self, peer: str) -> bool:
        return not self.finished and self.rank_of(peer) not in self.arrived

    def start(self, host: "Host") -> None:
        self.arrived = {self.rank}
        for dst in range(self.n):
            if dst != self.rank:
                post_message(self, host, dst, [], None, chunk_bytes=self.chunk_bytes, track=False)
        if len(self.arrived) == self.n:
            self.finish(host, None)

    def on_complete(
        self,
        host: "Host",
        src: int,
        index: int,
        tensors: list[torch.Tensor],
        meta: dict,
        header: dict,
    ) -> None:
        self.arrived.add(src)
        if len(self.arrived) == self.n:
            self.finish(host, None)


class SendOp(_MessageOp):
    kind = "p2p"

    def __init__(
        self,
        *args: Any,
        dst: int,
        tensors: list[torch.Tensor],
        user_meta: Mapping[str, Any] | None,
        **kw: Any,
    ) -> None:
        super().__init__(*args, **kw)
        self.dst = dst
        self.tensors = tensors
        self.user_meta = user_meta

    def peers_involved(self) -> tuple[str, ...]:
        return (self.peers[self.dst],)

    def needs(self, peer: str) -> bool:
        return False

    def start(self, host: "Host") -> None:
        post_message(
            self, host, self.dst, self.tensors, self.user_meta, chunk_bytes=self.chunk_bytes
        )
        self.finish(host, None)


class RecvOp(_MessageOp):
    kind = "p2p"
    p2p_recv = True

    def __init__(self, *args: Any, src: int, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.src = src

    def peers_involved(self) -> tuple[str, ...]:
        return (self.peers[self.src],)

    def needs(self, peer: str) -> bool:
        return not self.finished and self.rank_of(peer) == self.src

    def start(self, host: "Host") -> None:
        pass

    def on_complete(
        self,
        host: "Host",
        src: int,
        index: int,
        tensors: list[torch.Tensor],
        meta: dict,
        header: dict,
    ) -> None:
        if src != self.src:
            raise ProtocolError(f"message for a receive from rank {self.src} came from rank {src}")
        self.finish(host, (tensors, meta))
