"""A site of several ranks: torch.distributed (FSDP2 or DDP) inside, lowband across sites.

:class:`SiteWorker` is the Streaming DiLoCo worker (``diloco.trainer.DilocoWorker``) of one rank
r of a site of N ranks. The model is built plain and parallelised after construction over the
site's process group (``fully_shard`` per decoder block + root for FSDP2, or
``DistributedDataParallel``); the inner loop then is ordinary torch.distributed training on
B/N sequences per rank. The outer sync is sharded (``diloco.sharding``): rank r syncs only its
dim-0 chunk of every parameter, over its own lowband group made of rank r of every site, and
keeps that chunk's global copy, outer optimizer state and error-feedback residual.

Intra-site agreement. The N lowband groups of a site run independently (their own epochs,
reconciliations, redone syncs), and that is safe because the outer maths is elementwise: a
shard's state depends only on its own group. What must agree across the site is *when* the ranks
enter a code path that issues torch.distributed collectives, or they deadlock. Those paths are:
inner steps (every step), evaluation/export (fixed steps), re-replication under DDP and the data
slot broadcast (after each sync point). The decision "reconcile at this sync point" is therefore
taken site-wide by an all-reduce(MAX) of each rank's own reason (its group changed or lost a
sync), so every rank of every surviving site reconciles at the same sync point.

Site-granular membership: a rank that dies takes its site down (torchrun tears down the other
ranks; without torchrun the survivors' next collective fails, and ``site_main`` leaves the
lowband group at once and raises ``SiteFailed``), so a site is never half in a lowband group.
A restarted site joins every group r as a newcomer and receives shard r of the state from a
peer; the state hash verified per group is a hash per shard. Its ranks register with their
coordinators independently, so the surviving sites make sure every group admits it at the same
sync point, and the site checks after every reconciliation that its ranks hold shards of one
progress (step, syncs applied): both are :class:`SiteReconciler`'s, the site's hooks on the
group's membership component (``diloco.reconcile``).

Devices. The model, its shards, θ_g's shards, the outer optimizer state and the residuals live
on the rank's device (``cfg.compute.device``, ``cuda:LOCAL_RANK`` on a GPU site). The site's
collectives run on :func:`collective_device`: the rank's GPU under NCCL, the CPU under Gloo;
only their Python results (a MAX, status rows) come back to the host. What crosses the WAN
takes the worker's staging path (``diloco.staging``: pinned host copies on a side stream),
states handed to peers and checkpoints are host tensors, and the model is exported from the
host.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import re
import time
from pathlib import Path
from typing import Any, Callable, cast

import torch
import torch.distributed as dist
from torch import nn

from diloco.checkpoint import (
    State,
    export_model,
    has_sharded,
    load_optimizer_state,
    load_sharded,
    save_sharded,
)
from diloco.common import InnerLoop, hash_state, optimizer_tensors
from diloco.config import TrainConfig
from diloco.device import optimizer_kernels
from diloco.metrics import MetricsLog
from diloco.reconcile import ReconcileConfig, Reconciler, Replica
from diloco.sharding import (
    ShardFragment,
    ShardLayout,
    batch_rows,
    gather_rows,
    local_shard,
)
from diloco.task import Task
from diloco.trainer import DilocoWorker
from lowband.comm import Communicator, Membership
from lowband.errors import ConfigError, ProtocolError

logger = logging.getLogger(__name__)

BLOCK_MODULE = re.compile(r"(?:^|\.)layers\.\d+$")
"""FSDP2 wraps each decoder block (``model.layers.3``) as one unit, then the root."""
ADMIT_POLL_S = 0.05  # s between quorum rounds while a newcomer site's ranks are registering
CPU = torch.device("cpu")


class SiteTask:
    """The site's task as rank r sees it: rows ``batch_rows(B, N, r)`` of the batch the whole
    site draws for its data slot; the rest (model, loss, evaluation) is the wrapped task's."""

    def __init__(self, task: Task, layout: ShardLayout, batch_size: int) -> None:
        self.task, self.rows = task, batch_rows(batch_size, layout.size, layout.rank)
        self.size = layout.size

    def build_model(self) -> nn.Module:
        return self.task.build_model()

    def train_batch(self, slot: int, step: int) -> Any:
        return self.task.train_batch(slot, step)[self.rows]

    def loss(self, model: nn.Module, batch: Any) -> torch.Tensor:
        return self.task.loss(model, batch)

    def evaluate(self, model: nn.Module) -> float:
        return self.task.evaluate(model)

    def tokens_per_batch(self) -> int:
        return self.task.tokens_per_batch() // self.size


