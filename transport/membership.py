"""A peer's view of the group: the peer table, lost peers, quorum rounds, expulsion and rejoining.

Fed by the coordinator's messages on the control socket and by the BYEs on the data sockets;
runs on the reactor thread (:mod:`transport.reactor`).

Lost peers (the PeerLost contract of :mod:`lowband.comm`)
-----------------------------------------------------------
The coordinator tells every survivor about a lost peer. A *crashed* peer fails every unfinished
op it takes part in, and every one started later in that epoch. A peer that *left* (its BYEs
follow all its data on every connection) fails only the ops that still need data from it, so a
peer that contributed and then left does not fail what it completed. Either way a survivor can
also be stuck *behind another survivor*: the crashed peer's ring neighbour stops forwarding, a
star root whose contributor left never answers. So a rank that fails an op for a lost peer sends
ABORT (with the lost peers) to the op's other live participants, which fail it with PeerLost
too; an ABORT for an op not started yet is kept and fails it the moment it starts
(:mod:`transport.routing`). By induction along who-waits-on-whom, every survivor raises
PeerLost, none waits for its deadline. A lost peer never fails a pending quorum: the coordinator
drops it from the round.

Expelled peers rejoin by themselves
----------------------------------
A peer the coordinator declared lost (it was paused longer than the deadline: SIGSTOP, a laptop
lid, swap) learns it from the REFUSED "expelled" answer to its next heartbeat, or a restarted
coordinator answers the same. Its pending operations fail with PeerLost as before, but with
``ZmqConfig.rejoin`` the reactor sends REGISTER again right away (same id, same data address):
until REGISTERED comes back new operations fail fast and quorum requests are held, then the
held requests go out and the peer enters the next epoch as a newcomer. What the application
does with a newcomer (a state transfer, a re-assigned slot) is its business. Survivors forget
that a peer id was lost once it is a member again.

A silent coordinator fails pending quorums with PeerLost only after ``ZmqConfig.
coordinator_grace``; collectives among the current members go on meanwhile.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any, Callable

from lowband.comm import Membership
from lowband.errors import PeerLost, ProtocolError, TransportTimeout
from transport import control, wire
from transport.config import ZmqConfig
from transport.control import Refusal
from transport.peerlinks import PeerLinks
from transport.peers import PeerTable, data_address
from transport.routing import Routing

logger = logging.getLogger(__name__)


class Members:
    """This peer's membership state; see the module docstring.

    ``register`` is connect()'s REGISTER (None disables rejoining), ``local`` this peer's
    same-host identity (``Reactor.local``), ``on_membership`` is called with every new table,
    ``on_lost`` with every peer declared lost, ``bad`` counts and logs a dropped message."""

    def __init__(
        self,
        *,
        config: ZmqConfig,
        peer_id: str,
        links: PeerLinks,
        routing: Routing,
        heartbeat_interval: float,
        register: control.Register | None,
        local: list[str] | None,
        on_membership: Callable[[PeerTable], None] | None,
        on_lost: Callable[[str], None],
        bad: Callable[[str], None],
    ) -> None:
        self.peer_id = peer_id
        self._relay_mode = config.relay
        self._relay_warned: set[str] = set()
        self._links = links
        self._routing = routing
        self._local = local
        self._on_membership = on_membership
        self._on_lost = on_lost
        self._bad = bad
        self._coord_silence = max(config.coordinator_grace, 2 * heartbeat_interval)
        self._bye_grace = max(2.0, 2 * heartbeat_interval)
        self._table: PeerTable | None = None
        self.lost: set[str] = set()
        self.crashed: set[str] = set()  # lost without a goodbye (a subset of lost)
        self._byes: dict[str, int] = {}  # peer -> BYE messages received (one per connection)
        self._bye_expected: dict[str, int] = {}
        self._departing: dict[str, tuple[float, str]] = {}  # left, BYEs pending: deadline, why
        self._quorum_waiters: list[Any] = []
        self._cancelling: list[Any] = []
        self.expelled: BaseException | None = None
        self._register = register
        self.rejoining = False
        self._held_quorum: int | None = None  # largest min_world asked while rejoining
        self._expelled_at: float | None = None
        self.rejoins = 0
        self._coord_seen = time.monotonic()

    @property
    def table(self) -> PeerTable | None:
        """The current epoch's peers (read from user threads too: replaced, never mutated)."""
        return self._table

    @property
    def epoch(self) -> int:
        return self._table.membership.epoch if self._table else -1

    # ---- quorum --------------------------------------------------------------------------------
    def request_quorum(self, min_world: int, waiter: Any) -> None:
        if self.rejoining:  # asked once REGISTERED comes back
            self._quorum_waiters.append(waiter)
            self._held_quorum = max(self._held_quorum or 1, min_world)
            return
        if self.expelled is not None and self._register is None:
            waiter.set_error(self.expelled)
            return
        self._quorum_waiters.append(waiter)
        self._links.send_control(control.Quorum(min_world=min_world))

    def cancel_quorum(self, waiter: Any) -> None:
        """Withdraw from the quorum round. The coordinator acknowledges, and only then does the
        waiter fail: if the round completes first, the waiter gets the new membership instead,
        so a timed-out quorum() never leaves this peer half in a new epoch."""
        if waiter in self._quorum_waiters and self.rejoining:  # never sent: nothing to ack
            self._quorum_waiters.remove(waiter)
            waiter.set_error(TransportTimeout("quorum cancelled while rejoining"))
        elif waiter in self._quorum_waiters:
            self._cancelling.append(waiter)
            self._links.send_control(control.QuorumCancel())

    def fail_waiters(self, exc: BaseException) -> None:
        for w in self._quorum_waiters:
            w.set_error(exc)
        self._quorum_waiters = []

    # ---- the coordinator's messages --------------------------------------------------------------
    def on_control(self, frames: list[bytes]) -> None:
        self._coord_seen = time.monotonic()
        try:
            msg = control.parse(wire.unpack(frames, max_payload_bytes=0))
            if isinstance(msg, control.MembershipUpdate):
                self._apply(msg)
            elif isinstance(msg, control.PeersLost):
                self._peer_lost(msg.peers, msg.reason, msg.left)
            elif isinstance(msg, control.QuorumCancel):  # the coordinator's acknowledgement
                for w in self._cancelling:
                    if w in self._quorum_waiters:
                        self._quorum_waiters.remove(w)
                    w.set_error(TransportTimeout("quorum cancelled"))
                self._cancelling = []
            elif isinstance(msg, control.Refused):
                if self.rejoining and msg.kind == Refusal.EXPELLED:
                    return  # the answer to a heartbeat sent before our new REGISTER
                if self.rejoining:  # the coordinator will not take us back: final
                    self.rejoining = False
                    self._register = None
                self._expel(msg.reason or "refused")
            elif isinstance(msg, control.Registered):
                if msg.relay is not None:
                    self._links.relay_to(msg.relay)
                self._rejoined()
            elif not isinstance(msg, control.HeartbeatAck):
                raise ProtocolError(f"unexpected {msg.NAME} from the coordinator")
        except ProtocolError as exc:
            self._bad(f"bad message from the coordinator: {exc}")

    def _apply(self, msg: control.MembershipUpdate) -> None:
        peers = tuple(msg.peers)
        if peers[msg.rank] != self.peer_id:
            raise ProtocolError("inconsistent MEMBERSHIP message: the rank is another peer's")
        m = Membership(msg.epoch, msg.rank, len(peers), peers, tuple(msg.joined), tuple(msg.left))
        addrs, keys = tuple(msg.addrs), tuple(msg.keys)
        locals_ = tuple(msg.locals or [None] * len(peers))
        relayed = msg.relayed or [False] * len(peers)
        table = PeerTable(m, addrs, keys, locals_, tuple(relayed))
        old = self._table
        if self._register is not None and not self.rejoining:
            self.expelled = None  # rejoined: a member again
        # A member that was lost earlier has rejoined under its old id: it is a fresh peer now.
        for pid in peers:
            self.lost.discard(pid)
            self.crashed.discard(pid)
            self._byes.pop(pid, None)
            self._bye_expected.pop(pid, None)
            self._departing.pop(pid, None)
        self._table = table
        for pid in self._links.peers():
            if pid not in table.index:
                self._links.disconnect(pid)
        for pid, addr, key, local, far in zip(peers, addrs, keys, locals_, relayed):
            if pid == self.peer_id:
                continue
            via_relay = self._links.relay is not None and (
                self._relay_mode == "always" or (far and self._relay_mode == "auto")
            )
            if self._links.connected(pid) and (pid in self._links.relayed) != via_relay:
                self._links.disconnect(pid)  # its reachability changed (it registered again)
            if self._links.connected(pid):
                continue
            if via_relay:
                if pid not in self._relay_warned and len(self._relay_warned) < 4096:
                    self._relay_warned.add(pid)
                    logger.info(
                        "links from %s to %s go through the coordinator's relay (%s)",
                        self.peer_id,
                        pid,
                        "it cannot be dialled" if far else "relay=always",
                    )
                self._links.connect_relayed(pid)
            else:
                if far and pid not in self._relay_warned and len(self._relay_warned) < 4096:
                    self._relay_warned.add(pid)
                    logger.warning(
                        "%s cannot be dialled and %s has no relay (relay=%s, or the coordinator "
                        "runs none): dialling it directly anyway",
                        pid,
                        self.peer_id,
                        self._relay_mode,
                    )
                self._links.connect(pid, data_address(self._local, addr, local), key)
        if old is None or old.membership.epoch != msg.epoch:
            self._routing.new_epoch(msg.epoch)
        if self._on_membership is not None:
            self._on_membership(table)
        waiters, self._quorum_waiters, self._cancelling = self._quorum_waiters, [], []
        for w in waiters:
            w.set_result(m)

    # ---- lost peers ------------------------------------------------------------------------------
    def on_bye(self, pid: str, expected: int) -> None:
        self._byes[pid] = self._byes.get(pid, 0) + 1
        self._bye_expected[pid] = expected
        if pid in self._departing and self._byes[pid] >= expected:
            _, reason = self._departing.pop(pid)
            self._declare_lost(pid, reason, left=True)

    def heard_from(self, pid: str) -> None:
        """Data from ``pid`` came in. A peer that left but is still delivering what it sent
        before its BYEs (a slow link, a busy receiver) gets its grace renewed: its BYEs are
        behind that data, and the collectives here may need it."""
        if pid in self._departing:
            _, reason = self._departing[pid]
            self._departing[pid] = (time.monotonic() + self._bye_grace, reason)

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
        self.lost.add(pid)
        if not left:
            self.crashed.add(pid)
        self._links.disconnect(pid)
        self._routing.fail_peer(pid, reason, left)
        self._on_lost(pid)

    # ---- expelled and back -----------------------------------------------------------------------
    def _expel(self, reason: str) -> None:
        if self._register is None:
            err = PeerLost(
                f"{self.peer_id} is no longer a member: {reason}; connect again to rejoin",
                peers=(self.peer_id,),
            )
            if self.expelled is None:
                logger.error("%s", err)
            self.expelled = err
            self._routing.fail_all(err)
            self.fail_waiters(err)
            return
        err = PeerLost(
            f"{self.peer_id} is no longer a member: {reason}; rejoining as a newcomer",
            peers=(self.peer_id,),
        )
        if self.rejoining:
            return
        logger.warning("lost: %s", err)
        self.expelled, self._expelled_at, self.rejoining = err, time.monotonic(), True
        waiters, self._quorum_waiters = self._quorum_waiters, []
        self._routing.fail_all(err)
        # Quorum requests in flight died with our membership: re-ask them after registering.
        self._quorum_waiters = [w for w in waiters if not w.done()] if waiters else []
        if self._quorum_waiters:
            self._held_quorum = 1
        logger.info("rejoining: registering again with the coordinator as %s", self.peer_id)
        again = dataclasses.replace(self._register, last_epoch=self.epoch)
        table = self._table
        if again.reachable is None and table is not None and table.relayed:
            # Known from the dial-back already: no second probe of a running data socket
            # (it would count as a failed handshake here).
            again = dataclasses.replace(again, reachable=not table.relayed[table.membership.rank])
        self._links.send_control(again)

    def _rejoined(self) -> None:
        if not self.rejoining:
            return
        out_s = time.monotonic() - (self._expelled_at or time.monotonic())
        # Still not a member of any epoch: operations keep failing with PeerLost (their
        # epoch is gone) until the next MEMBERSHIP; quorum requests go out from now on.
        self.rejoining = False
        self.rejoins += 1
        logger.warning(
            "rejoined: %s is registered again (%.1fs after it learned it was lost); "
            "it joins the next epoch as a newcomer",
            self.peer_id,
            out_s,
        )
        self._coord_seen = time.monotonic()
        if self._held_quorum is not None:
            self._links.send_control(control.Quorum(min_world=self._held_quorum))
            self._held_quorum = None

    # ---- deadlines -----------------------------------------------------------------------------
    def sweep(self, now: float) -> None:
        """Declare lost the departed peers whose BYEs did not all come in time, and fail the
        pending quorums once the coordinator has been silent past its grace."""
        for pid, (deadline, reason) in list(self._departing.items()):
            if now > deadline:
                del self._departing[pid]
                self._declare_lost(pid, reason, left=True)
        if now - self._coord_seen > self._coord_silence and self._quorum_waiters:
            err = PeerLost(
                f"the coordinator has been silent for {now - self._coord_seen:.1f}s", peers=()
            )
            self.fail_waiters(err)
