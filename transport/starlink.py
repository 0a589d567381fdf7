"""A latency-first star link for the tensor-parallel hot path (TPI-LLM §3.2: star all-reduce).

Why a link of its own: a decode step makes 2 all-reduces per layer of a few KiB each, so the
cost is pure latency. Measured on this 2-core machine under load, a blocking TCP round trip
from the compute thread takes ~46 µs (median), while a general communicator that hands every
message through an I/O thread and an engine thread takes ~0.8 ms per all-reduce; with 64
all-reduces per token that is the difference between +3 ms and +50 ms per token, and far more
when the CPU is contended (each thread hop waits for the scheduler). So activations travel
here: one TCP connection per worker, blocking reads on the compute thread, fixed binary
framing. Membership, control messages, health checks and recovery stay on the
``lowband.comm.Communicator``.

Wire format (little-endian, defined once in :mod:`transport.starlink_wire` for this module and
the compiled decode step): header ``<4sBBHIQ`` = magic ``LBSL``, version 1, kind
(HELLO/DATA/RESULT/ABORT/SYNC/CMD), reserved, sequence number, payload length; a payload is a
u32 length and a msgpack table of frame dtypes/sizes and codec metadata, then the raw frames.
Sequence numbers catch desynchronisation loudly (``ProtocolError``) instead of mixing layers.

CMD carries a command from the master to one worker between two forwards (``StarHub.command``
/ ``StarSpoke.next_command``): during a decode the next token's forward goes this way, to a
worker already polling its link, instead of through the communicator's I/O and engine threads
(~0.2 ms per token on the master alone, measured). It never appears inside an all-reduce: the
master sends one only after its own forward has finished, which is after every worker has sent
its last partial sum, and TCP keeps the order.

Both classes provide the ``all_reduce``/``stats`` subset of the Communicator protocol that
``edge.tp.make_reduce`` uses; every rank returns the bit-identical ``decode(encode(sum))``.
"""

from __future__ import annotations

import hmac
import logging
import os
import secrets
import socket
import threading
import time
from typing import Sequence

import msgpack
import torch

from lowband.comm import Codec, Encoded, OpStats
from lowband.errors import AuthError, PeerLost, ProtocolError, TransportTimeout
from transport.starlink_wire import (
    ABORT,
    CMD,
    DATA,
    HEADER,
    HELLO,
    HELLO_TIMEOUT_S,
    MAGIC,
    MAX_HELLO,
    MAX_PAYLOAD,
    RESULT,
    SYNC,
    TABLE_LEN,
    VERSION,
)

logger = logging.getLogger(__name__)

_DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int8": torch.int8,
    "uint8": torch.uint8,
}


def _encode(x: torch.Tensor, codec: Codec | None) -> tuple[list[torch.Tensor], dict]:
    if codec is None:
        f = x.detach().to(torch.float32).contiguous()
        return [f], {"shape": list(x.shape)}
    enc = codec.encode(x)
    return [f.contiguous() for f in enc.frames], dict(enc.meta)


def _decode(frames: list[torch.Tensor], meta: dict, codec: Codec | None) -> torch.Tensor:
    if codec is None:
        return frames[0].view(meta["shape"])
    return codec.decode(Encoded(frames=tuple(frames), meta=meta))


