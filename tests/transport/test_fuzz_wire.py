"""Bad input on the transport's wire formats: the wire parser (tier 1) and live endpoints under
>= 10,000 fuzzed frames (tier 3), and, marked ``security`` (issue 25), bounded hypothesis fuzzing
(tests/fuzzing.py) of ``transport.wire.unpack`` and of the star link's HELLO and frame table."""

from __future__ import annotations

import random
import socket
import struct
import time

import msgpack
import pytest
import torch
import zmq
from hypothesis import example, given
from hypothesis import strategies as st

from lowband.errors import PeerLost, ProtocolError, VersionMismatch
from tests.conftest import run_ranks
from tests.fuzzing import FUZZ, VALUES
from transport import wire
from transport.launch import local_group
from transport.starlink import _Conn, _parse_table
from transport.starlink_wire import HEADER, HELLO, MAGIC, MAX_HELLO, TABLE_LEN, VERSION
from transport.wire import MsgType
from transport.zmq_comm import ZmqConfig

pytestmark = pytest.mark.timeout(120)

FIELDS = [
    "e",
    "o",
    "p",
    "k",
    "st",
    "g",
    "c",
    "n",
    "d",
    "r",
    "a",
    "cn",
    "ph",
    "ci",
    "i",
    "j",
    "t",
    "m",
    "pc",
    "np",
    "cf",
    "cm",
    "root",
    "min_world",
    "addr",
    "signature",
    "peers",
    "epoch",
    "rank",
    "addrs",
    "keys",
    "locals",
    "joined",
    "left",
    "reason",
    "kind",
    "key",
    "token",
]


def _random_value(rng: random.Random, depth: int = 0):
    kind = rng.randrange(9 if depth < 2 else 6)
    if kind == 0:
        return rng.randint(-(2**63), 2**64 - 1)
    if kind == 1:
        return rng.choice([0, 1, -1, 2**31, 2**62, 7])
    if kind == 2:
        return rng.choice(["", "auto:1", "float32", "bfloat16", "x" * 300, "all_reduce", "p2p"])
    if kind == 3:
        return rng.random() * 1e9
    if kind == 4:
        return rng.choice([None, True, False])
    if kind == 5:
        return rng.randbytes(rng.randrange(16))
    if kind == 6:
        return [_random_value(rng, depth + 1) for _ in range(rng.randrange(5))]
    if kind == 7:
        return {rng.choice(FIELDS): _random_value(rng, depth + 1) for _ in range(rng.randrange(5))}
    return [[rng.randrange(-2, 5), rng.randrange(-2, 1 << 20), rng.randrange(-2, 1 << 20)]]


def fuzz_frames(rng: random.Random, sender: str, epoch: int) -> list[bytes]:
    """One hostile message: garbage, a valid header with hostile metadata, or a mutated valid
    message. Operation keys are prefixed ``fuzz`` so later real collectives are never hit."""
    choice = rng.randrange(6)
    if choice == 0:
        return [rng.randbytes(rng.randrange(64))]
    mtype = rng.choice(list(MsgType))
    meta = {k: _random_value(rng) for k in rng.sample(FIELDS, rng.randrange(len(FIELDS)))}
    if choice >= 2:  # plausible routing fields, so the message gets past the envelope checks
        meta.update(
            e=rng.choice([epoch, epoch + 1, 0, 10**6]),
            o=f"fuzz:{rng.randrange(50)}",
            p=rng.choice([sender, "nobody"]),
        )
    payload = [rng.randbytes(rng.randrange(0, 300)) for _ in range(rng.randrange(3))]
    frames = wire.pack(mtype, meta, payload)
    if choice == 3:  # flip bytes in the header or the metadata
        head = bytearray(frames[0])
        for _ in range(rng.randrange(1, 4)):
            head[rng.randrange(len(head))] = rng.randrange(256)
        frames[0] = bytes(head)
    elif choice == 4:  # truncate or drop frames
        frames[0] = frames[0][: rng.randrange(len(frames[0]) + 1)]
        if len(frames) > 1 and rng.random() < 0.5:
            frames.pop()
    elif choice == 5 and rng.random() < 0.5:  # metadata that is msgpack but not a map
        body = msgpack.packb(_random_value(rng))
        frames[0] = (
            wire.HEADER.pack(
                wire.MAGIC,
                wire.PROTOCOL_VERSION,
                int(mtype),
                0,
                len(body),
                len(payload),
                sum(map(len, payload)),
            )
            + body
        )
    return [bytes(f) for f in frames]


