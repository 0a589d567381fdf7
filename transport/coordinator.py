"""The coordinator: registration, heartbeats, membership epochs, failure detection.

It carries no tensor data. Peers connect a DEALER socket (routing id = peer id) to the
coordinator's ROUTER socket and speak the typed control messages of :mod:`transport.control`:

    peer -> coordinator   REGISTER, HEARTBEAT, QUORUM, QUORUM_CANCEL, LEAVE, SUSPECT
    coordinator -> peer   REGISTERED / REFUSED, HEARTBEAT_ACK, MEMBERSHIP, PEER_LOST

Quorum semantics are those of :class:`transport.loopback.LoopbackGroup` and live in the pure
class :class:`MembershipBook` (unit-tested without sockets): a quorum completes once every live
member of the current view and every live registered newcomer has asked for it and the group has
at least the largest ``min_world`` asked; the epoch increments only when the view changes.

Failure detection: peers send a heartbeat every ``heartbeat_interval / 3``; a peer silent for
``dead_after`` (default two intervals) is *suspected*. The application heartbeat comes from a
Python thread, which a long GIL-holding call (tokenizing a 3 MB prompt, a training step) can
starve, so silence alone is not death: the coordinator's ROUTER socket also runs ZeroMQ's own
ZMTP heartbeats (``ZMQ_HEARTBEAT_IVL/TIMEOUT``), which the peer's libzmq I/O thread answers
without the GIL. A suspected peer is probed (ROUTER_MANDATORY send): while its connection is
alive it stays a member, until ``unresponsive_after`` (a hung process); once the connection is
gone (SIGSTOP: nobody answers the pings; kill -9: the kernel closed it) it is declared lost. A
peer that reports leaving is removed at once. Every remaining peer then gets PEER_LOST and fails
its pending collectives of that epoch. A peer that saw a data connection drop sends SUSPECT; a
suspected peer is probed after one silent interval instead of two.

Identity: a peer's control routing id is its id plus 128 random bits
(:func:`transport.auth.control_route`), told to nobody else, and under CURVE a peer also is the
public key its connection authenticated with (the ZAP handler's User-Id). REGISTER must name that
same key as the peer's data key; every later message in a registered peer's name must come on
its registered route and, under CURVE, from a connection authenticated with its key. Anything
else is dropped and counted (``counters["forged"]``): no peer can leave, cancel a quorum,
suspect or heartbeat in another's name, nor take its replies over (the ROUTER's handover needs
the whole routing id). ``reserved_prefix`` keeps a family of peer ids for the coordinator's
own key (the edge master). Under a shared token (PLAIN) or no authentication the route is the
only proof, and it crosses the network in clear: those modes are for loopback and trusted
networks.

The first peer to register sets the run signature and chunk size that every later peer must
match (else REFUSED ``Refusal.INCOMPATIBLE``); they are released when the last peer is gone.

A peer declared lost is not banned: its next message is answered REFUSED
``Refusal.EXPELLED``, and the peer re-registers under the same id and joins the next quorum
as a newcomer (:mod:`transport.reactor`). A restarted coordinator starts empty; every
peer's heartbeat is then refused the same way and the group re-forms, at an epoch above the
highest one the re-registering peers report.
"""

from __future__ import annotations

import hmac
import logging
import os
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any, cast

import zmq

