"""The relay: data links to peers that cannot be dialled, carried through the coordinator.

A site behind NAT (or a firewall that admits nothing in) can open connections but not accept
them. Its outgoing data links work as usual (it dials the others); the links *into* it cannot. The
coordinator decides which peers cannot be dialled (the peer says so, ``ZmqConfig.reachable``, or
the coordinator's dial-back to the advertised data address fails) and marks them in MEMBERSHIP;
every peer sends what it has for such a peer to the coordinator's relay socket instead, and the
relay hands it to the peer over the connection that peer dialled out. Peers that can be dialled
keep their direct links: only links into unreachable peers take the extra hop.

Wire format (one definition, here): a relayed data message is the lowband message itself
preceded by one envelope frame, a RELAY message without payload frames::

    sender -> relay     [envelope {"to": peer id},   inner header+meta, inner payload...]
    relay  -> receiver  [envelope {"from": peer id}, inner header+meta, inner payload...]

Authentication is the coordinator's (docs/security.md): the relay socket uses the coordinator's
mechanism and keys, under CURVE it admits only the keys of registered peers, and every peer
connects to it with its control routing id (peer id + 128 secret bits). A message is forwarded
only if it came on the route its sender registered and, under CURVE, from a connection
authenticated with that sender's key; if the inner message names that same sender; and if the
destination is registered. The relay names the sender in the envelope, the receiver checks the
inner message names it too, and under CURVE the receiver knows the envelope comes from the
coordinator (it pinned its key). Frames are bounded before they are kept: ZMQ_MAXMSGSIZE per
frame, a frame count, the inner header checked, and high-water marks bound what the relay queues.
A stranger cannot inject (not admitted, or its route/key is not a member's) nor read (the relay
sends a peer's traffic only to the route that peer registered).

Cost: one more hop and the coordinator's single forwarding thread, no striping over K
connections; measured in ``benchmarks.nat_relay``.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import zmq

from lowband.errors import ProtocolError
from transport import wire
from transport.auth import route_peer
from transport.wire import MsgType

logger = logging.getLogger(__name__)


MAX_PAIRS = 4096
"""(sender, receiver) pairs whose bytes the relay counts; beyond, only the totals."""


# ---- the envelope --------------------------------------------------------------------------------
def wrap(to: str, frames: Sequence[Any]) -> list[Any]:
    """The frames a sender gives the relay for ``to``: envelope, then the message's frames."""
    return [wire.pack(MsgType.RELAY, {"to": to})[0], *frames]


def envelope(frames: Sequence[Any], key: str) -> tuple[str, list[Any]]:
    """Split a relayed message into the peer id its envelope names under ``key`` (``to`` at
    the relay, ``from`` at the receiver) and the inner message's frames."""
    if len(frames) < 2:
        raise ProtocolError("relayed message without an inner message")
    env = wire.unpack(frames[:1], max_payload_bytes=0, max_meta_bytes=1024)
    if env.type != MsgType.RELAY:
        raise ProtocolError(f"expected a RELAY envelope, got {env.type.name}")
    pid = wire.field(env.meta, key, str)
    if not pid:
        raise ProtocolError(f"empty {key!r} in a RELAY envelope")
    return pid, list(frames[1:])


# ---- the relay server ----------------------------------------------------------------------------
@dataclass(frozen=True)
class Member:
    """What the relay needs to know of a registered peer."""

    route: bytes
    auth: str | None


