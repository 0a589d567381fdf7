"""A peer's links: its data and control sockets and its outgoing connections to every member.

Owned and used by the reactor thread only (:mod:`transport.reactor`); ZeroMQ sockets are not
thread-safe.

* Data arrives on one PULL socket (bound, authenticated through ZAP), watched for failed
  handshakes (:class:`~transport.auth.HandshakeWatch`).
* Data leaves through K PUSH sockets (K TCP connections) per remote peer, striped round robin,
  never blocking: a socket at its high-water mark gets a backlog and POLLOUT interest, so a slow
  receiver cannot deadlock the thread that must also keep receiving.
* One connection per peer is monitored for a drop: a crashed peer's kernel closes its sockets at
  once, and telling the coordinator (SUSPECT) gets it declared lost after one silent heartbeat
  interval instead of two.
* The coordinator is reached on a DEALER socket, which also carries the heartbeats.
* A peer that cannot be dialled (behind NAT) is reached through the coordinator's relay
  (:mod:`transport.relay`): one more DEALER socket, dialled out by every peer when the
  coordinator offers a relay, carries what this peer sends to such peers (one connection, one
  shared backlog) and what the relay brings from others.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from typing import Any, Sequence, cast

import zmq
from zmq.utils.monitor import recv_monitor_message

from transport import relay as relay_wire
from transport import wire
from transport.auth import CurveKeys, HandshakeWatch, configure_client
from transport.config import ZmqConfig
from transport.control import ControlMsg, Heartbeat, Suspect
from transport.control import pack as pack_control
from transport.wire import MsgType

logger = logging.getLogger(__name__)


class _Out:
    """The K connections to one remote peer, each with a backlog used only under back-pressure."""

    def __init__(self, sockets: list[zmq.Socket]) -> None:
        self.sockets = sockets
        self.backlog: list[deque] = [deque() for _ in sockets]
        self.next = 0
        self.monitor: zmq.Socket | None = None


class PeerLinks:
    """The sockets of one peer; see the module docstring. ``poller`` is the reactor's: the links
    register what they need watched (monitors, sockets with a backlog) on it."""

    def __init__(
        self,
        *,
        ctx: zmq.Context,
        config: ZmqConfig,
        peer_id: str,
        keys: CurveKeys | None,
        data: zmq.Socket,
        control: zmq.Socket,
        poller: zmq.Poller,
        heartbeat_interval: float,
        relay: zmq.Socket | None = None,
    ) -> None:
        self.ctx = ctx
        self.cfg = config
        self.peer_id = peer_id
        self.keys = keys
        self.data = data
        self.control = control
        self._poller = poller
        self.watch = HandshakeWatch(data, f"the data socket of {peer_id}")
        self._hb_period = heartbeat_interval / 3
        self._next_hb = 0.0
        self._control_warned = 0.0
        self._out: dict[str, _Out] = {}
        self._by_socket: dict[zmq.Socket, tuple[_Out, int]] = {}
        self._monitors: dict[zmq.Socket, str] = {}
        self.relay = relay
        self._relay_backlog: deque = deque()
        self.relayed: frozenset[str] = frozenset()  # replaced, never mutated: read by users

    # ---- data ------------------------------------------------------------------------------------
    def send(
        self,
        peer: str,
        mtype: MsgType,
        meta: dict[str, Any],
        payload: Sequence[Any] = (),
        *,
        stripe: int | None = None,
        track: bool = False,
    ) -> list[Any]:
        """Queue one message to ``peer`` on connection ``stripe`` (round robin if None).

        Payload buffers are sent zero-copy. With ``track`` the returned list holds them: pass
        it to :func:`still_sending` to learn when ZeroMQ has released them."""
        if peer in self.relayed:
            return self._send_relayed(peer, mtype, meta, payload, track)
        out = self._out.get(peer)
        if out is None:
            # The peer is gone. Whatever needs data from it fails through PEER_LOST; what only
            # sends to it may still complete, so the message is dropped rather than raised.
            return []
        k = len(out.sockets)
        if stripe is None:
            stripe = out.next
            out.next = (out.next + 1) % k
        i = stripe % k
        frames = wire.pack(mtype, meta, payload)
        trackers = list(payload) if track else []
        backlog = out.backlog[i]
        if backlog:
            backlog.append(frames)
            return trackers
        try:
            out.sockets[i].send_multipart(frames, zmq.NOBLOCK, copy=False)
        except zmq.Again:
            backlog.append(frames)
            self._poller.register(out.sockets[i], zmq.POLLIN | zmq.POLLOUT)
        return trackers

    def _send_relayed(
        self,
        peer: str,
        mtype: MsgType,
        meta: dict[str, Any],
        payload: Sequence[Any],
        track: bool,
    ) -> list[Any]:
        assert self.relay is not None
        frames = relay_wire.wrap(peer, wire.pack(mtype, meta, payload))
        trackers = list(payload) if track else []
        if self._relay_backlog:
            self._relay_backlog.append(frames)
            return trackers
        try:
            self.relay.send_multipart(frames, zmq.NOBLOCK, copy=False)
        except zmq.Again:
            self._relay_backlog.append(frames)
            self._poller.register(self.relay, zmq.POLLIN | zmq.POLLOUT)
        return trackers

    def send_byes(self) -> None:
        """BYE on every connection, after all data sent so far (see ``Reactor.close``)."""
        for pid in self.relayed:
            self.send(pid, MsgType.BYE, {"e": 0, "o": "", "p": self.peer_id, "n": 1})
        for pid, out in self._out.items():
            for i in range(len(out.sockets)):
                self.send(
                    pid,
                    MsgType.BYE,
                    {"e": 0, "o": "", "p": self.peer_id, "n": len(out.sockets)},
                    stripe=i,
                )

    def flush(self, sock: zmq.Socket) -> None:
        """``sock`` can take more: send its backlog until empty or full again."""
        if sock is self.relay:
            while self._relay_backlog:
                try:
                    sock.send_multipart(self._relay_backlog[0], zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    return
                self._relay_backlog.popleft()
            self._poller.register(sock, zmq.POLLIN)  # receiving only again
            return
        out, i = self._by_socket[sock]
        backlog = out.backlog[i]
        while backlog:
            try:
                sock.send_multipart(backlog[0], zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            backlog.popleft()
        self._poller.unregister(sock)

    def connected(self, peer: str) -> bool:
        return peer in self._out or peer in self.relayed

    def peers(self) -> list[str]:
        return [*self._out, *self.relayed]

    # ---- the coordinator -------------------------------------------------------------------------
    def send_control(self, msg: ControlMsg) -> None:
        try:
            self.control.send_multipart(pack_control(msg), zmq.NOBLOCK)
        except zmq.Again:  # the coordinator is unreachable and the queue is full
            now = time.monotonic()
            if now - self._control_warned > 10:
                self._control_warned = now
                logger.warning(
                    "cannot reach the coordinator; dropped a %s (and maybe more)", msg.NAME
                )

    def heartbeat(self) -> None:
        """Send a HEARTBEAT if one is due (three per coordinator heartbeat interval)."""
        now = time.monotonic()
        if now >= self._next_hb:
            self.send_control(Heartbeat())
            self._next_hb = now + self._hb_period

    # ---- connections -----------------------------------------------------------------------------
    def connect(self, pid: str, addr: str, key: str | None) -> None:
        cfg = self.cfg
        sockets = []
        for _ in range(cfg.connections):
            s = self.ctx.socket(zmq.PUSH)
            s.linger = int(cfg.linger * 1000)
            s.sndhwm = cfg.send_hwm
            if cfg.socket_buffer_bytes:
                s.sndbuf = cfg.socket_buffer_bytes
            configure_client(
                s,
                user=self.peer_id,
                token=cfg.token,
                curve=self.keys,
                server_key=key.encode() if (key and cfg.curve_server_key) else None,
            )
            s.connect(addr)
            sockets.append(s)
        out = _Out(sockets)
        # One connection is enough to notice a crash (see the module docstring).
        out.monitor = sockets[0].get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self._monitors[out.monitor] = pid
        self._poller.register(out.monitor, zmq.POLLIN)
        self._out[pid] = out
        for i, s in enumerate(sockets):
            self._by_socket[s] = (out, i)

    def connect_relayed(self, pid: str) -> None:
        """Reach ``pid`` through the relay (needs ``relay``)."""
        assert self.relay is not None
        self.relayed = self.relayed | {pid}

    def relay_to(self, port: int) -> None:
        """The relay moved (a restarted coordinator picked another port): dial the new one."""
        if self.relay is None:
            return
        old = cast(bytes, self.relay.get(zmq.LAST_ENDPOINT)).decode()
        endpoint = f"{old.rsplit(':', 1)[0]}:{port}"
        if old == endpoint:
            return
        try:
            self.relay.disconnect(old)
        except zmq.ZMQError:
            pass
        logger.info("the coordinator's relay is now at %s", endpoint)
        self.relay.connect(endpoint)

    def disconnect(self, pid: str) -> None:
        """Close the connections to ``pid`` now, dropping what they still queue."""
        if pid in self.relayed:
            self.relayed = self.relayed - {pid}
        out = self._out.pop(pid, None)
        if out is None:
            return
        self._drop_monitor(out)
        for s in out.sockets:
            self._by_socket.pop(s, None)
            if s in self._poller:
                self._poller.unregister(s)
            s.close(0)

    def _drop_monitor(self, out: _Out) -> None:
        if out.monitor is None:
            return
        self._monitors.pop(out.monitor, None)
        self._poller.unregister(out.monitor)
        out.sockets[0].disable_monitor()
        out.monitor.close(0)
        out.monitor = None

    def is_monitor(self, sock: Any) -> bool:
        return sock in self._monitors

    def on_monitor(self, mon: zmq.Socket) -> None:
        pid = self._monitors.get(mon)
        while True:
            try:
                event = recv_monitor_message(mon, zmq.NOBLOCK)
            except zmq.Again:
                return
            if pid is not None and event["event"] == zmq.EVENT_DISCONNECTED:
                logger.info("connection to %s dropped; reporting it to the coordinator", pid)
                self.send_control(Suspect(peer=pid))

    # ---- shutdown --------------------------------------------------------------------------------
    def close_peers(self) -> None:
        """Close every outgoing connection; each keeps its linger, so queued messages still
        leave."""
        for pid in list(self._out):
            out = self._out.pop(pid)
            self._drop_monitor(out)
            for s in out.sockets:
                s.close()
        self.relayed = frozenset()
        if self.relay is not None:
            self.relay.close()  # keeps its linger: BYEs sent through it still leave

    def close(self) -> None:
        """Close this peer's own sockets (after :meth:`close_peers`)."""
        self.data.disable_monitor()
        self.watch.close()
        self.data.close(0)
        self.control.close(0)