from lowband.errors import ConfigError, ProtocolError, VersionMismatch
from transport import control, wire
from transport.auth import (
    COORD_DOMAIN,
    RELAY_DOMAIN,
    CurveKeys,
    HandshakeWatch,
    ZapHandler,
    configure_server,
    curve_policy,
    route_peer,
    token_policy,
)
from transport.control import Refusal
from transport.relay import Member, Relay
from transport.wire import MsgType

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class CoordinatorConfig:
    """Where the coordinator listens and how it judges peers."""

    bind: str = "tcp://127.0.0.1:29500"
    """ZeroMQ endpoint to bind; port 0 picks a free port (read it back from ``address``).
    Loopback by default: a coordinator for other machines names its interface (or
    ``tcp://0.0.0.0:PORT``), with CURVE (see :func:`transport.auth.check_exposure`)."""
    heartbeat_interval: float = 1.0
    """Seconds. Peers heartbeat three times per interval; silence for ``dead_after`` is death."""
    dead_after: float | None = None
    """Seconds of silence after which a peer is declared lost; default 2 × heartbeat_interval."""
    token: str | None = None
    """Shared secret every peer must present (ZeroMQ PLAIN, or inside REGISTER under CURVE)."""
    curve: CurveKeys | None = None
    """The coordinator's CURVE keypair; enables encryption of all control traffic."""
    curve_authorized: tuple[bytes, ...] = ()
    """Z85 public keys allowed to connect under CURVE; empty admits any key (then use a token)."""
    max_message_bytes: int = 1 << 20
    """Largest control message accepted (enforced by ZMQ_MAXMSGSIZE and the header check)."""
    reserved_prefix: str | None = None
    """Under CURVE, peer ids starting with this may only be registered by a peer authenticated
    with the coordinator's own public key (``curve``): the process running the coordinator.
    The edge master reserves ``edge-master`` so that workers, who know the master by that id,
    follow only it. No effect without CURVE (nothing to tell peers apart by)."""
    unresponsive_after: float = 60.0
    """Seconds a peer whose connection still answers ZMTP pings (its process runs, its Python
    threads may be starved) may stay silent before it is declared lost anyway (a hung peer).
    A WAN or a phone deployment may raise ``heartbeat_interval``; this bounds a livelock."""
    relay: bool = True
    """Run a relay (:mod:`transport.relay`) for peers that cannot be dialled (behind NAT): the
    data links into such a peer go through this process. Only with a ``tcp://`` bind."""
    relay_bind: str | None = None
    """Endpoint of the relay socket; None: the host of ``bind``, a free port (peers learn it
    when they register). Name a fixed port where a firewall must let it in."""
    relay_max_message_bytes: int = 64 * (1 << 20) + (1 << 16)
    """Largest relayed data message (one frame, and the payload of one message); must cover
    the peers' ``ZmqConfig.chunk_bytes`` plus their metadata."""
    relay_hwm: int = 64
    """Messages the relay queues per connection in each direction: with the frame limit this
    bounds its memory (connections x 2 x relay_hwm x relay_max_message_bytes)."""
    relay_send_timeout: float = 10.0
    """Seconds the relay waits for a destination's full queue before dropping a message."""
    probe_timeout: float = 3.0
    """Seconds the dial-back to a newly registered peer's data address may take. A peer that
    states ``reachable`` is not probed; 0 disables probing (undeclared peers are reachable)."""

    def __post_init__(self) -> None:
        if not self.bind.startswith(("tcp://", "ipc://", "inproc://")):
            raise ConfigError(
                "bind", f"must be a ZeroMQ endpoint like tcp://0.0.0.0:29500, got {self.bind!r}"
            )
        if not 0.01 <= self.heartbeat_interval <= 3600:
            raise ConfigError(
                "heartbeat_interval", f"must be in [0.01, 3600] s, got {self.heartbeat_interval}"
            )
        if self.dead_after is not None and self.dead_after <= self.heartbeat_interval / 3:
            raise ConfigError(
                "dead_after", "must exceed the heartbeat period (heartbeat_interval / 3)"
            )
        if self.token is not None and not self.token:
            raise ConfigError("token", "must be non-empty when given")
        if self.curve is not None and self.curve.secret is None:
            raise ConfigError("curve", "the coordinator needs its secret key")
        if self.curve_authorized and self.curve is None:
            raise ConfigError("curve_authorized", "needs curve (the coordinator's keypair)")
        if self.max_message_bytes < 4096:
            raise ConfigError("max_message_bytes", "must be >= 4096")
        if self.reserved_prefix is not None and not self.reserved_prefix:
            raise ConfigError("reserved_prefix", "must be non-empty when given")
        if self.relay_bind is not None and not self.relay_bind.startswith("tcp://"):
            raise ConfigError("relay_bind", f"must be tcp://HOST:PORT, got {self.relay_bind!r}")
        if not 1 << 16 <= self.relay_max_message_bytes <= 1 << 31:
            raise ConfigError("relay_max_message_bytes", "must be in [64 KiB, 2 GiB]")
        if not 1 <= self.relay_hwm <= 100_000:
            raise ConfigError("relay_hwm", f"must be in [1, 100000], got {self.relay_hwm}")
        if self.relay_send_timeout <= 0:
            raise ConfigError("relay_send_timeout", "must be > 0 seconds")
        if not 0 <= self.probe_timeout <= 60:
            raise ConfigError("probe_timeout", f"must be in [0, 60] s, got {self.probe_timeout}")
        if self.unresponsive_after < (self.dead_after or 2 * self.heartbeat_interval):
            raise ConfigError(
                "unresponsive_after",
                f"must be >= dead_after ({self.dead_after or 2 * self.heartbeat_interval} s)",
            )

    @property
    def silence_limit(self) -> float:
        return self.dead_after if self.dead_after is not None else 2 * self.heartbeat_interval


@dataclass(frozen=True, kw_only=True)
class Liveness:
    """The failure-detection deadlines of one deployment, as the launchers and the command line
    carry them (the coordinator applies them; peers learn the interval when they register).

    A LAN demo wants a lost peer noticed in seconds; a phone on cellular or a WAN site under
    load wants tens of seconds, or healthy peers are expelled and rejoin in a loop."""

    heartbeat_interval: float = 1.0
    """Seconds between heartbeat rounds (peers send three per interval)."""
    dead_after: float | None = None
    """Seconds of silence with a dead connection before a peer is lost; None: 2 × interval."""
    unresponsive_after: float = 60.0
    """Seconds a silent peer with a live connection (a hung process) is kept."""

    def __post_init__(self) -> None:
        self.coordinator()  # the coordinator's own checks, raising ConfigError naming the field

    def coordinator(self, **kw: Any) -> CoordinatorConfig:
        """A :class:`CoordinatorConfig` with these deadlines and ``kw`` (bind, token, ...)."""
        return CoordinatorConfig(
            heartbeat_interval=self.heartbeat_interval,
            dead_after=self.dead_after,
            unresponsive_after=self.unresponsive_after,
            **kw,
        )


