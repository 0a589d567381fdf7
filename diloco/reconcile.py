"""Group membership for DiLoCo workers: quorums at sync points and state reconciliation.

A :class:`Reconciler` is the membership half of a worker (the torchft split: ``manager.py`` beside
``local_sgd.py``). The worker calls :meth:`Reconciler.sync_point` right after every APPLY,
where nothing is in flight (τ < H/P). There every worker calls ``comm.quorum()``; when the epoch
changed (a peer died or joined), or on the periodic audit, all members *reconcile*:

1. all-gather a status row per worker: run signature, step, syncs applied, the sync it lost
   (if any), hash of the global state;
2. refuse workers whose signature differs from the majority (they raise IncompatiblePeer);
3. if every most-advanced worker lost the same sync (a peer died while it was in flight),
   redo it with the survivors — the average is over those who contributed;
4. the lowest-ranked most-advanced worker holding the majority hash sends its full state to
   every worker that is behind, new, or different (point-to-point, tensors + JSON metadata);
5. all-gather the state hashes again: every worker must now be bit-identical in θ_g, outer
   optimizer state, step and sync count, or the run stops with StateMismatch.

A collective that fails inside this procedure (another peer lost) restarts it after a new quorum,
so it terminates once the membership stops changing.

The end of a run is one more sync point (:meth:`Reconciler.finish`). A worker paused or cut off
during the last sync period is declared lost; when it comes back the others may be gone, and
it would rejoin a group of one, redo its lost sync alone and finish with a state of its own.
So a group that finishes with fewer than the run's ``workers`` members holds: each peer lost
less than ``final_grace`` seconds ago gets until then to come back, and one that does is
reconciled like any newcomer (it receives the final state). A peer lost earlier than that
(kill -9 mid-run) delays nobody. Every member holds with the same membership history, so their
deadlines agree to within one quorum round.

The reconciler reaches the network only through :class:`lowband.comm.Communicator` and the
worker only through :class:`Replica` (progress counters, the state, its hash, redoing a sync).
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from dataclasses import dataclass
from typing import Protocol

import torch

from diloco.checkpoint import State
from diloco.common import signature_int
from diloco.metrics import MetricsLog
from lowband.comm import Communicator, Membership
from lowband.errors import (
    ConfigError,
    IncompatiblePeer,
    LowbandError,
    PeerLost,
    ProtocolError,
    TransportTimeout,
)

# A lost peer makes every survivor's pending collectives raise PeerLost promptly (the contract of
# lowband.comm; the ZeroMQ transport has the first rank that fails tell the others). A deadline
# (TransportTimeout) is still handled as a lost sync, as a safety net for a live but partitioned
# peer: then a worker that timed out waits in quorum() for those still inside their collective,
# so the quorum deadline must outlast a collective's.
QUORUM_TIMEOUT_FACTOR = 3.0
MAX_CONSECUTIVE_TIMEOUTS = 3

logger = logging.getLogger(__name__)

# Columns of the status row all-gathered when workers reconcile (int64).
SIG, INIT, STEP, APPLIED, LOST_FRAG, LOST_ROUND, HASH, SLOT = range(8)


class StateMismatch(LowbandError):
    """Workers still disagree on the global state after a state transfer (a determinism bug)."""


class Replica(Protocol):
    """What reconciliation reads and writes of a worker.

    ``initialized``: it holds authoritative state (resumed, or agreed with the group); ``slot``:
    its data slot (which stream of batches it draws, stable for life, ``-1`` until assigned).
    """

    initialized: bool
    slot: int

    @property
    def signature(self) -> bytes: ...

    @property
    def step(self) -> int: ...

    @property
    def applied(self) -> int: ...

    @property
    def lost_sync(self) -> tuple[int, int] | None:
        """(fragment, round) of a sync whose result never arrived here, if any."""
        ...

    def state_hash(self) -> int: ...

    def state(self, *, own: bool) -> State: ...

    def load(self, tensors: dict[str, torch.Tensor], meta: dict, *, own: bool) -> None: ...

    def redo(self, fragment: int, round_: int, *, leader: bool, expected: int, tag: str) -> None:
        """Run the sync (fragment, round) again as a collective tagged ``tag``; a ``leader``
        contributes what it sent the first time and applies the average over ``expected``
        contributions, everyone else contributes nothing."""
        ...


@dataclass(frozen=True, kw_only=True)
class ReconcileConfig:
    """When and how long the group agrees on membership and state."""

    sync_timeout: float  # s, deadline of one collective (a quorum waits QUORUM_TIMEOUT_FACTOR×)
    audit_every: int  # reconcile every this many sync points without a change (0: never)
    stride: int  # inner steps between two sync points (H/P)
    final_grace: float = 0.0  # s a lost peer has to come back before the group finishes (0: none)

    def __post_init__(self) -> None:
        if not self.sync_timeout > 0:
            raise ConfigError("sync_timeout", f"must be > 0 seconds, got {self.sync_timeout}")
        if self.audit_every < 0:
            raise ConfigError("audit_every", f"must be >= 0, got {self.audit_every}")
        if self.stride < 1:
            raise ConfigError("stride", f"must be >= 1, got {self.stride}")
        if not 0 <= self.final_grace <= 86400:
            raise ConfigError("final_grace", f"must be in [0, 86400] s, got {self.final_grace}")

    @property
    def quorum_timeout(self) -> float:
        return QUORUM_TIMEOUT_FACTOR * self.sync_timeout


def _majority(values: list[int]) -> int:
    """Most common value; ties go to the value seen first (the lowest rank)."""
    counts = Counter(values)
    best = max(counts.values())
    return next(v for v in values if counts[v] == best)


class Reconciler:
    """The membership of one worker: quorums, the audit schedule and reconciliations.

    Owns the epoch its reconciliation tags count from, how many reconciliations ran in it, and
    how many times this worker received the full state (``transfers``)."""

    def __init__(
        self, cfg: ReconcileConfig, comm: Communicator, replica: Replica, log: MetricsLog
    ) -> None:
        self.cfg, self.comm, self.replica, self.log = cfg, comm, replica, log
        self.transfers = 0
        self._rec_epoch: int | None = None
        self._rec_count = 0
        self._lost_at: dict[str, float] = {}  # peer -> when it left the group (monotonic)

    # ---- quorums -------------------------------------------------------------------------------
    def form(self, min_world: int) -> Membership:
        """The first quorum of a run: wait for ``min_world`` founding members (not logged)."""
        return self.comm.quorum(min_world=min_world, timeout=self.cfg.quorum_timeout)

    def quorum(self, *, min_world: int = 1, timeout: float | None = None) -> Membership:
        """Every quorum a worker takes while training (at a sync point, after a reconciliation
        lost a peer, after refusing workers, while admitting a site, while holding at the end):
        a ``membership`` line in the metrics log when the epoch moved."""
        before = self.comm.membership.epoch
        m = self.comm.quorum(
            min_world=min_world, timeout=self.cfg.quorum_timeout if timeout is None else timeout
        )
        if m.epoch != before:
            now = time.monotonic()
            for peer in m.left:
                self._lost_at.setdefault(peer, now)
            for peer in m.joined:
                self._lost_at.pop(peer, None)
            self.log.log(
                "membership",
                step=self.replica.step,
                epoch=m.epoch,
                world=m.world_size,
                joined=list(m.joined),
                left=list(m.left),
            )
        return m

    def audit_due(self) -> bool:
        """The periodic audit: every ``audit_every``-th sync point."""
        every = self.cfg.audit_every
        return bool(every) and (self.replica.step // self.cfg.stride) % every == 0

    def sync_point(self) -> None:
        """Quorum after an APPLY; reconcile if the membership changed or an audit is due."""
        before = self.comm.membership.epoch
        m = self.quorum()
        if m.epoch != before:
            self.reconcile("membership")
        elif self.audit_due():
            self.reconcile("audit")
        elif self.replica.lost_sync is not None:
            logger.warning("lost sync with an unchanged membership; the next audit heals it")

    def finish(self, workers: int) -> None:
        """The last sync point of a run (after the drain): while fewer than ``workers`` are
        members, wait for the peers lost less than ``final_grace`` ago to come back and reconcile
        them (they receive the final state); see the module docstring. Logs a ``hold`` record
        when it waits, with who came back and who did not."""
        held_since: float | None = None
        while self.comm.world_size < workers:
            now = time.monotonic()
            recent = {p: t for p, t in self._lost_at.items() if now - t < self.cfg.final_grace}
            if not recent:
                break
            if held_since is None:
                held_since = now
                logger.warning(
                    "finishing with %d of %d workers: waiting up to %.0fs for %s to come back "
                    "and take the final state",
                    self.comm.world_size,
                    workers,
                    max(recent.values()) + self.cfg.final_grace - now,
                    ", ".join(sorted(recent)),
                )
                self.log.log("hold", step=self.replica.step, waiting_for=sorted(recent))
            before = self.comm.membership.epoch
            remaining = max(recent.values()) + self.cfg.final_grace - now
            try:
                m = self.quorum(min_world=workers, timeout=remaining)
            except TransportTimeout:
                break
            if m.epoch != before:
                self.reconcile("final")
        if held_since is not None:
            missing = sorted(self._lost_at)
            if missing:
                logger.warning(
                    "finishing without %s: not back within final_grace (%.0fs)",
                    ", ".join(missing),
                    self.cfg.final_grace,
                )
            self.log.log(
                "hold",
                step=self.replica.step,
                waited_s=round(time.monotonic() - held_since, 3),
                world=self.comm.world_size,
                missing=missing,
            )

    # ---- reconciliation ------------------------------------------------------------------------
    def reconcile(self, reason: str) -> None:
        timeouts = 0
        while True:
            try:
                if self._reconcile_once(reason):
                    return
            except (PeerLost, TransportTimeout) as exc:
                timeouts = timeouts + 1 if isinstance(exc, TransportTimeout) else 0
                if timeouts >= MAX_CONSECUTIVE_TIMEOUTS:
                    raise
                logger.warning("reconciling failed (%s); new quorum", exc)
                self.quorum()

    def _status(self, state_hash: int) -> torch.Tensor:
        r = self.replica
        lost = r.lost_sync or (-1, -1)
        return torch.tensor(
            [
                signature_int(r.signature),
                int(r.initialized),
                r.step,
                r.applied,
                lost[0],
                lost[1],
                state_hash,
                r.slot,
            ],
            dtype=torch.int64,
        )

    def _next_tag(self) -> str:
        # Tags must be unique within an epoch and equal on every member, newcomers included:
        # count reconciliations since the epoch began (every member runs the same ones).
        epoch = self.comm.membership.epoch
        if epoch != self._rec_epoch:
            self._rec_epoch, self._rec_count = epoch, 0
        self._rec_count += 1
        return f"rec/{self._rec_count}"

    def _reconcile_once(self, reason: str) -> bool:
        comm, tag = self.comm, self._next_tag()
        mine = self.replica.state_hash()  # once: unchanged here unless the state is replaced
        rows = [
            r.tolist()
            for r in comm.all_gather(
                self._status(mine), tag=tag + "/status", timeout=self.cfg.sync_timeout
            )
        ]
        if not self._check_signatures(rows):
            return False
        if not any(r[INIT] for r in rows):  # a fresh run: the seeded models are the state
            for r in rows:
                r[INIT] = 1
        self._assign_slot(rows)
        best = max((r[STEP], r[APPLIED]) for r in rows if r[INIT])
        leaders = [i for i, r in enumerate(rows) if r[INIT] and (r[STEP], r[APPLIED]) == best]
        lost = {(rows[i][LOST_FRAG], rows[i][LOST_ROUND]) for i in leaders}
        if lost != {(-1, -1)}:
            if len(lost) != 1:
                raise ProtocolError(f"workers at the same progress lost different syncs: {lost}")
            fragment, round_ = lost.pop()
            self.replica.redo(
                fragment,
                round_,
                leader=comm.rank in leaders,
                expected=len(leaders),
                tag=f"{tag}/redo/{fragment}/{round_}",
            )
            return False  # progress changed: gather the status again
        ref = _majority([rows[i][HASH] for i in leaders])
        donor = min(i for i in leaders if rows[i][HASH] == ref)
        stale = [
            i
            for i, r in enumerate(rows)
            if not (r[INIT] and (r[STEP], r[APPLIED]) == best and r[HASH] == ref)
        ]
        if stale:
            self._transfer(donor, stale, tag)
        self._verify(tag, reason, stale, None if comm.rank in stale else mine)
        return True

    def _assign_slot(self, rows: list[list[int]]) -> None:
        """Workers keep their data slot for life; newcomers take fresh ones, in rank order."""
        taken = {r[SLOT] for r in rows if r[SLOT] >= 0}
        fresh = max(taken, default=-1) + 1
        for r in rows:
            if r[SLOT] < 0:
                r[SLOT], fresh = fresh, fresh + 1
        self.replica.slot = rows[self.comm.rank][SLOT]

    def _check_signatures(self, rows: list[list[int]]) -> bool:
        ref = _majority([r[SIG] for r in rows if r[INIT]] or [r[SIG] for r in rows])
        bad = [i for i, r in enumerate(rows) if r[SIG] != ref]
        if not bad:
            return True
        if self.comm.rank in bad:
            self.comm.close()
            raise IncompatiblePeer(
                "this worker's model/config signature differs from the group's (parameter "
                "shapes, H, P, τ, codec, optimizers, steps or seed): use the same preset and "
                "overrides as the other workers"
            )
        logger.warning("refusing %d worker(s) with a different signature", len(bad))
        self.quorum()  # they leave; continue without them
        return False

    def _transfer(self, donor: int, stale: list[int], tag: str) -> None:
        comm = self.comm
        if comm.rank == donor:
            tensors, meta = self.replica.state(own=False)
            names = sorted(tensors)
            for dst in stale:
                comm.send(
                    dst,
                    [tensors[n] for n in names],
                    {"names": names, "meta": meta},
                    tag=f"{tag}/state",
                    timeout=self.cfg.sync_timeout,
                )
        elif comm.rank in stale:
            ts, msg = comm.recv(donor, tag=f"{tag}/state", timeout=self.cfg.sync_timeout)
            self.replica.load(dict(zip(msg["names"], ts)), msg["meta"], own=False)
            self.transfers += 1
            logger.info("received the full state from rank %d at step %d", donor, self.replica.step)

    def _verify(self, tag: str, reason: str, stale: list[int], mine: int | None) -> None:
        """All workers' state hashes must agree; ``mine`` is this worker's unless it was just
        replaced by a transfer (then it is computed again)."""
        if mine is None:
            mine = self.replica.state_hash()
        hashes = [
            int(h)
            for h in self.comm.all_gather(
                torch.tensor([mine], dtype=torch.int64),
                tag=tag + "/verify",
                timeout=self.cfg.sync_timeout,
            )
        ]
        if len(set(hashes)) != 1:
            raise StateMismatch(f"state hashes differ after reconciling ({reason}): {hashes}")
        self.replica.initialized = True
        self.log.log(
            "audit",
            step=self.replica.step,
            reason=reason,
            world=self.comm.world_size,
            refreshed=stale,
            state_hash=mine,
        )