def _parse_table(payload: bytearray, who: str) -> tuple[dict, list[tuple[str, int, int]]]:
    """A payload's codec metadata and frames as ``(dtype name, offset, bytes)``, every field
    checked: whatever a peer sends, a malformed table is a ProtocolError (never a TypeError or
    a struct/msgpack error escaping to the caller)."""
    n = len(payload)
    if n < TABLE_LEN.size:
        raise ProtocolError(f"a link message from {who} too short for its frame table")
    (tlen,) = TABLE_LEN.unpack_from(payload, 0)
    start = TABLE_LEN.size
    if tlen > n - start:
        raise ProtocolError(f"a link message from {who} announces a table past its end")
    try:
        table = msgpack.unpackb(bytes(payload[start : start + tlen]))
    except (ValueError, TypeError, msgpack.UnpackException) as exc:
        raise ProtocolError(f"an undecodable frame table from {who}: {exc}") from None
    if not isinstance(table, dict) or not isinstance(table.get("f"), list):
        raise ProtocolError(f"a frame table from {who} is not a table")
    meta = table.get("m")
    if not isinstance(meta, dict):
        raise ProtocolError(f"a frame table from {who} carries no metadata table")
    frames, off = [], start + tlen
    for entry in table["f"]:
        if (
            not (isinstance(entry, list) and len(entry) == 2 and isinstance(entry[0], str))
            or entry[0] not in _DTYPES
        ):
            raise ProtocolError(f"bad frame table from {who}")
        nbytes = entry[1]
        if not isinstance(nbytes, int) or not 0 <= nbytes <= n - off:
            raise ProtocolError(f"bad frame table from {who}")
        frames.append((entry[0], off, nbytes))
        off += nbytes
    return meta, frames


def _table(meta: dict | None, frames) -> bytes:
    """The msgpack frame table of a message (also what the native path sends, see
    :func:`native_table`)."""
    return msgpack.packb(
        {
            "m": meta or {},
            "f": [
                [str(f.dtype).removeprefix("torch."), f.numel() * f.element_size()] for f in frames
            ],
        }
    )


def native_table(hidden: int, rows: int = 1) -> bytes:
    """The table of a DATA/RESULT message carrying a (1, rows, hidden) float32 activation (one
    token, or a batch of ``rows`` sequences' tokens) with no codec: fixed per shape, so a native
    implementation of this link (the compiled decode step, ``edge/quant/csrc/decode.cpp``) can
    send and check it byte for byte."""
    frame = torch.empty(rows * hidden, dtype=torch.float32)
    return _table({"shape": [1, rows, hidden]}, [frame])


# Linux's TCP_RTO_MIN_US socket option (6.15+; absent from the socket module): the floor of the
# retransmission timeout, and what a tail-loss probe adds to 2 RTT when one packet is unacked.
TCP_RTO_MIN_US = 45
# This link's floor (µs). The kernel's default (200 ms, net.ipv4.tcp_rto_min_us) is made for the
# internet at large; here a message is a few packets, so losing its last one (0.5 % of packets on
# the emulated Wi-Fi) waited for 2 RTT + 200 ms, stalling every step in flight behind it on the
# one connection. The round trip still sets the timeout above the floor (srtt + 4 rttvar).
RTO_MIN_US = 5000


def low_rto(sock: socket.socket, floor_us: int = RTO_MIN_US) -> bool:
    """Lower ``sock``'s retransmission-timeout floor to ``floor_us`` (rounded up to the
    kernel's tick); False where the kernel has no such option (older Linux, other systems:
    the system-wide floor stays, e.g. ``ip route ... rto_min``)."""
    try:
        sock.setsockopt(socket.IPPROTO_TCP, TCP_RTO_MIN_US, floor_us)
    except OSError:
        return False
    return True