# ---- pure quorum logic ---------------------------------------------------------------------------
@dataclass(frozen=True)
class View:
    """What one peer learns when a quorum completes (cf. :class:`lowband.comm.Membership`)."""

    epoch: int
    rank: int
    peers: tuple[str, ...]
    joined: tuple[str, ...]
    left: tuple[str, ...]


@dataclass
class MembershipBook:
    """Membership epochs and quorum rounds, independent of any socket."""

    epoch: int = -1
    view: tuple[str, ...] = ()
    alive: dict[str, int] = field(default_factory=dict)  # peer -> registration order
    arrived: dict[str, int] = field(default_factory=dict)  # peer -> min_world it asked for
    departed: set[str] = field(default_factory=set)  # view members removed since the view formed
    _order: int = 0

    def register(self, pid: str) -> None:
        self.alive[pid] = self._order
        self._order += 1

    def remove(self, pid: str) -> bool:
        """Forget a dead or departed peer; True if it was alive."""
        self.arrived.pop(pid, None)
        if pid in self.view:
            # Remembered even if it registers again before the next round: a peer that was
            # lost and came back is a newcomer (new epoch, state transfer), not a member.
            self.departed.add(pid)
        return self.alive.pop(pid, None) is not None

    def arrive(self, pid: str, min_world: int) -> None:
        if pid in self.alive:
            self.arrived[pid] = min_world

    def cancel(self, pid: str) -> None:
        self.arrived.pop(pid, None)

    def try_complete(self) -> dict[str, View] | None:
        """Complete the round if everyone required is there; returns each participant's view.

        Waiting for every *registered* newcomer (not just those who happen to have arrived)
        makes admission deterministic: a newcomer is in the first quorum after it registered."""
        if not self.arrived:
            return None
        old = set(self.view) - self.departed
        required = [p for p in self.view if p in old and p in self.alive]
        joiners = sorted((p for p in self.alive if p not in old), key=self.alive.__getitem__)
        members = required + joiners
        if any(p not in self.arrived for p in members):
            return None
        if len(members) < max(self.arrived.values(), default=1):
            return None
        new_view = tuple(members)
        if new_view != self.view or self.departed:
            self.epoch += 1
        result: dict[str, View] = {}
        for rank, pid in enumerate(new_view):
            first = pid not in old
            joined = () if first else tuple(p for p in new_view if p not in old)
            left = () if first else tuple(p for p in self.view if p not in old or p not in new_view)
            result[pid] = View(self.epoch, rank, new_view, joined, left)
        self.view = new_view
        self.arrived = {}
        self.departed = set()
        return result


# ---- the server ----------------------------------------------------------------------------------
@dataclass
class _Peer:
    addr: str
    key: bytes | None
    meta: dict[str, Any]
    last_seen: float
    local: list[str] | None = None  # [host key, ipc endpoint] for same-host peers
    suspected_at: float | None = None
    auth: str | None = None  # who its connection authenticated as (ZAP User-Id); None: no auth
    route: bytes = b""  # the routing id it registered from (peer id + random part)
    reachable: bool | None = None  # None: the dial-back has not answered yet


