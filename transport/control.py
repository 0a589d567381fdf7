"""The control plane between peers and the coordinator: one typed message per ``MsgType``.

The message type travels in the wire header (:class:`transport.wire.MsgType`); the map beside
it holds the message's fields (:mod:`lowband.schema`). :func:`pack` is the one encoder,
:func:`parse` the one decoder; the peer (``transport.zmq_comm``, ``transport.membership``,
``transport.peerlinks``, ``transport.reactor``) and the coordinator (``transport.coordinator``)
use no other. A malformed message is a :class:`lowband.errors.ProtocolError` naming the message
and the field; unknown keys are ignored, so a field added later with a default stays compatible.

The messages and their fields, generated from the dataclasses below by :func:`describe` (a
test keeps the two, and ARCHITECTURE.md, in step)::

    REGISTER       addr: str, signature: str, chunk: int, meta: dict = {},
                   key: str | None = None, token: str = '', local: list[str] | None = None,
                   reachable: bool | None = None, last_epoch: int = -1
    REGISTERED     heartbeat_interval: float, relay: int | None = None
    REFUSED        kind: Refusal, reason: str = ''
    HEARTBEAT
    HEARTBEAT_ACK
    QUORUM         min_world: int
    QUORUM_CANCEL
    MEMBERSHIP     epoch: int, rank: int, peers: list[str], addrs: list[str],
                   keys: list[str | None], locals: list[list[str] | None] | None = None,
                   relayed: list[bool] | None = None, joined: list[str] = [],
                   left: list[str] = []
    PEER_LOST      peers: list[str], epoch: int = -1, reason: str = 'lost',
                   left: bool = False
    LEAVE
    SUSPECT        peer: str
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar

from lowband import schema
from lowband.errors import AuthError, IncompatiblePeer, ProtocolError, VersionMismatch
from lowband.schema import Record
from transport import wire
from transport.wire import MsgType

MAX_PEERS = 1 << 20
"""Peers a MEMBERSHIP may list, and the largest ``min_world`` a QUORUM may ask (bounds only)."""
MAX_CHUNK = 1 << 40
"""Largest ``chunk`` a REGISTER may announce (ZmqConfig.chunk_bytes)."""

C = TypeVar("C", bound="ControlMsg")


class Refusal(str, enum.Enum):
    """Why the coordinator answered REFUSED (the ``kind`` field)."""

    AUTH = "auth"  # wrong or missing token, or a key that is not the connection's
    DUPLICATE = "duplicate"  # the peer id is registered already
    INCOMPATIBLE = "incompatible"  # run signature or chunk size differs from the group's
    VERSION = "version"  # another wire-protocol version
    EXPELLED = "expelled"  # not (or no longer) registered: register again

    def error(self, reason: str) -> Exception:
        """The exception a peer raises when its registration is refused for this."""
        kind = {
            Refusal.AUTH: AuthError,
            Refusal.INCOMPATIBLE: IncompatiblePeer,
            Refusal.VERSION: VersionMismatch,
        }.get(self, ProtocolError)
        return kind(f"coordinator refused this peer: {reason or self.value}")


@dataclass(frozen=True, kw_only=True)
class ControlMsg(Record):
    """Base of the control messages; ``TYPE`` is the header's message type."""

    TYPE: ClassVar[MsgType]

    def __init_subclass__(cls, **kw: Any) -> None:
        super().__init_subclass__(**kw)
        cls.NAME = cls.TYPE.name


CONTROL: dict[MsgType, type[ControlMsg]] = {}
"""Message type -> message class, in the order of :class:`MsgType`."""
TO_COORDINATOR: frozenset[MsgType] = frozenset(
    {
        MsgType.REGISTER,
        MsgType.HEARTBEAT,
        MsgType.QUORUM,
        MsgType.QUORUM_CANCEL,
        MsgType.LEAVE,
        MsgType.SUSPECT,
    }
)
"""What peers send; the coordinator answers with the others (QUORUM_CANCEL both ways: the
coordinator's is the acknowledgement)."""


def _control(cls: type[C]) -> type[C]:
    CONTROL[cls.TYPE] = cls
    return cls


@_control
@dataclass(frozen=True, kw_only=True)
class Register(ControlMsg):
    """A peer asks to join: where its data socket is and what it must agree on with the group."""

    TYPE: ClassVar[MsgType] = MsgType.REGISTER
    addr: str  # its data socket; "tcp://*:port" asks the coordinator to fill in the host
    signature: str  # run signature: model shapes and config every peer must share
    chunk: int  # ZmqConfig.chunk_bytes: reductions are matched chunk by chunk
    meta: dict = field(default_factory=dict)  # free-form; "layout" describes the signature
    key: str | None = None  # its CURVE public key (Z85), under CURVE
    token: str = ""  # the shared secret, under a token
    local: list[str] | None = None  # [host key, ipc endpoint, shm key] (same-host fast paths)
    reachable: bool | None = None  # None: the coordinator dials back to find out
    last_epoch: int = -1  # rejoining: the last epoch it saw (a restarted coordinator goes above)

    def __post_init__(self) -> None:
        if not 1 <= self.chunk <= MAX_CHUNK:
            raise self.bad("chunk", f"must be in [1, {MAX_CHUNK}]")
        if self.key is not None and len(self.key) != 40:
            raise self.bad("key", "must be a 40-character Z85 key")
        if self.local is not None and not 2 <= len(self.local) <= 3:
            raise self.bad("local", "must be [host key, ipc endpoint, shm key]")


