"""The master of a replica layout: every device holds the whole model, each runs its own streams.

For a model that fits each device, streams are spread over the devices instead of layers
(data parallelism): the master runs the same repacked fast path plain ``edge serve`` runs on
one device, and every worker a stage over all layers with the embedding and the WHOLE LM head
(``StageAssign.whole_head``). A stream's KV cache lives on one device. Per step only the token
ids go to a worker and, per wanted row, the best ``top`` logits come back (or, when every
logit is wanted, the final hidden row, for the master's own head): no per-layer or per-stage
hop, so a device runs its share of the streams at the batched step's cost. On one core a step
of 4 rows costs about half of 8 rows' (Gemma 3 270M Q4_K_M: 17.6 vs 37-40 ms), which is what
two devices gain.

Lanes (``edge.engine``): the engine keeps ``lanes`` = ``replica_lanes`` (default 1) x devices
steps in flight and takes ceil(active / lanes) streams per step. :meth:`submit` places the
step, sends its remote groups first (the workers compute meanwhile), then computes its local
group; :meth:`collect` takes the remote answers (in the order submitted; a worker serves its
messages in order). With two lanes per device a worker has its next group queued while the
answer to the last one travels and the master samples it, so the round trip leaves no gap in
the worker's compute (with one lane it idles a round trip per step), and the master computes
its own two groups in turn; but every step has half the rows (a batched step costs much less
per row than a small one) and the engine runs twice the steps: one lane measured faster over
Wi-Fi (4 ms) and at 10 ms (``ClusterConfig.replica_lanes``). The engine asks
:meth:`ReplicaRunner.lanes_for` how many lanes pay for the streams running now: 1 (one step
of them all, on the master) while one device's batched step of them is predicted at least as
fast as splitting them over the devices (:func:`split_pays`, from the step costs measured at
start), else every lane.

Placement (:meth:`_place`), per step: an item continuing a cache (``start`` > 0) stays on the
device holding it when it holds more than ``MIGRATE_TOKENS`` positions (pinned), unless the
step is alone in flight and the cache is on a worker and :func:`move_home` says recomputing
it on the master costs less than the round trips it would pay; the step's device is the
majority of its pinned items, else (nothing pinned) the master when nothing is in flight (a
lone stream never pays a round trip), else the device with the fewest groups in flight (a
worker first on a tie). Other items go to that device: new ones (``start`` 0) directly,
short caches elsewhere by recomputing the positions they held there (the runner keeps every
slot's tokens; the compiled step computes each row as its token alone, so the recomputed keys
are the same bits) and dropping them there. A step whose pinned items sit on several devices
is split into a group per device. A copied prefix goes to the source's device (the copy
replaces what the destination held).

Failure: a worker that does not answer in ``op_timeout`` or is lost fails the step with
:class:`ClusterUnavailable`; the runner stays unhealthy (``/health``) until restarted, as the
pipeline's does.
"""

from __future__ import annotations

import logging
import statistics
import threading
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from edge.cluster.master import ClusterConfig
from edge.cluster.protocol import (
    CTL,
    MAX_SEQS,
    READY,
    STAGE,
    Bye,
    Copy,
    Drop,
    Echo,
    Msg,
    Ping,
    Ready,
    Reset,
    Shutdown,
    StageAssign,
    Staged,
    StageStep,
    Yield,
    master_rank,
)
from edge.cluster.ship import ShipServer, offer
from edge.embeddings import embed_ragged
from edge.engine import ClusterUnavailable, LocalRunner, Work, split_logits, wanted_rows
from edge.planner import LayoutDevice, aggregate_tok_s
from edge.shardio import load_shard
from lowband.comm import Communicator
from lowband.errors import (
    CommClosed,
    ConfigError,
    LowbandError,
    PeerLost,
    ProtocolError,
    TransportTimeout,
)
from transport.starlink import StarHub

logger = logging.getLogger(__name__)

_NET_ERRORS = (PeerLost, TransportTimeout, ProtocolError)
# A cache holding at most this many positions on another device moves to the step's device
# (recomputed there: a prompt's reused prefix, a stream's first tokens); a longer one stays
# where it is and its step is split. Recomputing 32 positions costs about one batched step.
MIGRATE_TOKENS = 32
# local groups of at least this many rows time the master's prompt-like passes: what a
# recomputed cache costs per position (``ReplicaTimes.position_ms``)
PREFILL_ROWS = 8