class Coordinator:
    """Runs the control plane in a background thread. Also a context manager."""

    def __init__(self, config: CoordinatorConfig) -> None:
        self.config = config
        self._ctx: zmq.Context | None = None
        self._sock: zmq.Socket | None = None
        self._zap: ZapHandler | None = None
        self._thread: threading.Thread | None = None
        self._watch: HandshakeWatch | None = None
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._book = MembershipBook()
        self._peers: dict[str, _Peer] = {}
        self._signature: str | None = None
        self._layout: str | None = None  # what the first peer said its signature covers
        self._chunk: int | None = None
        self.address = ""
        self.counters = {
            "refused": 0,
            "bad_messages": 0,
            "lost": 0,
            "left": 0,
            "registered": 0,
            "forged": 0,  # messages in a registered peer's name from another identity
        }
        self._relay: Relay | None = None
        # peers removed a moment ago -> (who they were, until when the relay still forwards
        # what they sent before leaving)
        self._gone: dict[str, tuple[Member, float]] = {}
        self.relay_address = ""
        self._probe_fd = -1
        self._probed: list[tuple[str, bytes, str | None]] = []  # pid, route, why not reachable
        self._probing = 0
        self._forged_logged: set[str] = set()  # peer ids whose forgeries were logged (once)
        self._suspected: set[str] = set()  # silent but connected: logged once per silence

    # ---- lifecycle ------------------------------------------------------------------------------
    def start(self) -> "Coordinator":
        cfg = self.config
        self._ctx = zmq.Context()
        if cfg.token is not None or cfg.curve is not None:
            self._zap = ZapHandler(self._ctx)
            if cfg.curve is not None:
                allowed = set(cfg.curve_authorized)
                self._zap.set_policy(
                    COORD_DOMAIN,
                    curve_policy(
                        lambda key: key.decode() if not allowed or key in allowed else None
                    ),
                )
            else:
                assert cfg.token is not None
                self._zap.set_policy(COORD_DOMAIN, token_policy(cfg.token))
        sock = self._ctx.socket(zmq.ROUTER)
        sock.linger = 0
        sock.maxmsgsize = cfg.max_message_bytes
        # A peer that reconnects (its connection timed out while it was paused) takes its
        # routing id over from the dead pipe; refusing it would leave the peer unreachable.
        sock.router_handover = True
        # Sends to a routing id without a connection raise EHOSTUNREACH: that is the probe.
        sock.router_mandatory = True
        # ZMTP heartbeats: libzmq's I/O threads ping and answer, no Python thread involved, so a
        # peer whose interpreter is busy keeps its connection while a stopped or dead one loses it.
        sock.heartbeat_ivl = max(10, int(1000 * cfg.heartbeat_interval / 3))
        sock.heartbeat_timeout = max(20, int(1000 * cfg.silence_limit))
        sock.heartbeat_ttl = max(100, int(1000 * cfg.silence_limit))
        configure_server(sock, domain=COORD_DOMAIN, token=cfg.token, curve=cfg.curve)
        try:
            sock.bind(cfg.bind)
        except zmq.ZMQError as exc:
            sock.close(0)
            self._shutdown_ctx()
            raise ConfigError("bind", f"cannot bind {cfg.bind}: {exc}") from None
        self.address = cast(bytes, sock.get(zmq.LAST_ENDPOINT)).decode()
        self._sock = sock
        self._probe_fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        if cfg.relay and self.address.startswith("tcp://"):
            try:
                self._start_relay()
            except BaseException:
                sock.close(0)
                self._shutdown_ctx()
                raise
        self._thread = threading.Thread(target=self._run, name="lowband-coordinator", daemon=True)
        self._thread.start()
        logger.info(
            "coordinator listening on %s (heartbeat %.2fs, auth: %s)",
            self.address,
            cfg.heartbeat_interval,
            "curve" if cfg.curve else ("token" if cfg.token else "none"),
        )
        return self

    def _start_relay(self) -> None:
        """Bind the relay socket (same mechanism and keys as the coordinator's) and start it."""
        cfg = self.config
        assert self._ctx is not None
        if self._zap is not None:
            if cfg.curve is not None:
                # Only registered peers' keys; a key registering right now is held a moment.
                self._zap.set_policy(
                    RELAY_DOMAIN, curve_policy(self._registered_key, defer_unknown=True)
                )
            else:
                assert cfg.token is not None
                self._zap.set_policy(RELAY_DOMAIN, token_policy(cfg.token))
        sock = self._ctx.socket(zmq.ROUTER)
        sock.linger = 0
        sock.maxmsgsize = cfg.relay_max_message_bytes
        sock.rcvhwm = sock.sndhwm = cfg.relay_hwm
        sock.sndtimeo = int(cfg.relay_send_timeout * 1000)
        sock.router_handover = True
        sock.router_mandatory = True
        configure_server(sock, domain=RELAY_DOMAIN, token=cfg.token, curve=cfg.curve)
        bind = cfg.relay_bind or f"{self.address.rsplit(':', 1)[0]}:0"
        try:
            sock.bind(bind)
        except zmq.ZMQError as exc:
            sock.close(0)
            raise ConfigError("relay_bind", f"cannot bind {bind}: {exc}") from None
        self.relay_address = cast(bytes, sock.get(zmq.LAST_ENDPOINT)).decode()
        self._relay = Relay(
            sock,
            self._relay_member,
            max_message_bytes=cfg.relay_max_message_bytes,
            identity=self._identity,
        )
        self._relay.start()
        logger.info("relay for peers that cannot be dialled on %s", self.relay_address)

    def _registered_key(self, key: bytes) -> str | None:
        with self._lock:
            if any(p.key == key for p in self._peers.values()):
                return key.decode()
        return None

    def _relay_member(self, pid: str, sender: bool) -> Member | None:
        with self._lock:
            peer = self._peers.get(pid)
            if peer is not None:
                return Member(peer.route, peer.auth)
            gone = self._gone.get(pid) if sender else None
            if gone is not None and time.monotonic() < gone[1]:
                return gone[0]
            return None

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5.0)
            self._thread = None
        if self._relay is not None:
            self._relay.stop()
            stats = self._relay.stats()
            if stats["messages"] or stats["forged"] or stats["bad"]:
                logger.info(
                    "relay: forwarded %d messages (%.1f MB); dropped %d forged, %d malformed, "
                    "%d undeliverable",
                    stats["messages"],
                    stats["bytes"] / 1e6,
                    stats["forged"],
                    stats["bad"],
                    stats["undeliverable"],
                )
            self._relay = None
        self._shutdown_ctx()
        if self._probe_fd >= 0:
            os.close(self._probe_fd)
            self._probe_fd = -1

    def _shutdown_ctx(self) -> None:
        if self._zap is not None:
            self._zap.close()
            self._zap = None
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None

    def __enter__(self) -> "Coordinator":
        return self.start() if self._thread is None else self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def wait(self) -> None:
        """Block until stopped (for the CLI)."""
        while self._thread is not None and self._thread.is_alive():
            self._thread.join(0.5)

    # ---- introspection (tests, CLI) ----------------------------------------------------------
    @property
    def epoch(self) -> int:
        with self._lock:
            return self._book.epoch

    @property
    def members(self) -> tuple[str, ...]:
        with self._lock:
            return self._book.view

    @property
    def alive(self) -> tuple[str, ...]:
        with self._lock:
            return tuple(self._book.alive)

    @property
    def unreachable(self) -> tuple[str, ...]:
        """Registered peers that cannot be dialled: links into them go through the relay."""
        with self._lock:
            return tuple(p for p, peer in self._peers.items() if peer.reachable is False)

    def relay_stats(self) -> dict[str, Any]:
        """What the relay forwarded and dropped (empty without a relay)."""
        return self._relay.stats() if self._relay is not None else {}

    @property
    def auth_rejections(self) -> int:
        """Connections refused at the ZeroMQ handshake (bad credentials or wrong mechanism)."""
        watch = self._watch
        return watch.failures if watch is not None else 0

    # ---- loop -----------------------------------------------------------------------------------
    def _run(self) -> None:
        assert self._sock is not None
        sock = self._sock
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        watch = HandshakeWatch(sock, "the coordinator")
        self._watch = watch
        poller.register(watch.socket, zmq.POLLIN)
        poller.register(self._probe_fd, zmq.POLLIN)
        tick = self.config.heartbeat_interval / 6
        next_check = time.monotonic() + tick
        try:
            while not self._stop.is_set():
                ready = dict(poller.poll(max(1, int(1000 * (next_check - time.monotonic())))))
                if watch.socket in ready:
                    watch.drain()
                if self._probe_fd in ready:
                    self._on_probes()
                if sock in ready:
                    for _ in range(256):
                        try:
                            # the peer's routing id, the header, its payload frames
                            frames = wire.recv_bounded(
                                sock, copy=False, max_frames=wire.MAX_PAYLOAD_FRAMES + 2
                            )
                        except zmq.Again:
                            break
                        if frames is None:
                            logger.warning("dropped a message of too many frames")
                            continue
                        self._on_frames(frames)
                now = time.monotonic()
                if now >= next_check:
                    self._expire(now)
                    next_check = now + tick
        except zmq.ContextTerminated:
            pass
        finally:
            sock.disable_monitor()
            watch.close()
            sock.close(0)

    def _send(self, pid: str, msg: control.ControlMsg, route: bytes | None = None) -> bool:
        """Send to ``pid`` (on its registered route, or ``route``: the connection a message
        being answered came on); False when it has no live connection."""
        assert self._sock is not None
        if route is None:
            with self._lock:
                peer = self._peers.get(pid)
            route = peer.route if peer is not None else pid.encode()
        try:
            self._sock.send_multipart([route, *control.pack(msg)], zmq.NOBLOCK)
            return True
        except zmq.Again:
            return True  # connected but its queue is full: alive, just slow
        except zmq.ZMQError as exc:
            if exc.errno == zmq.EHOSTUNREACH:
                return False
            raise

    def _on_frames(self, frames: list[zmq.Frame]) -> None:
        ident = frames[0].bytes
        pid = route_peer(ident)
        try:
            msg = wire.unpack(
                frames[1:], max_payload_bytes=0, max_meta_bytes=self.config.max_message_bytes
            )
        except VersionMismatch as exc:
            self.counters["refused"] += 1
            self._bad(f"refused {pid!r}: {exc}")
            self._send(pid, control.Refused(kind=Refusal.VERSION, reason=str(exc)), ident)
            return
        except ProtocolError as exc:
            self._bad(
                f"dropped a malformed message from {pid!r} ({_peer_address(frames[-1])}): {exc}"
            )
            return
        try:
            self._dispatch(pid, ident, msg, frames[-1], self._identity(frames[-1]))
        except ProtocolError as exc:
            self._bad(f"dropped a {msg.type.name} from {pid!r}: {exc}")
        except Exception as exc:  # never let one message take the coordinator down
            logger.debug("unexpected error handling a message", exc_info=True)
            self._bad(
                f"dropped a {msg.type.name} from {pid!r} that raised {type(exc).__name__}: {exc}"
            )

    def _bad(self, what: str) -> None:
        self.counters["bad_messages"] += 1
        n = self.counters["bad_messages"]
        if n <= 20 or n % 1000 == 0:  # a flood must not flood the log too
            logger.warning("%s (bad messages so far: %d)", what, n)

    def _identity(self, frame: zmq.Frame) -> str | None:
        """Who the connection a frame came on authenticated as (the ZAP User-Id: under CURVE
        the peer's Z85 public key, under PLAIN the user name it chose); None without auth."""
        if self._zap is None:
            return None
        try:
            user = frame.get("User-Id")
        except (zmq.ZMQError, AttributeError):
            return ""
        return "" if user is None else str(user)

    def _forged(self, pid: str, user: str | None, what: str) -> None:
        """Drop a message in ``pid``'s name from a connection authenticated as someone else."""
        self.counters["forged"] += 1
        if pid not in self._forged_logged and len(self._forged_logged) < 4096:
            self._forged_logged.add(pid)  # once per id: a flood must not flood the log
            logger.warning(
                "dropped %s in the name of %r from a connection authenticated as %.12r… "
                "(not that peer's identity; further ones are only counted)",
                what,
                pid,
                user,
            )

    def _dispatch(
        self, pid: str, route: bytes, frames: wire.Message, frame: zmq.Frame, user: str | None
    ) -> None:
        now = time.monotonic()
        if frames.type == MsgType.REGISTER:
            self._register(pid, route, control.Register.from_wire(frames.meta), frame, now, user)
            return
        with self._lock:
            peer = self._peers.get(pid)
        if peer is None:
            if frames.type in (MsgType.HEARTBEAT, MsgType.QUORUM):
                why = "this peer is not registered (declared lost or never registered)"
                self._send(pid, control.Refused(kind=Refusal.EXPELLED, reason=why), route)
            else:
                logger.debug("ignored %s from unregistered %r", frames.type.name, pid)
            return
        if route != peer.route or peer.auth != user:  # first: not even a heartbeat counts
            self._forged(pid, user, frames.type.name)
            return
        peer.last_seen = now
        peer.suspected_at = None
        msg = control.parse(frames)
        if msg.TYPE not in control.TO_COORDINATOR:
            raise ProtocolError(f"unexpected {msg.NAME} on the control channel")
        if isinstance(msg, control.Heartbeat):
            self._send(pid, control.HeartbeatAck())
        elif isinstance(msg, control.Quorum):
            with self._lock:
                self._book.arrive(pid, msg.min_world)
            self._complete_quorum()
        elif isinstance(msg, control.QuorumCancel):
            with self._lock:
                self._book.cancel(pid)
            self._send(pid, msg)  # echoed as the acknowledgement: the peer may now give up
        elif isinstance(msg, control.Leave):
            self._remove(pid, "left", left=True)
        elif isinstance(msg, control.Suspect):
            with self._lock:
                other = self._peers.get(msg.peer)
                if other is not None and other.suspected_at is None:
                    other.suspected_at = now

    # ---- registration ----------------------------------------------------------------------------
    def _register(
        self,
        pid: str,
        route: bytes,
        reg: control.Register,
        frame: zmq.Frame,
        now: float,
        user: str | None,
    ) -> None:
        """Take ``pid`` into the group, or answer REFUSED saying why not."""
        with self._lock:
            refusal = self._auth_refusal(pid, reg, user) or self._group_refusal(pid, reg)
            if refusal is None:
                addr, reachable = self._add_peer(pid, route, reg, frame, now, user)
        if refusal is not None:
            kind, reason = refusal
            self.counters["refused"] += 1
            logger.warning(
                "refused registration of %r from %s: %s", pid, _peer_address(frame), reason
            )
            self._send(pid, control.Refused(kind=kind, reason=reason), route)
            return
        self.counters["registered"] += 1
        self._suspected.discard(pid)
        logger.info(
            "registered %s (data %s, meta %s%s)",
            pid,
            addr,
            reg.meta,
            ", rejoining" if reg.last_epoch >= 0 else "",
        )
        if reachable is None:
            # Answered once the dial-back is done (the peer waits for REGISTERED, so no
            # quorum can complete without it meanwhile).
            self._probing += 1
            threading.Thread(
                target=self._probe, args=(pid, route, addr), name="lowband-dial-back", daemon=True
            ).start()
            return
        self._admitted(pid, route)

    def _auth_refusal(
        self, pid: str, reg: control.Register, user: str | None
    ) -> tuple[Refusal, str] | None:
        """Why ``pid`` may not register under the group's credentials, or None."""
        cfg = self.config
        if cfg.token is not None and not hmac.compare_digest(
            reg.token.encode(), cfg.token.encode()
        ):
            return Refusal.AUTH, "wrong or missing token"
        if cfg.curve is not None and reg.key != user:
            # Other peers' data sockets admit this key as this peer id: it must be the key
            # this connection proved it holds.
            return Refusal.AUTH, "the key in REGISTER is not the one this connection uses"
        if (
            cfg.curve is not None
            and cfg.reserved_prefix is not None
            and pid.startswith(cfg.reserved_prefix)
            and user != cfg.curve.public.decode()
        ):
            return Refusal.AUTH, (
                f"peer ids starting with {cfg.reserved_prefix!r} are reserved to the "
                "coordinator's own key"
            )
        return None

    def _group_refusal(self, pid: str, reg: control.Register) -> tuple[Refusal, str] | None:
        """Why ``pid`` does not fit the group (a duplicate id, another run), or None. Under
        the lock."""
        if pid in self._peers:
            return Refusal.DUPLICATE, f"peer id {pid!r} is already registered"
        if self._signature is not None and reg.signature != self._signature:
            # A peer may describe what its signature covers (meta "layout", e.g. a site's
            # shard layout): the refusal then names both sides.
            why = "different model shapes or config"
            mine = reg.meta.get("layout")
            if isinstance(mine, str) or isinstance(self._layout, str):
                group = self._layout or "not stated"
                why = f"this peer: {mine or 'not stated'}; the group: {group}"
            return Refusal.INCOMPATIBLE, (
                f"run signature {reg.signature[:16]!r}… differs from the group's "
                f"{self._signature[:16]!r}… ({why})"
            )
        if self._chunk is not None and reg.chunk != self._chunk:
            # Reductions are matched chunk by chunk: every peer must cut buffers alike.
            return Refusal.INCOMPATIBLE, (
                f"chunk_bytes={reg.chunk} differs from the group's "
                f"{self._chunk}; give every peer the same ZmqConfig.chunk_bytes"
            )
        return None

    def _add_peer(
        self,
        pid: str,
        route: bytes,
        reg: control.Register,
        frame: zmq.Frame,
        now: float,
        user: str | None,
    ) -> tuple[str, bool | None]:
        """Record a registered peer (under the lock); returns its data address and whether it
        can be dialled (None: a dial-back will tell)."""
        cfg = self.config
        if self._signature is None:  # the first peer sets what the group must share
            self._signature = reg.signature
            layout = reg.meta.get("layout")
            self._layout = layout if isinstance(layout, str) else None
            self._chunk = reg.chunk
        addr = reg.addr
        if "://*:" in addr:  # the peer asked us to fill in the host we see it from
            addr = addr.replace("*", _peer_address(frame) or "127.0.0.1", 1)
        reachable = reg.reachable
        probe = reachable is None and cfg.probe_timeout > 0 and addr.startswith("tcp://")
        if probe and self._probing >= MAX_PROBES:
            probe, reachable = False, False  # a flood of registrations: relay them
        elif reachable is None and not probe:
            reachable = True
        self._peers[pid] = _Peer(
            addr,
            reg.key.encode() if reg.key else None,
            reg.meta,
            now,
            reg.local,
            auth=user,
            route=route,
            reachable=reachable,
        )
        self._book.register(pid)
        if not self._book.view and reg.last_epoch > self._book.epoch:
            # A restarted coordinator: go on above the epochs the group has used, so a
            # straggler message of an old epoch can never match a new operation.
            self._book.epoch = reg.last_epoch
        return addr, reachable

    def _admitted(self, pid: str, route: bytes) -> None:
        with self._lock:
            peer = self._peers.get(pid)
        if peer is not None and peer.reachable is False and self._relay is not None:
            frame = self._chunk or 0
            if frame + (1 << 16) > self.config.relay_max_message_bytes:
                logger.warning(
                    "the group's chunk_bytes (%d) exceeds what the relay takes "
                    "(relay_max_message_bytes %d): relayed links will fail",
                    frame,
                    self.config.relay_max_message_bytes,
                )
        if peer is not None and peer.reachable is False:
            logger.warning(
                "peer %s cannot be dialled at %s: links into it go through %s",
                pid,
                peer.addr,
                f"the relay {self.relay_address}" if self._relay else "nothing (no relay runs)",
            )
        relay = int(self.relay_address.rsplit(":", 1)[1]) if self._relay is not None else None
        answer = control.Registered(heartbeat_interval=self.config.heartbeat_interval, relay=relay)
        self._send(pid, answer, route)
        self._complete_quorum()  # a newcomer can unblock nothing, but a dead peer's slot may

    # ---- dial-back -------------------------------------------------------------------------------
    def _probe(self, pid: str, route: bytes, addr: str) -> None:
        """Probe thread: can this process open a TCP connection to ``addr``?"""
        why = dial_back(addr, self.config.probe_timeout)
        with self._lock:
            self._probed.append((pid, route, why))
        if self._probe_fd >= 0:
            os.eventfd_write(self._probe_fd, 1)

    def _on_probes(self) -> None:
        try:
            os.eventfd_read(self._probe_fd)
        except BlockingIOError:
            pass
        with self._lock:
            done, self._probed = self._probed, []
        now = time.monotonic()
        for pid, route, why in done:
            self._probing -= 1
            with self._lock:
                peer = self._peers.get(pid)
                if peer is None or peer.route != route:
                    continue  # gone (or registered again) meanwhile
                peer.reachable = why is None
                peer.last_seen = now
            if why is not None:
                logger.info("dial-back to %s (%s) failed: %s", pid, peer.addr, why)
            self._admitted(pid, route)

    def _complete_quorum(self) -> None:
        with self._lock:
            views = self._book.try_complete()
            if views is None:
                return
            peers = {p: self._peers[p] for p in views}
        order = next(iter(views.values())).peers
        addrs = [peers[p].addr for p in order]
        keys = [k.decode() if (k := peers[p].key) else None for p in order]
        relayed = [peers[p].reachable is False for p in order]
        for pid, view in views.items():
            self._send(
                pid,
                control.MembershipUpdate(
                    epoch=view.epoch,
                    rank=view.rank,
                    peers=list(view.peers),
                    addrs=addrs,
                    keys=keys,
                    locals=[peers[p].local for p in order],
                    relayed=relayed,
                    joined=list(view.joined),
                    left=list(view.left),
                ),
            )
        logger.info("quorum: epoch %d, %d peers", view.epoch, len(order))

    def _remove(self, pid: str, reason: str, *, left: bool = False) -> None:
        with self._lock:
            if not self._book.remove(pid):
                return
            peer = self._peers.pop(pid, None)
            if peer is not None and self._relay is not None:
                grace = max(5.0, 2 * self.config.heartbeat_interval)
                if len(self._gone) >= 4096:  # bounded: forget the oldest
                    self._gone.pop(next(iter(self._gone)))
                self._gone[pid] = (Member(peer.route, peer.auth), time.monotonic() + grace)
            if not self._peers:
                # Nobody is left to agree with: the next peer to register sets the run
                # signature and chunk size afresh, so no peer (a wrong config, or one that
                # joined only to claim them) holds them after it is gone.
                self._signature = self._layout = self._chunk = None
            epoch = self._book.epoch
            others = list(self._peers)
        self.counters["left" if left else "lost"] += 1
        log = logger.info if left else logger.warning
        log("peer %s %s; notifying %d peers", pid, reason, len(others))
        for other in others:
            self._send(other, control.PeersLost(peers=[pid], epoch=epoch, reason=reason, left=left))
        self._complete_quorum()

    def _expire(self, now: float) -> None:
        cfg = self.config
        limit, interval = cfg.silence_limit, cfg.heartbeat_interval
        with self._lock:
            for pid in [p for p, (_, until) in self._gone.items() if now > until]:
                del self._gone[pid]
            silent = {
                p: now - peer.last_seen
                for p, peer in self._peers.items()
                if peer.reachable is not None  # a dial-back pending: not answered yet
                and (
                    now - peer.last_seen > limit
                    or (peer.suspected_at is not None and now - peer.last_seen > interval)
                )
            }
        for pid, quiet in silent.items():
            if quiet > cfg.unresponsive_after:
                self._suspected.discard(pid)
                self._remove(
                    pid,
                    f"is unresponsive (connected, but no heartbeat for "
                    f"{quiet:.1f}s > unresponsive_after)",
                )
            elif not self._send(pid, control.HeartbeatAck()):
                self._suspected.discard(pid)
                self._remove(
                    pid,
                    f"is lost (no heartbeat for {quiet:.1f}s and its connection "
                    "stopped answering ZMTP pings)",
                )
            elif pid not in self._suspected:
                self._suspected.add(pid)
                logger.warning(
                    "peer %s suspected: no heartbeat for %.1fs, but its connection "
                    "is alive (a busy interpreter?); keeping it",
                    pid,
                    quiet,
                )
        for pid in list(self._suspected):
            if pid not in silent:
                self._suspected.discard(pid)
                logger.info("peer %s is heartbeating again", pid)


MAX_PROBES = 64
"""Dial-backs running at once; registrations beyond it are taken as not reachable (relayed)."""


def dial_back(addr: str, timeout: float) -> str | None:
    """None if a TCP connection to ``tcp://HOST:PORT`` opens within ``timeout``, else why not.

    The connection is closed in order (our FIN, then we wait for the peer's): the peer's libzmq
    has let go of it before the peer is told it registered, so the probe is not counted as a
    failed handshake on its data socket (the peer starts watching those after registering)."""
    host, _, port = addr[len("tcp://") :].rpartition(":")
    host = host.strip("[]")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout) as s:
            s.shutdown(socket.SHUT_WR)
            s.settimeout(timeout)
            try:
                while s.recv(4096):
                    pass
            except OSError:
                pass
    except (OSError, ValueError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


def _peer_address(frame: zmq.Frame) -> str:
    try:
        return str(frame.get("Peer-Address"))
    except (zmq.ZMQError, AttributeError):
        return ""
