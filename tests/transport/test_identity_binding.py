"""Control messages are bound to the authenticated identity (issue 25): under CURVE a peer is
the public key its connection proved it holds, not the id it writes. A stranger with a fresh
CURVE key (the coordinator admits any key without ``curve_authorized``) that takes a member's
routing id over cannot make it leave, cancel its quorum, suspect a peer or heartbeat for it;
REGISTER must name the connection's own key; the edge master's ids are reserved to the
coordinator's key, so no worker can be made to follow an impostor."""

from __future__ import annotations

import time

import pytest
import torch
import zmq

from lowband.errors import AuthError
from tests.conftest import run_ranks
from transport import wire
from transport.auth import CurveKeys, configure_client
from transport.coordinator import Coordinator, CoordinatorConfig
from transport.launch import connect_all
from transport.wire import MsgType
from transport.zmq_comm import ZmqConfig, connect

pytestmark = [pytest.mark.security, pytest.mark.timeout(120)]


def _peer_config(server: CurveKeys | None, **kw) -> ZmqConfig:
    return ZmqConfig(
        bind_host="127.0.0.1",
        connections=1,
        timeout=20.0,
        register_timeout=10.0,
        curve_server_key=server.public if server is not None else None,
        **kw,
    )


def _stranger(
    ctx: zmq.Context,
    address: str,
    routing_id: str,
    server: CurveKeys | None,
    token: str | None = None,
) -> zmq.Socket:
    """A DEALER that says it is ``routing_id``: under CURVE with a fresh keypair (it passes the
    handshake: no allow-list), under a token with the token (any holder may)."""
    s = ctx.socket(zmq.DEALER)
    s.linger = 0
    s.routing_id = routing_id.encode()
    configure_client(
        s,
        user=routing_id,
        token=token,
        curve=CurveKeys.generate() if server is not None else None,
        server_key=server.public if server is not None else None,
    )
    s.connect(address)
    return s


def _wait(cond, timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.05)
    return cond()


@pytest.mark.parametrize("mode", ["curve", "token", "none"])
def test_control_messages_in_another_peers_name_are_dropped(mode) -> None:
    """Before: the stranger's LEAVE removed the member (and under CURVE its routing-id
    takeover had the member declared lost)."""
    server = CurveKeys.generate() if mode == "curve" else None
    token = "s3cret" if mode == "token" else None
    cfg = CoordinatorConfig(
        bind="tcp://127.0.0.1:0", curve=server, token=token, heartbeat_interval=0.5
    )
    with Coordinator(cfg) as coord:
        comms = connect_all(coord.address, 2, _peer_config(server, token=token))
        ctx = zmq.Context()
        try:
            victim, other = (c.membership.peer_id for c in comms)
            s = _stranger(ctx, coord.address, victim, server, token)
            for mtype, meta in (
                (MsgType.HEARTBEAT, {}),
                (MsgType.SUSPECT, {"peer": other}),
                (MsgType.QUORUM_CANCEL, {}),
                (MsgType.LEAVE, {}),
            ):
                s.send_multipart(wire.pack(mtype, meta))
            assert _wait(lambda: coord.counters["forged"] >= 4), coord.counters
            assert set(coord.members) == {victim, other}
            # the member keeps its replies: the group reduces with the stranger still there
            outs = run_ranks(
                [lambda c=c: c.all_reduce(torch.ones(8) * (c.rank + 1)) for c in comms]
            )
            assert all(torch.equal(o, torch.full((8,), 3.0)) for o in outs)
            time.sleep(1.5)  # three heartbeat intervals: nobody suspected, lost or gone
            assert set(coord.members) == {victim, other}
            assert coord.counters["left"] == 0 and coord.counters["lost"] == 0
            s.close(0)
        finally:
            for c in comms:
                c.close()
            ctx.term()


def test_register_must_name_the_connections_own_key() -> None:
    server = CurveKeys.generate()
    cfg = CoordinatorConfig(bind="tcp://127.0.0.1:0", curve=server)
    with Coordinator(cfg) as coord:
        ctx = zmq.Context()
        try:
            s = _stranger(ctx, coord.address, "claims-another-key", server)
            meta = {
                "addr": "tcp://127.0.0.1:1",
                "signature": "",
                "chunk": 4 << 20,
                "key": CurveKeys.generate().public.decode(),  # not the key it connected with
            }
            s.send_multipart(wire.pack(MsgType.REGISTER, meta))
            assert s.poll(10_000), "no answer to REGISTER"
            msg = wire.unpack(s.recv_multipart(), max_payload_bytes=0)
            assert msg.type == MsgType.REFUSED and msg.meta["kind"] == "auth", msg.meta
            assert "key" in msg.meta["reason"]
            assert coord.members == () and coord.counters["registered"] == 0
            s.close(0)
        finally:
            ctx.term()


