"""An outsider cannot take a group over by registering (issue 25).

Found on an open coordinator: the first peer to register fixes the run signature for good (a
real peer is then refused as ``IncompatiblePeer``), and a peer that registers and never asks
for a quorum stalls every round (``TransportTimeout``). Each attack is run here against an open
coordinator first, to show it is real, and then against the coordinators the commands run
beyond loopback (CURVE, with or without a token) and on loopback with a token, where the
outsider cannot register and the real peer forms its group. The signature is also released
once the last peer is gone, so not even an authenticated peer holds it after it left.
"""

from __future__ import annotations

import time

import pytest

from lowband.errors import AuthError, IncompatiblePeer, TransportTimeout
from transport.auth import CurveKeys
from transport.coordinator import Coordinator, CoordinatorConfig
from transport.zmq_comm import ZmqConfig, connect

pytestmark = [pytest.mark.security, pytest.mark.timeout(120)]

BASE = dict(
    bind_host="127.0.0.1",
    connections=1,
    chunk_bytes=16 * 1024,
    timeout=10.0,
    register_timeout=5.0,
    same_host="off",
)
SERVER = CurveKeys.generate()
TOKEN = "t0ken-0123456789"

# coordinator config, the real peer's ZmqConfig extras, the outsider's attempts
SECURED = {
    "curve": (
        dict(curve=SERVER),
        dict(curve_server_key=SERVER.public),
        [dict(), dict(curve_server_key=CurveKeys.generate().public)],
    ),
    "curve+token": (
        dict(curve=SERVER, token=TOKEN),
        dict(curve_server_key=SERVER.public, token=TOKEN),
        [dict(), dict(curve_server_key=SERVER.public, token="guess")],
    ),
    "token on loopback": (
        dict(token=TOKEN),
        dict(token=TOKEN),
        [dict(), dict(token="guess")],
    ),
}


def _coordinator(**kw) -> Coordinator:
    return Coordinator(CoordinatorConfig(bind="tcp://127.0.0.1:0", **kw))


def test_on_an_open_coordinator_an_outsider_pins_the_signature_and_stalls_rounds() -> None:
    """The attacks themselves: what an open group allows (and the secured tests rule out)."""
    with _coordinator() as coord:
        squatter = connect(coord.address, ZmqConfig(**BASE), signature="outsider")
        try:
            with pytest.raises(IncompatiblePeer, match="signature"):
                connect(coord.address, ZmqConfig(**BASE), signature="the-run")
        finally:
            squatter.close()
    with _coordinator() as coord:
        staller = connect(coord.address, ZmqConfig(**BASE), signature="the-run")
        real = connect(coord.address, ZmqConfig(**BASE), signature="the-run")
        try:
            with pytest.raises(TransportTimeout):
                real.quorum(timeout=3)  # waits for the staller, which never asks
        finally:
            real.close()
            staller.close()


@pytest.mark.parametrize("mode", sorted(SECURED))
def test_an_outsider_cannot_register_so_cannot_pin_or_stall(mode) -> None:
    coord_kw, real_kw, attempts = SECURED[mode]
    with _coordinator(**coord_kw) as coord:
        for outsider in attempts:
            with pytest.raises(AuthError):
                connect(coord.address, ZmqConfig(**BASE, **outsider), signature="outsider")
        assert coord.alive == ()
        real = connect(coord.address, ZmqConfig(**BASE, **real_kw), signature="the-run")
        try:
            m = real.quorum(timeout=10)  # nobody else registered: no stall
            assert m.world_size == 1 and m.peers == (real.peer_id,)
        finally:
            real.close()


def _wait_empty(coord: Coordinator, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while coord.alive and time.monotonic() < deadline:
        time.sleep(0.05)
    assert coord.alive == ()


def test_the_signature_is_released_when_the_last_peer_is_gone() -> None:
    """Even an authenticated peer holds the run signature (and chunk size) only while it is a
    member: once the group is empty, the next peer sets them again."""
    cfg = ZmqConfig(**BASE, token=TOKEN)
    with _coordinator(token=TOKEN) as coord:
        first = connect(coord.address, cfg, signature="wrong-config")
        try:
            with pytest.raises(IncompatiblePeer, match="signature"):
                connect(coord.address, cfg, signature="the-run")  # while it is a member
        finally:
            first.close()  # leaves
        _wait_empty(coord)
        other_chunk = ZmqConfig(**{**BASE, "chunk_bytes": 32 * 1024}, token=TOKEN)
        real = connect(coord.address, other_chunk, signature="the-run")
        try:
            assert real.quorum(timeout=10).world_size == 1
            with pytest.raises(IncompatiblePeer, match="signature"):
                connect(coord.address, cfg, signature="wrong-config")  # the new group's rule
        finally:
            real.close()
