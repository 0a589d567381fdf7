"""Bounded fuzzing of every parser a stranger's bytes reach (issue 25).

Each parser has one typed error for bad input; anything else escaping (TypeError, KeyError,
struct.error, UnicodeDecodeError, a numpy error) would end the thread that called it: a
transport's receive loop, an edge master's accept, a worker's control loop, a model load. Each
test runs a fixed number of examples (``max_examples``) under the module's pytest timeout, so a
hang fails too; hypothesis keeps no example database here, so a run is reproducible from its
seed alone.
"""

from __future__ import annotations

import dataclasses
import socket
import struct
import time
from pathlib import Path

import gguf
import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from edge.cluster.protocol import MESSAGES, Msg, decode
from edge.formats.gguf import load_gguf
from lowband.errors import ConfigError, PeerLost, ProtocolError
from transport import wire
from transport.starlink import _Conn, _parse_table
from transport.starlink_wire import HEADER, HELLO, MAGIC, MAX_HELLO, TABLE_LEN, VERSION

pytestmark = [pytest.mark.security, pytest.mark.timeout(60)]

FUZZ = settings(
    max_examples=300,
    deadline=None,  # a shared 2-core machine: the pytest timeout bounds the whole run instead
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

# msgpack-able values, nested a little: what a peer can put in a metadata map.
LEAVES = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    # no subnormals: a library built with fast-math may have set flush-to-zero in this process
    | st.floats(allow_nan=True, allow_infinity=True, allow_subnormal=False)
    | st.text(max_size=20)
    | st.binary(max_size=20)
)
VALUES = st.recursive(
    LEAVES,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)


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


@FUZZ
@given(hellos())
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


@FUZZ
@given(st.binary(max_size=96), st.binary(max_size=64))
def test_starlink_frame_table_raises_only_protocol_errors(head, tail) -> None:
    for payload in (head, TABLE_LEN.pack(len(head)) + head + tail):
        try:
            _parse_table(bytearray(payload), "fuzz")
        except ProtocolError:
            pass


# ---- edge control messages: the meta map of every master -> worker message -----------------
@st.composite
def control_metas(draw) -> object:
    if draw(st.integers(0, 4)) == 0:
        return draw(VALUES)  # not even a map, or a map without an op
    cls = draw(st.sampled_from(sorted(MESSAGES.values(), key=lambda c: c.OP)))
    meta: dict = {"op": cls.OP}
    for f in dataclasses.fields(cls):
        if draw(st.integers(0, 5)):  # usually present
            meta[f.name] = draw(
                VALUES | st.integers(-5, 5) | st.lists(st.floats(allow_subnormal=False), max_size=3)
            )
    return meta


@FUZZ
@given(control_metas())
def test_control_decode_raises_only_protocol_errors(meta) -> None:
    try:
        msg = decode(meta)
    except ProtocolError:
        return
    assert isinstance(msg, Msg) and decode(msg.encode()) == msg


# ---- the GGUF reader on truncated and mutated files --------------------------------------------
def _tiny_gguf(path: Path) -> bytes:
    """A one-layer Llama GGUF (hidden 8, 2 heads, vocab 16), written by gguf.GGUFWriter."""
    hidden, ff, vocab, heads = 8, 16, 16, 2
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_context_length(32)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(ff)
    w.add_head_count(heads)
    w.add_head_count_kv(heads)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    rng = np.random.default_rng(0)

    def t(name: str, *shape: int) -> None:  # numpy shape (N, K): GGUF (K, N)
        w.add_tensor(name, rng.standard_normal(shape).astype(np.float32))

    t("token_embd.weight", vocab, hidden)
    t("output_norm.weight", hidden)
    for name, shape in {
        "attn_norm.weight": (hidden,),
        "ffn_norm.weight": (hidden,),
        "attn_q.weight": (hidden, hidden),
        "attn_k.weight": (hidden, hidden),
        "attn_v.weight": (hidden, hidden),
        "attn_output.weight": (hidden, hidden),
        "ffn_gate.weight": (ff, hidden),
        "ffn_up.weight": (ff, hidden),
        "ffn_down.weight": (hidden, ff),
    }.items():
        t(f"blk.0.{name}", *shape)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path.read_bytes()


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> tuple[Path, bytes]:
    d = tmp_path_factory.mktemp("fuzz-gguf")
    data = _tiny_gguf(d / "tiny.gguf")
    load_gguf(d / "tiny.gguf")  # the unmutated file loads: the mutations below start valid
    return d, data


@settings(FUZZ, max_examples=200)
@given(st.data())
def test_gguf_reader_raises_only_config_errors(tiny_gguf, data) -> None:
    d, good = tiny_gguf
    buf = bytearray(good)
    header_end = min(len(buf), 2048)  # where the header and metadata live: mutate there mostly
    for _ in range(data.draw(st.integers(0, 4))):
        hi = header_end if data.draw(st.integers(0, 3)) else len(buf)
        i = data.draw(st.integers(0, hi - 1))
        buf[i] = data.draw(st.sampled_from([0, 0xFF, 0x7F, 0x80, 1]) | st.integers(0, 255))
    if data.draw(st.booleans()):
        buf = buf[: data.draw(st.integers(0, len(buf)))]
    path = d / "mutated.gguf"
    path.write_bytes(bytes(buf))
    try:
        load_gguf(path)
    except ConfigError:
        pass


def test_a_metadata_string_that_is_not_utf8_is_a_config_error(tiny_gguf) -> None:
    """Found by the fuzzer above: the reader decodes strings lazily, so a bad byte in the
    architecture's name surfaced as a UnicodeDecodeError from the header check."""
    d, good = tiny_gguf
    at = good.index(b"llama", good.index(b"general.architecture"))
    buf = bytearray(good)
    buf[at] = 0xFF
    path = d / "bad-utf8.gguf"
    path.write_bytes(bytes(buf))
    with pytest.raises(ConfigError, match="not a readable GGUF"):
        load_gguf(path)
    from edge.source import resolve_model  # what `lowband edge run FILE.gguf` opens first

    with pytest.raises(ConfigError, match="not a readable GGUF"):
        resolve_model(path)
