"""How one ZeroMQ peer talks to the others: :class:`ZmqConfig`."""

from __future__ import annotations

from dataclasses import dataclass

from lowband.errors import ConfigError
from transport.auth import CurveKeys

MiB = 1 << 20
SAME_HOST_MODES = ("auto", "shm", "ipc", "off")
RELAY_MODES = ("auto", "always", "off")


@dataclass(frozen=True, kw_only=True)
class ZmqConfig:
    """How one peer talks to the others."""

    connections: int = 4
    """K: TCP connections per peer pair. Chunks are striped across them, so a WAN path whose
    single flow is capped by window/RTT carries up to K times more."""
    chunk_bytes: int = 4 * MiB
    """Large buffers move in chunks of at most this size (the unit of striping and pipelining);
    a buffer (a collective's segment, a message) of less than 16 chunks is cut into 16 pieces of
    at least 64 KiB instead, so that K connections carry it at once
    (:func:`transport.ops.piece_bytes`)."""
    timeout: float = 60.0
    """Default per-operation deadline in seconds (every call can override it)."""
    register_timeout: float = 30.0
    """Seconds to wait for the coordinator to answer the registration."""
    bind_host: str = "127.0.0.1"
    """Interface the data socket listens on. Loopback by default: a peer that others reach
    over a network names its interface (or ``0.0.0.0``), and then should use CURVE (see
    :func:`transport.auth.check_exposure`, which the command line applies)."""
    data_port: int = 0
    """Port of the data socket; 0 picks a free one."""
    advertise_host: str | None = None
    """Host other peers should connect to; None: the bind host, or, for a wildcard bind,
    the address the coordinator sees this peer's control connection come from."""
    advertise_port: int | None = None
    """Port other peers should connect to, when it differs (e.g. a relay/emulator in front)."""
    star_threshold_bytes: int = 256 * 1024
    """``algorithm="auto"`` uses star below this payload size; at or above it, scatter or ring
    (``scatter_max_world``)."""
    scatter_max_world: int = 0
    """``algorithm="auto"`` on payloads of at least ``star_threshold_bytes``: scatter (2 hops)
    up to this many ranks, ring (2(n-1) hops, one flow out and one in per rank) above; 0: always
    ring. Both move the same bytes. Where a payload is a few bandwidth-delay products (a long
    round trip), scatter saves the ring's hops and ramps n-1 flows at once: 1.6-2.0x faster than
    the ring on the ``intercontinental`` profile; where it is many (bandwidth-bound), its n-1
    flows per access link contend and retransmit, and the ring is up to 1.2x faster (both:
    ``benchmarks.wan``, docs/training.md). Peers on one host use shared memory either way."""
    max_message_bytes: int = 64 * MiB
    """Largest payload of one received message; larger frames are refused (ZMQ_MAXMSGSIZE)."""
    max_pending_bytes: int = 2 << 30
    """Bytes kept for operations another peer started before this one did (payload, decoded
    metadata and a per-message overhead: ``wire.Message.held_bytes``)."""
    max_tensor_bytes: int = 1 << 36
    """Largest logical message (e.g. a broadcast state dict) this peer will allocate for."""
    send_hwm: int = 1000
    """Messages queued per connection before the reactor holds further sends in its backlog."""
    socket_buffer_bytes: int = 0
    """SO_SNDBUF / SO_RCVBUF; 0 keeps the kernel's auto-tuning."""
    linger: float = 2.0
    """Seconds close() waits for queued messages to leave."""
    io_threads: int = 1
    """ZeroMQ I/O threads of this peer's context."""
    result_pool_bytes: int = 512 * MiB
    """Results of >= 1 MiB come from a pool of buffers reused once the caller dropped them
    (:mod:`transport.buffers`): no page faults for the same-sized reduction every step. The
    pool keeps up to this many bytes mapped; 0 disables it."""
    same_host: str = "auto"
    """How this peer reaches peers on the same host (same boot, network namespace, user and
    PID namespace):

    * ``auto`` — all-reduces without a codec go through shared memory (:mod:`transport.shm`)
      whenever *every* member of the epoch is such a peer, as NCCL's SHM transport does inside
      a node; everything else, and every group with a remote member, uses TCP. Nothing is left
      on disk, even after a crash.
    * ``shm`` — ``auto`` plus Unix sockets instead of TCP to same-host peers (socket files in
      ``ipc_dir``).
    * ``ipc`` — Unix sockets to same-host peers, no shared memory.
    * ``off`` — TCP only: what link emulators and shaped-link tests need, since any same-host
      shortcut would bypass the link they measure.

    Every rank of an epoch decides from the same coordinator table, so all agree."""
    ipc_dir: str = "/tmp"
    """Directory for the Unix socket files of ``same_host`` = ``ipc`` or ``shm``."""
    token: str | None = None
    """Shared secret (ZeroMQ PLAIN without CURVE; inside REGISTER with CURVE)."""
    curve_server_key: bytes | None = None
    """The coordinator's CURVE public key (Z85). Setting it enables CURVE on every socket."""
    curve: CurveKeys | None = None
    """This peer's CURVE keypair; None generates a fresh one per connect()."""
    coordinator_grace: float = 60.0
    """Seconds a peer waiting for a quorum tolerates a silent coordinator before the quorum
    fails with ``PeerLost``. Collectives among the current members go on meanwhile, and a
    coordinator restarted at the same address within the grace is rejoined without the caller
    seeing anything: a supervisor's restart takes seconds on an idle machine and longer on a
    loaded one, so the default leaves a minute."""
    rejoin: bool = True
    """Re-register by itself after the coordinator declared this peer lost (it was paused past
    the deadline) or restarted: pending operations still fail with PeerLost, the next quorum
    admits the peer as a newcomer. False: stay out (the caller must connect again)."""

    reachable: bool | None = None
    """Whether other peers can open connections to this peer's data address. None: the
    coordinator finds out by dialling it back when it registers; False: a site behind NAT or a
    firewall that admits nothing in (no dial-back). Links into a peer that cannot be dialled
    go through the coordinator's relay (:mod:`transport.relay`)."""
    relay: str = "auto"
    """``auto``: reach peers that cannot be dialled through the coordinator's relay, the rest
    directly; ``always``: reach every peer through the relay (measuring its cost, or a network
    where no peer can dial another); ``off``: never (a peer that cannot be dialled is then
    unreachable from this one)."""

    def __post_init__(self) -> None:
        if not 1 <= self.connections <= 64:
            raise ConfigError("connections", f"must be in [1, 64], got {self.connections}")
        if not 4096 <= self.chunk_bytes <= 1 << 30:
            raise ConfigError("chunk_bytes", f"must be in [4 KiB, 1 GiB], got {self.chunk_bytes}")
        for name in ("timeout", "register_timeout", "coordinator_grace"):
            if getattr(self, name) <= 0:
                raise ConfigError(name, f"must be > 0 seconds, got {getattr(self, name)}")
        if not 0 <= self.data_port < 65536:
            raise ConfigError("data_port", f"must be a port number, got {self.data_port}")
        if self.advertise_port is not None and not 0 < self.advertise_port < 65536:
            raise ConfigError("advertise_port", f"must be a port number, got {self.advertise_port}")
        if self.star_threshold_bytes < 0:
            raise ConfigError("star_threshold_bytes", "must be >= 0")
        if not 0 <= self.scatter_max_world <= 1 << 16:
            raise ConfigError(
                "scatter_max_world", f"must be in [0, 65536], got {self.scatter_max_world}"
            )
        if self.max_message_bytes < self.chunk_bytes + 65536:
            raise ConfigError(
                "max_message_bytes", f"must be >= chunk_bytes + 64 KiB ({self.chunk_bytes + 65536})"
            )
        if self.max_pending_bytes < self.max_message_bytes:
            raise ConfigError("max_pending_bytes", "must be >= max_message_bytes")
        if self.result_pool_bytes < 0:
            raise ConfigError("result_pool_bytes", "must be >= 0")
        if self.send_hwm < 1 or self.io_threads < 1 or self.linger < 0:
            raise ConfigError("send_hwm/io_threads/linger", "must be positive")
        if self.token is not None and not self.token:
            raise ConfigError("token", "must be non-empty when given")
        if self.curve_server_key is not None and len(self.curve_server_key) != 40:
            raise ConfigError("curve_server_key", "must be a 40-character Z85 public key")
        if self.curve is not None and self.curve.secret is None:
            raise ConfigError("curve", "this peer's keypair needs its secret key")
        if self.relay not in RELAY_MODES:
            raise ConfigError("relay", f"one of {', '.join(RELAY_MODES)}, got {self.relay!r}")
        if self.same_host not in SAME_HOST_MODES:
            raise ConfigError(
                "same_host", f"one of {', '.join(SAME_HOST_MODES)}, got {self.same_host!r}"
            )

    @property
    def offers_ipc(self) -> bool:
        return self.same_host in ("ipc", "shm")

    @property
    def offers_shm(self) -> bool:
        return self.same_host in ("auto", "shm")
