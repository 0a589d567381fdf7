"""A peer's message is bounded frame by frame before its frames are held (issue 25).

Before, the data and coordinator sockets read whole messages with ``recv_multipart`` and only then
compared the frame count with the header: one message of a million empty frames (~2 MB on the
wire) held 253 MiB and stalled the reactor for 17 s.
"""

from __future__ import annotations

import tracemalloc

import pytest
import torch
import zmq

from lowband.errors import ProtocolError
from transport import wire
from transport.coordinator import Coordinator, CoordinatorConfig
from transport.wire import MsgType

pytestmark = [pytest.mark.security, pytest.mark.timeout(120)]

FLOOD = 200_000  # empty frames in the forged message


@pytest.fixture
def pair():
    ctx = zmq.Context()
    a, b = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    b.bind("inproc://bounds")
    a.connect("inproc://bounds")
    yield a, b
    a.close(0)
    b.close(0)
    ctx.term()


def _poll(sock: zmq.Socket) -> None:
    assert sock.poll(10_000), "nothing arrived"


def test_an_oversized_message_is_dropped_without_holding_its_frames(pair):
    a, b = pair
    head = wire.pack(MsgType.CHUNK, {"e": 1})[0]
    a.send_multipart([head, *([b""] * FLOOD)], copy=True)
    a.send_multipart(wire.pack(MsgType.CHUNK, {"e": 2}, [b"ok"]))
    _poll(b)
    tracemalloc.start()
    try:
        got = wire.recv_bounded(b, copy=False, max_frames=wire.MAX_PAYLOAD_FRAMES + 1)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert got is None
    # recv_multipart would hold FLOOD zmq.Frame objects (tens of MiB of Python objects)
    assert peak < 2 << 20, f"{peak} bytes held while dropping the message"
    _poll(b)
    nxt = wire.recv_bounded(b, copy=False, max_frames=wire.MAX_PAYLOAD_FRAMES + 1)
    msg = wire.unpack(nxt, max_payload_bytes=1 << 20)
    assert msg.meta == {"e": 2} and bytes(msg.payload[0]) == b"ok"


def test_a_message_within_the_limit_is_read_whole(pair):
    a, b = pair
    payload = [bytes([i % 256]) * 3 for i in range(wire.MAX_PAYLOAD_FRAMES)]
    a.send_multipart(wire.pack(MsgType.CHUNK, {"e": 1}, payload))
    _poll(b)
    frames = wire.recv_bounded(b, copy=True, max_frames=wire.MAX_PAYLOAD_FRAMES + 1)
    msg = wire.unpack(frames, max_payload_bytes=1 << 20)
    assert [bytes(p) for p in msg.payload] == payload


def test_unpack_refuses_a_header_claiming_too_many_frames():
    head = wire.pack(MsgType.CHUNK, {"e": 1}, [b""] * (wire.MAX_PAYLOAD_FRAMES + 1))
    with pytest.raises(ProtocolError, match="frames"):
        wire.unpack(head, max_payload_bytes=1 << 20)


def test_a_sender_splits_many_small_tensors_into_parts_within_the_limit():
    from transport import messages

    n = wire.MAX_PAYLOAD_FRAMES * 2 + 5
    tensors = [torch.full((1,), float(i)) for i in range(n)]
    sent: list[int] = []

    class _Op:
        def meta(self, **kw):
            return kw

        def send(self, host, dst, mtype, meta, payload, stripe, track):
            sent.append(len(payload))

    messages.post_message(_Op(), None, 1, tensors, None, chunk_bytes=4 << 20)
    assert sum(sent) == n and max(sent) <= wire.MAX_PAYLOAD_FRAMES and len(sent) == 3


def test_the_coordinator_survives_a_flood_message_and_still_registers_peers():
    from transport.zmq_comm import ZmqConfig, connect

    coord = Coordinator(CoordinatorConfig(bind="tcp://127.0.0.1:0")).start()
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    try:
        s.connect(coord.address)
        head = wire.pack(MsgType.REGISTER, {"p": "x"})[0]
        s.send_multipart([head, *([b""] * FLOOD)])
        comm = connect(coord.address, ZmqConfig(bind_host="127.0.0.1", register_timeout=20.0))
        try:
            assert comm.quorum(timeout=20).world_size == 1
        finally:
            comm.close()
    finally:
        s.close(0)
        ctx.term()
        coord.stop()


# ---- a peer's data socket, end to end: the victim's memory ---------------------------------------
MILLION = 1_000_000  # empty frames in one message: ~2 MB on the wire

SENDER = """
import sys, zmq
from transport import wire
from transport.wire import MsgType
ctx = zmq.Context()
s = ctx.socket(zmq.PUSH)
s.sndhwm = 0
s.connect(sys.argv[1])
head = wire.pack(MsgType.CHUNK, {"e": 0, "o": "x", "p": "y", "k": "all_reduce"})[0]
s.send_multipart([head, *([b""] * int(sys.argv[2]))])
s.close(linger=60_000)
ctx.term()
"""


def test_a_million_frame_message_to_a_data_socket_holds_bounded_memory() -> None:
    """The finding as reported: one message of a million empty frames sent to a peer's data
    socket held 253 MiB and stalled its reactor for 17 s. The sender runs in its own process, so
    the RSS sampled here during the flood is the victim's alone."""
    import subprocess
    import threading
    import time

    import psutil

    from tests.conftest import PY, run_ranks
    from transport.launch import local_group
    from transport.zmq_comm import ZmqConfig

    cfg = ZmqConfig(bind_host="127.0.0.1", connections=1, timeout=30.0, same_host="off")
    with local_group(2, cfg) as (_, comms):
        victim = comms[1]
        me = psutil.Process()
        base, peak, stop = me.memory_info().rss, [0], threading.Event()

        def sample() -> None:
            while not stop.is_set():
                peak[0] = max(peak[0], me.memory_info().rss)
                time.sleep(0.005)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        bad0 = victim.bad_messages
        try:
            subprocess.run(
                [PY, "-c", SENDER, victim.address, str(MILLION)], check=True, timeout=120
            )
            deadline = time.monotonic() + 60
            while victim.bad_messages == bad0 and time.monotonic() < deadline:
                time.sleep(0.05)
        finally:
            stop.set()
            sampler.join(5)
        assert victim.bad_messages == bad0 + 1  # dropped, counted
        grown = (peak[0] - base) / 2**20
        # libzmq itself queues the message's million frames (~64 B each) before delivering it;
        # holding them as Python frames as well took 253 MiB
        assert grown < 160, f"victim RSS grew by {grown:.0f} MiB"
        outs = run_ranks([lambda c=c: c.all_reduce(torch.ones(4) * (c.rank + 1)) for c in comms])
        assert all(torch.equal(o, torch.full((4,), 3.0)) for o in outs)