@_control
@dataclass(frozen=True, kw_only=True)
class Registered(ControlMsg):
    """The coordinator took the peer: how often to heartbeat, and its relay's port if any."""

    TYPE: ClassVar[MsgType] = MsgType.REGISTERED
    heartbeat_interval: float  # seconds
    relay: int | None = None  # TCP port of the coordinator's relay (same host); None: no relay

    def __post_init__(self) -> None:
        if not (math.isfinite(self.heartbeat_interval) and self.heartbeat_interval > 0):
            raise self.bad("heartbeat_interval", "must be a finite number > 0")
        if self.relay is not None and not 1 <= self.relay <= 65535:
            raise self.bad("relay", "must be a TCP port")

    def to_wire(self) -> dict[str, Any]:
        out = super().to_wire()
        if self.relay is None:
            del out["relay"]  # absent, not nil: what peers before the typed schema expect
        return out


@_control
@dataclass(frozen=True, kw_only=True)
class Refused(ControlMsg):
    """The coordinator will not take (or no longer knows) the peer."""

    TYPE: ClassVar[MsgType] = MsgType.REFUSED
    kind: Refusal
    reason: str = ""


@_control
@dataclass(frozen=True, kw_only=True)
class Heartbeat(ControlMsg):
    """A peer is alive (every heartbeat_interval / 3)."""

    TYPE: ClassVar[MsgType] = MsgType.HEARTBEAT


@_control
@dataclass(frozen=True, kw_only=True)
class HeartbeatAck(ControlMsg):
    """The coordinator is alive (also its probe of a suspected peer)."""

    TYPE: ClassVar[MsgType] = MsgType.HEARTBEAT_ACK


@_control
@dataclass(frozen=True, kw_only=True)
class Quorum(ControlMsg):
    """A peer asks for the next membership view, with at least ``min_world`` peers."""

    TYPE: ClassVar[MsgType] = MsgType.QUORUM
    min_world: int

    def __post_init__(self) -> None:
        if not 1 <= self.min_world <= MAX_PEERS:
            raise self.bad("min_world", f"must be in [1, {MAX_PEERS}]")


@_control
@dataclass(frozen=True, kw_only=True)
class QuorumCancel(ControlMsg):
    """A peer withdraws its quorum request; the coordinator echoes it as the acknowledgement."""

    TYPE: ClassVar[MsgType] = MsgType.QUORUM_CANCEL


@_control
@dataclass(frozen=True, kw_only=True)
class MembershipUpdate(ControlMsg):
    """A completed quorum: the view of epoch ``epoch`` and this peer's rank in it; the lists
    are per peer, in rank order."""

    TYPE: ClassVar[MsgType] = MsgType.MEMBERSHIP
    epoch: int
    rank: int
    peers: list[str]
    addrs: list[str]  # data sockets
    keys: list[str | None]  # CURVE public keys
    locals: list[list[str] | None] | None = None  # Register.local of each
    relayed: list[bool] | None = None  # cannot be dialled: links into it go through the relay
    joined: list[str] = field(default_factory=list)
    left: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        n = len(self.peers)
        if not 1 <= n <= MAX_PEERS:
            raise self.bad("peers", f"must name 1 to {MAX_PEERS} peers")
        if not 0 <= self.rank < n:
            raise self.bad("rank", f"must be in [0, {n})")
        if self.epoch < 0:
            raise self.bad("epoch", "must be >= 0")
        for name in ("addrs", "keys", "locals", "relayed"):
            v = getattr(self, name)
            if v is not None and len(v) != n:
                raise self.bad(name, f"must hold one entry per peer ({n})")


@_control
@dataclass(frozen=True, kw_only=True)
class PeersLost(ControlMsg):
    """Peers left or were declared lost in ``epoch``: fail what waits on them."""

    TYPE: ClassVar[MsgType] = MsgType.PEER_LOST
    peers: list[str]
    epoch: int = -1
    reason: str = "lost"
    left: bool = False  # they said goodbye (their BYEs may still be in flight)


@_control
@dataclass(frozen=True, kw_only=True)
class Leave(ControlMsg):
    """A peer leaves the group for good."""

    TYPE: ClassVar[MsgType] = MsgType.LEAVE


@_control
@dataclass(frozen=True, kw_only=True)
class Suspect(ControlMsg):
    """A peer saw its data connection to ``peer`` drop: probe that one sooner."""

    TYPE: ClassVar[MsgType] = MsgType.SUSPECT
    peer: str


def pack(msg: ControlMsg) -> list[Any]:
    """The frames of ``msg`` (header, then its map)."""
    return wire.pack(msg.TYPE, msg.to_wire())


def parse(msg: wire.Message) -> ControlMsg:
    """The control message ``msg`` carries; :class:`ProtocolError` for a data-plane type or a
    malformed map."""
    cls = CONTROL.get(msg.type)
    if cls is None:
        raise ProtocolError(f"unexpected {msg.type.name} on the control channel")
    return cls.from_wire(msg.meta)


def describe() -> str:
    """The message table of the module docstring (and ARCHITECTURE.md)."""
    return schema.describe({t.name: cls for t, cls in CONTROL.items()}, width=14)