def move_home(held: int, decoded: int, rtt_ms: float, position_ms: float) -> bool:
    """Whether a lone stream whose cache of ``held`` positions sits on a worker moves to the
    master (its positions recomputed there at ``position_ms`` each) rather than pay a round
    trip of ``rtt_ms`` per token there. The runner does not know how many tokens the stream
    has left; it takes the tokens it decoded so far (``decoded``) as the estimate (a stream
    of unknown length is as likely to be in its first half as in its second: the median of
    what is left is what has passed), so a long prompt with a few tokens decoded stays and a
    stream that has decoded for a while comes home."""
    return decoded * rtt_ms > held * position_ms


def split_pays(
    active: int,
    layers: int,
    step_ms: Sequence[tuple[int, float]],
    rtt_ms: Sequence[float],
    per_device: int = 1,
) -> bool:
    """Whether splitting ``active`` streams over the devices (``per_device`` lanes each) is
    predicted faster than one device's batched step of them all: the planner's aggregate
    rates (:func:`edge.planner.aggregate_tok_s`, replica against single) from ``step_ms``,
    the ms of one decoder layer for a step of that many rows (rows 1 among them; linear
    between), and the round trip to each worker. A tie keeps the one step."""
    if active < 2 or not rtt_ms:
        return False
    table = dict(step_ms)
    if 1 not in table:
        raise ConfigError("step_ms", "the step costs need the one-row step (rows 1)")
    batch = tuple((b, ms) for b, ms in sorted(table.items()) if b > 1)
    one = LayoutDevice(name="master", layer_ms=table[1], memory_mb=0.0, batch_layer_ms=batch)
    devs = [one] + [
        LayoutDevice(name=f"worker{d}", layer_ms=table[1], memory_mb=0.0, rtt_ms=r,
                     batch_layer_ms=batch)
        for d, r in enumerate(rtt_ms, start=1)
    ]  # fmt: skip
    rep = aggregate_tok_s("replica", active, (layers,), devs, lanes=per_device)
    return rep > aggregate_tok_s("single", active, (layers,), devs[:1])


def measure_step_ms(runner: LocalRunner, rows: int, steps: int = 5) -> float:
    """ms of one decoder layer for a decode step of ``rows`` streams at once on ``runner``
    (greedy; the median of the steps after the first two)."""
    L = runner.model.config.num_hidden_layers
    slots = list(range(1, rows + 1))
    toks, times = [1] * rows, []
    with torch.inference_mode():
        for pos in range(steps):
            work = [Work(slot=s, ids=(t,), start=pos) for s, t in zip(slots, toks)]
            t0 = time.perf_counter()
            out = runner.forward_batch(work, top=1)
            times.append(time.perf_counter() - t0)
            toks = [int(lg.argmax()) if lg is not None else 1 for lg in out]
    for s in slots:
        runner.drop(s)
    return 1e3 * statistics.median(times[2:]) / L


@dataclass(frozen=True)
class Group:
    """One device's part of a step: the items as sent (a moved cache's recomputed positions
    first) and, for a worker, the message."""

    device: int
    items: tuple[Work, ...]
    msg: StageStep | None
    sent: float = 0.0  # perf_counter when it left for its worker


@dataclass
class ReplicaFlight:
    """A step in flight: the engine's items, its groups and the master's own logits."""

    work: tuple[Work, ...]
    groups: tuple[Group, ...]
    k: int
    local: dict[int, torch.Tensor | None] = field(default_factory=dict)

    @property
    def devices(self) -> set[int]:
        return {g.device for g in self.groups}


