"""The master of a tensor-parallel cluster: slot 0 of the plan, the :class:`edge.engine.Runner`
the HTTP server drives, and the recovery of a cluster that lost a device (see ``edge.cluster``).

It is a :class:`edge.engine.BatchRunner`: every rank keeps one KV cache per sequence of the
engine, and a batched step is one ``batch`` message, one ragged pass on every rank (two
all-reduces per layer for the whole batch, whatever its size) and one exchange of the
vocabulary-parallel head for every row the engine wants.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence, cast

import torch

from edge.cluster.protocol import (
    CTL,
    MAX_SEQS,
    READY,
    Assign,
    Batch,
    Bye,
    Copy,
    Drop,
    Forward,
    Msg,
    Ping,
    Ready,
    Regroup,
    Report,
    Reset,
    Shutdown,
    Stats,
    Yield,
    master_rank,
    stats_tag,
)
from edge.cluster.shard import (
    Tags,
    append_problem,
    embed_in_scratch,
    load_slot,
    shard_logits,
    shard_rows_logits,
    wire_codec,
)
from edge.cluster.ship import ShipServer, offer
from edge.engine import ClusterUnavailable, Work, split_logits, wanted_rows
from edge.moe.serve import ExpertServeConfig
from edge.shardio import REPACK_MODES, WindowConfig, is_split_dir
from lowband.comm import Communicator, OpStats
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

if TYPE_CHECKING:
    from edge.planner import SplitPlan

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class ClusterConfig:
    """How the master drives its workers."""

    devices: int  # N: master + workers
    weights: tuple[float, ...] | None = None  # relative device capacities (uneven split)
    wire: str = "fp32"  # activation encoding on the wire
    algorithm: str = "star"  # all-reduce schedule: star (latency-bound links) or ring
    dtype: str | None = None
    window: int | None = None  # sliding window (layer blocks resident) on every device
    memory_budget_mb: float | None = None
    op_timeout: float = 30.0  # seconds; a forward step slower than this counts as a failure
    join_timeout: float = 600.0  # seconds to wait for all workers at start
    heartbeat_s: float = 2.0  # idle health-check period
    worker_model_dir: str | None = None  # path workers read; default: the master's path
    link: str = "direct"  # activations: "direct" (transport.starlink star over TCP) or "comm"
    # where the master's star link listens (workers dial the master host); the CLI sets it to
    # the coordinator's interface
    link_host: str = "127.0.0.1"
    # Microseconds each end of the direct link polls for an all-reduce answer before sleeping
    # in the kernel (transport.starlink._Conn): saves the wake-up of an idle core per
    # all-reduce, costs power while waiting. 0: always sleep.
    link_spin_us: float = 1000.0
    # After this many seconds without the lost worker, re-plan the split onto the devices that
    # are left (each then holds a bigger slice). Needs a plain checkpoint (a split directory is
    # cut for one device count). None: wait for the worker to come back.
    replan_after_s: float | None = None
    # A bit-nested MoE (``edge quantize --nested``): experts placed whole on the devices, each
    # serving its share of this budget from its own expert store. Required for such a dir.
    experts: ExpertServeConfig | None = None
    # Profile every device and let edge.planner choose the weights (and leave out devices
    # that would slow the cluster down); also used when re-planning. Excludes ``weights``.
    auto_split: bool = False
    # Every device keeps its slice's K-quant weights also in the batch GEMM's layout
    # (edge.shardio.LoadedShard.repack): "on", "off", or "auto" (where the copy fits half the
    # device's free memory). edge.launch sets it from the engine's batching.
    repack: str = "off"
    # How the model is spread over the devices (edge.cluster.layout.LAYOUTS): "tp" (every
    # layer split, two all-reduces per layer), "pipeline" (each device a range of layers,
    # edge.cluster.pipeline), "replica" (the whole model on every device, each running its
    # own streams: edge.cluster.replica), "single" (the master alone) or "auto"
    # (edge.planner.plan_layout from the measured round trips and device profiles). The
    # launcher resolves "auto".
    layout: str = "tp"
    # G: groups of streams whose pipeline steps are in flight at once (the engine's lanes,
    # edge.cluster.pipeline). 3 measured best for two stages over Wi-Fi (benchmarks.edge_wan:
    # 2 leaves the master waiting a round trip per group, 4 pays too many small passes).
    micro_batches: int = 3
    # Steps in flight per device in the replica layout (edge.cluster.replica: the engine's
    # lanes are this times the devices). 2 keeps a worker's next group queued while its
    # answer travels, but halves each step's rows and doubles the engine's steps: measured
    # slower over Wi-Fi (8 streams, 4 ms: 257 against 283 tok/s) and at 10 ms (223 against
    # 235; benchmarks/results/edge_wan-gemma3-270m-replica-lanes.json).
    replica_lanes: int = 1
    # The master's share of the LM head's vocabulary rows in a pipeline (the rest: the last
    # stage); None: in proportion to the two stages' layers. Below that proportion moves head
    # work off the master, which also embeds, merges, samples and serves HTTP.
    head_share: float | None = None
    # N: the concurrent streams the ``auto`` layout plans for (edge.planner.plan_layout): 1
    # ranks the layouts by one stream's ms/token (never slower than the master alone for one
    # user); N > 1 by aggregate tokens/s at N streams (a server that is mostly busy)
    plan_streams: int = 1
    # Stream the model to every worker as it is assigned (edge.cluster.ship: hashed, cached on
    # the worker, resumed after a broken transfer): workers need no copy of their own and are
    # started with a cache directory instead of --model-dir. Both layouts (a pipeline stage
    # is sent the whole file too).
    ship: bool = False

    def __post_init__(self) -> None:
        if self.layout not in ("auto", "single", "tp", "pipeline", "replica"):
            raise ConfigError(
                "layout", f"must be auto, single, tp, pipeline or replica, got {self.layout!r}"
            )
        if not 1 <= self.plan_streams <= 256:
            raise ConfigError("plan_streams", f"must be in [1, 256], got {self.plan_streams}")
        if self.head_share is not None and not 0.0 <= self.head_share < 1.0:
            raise ConfigError("head_share", f"must be in [0, 1), got {self.head_share}")
        if not 1 <= self.micro_batches <= 64:
            raise ConfigError("micro_batches", f"must be in [1, 64], got {self.micro_batches}")
        if not 1 <= self.replica_lanes <= 8:
            raise ConfigError("replica_lanes", f"must be in [1, 8], got {self.replica_lanes}")
        if self.auto_split and self.weights is not None:
            raise ConfigError("auto_split", "give either --weights or --auto-split, not both")
        if self.devices < 1:
            raise ConfigError("devices", f"must be >= 1, got {self.devices}")
        if self.weights is not None and len(self.weights) != self.devices:
            raise ConfigError("weights", f"{len(self.weights)} weights for {self.devices} devices")
        if self.weights is not None and not all(math.isfinite(w) and w > 0 for w in self.weights):
            # (a worker refuses such an assign: edge.cluster.protocol.Assign)
            raise ConfigError("weights", f"must be finite and > 0, got {list(self.weights)}")
        wire_codec(self.wire)
        if self.repack not in REPACK_MODES:
            raise ConfigError("repack", f"must be one of {REPACK_MODES}, got {self.repack!r}")
        if self.algorithm not in ("star", "ring", "auto"):
            raise ConfigError("algorithm", f"must be star, ring or auto, got {self.algorithm!r}")
        if self.link not in ("direct", "comm"):
            raise ConfigError("link", f"must be 'direct' or 'comm', got {self.link!r}")
        if self.replan_after_s is not None and self.replan_after_s < 0:
            raise ConfigError("replan_after_s", f"must be >= 0, got {self.replan_after_s}")
        if self.op_timeout <= 0 or self.join_timeout <= 0 or self.heartbeat_s <= 0:
            raise ConfigError("op_timeout", "timeouts must be > 0")
        if not 0 <= self.link_spin_us <= 1e6:
            raise ConfigError("link_spin_us", f"must be in [0, 1e6], got {self.link_spin_us}")

    def window_config(self) -> WindowConfig | None:
        if self.window is None and self.memory_budget_mb is None:
            return None
        return WindowConfig(window=self.window, memory_budget_mb=self.memory_budget_mb)


class MasterRunner:
    """Runner (see ``edge.engine``) for the master of an N-device cluster."""

    def __init__(self, comm: Communicator, model_dir: str | Path, cfg: ClusterConfig) -> None:
        self.comm = comm
        self.cfg = cfg
        self.model_dir = str(model_dir)
        self.codec = wire_codec(cfg.wire)
        self.tags = Tags()
        self._fid = 0
        self._lock = threading.RLock()  # one forward / ping / recovery at a time
        self._healthy = False
        self._status = "starting"
        self._slots: dict[str, int] = {}  # peer id -> slot
        self._closed = threading.Event()
        # Slots of workers polling their star link for the next command (they were sent a
        # forward and have not been told to go back to the communicator since): see forward.
        self._on_link: set[int] = set()
        self._recovery: threading.Thread | None = None
        self._ping_n = 0
        self.devices = cfg.devices  # the current plan (changes when re-planned onto survivors)
        self.weights = cfg.weights
        m = comm.quorum(min_world=cfg.devices, timeout=cfg.join_timeout)
        if master_rank(m.peers) != comm.rank:
            raise ConfigError(
                "master", f"another peer ({m.peers[master_rank(m.peers)]}) is the master"
            )
        self.split: SplitPlan | None = None  # set when cfg.auto_split
        if cfg.auto_split and cfg.devices > 1:
            self._auto_split()
        self.hub = (
            StarHub(cfg.link_host, spin_s=cfg.link_spin_us * 1e-6)
            if cfg.link == "direct" and self.devices > 1
            else None
        )
        self.shard = load_slot(
            self.model_dir,
            0,
            self.devices,
            self.weights,
            cfg.dtype,
            self.hub or comm,
            self.codec,
            cfg.algorithm,
            cfg.op_timeout,
            cfg.window_config(),
            self.tags,
            cfg.experts,
            cfg.repack,
        )
        self.model = self.shard.model
        self.config = self.model.config
        # The engine's KV caches (made on first use; ``forward`` is cache 0). The workers keep
        # the same ids in step (batch / copy / drop / reset messages), so the lengths here are
        # every rank's: slot_length answers from them.
        self._kv: dict[int, KVCache] = {}
        self._slots[comm.membership.peer_id] = 0
        self._assign(self._others(), list(range(1, self.devices)))
        self._healthy, self._status = True, "ok"
        self._heartbeat = threading.Thread(
            target=self._heartbeat_loop, name="edge-heartbeat", daemon=True
        )
        self._heartbeat.start()

    # ---- setup / recovery ----------------------------------------------------------------------
    def _auto_split(self) -> None:
        """Profile, plan (edge.profile / edge.planner), and dismiss the devices left out."""
        from edge.profile import auto_split

        self._ping_n += 1
        plan, used = auto_split(
            self.comm,
            self._others(),
            self.model_dir,
            dtype=self.cfg.dtype,
            timeout=self.cfg.join_timeout,
            start_n=self._ping_n * 1000,
            worker_model_dir=self.cfg.worker_model_dir or self.model_dir,
        )
        dropped = [r for r in self._others() if r not in used]
        for r in dropped:
            why = plan.left_out.get(self.comm.membership.peers[r], "")
            self._ctl(r, [], Shutdown(reason=f"left out by the planner: {why}"))
        for r in dropped:
            _, meta = self.comm.recv(r, tag=READY, timeout=self.cfg.op_timeout)
            Bye.decode(meta)
        if dropped:  # the next epoch is formed by the devices that stay
            for r in used:
                self._ctl(r, [], Regroup(epoch=self.comm.membership.epoch))
            self.comm.quorum(min_world=len(plan.devices), timeout=self.cfg.join_timeout)
        self.split, self.devices, self.weights = plan, len(plan.devices), plan.weights
        print(f"lowband edge: {plan.explain()}", flush=True)

    def _others(self) -> list[int]:
        return [r for r in range(self.comm.world_size) if r != self.comm.rank]

    def _slot(self, r: int) -> int | None:
        return self._slots.get(self.comm.membership.peers[r])

    def _ctl(self, r: int, tensors: list[torch.Tensor], msg: Msg) -> None:
        """A control message to rank ``r`` over the communicator. A worker polling its star
        link for the next forward is first told to go back to the communicator ("yield"): it
        then reads this message next, so the order of everything the master says is kept."""
        slot = self._slot(r)
        if slot in self._on_link:
            self._on_link.discard(slot)
            assert self.hub is not None
            self.hub.command(slot, Yield().encode(), timeout=self.cfg.op_timeout)
        self.comm.send(r, tensors, msg.encode(), tag=CTL)

    def _shipment(self) -> ShipServer:
        """The model's manifest and files for workers without a copy (hashed once)."""
        if getattr(self, "_ship", None) is None:
            self._ship = ShipServer.of(self.model_dir)
        return self._ship

    def _assign(self, ranks: Sequence[int], slots: Sequence[int]) -> None:
        cfg = self.cfg
        peers = self.comm.membership.peers
        for r, s in zip(ranks, slots):
            msg = Assign(
                slot=s,
                world=self.devices,
                weights=list(self.weights) if self.weights else None,
                model_dir=cfg.worker_model_dir or self.model_dir,
                dtype=cfg.dtype,
                wire=cfg.wire,
                algorithm=cfg.algorithm,
                op_timeout=cfg.op_timeout,
                window=cfg.window,
                memory_budget_mb=cfg.memory_budget_mb,
                experts=cfg.experts.to_dict() if cfg.experts else None,
                link_port=self.hub.port if self.hub else None,
                link_spin_us=cfg.link_spin_us,
                link_secret=self.hub.secret if self.hub else None,
                # an idle master pings every heartbeat_s: this much silence means it is gone
                silence_s=max(30.0, 10 * cfg.heartbeat_s) + cfg.op_timeout,
                repack=cfg.repack,
                ship=cfg.ship,
            )
            self._ctl(r, [], msg)
        for r, s in zip(ranks, slots):
            if cfg.ship:  # the worker fetches what its cache lacks, then loads and answers
                served = offer(self.comm, r, self._shipment(), timeout=cfg.join_timeout)
                logger.info("worker rank %d: model shipped (%d chunks)", r, served)
            _, meta = self.comm.recv(r, tag=READY, timeout=cfg.join_timeout)
            ready = Ready.decode(meta)
            if not ready.ok:
                raise ConfigError(
                    "worker", f"worker rank {r} could not load slot {s}: {ready.error}"
                )
            if self.hub is not None:  # the worker dialled the link before saying ready
                self.hub.accept(s, timeout=cfg.op_timeout)
            self._slots[peers[r]] = s

    def _fail(self, exc: BaseException) -> ClusterUnavailable:
        if self.hub is not None:
            self.hub.abort()  # also ends a worker's wait for the next command on its link
        self._on_link.clear()
        self._healthy = False
        self._status = f"degraded: {exc}"
        logger.warning("cluster degraded: %s; waiting for the worker to come back", exc)
        if self._recovery is None or not self._recovery.is_alive():
            self._recovery = threading.Thread(
                target=self._recover, name="edge-recover", daemon=True
            )
            self._recovery.start()
        return ClusterUnavailable(
            f"a device of the cluster failed ({exc}); the request was aborted. The master keeps "
            f"running and recovers when the worker reconnects (see /health)"
        )

    def _recover(self) -> None:
        since = time.monotonic()
        replan_after = self.cfg.replan_after_s
        if replan_after is not None and is_split_dir(self.model_dir):
            replan_after = None  # a split directory is cut for one device count: no re-plan
        while not self._closed.is_set():
            with self._lock:
                try:
                    if replan_after is not None and time.monotonic() - since >= replan_after:
                        self._replan()
                    else:
                        self._regroup_once()
                    self._healthy, self._status = True, "ok"
                    logger.info("cluster whole again (epoch %d)", self.comm.membership.epoch)
                    return
                except (PeerLost, TransportTimeout, ProtocolError) as exc:
                    self._status = f"degraded: waiting for workers ({exc})"
                except CommClosed:
                    return
            time.sleep(0.2)

    def _announce_regroup(self) -> None:
        """Tell every other peer to join the next quorum (see ``_regroup`` on the workers)."""
        epoch = self.comm.membership.epoch
        for r in self._others():
            try:
                self._ctl(r, [], Regroup(epoch=epoch))
            except (PeerLost, TransportTimeout):
                pass  # that one is gone; the quorum goes on without it

    def _regroup_once(self) -> None:
        self._announce_regroup()
        m = self.comm.quorum(min_world=self.devices, timeout=self.cfg.heartbeat_s * 5)
        self._slots = {p: s for p, s in self._slots.items() if p in m.peers}
        missing = sorted(set(range(self.devices)) - set(self._slots.values()))
        if self.hub is not None:
            for s in missing:
                self.hub.drop(s)
                self._on_link.discard(s)
        new_ranks = [r for r, p in enumerate(m.peers) if p not in self._slots]
        if len(new_ranks) < len(missing):
            raise PeerLost(f"slots {missing} still unassigned")
        self._assign(new_ranks[: len(missing)], missing)
        self._sync_all()

    def _replan(self) -> None:
        """Re-split the model over whoever is connected now (survivors and newcomers)."""
        self._announce_regroup()
        m = self.comm.quorum(min_world=1, timeout=self.cfg.heartbeat_s * 5)
        logger.warning("re-planning onto %d device(s) (was %d)", m.world_size, self.devices)
        if self.cfg.auto_split and m.world_size > 1:  # profile the new group and plan again
            self._auto_split()
            m, others, weights = self.comm.membership, self._others(), self.weights
        else:
            others = self._others()
            w = self.cfg.weights
            weights = (
                None
                if w is None
                else tuple(
                    [w[0]]
                    + [
                        w[self._slots[m.peers[r]]] if m.peers[r] in self._slots else 1.0
                        for r in others
                    ]
                )
            )
            self.devices, self.weights = m.world_size, weights
        if self.hub is not None:
            for s in self.hub.slots():
                self.hub.drop(s)
            self._on_link.clear()
        self.shard.close()
        # Drop the old slice before loading the new one (peak memory of one slice, not two);
        # a failed reload leaves the runner without a model, which store_report checks.
        self.shard = self.model = cast(Any, None)
        net = self.hub if (self.hub is not None and self.devices > 1) else self.comm
        self.shard = load_slot(
            self.model_dir,
            0,
            self.devices,
            weights,
            self.cfg.dtype,
            net,
            self.codec,
            self.cfg.algorithm,
            self.cfg.op_timeout,
            self.cfg.window_config(),
            self.tags,
            self.cfg.experts,
            self.cfg.repack,
        )
        self.model = self.shard.model
        self._slots = {m.peer_id: 0}
        self._assign(others, list(range(1, self.devices)))
        self._sync_all()

    def _sync_all(self) -> None:
        """Restart every link's sequence and every worker's cache after a regroup."""
        if self.hub is not None:
            self.hub.sync_send(timeout=self.cfg.op_timeout)
        for r in self._others():
            self._ctl(r, [], Reset(sync=self.hub is not None))
        if self.hub is not None:
            self.hub.sync_wait(timeout=self.cfg.op_timeout)
        self._kv = {}  # every cache is gone everywhere: the engine recomputes

    def _heartbeat_loop(self) -> None:
        rejoins = getattr(self.comm, "rejoins", 0)
        while not self._closed.wait(self.cfg.heartbeat_s):
            if not self._healthy or not self._lock.acquire(blocking=False):
                continue
            try:
                now = getattr(self.comm, "rejoins", 0)
                if now != rejoins:  # this master was paused past the deadline and re-registered
                    rejoins = now
                    self._fail(
                        PeerLost(
                            "this master was declared lost and rejoined as a newcomer; "
                            "re-forming the cluster"
                        )
                    )
                    continue
                self._ping_n += 1
                m = self.comm.membership
                for r in self._others():
                    self._ctl(r, [], Ping(n=self._ping_n, epoch=m.epoch))
                self.comm.barrier(tag=f"ping{self._ping_n}", timeout=self.cfg.op_timeout)
            except (PeerLost, TransportTimeout) as exc:
                self._fail(exc)
            except CommClosed:
                return
            finally:
                self._lock.release()

    # ---- Runner / BatchRunner -----------------------------------------------------------------
    @property
    def cache(self) -> KVCache:
        """The KV cache of :meth:`forward` (cache 0)."""
        return self._cache(0)

    def _cache(self, i: int) -> KVCache:
        c = self._kv.get(i)
        if c is None:
            c = self._kv[i] = self.model.new_cache()
        return c

    def _check_ready(self) -> None:
        if not self._healthy:
            why = f"the cluster is not ready ({self._status})"
            if self._recovery is not None and self._recovery.is_alive():
                why += "; the master recovers when the worker reconnects (see /health)"
            raise ClusterUnavailable(f"{why}; retry later")

    def _send_step(self, meta: dict, x: torch.Tensor) -> None:
        """Start a forward or batch on every worker. A decode step reaches a worker that
        already polls its link that way (no I/O or engine thread on either side); the first
        step after any other message goes through the communicator and puts the worker on its
        link."""
        for r in self._others():
            slot = self._slot(r)
            if slot in self._on_link:
                assert self.hub is not None
                self.hub.command(slot, meta, [x], timeout=self.cfg.op_timeout)
            else:
                self.comm.send(r, [x], meta, tag=CTL)
                if self.hub is not None and slot is not None:
                    self._on_link.add(slot)

    def forward(self, ids: Sequence[int], start: int, top: int = 0) -> torch.Tensor:
        with self._lock:
            self._check_ready()
            self._fid += 1
            self.tags.start(self._fid)
            x = self.model.embed(torch.tensor([list(ids)], dtype=torch.long))
            try:
                meta = Forward(
                    fid=self._fid,
                    start=start,
                    top=top,
                    epoch=self.comm.membership.epoch,
                    link=self.hub is not None,
                ).encode()
                self._send_step(meta, x)
                with torch.inference_mode():
                    h = self.model.forward_layers(x, cache=self.cache, start=start)
                    out = shard_logits(self.shard, h, top)
                assert out is not None  # rank 0 always gets the logits
                return out
            except (PeerLost, TransportTimeout, ProtocolError) as exc:
                raise self._fail(exc) from exc

    def forward_batch(self, work: Sequence[Work], top: int = 0) -> list[torch.Tensor | None]:
        """One step of continuous batching on every rank (see the module docstring)."""
        rows = wanted_rows(work)

        def head(h: torch.Tensor) -> torch.Tensor | None:
            return shard_rows_logits(self.shard, h[0, rows], top) if rows else None

        with self._lock:
            logits = self._ragged(work, top, head)
        return split_logits(work, logits)  # rank 0 always gets the logits

    def _ragged(
        self,
        work: Sequence[Work],
        top: int,
        then: Callable[[torch.Tensor], torch.Tensor | None],
    ) -> torch.Tensor | None:
        """A ragged pass over ``work`` on every rank, then ``then(h)`` on the master with the
        hidden states (1, N, H) after the last layer (the workers send their share of the
        head's rows they are told, ``wanted_rows(work)``: ``then`` must take part in that
        exchange when there are any)."""
        self._check_ready()
        rows = wanted_rows(work)
        # A bad batch is refused here, before any rank computes (RuntimeError: the engine
        # fails its requests, the cluster stays in step).
        for w in work:
            why = append_problem(self._kv.get(w.slot), w.start) if w.ids else "is empty"
            if why is not None:
                raise RuntimeError(f"batch item on cache {w.slot} {why}")
        self._fid += 1
        try:
            msg = Batch(
                fid=self._fid,
                epoch=self.comm.membership.epoch,
                caches=[w.slot for w in work],
                starts=[w.start for w in work],
                lengths=[len(w.ids) for w in work],
                rows=rows,
                top=top,
                link=self.hub is not None,
            )
        except ProtocolError as exc:  # e.g. a cache named twice
            raise RuntimeError(str(exc)) from None
        self.tags.start(self._fid)
        x = self.model.embed(torch.tensor([[t for w in work for t in w.ids]]))
        spans = [Span(self._cache(w.slot), w.start, len(w.ids)) for w in work]
        try:
            self._send_step(msg.encode(), x)
            with torch.inference_mode():
                h = self.model.forward_ragged(x, spans)
                return then(h)
        except (PeerLost, TransportTimeout, ProtocolError, RuntimeError) as exc:
            # Half a step leaves the ranks' caches and link sequences out of step: only
            # the regroup of the recovery path puts them back.
            raise self._fail(exc) from exc

    def embed(self, seqs: Sequence[Sequence[int]], pooling: str, chunk: int) -> torch.Tensor:
        """(B, H) as :meth:`edge.engine.LocalRunner.embed` gives on one device: every rank
        runs each ragged pass (its shard of every layer, the all-reduces between) in
        throw-away caches named above the engine's and dropped after, and no rank computes
        logits. The master's hidden state is the whole one (each all-reduce leaves every rank
        the full residual stream), pooled after its final norm."""

        def ragged(work: list[Work]) -> torch.Tensor:
            h = self._ragged(work, 0, lambda h: h[0])
            assert h is not None
            return h

        with self._lock:
            return embed_in_scratch(self.model, self._kv, self.drop, seqs, pooling, chunk, ragged)

    def slot_length(self, slot: int) -> int:
        c = self._kv.get(slot)
        return 0 if c is None else c.length

    def slot_floor(self, slot: int) -> int:
        c = self._kv.get(slot)
        return 0 if c is None else c.restart_floor()

    def copy_prefix(self, src: int, dst: int, n: int) -> None:
        """Copy on this rank, then tell every worker (``copy``). ``RuntimeError`` when the
        copy cannot be made, the cluster is not ready included (the engine then computes the
        prefix; the step after reports the cluster's state)."""
        if src == dst:
            raise RuntimeError("a cache cannot copy from itself")
        with self._lock:
            if not self._healthy:
                raise RuntimeError(f"the cluster is not ready ({self._status})")
            source = self._kv.get(src)
            if source is None:
                raise RuntimeError(f"cache {src} is empty")
            try:
                msg = Copy(epoch=self.comm.membership.epoch, src=src, dst=dst, n=n)
            except ProtocolError as exc:  # a cache id beyond protocol.MAX_SEQS
                raise RuntimeError(str(exc)) from None
            self._cache(dst).copy_prefix(source, n)
            try:
                for r in self._others():
                    self._ctl(r, [], msg)
            except (PeerLost, TransportTimeout, ProtocolError) as exc:
                self._kv.pop(dst, None)
                self._fail(exc)
                raise RuntimeError(f"the cluster failed while copying a prefix: {exc}") from exc

    def drop(self, slot: int) -> None:
        with self._lock:
            self._kv.pop(slot, None)
            if not self._healthy or slot not in range(MAX_SEQS):
                return  # (a regroup drops every cache anyway; no worker holds such an id)
            msg = Drop(epoch=self.comm.membership.epoch, cache=slot)
            try:
                for r in self._others():
                    self._ctl(r, [], msg)
            except (PeerLost, TransportTimeout, ProtocolError) as exc:
                self._fail(exc)

    def reset(self) -> None:
        with self._lock:
            self._kv = {}
            if not self._healthy:
                return
            try:
                for r in self._others():
                    self._ctl(r, [], Reset())
            except (PeerLost, TransportTimeout) as exc:
                self._fail(exc)

    def cached_tokens(self) -> int:
        return self.slot_length(0)

    def restart_floor(self) -> int:
        return self.slot_floor(0)

    def wire_bytes(self) -> int:
        s = self.comm.stats()
        h = self.hub.stats() if self.hub is not None else OpStats()
        return s.bytes_sent + s.bytes_received + h.bytes_sent + h.bytes_received

    def store_report(self) -> dict | None:
        """Expert-store statistics of every device, summed (None for a dense model)."""
        from edge.moe.serve import merge_reports

        with self._lock:
            own = self.shard.store_report() if self.shard is not None else None
            if own is None and self.cfg.experts is None:
                return None
            if not self._healthy:
                return merge_reports([own] if own else [])
            self._ping_n += 1
            tag = stats_tag(self._ping_n)
            reports = [own] if own else []
            try:
                for r in self._others():
                    self._ctl(r, [], Stats(n=self._ping_n))
                for r in self._others():
                    _, meta = self.comm.recv(r, tag=tag, timeout=self.cfg.op_timeout)
                    report = Report.decode(meta).report
                    if report:
                        reports.append(report)
            except (PeerLost, TransportTimeout, ProtocolError) as exc:
                self._fail(exc)
                return merge_reports(reports[:1])
            return merge_reports(reports)

    def health(self) -> dict:
        m = self.comm.membership
        out = {
            "healthy": self._healthy,
            "status": self._status,
            "devices": self.devices,
            "connected": m.world_size,
            "epoch": m.epoch,
        }
        if self.split is not None:
            out["split"] = self.split.to_dict()
        return out

    def close(self) -> None:
        self._closed.set()
        with self._lock:
            told = []
            for r in self._others():
                try:
                    self._ctl(r, [], Shutdown())
                    told.append(r)
                except LowbandError:
                    pass
            for r in told:  # wait for the goodbyes, so closing our socket cannot overtake them
                try:
                    Bye.decode(self.comm.recv(r, tag=READY, timeout=5.0)[1])
                except LowbandError:
                    pass
        if self.hub is not None:
            self.hub.close()
        self.shard.close()