class _Conn:
    """One framed TCP connection; every error becomes PeerLost / TransportTimeout.

    ``spin_s``: before blocking in the kernel, poll the socket for up to this long (yielding
    the core on every miss, so a core shared with another process is not starved). A decode
    step's all-reduce answer usually arrives within a millisecond; a thread that went to sleep
    in ``recv`` pays the wake-up of an idle core on top (tens to hundreds of µs on a VM), 64
    times per token. A device spends that time waiting anyway, so polling costs it no work,
    only power; 0 turns it off.
    """

    def __init__(self, sock: socket.socket, who: str, spin_s: float = 0.0) -> None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        low_rto(sock)
        self.sock, self.who, self.spin_s = sock, who, spin_s
        self.sent = self.received = 0

    def send(
        self,
        kind: int,
        seq: int,
        frames: Sequence[torch.Tensor] = (),
        meta: dict | None = None,
        timeout: float | None = None,
    ) -> None:
        table = _table(meta, frames)
        body = [TABLE_LEN.pack(len(table)), table] + [
            f.numpy().tobytes()
            if f.dtype != torch.bfloat16
            else f.view(torch.int16).numpy().tobytes()
            for f in frames
        ]
        payload = b"".join(body)
        try:
            self.sock.settimeout(timeout)
            self.sock.sendall(HEADER.pack(MAGIC, VERSION, kind, 0, seq, len(payload)) + payload)
        except socket.timeout:
            raise TransportTimeout(f"send to {self.who} timed out after {timeout}s") from None
        except OSError as exc:
            raise PeerLost(f"link to {self.who} broke: {exc}", peers=(self.who,)) from None
        self.sent += sum(f.numel() * f.element_size() for f in frames)  # tensor payload only

    def _read(self, n: int, timeout: float | None) -> bytearray:
        buf = bytearray(n)
        view, got = memoryview(buf), 0
        spinning = self.spin_s > 0 and n > 0
        if spinning:
            self.sock.setblocking(False)
            end = time.perf_counter() + self.spin_s
        try:
            while got < n:
                try:
                    k = self.sock.recv_into(view[got:])
                except BlockingIOError:  # only while spinning: the socket is non-blocking
                    if time.perf_counter() <= end:
                        os.sched_yield()
                    else:  # spun long enough: sleep in the kernel, under the deadline
                        self.sock.settimeout(timeout)
                        spinning = False
                    continue
                if k == 0:
                    raise PeerLost(f"{self.who} closed the link", peers=(self.who,))
                got += k
        finally:
            if spinning:
                self.sock.settimeout(timeout)
        return buf

    def recv(self, timeout: float | None) -> tuple[int, int, list[torch.Tensor], dict]:
        try:
            self.sock.settimeout(timeout)
            magic, ver, kind, _, seq, n = HEADER.unpack(self._read(HEADER.size, timeout))
            if magic != MAGIC or ver != VERSION or n > MAX_PAYLOAD:
                raise ProtocolError(f"bad link header from {self.who} (magic {magic!r}, v{ver})")
            payload = self._read(n, timeout)
        except socket.timeout:
            raise TransportTimeout(f"no message from {self.who} within {timeout}s") from None
        except OSError as exc:
            raise PeerLost(f"link to {self.who} broke: {exc}", peers=(self.who,)) from None
        meta, table = _parse_table(payload, self.who)
        frames = []
        for dname, off, nbytes in table:
            raw = (
                torch.frombuffer(payload, dtype=torch.uint8, offset=off, count=nbytes)
                if nbytes
                else torch.empty(0, dtype=torch.uint8)
            )
            try:
                frames.append(raw.view(_DTYPES[dname]))
            except RuntimeError:  # a byte count that is not a whole number of elements
                raise ProtocolError(f"bad frame table from {self.who}") from None
            self.received += nbytes
        return kind, seq, frames, meta

    def read_hello(self, deadline: float) -> tuple[int, str]:
        """A new connection's HELLO as ``(slot, secret)``, read by the monotonic ``deadline``.
        Nothing is trusted before the length check: a HELLO announcing more than
        ``MAX_HELLO`` bytes is refused without reading (or allocating) it."""
        buf = bytearray(HEADER.size + MAX_HELLO)
        got = self._read_by(buf, 0, HEADER.size, deadline)
        magic, ver, kind, _, _, n = HEADER.unpack_from(buf, 0)
        if magic != MAGIC or ver != VERSION or kind != HELLO:
            raise ProtocolError(f"{self.who} did not open with a link HELLO (magic {magic!r})")
        if n > MAX_HELLO:
            raise ProtocolError(f"{self.who} announced a {n}-byte HELLO (at most {MAX_HELLO})")
        need = HEADER.size + n
        got = self._read_by(buf, got, need, deadline)
        meta, _ = _parse_table(buf[HEADER.size : need], self.who)
        slot, secret = meta.get("slot"), meta.get("secret")
        if type(slot) is not int or not 0 <= slot < 1 << 16 or not isinstance(secret, str):
            raise ProtocolError(f"a HELLO from {self.who} without a valid slot and secret")
        return slot, secret

    def _read_by(self, buf: bytearray, got: int, need: int, deadline: float) -> int:
        view = memoryview(buf)
        try:
            while got < need:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise socket.timeout
                self.sock.settimeout(left)
                k = self.sock.recv_into(view[got:need])
                if k == 0:
                    raise PeerLost(f"{self.who} closed the link", peers=(self.who,))
                got += k
        except socket.timeout:
            raise ProtocolError(f"{self.who} did not complete its HELLO in time") from None
        except OSError as exc:
            raise PeerLost(f"link to {self.who} broke: {exc}", peers=(self.who,)) from None
        return got

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass


