"""The peer engine: one thread that owns every ZeroMQ socket of a peer.

ZeroMQ sockets are not thread-safe, so user threads never touch them: they hand operations
(:class:`transport.ops.Op`) to the engine through a queue and an eventfd wake-up, and
wait on the operation's :class:`~transport.work.FutureWork`. The engine thread

* receives every data message on one PULL socket (bound, authenticated through ZAP) and routes it
  to the operation it belongs to, keyed by ``(epoch, op key)``; messages for operations this peer
  has not started yet are kept (zero-copy frames) until it does;
* sends through K PUSH sockets (K TCP connections) per remote peer, never blocking: a socket at its
  high-water mark gets a backlog and POLLOUT interest, so a slow receiver cannot deadlock the
  thread that must also keep receiving;
* talks to the coordinator on a DEALER socket: heartbeats, quorum rounds, peer-lost notices;
* enforces deadlines and completes operations once their zero-copy sends of caller-visible
  buffers are released by ZeroMQ (so a caller may reuse a tensor as soon as the call returns).

Reductions run on this thread too: while it adds one chunk, ZeroMQ's I/O thread keeps reading the
next ones from the kernel, which is what overlaps receive with reduction.

Lost peers (the PeerLost contract of :mod:`lowband.comm`)
-----------------------------------------------------------
The coordinator tells every survivor about a lost peer. A *crashed* peer fails every unfinished
op it takes part in, and every one started later in that epoch. A peer that *left* (its BYEs
follow all its data on every connection) fails only the ops that still need data from it, so a
peer that contributed and then left does not fail what it completed. Either way a survivor can
also be stuck *behind another survivor*: the crashed peer's ring neighbour stops forwarding, a
star root whose contributor left never answers. So a rank that fails an op for a lost peer sends
ABORT (with the lost peers) to the op's other live participants, which fail it with PeerLost
too; an ABORT for an op not started yet is kept and fails it the moment it starts. By induction
along who-waits-on-whom, every survivor raises PeerLost, none waits for its deadline. A lost
peer never fails a pending quorum: the coordinator drops it from the round.

Expelled peers rejoin by themselves
----------------------------------
A peer the coordinator declared lost (it was paused longer than the deadline: SIGSTOP, a laptop
lid, swap) learns it from the REFUSED "expelled" answer to its next heartbeat, or a restarted
coordinator answers the same. Its pending operations fail with PeerLost as before, but with
``ZmqConfig.rejoin`` the engine sends REGISTER again right away (same id, same data address):
until REGISTERED comes back new operations fail fast and quorum requests are held, then the
held requests go out and the peer enters the next epoch as a newcomer. What the application
does with a newcomer (a state transfer, a re-assigned slot) is its business. Survivors forget
that a peer id was lost once it is a member again.

Point-to-point receives are numbered here, in the order they start, per (source, tag); one that
ends before a byte of its message arrived gives its number back, so an abandoned receive never
shifts which message a later receive gets.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from typing import TYPE_CHECKING, Any, Callable, Sequence

import zmq
from zmq.utils.monitor import recv_monitor_message

from lowband.comm import Membership, OpStats
from lowband.errors import CommClosed, PeerLost, ProtocolError, TransportTimeout
from transport import wire
from transport.auth import CurveKeys, HandshakeWatch, configure_client
from transport.buffers import BufferPool
from transport.config import ZmqConfig
from transport.peers import PeerTable, data_address
from transport.shm import PeerSlabs, SlabPool
from transport.wire import MsgType

if TYPE_CHECKING:
    from transport.ops import Op

logger = logging.getLogger(__name__)

Key = tuple[int, str]  # (epoch, op key)


class _Out:
    """The K connections to one remote peer, each with a backlog used only under back-pressure."""

    def __init__(self, sockets: list[zmq.Socket]) -> None:
        self.sockets = sockets
        self.backlog: list[deque] = [deque() for _ in sockets]
        self.next = 0
        self.monitor: zmq.Socket | None = None


class Reactor:
    """Owns the sockets; see the module docstring. Created and started by ``zmq_comm.connect``."""

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
        register_meta: dict[str, Any] | None = None,
    ) -> None:
        self.ctx = ctx
        self.cfg = config
        self.peer_id = peer_id
        self.keys = keys
        self._data = data
        self._control = control
        self._hb_period = heartbeat_interval / 3
        self._next_hb = 0.0
        self._control_warned = 0.0
        self._coord_silence = max(config.coordinator_grace, 2 * heartbeat_interval)
        self._bye_grace = max(2.0, 2 * heartbeat_interval)
        self._wake_fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._cmds: deque[Callable[[], None]] = deque()
        self._poller = zmq.Poller()
        self._poller.register(data, zmq.POLLIN)
        self._poller.register(control, zmq.POLLIN)
        self._poller.register(self._wake_fd, zmq.POLLIN)
        self.watch = HandshakeWatch(data, f"the data socket of {peer_id}")
        self._poller.register(self.watch.socket, zmq.POLLIN)
        self._out: dict[str, _Out] = {}
        self._by_socket: dict[zmq.Socket, tuple[_Out, int]] = {}
        self._monitors: dict[zmq.Socket, str] = {}
        self._ops: dict[Key, "Op"] = {}
        self._early: dict[Key, list[wire.Message]] = {}
        self._early_bytes = 0
        self._finishing: list["Op"] = []
        self._done_keys: set[Key] = set()  # finished here: late messages for them are dropped
        self._aborted: dict[Key, wire.Message] = {}  # ABORTs for ops not started here yet
        self._rx_next: dict[tuple[int, str], int] = {}  # receive side of p2p: next message number
        self._recvs: dict[tuple[int, str], list["Op"]] = {}  # bound, unfinished receives, in order
        self._table: PeerTable | None = None
        self._lost: set[str] = set()
        self._crashed: set[str] = set()  # lost without a goodbye (a subset of _lost)
        self._byes: dict[str, int] = {}  # peer -> BYE messages received (one per connection)
        self._bye_expected: dict[str, int] = {}
        self._departing: dict[str, tuple[float, str]] = {}  # left, BYEs pending: deadline, why
        self._quorum_waiters: list[Any] = []
        self._cancelling: list[Any] = []
        self._expelled: BaseException | None = None
        # REGISTER of connect(); None disables rejoining (ZmqConfig.rejoin=False)
        self._register_meta = register_meta
        self._rejoining = False
        self._held_quorum: int | None = None  # largest min_world asked while rejoining
        self._expelled_at: float | None = None
        self.rejoins = 0
        self._coord_seen = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run, name=f"lowband-engine-{peer_id}", daemon=True
        )
        self.stats_lock = threading.Lock()
        self.sent = 0
        self.received = 0
        self.bad_messages = 0
        self.on_membership: Callable[[PeerTable], None] | None = None
        self.pool = BufferPool(config.result_pool_bytes)
        self._slabs: Any = None
        self._peer_slabs: Any = None
        self.shm_pids: dict[str, int] = {}  # peer id -> OS pid whose slabs this peer maps
        self.local: list[str] | None = None  # [host key, ipc endpoint or "", shm key or ""]

    # ---- called from user threads ---------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def call(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` on the engine thread (soon, in submission order)."""
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
            if leave and self._expelled is None:
                # BYE goes last on every connection, after all data: a peer that sees our
                # departure (PEER_LOST, on another channel) first waits for these, so data we
                # already sent for a collective it still runs is not thrown away.
                for pid, out in self._out.items():
                    for i in range(len(out.sockets)):
                        self.send(
                            pid,
                            MsgType.BYE,
                            {"e": 0, "o": "", "p": self.peer_id, "n": len(out.sockets)},
                            stripe=i,
                        )
                self._send_control(MsgType.LEAVE, {})
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

    # ---- sending (engine thread) ------------------------------------------------------------
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

    def _flush(self, sock: zmq.Socket) -> None:
        out, i = self._by_socket[sock]
        backlog = out.backlog[i]
        while backlog:
            try:
                sock.send_multipart(backlog[0], zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            backlog.popleft()
        self._poller.unregister(sock)

    def _send_control(self, mtype: MsgType, meta: dict[str, Any]) -> None:
        try:
            self._control.send_multipart(wire.pack(mtype, meta), zmq.NOBLOCK)
        except zmq.Again:  # the coordinator is unreachable and the queue is full
            now = time.monotonic()
            if now - self._control_warned > 10:
                self._control_warned = now
                logger.warning(
                    "cannot reach the coordinator; dropped a %s (and maybe more)", mtype.name
                )

    def count(self, sent: int = 0, received: int = 0) -> None:
        with self.stats_lock:
            self.sent += sent
            self.received += received

    # ---- membership ---------------------------------------------------------------------------
    @property
    def table(self) -> PeerTable | None:
        return self._table

    def request_quorum(self, min_world: int, waiter: Any) -> None:
        if self._rejoining:  # asked once REGISTERED comes back
            self._quorum_waiters.append(waiter)
            self._held_quorum = max(self._held_quorum or 1, min_world)
            return
        if self._expelled is not None and self._register_meta is None:
            waiter.set_error(self._expelled)
            return
        self._quorum_waiters.append(waiter)
        self._send_control(MsgType.QUORUM, {"min_world": min_world})

    def cancel_quorum(self, waiter: Any) -> None:
        """Withdraw from the quorum round. The coordinator acknowledges, and only then does the
        waiter fail: if the round completes first, the waiter gets the new membership instead,
        so a timed-out quorum() never leaves this peer half in a new epoch."""
        if waiter in self._quorum_waiters and self._rejoining:  # never sent: nothing to ack
            self._quorum_waiters.remove(waiter)
            waiter.set_error(TransportTimeout("quorum cancelled while rejoining"))
        elif waiter in self._quorum_waiters:
            self._cancelling.append(waiter)
            self._send_control(MsgType.QUORUM_CANCEL, {})

    def _apply_membership(self, meta: dict[str, Any]) -> None:
        peers = tuple(wire.str_list(meta, "peers"))
        epoch = wire.int_field(meta, "epoch", 0)
        rank = wire.int_field(meta, "rank", 0, len(peers) - 1)
        addrs = tuple(wire.str_list(meta, "addrs"))
        keys = tuple(wire.field(meta, "keys", list))
        if len(addrs) != len(peers) or len(keys) != len(peers) or peers[rank] != self.peer_id:
            raise ProtocolError("inconsistent MEMBERSHIP message")
        m = Membership(
            epoch,
            rank,
            len(peers),
            peers,
            tuple(wire.str_list(meta, "joined")),
            tuple(wire.str_list(meta, "left")),
        )
        locals_ = tuple(meta.get("locals") or [None] * len(peers))
        if len(locals_) != len(peers):
            raise ProtocolError("inconsistent MEMBERSHIP message")
        table = PeerTable(m, addrs, keys, locals_)
        old = self._table
        if self._register_meta is not None and not self._rejoining:
            self._expelled = None  # rejoined: a member again
        # A member that was lost earlier has rejoined under its old id: it is a fresh peer now.
        for pid in peers:
            self._lost.discard(pid)
            self._crashed.discard(pid)
            self._byes.pop(pid, None)
            self._bye_expected.pop(pid, None)
            self._departing.pop(pid, None)
        self._table = table
        for pid in list(self._out):
            if pid not in table.index:
                self._disconnect(pid)
        for pid, addr, key, local in zip(peers, addrs, keys, locals_):
            if pid != self.peer_id and pid not in self._out:
                self._connect(pid, data_address(self.local, addr, local), key)
        if old is None or old.membership.epoch != epoch:
            self._early = {k: v for k, v in self._early.items() if k[0] >= epoch}
            self._done_keys = {k for k in self._done_keys if k[0] >= epoch}
            self._aborted = {k: v for k, v in self._aborted.items() if k[0] >= epoch}
            self._rx_next = {k: v for k, v in self._rx_next.items() if k[0] >= epoch}
            self._early_bytes = sum(_msg_bytes(m) for v in self._early.values() for m in v)
        if self.on_membership is not None:
            self.on_membership(table)
        waiters, self._quorum_waiters, self._cancelling = self._quorum_waiters, [], []
        for w in waiters:
            w.set_result(m)

    def _connect(self, pid: str, addr: str, key: str | None) -> None:
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
        # Watch one connection for a drop: a crashed peer's kernel closes its sockets at once,
        # and telling the coordinator (SUSPECT) gets it declared lost after one silent
        # heartbeat interval instead of two.
        out.monitor = sockets[0].get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self._monitors[out.monitor] = pid
        self._poller.register(out.monitor, zmq.POLLIN)
        self._out[pid] = out
        for i, s in enumerate(sockets):
            self._by_socket[s] = (out, i)

    def _disconnect(self, pid: str) -> None:
        out = self._out.pop(pid, None)
        if out is None:
            return
        self._drop_monitor(out)
        for s in out.sockets:
            self._by_socket.pop(s, None)
            if s in self._poller:
                self._poller.unregister(s)
            s.close(0)

    def _drop_monitor(self, out: "_Out") -> None:
        if out.monitor is None:
            return
        self._monitors.pop(out.monitor, None)
        self._poller.unregister(out.monitor)
        out.sockets[0].disable_monitor()
        out.monitor.close(0)
        out.monitor = None

    def _on_monitor(self, mon: zmq.Socket) -> None:
        pid = self._monitors.get(mon)
        while True:
            try:
                event = recv_monitor_message(mon, zmq.NOBLOCK)
            except zmq.Again:
                return
            if pid is not None and event["event"] == zmq.EVENT_DISCONNECTED:
                logger.info("connection to %s dropped; reporting it to the coordinator", pid)
                self._send_control(MsgType.SUSPECT, {"peer": pid})

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

    # ---- operations -----------------------------------------------------------------------------
    def _start_op(self, op: "Op") -> None:
        if self._expelled is not None:
            op.fail(self, self._expelled)
            return
        if op.p2p_recv:
            self._bind_recv(op)
        key = (op.epoch, op.key)
        if key in self._ops:
            op.fail(self, ProtocolError(f"two operations with key '{op.key}' in flight"))
            return
        self._ops[key] = op
        try:
            abort = self._aborted.pop(key, None)
            if abort is not None:  # another participant already gave this operation up
                self._drop_early(key)
                self._deliver(op, abort)
                return
            crashed = [p for p in op.peers_involved() if p in self._crashed]
            if crashed:
                self._drop_early(key)
                self._fail_lost(op, crashed, "crashed")
                return
            op.start(self)
            early = self._drop_early(key)
            for msg in early:
                if op.finished:
                    break
                self._deliver(op, msg)
            # A peer that left gracefully may have sent everything this op needs before it
            # went: fail only if the op still needs something from it.
            lost = [p for p in op.peers_involved() if p in self._lost and op.needs(p)]
            if lost and not op.finished:
                self._fail_lost(op, lost, "left")
        except Exception as exc:  # a bug or bad input must fail the op, not kill the engine
            logger.exception("%s failed", op.describe())
            op.fail(
                self, exc if isinstance(exc, (ProtocolError, PeerLost)) else ProtocolError(str(exc))
            )

    def _drop_early(self, key: Key) -> list[wire.Message]:
        early = self._early.pop(key, [])
        self._early_bytes -= sum(_msg_bytes(m) for m in early)
        return early

    def _bind_recv(self, op: "Op") -> None:
        """Give a receive the number of the next message from its source with its tag.

        Numbers are handed out here, on the engine thread, in the order receives start; a
        receive that ends without a byte of its message gives its number back (see
        :meth:`_unbind_recv`), so an abandoned receive never shifts later pairings."""
        name = (op.epoch, op.key)
        n = self._rx_next.get(name, 0)
        self._rx_next[name] = n + 1
        self._recvs.setdefault(name, []).append(op)
        op.p2p_name, op.key = op.key, f"{op.key}#{n}"

    def _unbind_recv(self, op: "Op") -> bool:
        """Called when a receive fails. True if its number went back: later receives of the
        same source and tag (none of which has seen a byte yet) move one number down."""
        name = (op.epoch, op.p2p_name)
        queue = self._recvs.get(name, [])
        if op not in queue:
            return False
        i = queue.index(op)
        queue.pop(i)
        later = queue[i:]
        if op.received or any(o.received or o.assembler.busy for o in later) or op.assembler.busy:
            return False  # part of its message is here already: the number stays used
        for o in reversed(later):  # renumber n+1 -> n, n+2 -> n+1, ...
            old = (o.epoch, o.key)
            base, num = o.key.rsplit("#", 1)
            o.key = f"{base}#{int(num) - 1}"
            self._ops[(o.epoch, o.key)] = self._ops.pop(old)
        self._rx_next[name] -= 1
        if not queue:
            self._recvs.pop(name, None)
        return True

    def _fail_lost(self, op: "Op", lost: Sequence[str], how: str) -> None:
        """Fail ``op`` because peers are gone, and tell its other live participants: they may
        wait on data this rank will now never send (the lost peer's ring neighbour stops
        forwarding, a star root stops answering), which no lost-peer notice of theirs covers."""
        names = ", ".join(lost)
        op.fail(self, PeerLost(f"{op.describe()}: peer(s) {names} {how}", peers=tuple(lost)))
        self._abort(op, f"peer(s) {names} {how}", lost=list(lost))

    def done(self, op: "Op") -> None:
        """Called by an op once its result is final; completes it when its sends are released."""
        if op.pending_trackers():
            self._finishing.append(op)
        else:
            op.settle(self)
        self._ops.pop((op.epoch, op.key), None)
        self._done_keys.add((op.epoch, op.key))
        if op.p2p_recv:
            queue = self._recvs.get((op.epoch, op.p2p_name), [])
            if op in queue:
                queue.remove(op)

    def forget(self, op: "Op") -> None:
        self._ops.pop((op.epoch, op.key), None)
        if op.p2p_recv and self._unbind_recv(op):
            return  # the number went back: its message, when it comes, is the next receive's
        self._done_keys.add((op.epoch, op.key))
        if op in self._finishing:
            self._finishing.remove(op)

    def _deliver(self, op: "Op", msg: wire.Message) -> None:
        src_peer = msg.meta["p"]
        src = op.rank_of(src_peer)
        if src is None:
            self._bad(f"{msg.type.name} for {op.describe()} from {src_peer}, not a member")
            return
        if msg.type == MsgType.ABORT:
            reason = str(msg.meta.get("reason", "?"))[:2000]
            lost = msg.meta.get("lost")
            if isinstance(lost, list) and lost and all(isinstance(p, str) for p in lost):
                op.fail(
                    self,
                    PeerLost(
                        f"{op.describe()}: rank {src} gave it up: {reason}", peers=tuple(lost[:64])
                    ),
                )
            else:
                op.fail(self, ProtocolError(f"{op.describe()} was aborted by rank {src}: {reason}"))
            return
        try:
            op.on_message(self, src, msg)
        except ProtocolError as exc:
            if getattr(exc, "fatal", False):
                op.fail(self, exc)
                self._abort(op, str(exc))
            else:
                self._bad(f"{op.describe()}: {exc}")
        except Exception as exc:  # a message we did not anticipate: drop it, keep serving
            logger.debug("unexpected error handling a message", exc_info=True)
            self._bad(f"{op.describe()}: dropped a message that raised {type(exc).__name__}: {exc}")

    def _abort(self, op: "Op", reason: str, lost: list[str] | None = None) -> None:
        """Tell the other participants an operation cannot succeed, so they fail now rather
        than at their deadline (with PeerLost when ``lost`` names the peers that are gone)."""
        extra = {"lost": lost} if lost else {}
        for peer in op.peers_involved():
            if peer != self.peer_id and peer in self._out:
                self.send(peer, MsgType.ABORT, op.meta(reason=reason[:2000], **extra))

    def _fail_all(self, exc: BaseException) -> None:
        """Fail every op and any pending quorum (closing, expelled, engine crashed)."""
        for op in list(self._ops.values()) + list(self._finishing):
            op.fail(self, exc)
        for w in self._quorum_waiters:
            w.set_error(exc)
        self._quorum_waiters = []

    # ---- receiving ------------------------------------------------------------------------------
    def _on_data(self, frames: list[zmq.Frame]) -> None:
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
        if self.cfg.token is not None or self.cfg.curve_server_key is not None:
            user = _user_id(frames[0])
            if user != sender:
                self._bad(
                    f"dropped a message claiming to be from {sender!r} on a connection "
                    f"authenticated as {user!r}"
                )
                return
        if msg.type == MsgType.BYE:
            self._on_bye(sender, expected)
            return
        n = sum(len(p) for p in msg.payload)
        op = self._ops.get((epoch, key))
        if op is not None:
            self._deliver(op, msg)
            return
        if (epoch, key) in self._done_keys:
            return  # a late or duplicate message for an operation that already ended here
        current = self._table.membership.epoch if self._table else -1
        if epoch < current:
            return  # a straggler of a finished or abandoned epoch
        if msg.type == MsgType.ABORT:
            # Kept apart from early data (and capped): when this peer starts the operation,
            # it fails at once instead of waiting for data that will never come.
            if len(self._aborted) >= _MAX_ABORTED:
                self._bad(f"dropped an ABORT for '{key}': {_MAX_ABORTED} are pending already")
            else:
                self._aborted[(epoch, key)] = msg
            return
        if self._early_bytes + n > self.cfg.max_pending_bytes:
            self._bad(
                f"dropped a message for '{key}' (epoch {epoch}): more than "
                f"{self.cfg.max_pending_bytes} bytes wait for operations not started here"
            )
            return
        self._early.setdefault((epoch, key), []).append(msg)
        self._early_bytes += n

    def _bad(self, what: str) -> None:
        self.bad_messages += 1
        if self.bad_messages <= 20 or self.bad_messages % 1000 == 0:
            logger.warning("%s (bad messages so far: %d)", what, self.bad_messages)

    def _on_control(self, frames: list[bytes]) -> None:
        self._coord_seen = time.monotonic()
        try:
            msg = wire.unpack(frames, max_payload_bytes=0)
            if msg.type == MsgType.MEMBERSHIP:
                self._apply_membership(msg.meta)
            elif msg.type == MsgType.PEER_LOST:
                self._peer_lost(
                    wire.str_list(msg.meta, "peers"),
                    str(msg.meta.get("reason", "lost")),
                    msg.meta.get("left") is True,
                )
            elif msg.type == MsgType.QUORUM_CANCEL:  # the coordinator's acknowledgement
                for w in self._cancelling:
                    if w in self._quorum_waiters:
                        self._quorum_waiters.remove(w)
                    w.set_error(TransportTimeout("quorum cancelled"))
                self._cancelling = []
            elif msg.type == MsgType.REFUSED:
                if self._rejoining and msg.meta.get("kind") == "expelled":
                    return  # the answer to a heartbeat sent before our new REGISTER
                if self._rejoining:  # the coordinator will not take us back: final
                    self._rejoining = False
                    self._register_meta = None
                self._expel(str(msg.meta.get("reason", "refused")))
            elif msg.type == MsgType.REGISTERED:
                self._rejoined()
            elif msg.type != MsgType.HEARTBEAT_ACK:
                raise ProtocolError(f"unexpected {msg.type.name} from the coordinator")
        except ProtocolError as exc:
            self._bad(f"bad message from the coordinator: {exc}")

    def _on_bye(self, pid: str, expected: int) -> None:
        self._byes[pid] = self._byes.get(pid, 0) + 1
        self._bye_expected[pid] = expected
        if pid in self._departing and self._byes[pid] >= expected:
            _, reason = self._departing.pop(pid)
            self._declare_lost(pid, reason, left=True)

    def _peer_lost(self, peers: list[str], reason: str, left: bool = False) -> None:
        """The coordinator declared ``peers`` lost (``left``: they said goodbye)."""
        for pid in peers:
            if pid == self.peer_id:
                self._expel(f"the coordinator declared this peer lost ({reason})")
            elif left and self._byes.get(pid, 0) < self._bye_expected.get(pid, 1):
                # Its last data may still be in flight on the data connections: wait for its
                # BYEs (bounded), then fail what still needs it.
                self._departing[pid] = (time.monotonic() + self._bye_grace, reason)
            else:
                self._declare_lost(pid, reason, left)

    def _declare_lost(self, pid: str, reason: str, left: bool) -> None:
        """Fail what a lost peer leaves unfinishable, here and (by ABORT) on the others.

        Crashed peer: every unfinished op it takes part in fails, now and when started later
        in this epoch (the contract; an op that happens to hold all its data already fails too,
        which keeps the survivors' outcomes alike). Peer that left: its BYEs came after all its
        data, so only ops that still need something from it fail; an op it completed its part
        of finishes normally on the others."""
        self._departing.pop(pid, None)
        self._lost.add(pid)
        if not left:
            self._crashed.add(pid)
        self._disconnect(pid)
        for op in list(self._ops.values()):
            if op.finished or pid not in op.peers_involved():
                continue
            if not left or op.needs(pid):
                self._fail_lost(op, [pid], reason)
        os_pid = self.shm_pids.pop(pid, None)
        if os_pid is not None and self._peer_slabs is not None:
            self._peer_slabs.forget(os_pid)  # its memory goes once no view of ours remains

    def _expel(self, reason: str) -> None:
        if self._register_meta is None:
            err = PeerLost(
                f"{self.peer_id} is no longer a member: {reason}; connect again to rejoin",
                peers=(self.peer_id,),
            )
            if self._expelled is None:
                logger.error("%s", err)
            self._expelled = err
            self._fail_all(err)
            return
        err = PeerLost(
            f"{self.peer_id} is no longer a member: {reason}; rejoining as a newcomer",
            peers=(self.peer_id,),
        )
        if self._rejoining:
            return
        logger.warning("lost: %s", err)
        self._expelled, self._expelled_at, self._rejoining = err, time.monotonic(), True
        waiters, self._quorum_waiters = self._quorum_waiters, []
        self._fail_all(err)
        # Quorum requests in flight died with our membership: re-ask them after registering.
        self._quorum_waiters = [w for w in waiters if not w.done()] if waiters else []
        if self._quorum_waiters:
            self._held_quorum = 1
        last = self._table.membership.epoch if self._table is not None else -1
        logger.info("rejoining: registering again with the coordinator as %s", self.peer_id)
        self._send_control(MsgType.REGISTER, {**self._register_meta, "last_epoch": last})

    def _rejoined(self) -> None:
        if not self._rejoining:
            return
        out_s = time.monotonic() - (self._expelled_at or time.monotonic())
        # Still not a member of any epoch: operations keep failing with PeerLost (their
        # epoch is gone) until the next MEMBERSHIP; quorum requests go out from now on.
        self._rejoining = False
        self.rejoins += 1
        logger.warning(
            "rejoined: %s is registered again (%.1fs after it learned it was lost); "
            "it joins the next epoch as a newcomer",
            self.peer_id,
            out_s,
        )
        self._coord_seen = time.monotonic()
        if self._held_quorum is not None:
            self._send_control(MsgType.QUORUM, {"min_world": self._held_quorum})
            self._held_quorum = None

    # ---- the loop ---------------------------------------------------------------------------
    def tick(self) -> None:
        """Heartbeat if one is due. Long-running work on this thread (a big shared-memory
        reduction, encoding many chunks) calls this between pieces, so the coordinator never
        mistakes a busy peer for a dead one."""
        now = time.monotonic()
        if now >= self._next_hb and not self._rejoining:
            self._send_control(MsgType.HEARTBEAT, {})
            self._next_hb = now + self._hb_period

    def _run(self) -> None:
        next_sweep = 0.0
        try:
            while not self._stop.is_set():
                wait_ms = 1 if self._finishing else 50
                for sock, ev in self._poller.poll(wait_ms):
                    if sock is self._data:
                        self._drain(self._data, self._on_data, copy=False)
                    elif sock is self._control:
                        self._drain(self._control, self._on_control, copy=True)
                    elif sock == self._wake_fd:
                        self._run_commands()
                    elif sock is self.watch.socket:
                        self.watch.drain()
                    elif sock in self._monitors:
                        self._on_monitor(sock)
                    elif ev & zmq.POLLOUT:
                        self._flush(sock)
                if self._finishing:
                    self._settle_finished()
                self.tick()
                now = time.monotonic()
                if now >= next_sweep:
                    self._sweep(now)
                    next_sweep = now + 0.05
        except zmq.ContextTerminated:
            pass
        except Exception:  # keep the process alive; fail every caller loudly instead
            logger.exception("lowband engine crashed")
            self._fail_all(CommClosed("the transport engine crashed; see the log"))
        finally:
            self._stop.set()
            for pid in list(self._out):
                self._disconnect_flush(pid)
            if self._slabs is not None:
                self._slabs.close()
            self._data.disable_monitor()
            self.watch.close()
            self._data.close(0)
            self._control.close(0)

    def _disconnect_flush(self, pid: str) -> None:
        out = self._out.pop(pid)
        self._drop_monitor(out)
        for s in out.sockets:
            s.close()  # uses the socket's linger so queued messages still leave

    def _drain(self, sock: zmq.Socket, handle: Callable[[Any], None], copy: bool) -> None:
        for _ in range(64):
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK, copy=copy)
            except zmq.Again:
                return
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
                logger.exception("engine command failed")

    def _settle_finished(self) -> None:
        still = []
        for op in self._finishing:
            if op.pending_trackers():
                still.append(op)
            else:
                op.settle(self)
        self._finishing = still

    def _sweep(self, now: float) -> None:
        for pid, (deadline, reason) in list(self._departing.items()):
            if now > deadline:
                del self._departing[pid]
                self._declare_lost(pid, reason, left=True)
        for op in list(self._ops.values()) + self._finishing:
            if now > op.deadline:
                op.fail(
                    self,
                    TransportTimeout(
                        f"{op.describe()} did not complete within {op.timeout:.1f}s; a peer may be "
                        "slow or partitioned (raise the timeout, or check the peers' logs)"
                    ),
                )
        if now - self._coord_seen > self._coord_silence and self._quorum_waiters:
            err = PeerLost(
                f"the coordinator has been silent for {now - self._coord_seen:.1f}s", peers=()
            )
            for w in self._quorum_waiters:
                w.set_error(err)
            self._quorum_waiters = []

    def stats(self) -> OpStats:
        with self.stats_lock:
            return OpStats(self.sent, self.received)


_MAX_ABORTED = 10_000  # ABORTs kept for operations not started here (each a few hundred bytes)


def _msg_bytes(msg: wire.Message) -> int:
    return sum(len(p) for p in msg.payload)


def _user_id(frame: zmq.Frame) -> str | None:
    try:
        return frame.get("User-Id")
    except zmq.ZMQError:
        return None
