"""ZeroMQ communicator: K striped TCP connections per peer pair, coordinator-managed membership.

Usage (see also ``lowband coordinator``)::

    comm = connect("tcp://coord:29500", ZmqConfig(connections=4), signature=model_signature)
    comm.quorum(min_world=3)               # founding members wait for each other
    avg = comm.all_reduce(grad, "avg", codec=Int8BlockCodec())

``connect`` binds this peer's data socket, registers with the coordinator (refused with
:class:`~lowband.errors.IncompatiblePeer` if the run signature differs, with
:class:`~lowband.errors.AuthError` if credentials are wrong) and returns a
:class:`ZmqCommunicator`, which satisfies :class:`lowband.comm.Communicator`. Its epoch is -1 until
its first :meth:`~ZmqCommunicator.quorum`; collectives before that raise ``PeerLost``.

Threading: all sockets live on the reactor thread (:mod:`transport.reactor`); the methods here build
an operation (:mod:`transport.ops`), hand it over and return its handle. Any number of
user threads may call them concurrently.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid
from typing import Any, Mapping, Sequence, cast

import torch
import zmq
from zmq.utils.monitor import recv_monitor_message

from lowband.comm import ALGORITHMS, Algorithm, Codec, Membership, OpStats, ReduceOp
from lowband.errors import (
    AuthError,
    CommClosed,
    ConfigError,
    PeerLost,
    ProtocolError,
    TransportTimeout,
)
from transport import control, wire
from transport.allreduce import OwnerAllReduce, RingAllReduce
from transport.auth import (
    DATA_DOMAIN,
    CurveKeys,
    ZapHandler,
    configure_client,
    configure_server,
    control_route,
    curve_policy,
    token_policy,
)
from transport.blocking import BlockingCollectives
from transport.config import SAME_HOST_MODES, MiB, ZmqConfig  # noqa: F401  (ZmqConfig is re-exported)
from transport.messages import AllGatherOp, BarrierOp, BroadcastOp, RecvOp, SendOp
from transport.ops import acc_dtype, check_out
from transport.peers import PeerTable, data_address
from transport.reactor import Reactor
from transport.shm import ShmAllReduce, shm_key
from transport.work import FutureWork

logger = logging.getLogger(__name__)


def connect(
    coordinator: str,
    config: ZmqConfig | None = None,
    *,
    signature: str = "",
    meta: Mapping[str, Any] | None = None,
    peer_id: str | None = None,
) -> "ZmqCommunicator":
    """Register with the coordinator at ``coordinator`` and return this peer's communicator."""
    cfg = config or ZmqConfig()
    pid = peer_id or uuid.uuid4().hex[:12]
    ctx = zmq.Context(io_threads=cfg.io_threads)
    zap: ZapHandler | None = None
    sockets: list[zmq.Socket] = []
    try:
        keys = None
        if cfg.curve_server_key is not None:
            keys = cfg.curve or CurveKeys.generate()
        # Members' CURVE keys -> peer ids. The reactor swaps in a new dict per epoch (never mutates
        # one), because the ZAP thread reads it concurrently.
        allowed: list[dict[bytes, str]] = [{}]
        if cfg.token is not None or keys is not None:
            zap = ZapHandler(ctx)
            zap.set_policy(
                DATA_DOMAIN,
                curve_policy(lambda k: allowed[0].get(k), defer_unknown=True)
                if keys is not None
                else token_policy(cfg.token or ""),
            )
        data = ctx.socket(zmq.PULL)
        sockets.append(data)
        data.linger = 0
        data.maxmsgsize = cfg.max_message_bytes + wire.DEFAULT_MAX_META_BYTES + wire.HEADER_SIZE
        data.rcvhwm = cfg.send_hwm
        if cfg.socket_buffer_bytes:
            data.rcvbuf = cfg.socket_buffer_bytes
        configure_server(data, domain=DATA_DOMAIN, token=cfg.token, curve=keys)
        data.bind(f"tcp://{cfg.bind_host}:{cfg.data_port}")
        port = int(cast(bytes, data.get(zmq.LAST_ENDPOINT)).decode().rsplit(":", 1)[1])
        host = cfg.advertise_host or (
            cfg.bind_host if cfg.bind_host not in ("0.0.0.0", "*", "::") else "*"
        )
        addr = f"tcp://{host}:{cfg.advertise_port or port}"
        local = None
        if cfg.same_host != "off":
            ipc = ""
            if cfg.offers_ipc:
                ipc = f"ipc://{os.path.join(cfg.ipc_dir, f'lowband-{pid}.sock')}"
                data.bind(ipc)
            # [host key, Unix socket or "", shared-memory key or ""]: see Reactor.same_host_shm
            local = [host_key(), ipc, shm_key() if cfg.offers_shm else ""]
        ctl = ctx.socket(zmq.DEALER)
        sockets.append(ctl)
        # LEAVE is tiny, and a dead coordinator must not stall close() for long.
        ctl.linger = int(min(cfg.linger, 1.0) * 1000)
        ctl.routing_id = control_route(pid)  # pid + an unguessable part: see there
        ctl.maxmsgsize = wire.DEFAULT_MAX_META_BYTES + wire.HEADER_SIZE
        configure_client(
            ctl, user=pid, token=cfg.token, curve=keys, server_key=cfg.curve_server_key
        )
        register = control.Register(
            addr=addr,
            signature=signature,
            chunk=cfg.chunk_bytes,
            meta=dict(meta or {}),
            key=keys.public.decode() if keys else None,
            token=cfg.token or "",
            local=local,
            reachable=cfg.reachable,
        )
        interval, relay_port = _register(ctl, coordinator, cfg, register)
        relay = None
        if relay_port is not None and cfg.relay != "off" and coordinator.startswith("tcp://"):
            relay = _dial_relay(ctx, cfg, pid, keys, ctl.routing_id, coordinator, relay_port)
            if relay is not None:
                sockets.append(relay)

        def allow(table: PeerTable) -> None:
            allowed[0] = {k.encode(): p for p, k in zip(table.membership.peers, table.keys) if k}

        reactor = Reactor(
            ctx=ctx,
            config=cfg,
            peer_id=pid,
            data=data,
            control=ctl,
            keys=keys,
            heartbeat_interval=interval,
            register=register if cfg.rejoin else None,
            local=local,
            on_membership=allow if keys is not None else None,
            relay=relay,
        )
        reactor.start()
        return ZmqCommunicator(reactor, ctx, zap, cfg, pid, addr)
    except BaseException:
        for s in sockets:
            s.close(0)
        if zap is not None:
            zap.close()
        ctx.term()
        raise