def _shaped(frames: list[torch.Tensor], meta: dict, what: str) -> tuple[list[torch.Tensor], dict]:
    """A CMD message's frames in the shapes its sender listed (``_shapes``)."""
    shapes = meta.pop("_shapes", None)
    if not isinstance(shapes, list) or len(shapes) != len(frames):
        raise ProtocolError(f"{what} without its frame shapes")
    try:
        return [f.view(shape) for f, shape in zip(frames, shapes)], meta
    except (RuntimeError, TypeError):
        raise ProtocolError(f"{what}'s frames do not match their shapes {shapes}") from None


class StarHub:
    """The master's end: sums the workers' partial outputs and sends back the result."""

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        spin_s: float = 0.0,
        hello_timeout: float = HELLO_TIMEOUT_S,
    ) -> None:
        self._srv = socket.create_server((host, port))
        self.spin_s = spin_s
        self.hello_timeout = hello_timeout  # per connection, see starlink_wire.HELLO_TIMEOUT_S
        self.port = self._srv.getsockname()[1]
        # Handed to workers over the (authenticated) communicator; a connection that does not
        # present it is dropped, so a stranger on the LAN cannot take a slot. (No encryption:
        # activations travel in the clear, like TPI-LLM's and distributed-llama's.)
        self.secret = secrets.token_hex(16)
        self._conns: dict[int, _Conn] = {}  # slot -> connection
        self._pending: dict[int, _Conn] = {}
        self._seq = 0
        self.native_seconds = 0.0  # inside natively driven all-reduces (see native_done)
        self._lock = threading.Lock()

    def accept(self, slot: int, timeout: float) -> None:
        """Wait up to ``timeout`` seconds for the worker holding ``slot`` to connect (other
        slots are kept for later). A connection that does not present a well-formed HELLO with
        the secret within ``hello_timeout`` is logged and dropped; the wait goes on, so a
        stranger can neither crash the caller (the master's recovery thread) nor hold it."""
        deadline = time.monotonic() + timeout
        while slot not in self._pending:
            left = deadline - time.monotonic()
            try:
                if left <= 0:
                    raise socket.timeout
                self._srv.settimeout(left)
                sock, addr = self._srv.accept()
            except socket.timeout:
                raise TransportTimeout(
                    f"worker for slot {slot} did not connect its link within {timeout}s"
                ) from None
            who = f"{addr[0]}:{addr[1]}"
            try:
                conn = _Conn(sock, who)
                got, secret = conn.read_hello(time.monotonic() + min(self.hello_timeout, left))
                if not hmac.compare_digest(secret.encode(), self.secret.encode()):
                    raise AuthError(f"{who} presented a wrong link secret")
            except (ProtocolError, AuthError, PeerLost, OSError) as exc:
                logger.warning("star link: dropped a connection from %s: %s", who, exc)
                sock.close()
                continue
            stale = self._pending.pop(got, None)
            if stale is not None:
                stale.close()
            self._pending[got] = conn
        old = self._conns.pop(slot, None)
        if old is not None:
            old.close()
        self._conns[slot] = self._pending.pop(slot)
        self._conns[slot].spin_s = self.spin_s
        self._conns[slot].who = f"worker slot {slot}"

    def drop(self, slot: int) -> None:
        conn = self._conns.pop(slot, None)
        if conn is not None:
            conn.close()

    def slots(self) -> list[int]:
        return sorted(self._conns)

    def all_reduce(
        self,
        x: torch.Tensor,
        op: str = "sum",
        *,
        codec: Codec | None = None,
        algorithm: str = "star",
        tag: str | None = None,
        timeout: float | None = None,
    ) -> torch.Tensor:
        self._seq += 1
        acc = x.detach().to(torch.float32).clone()
        for slot in sorted(self._conns):  # fixed order: identical sums every time
            kind, seq, frames, meta = self._conns[slot].recv(timeout)
            if kind != DATA or seq != self._seq:
                raise ProtocolError(
                    f"link out of step with slot {slot}: got kind {kind} seq {seq}, "
                    f"expected data seq {self._seq} ({tag})"
                )
            acc += _decode(frames, meta, codec)
        frames, meta = _encode(acc, codec)
        for slot in sorted(self._conns):
            self._conns[slot].send(RESULT, self._seq, frames, meta, timeout)
        out = acc if codec is None else _decode(frames, meta, codec)
        return out.to(x.dtype).reshape(x.shape)

    def command(
        self,
        slot: int,
        meta: dict,
        frames: Sequence[torch.Tensor] = (),
        timeout: float | None = None,
    ) -> None:
        """Send a command (a CMD message) to the worker holding ``slot``; its frames keep their
        dtype (a bf16/fp16 model's activations arrive as the model computes them)."""
        conn = self._conns.get(slot)
        if conn is None:
            raise PeerLost(f"no link to slot {slot}")
        meta = {**meta, "_shapes": [list(f.shape) for f in frames]}
        conn.send(CMD, 0, [f.detach().contiguous() for f in frames], meta, timeout)

    def reply_from(
        self, slot: int, timeout: float | None = None
    ) -> tuple[list[torch.Tensor], dict]:
        """The answer (a CMD message, :meth:`StarSpoke.reply`) of the worker holding ``slot``
        to a command: a pipeline stage's hidden state comes back this way."""
        conn = self._conns.get(slot)
        if conn is None:
            raise PeerLost(f"no link to slot {slot}")
        kind, _, frames, meta = conn.recv(timeout)
        if kind != CMD:
            raise ProtocolError(f"expected a reply from slot {slot}, got message kind {kind}")
        return _shaped(frames, meta, "a reply")

    def native_spec(self, timeout: float | None) -> tuple:
        """What a native implementation needs for float32 all-reduces on this link:
        ``(role=1, fds in slot order, seq, timeout | -1, spin_s)``; report back with
        :meth:`native_done`."""
        fds = [self._conns[s].sock.fileno() for s in sorted(self._conns)]
        return (1, fds, self._seq, -1.0 if timeout is None else float(timeout), self.spin_s)

    def native_done(self, seq: int, sent: int, received: int, seconds: float = 0.0) -> None:
        """Account for all-reduces a native implementation ran (sequence, bytes, and the time
        spent inside them: link plus waiting for the slowest device)."""
        self._seq = int(seq)
        self.native_seconds += seconds
        conns = [self._conns[s] for s in sorted(self._conns)]
        if conns:  # per-connection split is not tracked natively: spread evenly
            for c in conns:
                c.sent += sent // len(conns)
                c.received += received // len(conns)

    def abort(self) -> None:
        """Wake workers blocked in an all-reduce of a forward the master gave up on."""
        for conn in list(self._conns.values()):
            try:
                conn.send(ABORT, 0, timeout=1.0)
            except (PeerLost, TransportTimeout):
                pass

    def sync_send(self, timeout: float) -> None:
        """Start a new sequence on every link: send the SYNC marker. Each worker reads up to
        it (skipping stale ABORT/RESULT) and answers with its own, see :meth:`sync_wait`."""
        self._seq = 0
        for conn in self._conns.values():
            conn.send(SYNC, 0, timeout=timeout)

    def sync_wait(self, timeout: float) -> None:
        """Read every worker's SYNC answer, skipping partial sums of an aborted forward."""
        for slot, conn in self._conns.items():
            while True:
                kind, _, _, _ = conn.recv(timeout)
                if kind == SYNC:
                    break
                if kind != DATA:
                    raise ProtocolError(f"unexpected link message kind {kind} from slot {slot}")

    def stats(self) -> OpStats:
        return OpStats(
            sum(c.sent for c in self._conns.values()), sum(c.received for c in self._conns.values())
        )

    def close(self) -> None:
        for c in list(self._conns.values()) + list(self._pending.values()):
            c.close()
        self._srv.close()


