"""Peers that cannot be dialled (behind NAT) reach the group through the coordinator's relay.

Loopback tests (no root): a peer that declares itself unreachable, one whose dial-back fails,
``relay="always"``, and the relay's refusals (a stranger, a forged route, a forged sender, a
stolen routing id, a wrong token). The ``netns`` tests build real NAT: sites in namespaces behind
a MASQUERADE router with no way in (transport/links/nat.py), and show the site cannot be dialled
and still all-reduces to the same bytes as everyone else.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Callable

import pytest
import torch
import zmq
from zmq.utils.monitor import recv_monitor_message

from lowband.proc import free_port
from tests.conftest import run_ranks
from transport import relay as relay_wire
from transport import wire
from transport.auth import CurveKeys, control_route
from transport.coordinator import Coordinator, CoordinatorConfig, dial_back
from transport.links import nat
from transport.wire import MsgType
from transport.zmq_comm import ZmqCommunicator, ZmqConfig, connect

pytestmark = pytest.mark.timeout(90)

BASE = dict(
    bind_host="127.0.0.1",
    connections=2,
    chunk_bytes=64 * 1024,
    timeout=15.0,
    register_timeout=10.0,
    same_host="off",
)


def _group(address: str, configs: list[ZmqConfig]) -> list[ZmqCommunicator]:
    """One peer per config (ids p0, p1, ...), first quorum together; returned by peer id."""
    comms: list[ZmqCommunicator | None] = [None] * len(configs)
    errors: list[BaseException] = []

    def one(i: int) -> None:
        try:
            comm = connect(address, configs[i], signature="nat", peer_id=f"p{i}")
            comms[i] = comm
            comm.quorum(min_world=len(configs), timeout=20)
        except BaseException as exc:  # noqa: BLE001 - re-raised below after cleanup
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(len(configs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    made = [c for c in comms if c is not None]
    if errors or len(made) != len(configs):
        for c in made:
            c.close()
        raise errors[0] if errors else TimeoutError("the group did not form")
    return made


def _close(comms: list[ZmqCommunicator]) -> None:
    for c in comms:
        c.close()


def _all_reduce_everywhere(comms: list[ZmqCommunicator], n: int = 300_000) -> list[torch.Tensor]:
    xs = [torch.randn(n, generator=torch.Generator().manual_seed(i)) for i in range(len(comms))]

    def reduce(c: ZmqCommunicator, x: torch.Tensor) -> Callable[[], torch.Tensor]:
        return lambda: c.all_reduce(x.clone(), "sum")

    outs = run_ranks([reduce(c, x) for c, x in zip(comms, xs)])
    tensors = [o for o in outs if isinstance(o, torch.Tensor)]
    assert len(tensors) == len(comms)
    return tensors


# ---- automatic selection -----------------------------------------------------------------------
def test_declared_unreachable_peers_are_relayed_and_the_rest_stays_direct():
    keys = CurveKeys.generate()
    with Coordinator(CoordinatorConfig(bind="tcp://127.0.0.1:0", curve=keys)) as coord:
        cfg = ZmqConfig(**BASE, curve_server_key=keys.public)
        unreachable = ZmqConfig(**BASE, curve_server_key=keys.public, reachable=False)
        comms = _group(coord.address, [unreachable, unreachable, cfg])
        try:
            assert set(coord.unreachable) == {"p0", "p1"}
            outs = _all_reduce_everywhere(comms)
            assert all(torch.equal(o, outs[0]) for o in outs)
            by_id = {c.peer_id: c for c in comms}
            # links INTO p0 and p1 are relayed; links out of them, and into p2, are direct
            assert by_id["p0"].relayed_peers == ("p1",)
            assert by_id["p1"].relayed_peers == ("p0",)
            assert by_id["p2"].relayed_peers == ("p0", "p1")
            assert by_id["p2"].route(torch.zeros(10)) == "relay"
            assert by_id["p0"].route(torch.zeros(10)) == "relay+tcp"
            stats = coord.relay_stats()
            assert stats["bytes"] > 0 and stats["forged"] == stats["bad"] == 0
            assert not any(pair.endswith(">p2") for pair in stats["pairs"])
            assert all(c.bad_messages == 0 and c.auth_rejections == 0 for c in comms)
        finally:
            _close(comms)


def test_a_peer_whose_dial_back_fails_is_relayed_without_saying_so():
    """The coordinator dials the advertised data address back; nothing listens there (as for a
    site behind NAT advertising its router's address), so the peer is relayed by itself."""
    with Coordinator(CoordinatorConfig(bind="tcp://127.0.0.1:0", probe_timeout=2.0)) as coord:
        closed = free_port()  # nothing listens: the dial-back is refused
        hidden = ZmqConfig(**BASE, advertise_port=closed)
        comms = _group(coord.address, [ZmqConfig(**BASE), hidden, ZmqConfig(**BASE)])
        try:
            assert coord.unreachable == ("p1",)
            outs = _all_reduce_everywhere(comms)
            assert all(torch.equal(o, outs[0]) for o in outs)
            pairs = coord.relay_stats()["pairs"]
            assert pairs and all(pair.endswith(">p1") for pair in pairs)  # only links into p1
            # the probe of the reachable peers was not counted as a failed handshake there
            assert all(c.auth_rejections == 0 for c in comms)
        finally:
            _close(comms)


def test_dial_back_reports_why():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        assert dial_back(f"tcp://127.0.0.1:{s.getsockname()[1]}", 2.0) is None
    assert "Refused" in (dial_back(f"tcp://127.0.0.1:{free_port()}", 2.0) or "")


def test_relay_always_with_a_token_carries_broadcast_and_all_reduce():
    cfg = ZmqConfig(**BASE, token="s3cret", relay="always")
    with Coordinator(CoordinatorConfig(bind="tcp://127.0.0.1:0", token="s3cret")) as coord:
        comms = _group(coord.address, [cfg, cfg, cfg])
        try:
            assert coord.unreachable == ()
            assert all(c.route(torch.zeros(10)) == "relay" for c in comms)
            outs = _all_reduce_everywhere(comms)
            assert all(torch.equal(o, outs[0]) for o in outs)
            state = torch.arange(200_000, dtype=torch.float32)
            got = run_ranks(
                [lambda c=c: c.broadcast(state if c.rank == 0 else None, root=0) for c in comms]
            )
            assert all(torch.equal(g, state) for g in got)
        finally:
            _close(comms)


def test_relay_off_dials_directly_and_says_so(caplog):
    with Coordinator(CoordinatorConfig(bind="tcp://127.0.0.1:0")) as coord:
        # declared unreachable but it can in fact be dialled: with relay=off the others dial it
        off = ZmqConfig(**BASE, relay="off")
        comms = _group(coord.address, [ZmqConfig(**BASE, reachable=False, relay="off"), off])
        try:
            assert all(c.relayed_peers == () for c in comms)
            outs = _all_reduce_everywhere(comms)
            assert torch.equal(outs[0], outs[1])
            assert "has no relay" in caplog.text
        finally:
            _close(comms)


# ---- what the relay refuses --------------------------------------------------------------------
def _relay_endpoint(coord: Coordinator) -> str:
    return coord.relay_address


def _dealer(
    endpoint: str, *, route: bytes, curve: CurveKeys | None, server: bytes | None
) -> tuple[zmq.Socket, int | None]:
    s: zmq.Socket = zmq.Context.instance().socket(zmq.DEALER)
    s.linger = 0
    s.routing_id = route
    if curve is not None and curve.secret is not None and server is not None:
        s.curve_serverkey = server
        s.curve_publickey = curve.public
        s.curve_secretkey = curve.secret
    mon = s.get_monitor_socket(
        zmq.EVENT_HANDSHAKE_SUCCEEDED
        | zmq.EVENT_HANDSHAKE_FAILED_AUTH
        | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
        | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    )
    s.connect(endpoint)
    event = None
    if mon.poll(5000):
        event = recv_monitor_message(mon)["event"]
    s.disable_monitor()
    mon.close(0)
    return s, event


def _chunk_to(victim: ZmqCommunicator, sender: str) -> list[bytes]:
    m = victim.membership
    return relay_wire.wrap(
        victim.peer_id,
        wire.pack(
            MsgType.CHUNK,
            {"e": m.epoch, "o": "auto:1", "p": sender, "k": "all_reduce", "st": 0, "g": 0, "c": 0},
            [b"\0" * 64],
        ),
    )


def test_the_relay_refuses_strangers_forged_routes_and_forged_senders():
    keys = CurveKeys.generate()
    with Coordinator(CoordinatorConfig(bind="tcp://127.0.0.1:0", curve=keys)) as coord:
        mallory_keys = CurveKeys.generate()
        cfg = ZmqConfig(**BASE, curve_server_key=keys.public, reachable=False)
        mal_cfg = ZmqConfig(**BASE, curve_server_key=keys.public, curve=mallory_keys)
        comms = _group(coord.address, [cfg, cfg, mal_cfg])
        victim, honest, mallory = comms
        endpoint = _relay_endpoint(coord)
        opened = []
        handshakes = []
        try:
            # 1. a stranger (a key the coordinator never registered) fails the handshake
            stranger, event = _dealer(
                endpoint,
                route=control_route("stranger"),
                curve=CurveKeys.generate(),
                server=keys.public,
            )
            opened.append(stranger)
            assert event != zmq.EVENT_HANDSHAKE_SUCCEEDED
            # 2. no CURVE at all: refused too
            plain, event = _dealer(endpoint, route=control_route("x"), curve=None, server=None)
            opened.append(plain)
            assert event != zmq.EVENT_HANDSHAKE_SUCCEEDED
            # 3. a member (mallory) posing as the honest peer: its routing id names p1, but it
            #    cannot know p1's secret part, and its key is not p1's
            posing, event = _dealer(
                endpoint, route=control_route("p1"), curve=mallory_keys, server=keys.public
            )
            opened.append(posing)
            assert event == zmq.EVENT_HANDSHAKE_SUCCEEDED
            posing.send_multipart(_chunk_to(victim, "p1"))
            # 4. mallory on its own relay connection, but the message claims to come from p1
            forged = _chunk_to(victim, "p1")
            links = mallory._reactor.links
            mallory._reactor.call(lambda: links.relay.send_multipart(forged))
            deadline = time.monotonic() + 10
            while coord.relay_stats()["forged"] < 2 and time.monotonic() < deadline:
                time.sleep(0.05)
            stats = coord.relay_stats()
            assert stats["forged"] == 2 and stats["messages"] == 0, stats
            # 5. mallory's connection under a p0 routing id did not take p0's traffic over: an
            #    honest all-reduce still reaches the victim, and mallory's socket got nothing
            thief, event = _dealer(
                endpoint, route=control_route("p0"), curve=mallory_keys, server=keys.public
            )
            opened.append(thief)
            handshakes = [posing, thief]
            outs = _all_reduce_everywhere(comms, n=50_000)
            assert all(torch.equal(o, outs[0]) for o in outs)
            for s in handshakes:
                assert not s.poll(200), "the relay handed someone else's traffic over"
            assert victim.bad_messages == 0 and honest.bad_messages == 0
        finally:
            for s in opened:
                s.close(0)
            _close(comms)


def test_the_relay_refuses_a_wrong_token():
    with Coordinator(CoordinatorConfig(bind="tcp://127.0.0.1:0", token="right")) as coord:
        s = zmq.Context.instance().socket(zmq.DEALER)
        s.linger = 0
        s.plain_username = b"p0"
        s.plain_password = b"wrong"
        mon = s.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_HANDSHAKE_FAILED_AUTH)
        try:
            s.connect(coord.relay_address)
            assert mon.poll(5000)
            assert recv_monitor_message(mon)["event"] == zmq.EVENT_HANDSHAKE_FAILED_AUTH
        finally:
            s.disable_monitor()
            mon.close(0)
            s.close(0)