def host_key() -> str:
    """Identifies this host *and* network namespace: peers with equal keys can reach each
    other's Unix sockets and are not separated by an emulated or shaped link."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        netns = os.stat("/proc/self/ns/net").st_ino
    except OSError:
        return f"{socket.gethostname()}-{uuid.getnode()}"
    return f"{socket.gethostname()}-{boot}-{netns}"


def _dial_relay(
    ctx: zmq.Context,
    cfg: ZmqConfig,
    pid: str,
    keys: CurveKeys | None,
    route: bytes,
    coordinator: str,
    port: int,
) -> zmq.Socket | None:
    """Dial the coordinator's relay (:mod:`transport.relay`) and wait for the handshake, so
    that messages relayed to this peer from the first epoch on find its connection there.
    None (and a warning) when it cannot: peers that cannot be dialled are then out of reach."""
    endpoint = f"{coordinator.rsplit(':', 1)[0]}:{port}"
    sock = ctx.socket(zmq.DEALER)
    sock.linger = int(cfg.linger * 1000)
    sock.routing_id = route  # the relay knows this peer by its control route, like the coordinator
    sock.sndhwm = sock.rcvhwm = cfg.send_hwm
    sock.maxmsgsize = cfg.max_message_bytes + wire.DEFAULT_MAX_META_BYTES + wire.HEADER_SIZE
    configure_client(sock, user=pid, token=cfg.token, curve=keys, server_key=cfg.curve_server_key)
    monitor = sock.get_monitor_socket(
        zmq.EVENT_HANDSHAKE_SUCCEEDED
        | zmq.EVENT_HANDSHAKE_FAILED_AUTH
        | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
        | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    )
    try:
        sock.connect(endpoint)
        if monitor.poll(int(cfg.register_timeout * 1000)):
            event = recv_monitor_message(monitor)["event"]
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                return sock
            why = f"the handshake failed ({zmq.Event(event).name})"
        else:
            why = f"no handshake within {cfg.register_timeout:.1f}s"
    finally:
        sock.disable_monitor()
        monitor.close(0)
    logger.warning(
        "cannot use the coordinator's relay at %s: %s; peers that cannot be dialled will be out "
        "of reach of %s",
        endpoint,
        why,
        pid,
    )
    sock.close(0)
    return None


def _register(
    sock: zmq.Socket, coordinator: str, cfg: ZmqConfig, register: control.Register
) -> tuple[float, int | None]:
    """Connect, send REGISTER, wait for the answer; returns the coordinator's heartbeat interval
    and the port of its relay (None: it runs none)."""
    monitor = sock.get_monitor_socket(
        zmq.EVENT_HANDSHAKE_FAILED_AUTH
        | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
        | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    )
    try:
        sock.connect(coordinator)
        sock.send_multipart(control.pack(register))
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        deadline = time.monotonic() + cfg.register_timeout
        while (left := deadline - time.monotonic()) > 0:
            ready = dict(poller.poll(int(left * 1000) + 1))
            if monitor in ready:
                event = recv_monitor_message(monitor)
                raise AuthError(
                    f"the coordinator at {coordinator} rejected this peer's credentials "
                    f"(ZeroMQ {zmq.Event(event['event']).name}): check the token / CURVE keys"
                )
            if sock in ready:
                answer = control.parse(wire.unpack(sock.recv_multipart(), max_payload_bytes=0))
                if isinstance(answer, control.Registered):
                    return answer.heartbeat_interval, answer.relay
                if isinstance(answer, control.Refused):
                    raise answer.kind.error(answer.reason)
                raise ProtocolError(f"unexpected {answer.NAME} while registering")
        raise TransportTimeout(
            f"no answer from the coordinator at {coordinator} within "
            f"{cfg.register_timeout:.1f}s (is it running and reachable?)"
        )
    finally:
        sock.disable_monitor()
        monitor.close(0)


class ZmqCommunicator(BlockingCollectives):
    """One peer's communicator. Satisfies :class:`lowband.comm.Communicator`."""

    def __init__(
        self,
        reactor: Reactor,
        ctx: zmq.Context,
        zap: ZapHandler | None,
        cfg: ZmqConfig,
        peer_id: str,
        address: str,
    ) -> None:
        self._reactor = reactor
        self._ctx = ctx
        self._zap = zap
        self.config = cfg
        self.peer_id = peer_id
        self.address = address
        self._lock = threading.Lock()
        self._epoch_seen = -1
        self._seq = 0
        self._uses: dict[str, int] = {}
        self._closed = False

    # ---- membership ---------------------------------------------------------------------------
    @property
    def membership(self) -> Membership:
        table = self._reactor.members.table
        return table.membership if table else Membership(-1, 0, 1, (self.peer_id,))

    @property
    def rank(self) -> int:
        return self.membership.rank

    @property
    def world_size(self) -> int:
        return self.membership.world_size

    @property
    def rejoins(self) -> int:
        """Times this peer was declared lost and registered again by itself (a process that
        was paused past the deadline learns of it here: its groups must re-form)."""
        return self._reactor.members.rejoins

    def quorum(self, *, min_world: int = 1, timeout: float | None = None) -> Membership:
        if min_world < 1:
            raise ConfigError("min_world", f"must be >= 1, got {min_world}")
        limit = self._timeout(timeout)
        waiter: FutureWork[Membership] = FutureWork(f"quorum(min_world={min_world})", limit)
        self._reactor.call(lambda: self._reactor.members.request_quorum(min_world, waiter))
        try:
            m = waiter.wait(limit)
        except TransportTimeout:
            self._reactor.call(lambda: self._reactor.members.cancel_quorum(waiter))
            try:  # the round may still complete before the coordinator sees the cancellation
                m = waiter.wait(max(5.0, limit))
            except TransportTimeout:
                raise TransportTimeout(
                    f"quorum: within {limit:.1f}s not every live member arrived or the group "
                    f"stayed below min_world={min_world}"
                ) from None
        with self._lock:
            if m.epoch != self._epoch_seen:
                self._epoch_seen = m.epoch
                self._seq = 0
                self._uses = {}
        return m

    # ---- helpers -------------------------------------------------------------------------------
    def _timeout(self, timeout: float | None) -> float:
        return self.config.timeout if timeout is None else timeout

    def _table(self) -> PeerTable:
        if self._closed:
            raise CommClosed("this communicator is closed")
        table = self._reactor.members.table
        if table is None:
            raise PeerLost(f"{self.peer_id} has not joined yet: call quorum() first")
        return table

    def _key(self, table: PeerTable, tag: str | None, scope: str = "") -> str:
        with self._lock:
            if table.membership.epoch != self._epoch_seen:
                self._epoch_seen = table.membership.epoch
                self._seq = 0
                self._uses = {}
            if tag is None:
                self._seq += 1
                return f"auto:{self._seq}"
            name = f"{scope}{tag}"
            n = self._uses.get(name, 0)
            self._uses[name] = n + 1
            return f"{name}#{n}"

    def _common(self, table: PeerTable, key: str, timeout: float | None, what: str) -> dict:
        limit = self._timeout(timeout)
        return {
            "table": table,
            "key": key,
            "timeout": limit,
            "work": FutureWork(f"{what} '{key}' on rank {table.membership.rank}", limit),
        }

    def choose_algorithm(
        self,
        tensor: torch.Tensor,
        codec: Codec | None = None,
        algorithm: Algorithm = "auto",
        world_size: int | None = None,
    ) -> str:
        """The schedule ``all_reduce`` will run: ring, scatter, star or shm (same host)."""
        table = self._reactor.members.table
        n = world_size if world_size is not None else (table.membership.world_size if table else 1)
        if n <= 1:
            return "star"

        def shm() -> bool:  # asked only where it matters: not on every small star
            return codec is None and table is not None and self._reactor.same_host_shm(table)

        if algorithm == "auto":
            if wire.nbytes(tensor) < self.config.star_threshold_bytes:
                algorithm = "star"
            elif n <= self.config.scatter_max_world and not shm():
                algorithm = "scatter"
            else:
                algorithm = "ring"  # on one host: shared memory, below
        if algorithm == "ring" and shm():
            return "shm"
        if algorithm == "ring" and (codec is not None or acc_dtype(tensor.dtype) != tensor.dtype):
            return "scatter"
        return algorithm

    def route(
        self, tensor: torch.Tensor, codec: Codec | None = None, algorithm: Algorithm = "auto"
    ) -> str:
        """How an ``all_reduce`` of ``tensor`` travels in the current epoch: ``shm`` (shared
        memory), ``ipc`` (Unix sockets), ``tcp``, ``relay`` (through the coordinator), or a mix
        such as ``relay+tcp``."""
        if self.choose_algorithm(tensor, codec, algorithm) == "shm":
            return "shm"
        table = self._reactor.members.table
        if table is None or table.membership.world_size <= 1:
            return "local"
        relayed = self._reactor.links.relayed
        kinds = {
            "relay"
            if pid in relayed
            else data_address(self._reactor.local, addr, loc).split("://", 1)[0]
            for pid, addr, loc in zip(table.membership.peers, table.addrs, table.locals)
            if pid != self.peer_id
        }
        return "+".join(sorted(kinds))

    @property
    def relayed_peers(self) -> tuple[str, ...]:
        """Peers this one reaches through the coordinator's relay (they cannot be dialled, or
        ``ZmqConfig.relay`` is ``always``)."""
        return tuple(sorted(self._reactor.links.relayed))

    # ---- collectives ---------------------------------------------------------------------------
    def all_reduce_async(
        self,
        tensor: torch.Tensor,
        op: ReduceOp = "sum",
        *,
        codec: Codec | None = None,
        algorithm: Algorithm = "auto",
        tag: str | None = None,
        timeout: float | None = None,
        out: torch.Tensor | None = None,
    ) -> FutureWork:
        if op not in ("sum", "avg"):
            raise ConfigError("op", f"unknown reduction {op!r}; use 'sum' or 'avg'")
        if algorithm not in ALGORITHMS:
            raise ConfigError("algorithm", f"unknown algorithm {algorithm!r}; one of {ALGORITHMS}")
        check_out(tensor, out)
        table = self._table()
        algo = self.choose_algorithm(tensor, codec, algorithm, table.membership.world_size)
        cls = {"ring": RingAllReduce, "shm": ShmAllReduce}.get(algo, OwnerAllReduce)
        common = self._common(table, self._key(table, tag), timeout, "all_reduce")
        x = tensor.detach().contiguous().reshape(-1)
        o = cls(
            **common,
            x=x,
            shape=tuple(tensor.shape),
            op=op,
            algorithm=algo,
            chunk_bytes=self.config.chunk_bytes,
            codec=codec,
            out=out,
        )
        self._reactor.submit(o)
        return o.work

    def _broadcast_async(
        self,
        tensors: Sequence[torch.Tensor] | None,
        meta: Mapping | None,
        root: int,
        tag: str | None,
        timeout: float | None,
    ) -> FutureWork:
        table = self._table()
        n = table.membership.world_size
        if not 0 <= root < n:
            raise ConfigError("root", f"rank {root} is not in a world of {n}")
        mine = None
        if table.membership.rank == root:
            if tensors is None:
                raise ConfigError("tensor", "the root of a broadcast must pass a tensor")
            mine = [t.detach().contiguous() for t in tensors]
        o = BroadcastOp(
            **self._common(table, self._key(table, tag), timeout, "broadcast"),
            root=root,
            tensors=mine,
            user_meta=meta,
            chunk_bytes=self.config.chunk_bytes,
            max_bytes=self.config.max_tensor_bytes,
        )
        self._reactor.submit(o)
        return o.work

    def all_gather_async(
        self, tensor: torch.Tensor, *, tag: str | None = None, timeout: float | None = None
    ) -> FutureWork:
        table = self._table()
        o = AllGatherOp(
            **self._common(table, self._key(table, tag), timeout, "all_gather"),
            tensor=tensor.detach().contiguous(),
            chunk_bytes=self.config.chunk_bytes,
            max_bytes=self.config.max_tensor_bytes,
        )
        self._reactor.submit(o)
        return o.work

    def barrier(self, *, tag: str | None = None, timeout: float | None = None) -> None:
        table = self._table()
        o = BarrierOp(
            **self._common(table, self._key(table, tag), timeout, "barrier"),
            chunk_bytes=self.config.chunk_bytes,
            max_bytes=0,
        )
        self._reactor.submit(o)
        o.work.wait()

    # ---- point to point ------------------------------------------------------------------------
    def _p2p_table(self, peer: int, name: str) -> PeerTable:
        table = self._table()
        n = table.membership.world_size
        if not 0 <= peer < n:
            raise ConfigError(name, f"rank {peer} is not in a world of {n}")
        return table

    def send(
        self,
        dst: int,
        tensors: Sequence[torch.Tensor],
        meta: Mapping[str, Any] | None = None,
        *,
        tag: str,
        timeout: float | None = None,
    ) -> None:
        table = self._p2p_table(dst, "dst")
        key = self._key(table, tag, scope=f"p2p:{table.membership.rank}>{dst}:")
        o = SendOp(
            **self._common(table, key, timeout, "send"),
            dst=dst,
            tensors=[t.detach().contiguous() for t in tensors],
            user_meta=meta,
            chunk_bytes=self.config.chunk_bytes,
            max_bytes=0,
        )
        self._reactor.submit(o)
        o.work.wait()

    def recv(
        self, src: int, *, tag: str, timeout: float | None = None
    ) -> tuple[list[torch.Tensor], dict[str, Any]]:
        table = self._p2p_table(src, "src")
        # Numbered by the reactor when it starts (in call order), not here: a receive that times
        # out before its message came gives the number back, so the message goes to the next
        # receive of this tag instead of shifting every later pairing by one.
        key = f"p2p:{src}>{table.membership.rank}:{tag}"
        o = RecvOp(
            **self._common(table, key, timeout, "recv"),
            src=src,
            chunk_bytes=self.config.chunk_bytes,
            max_bytes=self.config.max_tensor_bytes,
        )
        self._reactor.submit(o)
        try:
            return o.work.wait()
        except TransportTimeout as exc:
            # Withdraw it on the reactor thread before giving up: a message that arrives in
            # between must either complete this receive (and be returned) or stay for the next.
            settled = threading.Event()

            def withdraw(e: BaseException = exc) -> None:
                if not o.finished:
                    o.fail(self._reactor, e)
                settled.set()

            self._reactor.call(withdraw)
            settled.wait(5.0)
            return o.work.wait(0)

    # ---- bookkeeping ---------------------------------------------------------------------------
    def stats(self) -> OpStats:
        return self._reactor.stats()

    @property
    def bad_messages(self) -> int:
        """Malformed or unexpected data messages dropped so far (each one was logged)."""
        return self._reactor.bad_messages

    @property
    def auth_rejections(self) -> int:
        """Connections to this peer's data socket refused at the handshake."""
        return self._reactor.links.watch.failures

    def close(self) -> None:
        """Leave the group (peers get PEER_LOST at once) and release every socket.

        Closing right after a collective returns is safe: an all-reduce completes only once
        ZeroMQ has handed its last sends to the kernel, the BYEs follow them on every
        connection, and a peer still receiving them keeps waiting as long as they keep coming.
        Only what is still queued in ZeroMQ (the BYEs behind a full kernel buffer) gets no more
        than ``ZmqConfig.linger`` seconds."""
        if self._closed:
            return
        self._closed = True
        self._reactor.close(leave=True, timeout=max(5.0, self.config.linger + 1))
        if self._zap is not None:
            self._zap.close()
        if self._reactor.running:
            # Its sockets are still open: terminating the context would block forever.
            logger.error(
                "the transport reactor of %s did not stop; leaving its sockets open", self.peer_id
            )
            return
        self._ctx.term()

    def __enter__(self) -> "ZmqCommunicator":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
