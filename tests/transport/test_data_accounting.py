"""Every byte a peer's data socket keeps for another peer is counted and bounded (issue 25).

Before: metadata-only messages were not counted against ``max_pending_bytes`` (300 messages of
1 MiB metadata held +600 MiB with 0 bytes counted), messages of far-future epochs were kept and
never pruned, and the parts of a message that came before its header were kept without limit.
"""

from __future__ import annotations

import threading
import time

import psutil
import pytest
import torch
import zmq

from lowband.errors import ProtocolError, TransportTimeout
from tests.conftest import run_ranks
from transport import wire
from transport.config import ZmqConfig
from transport.launch import local_group
from transport.messages import MAX_OPEN_PER_SOURCE, PARTIAL_SLACK, Assembler
from transport.routing import Routing
from transport.wire import MsgType

pytestmark = [pytest.mark.security, pytest.mark.timeout(180)]

MiB = 1 << 20


def _msg(mtype: MsgType, meta: dict, payload: list[bytes] = ()) -> wire.Message:
    return wire.unpack(wire.pack(mtype, meta, list(payload)), max_payload_bytes=1 << 40)


def _routing(max_pending: int) -> tuple[Routing, list[str]]:
    bad: list[str] = []
    cfg = ZmqConfig(bind_host="127.0.0.1", max_pending_bytes=max_pending)
    return Routing(host=None, links=None, config=cfg, peer_id="me", bad=bad.append), bad  # type: ignore[arg-type]


# ---- counting (unit) -------------------------------------------------------------------------


def test_metadata_and_a_per_message_overhead_are_counted() -> None:
    big = _msg(MsgType.MSG, {"e": 0, "o": "x", "p": "a", "m": "m" * MiB})
    empty = _msg(MsgType.MSG, {"e": 0, "o": "y", "p": "a"})
    assert big.held_bytes >= wire.META_EXPANSION * MiB
    assert empty.held_bytes >= wire.MESSAGE_OVERHEAD
    r, bad = _routing(max_pending=64 * MiB)
    r.route(big, 0, "x", 0)  # 80 MiB counted: over the 64 MiB cap, dropped
    assert len(bad) == 1 and "bytes wait" in bad[0]
    kept = 0
    for i in range(100_000):  # empty messages count too: the cap ends the flood
        before = len(bad)
        r.route(_msg(MsgType.MSG, {"e": 0, "o": f"k{i}", "p": "a"}), 0, f"k{i}", 0)
        if len(bad) > before:
            break
        kept += 1
    assert 0 < kept <= 64 * MiB // wire.MESSAGE_OVERHEAD


def test_an_abort_flood_is_counted_with_the_early_messages() -> None:
    r, bad = _routing(max_pending=64 * MiB)
    for i in range(50):
        r.route(
            _msg(MsgType.ABORT, {"e": 0, "o": f"k{i}", "p": "a", "reason": "r" * 50_000}),
            0,
            f"k{i}",
            0,
        )
    assert bad and all("ABORT" in b for b in bad)
    assert r._early_bytes <= 64 * MiB and len(r._aborted) < 50


def test_far_future_epochs_are_refused_while_a_member_and_pruned() -> None:
    r, bad = _routing(max_pending=64 * MiB)
    r.route(_msg(MsgType.MSG, {"e": 6}), 6, "next", 5)  # one epoch ahead: a peer may be
    assert not bad
    r.route(_msg(MsgType.MSG, {"e": 9}), 9, "far", 5)
    assert bad and "epoch 9" in bad[0]
    # a peer out of the group (rejoining) may be sent the epoch it rejoins at, however far
    r.route(_msg(MsgType.MSG, {"e": 40}), 40, "rejoin", 5, member=False)
    assert len(bad) == 1
    r.new_epoch(6)  # the epoch it learns: what was kept beyond 7 goes
    assert set(r._early) == {(6, "next")}
    assert r._early_bytes == r._early[(6, "next")][0].held_bytes


# ---- reassembly (unit) -------------------------------------------------------------------------


class _Pool:
    def __init__(self) -> None:
        self.allocated = 0

    def empty(self, shape, dtype):
        t = torch.empty(shape, dtype=dtype)
        self.allocated += t.numel() * t.element_size()
        return t


def _part(j: int, n: int, index: int = 0) -> wire.Message:
    return _msg(MsgType.MSG_PART, {"i": index, "j": j, "pc": [[0, 0, n]]}, [b"\0" * n])


def _header(nbytes: int, index: int = 0, parts: int = 0) -> wire.Message:
    desc = wire.describe(torch.empty(0, dtype=torch.uint8))
    desc["s"] = [nbytes]
    return _msg(MsgType.MSG, {"i": index, "t": [desc], "m": {}, "pc": [], "np": parts})


def test_parts_before_their_header_are_bounded_per_source() -> None:
    a, pool = Assembler(max_bytes=4 * MiB), _Pool()
    sent = 0
    with pytest.raises(ProtocolError, match="partial messages"):
        for j in range(1000):  # 1000 MiB of headerless parts from rank 1
            a.feed(1, _part(j, MiB), pool)
            sent += 1
    assert sent * MiB <= 4 * MiB + PARTIAL_SLACK
    assert a.held(1) <= a.limit
    a.feed(2, _part(0, MiB), pool)  # another source has its own allowance
    assert a.held(2) > 0