def test_a_relayed_peer_drops_a_relayed_message_naming_another_sender():
    """Defence in depth: even were the relay to vouch for the wrong sender, the receiver
    checks the inner message names the one the envelope names."""
    with Coordinator(CoordinatorConfig(bind="tcp://127.0.0.1:0")) as coord:
        cfg = ZmqConfig(**BASE, reachable=False)
        comms = _group(coord.address, [cfg, ZmqConfig(**BASE)])
        try:
            victim = comms[0]
            inner = wire.pack(
                MsgType.CHUNK,
                {"e": 0, "o": "auto:1", "p": "p1", "k": "all_reduce", "st": 0, "g": 0, "c": 0},
                [b"\0" * 8],
            )
            frames = [wire.pack(MsgType.RELAY, {"from": "someone"})[0], *inner]
            done = threading.Event()
            victim._reactor.call(
                lambda: (
                    victim._reactor._on_relayed([zmq.Frame(f) for f in frames]),
                    done.set(),
                )
            )
            assert done.wait(5)
            assert victim.bad_messages == 1
        finally:
            _close(comms)


def test_relay_limits_are_checked():
    from lowband.errors import ConfigError

    with pytest.raises(ConfigError, match="relay_hwm"):
        CoordinatorConfig(relay_hwm=0)
    with pytest.raises(ConfigError, match="relay_bind"):
        CoordinatorConfig(relay_bind="ipc:///tmp/x")
    with pytest.raises(ConfigError, match="relay"):
        ZmqConfig(relay="sometimes")