@dataclass
class ReplicaTimes:
    """Where the master's time goes (``/health`` ``cycle``), seconds summed over the steps:
    its own groups (``local_s``: embedding, layers, head), handing groups to the links
    (``send_s``), blocked on a worker's answer (``wait_s``: the master idle), turning the
    answers into logits (``head_s``). ``rows``: rows each device ran; ``moved``: positions
    recomputed on another device (``home``: lone streams brought to the master, see
    :func:`move_home`); ``remote_groups`` and their ``round_s``: from a group's send to its
    answer (the round trip, the worker's queue and compute); ``prefill_rows`` and
    ``prefill_s``: the master's groups of at least ``PREFILL_ROWS`` rows."""

    devices: int
    steps: int = 0
    rows: list[int] = field(default_factory=list)
    moved: int = 0
    home: int = 0
    remote_groups: int = 0
    round_s: float = 0.0
    local_s: float = 0.0
    send_s: float = 0.0
    wait_s: float = 0.0
    head_s: float = 0.0
    prefill_rows: int = 0
    prefill_s: float = 0.0
    since: float = field(default_factory=time.perf_counter)

    def __post_init__(self) -> None:
        self.rows = [0] * self.devices

    def position_ms(self) -> float | None:
        """ms the master spends per position of a recomputed cache: its prompt-like groups'
        rate, else (none ran yet) its mean per row (decode steps: dearer per row, so a cache
        moves later rather than sooner); None before it ran a group."""
        if self.prefill_rows:
            return 1e3 * self.prefill_s / self.prefill_rows
        return 1e3 * self.local_s / self.rows[0] if self.rows[0] else None

    def report(self) -> dict[str, Any]:
        wall = time.perf_counter() - self.since
        out: dict[str, Any] = {"steps": self.steps, "rows": list(self.rows), "moved": self.moved}
        out["home"] = self.home
        out["wall_s"], out["remote_groups"] = round(wall, 3), self.remote_groups
        for k in ("local_s", "send_s", "wait_s", "head_s", "round_s"):
            out[k] = round(getattr(self, k), 6)
        return out


