"""The peer reactor: one thread that owns every ZeroMQ socket of a peer.

ZeroMQ sockets are not thread-safe, so user threads never touch them: they hand operations
(:class:`transport.ops.Op`) to the reactor through a queue and an eventfd wake-up, and
wait on the operation's :class:`~transport.work.FutureWork`. The reactor thread polls, and hands
what it reads to the three parts it composes, each owning its state:

* :mod:`transport.peerlinks`: the sockets. Data arrives on one PULL socket; it leaves through K
  PUSH sockets per remote peer, never blocking (back-pressure goes to a backlog); the
  coordinator is reached on a DEALER socket (heartbeats, quorum rounds, peer-lost notices).
* :mod:`transport.routing`: routes every data message to the operation it belongs to, keyed by
  ``(epoch, op key)``, keeps messages for operations this peer has not started yet, enforces
  deadlines and completes operations once their zero-copy sends of caller-visible buffers are
  released by ZeroMQ (so a caller may reuse a tensor as soon as the call returns).
* :mod:`transport.membership`: the peer table, lost peers (the PeerLost contract), quorum
  rounds, expulsion and rejoining, the coordinator's liveness.

Reductions run on this thread too: while it adds one chunk, ZeroMQ's I/O thread keeps reading the
next ones from the kernel, which is what overlaps receive with reduction. Everything above runs on
this thread; the only entries from other threads are :meth:`Reactor.call`, :meth:`Reactor.submit`
and :meth:`Reactor.close`, which queue work for it.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from typing import TYPE_CHECKING, Any, Callable

import zmq

from lowband.comm import OpStats
from lowband.errors import CommClosed, ProtocolError
from transport import relay as relay_wire
from transport import wire
from transport.auth import CurveKeys
from transport.buffers import BufferPool
from transport.config import ZmqConfig
from transport.control import Leave, Register
from transport.membership import Members
from transport.peerlinks import PeerLinks
from transport.peers import PeerTable
from transport.routing import Routing
from transport.shm import PeerSlabs, SlabPool
from transport.wire import MsgType

if TYPE_CHECKING:
    from transport.ops import Op

logger = logging.getLogger(__name__)


class Reactor:
    """The I/O loop of one peer; see the module docstring. Created and started by
    ``zmq_comm.connect``. Satisfies :class:`transport.ops.Host` for the operations it drives.

    ``local`` is this peer's same-host identity ([host key, ipc endpoint or "", shm key or ""]),
    ``on_membership`` is called (on the reactor thread) with every new peer table."""

    def __init__(
        self,
        *,
        ctx: zmq.Context,
        config: ZmqConfig,
        peer_id: str,
        data: zmq.Socket,
        control: zmq.Socket,
        keys: CurveKeys | None,
        heartbeat_interval: float,
        register: Register | None = None,
        local: list[str] | None = None,
        on_membership: Callable[[PeerTable], None] | None = None,
        relay: zmq.Socket | None = None,
    ) -> None:
        self.cfg = config
        self.peer_id = peer_id
        self.local = local
        self._wake_fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._cmds: deque[Callable[[], None]] = deque()
        self._poller = zmq.Poller()
        self.links = PeerLinks(
            ctx=ctx,
            config=config,
            peer_id=peer_id,
            keys=keys,
            data=data,
            control=control,
            poller=self._poller,
            heartbeat_interval=heartbeat_interval,
            relay=relay,
        )
        # operations send through the links (transport.ops.Host.send), under the same signature
        self.send = self.links.send
        self._poller.register(data, zmq.POLLIN)
        self._poller.register(control, zmq.POLLIN)
        self._poller.register(self._wake_fd, zmq.POLLIN)
        self._poller.register(self.links.watch.socket, zmq.POLLIN)
        if relay is not None:
            self._poller.register(relay, zmq.POLLIN)
        self.routing = Routing(
            host=self, links=self.links, config=config, peer_id=peer_id, bad=self._bad
        )
        self.members = Members(
            config=config,
            peer_id=peer_id,
            links=self.links,
            routing=self.routing,
            heartbeat_interval=heartbeat_interval,
            register=register,
            local=local,
            on_membership=on_membership,
            on_lost=self._forget_shm,
            bad=self._bad,
        )
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run, name=f"lowband-reactor-{peer_id}", daemon=True
        )
        self.stats_lock = threading.Lock()
        self.sent = 0
        self.received = 0
        self.bad_messages = 0
        self.pool = BufferPool(config.result_pool_bytes)
        self._slabs: Any = None
        self._peer_slabs: Any = None
        self.shm_pids: dict[str, int] = {}  # peer id -> OS pid whose slabs this peer maps

    # ---- called from user threads ---------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def call(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` on the reactor thread (soon, in submission order)."""
        if self._stop.is_set():
            raise CommClosed("this communicator is closed")
        self._cmds.append(fn)
        os.eventfd_write(self._wake_fd, 1)

    def submit(self, op: "Op") -> None:
        self.call(lambda: self._start_op(op))

    def close(self, leave: bool, timeout: float = 5.0) -> None:
        if self._stop.is_set():
            return
        done = threading.Event()

        def shutdown() -> None:
            if leave and self.members.expelled is None:
                # BYE goes last on every connection, after all data: a peer that sees our
                # departure (PEER_LOST, on another channel) first waits for these, so data we
                # already sent for a collective it still runs is not thrown away.
                self.links.send_byes()
                self.links.send_control(Leave())
            self._fail_all(
                CommClosed("the communicator was closed while this operation was pending")
            )
            self._stop.set()
            done.set()

        try:
            self.call(shutdown)
        except CommClosed:
            return
        done.wait(timeout)
        self._stop.set()
        self._thread.join(timeout)
        if not self._thread.is_alive():
            os.close(self._wake_fd)

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def stats(self) -> OpStats:
        with self.stats_lock:
            return OpStats(self.sent, self.received)

    # ---- what operations see (transport.ops.Host; reactor thread) -------------------------------
    def count(self, sent: int = 0, received: int = 0) -> None:
        with self.stats_lock:
            self.sent += sent
            self.received += received

    def done(self, op: "Op") -> None:
        """Called by an op once its result is final; completes it when its sends are released."""
        self.routing.done(op)

    def forget(self, op: "Op") -> None:
        self.routing.forget(op)

    def tick(self) -> None:
        """Heartbeat if one is due. Long-running work on this thread (a big shared-memory
        reduction, encoding many chunks) calls this between pieces, so the coordinator never
        mistakes a busy peer for a dead one."""
        if not self.members.rejoining:
            self.links.heartbeat()

    def shm_slabs(self) -> Any:
        """This peer's shared-memory slabs (created on first use; see transport.shm)."""
        if self._slabs is None:
            self._slabs = SlabPool(self.cfg.result_pool_bytes * 2 or (1 << 30))
        return self._slabs

    def shm_peers(self) -> Any:
        if self._peer_slabs is None:
            self._peer_slabs = PeerSlabs()
        return self._peer_slabs

    def same_host_shm(self, table: PeerTable) -> bool:
        """Whether every member of ``table`` (this peer included) offers the shared-memory
        path with this peer's key: same host and network namespace, same user and PID
        namespace (slabs are opened through ``/proc/<pid>/fd``). Computed from the
        coordinator's table, so all ranks agree."""
        mine = self.local
        if mine is None or len(mine) < 3 or not mine[2]:
            return False
        return all(
            isinstance(loc, list) and len(loc) >= 3 and loc[0] == mine[0] and loc[2] == mine[2]
            for loc in table.locals
        )

    def _forget_shm(self, pid: str) -> None:
        """A lost peer's slabs go once no view of ours remains."""
        os_pid = self.shm_pids.pop(pid, None)
        if os_pid is not None and self._peer_slabs is not None:
            self._peer_slabs.forget(os_pid)

    # ---- dispatch (reactor thread) --------------------------------------------------------------
    def _start_op(self, op: "Op") -> None:
        if self.members.expelled is not None:
            op.fail(self, self.members.expelled)
            return
        self.routing.start(op, lost=self.members.lost, crashed=self.members.crashed)

    def _fail_all(self, exc: BaseException) -> None:
        """Fail every op and any pending quorum (closing, reactor crashed)."""
        self.routing.fail_all(exc)
        self.members.fail_waiters(exc)

    def _on_relayed(self, frames: list[zmq.Frame]) -> None:
        """A data message the coordinator's relay brought, with the sender it vouches for."""
        try:
            sender, inner = relay_wire.envelope(frames, "from")
        except ProtocolError as exc:
            self._bad(f"dropped a relayed message: {exc}")
            return
        self._on_data(inner, vouched=sender)

    def _on_data(self, frames: list[zmq.Frame], vouched: str | None = None) -> None:
        """A data message; ``vouched``: the sender the relay authenticated (else the data
        socket's ZAP User-Id is the proof, when authentication is on)."""
        try:
            msg = wire.unpack(frames, max_payload_bytes=self.cfg.max_message_bytes)
            if msg.type < MsgType.CHUNK:
                raise ProtocolError(f"control message {msg.type.name} on the data socket")
            epoch = wire.int_field(msg.meta, "e", 0)
            key = wire.field(msg.meta, "o", str)
            sender = wire.field(msg.meta, "p", str)
            if msg.type == MsgType.BYE:
                expected = wire.int_field(msg.meta, "n", 1, 64)
        except ProtocolError as exc:
            self._bad(f"dropped a data message: {exc}")
            return
        if vouched is not None:
            if vouched != sender:
                self._bad(
                    f"dropped a relayed message claiming to be from {sender!r}, "
                    f"relayed for {vouched!r}"
                )
                return
        elif self.cfg.token is not None or self.cfg.curve_server_key is not None:
            user = _user_id(frames[0])
            if user != sender:
                self._bad(
                    f"dropped a message claiming to be from {sender!r} on a connection "
                    f"authenticated as {user!r}"
                )
                return
        if msg.type == MsgType.BYE:
            self.members.on_bye(sender, expected)
            return
        self.members.heard_from(sender)
        self.routing.route(
            msg, epoch, key, self.members.epoch, member=self.members.expelled is None
        )

    def _bad(self, what: str) -> None:
        self.bad_messages += 1
        if self.bad_messages <= 20 or self.bad_messages % 1000 == 0:
            logger.warning("%s (bad messages so far: %d)", what, self.bad_messages)

    # ---- the loop -------------------------------------------------------------------------------
    def _run(self) -> None:
        links = self.links
        next_sweep = 0.0
        try:
            while not self._stop.is_set():
                wait_ms = 1 if self.routing.finishing else 50
                for sock, ev in self._poller.poll(wait_ms):
                    if sock is links.data:
                        self._drain(links.data, self._on_data, copy=False)
                    elif sock is links.control:
                        self._drain(links.control, self.members.on_control, copy=True)
                    elif links.relay is not None and sock is links.relay:
                        if ev & zmq.POLLIN:
                            self._drain(links.relay, self._on_relayed, copy=False, envelope=1)
                        if ev & zmq.POLLOUT:
                            links.flush(links.relay)
                    elif sock == self._wake_fd:
                        self._run_commands()
                    elif sock is links.watch.socket:
                        links.watch.drain()
                    elif links.is_monitor(sock):
                        links.on_monitor(sock)
                    elif ev & zmq.POLLOUT:
                        links.flush(sock)
                if self.routing.finishing:
                    self.routing.settle_finished()
                self.tick()
                now = time.monotonic()
                if now >= next_sweep:
                    self.members.sweep(now)
                    self.routing.sweep(now)
                    next_sweep = now + 0.05
        except zmq.ContextTerminated:
            pass
        except Exception:  # keep the process alive; fail every caller loudly instead
            logger.exception("lowband reactor crashed")
            self._fail_all(CommClosed("the transport reactor crashed; see the log"))
        finally:
            self._stop.set()
            links.close_peers()
            if self._slabs is not None:
                self._slabs.close()
            links.close()

    def _drain(
        self, sock: zmq.Socket, handle: Callable[[Any], None], copy: bool, envelope: int = 0
    ) -> None:
        for _ in range(64):
            try:
                # (a relay envelope,) the header frame + at most MAX_PAYLOAD_FRAMES payload frames
                frames = wire.recv_bounded(
                    sock, copy=copy, max_frames=wire.MAX_PAYLOAD_FRAMES + 1 + envelope
                )
            except zmq.Again:
                return
            if frames is None:
                self._bad(f"dropped a message of more than {wire.MAX_PAYLOAD_FRAMES} frames")
                continue
            handle(frames)

    def _run_commands(self) -> None:
        try:
            os.eventfd_read(self._wake_fd)
        except BlockingIOError:
            pass
        while self._cmds:
            fn = self._cmds.popleft()
            try:
                fn()
            except Exception:
                logger.exception("reactor command failed")


def _user_id(frame: zmq.Frame) -> str | None:
    try:
        user = frame.get("User-Id")
    except zmq.ZMQError:
        return None
    return None if user is None else str(user)