# ---- tier 1 -------------------------------------------------------------------------------------
def test_parser_raises_only_protocol_errors_on_20000_hostile_messages():
    rng = random.Random(1234)
    outcomes = {"ok": 0, "protocol": 0}
    for _ in range(20_000):
        frames = fuzz_frames(rng, "peer", 0)
        try:
            wire.unpack(frames, max_payload_bytes=1 << 20)
            outcomes["ok"] += 1
        except ProtocolError:
            outcomes["protocol"] += 1
    assert outcomes["protocol"] > 3000 and outcomes["ok"] > 3000


def test_parser_error_messages_name_the_problem():
    good = wire.pack(MsgType.MSG, {"a": 1}, [b"abcd"])
    with pytest.raises(ProtocolError, match="magic"):
        wire.unpack([b"GET / HTTP/1.1\r\n\r\n" + b"x" * 20], max_payload_bytes=10)
    with pytest.raises(ProtocolError, match="truncated header"):
        wire.unpack([good[0][:10]], max_payload_bytes=10)
    bad_version = bytearray(good[0])
    bad_version[4:6] = (99).to_bytes(2, "little")
    with pytest.raises(VersionMismatch, match="v99.*v1"):
        wire.unpack([bytes(bad_version), good[1]], max_payload_bytes=10)
    with pytest.raises(ProtocolError, match="payload frames"):
        wire.unpack([good[0]], max_payload_bytes=10)
    with pytest.raises(ProtocolError, match="exceeds the limit"):
        wire.unpack(good, max_payload_bytes=3)
    with pytest.raises(ProtocolError, match="metadata"):
        wire.unpack([good[0][:-1], good[1]], max_payload_bytes=10)
    with pytest.raises(ProtocolError, match="missing field 'x'"):
        wire.field({}, "x", int)
    with pytest.raises(ProtocolError, match="must be int"):
        wire.int_field({"x": True}, "x")
    with pytest.raises(ProtocolError, match="unknown dtype"):
        wire.parse_descriptor({"d": "object", "s": [1]}, 100)
    with pytest.raises(ProtocolError, match="exceeds"):
        wire.parse_descriptor({"d": "float32", "s": [1 << 40]}, 1 << 30)


@pytest.mark.parametrize(
    "dtype",
    [
        torch.float32,
        torch.float16,
        torch.bfloat16,
        torch.int8,
        torch.uint8,
        torch.bool,
        torch.int64,
        torch.complex64,
    ],
)
@pytest.mark.parametrize("shape", [(), (0,), (2, 0, 3), (5, 7)])
def test_tensor_bytes_round_trip_exactly(dtype, shape):
    t = (torch.randn(shape) * 50).to(dtype)
    frames = wire.pack(MsgType.MSG, {"t": [wire.describe(t)]}, [wire.tensor_bytes(t)])
    msg = wire.unpack([bytes(f) for f in frames], max_payload_bytes=1 << 20)
    dt, sh, size = wire.parse_descriptor(msg.meta["t"][0], 1 << 20)
    back = wire.tensor_from(msg.payload[0], dt, sh)
    assert back.dtype == dtype and back.shape == t.shape and size == t.numel() * t.element_size()
    assert torch.equal(back, t)