class ReplicaRunner:
    """Runner (see ``edge.engine``) for the master of a replica layout (module docstring)."""

    def __init__(
        self,
        comm: Communicator,
        model_dir: str,
        cfg: ClusterConfig,
        plan: dict[str, Any] | None = None,
        step_ms: Sequence[tuple[int, float]] | None = None,
    ) -> None:
        """``step_ms``: ms of one decoder layer for a step of that many rows on a device
        (rows 1 among them; :func:`split_pays`), as the planner measured them; without it
        the runner measures steps of 1 and 2 x devices rows at start."""
        self.comm, self.cfg, self.model_dir = comm, cfg, str(model_dir)
        self._lock = threading.RLock()  # one step / ping at a time
        self._closed = threading.Event()
        self._healthy, self._status = False, "starting"
        self._fid = self._ping_n = 0
        self._plan = plan
        m = comm.quorum(min_world=cfg.devices, timeout=cfg.join_timeout)
        if master_rank(m.peers) != comm.rank:
            raise ConfigError("master", f"another peer ({m.peers[master_rank(m.peers)]}) leads")
        self.workers = [r for r in range(comm.world_size) if r != comm.rank][: cfg.devices - 1]
        self.hub = (
            StarHub(cfg.link_host, spin_s=cfg.link_spin_us * 1e-6)
            if cfg.link == "direct" and self.workers
            else None
        )
        self._on_link: set[int] = set()  # devices polling their link for the next step
        # the master's model: what plain ``edge serve`` runs on one device (repacked fast path)
        shard = load_shard(self.model_dir, dtype=cfg.dtype)
        try:
            shard.repack(cfg.repack)
        except BaseException:
            shard.close()
            raise
        self.local = LocalRunner(shard.model, shard.close, report=shard.store_report)
        self.model, self.config = shard.model, shard.model.config
        self._dev: dict[int, int] = {}  # slot -> the device holding its cache
        self._hist: dict[int, list[int]] = {}  # slot -> the tokens its cache holds
        self._floor: dict[int, int] = {}  # slot on a worker -> its cache's restart floor
        self._decoded: dict[int, int] = {}  # slot -> single-token steps since its cache began
        self._flights: deque[ReplicaFlight] = deque()
        self.times = ReplicaTimes(devices=len(self.workers) + 1)
        self._assign()
        self.rtt_ms = [self._echo(d) for d in range(1, len(self.workers) + 1)]
        self.per_device = cfg.replica_lanes
        if step_ms is None:
            step_ms = [(b, measure_step_ms(self.local, b)) for b in sorted({1, 2 * self.devices})]
        self.step_ms = tuple(sorted(dict(step_ms).items()))
        if not self.step_ms or self.step_ms[0][0] != 1:
            raise ConfigError("step_ms", "the step costs need the one-row step (rows 1)")
        self._lanes_for: dict[int, int] = {}  # running streams -> lanes that pay (cached)
        self._healthy, self._status = True, "ok"
        self._heartbeat = threading.Thread(target=self._beat, name="edge-beat", daemon=True)
        self._heartbeat.start()

    # ---- setup and the links ----------------------------------------------------------------
    def _assign(self) -> None:
        cfg, L = self.cfg, self.config.num_hidden_layers
        for d, r in enumerate(self.workers, start=1):
            msg = StageAssign(
                stage=d,
                lo=0,
                hi=L,
                layers=L,
                model_dir=cfg.worker_model_dir or self.model_dir,
                dtype=cfg.dtype,
                op_timeout=cfg.op_timeout,
                silence_s=max(30.0, 10 * cfg.heartbeat_s) + cfg.op_timeout,
                link_port=self.hub.port if self.hub else None,
                link_secret=self.hub.secret if self.hub else None,
                link_spin_us=cfg.link_spin_us,
                repack=cfg.repack,
                whole_head=True,
                ship=cfg.ship,
            )
            self.comm.send(r, [], msg.encode(), tag=CTL)
        ship = ShipServer.of(self.model_dir) if cfg.ship and self.workers else None
        for d, r in enumerate(self.workers, start=1):
            if ship is not None:  # the worker fetches what its cache lacks, then loads
                served = offer(self.comm, r, ship, timeout=cfg.join_timeout)
                logger.info("worker rank %d: model shipped (%d chunks)", r, served)
            ready = Ready.decode(self.comm.recv(r, tag=READY, timeout=cfg.join_timeout)[1])
            if not ready.ok:
                raise ConfigError(
                    "worker", f"worker rank {r} could not load the model: {ready.error}"
                )
            if self.hub is not None:  # the worker dialled the link before saying ready
                self.hub.accept(d, timeout=cfg.op_timeout)
        logger.info("replica layout: the whole model on %d devices", len(self.workers) + 1)

    def _echo(self, d: int, n: int = 5) -> float:
        """Median ms of ``n`` round trips to worker device ``d`` (what a token of a stream
        whose cache sits there pays beside its compute; :func:`move_home`)."""
        times = []
        for i in range(n):
            k = 800_000 + d * 100 + i  # (the planner's echoes use 900_000..)
            t = time.perf_counter()
            self._ctl(d, Echo(n=k))
            self.comm.recv(self.workers[d - 1], tag=f"edge.echo{k}", timeout=self.cfg.op_timeout)
            times.append(1e3 * (time.perf_counter() - t))
        return sorted(times)[n // 2]

    def _ctl(self, d: int, msg: Msg) -> None:
        """A control message to worker device ``d`` (1..): one polling its link is first told
        to go back to the communicator, so the order of everything the master says is kept."""
        if d in self._on_link:
            self._on_link.discard(d)
            assert self.hub is not None
            self.hub.command(d, Yield().encode(), timeout=self.cfg.op_timeout)
        self.comm.send(self.workers[d - 1], [], msg.encode(), tag=CTL)

    def _tell(self, d: int, msg: Msg, what: str) -> None:
        try:
            self._ctl(d, msg)
        except _NET_ERRORS as exc:
            self._fail(exc, what)

    def _send_step(self, d: int, msg: StageStep, ids: torch.Tensor) -> None:
        if d in self._on_link:
            assert self.hub is not None
            self.hub.command(d, msg.encode(), [ids], timeout=self.cfg.op_timeout)
            return
        self.comm.send(self.workers[d - 1], [ids], msg.encode(), tag=CTL)
        if self.hub is not None:
            self._on_link.add(d)

    def _answer(self, d: int, fid: int, n: int) -> tuple[list[torch.Tensor], Staged]:
        """Worker device ``d``'s answer to step ``fid``: ``n`` tensors (-1: any number)."""
        if self.hub is not None:
            tensors, meta = self.hub.reply_from(d, timeout=self.cfg.op_timeout)
        else:
            tensors, meta = self.comm.recv(
                self.workers[d - 1], tag=STAGE, timeout=self.cfg.op_timeout
            )
        got = Staged.decode(meta)
        if got.fid != fid or len(tensors) != n and n >= 0:
            raise ProtocolError(
                f"device {d} answered step {got.fid} with {len(tensors)} tensors, "
                f"expected {fid} with {n}"
            )
        return list(tensors), got

    def _fail(self, exc: BaseException, where: str) -> ClusterUnavailable:
        if self.hub is not None:
            self.hub.abort()
        self._on_link.clear()
        self._flights.clear()
        self._healthy = False
        self._status = f"failed: {where}: {exc}"
        logger.warning("replica layout failed at %s: %s", where, exc)
        return ClusterUnavailable(
            f"a replica device failed ({where}: {exc}); the request was aborted. The replica "
            "layout does not re-form after a loss: restart the cluster (see /health)"
        )

    def _beat(self) -> None:
        """Idle health check, so workers do not take a quiet master for a dead one."""
        while not self._closed.wait(self.cfg.heartbeat_s):
            if not self._healthy or not self._lock.acquire(blocking=False):
                continue
            if self._flights:
                self._lock.release()
                continue
            try:
                self._ping_n += 1
                for d in range(1, len(self.workers) + 1):
                    self._ctl(d, Ping(n=self._ping_n, epoch=self.comm.membership.epoch))
                self.comm.barrier(tag=f"ping{self._ping_n}", timeout=self.cfg.op_timeout)
            except _NET_ERRORS as exc:
                self._fail(exc, "heartbeat")
            except CommClosed:
                return
            finally:
                self._lock.release()

    # ---- placement --------------------------------------------------------------------------
    @property
    def devices(self) -> int:
        return len(self.workers) + 1

    @property
    def lanes(self) -> int:
        """Steps the engine keeps in flight: ``per_device`` per device."""
        return self.per_device * self.devices

    def lanes_for(self, active: int) -> int:
        """Lanes that pay for ``active`` running streams (asked by the engine as it plans):
        1 while one device's batched step of them is predicted at least as fast as splitting
        them (:func:`split_pays`), else :attr:`lanes`."""
        n = self._lanes_for.get(active)
        if n is None:
            L = self.config.num_hidden_layers
            pays = split_pays(active, L, self.step_ms, self.rtt_ms, self.per_device)
            n = self._lanes_for[active] = self.lanes if pays else 1
        return n

    def _check(self, work: Sequence[Work]) -> None:
        if not self._healthy:
            raise ClusterUnavailable(f"the replica layout is not ready ({self._status})")
        if len({w.slot for w in work}) != len(work):
            raise RuntimeError("a batch names a cache twice")
        flying = {w.slot for f in self._flights for w in f.work}
        for w in work:
            held = len(self._hist.get(w.slot, ()))
            why = None
            if not w.ids:
                why = "is empty"
            elif not 0 <= w.slot < MAX_SEQS:
                why = f"is beyond the {MAX_SEQS} caches a device holds"
            elif w.slot in flying:
                why = "has a step still in flight"
            elif w.start > held:
                why = f"appends at position {w.start}, but the cache holds {held}"
            elif 0 < w.start < self.slot_floor(w.slot):
                why = f"restarts at {w.start}, below the sliding window's floor"
            if why is not None:
                raise RuntimeError(f"batch item on cache {w.slot} {why}")

    def _target(self, pinned: Sequence[int]) -> int:
        """The device of a step whose pinned items sit on ``pinned`` (module docstring)."""
        if pinned:
            counts = Counter(pinned).most_common()
            return min(d for d, n in counts if n == counts[0][1])
        if not self._flights:
            return 0
        groups = [0] * self.devices
        for f in self._flights:
            for g in f.groups:
                groups[g.device] += 1
        # the fewest groups in flight, a worker first on a tie: a worker then gets its
        # second lane while the master computes its first, so it has a group queued
        return min(range(self.devices), key=lambda d: (groups[d], d == 0, d))

    def _place(self, work: Sequence[Work]) -> list[tuple[int, Work]]:
        """Each item's device and the item as that device computes it."""
        held = {w.slot: self._dev.get(w.slot) if w.start > 0 else None for w in work}
        pin = {
            w.slot
            for w in work
            if held[w.slot] is not None and (w.start > MIGRATE_TOKENS or w.logits == "all")
        }
        if not self._flights:  # a lone step: a long cache on a worker may come home
            pin -= {w.slot for w in work if w.slot in pin and self._home(w, held[w.slot])}
        f = self._target([held[s] for s in pin])  # type: ignore[misc]
        out = []
        for w in work:
            d = held[w.slot]
            if w.slot in pin or d == f:
                out.append((d if d is not None else f, w))
                continue
            old = self._dev.get(w.slot)
            if old is not None and old != f:
                self._forget(w.slot, old)  # its positions are recomputed (or it starts anew)
            if w.start > 0:  # positions recomputed on f: the tokens this cache held first
                ids = (*self._hist[w.slot][: w.start], *w.ids)
                self.times.moved += w.start
                w = Work(slot=w.slot, ids=ids, start=0, logits=w.logits)
            out.append((f, w))
        return out

    def _home(self, w: Work, d: int | None) -> bool:
        """Whether ``w``'s cache on worker device ``d`` moves to the master (:func:`move_home`
        with the measured round trip and recompute rate)."""
        pos_ms = self.times.position_ms()
        if not d or w.logits == "all" or pos_ms is None:
            return False
        decoded = self._decoded.get(w.slot, 0)
        if not move_home(w.start, decoded, self.rtt_ms[d - 1], pos_ms):
            return False
        logger.info(
            "cache %d (%d positions) moves to the master: %d tokens decoded x %.1f ms round "
            "trip > %.1f ms to recompute it",
            w.slot, w.start, decoded, self.rtt_ms[d - 1], w.start * pos_ms,
        )  # fmt: skip
        self.times.home += 1
        return True

    def _forget(self, slot: int, d: int) -> None:
        """Free ``slot``'s cache on device ``d`` (it moves, or is dropped)."""
        if d == 0:
            self.local.drop(slot)
        elif self._healthy:
            self._floor.pop(slot, None)
            self._tell(d, Drop(epoch=self.comm.membership.epoch, cache=slot), "dropping a cache")

    # ---- the step ---------------------------------------------------------------------------
    def forward_batch(self, work: Sequence[Work], top: int = 0) -> list[torch.Tensor | None]:
        with self._lock:
            if self._flights:
                raise RuntimeError("a step was submitted and not collected")
            return self._collect(self._submit(work, top))

    def submit(self, work: Sequence[Work], top: int = 0) -> ReplicaFlight:
        """Place ``work``, send its remote groups, compute its local group; :meth:`collect`
        (in the order submitted) returns its logits as :meth:`forward_batch` would."""
        with self._lock:
            return self._submit(work, top)

    def collect(self, flight: ReplicaFlight) -> list[torch.Tensor | None]:
        with self._lock:
            if not self._healthy:  # (a failure forgot every step in flight)
                raise ClusterUnavailable(f"the replica layout is not ready ({self._status})")
            if not self._flights or self._flights[0] is not flight:
                raise RuntimeError("steps in flight are collected in the order submitted")
            return self._collect(flight)

    def _submit(self, work: Sequence[Work], top: int) -> ReplicaFlight:
        self._check(work)
        V = self.config.vocab_size
        k = top if 0 < top < V else 0  # (a worker answers the best k logits; 0: the hidden)
        by_dev: dict[int, list[Work]] = {}
        for d, w in self._place(work):
            by_dev.setdefault(d, []).append(w)
            self._dev[w.slot] = d
            self._hist[w.slot] = [*self._hist.get(w.slot, ())][: w.start] + list(w.ids)
        for w in work:  # (the engine's items: a moved cache's recomputed positions aside)
            n = self._decoded.get(w.slot, 0) if w.start > 0 else 0
            self._decoded[w.slot] = n + 1 if len(w.ids) == 1 and w.start > 0 else n
        ts = self.times
        groups = []
        epoch = self.comm.membership.epoch
        try:
            for d in sorted(by_dev, reverse=True):  # the workers' groups first, the master's last
                g = by_dev[d]
                ts.rows[d] += sum(len(w.ids) for w in g)
                if d == 0:
                    groups.append(Group(0, tuple(g), None))
                    continue
                self._fid += 1
                msg = StageStep(
                    fid=self._fid,
                    epoch=epoch,
                    caches=[w.slot for w in g],
                    starts=[w.start for w in g],
                    lengths=[len(w.ids) for w in g],
                    link=self.hub is not None,
                    top=k,
                    rows=wanted_rows(g),
                    embed=True,
                )
                t0 = time.perf_counter()
                ids = torch.tensor([[t for w in g for t in w.ids]], dtype=torch.float32)
                self._send_step(d, msg, ids)  # (token ids as float32: exact below 2^24)
                ts.send_s += time.perf_counter() - t0
                groups.append(Group(d, tuple(g), msg, t0))
        except _NET_ERRORS as exc:
            raise self._fail(exc, "a replica step") from exc
        flight = ReplicaFlight(tuple(work), tuple(groups), k)
        self._flights.append(flight)
        if 0 in by_dev:
            t0 = time.perf_counter()
            g = by_dev[0]
            try:
                flight.local = dict(zip((w.slot for w in g), self.local.forward_batch(g, top)))
            except BaseException:
                self._abandon(flight)
                raise
            dt = time.perf_counter() - t0
            ts.local_s += dt
            if (n := sum(len(w.ids) for w in g)) >= PREFILL_ROWS:
                ts.prefill_rows, ts.prefill_s = ts.prefill_rows + n, ts.prefill_s + dt
        ts.steps += 1
        return flight

    def _collect(self, flight: ReplicaFlight) -> list[torch.Tensor | None]:
        """Every worker's answer (in the order sent) as logits; the items' in the engine's
        order."""
        got = dict(flight.local)
        V, ts = self.config.vocab_size, self.times
        try:
            for g in flight.groups:
                if g.msg is None:
                    continue
                rows = g.msg.rows or []
                n = (2 if flight.k else 1) if rows else 0
                t0 = time.perf_counter()
                tensors, answer = self._answer(g.device, g.msg.fid, n)
                t1 = time.perf_counter()
                ts.wait_s += t1 - t0
                ts.round_s += t1 - g.sent
                ts.remote_groups += 1
                for c, fl in zip(g.msg.caches, answer.floors or [0] * len(g.msg.caches)):
                    self._floor[c] = fl
                logits = self._logits(tensors, len(rows), flight.k, V) if rows else None
                got.update(zip((w.slot for w in g.items), split_logits(g.items, logits)))
                ts.head_s += time.perf_counter() - t1
        except _NET_ERRORS as exc:
            raise self._fail(exc, "a replica step") from exc
        self._flights.popleft()
        return [got[w.slot] for w in flight.work]

    def _abandon(self, flight: ReplicaFlight) -> None:
        """A step whose local group failed: the workers' answers read and dropped, and every
        cache of the step forgotten (the engine fails its requests)."""
        try:
            for g in flight.groups:
                if g.msg is not None:
                    self._answer(g.device, g.msg.fid, -1 if g.msg.rows else 0)
        except _NET_ERRORS as exc:
            raise self._fail(exc, "a replica step") from exc
        finally:
            if flight in self._flights:
                self._flights.remove(flight)
        for w in flight.work:
            self.drop(w.slot)

    def _logits(self, tensors: list[torch.Tensor], R: int, k: int, V: int) -> torch.Tensor:
        """(R, V) logits from a worker's answer: its best ``k`` (values, ids), -inf elsewhere
        (the sampler's candidates, as ``edge.tp.gather_logits``); k = 0: the hidden rows
        through the master's own head."""
        if not k:
            h = tensors[0]
            if tuple(h.shape) != (R, self.config.hidden_size):
                raise ProtocolError(f"a worker sent hidden rows {tuple(h.shape)}, not {R} rows")
            with torch.inference_mode():
                return self.model.head(h).float()
        vals, ids = tensors
        if tuple(vals.shape) != (R, k) or tuple(ids.shape) != (R, k):
            raise ProtocolError(f"a worker sent {tuple(vals.shape)} best logits, not {R}x{k}")
        wi = ids.long()
        if int(wi.min()) < 0 or int(wi.max()) >= V:
            raise ProtocolError("a worker named token ids outside the vocabulary")
        out = torch.full((R, V), float("-inf"), dtype=torch.float32)
        out.scatter_(1, wi, vals.float())
        return out

    def forward(self, ids: Sequence[int], start: int, top: int = 0) -> torch.Tensor:
        out = self.forward_batch([Work(slot=0, ids=list(ids), start=start)], top)[0]
        assert out is not None  # a "last" item always gets its row
        return out

    def embed(self, seqs: Sequence[Sequence[int]], pooling: str, chunk: int) -> torch.Tensor:
        """(B, H) as one device gives: the master's whole model, in caches of their own."""
        with self._lock:
            return embed_ragged(self.model, seqs, pooling, chunk)

    # ---- caches -----------------------------------------------------------------------------
    def slot_length(self, slot: int) -> int:
        return len(self._hist.get(slot, ()))

    def slot_floor(self, slot: int) -> int:
        d = self._dev.get(slot)
        if d is None:
            return 0
        return self.local.slot_floor(slot) if d == 0 else self._floor.get(slot, 0)

    def truncate(self, slot: int, n: int) -> None:
        """Forget positions n.. of ``slot`` (rejected draft tokens): a worker's cache is
        overwritten from n by the next step there."""
        with self._lock:
            if slot in self._hist:
                del self._hist[slot][n:]
            if self._dev.get(slot) == 0:
                self.local.truncate(slot, n)

    def copy_prefix(self, src: int, dst: int, n: int) -> None:
        """``dst`` holds positions 0..n-1 of ``src``, on ``src``'s device (what ``dst`` held
        elsewhere is dropped there)."""
        with self._lock:
            d = self._dev.get(src)
            flying = {w.slot for f in self._flights for w in f.work}
            if src == dst or not self._healthy or d is None or dst in flying:
                raise RuntimeError(f"cannot copy cache {src} to {dst} ({self._status})")
            if not 0 <= n <= len(self._hist[src]) or self.slot_floor(src) > 0:
                raise RuntimeError(f"cache {src} does not hold positions 0..{n - 1}")
            try:
                msg = Copy(epoch=self.comm.membership.epoch, src=src, dst=dst, n=n)
            except ProtocolError as exc:
                raise RuntimeError(str(exc)) from None
            old = self._dev.get(dst)
            if old is not None and old != d:
                self._forget(dst, old)
            if d == 0:
                self.local.copy_prefix(src, dst, n)
            else:
                self._tell(d, msg, "copying a prefix")
                self._floor[dst] = 0
            self._dev[dst], self._hist[dst] = d, self._hist[src][:n]
            self._decoded[dst] = 0

    def drop(self, slot: int) -> None:
        with self._lock:
            self._hist.pop(slot, None)
            self._decoded.pop(slot, None)
            d = self._dev.pop(slot, None)
            if d is not None and 0 <= slot < MAX_SEQS:
                self._forget(slot, d)

    def reset(self) -> None:
        with self._lock:
            try:  # the answers of steps still in flight are read (and dropped) first
                while self._flights and self._healthy:
                    self._collect(self._flights[0])
            except ClusterUnavailable:
                pass
            self.local.reset()
            self._dev, self._hist, self._floor, self._decoded = {}, {}, {}, {}
            if self._healthy:
                for d in range(1, len(self.workers) + 1):
                    self._tell(d, Reset(), "reset")

    def cached_tokens(self) -> int:
        return self.slot_length(0)

    def restart_floor(self) -> int:
        return self.slot_floor(0)

    def wire_bytes(self) -> int:
        s = self.comm.stats()
        return s.bytes_sent + s.bytes_received

    def health(self) -> dict:
        slots = [0] * self.devices
        for d in self._dev.values():
            slots[d] += 1
        out: dict[str, Any] = {
            "healthy": self._healthy,
            "status": self._status,
            "devices": self.devices,
            "lanes": self.lanes,
            "connected": self.comm.membership.world_size,
            "layout": "replica",
            "slots": slots,  # caches each device holds now (the master first)
            "rtt_ms": [round(x, 3) for x in self.rtt_ms],  # to each worker, measured at start
            # ms of one decoder layer per step of that many rows (lanes_for), from the start
            "step_ms": [[b, round(ms, 4)] for b, ms in self.step_ms],
            "cycle": self.times.report(),
        }
        if self._plan is not None:
            out["plan"] = self._plan
        return out

    def store_report(self) -> dict | None:
        return self.local.store_report()

    def close(self) -> None:
        self._closed.set()
        with self._lock:
            told = []
            for d, r in enumerate(self.workers, start=1):
                try:
                    self._ctl(d, Shutdown())
                    told.append(r)
                except LowbandError:
                    pass
            for r in told:
                try:
                    Bye.decode(self.comm.recv(r, tag=READY, timeout=5.0)[1])
                except LowbandError:
                    pass
        if self.hub is not None:
            self.hub.close()
        self.local.close()
