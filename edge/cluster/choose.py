"""Start the master's runner in the layout the configuration asks for, resolving ``auto``.

``auto`` measures before it plans: the round trip to every worker (``echo``, median of a few)
and this device's own decode speed on the loaded model (a few greedy steps of one stream:
the kernels it will really run; with ``plan_streams`` N > 1 also batched steps of N rows and
of a pipeline group's rows, for the aggregate tokens/s the plan then ranks by; with one
stream, batched steps at ``busy_streams``, where the replica layout must gain to be
chosen). Workers are taken to be as fast as the master and to hold as much memory (a worker
profile on a GGUF file is future work; ``edge.profile`` profiles model directories for the
tensor-parallel split).
:func:`edge.planner.plan_layout` then chooses; the plan and its reason go to the log and to
``/health``. A worker left out (the single-device choice) is told why and leaves.
"""

from __future__ import annotations

import logging
import statistics
import time
from typing import Any

import torch

from edge.cluster.layout import LayerRange
from edge.cluster.master import ClusterConfig, MasterRunner
from edge.cluster.pipeline import PipelineRunner
from edge.cluster.protocol import CTL, READY, Bye, Echo, Regroup, Shutdown, master_rank
from edge.cluster.replica import ReplicaRunner, measure_step_ms
from edge.engine import LocalRunner, Runner
from edge.planner import LayoutDevice, LayoutPlan, busy_streams, plan_layout
from edge.profile import memory_available_mb
from edge.shardio import is_split_dir, load_shard
from lowband.comm import Communicator
from lowband.errors import ConfigError, LowbandError

logger = logging.getLogger(__name__)


class PlannedRunner:
    """A runner whose ``/health`` also shows the layout the planner chose (and why)."""

    def __init__(self, runner: Runner, plan: LayoutPlan | None, layout: str) -> None:
        self._runner, self._plan, self._layout = runner, plan, layout

    def __getattr__(self, name: str) -> Any:
        return getattr(self._runner, name)

    def health(self) -> dict:
        out = dict(self._runner.health())
        out["layout"] = self._layout
        if self._plan is not None:
            out["plan"] = self._plan.to_dict()
        return out


def measure_rtts(comm: Communicator, ranks: list[int], timeout: float, n: int = 7) -> list[float]:
    """Median ms of ``n`` echo round trips to each rank (answered by ``edge.profile.answer``)."""
    out = []
    for r in ranks:
        times = []
        for i in range(n):
            k = 900_000 + r * 100 + i  # (echo tags of the automatic split start below)
            t = time.perf_counter()
            comm.send(r, [], Echo(n=k).encode(), tag=CTL)
            comm.recv(r, tag=f"edge.echo{k}", timeout=timeout)
            times.append(1e3 * (time.perf_counter() - t))
        out.append(statistics.median(times))
    return out


def measure_layer_ms(runner: LocalRunner, steps: int = 12) -> float:
    """ms of one decoder layer per decoded token on this device (greedy, one stream)."""
    L = runner.model.config.num_hidden_layers
    tok, times = 1, []
    for pos in range(steps):
        t = time.perf_counter()
        tok = int(runner.forward([tok], pos).argmax())
        times.append(time.perf_counter() - t)
    runner.reset()
    return 1e3 * statistics.median(times[2:]) / L


def tp_only(model_dir: str, cc: ClusterConfig) -> str | None:
    """Why only the tensor-parallel layout serves this (None: any layout can): a directory
    split for N devices, or an option only tensor parallelism has."""
    if is_split_dir(model_dir):
        return "a split directory is cut for tensor parallelism"
    for name in ("weights", "experts", "window", "memory_budget_mb"):
        if getattr(cc, name) is not None:
            return f"--{name.replace('_', '-')} is a tensor-parallel option"
    return "--auto-split plans a tensor-parallel split" if cc.auto_split else None


