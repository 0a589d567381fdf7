"""All-reduce schedules, as operations driven by the reactor thread (see :mod:`transport.ops`).

Each operation is created by a user thread, started on the reactor thread, fed the messages whose
``(epoch, op key)`` match it, and completes its :class:`~transport.work.FutureWork` exactly once.
Every operation sends from and receives into buffers it owns or that the caller lent it; sends of
caller-visible buffers are zero-copy and *tracked*, and the operation completes only after ZeroMQ
released them (``Reactor.done``), so callers may reuse a tensor as soon as the call returns.

All-reduce algorithms (bytes each rank sends for a payload of P bytes over n ranks)
-------------------------------------------------------------------------------------
``ring``     pipelined ring reduce-scatter + all-gather, 2(n-1)/n·P. Every segment is cut into
             chunks and each chunk moves on independently, so rank r adds chunk c of step s while
             chunk c+1 is still on the wire. Partial sums are forwarded in the accumulation dtype,
             so it is used when that equals the input dtype (float32, float64, int64) and no codec
             is given; otherwise ``ring`` is served by ``scatter``.
``scatter``  direct reduce-scatter to segment owners + all-gather from them, the same 2(n-1)/n·P.
             Every contribution is encoded once by its author and decoded once by the owner, which
             accumulates in float32: quantization error does not grow with the world size, unlike a
             ring that would re-quantize partial sums at every hop.
``star``     every rank sends to rank 0, rank 0 reduces and sends the result back: two hops, for
             small latency-bound payloads.

Bit-identical results: each element has exactly one owner that computes its final value; the
owner sends those bytes (with a codec: the encoding of the final value, which the owner decodes
itself too) and every rank, the owner included, ends with exactly that value.

Why forwarding the ring's partial sums zero-copy is safe without tracking: a partial sum of
segment g sent by rank r is consumed by rank r+1 before the final value of g can exist, and r
overwrites that region only with g's final value. Step-0 sends (the caller's input) and every
send of a final value (from the returned tensor) are tracked, so an operation completes only when
ZeroMQ has handed its last sends to the kernel and a caller may close the communicator at once.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from lowband.comm import Encoded
from lowband.errors import ProtocolError
from transport import wire
from transport.ops import Host, ReduceBase, acc_dtype, bounds, chunked, decode_into
from transport.wire import MsgType

if TYPE_CHECKING:
    pass


class RingAllReduce(ReduceBase):
    """Pipelined ring; see the module docstring. Global step s in [0, 2n-3]: rank r sends
    segment (r - s) mod n and receives segment (r - s - 1) mod n; steps < n-1 reduce, the rest
    gather. Rank r owns segment (r + 1) mod n."""

    def start(self, host: "Host") -> None:
        n, r = self.n, self.rank
        self.out = host.pool.empty(self.numel, self.dtype)
        self.segs = [chunked(lo, hi, self.chunk) for lo, hi in bounds(self.numel, n)]
        self.next = (r + 1) % n
        self.prev = (r - 1) % n
        self.owned = (r + 1) % n
        self.seen: set[tuple[int, int]] = set()
        # Every chunk completes here exactly once: the owned segment's chunks when this rank
        # finalizes them, every other segment's (its own input segment included) when the
        # all-gather brings the owner's value.
        self.todo = sum(len(c) for c in self.segs)
        for c, (lo, hi) in enumerate(self.segs[r]):
            self.send(
                host,
                self.next,
                MsgType.CHUNK,
                self.meta(st=0, g=r, c=c, **self.signature),
                [wire.tensor_bytes(self.x[lo:hi])],
                stripe=c,
                track=True,
            )
        if self.todo == 0:
            self.finish(host, self.out.view(self.shape))

    def needs(self, peer: str) -> bool:
        # Everything comes from the previous rank (what others send reaches this one through
        # it); a rank that finished and left handed its last sends to the kernel before its BYEs.
        return not self.finished and self.rank_of(peer) == self.prev

    def on_message(self, host: "Host", src: int, msg: wire.Message) -> None:
        self.check(msg)
        n, r = self.n, self.rank
        if src != self.prev:
            raise ProtocolError(f"ring chunk from rank {src}, expected rank {self.prev}")
        st = wire.int_field(msg.meta, "st", 0, 2 * n - 3)
        g = wire.int_field(msg.meta, "g", 0, n - 1)
        c = wire.int_field(msg.meta, "c", 0)
        if g != (r - st - 1) % n or c >= len(self.segs[g]):
            raise ProtocolError(
                f"ring chunk (step {st}, segment {g}, chunk {c}) is not expected here"
            )
        if (st, c) in self.seen:
            raise ProtocolError(f"duplicate ring chunk (step {st}, chunk {c})")
        lo, hi = self.segs[g][c]
        if len(msg.payload) != 1 or len(msg.payload[0]) != (hi - lo) * self.x.element_size():
            raise ProtocolError(
                f"ring chunk of {[len(p) for p in msg.payload]} bytes, "
                f"expected {(hi - lo) * self.x.element_size()}"
            )
        self.seen.add((st, c))
        self.received += len(msg.payload[0])
        incoming = wire.tensor_from(msg.payload[0], self.dtype, (hi - lo,))
        dst = self.out[lo:hi]
        if st < n - 1:  # reduce-scatter
            torch.add(self.x[lo:hi], incoming, out=dst)
            if st < n - 2:
                self.send(
                    host,
                    self.next,
                    MsgType.CHUNK,
                    self.meta(st=st + 1, g=g, c=c, **self.signature),
                    [wire.tensor_bytes(dst)],
                    stripe=c,
                )
            else:  # this rank owns segment g: finalize, then start its all-gather
                self.average(dst)
                self.send(
                    host,
                    self.next,
                    MsgType.CHUNK,
                    self.meta(st=st + 1, g=g, c=c, **self.signature),
                    [wire.tensor_bytes(dst)],
                    stripe=c,
                    track=True,
                )
                self.todo -= 1
        else:  # all-gather: keep the owner's bytes and pass them on
            dst.copy_(incoming)
            if st < 2 * n - 3:
                # From the result, tracked: this rank's last sends, which its completion must
                # wait for, or a caller that closes on return could leave them queued.
                self.send(
                    host,
                    self.next,
                    MsgType.CHUNK,
                    self.meta(st=st + 1, g=g, c=c, **self.signature),
                    [wire.tensor_bytes(dst)],
                    stripe=c,
                    track=True,
                )
            self.todo -= 1
        if self.todo == 0:
            self.finish(host, self.out.view(self.shape))


class OwnerAllReduce(ReduceBase):
    """The owner schedules: every segment of the buffer is reduced by the rank that owns it.
    ``star``: one segment, owned by rank 0; ``scatter``: n segments, segment j owned by rank j.

    Phase 0: each rank sends each chunk of every segment it does not own to that segment's
    owner (encoded once if a codec is given). The owner decodes each contribution once and
    accumulates in float32 in arrival order. Phase 1: once a chunk has all n contributions, the
    owner finalizes it (average, encode) and sends the final bytes to every other rank."""

    def start(self, host: "Host") -> None:
        parts = 1 if self.algorithm == "star" else self.n
        self.owner_of: list[int] = []
        self.spans: list[tuple[int, int]] = []
        for owner, (lo, hi) in enumerate(bounds(self.numel, parts)):
            for span in chunked(lo, hi, self.chunk):
                self.owner_of.append(owner)
                self.spans.append(span)
        # With a codec and the caller's ``out=``, every chunk's final value is held as the
        # owner's encoding (1 B/element for int8, not a float32 result buffer) and decoded
        # into ``out`` once all have arrived: ``out`` (often the input) is written only on
        # success, and the input is not read after this method (its chunks left encoded).
        self.held: dict[int, Encoded] | None = None
        if self.target is not None and self.codec is not None:
            self.held = {}
            self.out = self.target.view(-1)
        else:
            self.out = host.pool.empty(self.numel, self.dtype)
        self.acc: dict[int, torch.Tensor] = {}
        self.contributors: dict[int, set[int]] = {}
        self.todo = len(self.spans)
        self.final_seen: set[int] = set()
        self.pending_owned = {ci for ci, o in enumerate(self.owner_of) if o == self.rank}
        for ci, (lo, hi) in enumerate(self.spans):
            host.tick()  # encoding many chunks may take a while
            piece = self.x[lo:hi]
            owner = self.owner_of[ci]
            if owner == self.rank:
                self._accumulate(host, ci, self.rank, self._local(piece))
            else:
                payload, extra = self._encode(piece)
                self.send(
                    host,
                    owner,
                    MsgType.CHUNK,
                    self.meta(ph=0, ci=ci, **extra, **self.signature),
                    payload,
                    stripe=ci,
                    track=self.codec is None,
                )
        if self.todo == 0:
            self._done(host)

    def needs(self, peer: str) -> bool:
        if self.finished:
            return False
        r = self.rank_of(peer)
        if any(
            self.owner_of[ci] == self.rank and r not in self.contributors.get(ci, ())
            for ci in self.pending_owned
        ):
            return True  # a contribution of ``peer`` to a chunk this rank owns is missing
        return any(
            self.owner_of[ci] == r and ci not in self.final_seen for ci in range(len(self.spans))
        )

    def _local(self, piece: torch.Tensor) -> torch.Tensor:
        if self.codec is None:
            return piece
        return self.codec.decode(self.codec.encode(piece))

    def _encode(self, piece: torch.Tensor) -> tuple[list[memoryview], dict[str, Any]]:
        if self.codec is None:
            return [wire.tensor_bytes(piece)], {}
        enc = self.codec.encode(piece)
        return (
            [wire.tensor_bytes(f) for f in enc.frames],
            {"cm": dict(enc.meta), "cf": [wire.describe(f) for f in enc.frames]},
        )

    def _done(self, host: "Host") -> None:
        if self.held is not None and self.codec is not None:
            for ci, (lo, hi) in enumerate(self.spans):
                decode_into(self.codec, self.held.pop(ci), self.out[lo:hi])
        self.finish(host, self.out.view(self.shape))

    def _encoded(self, msg: wire.Message) -> Encoded:
        descs = wire.field(msg.meta, "cf", list)
        cmeta = wire.field(msg.meta, "cm", dict)
        if len(descs) != len(msg.payload):
            raise ProtocolError("codec frame descriptors do not match the payload frames")
        frames = []
        for desc, buf in zip(descs, msg.payload):
            dtype, shape, size = wire.parse_descriptor(desc, len(buf))
            if size != len(buf):
                raise ProtocolError(f"codec frame of {len(buf)} bytes, descriptor says {size}")
            frames.append(wire.tensor_from(buf, dtype, shape))
        return Encoded(frames=tuple(frames), meta=cmeta)

    def _decode(self, msg: wire.Message, length: int) -> torch.Tensor:
        if self.codec is None:
            if len(msg.payload) != 1 or len(msg.payload[0]) != length * self.x.element_size():
                raise ProtocolError(
                    f"chunk of {[len(p) for p in msg.payload]} bytes, expected "
                    f"{length * self.x.element_size()}"
                )
            return wire.tensor_from(msg.payload[0], self.dtype, (length,))
        encoded = self._encoded(msg)
        try:
            value = self.codec.decode(encoded)
        except Exception as exc:  # a codec fed bad bytes may raise anything
            raise ProtocolError(
                f"codec {self.codec.name} could not decode a chunk: {exc}"
            ) from None
        if value.shape != (length,):
            raise ProtocolError(
                f"decoded chunk has shape {tuple(value.shape)}, expected ({length},)"
            )
        return value

    def _accumulate(self, host: "Host", ci: int, src: int, value: torch.Tensor) -> None:
        have = self.contributors.setdefault(ci, set())
        if src in have:
            raise ProtocolError(f"duplicate contribution of rank {src} to chunk {ci}")
        have.add(src)
        acc = self.acc.get(ci)
        if acc is None:
            if self.codec is None and acc_dtype(self.dtype) == self.dtype:
                lo, hi = self.spans[ci]
                acc = self.acc[ci] = self.out[lo:hi]  # sum in place where the result goes
                acc.copy_(value)
            else:
                self.acc[ci] = value.to(acc_dtype(self.dtype), copy=True)
        else:
            acc += value
        if len(have) == self.n:
            self._finalize(host, ci)

    def _finalize(self, host: "Host", ci: int) -> None:
        acc = self.average(self.acc.pop(ci))
        del self.contributors[ci]
        self.pending_owned.discard(ci)
        lo, hi = self.spans[ci]
        if self.codec is not None:
            enc = self.codec.encode(acc)
            frames = list(enc.frames)
            extra = {"cm": dict(enc.meta), "cf": [wire.describe(f) for f in enc.frames]}
            if self.held is not None:
                self.held[ci] = enc
            else:
                self.out[lo:hi] = self.codec.decode(enc).to(self.dtype)
        else:
            final = acc.to(self.dtype)
            frames, extra = [final], {}
            if final.data_ptr() != self.out[lo:hi].data_ptr():
                self.out[lo:hi] = final
        for dst in range(self.n):
            if dst != self.rank:
                # The owner's last sends: tracked (its completion waits for them, so a caller
                # that closes on return leaves nothing queued), each send its own views
                # (tracking counts references to the payload objects).
                self.send(
                    host,
                    dst,
                    MsgType.CHUNK,
                    self.meta(ph=1, ci=ci, **extra, **self.signature),
                    [wire.tensor_bytes(f) for f in frames],
                    stripe=ci,
                    track=True,
                )
        self.todo -= 1

    def on_message(self, host: "Host", src: int, msg: wire.Message) -> None:
        self.check(msg)
        ph = wire.int_field(msg.meta, "ph", 0, 1)
        ci = wire.int_field(msg.meta, "ci", 0, len(self.spans) - 1) if self.spans else -1
        if ci < 0:
            raise ProtocolError("chunk for an empty all_reduce")
        lo, hi = self.spans[ci]
        owner = self.owner_of[ci]
        if ph == 0:
            if owner != self.rank:
                raise ProtocolError(
                    f"contribution to chunk {ci} sent to rank {self.rank}, owner is {owner}"
                )
            value = self._decode(msg, hi - lo)
            self.received += sum(len(p) for p in msg.payload)
            self._accumulate(host, ci, src, value)
        else:
            if src != owner or ci in self.final_seen:
                raise ProtocolError(f"unexpected final value of chunk {ci} from rank {src}")
            value = self._decode(msg, hi - lo)  # checks the bytes now, whether held or not
            self.final_seen.add(ci)
            self.received += sum(len(p) for p in msg.payload)
            if self.held is not None:  # a copy: the message's buffers are not ours to keep
                enc = self._encoded(msg)
                self.held[ci] = Encoded(tuple(f.clone() for f in enc.frames), enc.meta)
            else:
                self.out[lo:hi] = value
            self.todo -= 1
        if self.todo == 0:
            self._done(host)