class StarSpoke:
    """A worker's end: sends its partial output, receives the sum."""

    def __init__(
        self,
        host: str,
        port: int,
        slot: int,
        timeout: float,
        secret: str = "",
        *,
        spin_s: float = 0.0,
    ) -> None:
        try:
            sock = socket.create_connection((host, port), timeout=timeout)
        except OSError as exc:
            raise PeerLost(f"cannot open the link to the master at {host}:{port}: {exc}") from None
        self._conn = _Conn(sock, f"master {host}:{port}")
        self._conn.send(HELLO, 0, meta={"slot": slot, "secret": secret}, timeout=timeout)
        self._conn.spin_s = spin_s
        self._seq = 0
        self.native_seconds = 0.0

    def all_reduce(
        self,
        x: torch.Tensor,
        op: str = "sum",
        *,
        codec: Codec | None = None,
        algorithm: str = "star",
        tag: str | None = None,
        timeout: float | None = None,
    ) -> torch.Tensor:
        self._seq += 1
        frames, meta = _encode(x, codec)
        self._conn.send(DATA, self._seq, frames, meta, timeout)
        kind, seq, frames, meta = self._conn.recv(timeout)
        if kind == ABORT:
            raise PeerLost("the master aborted this forward (a device failed)")
        if kind != RESULT or seq != self._seq:
            raise ProtocolError(
                f"link out of step: got kind {kind} seq {seq}, expected result "
                f"seq {self._seq} ({tag})"
            )
        return _decode(frames, meta, codec).to(x.dtype).reshape(x.shape)

    def native_spec(self, timeout: float | None) -> tuple:
        """See :meth:`StarHub.native_spec` (role 2: one link, to the master)."""
        return (
            2,
            [self._conn.sock.fileno()],
            self._seq,
            -1.0 if timeout is None else float(timeout),
            self._conn.spin_s,
        )

    def native_done(self, seq: int, sent: int, received: int, seconds: float = 0.0) -> None:
        self._seq = int(seq)
        self.native_seconds += seconds
        self._conn.sent += sent
        self._conn.received += received

    def next_command(self, timeout: float | None) -> tuple[list[torch.Tensor], dict]:
        """Wait for the master's next command (see :meth:`StarHub.command`); an ABORT (the
        master gave up on the cluster) raises PeerLost like it does inside an all-reduce."""
        kind, _, frames, meta = self._conn.recv(timeout)
        if kind == ABORT:
            raise PeerLost("the master aborted (a device failed)")
        if kind != CMD:
            raise ProtocolError(f"expected a command on the link, got message kind {kind}")
        return _shaped(frames, meta, "a link command")

    def reply(self, meta: dict, frames: Sequence[torch.Tensor], timeout: float | None) -> None:
        """Answer the master's command (read by :meth:`StarHub.reply_from`)."""
        meta = {**meta, "_shapes": [list(f.shape) for f in frames]}
        self._conn.send(CMD, 0, [f.detach().contiguous() for f in frames], meta, timeout)

    def resync(self, timeout: float) -> None:
        """Skip stale ABORTs up to the master's SYNC marker; restart the sequence."""
        while True:
            kind, _, _, _ = self._conn.recv(timeout)
            if kind == SYNC:
                self._seq = 0
                self._conn.send(SYNC, 0, timeout=timeout)
                return
            if kind not in (ABORT, RESULT):
                raise ProtocolError(f"unexpected link message kind {kind} while resyncing")

    def stats(self) -> OpStats:
        return OpStats(self._conn.sent, self._conn.received)

    def close(self) -> None:
        self._conn.close()


__all__ = ["StarHub", "StarSpoke", "native_table"]