def start_runner(comm: Communicator, model_dir: str, cc: ClusterConfig) -> Runner:
    """The master's runner for ``cc.layout`` (``auto``: measured and planned, see above)."""
    if cc.layout == "tp" or (cc.layout == "auto" and tp_only(model_dir, cc)):
        return MasterRunner(comm, model_dir, cc)
    if cc.layout == "pipeline":
        return PlannedRunner(PipelineRunner(comm, model_dir, cc), None, "pipeline")
    if cc.layout == "replica":
        return PlannedRunner(ReplicaRunner(comm, model_dir, cc), None, "replica")
    m = comm.quorum(min_world=cc.devices, timeout=cc.join_timeout)
    if master_rank(m.peers) != comm.rank:
        raise ConfigError("master", f"another peer ({m.peers[master_rank(m.peers)]}) leads")
    workers = [r for r in range(comm.world_size) if r != comm.rank][: cc.devices - 1]
    plan: LayoutPlan | None = None
    layout = cc.layout
    local: LocalRunner | None = None
    steps: tuple[tuple[int, float], ...] | None = None  # (the replica runner's lanes_for)
    if layout == "auto":
        # the runner plain ``edge serve`` keeps on one device (its batch GEMMs' repacked
        # weights too): what the single layout then serves, and what is measured
        shard = load_shard(model_dir, dtype=cc.dtype)
        local = LocalRunner(shard.model, shard.close, report=shard.store_report)
        layer_bytes = sum(
            p.numel() * p.element_size() for p in shard.model.model.layers.parameters()
        )  # (before the repacked copy)
        shard.repack(cc.repack)
        N, G, D = cc.plan_streams, cc.micro_batches, cc.devices
        with torch.inference_mode():
            layer_ms = measure_layer_ms(local)
            # several streams planned for: the batched step's cost at the pipeline's group
            # size, at a replica's lane and device share and at all N rows (one device's
            # step); one stream: at the streams replica is checked at (busy_streams)
            n, lanes = (N if N > 1 else busy_streams(D)), cc.replica_lanes
            rows = sorted(
                {-(-n // (lanes * D)), -(-n // D), n} | ({-(-N // G)} if N > 1 else set())
            )
            batch = tuple((b, measure_step_ms(local, b, steps=6)) for b in rows if b > 1)
            steps = ((1, layer_ms), *batch)
        rtts = measure_rtts(comm, workers, cc.op_timeout)
        cfg = shard.model.config
        layer_mb = layer_bytes / 2**20 / cfg.num_hidden_layers
        mem = memory_available_mb() * 0.8
        kw: dict[str, Any] = dict(layer_ms=layer_ms, memory_mb=mem, batch_layer_ms=batch)
        devs = [LayoutDevice(name=m.peers[comm.rank], **kw)]
        devs += [LayoutDevice(name=m.peers[r], rtt_ms=rtt, **kw) for r, rtt in zip(workers, rtts)]
        L = cfg.num_hidden_layers
        plan = plan_layout(L, layer_mb, devs, streams=N, groups=G, lanes=lanes)
        layout = plan.layout
        print(f"lowband edge: layout {layout}: {plan.reason}", flush=True)
        if layout != "single":
            local.close()
            local = None
            # the runner forms its group again (its own quorum): the workers join it
            for r in workers:
                comm.send(r, [], Regroup(epoch=comm.membership.epoch).encode(), tag=CTL)
    if layout == "single":
        _dismiss(comm, workers, cc, plan.reason if plan else "--layout single")
        if local is None:
            shard = load_shard(model_dir, dtype=cc.dtype, window=cc.window_config())
            local = LocalRunner(shard.model, shard.close, report=shard.store_report)
            shard.repack(cc.repack)  # (as plain serve: a window's streamed weights stay)
        return PlannedRunner(local, plan, "single")
    if layout == "pipeline":
        ranges = None
        if plan is not None and plan.stages:
            ranges, lo = [], 0
            for n in plan.stages:
                ranges.append(LayerRange(lo, lo + n, sum(plan.stages)))
                lo += n
        runner = PipelineRunner(comm, model_dir, cc, ranges, plan.to_dict() if plan else None)
        return PlannedRunner(runner, plan, "pipeline")
    if layout == "replica":
        return PlannedRunner(
            ReplicaRunner(comm, model_dir, cc, plan.to_dict() if plan else None, steps),
            plan,
            "replica",
        )
    return PlannedRunner(MasterRunner(comm, model_dir, cc), plan, "tp")


def _dismiss(comm: Communicator, workers: list[int], cc: ClusterConfig, why: str) -> None:
    """Tell the workers the plan leaves them out; wait for their goodbyes."""
    for r in workers:
        comm.send(
            r, [], Shutdown(reason=f"left out by the layout planner: {why}").encode(), tag=CTL
        )
    for r in workers:
        try:
            Bye.decode(comm.recv(r, tag=READY, timeout=cc.op_timeout)[1])
        except LowbandError as exc:
            logger.warning("a dismissed worker did not say goodbye: %s", exc)