# ---- tier 3: live endpoints ----------------------------------------------------------------------
def _raw_tcp_abuse(endpoint: str) -> list[socket.socket]:
    """Connections that never speak, speak garbage, or stop in the middle of a frame."""
    host, port = endpoint.removeprefix("tcp://").rsplit(":", 1)
    kept = []
    silent = socket.create_connection((host, int(port)), timeout=5)
    kept.append(silent)
    for payload in (
        b"\x00" * 7,  # half a greeting, then gone
        b"GET / HTTP/1.1\r\nHost: x\r\n\r\n",  # not ZMTP at all
        bytes([0xFF] + [0] * 8 + [0x7F]) + b"\x03\x00NULL" + b"\0" * 50,
    ):
        s = socket.create_connection((host, int(port)), timeout=5)
        s.sendall(payload)
        s.close()
    # ZMTP handshake done, then a frame announcing 1 MiB that ends after 10 bytes.
    s = socket.create_connection((host, int(port)), timeout=5)
    s.sendall(
        bytes([0xFF, 0, 0, 0, 0, 0, 0, 0, 1, 0x7F, 3, 0])
        + b"NULL"
        + b"\0" * 16
        + b"\0"
        + b"\0" * 31
    )
    s.sendall(bytes([0x02]) + (1 << 20).to_bytes(8, "big") + b"0123456789")
    s.close()
    return kept


def test_live_peer_and_coordinator_survive_10000_fuzzed_frames():
    cfg = ZmqConfig(
        bind_host="127.0.0.1",
        connections=2,
        chunk_bytes=16 * 1024,
        timeout=20.0,
        max_message_bytes=1 << 20,
        same_host="off",
    )
    with local_group(2, cfg) as (coord, comms):
        victim = comms[0]
        m = victim.membership
        rng = random.Random(99)
        ctx = zmq.Context.instance()
        data = ctx.socket(zmq.PUSH)
        data.connect(victim.address)
        control = ctx.socket(zmq.DEALER)
        control.connect(coord.address)
        kept = _raw_tcp_abuse(victim.address) + _raw_tcp_abuse(coord.address)
        try:
            for i in range(10_000):
                data.send_multipart(fuzz_frames(rng, m.peers[1], m.epoch))
                if i % 4 == 0:
                    control.send_multipart(fuzz_frames(rng, "intruder", m.epoch))
            # Wait until the victim has chewed through the flood (bounded).
            deadline = time.monotonic() + 60
            while victim.bad_messages < 3000 and time.monotonic() < deadline:
                time.sleep(0.1)
            assert victim.bad_messages >= 3000
            assert coord.counters["bad_messages"] >= 300

            # Still correct, still the same group.
            gen = torch.Generator().manual_seed(5)
            xs = [torch.randn(200_000, generator=gen) for _ in range(2)]

            def body(c):
                s = c.all_reduce(xs[c.rank], tag="after", algorithm="ring")
                b = c.broadcast(xs[1] if c.rank == 1 else None, root=1, tag="after-b")
                return s, b

            for s, b in run_ranks([lambda c=c: body(c) for c in comms], timeout=60):
                assert torch.allclose(s, xs[0] + xs[1]) and torch.equal(b, xs[1])
            assert coord.alive == tuple(c.peer_id for c in comms)
            assert all(c._reactor._thread.is_alive() for c in comms)
        finally:
            data.close(0)
            control.close(0)
            for s in kept:
                s.close()


# ---- transport.wire.unpack: a multipart ZeroMQ message ---------------------------------------
def _header(draw_ints: tuple[int, int, int, int, int, int]) -> bytes:
    version, mtype, flags, meta_len, n_frames, payload_len = draw_ints
    return wire.HEADER.pack(wire.MAGIC, version, mtype, flags, meta_len, n_frames, payload_len)