class Relay:
    """Forwards relayed data messages between registered peers; one thread, one ROUTER socket.

    ``lookup(peer id, sender)`` returns the peer's :class:`Member` (None: not registered),
    read under the coordinator's lock; as a sender, a peer that left a moment ago still counts
    (what it sent before it left, its BYEs included, is still queued here). The socket is
    configured (auth, bind) by the coordinator."""

    def __init__(
        self,
        sock: zmq.Socket,
        lookup: Callable[[str, bool], Member | None],
        *,
        max_message_bytes: int,
        identity: Callable[[Any], str | None],
    ) -> None:
        self._sock = sock
        self._lookup = lookup
        self._identity = identity
        self._max = max_message_bytes
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self.counters = {
            "messages": 0,
            "bytes": 0,
            "forged": 0,
            "bad": 0,
            "unknown": 0,
            "undeliverable": 0,
        }
        self.pairs: dict[tuple[str, str], int] = {}  # (from, to) -> bytes forwarded
        self._logged = 0
        self._thread = threading.Thread(target=self._run, name="lowband-relay", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5.0)

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return {
                **self.counters,
                "pairs": {f"{a}>{b}": n for (a, b), n in sorted(self.pairs.items())},
            }

    def _drop(self, kind: str, what: str) -> None:
        with self._lock:
            self.counters[kind] += 1
        self._logged += 1
        if self._logged <= 20 or self._logged % 1000 == 0:
            logger.warning("relay dropped %s (dropped so far: %d)", what, self._logged)

    def _run(self) -> None:
        sock = self._sock
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                if not poller.poll(100):
                    continue
                for _ in range(64):
                    try:
                        # route, envelope, inner header, at most MAX_PAYLOAD_FRAMES payload frames
                        frames = wire.recv_bounded(
                            sock, copy=False, max_frames=wire.MAX_PAYLOAD_FRAMES + 3
                        )
                    except zmq.Again:
                        break
                    if frames is None:
                        self._drop("bad", "a message of too many frames")
                        continue
                    self._forward(frames)
        except zmq.ContextTerminated:
            pass
        finally:
            sock.close(0)

    def _forward(self, frames: list[Any]) -> None:
        route = frames[0].bytes
        sender = route_peer(route)
        member = self._lookup(sender, True)
        user = self._identity(frames[-1])
        if member is None:
            # not (or no longer) registered: a peer that just left may have BYEs in flight
            with self._lock:
                self.counters["unknown"] += 1
            logger.debug("relay dropped a message from unregistered %r", sender)
            return
        if member.route != route or member.auth != user:
            self._drop("forged", f"a message in the name of {sender!r} (not that peer's route/key)")
            return
        try:
            to, inner = envelope(frames[1:], "to")
            msg = wire.unpack(inner, max_payload_bytes=self._max)
            if msg.type < MsgType.CHUNK:
                raise ProtocolError(f"{msg.type.name} is not a data message")
            claimed = wire.field(msg.meta, "p", str)
        except ProtocolError as exc:
            self._drop("bad", f"a malformed message from {sender!r}: {exc}")
            return
        if claimed != sender:
            self._drop("forged", f"a message from {sender!r} claiming to be from {claimed!r}")
            return
        dest = self._lookup(to, False)
        if dest is None:
            self._drop("undeliverable", f"a message from {sender!r} to unregistered {to!r}")
            return
        out = [dest.route, wire.pack(MsgType.RELAY, {"from": sender})[0], *inner]
        try:
            # blocks while the destination's queue is full (back-pressure to every sender),
            # up to the socket's send timeout
            sock_send = self._sock.send_multipart
            sock_send(out, copy=False)
        except zmq.Again:
            self._drop("undeliverable", f"a message to {to!r}: its queue stayed full")
            return
        except zmq.ZMQError as exc:
            if exc.errno != zmq.EHOSTUNREACH:
                raise
            self._drop("undeliverable", f"a message to {to!r}: not connected to the relay")
            return
        size = sum(len(f.buffer) if isinstance(f, zmq.Frame) else len(f) for f in inner)
        with self._lock:
            self.counters["messages"] += 1
            self.counters["bytes"] += size
            if (sender, to) in self.pairs or len(self.pairs) < MAX_PAIRS:
                self.pairs[(sender, to)] = self.pairs.get((sender, to), 0) + size
