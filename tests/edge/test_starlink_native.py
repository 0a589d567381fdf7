"""The compiled decode step's star link (edge/quant/csrc/decode.cpp) against the Python one
(transport/starlink.py), byte for byte, over real sockets.

Both ends take the wire format from transport/starlink_wire.py (C++ through the generated
starlink_wire.h); these tests check that the bytes agree, not only that the constants do. The
native side runs through the extension's ``link_all_reduce`` test hook: one all-reduce, exactly
as the decode step runs it between layers.
"""

from __future__ import annotations

import socket
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from edge.quant import kernel as qkernel
from tests.conftest import run_ranks
from transport.starlink import StarHub, StarSpoke, _Conn, native_table
from transport.starlink_wire import (
    ABORT,
    DATA,
    HEADER,
    MAGIC,
    MAX_PAYLOAD,
    RESULT,
    TABLE_LEN,
    VERSION,
)

H = 48


@pytest.fixture(scope="module")
def ext():
    mod = qkernel.load()
    assert mod is not None, qkernel.unavailable_reason()
    return mod


def _vec(seed: int) -> torch.Tensor:
    return torch.randn(1, 1, H, generator=torch.Generator().manual_seed(seed))


def _read_message(sock: socket.socket) -> bytes:
    """One whole message as raw bytes (header + payload), read with the header's own length."""

    def exactly(n: int) -> bytes:
        buf = b""
        while len(buf) < n:
            chunk = sock.recv(n - len(buf))
            assert chunk, "peer closed mid-message"
            buf += chunk
        return buf

    head = exactly(HEADER.size)
    return head + exactly(HEADER.unpack(head)[5])


def _tcp_pair() -> tuple[socket.socket, socket.socket]:
    """Two ends of one loopback TCP connection (the link sets TCP_NODELAY: no Unix sockets)."""
    with socket.create_server(("127.0.0.1", 0)) as srv:
        a = socket.create_connection(srv.getsockname(), timeout=10)
        b, _ = srv.accept()
    b.settimeout(10)
    return a, b


def _python_bytes(kind: int, seq: int, x: torch.Tensor) -> bytes:
    """What the Python link puts on the wire for a float32 activation without a codec (the
    message StarHub/StarSpoke.all_reduce sends), captured from a real socket."""
    a, b = _tcp_pair()
    with a, b:
        _Conn(a, "capture").send(
            kind, seq, [x.to(torch.float32).contiguous()], {"shape": [1, 1, H]}
        )
        return _read_message(b)


def _spec(role: int, fds: list[int], seq: int) -> tuple:
    return (role, fds, seq, 10.0, 0.0, native_table(H))


def test_native_spoke_speaks_the_python_bytes(ext) -> None:
    """C++ sends DATA exactly as Python would; it parses a RESULT Python sent."""
    x, total = _vec(1), _vec(2)
    a, b = _tcp_pair()
    with a, b, ThreadPoolExecutor(1) as pool:
        got = x.clone()
        fut = pool.submit(ext.link_all_reduce, got, _spec(2, [a.fileno()], 6))
        sent = _read_message(b)
        assert sent == _python_bytes(DATA, 7, x)
        assert sent[:4] == MAGIC and sent[4] == VERSION and sent[5] == DATA
        _Conn(b, "hub").send(RESULT, 7, [total], {"shape": [1, 1, H]})
        seq, n_sent, n_received, _ = fut.result(timeout=10)
    assert (seq, n_sent, n_received) == (7, 4 * H, 4 * H)
    assert torch.equal(got, total)


def test_native_hub_speaks_the_python_bytes(ext) -> None:
    """C++ parses DATA that Python sent and answers with the RESULT Python would send."""
    mine, theirs = _vec(3), _vec(4)
    a, b = _tcp_pair()
    with a, b, ThreadPoolExecutor(1) as pool:
        got = mine.clone()
        fut = pool.submit(ext.link_all_reduce, got, _spec(1, [a.fileno()], 41))
        _Conn(b, "hub").send(DATA, 42, [theirs], {"shape": [1, 1, H]})
        answer = _read_message(b)
        seq, _, _, _ = fut.result(timeout=10)
    assert seq == 42
    assert torch.equal(got, mine + theirs)
    assert answer == _python_bytes(RESULT, 42, mine + theirs)
    table = native_table(H)
    assert answer[HEADER.size : HEADER.size + TABLE_LEN.size] == TABLE_LEN.pack(len(table))


def _bad(field: str) -> bytes:
    """A header the native end must refuse, with the payload a DATA/RESULT would carry."""
    payload = TABLE_LEN.pack(len(native_table(H))) + native_table(H) + bytes(4 * H)
    magic, version, n = MAGIC, VERSION, len(payload)
    if field == "magic":
        magic = MAGIC[:3] + b"X"
    elif field == "version":
        version = VERSION + 1
    else:
        n, payload = MAX_PAYLOAD + 1, b""
    return HEADER.pack(magic, version, RESULT, 0, 1, n) + payload


@pytest.mark.parametrize("field", ["magic", "version", "length"])
def test_native_end_refuses_what_python_refuses(ext, field) -> None:
    a, b = _tcp_pair()
    with a, b, ThreadPoolExecutor(1) as pool:
        fut = pool.submit(ext.link_all_reduce, _vec(5), _spec(2, [a.fileno()], 0))
        _read_message(b)
        b.sendall(_bad(field))
        with pytest.raises(RuntimeError, match="^lowband-link:ProtocolError:bad link header"):
            fut.result(timeout=10)


def test_native_spoke_takes_the_python_abort(ext) -> None:
    a, b = _tcp_pair()
    with a, b, ThreadPoolExecutor(1) as pool:
        fut = pool.submit(ext.link_all_reduce, _vec(6), _spec(2, [a.fileno()], 0))
        _read_message(b)
        _Conn(b, "hub").send(ABORT, 0)
        with pytest.raises(RuntimeError, match="^lowband-link:PeerLost:the master aborted"):
            fut.result(timeout=10)


def test_mixed_star_over_tcp(ext) -> None:
    """A native hub, a native spoke and a Python spoke on one star over 127.0.0.1: three
    all-reduces, every rank gets the same bits, the hub's slot-order sum."""
    hub = StarHub("127.0.0.1")
    spokes = [StarSpoke("127.0.0.1", hub.port, s, 10.0, secret=hub.secret) for s in (1, 2)]
    for s in (1, 2):
        hub.accept(s, timeout=10)
    xs = [[_vec(10 * k + r) for r in range(3)] for k in range(3)]

    def native(link, r: int):
        def body():
            outs = []
            for k in range(3):
                x = xs[k][r].clone()
                link.native_done(
                    *ext.link_all_reduce(x, (*link.native_spec(10.0), native_table(H)))
                )
                outs.append(x)
            return outs

        return body

    def python():
        return [spokes[1].all_reduce(xs[k][2], timeout=10) for k in range(3)]

    try:
        outs = run_ranks([native(hub, 0), native(spokes[0], 1), python], timeout=60)
    finally:
        for s in spokes:
            s.close()
        hub.close()
    for k in range(3):
        want = xs[k][0].clone()
        want += xs[k][1]
        want += xs[k][2]
        for r in range(3):
            assert torch.equal(outs[r][k], want), (k, r)
    assert hub._seq == spokes[0]._seq == spokes[1]._seq == 3
    assert spokes[0].stats().bytes_sent == spokes[1].stats().bytes_sent == 3 * 4 * H