def test_headers_are_charged_before_anything_is_allocated() -> None:
    a, pool = Assembler(max_bytes=16 * MiB), _Pool()
    a.feed(1, _header(12 * MiB, index=0, parts=1), pool)
    with pytest.raises(ProtocolError, match="partial messages"):
        for i in range(1, 20):  # a second, third ... message open at once from rank 1
            a.feed(1, _header(12 * MiB, index=i, parts=1), pool)
    assert pool.allocated <= 16 * MiB + PARTIAL_SLACK
    with pytest.raises(ProtocolError, match="exceeds the limit"):
        a.feed(3, _header(17 * MiB), pool)  # one message over the limit: nothing allocated
    assert pool.allocated <= 16 * MiB + PARTIAL_SLACK


def test_open_messages_per_source_are_capped_and_refusals_leave_no_trace() -> None:
    a, pool = Assembler(max_bytes=1 << 40), _Pool()
    for i in range(MAX_OPEN_PER_SOURCE):
        a.feed(1, _part(0, 1, index=i), pool)
    with pytest.raises(ProtocolError, match="open here already"):
        a.feed(1, _part(0, 1, index=MAX_OPEN_PER_SOURCE), pool)
    b = Assembler(max_bytes=8)
    for i in range(1000):  # malformed first messages under fresh indexes
        with pytest.raises(ProtocolError):
            b.feed(1, _header(9, index=i), pool)
    assert not b.busy and b.held(1) == 0


def test_a_whole_message_releases_its_charge() -> None:
    a, pool = Assembler(max_bytes=4 * MiB), _Pool()
    for _ in range(50):  # far more than the limit in total, one at a time
        assert a.feed(1, _part(0, 2 * MiB), pool) is None  # its part overtook the header
        done = a.feed(1, _header(2 * MiB, parts=1), pool)
        assert done is not None and done[1][0].numel() == 2 * MiB
        assert a.held(1) == 0 and not a.busy


# ---- the victim's memory, end to end ---------------------------------------------------------


def _rss() -> int:
    return psutil.Process().memory_info().rss


def _wait(cond, timeout: float = 60.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.05)
    return cond()


@pytest.fixture
def group():
    cfg = ZmqConfig(
        bind_host="127.0.0.1",
        connections=1,
        timeout=20.0,
        same_host="off",
        max_pending_bytes=64 * MiB,
        max_tensor_bytes=MiB,
    )
    with local_group(2, cfg) as (_, comms):
        ctx = zmq.Context()
        push = ctx.socket(zmq.PUSH)
        push.linger = 0
        push.sndhwm = 0
        push.connect(comms[1].address)
        try:
            yield comms, push
        finally:
            push.close(0)
            ctx.term()


def test_a_flood_of_metadata_only_messages_holds_bounded_memory(group) -> None:
    comms, push = group
    epoch, sender = comms[1].membership.epoch, comms[0].membership.peer_id
    base, bad0 = _rss(), comms[1].bad_messages
    n = 300
    for i in range(n):  # 300 MiB of metadata for operations the victim never starts
        meta = {"e": epoch, "o": f"never{i}", "p": sender, "k": "p2p", "m": "x" * MiB}
        push.send_multipart(wire.pack(MsgType.MSG, meta))
    assert _wait(lambda: comms[1].bad_messages - bad0 >= n - 1), comms[1].bad_messages - bad0
    grown = _rss() - base
    assert grown < 150 * MiB, f"victim RSS grew by {grown / MiB:.0f} MiB"
    # and the far future: refused outright, payload or not
    bad1 = comms[1].bad_messages
    for i in range(20):
        meta = {"e": epoch + 5, "o": f"later{i}", "p": sender, "k": "p2p"}
        push.send_multipart(wire.pack(MsgType.MSG, meta, [b"\0" * MiB]))
    assert _wait(lambda: comms[1].bad_messages - bad1 >= 20)
    outs = run_ranks([lambda c=c: c.all_reduce(torch.ones(4) * (c.rank + 1)) for c in comms])
    assert all(torch.equal(o, torch.full((4,), 3.0)) for o in outs)


def test_headerless_parts_for_a_posted_receive_hold_bounded_memory(group) -> None:
    comms, push = group
    epoch, sender = comms[1].membership.epoch, comms[0].membership.peer_id
    errors: list[BaseException] = []

    def receive() -> None:
        try:
            comms[1].recv(0, tag="x", timeout=15)
        except BaseException as exc:  # noqa: BLE001 (checked below)
            errors.append(exc)

    t = threading.Thread(target=receive)
    t.start()
    time.sleep(0.5)  # the receive is posted
    base, bad0 = _rss(), comms[1].bad_messages
    n = 300
    for j in range(n):  # 300 MiB of parts whose header never comes
        meta = {"e": epoch, "o": "p2p:0>1:x#0", "p": sender, "k": "p2p", "i": 0, "j": j}
        meta["pc"] = [[0, j * MiB, MiB]]
        push.send_multipart(wire.pack(MsgType.MSG_PART, meta, [b"\0" * MiB]))
    limit_parts = (MiB + PARTIAL_SLACK) // MiB
    assert _wait(lambda: comms[1].bad_messages - bad0 >= n - limit_parts)
    grown = _rss() - base
    assert grown < 150 * MiB, f"victim RSS grew by {grown / MiB:.0f} MiB"
    t.join(30)
    assert not t.is_alive() and errors and isinstance(errors[0], TransportTimeout), errors