# ---- real NAT in network namespaces ------------------------------------------------------------
netns = pytest.mark.skipif(nat.available() is not None, reason=f"netns: {nat.available()}")


def _in(bed: nat.NatTestbed, ns: str, code: str, timeout: float = 20) -> str:
    out = subprocess.run(
        bed.command(ns, [sys.executable, "-c", code]),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


_DIAL = """
import socket, sys
try:
    socket.create_connection(({host!r}, {port}), timeout=2).close()
    print("connected")
except OSError as exc:
    print(type(exc).__name__)
"""


@pytest.mark.netns
@netns
@pytest.mark.timeout(240)
def test_a_site_behind_nat_joins_through_the_relay():
    prefix = f"lt{free_port() % 10000}"
    with nat.NatTestbed(nat.NatConfig(public=2, nat=2, net=190, name=prefix)) as bed:
        port = 29600 + free_port() % 300
        # The NAT site can dial out (and is seen from its router's address) ...
        listener = subprocess.Popen(
            bed.command(
                bed.public[1],
                [
                    sys.executable,
                    "-c",
                    "import socket; s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, "
                    f"socket.SO_REUSEADDR, 1); s.bind(({bed.public_addr(1)!r}, {port})); "
                    "s.listen(); s.settimeout(20); c, a = s.accept(); print(a[0], flush=True)",
                ],
            ),
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            time.sleep(0.5)
            dialled_out = _in(bed, bed.nat[0], _DIAL.format(host=bed.public_addr(1), port=port))
            seen_from = listener.communicate(timeout=20)[0].strip()
        finally:
            if listener.poll() is None:
                listener.kill()
                listener.wait()
        assert dialled_out == "connected" and seen_from == bed.router_addr(0)
        # ... but nobody can dial it: not at its own address, not through its router
        assert _in(bed, bed.public[1], _DIAL.format(host=bed.nat_addr(0), port=port)) != "connected"
        assert (
            _in(bed, bed.public[1], _DIAL.format(host=bed.router_addr(0), port=port)) != "connected"
        )
        assert _in(bed, bed.nat[1], _DIAL.format(host=bed.nat_addr(0), port=port)) != "connected"
        reports = nat.run_group(bed, nat.GroupConfig(size_mb=2, repeats=2), port)
    assert nat.namespaces_left(prefix) == []
    by_id = {r["id"]: r for r in reports}
    assert len({r["hash"] for r in reports}) == 1  # every site holds the same sum
    assert all(r["bad_messages"] == 0 for r in reports)
    coord = by_id["s0"]
    # the coordinator found the NAT sites by its dial-back (they declared nothing)
    assert sorted(coord["unreachable"]) == ["s2", "s3"]
    # public sites reach both NAT sites through the relay; each NAT site reaches the other NAT
    # site through it and dials the public sites itself
    assert by_id["s1"]["relayed_peers"] == ["s2", "s3"]
    assert by_id["s2"]["relayed_peers"] == ["s3"] and by_id["s3"]["relayed_peers"] == ["s2"]
    pairs = coord["relay"]["pairs"]
    assert all(p.split(">")[1] in ("s2", "s3") for p in pairs)
    assert coord["relay"]["bytes"] >= 2 * (2 << 20)  # the ring's chunks into the NAT sites
    assert coord["relay"]["forged"] == 0 and coord["relay"]["bad"] == 0
    assert "cannot be dialled" in coord["log"]


@pytest.mark.netns
@netns
@pytest.mark.timeout(60)
def test_the_nat_testbed_leaves_nothing_behind_on_failure():
    prefix = f"lt{free_port() % 10000}"
    with pytest.raises(RuntimeError, match="boom"):
        with nat.NatTestbed(nat.NatConfig(public=1, nat=1, net=195, name=prefix)):
            assert len(nat.namespaces_left(prefix)) == 4
            raise RuntimeError("boom")
    assert nat.namespaces_left(prefix) == []


@pytest.mark.netns
@pytest.mark.slow
@netns
@pytest.mark.timeout(300)
def test_the_relay_benchmark_runs_tiny():
    from tests.conftest import run_json_module

    out = run_json_module(
        "benchmarks.nat_relay",
        *("--size-mb", "0.25", "--repeats", "1", "--iters", "1", "--net", "175", "--json"),
        timeout=280,
    )
    assert set(out["seconds"]) == {"direct", "nat", "relay_all"}
    assert out["routes"]["direct"] == ["tcp"] * 3
    assert out["routes"]["relay_all"] == ["relay"] * 3
    assert "relay" in out["routes"]["nat"][0]
    assert out["relay_bytes_per_group"]["direct"] == 0 < out["relay_bytes_per_group"]["nat"]


@pytest.mark.netns
@pytest.mark.slow
@netns
@pytest.mark.timeout(300)
def test_diloco_training_with_two_sites_behind_nat_ends_with_equal_hashes(tmp_path):
    """`lowband coordinator` and three `lowband worker`s (CURVE): one public site, two behind
    their own NAT. Nothing is configured for NAT: the dial-back finds the two sites, their
    incoming links go through the relay, and the run ends with one state hash."""
    keys = tmp_path / "keys"
    subprocess.run(
        [sys.executable, "-m", "cli", "keygen", "--out", str(keys)], check=True, timeout=60
    )
    prefix = f"lt{free_port() % 10000}"
    with nat.NatTestbed(nat.NatConfig(public=2, nat=2, net=200, name=prefix)) as bed:
        port = free_port()
        coord_addr = f"tcp://{bed.public_addr(0)}:{port}"
        logs = {name: open(tmp_path / f"{name}.log", "w") for name in ("coord", "w0", "w1", "w2")}
        procs = []
        try:
            procs.append(
                subprocess.Popen(
                    bed.command(
                        bed.public[0],
                        [
                            *(sys.executable, "-m", "cli", "coordinator"),
                            *("--bind", coord_addr, "--heartbeat", "2"),
                            *("--curve-key", str(keys / "lowband.key_secret")),
                        ],
                    ),
                    stdout=logs["coord"],
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            )
            sites = [
                (bed.public[1], bed.public_addr(1)),
                (bed.nat[0], bed.nat_addr(0)),
                (bed.nat[1], bed.nat_addr(1)),
            ]
            for i, (ns, addr) in enumerate(sites):
                procs.append(
                    subprocess.Popen(
                        bed.command(
                            ns,
                            [
                                *(sys.executable, "-m", "cli", "worker"),
                                *("--coordinator", coord_addr, "--bind-host", addr),
                                *("--curve-server-key", str(keys / "lowband.key")),
                                *("--preset", "tiny", "--workers", "3", "--steps", "24"),
                                *("--eval-every", "0", "--id", str(i), "--out", str(tmp_path)),
                                *("--threads", "1", "--register-timeout", "60"),
                            ],
                        ),
                        stdout=logs[f"w{i}"],
                        stderr=subprocess.STDOUT,
                        start_new_session=True,
                    )
                )
            for i, w in enumerate(procs[1:]):
                assert w.wait(240) == 0, (tmp_path / f"w{i}.log").read_text()[-3000:]
        finally:
            for p in procs:
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGKILL)
                    p.wait(10)
            for f in logs.values():
                f.close()
    assert nat.namespaces_left(prefix) == []
    finals = []
    for i in range(3):
        lines = (tmp_path / f"metrics-worker{i}.jsonl").read_text().splitlines()
        finals.append([json.loads(x) for x in lines if '"final"' in x][-1])
    assert all(f["steps"] == 24 for f in finals), finals
    assert len({f["state_hash"] for f in finals}) == 1
    coord_log = (tmp_path / "coord.log").read_text()
    assert coord_log.count("cannot be dialled") == 2, coord_log[-3000:]
    assert coord_log.count(": links into it go through the relay tcp://") == 2