def test_reserved_ids_need_the_coordinators_own_key() -> None:
    server = CurveKeys.generate()
    cfg = CoordinatorConfig(bind="tcp://127.0.0.1:0", curve=server, reserved_prefix="edge-master")
    with Coordinator(cfg) as coord:
        with pytest.raises(AuthError, match="reserved"):
            connect(coord.address, _peer_config(server), peer_id="edge-master-impostor")
        comm = connect(coord.address, _peer_config(server, curve=server), peer_id="edge-master-1")
        try:
            assert coord.counters["registered"] == 1 and coord.counters["refused"] == 1
            worker = connect(coord.address, _peer_config(server), peer_id="worker-1")
            worker.close()
            assert coord.counters["registered"] == 2
        finally:
            comm.close()


def test_the_edge_master_holds_the_coordinators_key(tmp_path) -> None:
    """The edge master's coordinator reserves the master's ids under CURVE (workers tell the
    master by its id), and nothing changes without CURVE."""
    from edge.cluster import ClusterConfig
    from edge.cluster.protocol import MASTER_ID_PREFIX
    from edge.launch import ServeMasterConfig, _coordinator_config

    keys = CurveKeys.generate()
    base = dict(model_dir=str(tmp_path), bind="tcp://127.0.0.1:0")
    cfg = _coordinator_config(
        ServeMasterConfig(**base, curve=keys, cluster=ClusterConfig(devices=2))
    )
    assert cfg.reserved_prefix == MASTER_ID_PREFIX and cfg.curve == keys
    cfg = _coordinator_config(ServeMasterConfig(**base, cluster=ClusterConfig(devices=2)))
    assert cfg.reserved_prefix is None


def test_config_checks() -> None:
    from lowband.errors import ConfigError

    with pytest.raises(ConfigError, match="reserved_prefix"):
        CoordinatorConfig(bind="tcp://127.0.0.1:0", reserved_prefix="")


def test_a_member_cannot_send_data_in_another_members_name() -> None:
    """On a data socket under CURVE a message's sender field must be the peer id its
    connection's key belongs to: member 0, with its own key, cannot pass a chunk off as member
    1's to member 2 (which would then apply it as 1's part of a reduction)."""
    server = CurveKeys.generate()
    with Coordinator(CoordinatorConfig(bind="tcp://127.0.0.1:0", curve=server)) as coord:
        comms = connect_all(coord.address, 3, _peer_config(server, same_host="off"))
        try:
            m = comms[2].membership
            a, b, victim = comms[0], comms[1], comms[2]
            ctx = zmq.Context()
            s = ctx.socket(zmq.PUSH)
            s.linger = 0
            configure_client(
                s,
                user=a.peer_id,
                token=None,
                curve=a._reactor.links.keys,  # member 0's own, registered keypair
                server_key=victim._reactor.links.keys.public,
            )
            s.connect(victim.address)
            meta = {"e": m.epoch, "o": "x:1", "k": "all_reduce", "st": 0, "g": 0, "c": 0}
            try:
                bad0 = victim.bad_messages
                s.send_multipart(wire.pack(MsgType.CHUNK, {**meta, "p": b.peer_id}, [b"\0" * 8]))
                assert _wait(lambda: victim.bad_messages == bad0 + 1), "forged sender accepted"
                # the same message in its own name is not refused for its sender
                s.send_multipart(wire.pack(MsgType.CHUNK, {**meta, "p": a.peer_id}, [b"\0" * 8]))
                time.sleep(1.0)
                assert victim.bad_messages == bad0 + 1
            finally:
                s.close(0)
                ctx.term()
            outs = run_ranks([lambda c=c: c.all_reduce(torch.ones(4)) for c in comms])
            assert all(torch.equal(o, torch.full((4,), 3.0)) for o in outs)
        finally:
            for c in comms:
                c.close()
