"""The master of a pipeline layout: stage 0 of the plan and the engine's :class:`BatchRunner`.

Each device holds a contiguous range of decoder layers (``edge.cluster.stage``) and its KV
caches. A step embeds the tokens here, runs stage 0, then the hidden state (1, N, H) visits
stage 1, 2, ... and comes back for the final norm and LM head: per stage it crosses a link
once, where tensor parallelism pays two round trips per layer. The master relays between
stages (star): with two devices that is the ring; with more, each extra stage costs one more
hop than a ring would (worker-to-worker links are future work).

The LM head (as much work as all the layers together on a small model with a large vocabulary,
Gemma 3 270M's) is split by vocabulary rows between the master and the last stage, in the
proportion of their layers: when the sampler picks among the ``top`` best logits (greedy,
top-k), the last stage sends its rows' best ``top`` beside the hidden state and the master
merges them with its own (the logits it can pick from equal one device's, -inf elsewhere,
as ``edge.tp.gather_logits``); a step that needs every logit runs the master's whole head.

Streams in flight: the step's work items are cut into micro-batches (``edge.cluster.layout``);
every group is sent on before any answer is awaited, so while stage 1 runs group g the master
runs stage 0 of group g+1, and the head of group g while stage 1 runs group g+1. A prompt
chunk rides in its group like a decode token (chunked prefill flows through the stages).

Across steps (``lanes``, the engine's lanes of ``edge.engine``): :meth:`submit` runs stage 0
of one group and sends it on, :meth:`collect` takes that group's answer (in the order
submitted) and its logits. The engine keeps ``micro_batches`` groups of streams in flight,
each a step behind the other: it samples group A's tokens and submits A's next step while
stage 1 runs group B, so neither device waits for the other nor for the round trip as long
as one group's stage-0 work outlasts the link (a step no longer drains the pipeline).
Control messages may be sent while groups are in flight: a stage serves its messages in
order, so a copy or drop comes after the steps sent before it, as on the master.

Failure: a stage that does not answer in ``op_timeout``, or a lost peer or link, fails the
step with :class:`ClusterUnavailable` naming the stage (the engine fails the requests of the
step) and the master re-forms the pipeline in the background: it forgets every KV cache
(``slot_length`` 0: the engine recomputes), drops the links, tells every worker to regroup
(``regroup``) and joins the quorum of its ``devices``, assigns each stage again (to the worker
that held it where it is still in the group, else to a newcomer) and accepts the links anew.
A stage worker whose step or link failed keeps its layers and waits on the communicator for
that ``regroup`` (``edge.cluster.worker``), and an assignment equal to the one it holds keeps
them loaded. While re-forming, every request fails at once with the status (``/health``:
``re-forming: ...``, then ``ok`` with ``reformed`` counted and the ``epoch``); past
``join_timeout`` without the workers it says ``failed: ... still waiting`` and keeps trying.
Steps sent before a re-forming are never collected (``Flight.era``); a late answer to one on
the communicator is dropped by its step number.

Shipping (``cfg.ship``): each stage worker is sent the whole model file (``edge.cluster.ship``:
hashed, cached, resumed) right after its assignment, also when the pipeline re-forms (then a
cache hit: nothing is transferred), and loads its stage from its cache.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from edge.cluster.layout import budget_ranges, micro_batches, stage_ranges, stage_weight_bytes
from edge.cluster.master import ClusterConfig
from edge.cluster.protocol import (
    CTL,
    MAX_SEQS,
    READY,
    STAGE,
    Bye,
    Copy,
    Drop,
    Msg,
    Ping,
    Ready,
    Regroup,
    Reset,
    Shutdown,
    StageAssign,
    Staged,
    StageStep,
    Yield,
    master_rank,
)
from edge.cluster.shard import append_problem, embed_in_scratch
from edge.cluster.ship import ShipServer, offer
from edge.cluster.stage import LayerRange, Stage
from edge.embeddings import embed_ragged
from edge.engine import ClusterUnavailable, Work, split_logits, wanted_rows
from edge.formats.gguf_arch import is_gguf
from edge.shardio import WindowConfig, load_shard
from lowband.comm import Communicator
from lowband.errors import (
    CommClosed,
    ConfigError,
    LowbandError,
    PeerLost,
    ProtocolError,
    TransportTimeout,
)
from lowband.models.llama import KVCache, Span
from transport.starlink import StarHub

logger = logging.getLogger(__name__)

_NET_ERRORS = (PeerLost, TransportTimeout, ProtocolError)


@dataclass(frozen=True)
class Flight:
    """A step in flight (:meth:`PipelineRunner.submit`): its work items, their micro-batches,
    the stage steps sent for them and the candidates ``k`` each half of the head answers."""

    work: tuple[Work, ...]
    groups: tuple[tuple[Work, ...], ...]
    msgs: tuple[StageStep, ...]
    k: int
    era: int = 0  # the pipeline's re-formations before it was sent (its answers die with one)


@dataclass
class CycleTimes:
    """Where the master's time goes (``/health`` ``cycle``), seconds summed over the steps:
    its stage's layers (``stage_s``, embedding included), handing hidden states to the link
    (``send_s``), blocked on a stage's answer (``wait_s``: the master idle), its rows of the
    head and the merge (``head_s``). The rest of the wall time is the engine's (sampling,
    streaming) and the server's."""

    steps: int = 0
    rows: int = 0
    stage_s: float = 0.0
    send_s: float = 0.0
    wait_s: float = 0.0
    head_s: float = 0.0
    since: float = field(default_factory=time.perf_counter)

    def report(self) -> dict[str, Any]:
        wall = time.perf_counter() - self.since
        out: dict[str, Any] = {"steps": self.steps, "rows": self.rows, "wall_s": round(wall, 3)}
        for k in ("stage_s", "send_s", "wait_s", "head_s"):
            out[k] = round(getattr(self, k), 6)
        return out