@st.composite
def wire_frames(draw) -> list[bytes]:
    """Mostly near-valid messages (a real header, then mutated), some pure noise."""
    if draw(st.booleans()):
        return draw(st.lists(st.binary(max_size=64), max_size=4))
    meta = msgpack.packb(draw(VALUES), use_bin_type=True)
    payload = draw(st.lists(st.binary(max_size=32), max_size=3))
    mtype = draw(st.sampled_from(sorted(int(t) for t in wire.MsgType)) | st.integers(0, 255))
    fields = (
        draw(st.sampled_from([wire.PROTOCOL_VERSION]) | st.integers(0, 255)),
        mtype,
        draw(st.sampled_from([0]) | st.integers(0, 255)),
        draw(st.sampled_from([len(meta)]) | st.integers(0, 2**32 - 1)),
        draw(st.sampled_from([len(payload)]) | st.integers(0, 2**32 - 1)),
        draw(st.sampled_from([sum(map(len, payload))]) | st.integers(0, 2**63 - 1)),
    )
    try:
        first = bytearray(_header(fields) + meta)
    except struct.error:  # a drawn value outside its header field: noise instead
        first = bytearray(draw(st.binary(max_size=64)))
    for _ in range(draw(st.integers(0, 3))):  # flip a few bytes
        if first:
            first[draw(st.integers(0, len(first) - 1))] = draw(st.integers(0, 255))
    cut = draw(st.integers(0, len(first)))
    return [bytes(first[: len(first) if draw(st.booleans()) else cut]), *payload]


@pytest.mark.security
@pytest.mark.timeout(60)
@FUZZ
@given(wire_frames())
def test_wire_unpack_raises_only_protocol_errors(frames) -> None:
    try:
        wire.unpack(frames, max_payload_bytes=1 << 16, max_meta_bytes=1 << 12)
    except ProtocolError:  # VersionMismatch included
        pass


# ---- the star link's HELLO: the first bytes a stranger sends to an edge master --------------
@st.composite
def hellos(draw) -> bytes:
    if draw(st.booleans()):
        return draw(st.binary(max_size=80))
    if draw(st.booleans()):
        table = msgpack.packb(draw(VALUES))
    else:  # a real table whose metadata is fuzzed
        table = msgpack.packb({"m": draw(VALUES), "f": draw(st.lists(VALUES, max_size=3))})
    payload = TABLE_LEN.pack(len(table) if draw(st.booleans()) else draw(st.integers(0, 2**32 - 1)))
    payload += table + draw(st.binary(max_size=16))
    n = len(payload) if draw(st.booleans()) else draw(st.integers(0, 2 * MAX_HELLO))
    kind = HELLO if draw(st.booleans()) else draw(st.integers(0, 255))
    data = bytearray(HEADER.pack(MAGIC, VERSION, kind, 0, 0, n) + payload)
    for _ in range(draw(st.integers(0, 2))):
        data[draw(st.integers(0, len(data) - 1))] = draw(st.integers(0, 255))
    return bytes(data[: draw(st.integers(0, len(data)))] if draw(st.booleans()) else data)


@pytest.mark.security
@pytest.mark.timeout(60)
@FUZZ
@given(hellos())
# a frame table whose dtype is a list (unhashable): was a TypeError, found by this test in CI
@example(
    data=b"LBSL\x01\x01\x00\x00\x00\x00\x00\x00\x0e\x00\x00\x00\x00\x00\x00\x00\n\x00\x00\x00"
    b"\x82\xa1m\x80\xa1f\x91\x92\x90\xc0"
)
def test_starlink_hello_raises_only_typed_errors(data) -> None:
    a, b = socket.socketpair()
    try:
        a.sendall(data)
        a.close()  # the stranger hangs up after its bytes: a short HELLO is PeerLost, not a wait
        conn = _UnixConn(b)
        try:
            slot, secret = conn.read_hello(time.monotonic() + 5.0)
        except (ProtocolError, PeerLost):
            return
        assert type(slot) is int and 0 <= slot < 1 << 16 and isinstance(secret, str)
    finally:
        b.close()


class _UnixConn(_Conn):
    """A socketpair is AF_UNIX, where TCP_NODELAY does not exist; the reading is the same."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock, self.who, self.spin_s = sock, "fuzz", 0.0
        self.sent = self.received = 0


@pytest.mark.security
@pytest.mark.timeout(60)
@FUZZ
@given(st.binary(max_size=96), st.binary(max_size=64))
def test_starlink_frame_table_raises_only_protocol_errors(head, tail) -> None:
    for payload in (head, TABLE_LEN.pack(len(head)) + head + tail):
        try:
            _parse_table(bytearray(payload), "fuzz")
        except ProtocolError:
            pass
