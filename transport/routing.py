"""Which operation a data message belongs to, and the life of operations on the reactor thread.

Every data message carries ``(epoch, op key)``; :class:`Routing` hands it to the operation with
that key, keeps it (zero-copy frames, capped by ``ZmqConfig.max_pending_bytes``) until this peer
starts that operation, or drops it when the operation already ended here or its epoch is over.

An operation that fails because peers are gone tells its other live participants (ABORT with the
lost peers): they may wait on data this rank will now never send, which no lost-peer notice of
theirs covers. An ABORT for an operation not started here yet is kept and fails it the moment it
starts (the PeerLost contract is in :mod:`transport.members`).

Point-to-point receives are numbered here, in the order they start, per (source, tag); one that
ends before a byte of its message arrived gives its number back, so an abandoned receive never
shifts which message a later receive gets.

An operation whose result is final completes only once ZeroMQ released its zero-copy sends of
caller-visible buffers (so a caller may reuse a tensor as soon as the call returns); until then
it waits in ``finishing``.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Callable, Collection, Sequence, cast

from lowband.errors import PeerLost, ProtocolError, TransportTimeout
from transport import wire
from transport.config import ZmqConfig
from transport.peerlinks import PeerLinks
from transport.wire import MsgType

if TYPE_CHECKING:
    from transport.messages import RecvOp
    from transport.ops import Host, Op

logger = logging.getLogger(__name__)

Key = tuple[int, str]  # (epoch, op key)

_MAX_ABORTED = 10_000  # ABORTs kept for operations not started here (each a few hundred bytes)


class Routing:
    """The operations in flight and the messages that arrived ahead of theirs.

    ``host`` is what the operations see (the reactor); ``bad`` counts and logs a dropped
    message."""

    def __init__(
        self,
        *,
        host: "Host",
        links: PeerLinks,
        config: ZmqConfig,
        peer_id: str,
        bad: Callable[[str], None],
    ) -> None:
        self._host = host
        self._links = links
        self.cfg = config
        self.peer_id = peer_id
        self._bad = bad
        self._ops: dict[Key, "Op"] = {}
        self._early: dict[Key, list[wire.Message]] = {}
        self._early_bytes = 0
        self._finishing: list["Op"] = []
        self._done_keys: set[Key] = set()  # finished here: late messages for them are dropped
        self._aborted: dict[Key, wire.Message] = {}  # ABORTs for ops not started here yet
        self._rx_next: dict[tuple[int, str], int] = {}  # receive side of p2p: next message number
        self._recvs: dict[
            tuple[int, str], list["RecvOp"]
        ] = {}  # bound, unfinished receives, in order

    # ---- starting and ending ---------------------------------------------------------------------
    def start(self, op: "Op", *, lost: Collection[str], crashed: Collection[str]) -> None:
        """Start ``op`` and feed it what arrived early. ``lost`` are the peers lost in this
        epoch, ``crashed`` those of them that left without a goodbye."""
        host = self._host
        if op.p2p_recv:
            self.bind_recv(cast("RecvOp", op))
        key = (op.epoch, op.key)
        if key in self._ops:
            op.fail(host, ProtocolError(f"two operations with key '{op.key}' in flight"))
            return
        self._ops[key] = op
        try:
            abort = self._aborted.pop(key, None)
            if abort is not None:  # another participant already gave this operation up
                self._early_bytes -= _msg_bytes(abort)
                self._drop_early(key)
                self.deliver(op, abort)
                return
            gone = [p for p in op.peers_involved() if p in crashed]
            if gone:
                self._drop_early(key)
                self.fail_lost(op, gone, "crashed")
                return
            op.start(host)
            early = self._drop_early(key)
            for msg in early:
                if op.finished:
                    break
                self.deliver(op, msg)
            # A peer that left gracefully may have sent everything this op needs before it
            # went: fail only if the op still needs something from it.
            left = [p for p in op.peers_involved() if p in lost and op.needs(p)]
            if left and not op.finished:
                self.fail_lost(op, left, "left")
        except Exception as exc:  # a bug or bad input must fail the op, not kill the reactor
            logger.exception("%s failed", op.describe())
            op.fail(
                host, exc if isinstance(exc, (ProtocolError, PeerLost)) else ProtocolError(str(exc))
            )

    def _drop_early(self, key: Key) -> list[wire.Message]:
        early = self._early.pop(key, [])
        self._early_bytes -= sum(_msg_bytes(m) for m in early)
        return early

    def done(self, op: "Op") -> None:
        """Called by an op once its result is final; completes it when its sends are released."""
        if op.pending_trackers():
            self._finishing.append(op)
        else:
            op.settle(self._host)
        self._ops.pop((op.epoch, op.key), None)
        self._done_keys.add((op.epoch, op.key))
        if op.p2p_recv:
            queue = self._recvs.get((op.epoch, op.p2p_name), [])
            if op in queue:
                queue.remove(op)

    def forget(self, op: "Op") -> None:
        """Called by an op that failed."""
        self._ops.pop((op.epoch, op.key), None)
        if op.p2p_recv and self.unbind_recv(cast("RecvOp", op)):
            return  # the number went back: its message, when it comes, is the next receive's
        self._done_keys.add((op.epoch, op.key))
        if op in self._finishing:
            self._finishing.remove(op)

    @property
    def finishing(self) -> bool:
        """Whether finished ops wait for ZeroMQ to release their sends (poll soon)."""
        return bool(self._finishing)

    def settle_finished(self) -> None:
        still = []
        for op in self._finishing:
            if op.pending_trackers():
                still.append(op)
            else:
                op.settle(self._host)
        self._finishing = still

    # ---- point-to-point receive numbering ------------------------------------------------------
    def bind_recv(self, op: "RecvOp") -> None:
        """Give a receive the number of the next message from its source with its tag.

        Numbers are handed out here, on the reactor thread, in the order receives start; a
        receive that ends without a byte of its message gives its number back (see
        :meth:`unbind_recv`), so an abandoned receive never shifts later pairings."""
        name = (op.epoch, op.key)
        n = self._rx_next.get(name, 0)
        self._rx_next[name] = n + 1
        self._recvs.setdefault(name, []).append(op)
        op.p2p_name, op.key = op.key, f"{op.key}#{n}"

    def unbind_recv(self, op: "RecvOp") -> bool:
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

    # ---- messages ------------------------------------------------------------------------------
    def route(
        self, msg: wire.Message, epoch: int, key: str, current_epoch: int, *, member: bool = True
    ) -> None:
        """Hand a data message to its operation, or keep it until that starts here.

        ``member``: this peer is a member of ``current_epoch`` (not expelled, not rejoining).
        A member is never more than one epoch behind a peer that sends to it (a quorum needs
        every member's request, made after it applied the previous epoch), so a message of
        a later epoch is refused; a peer out of the group may be sent the epoch it rejoins
        at, however far ahead, before it knows it (bounded by ``max_pending_bytes``)."""
        op = self._ops.get((epoch, key))
        if op is not None:
            self.deliver(op, msg)
            return
        if (epoch, key) in self._done_keys:
            return  # a late or duplicate message for an operation that already ended here
        if epoch < current_epoch:
            return  # a straggler of a finished or abandoned epoch
        if member and current_epoch >= 0 and epoch > current_epoch + 1:
            self._bad(
                f"dropped a message for '{key}' of epoch {epoch}: this peer is in epoch "
                f"{current_epoch}, and no peer is more than one epoch ahead"
            )
            return
        n = _msg_bytes(msg)
        if msg.type == MsgType.ABORT:
            # Kept apart from early data (capped in number, counted in bytes with it): when
            # this peer starts the operation, it fails at once instead of waiting for data
            # that will never come.
            old = self._aborted.get((epoch, key))
            held = self._early_bytes - (_msg_bytes(old) if old is not None else 0)
            if old is None and len(self._aborted) >= _MAX_ABORTED:
                self._bad(f"dropped an ABORT for '{key}': {_MAX_ABORTED} are pending already")
            elif held + n > self.cfg.max_pending_bytes:
                self._bad(f"dropped an ABORT for '{key}': max_pending_bytes reached")
            else:
                self._aborted[(epoch, key)] = msg
                self._early_bytes = held + n
            return
        if self._early_bytes + n > self.cfg.max_pending_bytes:
            self._bad(
                f"dropped a message for '{key}' (epoch {epoch}): more than "
                f"{self.cfg.max_pending_bytes} bytes wait for operations not started here"
            )
            return
        self._early.setdefault((epoch, key), []).append(msg)
        self._early_bytes += n

    def deliver(self, op: "Op", msg: wire.Message) -> None:
        host = self._host
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
                    host,
                    PeerLost(
                        f"{op.describe()}: rank {src} gave it up: {reason}", peers=tuple(lost[:64])
                    ),
                )
            else:
                op.fail(host, ProtocolError(f"{op.describe()} was aborted by rank {src}: {reason}"))
            return
        try:
            op.on_message(host, src, msg)
        except ProtocolError as exc:
            if getattr(exc, "fatal", False):
                op.fail(host, exc)
                self._abort(op, str(exc))
            else:
                self._bad(f"{op.describe()}: {exc}")
        except Exception as exc:  # a message we did not anticipate: drop it, keep serving
            logger.debug("unexpected error handling a message", exc_info=True)
            self._bad(f"{op.describe()}: dropped a message that raised {type(exc).__name__}: {exc}")

    def new_epoch(self, epoch: int) -> None:
        """Forget what belongs to epochs before ``epoch``, and what was kept for epochs beyond
        ``epoch + 1`` (only a peer out of the group takes those: see :meth:`route`)."""
        self._early = {k: v for k, v in self._early.items() if epoch <= k[0] <= epoch + 1}
        self._done_keys = {k for k in self._done_keys if k[0] >= epoch}
        self._aborted = {k: v for k, v in self._aborted.items() if epoch <= k[0] <= epoch + 1}
        self._rx_next = {k: v for k, v in self._rx_next.items() if k[0] >= epoch}
        self._early_bytes = sum(_msg_bytes(m) for v in self._early.values() for m in v) + sum(
            _msg_bytes(m) for m in self._aborted.values()
        )

    # ---- failing -------------------------------------------------------------------------------
    def fail_lost(self, op: "Op", lost: Sequence[str], how: str) -> None:
        """Fail ``op`` because peers are gone, and tell its other live participants: they may
        wait on data this rank will now never send (the lost peer's ring neighbour stops
        forwarding, a star root stops answering), which no lost-peer notice of theirs covers."""
        names = ", ".join(lost)
        op.fail(self._host, PeerLost(f"{op.describe()}: peer(s) {names} {how}", peers=tuple(lost)))
        self._abort(op, f"peer(s) {names} {how}", lost=list(lost))

    def fail_peer(self, pid: str, reason: str, left: bool) -> None:
        """Fail the unfinished ops a lost peer takes part in: all of them if it crashed, those
        that still need something from it if it ``left``."""
        for op in list(self._ops.values()):
            if op.finished or pid not in op.peers_involved():
                continue
            if not left or op.needs(pid):
                self.fail_lost(op, [pid], reason)

    def _abort(self, op: "Op", reason: str, lost: list[str] | None = None) -> None:
        """Tell the other participants an operation cannot succeed, so they fail now rather
        than at their deadline (with PeerLost when ``lost`` names the peers that are gone)."""
        extra = {"lost": lost} if lost else {}
        for peer in op.peers_involved():
            if peer != self.peer_id and self._links.connected(peer):
                self._links.send(peer, MsgType.ABORT, op.meta(reason=reason[:2000], **extra))

    def fail_all(self, exc: BaseException) -> None:
        """Fail every op, finishing ones included (closing, expelled, reactor crashed)."""
        for op in list(self._ops.values()) + list(self._finishing):
            op.fail(self._host, exc)

    def sweep(self, now: float) -> None:
        """Fail the ops past their deadline."""
        for op in list(self._ops.values()) + self._finishing:
            if now > op.deadline:
                op.fail(
                    self._host,
                    TransportTimeout(
                        f"{op.describe()} did not complete within {op.timeout:.1f}s; a peer may be "
                        "slow or partitioned (raise the timeout, or check the peers' logs)"
                    ),
                )


def _msg_bytes(msg: wire.Message) -> int:
    return msg.held_bytes  # metadata and a per-message overhead count too