def budgeted_ranges(model_dir: str, cfg: ClusterConfig) -> list[LayerRange]:
    """Stage ranges within ``cfg.memory_budget_mb`` per device (``budget_ranges``: the first
    stage holds the embedding and the head's first rows beside its layers, the last stage the
    head's other rows), from a GGUF file's header; a ``ConfigError`` when none fits."""
    if not is_gguf(model_dir):
        raise ConfigError(
            "memory_budget_mb",
            "the pipeline layout's memory budget maps each stage from a GGUF file; "
            f"{model_dir} is not one",
        )
    from edge.formats.gguf_window import stage_sizes

    layer_bytes, embed, head, tied = stage_sizes(model_dir)
    budget = int(float(cfg.memory_budget_mb or 0) * 2**20)
    ranges = budget_ranges(
        cfg.weights or [1.0] * cfg.devices, budget, layer_bytes, embed, head, tied
    )
    held = stage_weight_bytes(ranges, layer_bytes, embed, head, tied)
    logger.info(
        "pipeline within %.0f MB per device: %s",
        budget / 2**20,
        ", ".join(f"layers {r.lo}..{r.hi - 1} ({b / 2**20:.0f} MB)" for r, b in zip(ranges, held)),
    )
    return ranges


class PipelineRunner:
    """Runner (see ``edge.engine``) for the master (stage 0) of an S-stage pipeline."""

    def __init__(
        self,
        comm: Communicator,
        model_dir: str,
        cfg: ClusterConfig,
        ranges: Sequence[LayerRange] | None = None,
        plan: dict[str, Any] | None = None,
    ) -> None:
        self.comm, self.cfg, self.model_dir = comm, cfg, str(model_dir)
        self._lock = threading.RLock()  # one step / ping at a time
        self._closed = threading.Event()
        self._healthy, self._status = False, "starting"
        self._fid = self._ping_n = 0
        self._plan = plan  # what the planner chose and why (shown in /health)
        self._reformer: threading.Thread | None = None  # re-forming after a failure
        self._reforming = False
        self._failure = ""  # the last failure, for /health
        self._era = 0  # times the pipeline re-formed
        self._regrouping = False  # a re-forming attempt is in its quorum
        m = comm.quorum(min_world=cfg.devices, timeout=cfg.join_timeout)
        if master_rank(m.peers) != comm.rank:
            raise ConfigError("master", f"another peer ({m.peers[master_rank(m.peers)]}) leads")
        self.workers = self._others()[: cfg.devices - 1]
        # Steps and answers travel on the star link (the compute threads, no I/O thread hop:
        # see transport.starlink); control messages on the communicator. _on_link: stages
        # polling their link for the next step (told to "yield" before any control message).
        self.hub = (
            StarHub(cfg.link_host, spin_s=cfg.link_spin_us * 1e-6)
            if cfg.link == "direct" and self.workers
            else None
        )
        self._on_link: set[int] = set()
        # a memory budget: each device's stage sized to hold at most that many MB of weights
        # and loaded mapped from the file, only its own layers ever read; no repacked copy
        self.mapped = cfg.memory_budget_mb is not None
        self.repack = "off" if self.mapped else cfg.repack
        if self.mapped and ranges is None:
            ranges = budgeted_ranges(self.model_dir, cfg)
        if self.mapped and ranges is not None:
            rows = (ranges[0].lo, ranges[0].hi)
            window = WindowConfig(window=rows[1] - rows[0])
            shard = load_shard(
                self.model_dir, dtype=cfg.dtype, fast=False, window=window, layers=rows
            )
        else:
            shard = load_shard(self.model_dir, dtype=cfg.dtype, fast=False)
        L = shard.model.config.num_hidden_layers
        self.ranges = list(ranges or stage_ranges(L, cfg.weights or [1.0] * cfg.devices))
        if len(self.ranges) != cfg.devices or self.ranges[0].lo != 0:
            shard.close()
            raise ConfigError("layout", f"{len(self.ranges)} stage ranges for {cfg.devices}")
        try:
            self.stage = Stage(shard, self.ranges[0])
            self.stage.repack(self.repack)  # (after the other layers are freed: see load_stage)
        except BaseException:
            shard.close()
            raise
        self.model = self.stage.model
        self.config = self.model.config
        self.head_lo = self._cut_head()
        self._kv: dict[int, KVCache] = {}
        self._flights: deque[Flight] = deque()  # submitted, not yet collected (in order)
        self.times = CycleTimes()
        self._assign()
        self._healthy, self._status = True, "ok"
        self._heartbeat = threading.Thread(target=self._beat, name="edge-beat", daemon=True)
        self._heartbeat.start()

    # ---- setup ------------------------------------------------------------------------------
    def _cut_head(self) -> int:
        """Split the LM head's vocabulary between the master (rows 0..a-1) and the last stage
        (a..V-1): ``cfg.head_share`` of it on the master, by default in the proportion of their
        layers; returns a (0: the master keeps it whole, as with one stage or a head that
        cannot be cut)."""
        V = self.config.vocab_size
        first, last = self.ranges[0], self.ranges[-1]
        if len(self.ranges) < 2 or V < 4:
            return 0
        n0, n1 = first.hi - first.lo, last.hi - last.lo
        share = self.cfg.head_share if self.cfg.head_share is not None else n0 / (n0 + n1)
        a = min(V - 1, max(1, round(V * share)))
        try:
            self.stage.cut_head(0, a)
        except ValueError as exc:
            logger.info("the LM head stays whole on the master: %s", exc)
            return 0
        return a

    def _assign(self) -> None:
        cfg = self.cfg
        L = self.config.num_hidden_layers
        for s, (r, rng) in enumerate(zip(self.workers, self.ranges[1:]), start=1):
            msg = StageAssign(
                stage=s,
                lo=rng.lo,
                hi=rng.hi,
                layers=L,
                model_dir=cfg.worker_model_dir or self.model_dir,
                dtype=cfg.dtype,
                op_timeout=cfg.op_timeout,
                silence_s=max(30.0, 10 * cfg.heartbeat_s) + cfg.op_timeout,
                link_port=self.hub.port if self.hub else None,
                link_secret=self.hub.secret if self.hub else None,
                link_spin_us=cfg.link_spin_us,
                repack=self.repack,
                head_lo=self.head_lo if s == len(self.ranges) - 1 else 0,
                mapped=self.mapped,
                ship=cfg.ship,
            )
            self.comm.send(r, [], msg.encode(), tag=CTL)
        for s, r in enumerate(self.workers, start=1):
            if cfg.ship:  # the worker fetches what its cache lacks, then loads and answers
                served = offer(self.comm, r, self._shipment(), timeout=cfg.join_timeout)
                logger.info("stage %d (rank %d): model shipped (%d chunks)", s, r, served)
            ready = Ready.decode(self.comm.recv(r, tag=READY, timeout=cfg.join_timeout)[1])
            if not ready.ok:
                raise ConfigError(
                    "worker", f"worker rank {r} could not load stage {s}: {ready.error}"
                )
            if self.hub is not None:  # the worker dialled the link before saying ready
                self.hub.accept(s, timeout=cfg.op_timeout)
        logger.info("pipeline stages: %s", self.describe())

    def _others(self) -> list[int]:
        return [r for r in range(self.comm.world_size) if r != self.comm.rank]

    def _shipment(self) -> ShipServer:
        """The model's manifest and file for workers without a copy (hashed once)."""
        if getattr(self, "_ship", None) is None:
            self._ship = ShipServer.of(self.model_dir)
        return self._ship

    def describe(self) -> str:
        return ", ".join(f"stage {i}: layers {r.lo}..{r.hi - 1}" for i, r in enumerate(self.ranges))

    def _ctl(self, s: int, msg: Msg) -> None:
        """A control message to stage ``s`` (1..): one polling its link is first told to go
        back to the communicator, so the order of everything the master says is kept."""
        if s in self._on_link:
            self._on_link.discard(s)
            assert self.hub is not None
            self.hub.command(s, Yield().encode(), timeout=self.cfg.op_timeout)
        self.comm.send(self.workers[s - 1], [], msg.encode(), tag=CTL)

    def _send_all(self, msg: Msg) -> None:
        for s in range(1, len(self.workers) + 1):
            self._ctl(s, msg)

    def _fail(self, exc: BaseException, where: str) -> ClusterUnavailable:
        if self.hub is not None:
            self.hub.abort()  # wakes a stage waiting on its link for the next step
        self._on_link.clear()
        self._flights.clear()
        self._healthy = False
        self._status = self._failure = f"failed: {where}: {exc}"
        logger.warning("pipeline failed at %s: %s; re-forming", where, exc)
        if not self._closed.is_set() and not self._reforming:
            self._reforming = True  # (cleared by that thread, under the lock, when done)
            self._reformer = threading.Thread(target=self._reform, name="edge-reform", daemon=True)
            self._reformer.start()
        return ClusterUnavailable(
            f"a pipeline stage failed ({where}: {exc}); the request was aborted. The master "
            "re-forms the pipeline when its workers are back (see /health)"
        )

    def _quorum_s(self) -> float:
        return min(2.0, max(0.5, 5 * self.cfg.heartbeat_s))

    def _reform(self) -> None:
        try:
            self._reform_until_whole()
        except Exception as exc:  # (a bug: said in /health; the runner stays unhealthy)
            if self._closed.is_set():
                return  # (close() shut the links under it)
            logger.exception("re-forming the pipeline crashed")
            with self._lock:
                self._status, self._reforming = f"failed: re-forming crashed: {exc!r}", False

    def _reform_until_whole(self) -> None:
        """After a failure (module docstring): every cache dropped, the workers regrouped and
        assigned their stages again, the links accepted anew; retried until it succeeds or
        the runner closes, the status saying how long the workers have been awaited."""
        since = told = time.monotonic()
        announce = True
        with self._lock:  # (the failed step has returned)
            self._kv = {}
            self._status = f"re-forming: regrouping the stage workers ({self._failure})"
        while not self._closed.is_set():
            # A worker told to regroup joins quorum rounds until its join_timeout: tell it
            # again only after an attempt that got past its quorum, or that long after.
            announce = announce or time.monotonic() - told > self.cfg.join_timeout
            try:
                if announce:
                    told = time.monotonic()
                self._regrouping = False
                self._regroup(announce)
                announce = True
                self._assign()
            except CommClosed:
                break
            except LowbandError as exc:
                waited = time.monotonic() - since
                self._status = (
                    f"failed: the stage workers did not come back within "
                    f"{self.cfg.join_timeout:.0f}s ({exc}); still waiting for them"
                    if waited > self.cfg.join_timeout
                    else f"re-forming: waiting {waited:.0f}s for the stage workers ({exc})"
                )
                if self._regrouping:  # (the quorum failed: the workers told wait in it)
                    announce = False
                self._closed.wait(0.2)
                continue
            with self._lock:
                self._kv, self._era = {}, self._era + 1
                self._healthy, self._status, self._reforming = True, "ok", False
                logger.warning(
                    "pipeline re-formed (epoch %d) after %.1fs",
                    self.comm.membership.epoch,
                    time.monotonic() - since,
                )
                return
        with self._lock:
            self._reforming = False

    def _regroup(self, announce: bool) -> None:
        """Tell every other peer to join the next quorum (``announce``) and join it. Each stage
        stays with its worker where that one is still in the group; a newcomer takes the stage
        of one that is gone."""
        if self.hub is not None:
            for s in self.hub.slots():
                self.hub.drop(s)  # the workers dial again when assigned
        self._on_link.clear()
        held = [self.comm.membership.peers[r] for r in self.workers]
        if announce:
            regroup = Regroup(epoch=self.comm.membership.epoch).encode()
            for r in self._others():
                try:
                    self.comm.send(r, [], regroup, tag=CTL)
                except (PeerLost, TransportTimeout):
                    pass  # that one is gone; the quorum goes on without it
        self._regrouping = True
        m = self.comm.quorum(min_world=self.cfg.devices, timeout=self._quorum_s())
        self._regrouping = False
        if master_rank(m.peers) != self.comm.rank:
            raise ConfigError("master", f"another peer ({m.peers[master_rank(m.peers)]}) leads")
        rank = {m.peers[r]: r for r in self._others()}
        free = [r for r in self._others() if m.peers[r] not in held]
        self.workers = [rank[p] if p in rank else free.pop(0) for p in held]
        self._status = f"re-forming: assigning the stages again (epoch {m.epoch})"

    def _beat(self) -> None:
        """Idle health check, so workers do not take a quiet master for a dead one."""
        while not self._closed.wait(self.cfg.heartbeat_s):
            if not self._healthy or not self._lock.acquire(blocking=False):
                continue
            if self._flights:  # steps are flowing: the stages hear from the master anyway
                self._lock.release()
                continue
            try:
                self._ping_n += 1
                self._send_all(Ping(n=self._ping_n, epoch=self.comm.membership.epoch))
                self.comm.barrier(tag=f"ping{self._ping_n}", timeout=self.cfg.op_timeout)
            except _NET_ERRORS as exc:
                self._fail(exc, "heartbeat")
            except CommClosed:
                return
            finally:
                self._lock.release()

    # ---- the step ---------------------------------------------------------------------------
    def _cache(self, i: int) -> KVCache:
        c = self._kv.get(i)
        if c is None:
            c = self._kv[i] = self.stage.new_cache()
        return c

    def _check(self, work: Sequence[Work]) -> None:
        if not self._healthy:
            raise ClusterUnavailable(f"the pipeline is not ready ({self._status})")
        for w in work:
            why = append_problem(self._kv.get(w.slot), w.start) if w.ids else "is empty"
            if why is None and not 0 <= w.slot < MAX_SEQS:
                why = f"is beyond the {MAX_SEQS} caches a stage holds"
            if why is not None:
                raise RuntimeError(f"batch item on cache {w.slot} {why}")
        if len({w.slot for w in work}) != len(work):
            raise RuntimeError("a batch names a cache twice")
        flying = {w.slot for f in self._flights for w in f.work}
        if any(w.slot in flying for w in work):
            raise RuntimeError("a batch names a cache whose step is still in flight")

    @property
    def lanes(self) -> int:
        """Steps the engine may keep in flight (:meth:`submit`): G with two or more stages."""
        return self.cfg.micro_batches if len(self.ranges) > 1 else 1

    def forward_batch(self, work: Sequence[Work], top: int = 0) -> list[torch.Tensor | None]:
        """One step of continuous batching through every stage (module docstring)."""
        with self._lock:
            if self._flights:
                raise RuntimeError("a step was submitted and not collected")
            self._check(work)
            groups = micro_batches(work, [len(w.ids) for w in work], self.cfg.micro_batches)
            return self._collect(self._send(work, groups, top))

    def submit(self, work: Sequence[Work], top: int = 0) -> Flight:
        """Stage 0 of ``work`` (one micro-batch) sent on to stage 1; :meth:`collect` (in the
        order submitted) returns its logits as :meth:`forward_batch` would."""
        with self._lock:
            self._check(work)
            return self._send(work, [list(work)], top)

    def collect(self, flight: Flight) -> list[torch.Tensor | None]:
        """The logits of a :meth:`submit`; steps are collected in the order they were sent."""
        with self._lock:
            if not self._healthy:  # (a failure forgot every step in flight)
                raise ClusterUnavailable(f"the pipeline is not ready ({self._status})")
            if flight.era != self._era:
                raise ClusterUnavailable("the pipeline re-formed since this step was sent")
            if not self._flights or self._flights[0] is not flight:
                raise RuntimeError("steps in flight are collected in the order submitted")
            return self._collect(flight)

    def _send(self, work: Sequence[Work], groups: list[list[Work]], top: int) -> Flight:
        """Stage 0 of every group, each sent on at once."""
        V = self.config.vocab_size
        # the split head answers the sampler's candidates only (as tp.gather_logits): the best
        # ``k`` of each half, -inf elsewhere; all logits asked (top 0): the master's whole head
        k = top if self.head_lo and 0 < top and 2 * top < min(self.head_lo, V - self.head_lo) else 0
        epoch = self.comm.membership.epoch
        msgs = []
        try:
            for g in groups:
                self._fid += 1
                msg = StageStep(
                    fid=self._fid,
                    epoch=epoch,
                    caches=[w.slot for w in g],
                    starts=[w.start for w in g],
                    lengths=[len(w.ids) for w in g],
                    link=self.hub is not None,
                    top=k,
                    rows=wanted_rows(g) if k else None,
                )
                ids = torch.tensor([[t for w in g for t in w.ids]], dtype=torch.long)
                spans = [Span(self._cache(w.slot), w.start, len(w.ids)) for w in g]
                t0 = time.perf_counter()
                with torch.inference_mode():
                    h = self.stage.run(self.model.embed(ids), spans)
                t1 = time.perf_counter()
                msgs.append(msg)
                self._relay(0, msg, h)
                ts = self.times
                ts.stage_s += t1 - t0
                ts.send_s += time.perf_counter() - t1
                ts.steps += 1
                ts.rows += int(ids.shape[1])
        except _NET_ERRORS as exc:
            raise self._fail(exc, "a stage step") from exc
        flight = Flight(tuple(work), tuple(tuple(g) for g in groups), tuple(msgs), k, self._era)
        self._flights.append(flight)
        return flight

    def _collect(self, flight: Flight) -> list[torch.Tensor | None]:
        """The answers of ``flight``'s groups in the order sent (layout.py: no deadlock)."""
        V, k = self.config.vocab_size, flight.k
        out = []
        try:
            ts = self.times
            for g, msg in zip(flight.groups, flight.msgs):
                got = self._through(msg)
                h = got[0]
                rows = wanted_rows(g)
                t0 = time.perf_counter()
                if rows and msg.rows:
                    out.append(self._merge(h[0, rows], got[1], got[2], k, V))
                elif rows:
                    with torch.inference_mode():
                        out.append(self.model.head(h[0, rows]).float())
                ts.head_s += time.perf_counter() - t0
        except _NET_ERRORS as exc:
            raise self._fail(exc, "a stage step") from exc
        self._flights.popleft()
        return split_logits(flight.work, torch.cat(out) if out else None)

    def _through(self, msg: StageStep) -> list[torch.Tensor]:
        """Stages 1.. of a step :meth:`_send` started: each one's hidden state relayed to the
        next; the last stage's answer (its hidden state, then its best logits when asked)."""
        last = len(self.ranges) - 1
        got: list[torch.Tensor] = []
        for s in range(1, last + 1):
            t0 = time.perf_counter()
            got = self._answer(s, msg.fid, 3 if s == last and msg.rows else 1)
            self.times.wait_s += time.perf_counter() - t0
            if s < last:
                self._relay(s, msg, got[0])
        return got

    def embed(self, seqs: Sequence[Sequence[int]], pooling: str, chunk: int) -> torch.Tensor:
        """(B, H) as :meth:`edge.engine.LocalRunner.embed` gives on one device: each ragged
        pass goes through every stage (one micro-batch) in throw-away caches named above the
        engine's and dropped after; the last stage sends its hidden state back, and the
        master (which keeps the final norm) pools it. No logits are computed."""
        with self._lock:
            if self._flights:
                raise RuntimeError("embeddings while a step is in flight")
            if len(self.ranges) < 2:
                return embed_ragged(self.model, seqs, pooling, chunk)

            def ragged(work: list[Work]) -> torch.Tensor:
                self._check(work)
                flight = self._send(work, [work], 0)
                try:
                    h = self._through(flight.msgs[0])[0]
                except _NET_ERRORS as exc:
                    raise self._fail(exc, "an embedding pass") from exc
                self._flights.popleft()
                return h[0]

            return embed_in_scratch(self.model, self._kv, self.drop, seqs, pooling, chunk, ragged)

    def _merge(
        self, h: torch.Tensor, vals: torch.Tensor, ids: torch.Tensor, k: int, V: int
    ) -> torch.Tensor:
        """(R, V) logits: the best ``k`` of the master's head rows and of the last stage's
        (``vals``/``ids``), each equal to the whole head's, and -inf elsewhere."""
        R = h.shape[0]
        if tuple(vals.shape) != (R, k) or tuple(ids.shape) != (R, k):
            raise ProtocolError(f"the last stage sent {tuple(vals.shape)} best logits, not {R}x{k}")
        assert self.stage.head is not None
        mv, mi = self.stage.top_logits(h, k)
        out = torch.full((R, V), float("-inf"), dtype=torch.float32)
        out.scatter_(1, mi.long(), mv.float())
        wi = ids.long()
        if int(wi.min()) < self.head_lo or int(wi.max()) >= V:
            raise ProtocolError("the last stage named token ids outside its head rows")
        out.scatter_(1, wi, vals.float())
        return out

    def _relay(self, s: int, msg: StageStep, h: torch.Tensor) -> None:
        """The hidden state leaving stage ``s`` to stage ``s + 1``: on its link when it polls
        there, else on the communicator (which puts it on its link when there is one)."""
        nxt, x = s + 1, h.contiguous()
        if nxt in self._on_link:
            assert self.hub is not None
            self.hub.command(nxt, msg.encode(), [x], timeout=self.cfg.op_timeout)
            return
        self.comm.send(self.workers[s], [x], msg.encode(), tag=CTL)
        if self.hub is not None:
            self._on_link.add(nxt)

    def _answer(self, s: int, fid: int, n: int = 1) -> list[torch.Tensor]:
        """Stage ``s``'s answer to step ``fid``: ``n`` tensors (the hidden state, then the
        best logits and their ids where it holds head rows)."""
        while True:
            if self.hub is not None:
                tensors, meta = self.hub.reply_from(s, timeout=self.cfg.op_timeout)
            else:
                tensors, meta = self.comm.recv(
                    self.workers[s - 1], tag=STAGE, timeout=self.cfg.op_timeout
                )
            got = Staged.decode(meta)
            if got.fid >= fid:
                break
            # (over the communicator: a late answer to a step failed before a re-forming)
            logger.info("stage %d: dropping its answer to step %d, sent before", s, got.fid)
        if got.fid != fid or len(tensors) != n:
            raise ProtocolError(
                f"stage {s} answered step {got.fid} with {len(tensors)} tensors, "
                f"expected {fid} with {n}"
            )
        return list(tensors)

    def forward(self, ids: Sequence[int], start: int, top: int = 0) -> torch.Tensor:
        out = self.forward_batch([Work(slot=0, ids=list(ids), start=start)], top)[0]
        assert out is not None  # a "last" item always gets its row
        return out

    # ---- caches -----------------------------------------------------------------------------
    def _tell(self, msg: Msg, what: str) -> None:
        try:
            self._send_all(msg)
        except _NET_ERRORS as exc:
            self._fail(exc, what)

    def slot_length(self, slot: int) -> int:
        c = self._kv.get(slot)
        return 0 if c is None else c.length

    def slot_floor(self, slot: int) -> int:
        c = self._kv.get(slot)
        return 0 if c is None else c.restart_floor()

    def copy_prefix(self, src: int, dst: int, n: int) -> None:
        with self._lock:
            if src == dst or not self._healthy or self._kv.get(src) is None:
                raise RuntimeError(f"cannot copy cache {src} to {dst} ({self._status})")
            try:
                msg = Copy(epoch=self.comm.membership.epoch, src=src, dst=dst, n=n)
            except ProtocolError as exc:
                raise RuntimeError(str(exc)) from None
            self._cache(dst).copy_prefix(self._kv[src], n)
            self._tell(msg, "copying a prefix")

    def drop(self, slot: int) -> None:
        with self._lock:
            self._kv.pop(slot, None)
            if self._healthy and 0 <= slot < MAX_SEQS:
                self._tell(Drop(epoch=self.comm.membership.epoch, cache=slot), "dropping a cache")

    def reset(self) -> None:
        with self._lock:
            try:  # the answers of steps still in flight are read (and dropped) first
                while self._flights and self._healthy:
                    self._collect(self._flights[0])
            except ClusterUnavailable:
                pass  # (_fail marked the runner unhealthy and forgot the steps)
            self._kv = {}
            if self._healthy:
                self._tell(Reset(), "reset")

    def cached_tokens(self) -> int:
        return self.slot_length(0)

    def restart_floor(self) -> int:
        return self.slot_floor(0)

    def wire_bytes(self) -> int:
        s = self.comm.stats()
        return s.bytes_sent + s.bytes_received

    def health(self) -> dict:
        out: dict[str, Any] = {
            "healthy": self._healthy,
            "status": self._status,
            "devices": len(self.ranges),
            "connected": self.comm.membership.world_size,
            "layout": "pipeline",
            "stages": [[r.lo, r.hi] for r in self.ranges],
            "head_rows": [[0, self.head_lo], [self.head_lo, self.config.vocab_size]]
            if self.head_lo
            else [[0, self.config.vocab_size]],
            "micro_batches": self.cfg.micro_batches,
            "cycle": self.times.report(),
            "epoch": self.comm.membership.epoch,
            "reformed": self._era,
        }
        if self._failure:
            out["last_failure"] = self._failure
        if self._plan is not None:
            out["plan"] = self._plan
        return out

    def store_report(self) -> dict | None:
        return None

    def close(self) -> None:
        self._closed.set()
        if self._reformer is not None:  # (one in its quorum ends within a round)
            self._reformer.join(self._quorum_s() + 1.0)
        with self._lock:
            told = []
            for s, r in enumerate(self.workers, start=1):
                try:
                    self._ctl(s, Shutdown())
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
        self.stage.close()