def site_signature(signature: bytes, layout: ShardLayout) -> bytes:
    """The run signature of a site rank: the model/config signature plus the shard layout, so a
    site whose shards do not map onto the group's is refused when it connects."""
    text = signature + f"|shards={layout.size}".encode()
    return hashlib.blake2b(text, digest_size=16).digest()


def collective_device(backend: str, device: torch.device) -> torch.device:
    """The device the site's own collectives (agreements, status rows, shard all-gathers) run
    on: the rank's GPU under NCCL (it takes CUDA tensors only), the CPU under Gloo (its CPU
    path serves every collective; its CUDA support would stage through the host anyway)."""
    if backend == "nccl":
        if device.type != "cuda":
            raise ConfigError(
                "site.backend",
                f"nccl needs CUDA tensors, this rank computes on "
                f"{device}: use a CUDA device or the gloo backend",
            )
        return device
    return CPU


def parallelize(
    model: nn.Module, layout: ShardLayout, group: Any = None, device: torch.device = CPU
) -> nn.Module:
    """FSDP2 (every decoder block, then the root) or DDP over the site's process group;
    ``model`` already lives on ``device``, the rank's device."""
    if layout.engine == "ddp":
        ids = (
            [device.index if device.index is not None else torch.cuda.current_device()]
            if device.type == "cuda"
            else None
        )
        return nn.parallel.DistributedDataParallel(model, device_ids=ids, process_group=group)
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    pg = group or dist.group.WORLD
    if pg is None:  # no group given and no default one: init_process_group was not called
        raise RuntimeError("parallelize needs torch.distributed initialised (init_process_group)")
    mesh = DeviceMesh.from_group(pg, device.type)
    for name, module in model.named_modules():
        if BLOCK_MODULE.search(name):
            fully_shard(module, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


class SiteReconciler(Reconciler):
    """The membership of one site rank's lowband group, with the decisions taken per site.

    Every rank of the site calls :meth:`sync_point` and :meth:`reconcile` at the same points;
    the site's collectives are given as callables: ``site_max`` (all-reduce MAX of one int),
    ``site_gather`` (every site rank's int row, by site rank) and ``replicate`` (DDP: share
    each rank's rows of the replica after the outer step; nothing under FSDP2)."""

    def __init__(
        self,
        cfg: ReconcileConfig,
        comm: Communicator,
        replica: Replica,
        log: MetricsLog,
        *,
        site_rank: int,
        site_max: Callable[[int], int],
        site_gather: Callable[[list[int]], list[list[int]]],
        replicate: Callable[[], None],
    ) -> None:
        super().__init__(cfg, comm, replica, log)
        self.site_rank = site_rank
        self.site_max, self.site_gather, self.replicate = site_max, site_gather, replicate

    def sync_point(self) -> None:
        before = self.comm.membership.epoch
        m = self._admit_together(len(self.quorum().joined))
        changed = m.epoch != before
        audit = self.audit_due()
        if self.site_max(int(changed or self.replica.lost_sync is not None or audit)):
            self.reconcile("membership" if changed else "audit")
        else:
            self.replicate()

    def _admit_together(self, joined: int) -> Membership:
        """Admit a restarted site into every shard group at the same sync point.

        Its ranks register with their coordinators independently, so one quorum round may admit
        rank 0 of the newcomer site in group 0 while rank 1 registered in group 1 just after
        that group's round completed. A newcomer site admitted at two different sync points
        would hold shards of two different steps (and its first inner step, a site collective,
        would wait for a rank that is still waiting to be admitted). So the surviving site
        compares how many newcomers each of its groups admitted; a group behind calls quorum
        again (the newcomer's rank is registering right now) until the counts agree or the
        sync deadline passes. Every surviving site sees the same per-group counts (a group's
        view is the same for all its members), so the same ranks of every site re-quorum in
        lockstep. Deadline: ``sync_timeout``, agreed site-wide (rank 0's clock)."""
        m = self.comm.membership
        deadline = time.monotonic() + self.cfg.sync_timeout
        while True:
            expired = int(self.site_rank == 0 and time.monotonic() > deadline)
            rows = self.site_gather([joined, expired])
            most = max(r[0] for r in rows)
            if all(r[0] == most for r in rows):
                return m
            if any(r[1] for r in rows):
                logger.warning(
                    "a newcomer site was admitted by %s of its shard groups "
                    "within %.0fs; its missing ranks join later",
                    [r[0] for r in rows],
                    self.cfg.sync_timeout,
                )
                return m
            if joined < most:
                time.sleep(ADMIT_POLL_S)
                m = self.quorum()
                joined += len(m.joined)
            else:
                time.sleep(ADMIT_POLL_S)

    def finish(self, workers: int) -> None:
        """A site does not hold at the end. Its ranks would have to agree on holding and on
        every group admitting the late site at the same round (as :meth:`_admit_together` does
        at a sync point), or one rank would reconcile while another checkpoints (a site
        collective each): a site lost in the last sync period finishes apart, and the run
        summary names it."""

    def reconcile(self, reason: str) -> None:
        super().reconcile(reason)
        me = self.replica
        # The data slot was assigned per lowband group; the site draws one stream: rank 0's.
        rows = self.site_gather([me.slot, me.step, me.applied])
        me.slot = rows[0][0]
        if len({(r[1], r[2]) for r in rows}) != 1:
            raise ProtocolError(
                f"the ranks of this site hold shards of different progress after reconciling "
                f"({reason}): (step, syncs applied) by rank = {[tuple(r[1:]) for r in rows]}; "
                "its shard groups admitted it at different sync points: restart the site"
            )
        self.replicate()


class SiteWorker(DilocoWorker):
    """Rank ``layout.rank`` of a site; ``comm`` is its lowband group (rank r of every site)."""

    def __init__(
        self,
        cfg: TrainConfig,
        comm: Communicator,
        task: Task,
        *,
        layout: ShardLayout,
        group: Any = None,
        **kwargs: Any,
    ) -> None:
        # The default id must differ between ranks of a site: they share checkpoint files
        # (DCP), where the base class's default (the lowband group rank) would collide.
        if kwargs.get("worker_id") is None:
            kwargs["worker_id"] = f"r{layout.rank}"
        super().__init__(cfg, comm, SiteTask(task, layout, cfg.data.batch_size), **kwargs)
        self.layout, self.group = layout, group
        self.signature = site_signature(self.signature, layout)
        self.collectives = collective_device(dist.get_backend(group), self.device)
        plain = self.model  # on self.device already (DilocoWorker moved it)
        self.model = parallelize(plain, layout, group, self.device)
        # over the sharded/wrapped params, on the rank's device
        self.inner = InnerLoop(cfg, self.task, self.model, self.device)
        params = dict(plain.named_parameters())
        self._params = params
        outer = functools.partial(
            self.mode.outer.build,
            kernels=optimizer_kernels(
                self.mode.outer.name, self.device, cfg.compute.optimizer_impl
            ),
        )
        # θ_g's shards, their outer optimizer state and the residuals: on the rank's device
        self.fragments = [
            ShardFragment(
                f.index,
                f.names,
                [params[n] for n in f.names],
                layout,
                outer,
                self.codec,
                self.mode.error_feedback,
            )
            for f in self.fragments
        ]
        # self.global_model (plain, full size) is only an assembly buffer for evaluation and
        # export now: the authoritative θ_g is the fragments' global shards.
        self.reconciler = SiteReconciler(
            self.reconciler.cfg,
            comm,
            self,
            self.log,
            site_rank=layout.rank,
            site_max=self._site_max,
            site_gather=self._site_gather,
            replicate=self._replicate,
        )

    # ---- site collectives (every rank of the site calls them at the same point) -----------------
    # Their tensors live on self.collectives; reading the answer is the one host sync each.
    def _site_max(self, value: int) -> int:
        t = torch.tensor([value], dtype=torch.int64, device=self.collectives)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return int(t[0])

    def _site_gather(self, row: list[int]) -> list[list[int]]:
        """Every site rank's ``row`` (int64), by site rank."""
        t = torch.tensor(row, dtype=torch.int64, device=self.collectives)
        out = [torch.empty_like(t) for _ in range(self.layout.size)]
        dist.all_gather(out, t, group=self.group)
        return torch.stack(out).tolist()  # one device-to-host copy for all rows

    def _all_gather(self, out: list[torch.Tensor], t: torch.Tensor) -> None:
        dist.all_gather(out, t, group=self.group)

    def _gather_full(self, shard: torch.Tensor, rows: int) -> torch.Tensor:
        """The full tensor from every rank's dim-0 ``shard``, on the collective device (the
        caller's ``copy_`` brings it to the rank's device: no copy at all under NCCL)."""
        return gather_rows(
            shard.detach().to(self.collectives), rows, self.layout.size, self._all_gather
        )

    @torch.no_grad()
    def _assemble_global(self) -> None:
        """θ_g in full into ``self.global_model`` (all-gather of every rank's global shards)."""
        full = dict(self.global_model.named_parameters())
        for f in self.fragments:
            for name, g in zip(f.names, f.global_):
                full[name].copy_(self._gather_full(g, full[name].shape[0]).view_as(full[name]))

    @torch.no_grad()
    def _replicate(self) -> None:
        """DDP: every rank updated only its rows of the replica in merge; share them."""
        if self.layout.engine != "ddp":
            return
        for p in self._params.values():
            p.copy_(self._gather_full(local_shard(p, self.layout), p.shape[0]).view_as(p))

    # ---- state: this rank's shard ---------------------------------------------------------------
    def state_hash(self) -> int:
        """Digest of this shard of θ_g, its outer optimizer state, step and syncs applied: what
        rank r must share with rank r of every other site."""
        tensors: list[torch.Tensor] = [g for f in self.fragments for g in f.global_]
        for f in self.fragments:
            tensors += optimizer_tensors(f.outer_opt)
        return hash_state(tensors, self.step, self.applied)

    def state(self, *, own: bool) -> State:
        """This rank's shard of the worker state as host tensors (what the transport sends to a
        peer and DCP writes)."""
        tensors: dict[str, torch.Tensor] = {}
        for name, p in self._params.items():
            tensors["local." + name] = local_shard(p, self.layout).to("cpu", copy=True)
        for f in self.fragments:
            for name, g in zip(f.names, f.global_):
                tensors["global." + name] = g.detach().to("cpu", copy=True)
        inner_meta, outer_meta = self._optimizer_sections(tensors, own=own, inner=_plain)
        meta = {
            "format": 1,
            "step": self.step,
            "applied": self.applied,
            "inner": inner_meta,
            "outer": outer_meta,
            "slot": self.slot if own else -1,
            "shard": [self.layout.rank, self.layout.size],
        }
        return tensors, meta

    @torch.no_grad()
    def load(self, tensors: dict[str, torch.Tensor], meta: dict, *, own: bool) -> None:
        """Inverse of :meth:`state`: host tensors copied onto the rank's device (the optimizers'
        ``load_state_dict`` moves their states to their parameters' device)."""
        for name, p in self._params.items():
            local_shard(p, self.layout).copy_(tensors["local." + name])
        for f, m in zip(self.fragments, meta["outer"]):
            for name, g in zip(f.names, f.global_):
                g.copy_(tensors["global." + name])
            load_optimizer_state(f.outer_opt, f"outer{f.index}", tensors, m)
            key = f"residual.{f.index}"
            f.residual = tensors[key].to(self.device, copy=True) if own and key in tensors else None
        load_optimizer_state(self.inner.opt, "inner", tensors, meta["inner"])
        _redistribute(self.inner.opt)
        self.inner.step = int(meta["step"])
        self.applied = int(meta["applied"])
        self.lost = self.inflight = None
        self.initialized = True
        if own:
            self.slot = int(meta.get("slot", -1))

    # ---- sharded checkpoint (DCP): every rank of the site at the same step ----------------------
    def checkpoint(self, directory: Path) -> None:
        """This rank's shard of the full worker state (``state(own=True)``: its model and inner
        optimizer shard, its global shard θ_g, outer optimizer state and residual, step,
        syncs applied, data slot) into the site's DCP checkpoint ``directory``."""
        save_sharded(directory, self.state(own=True), key=self._key, process_group=self.group)

    def _resume(self, directory: Path) -> None:
        """Exact resume from :meth:`checkpoint`. Decided site-wide: the load is a collective,
        so either every rank has its shard there or none loads (and the site takes its state
        from a peer as a newcomer)."""
        if self._site_max(int(not has_sharded(directory, self._key))):
            logger.warning(
                "no complete site checkpoint in %s: this site will take its state from a peer",
                directory,
            )
            return
        tensors, meta = load_sharded(directory, key=self._key, process_group=self.group)
        if meta.get("shard") != [self.layout.rank, self.layout.size]:
            raise ConfigError(
                "resume",
                f"{directory} holds shard {meta.get('shard')} "
                f"(rank, ranks), this is {[self.layout.rank, self.layout.size]}",
            )
        self.load(tensors, meta, own=True)

    @property
    def _key(self) -> str:
        # cast: never None here, __init__ passes a default id and DilocoWorker keeps a given one
        return cast(str, self.worker_id)

    # ---- evaluation and export: θ_g assembled on every rank, used by one -------------------------
    def _evaluate(self) -> float | None:
        self._assemble_global()
        if self.layout.rank != 0:
            return None
        return super()._evaluate()

    @torch.no_grad()
    def _export(self, directory: Path) -> None:
        """One rank of one site writes ``self.global_model``, which the final evaluation
        assembled on every rank (the base ``_finish`` checkpoints first: DCP, every rank). From
        the host: moved to the CPU for the writer and back (it is only the assembly buffer; the
        fragments keep θ_g's shards)."""
        if self.layout.rank != 0 or self.comm.rank != 0:
            return
        self.global_model.to("cpu")
        try:
            export_model(self.global_model, directory, byte_tokenizer=self.byte_tokenizer)
        finally:
            self.global_model.to(self.device)


def _plain(t: torch.Tensor) -> torch.Tensor:
    """A DTensor optimizer state (FSDP2) as its local shard: what travels and is saved."""
    to_local = getattr(t, "to_local", None)
    return to_local().detach().clone() if to_local is not None else t


@torch.no_grad()
def _redistribute(opt: torch.optim.Optimizer) -> None:
    """After ``load_state_dict`` with local tensors: wrap the states of DTensor parameters back
    into DTensors laid out like their parameter (AdamW cannot mix the two)."""
    from torch.distributed.tensor import DTensor

    for group in opt.param_groups:
        for p in group["params"]:
            if not isinstance(p, DTensor):
                continue
            for key, value in opt.state.get(p, {}).items():
                if (
                    isinstance(value, torch.Tensor)
                    and not isinstance(value, DTensor)
                    and value.shape == p.to_local().shape
                    and value.dim() > 0
                ):
                    opt.state[p][key] = DTensor.from_local(
                        value, p.device_mesh, p.placements, shape=p.shape, stride=p.stride()
                    )
