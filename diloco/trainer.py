"""The Streaming DiLoCo worker: inner steps, fragment syncs, and a self-healing group.

One :class:`DilocoWorker` runs on each site over an injected :class:`lowband.comm.Communicator`
(ZeroMQ across machines, the loopback group in tests). Its loop is the schedule of
``diloco.schedule``: after every inner step it runs the SEND/APPLY actions of that step; the
outer step itself is ``diloco.outer``.

Membership, failures and joins
------------------------------
Right after every APPLY nothing is in flight (τ < H/P), so that is the *sync point*: the
worker's :class:`diloco.reconcile.Reconciler` takes a quorum there and, when the membership
changed or an audit is due, reconciles the group's state (status rows, redoing a sync every
most-advanced worker lost, a state transfer to those behind, a hash check). The worker is its
:class:`diloco.reconcile.Replica`: it reports its progress and state and redoes lost syncs.
"""

from __future__ import annotations

import copy
import functools
import logging
import time
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from diloco.checkpoint import (
    State,
    export_model,
    latest_state,
    load_optimizer_state,
    load_state,
    optimizer_state,
    save_state,
)
from diloco.common import (
    InnerLoop,
    WorkerResult,
    hash_state,
    optimizer_tensors,
    record_inner_step,
    run_signature,
)
from diloco.config import DilocoConfig, TrainConfig
from diloco.device import optimizer_kernels, resolve_device
from diloco.fragments import plan_fragments
from diloco.metrics import MetricsLog, Progress
from diloco.outer import FragmentSync, warn_invalid
from diloco.reconcile import ReconcileConfig, Reconciler
from diloco.schedule import Action, Kind, drain_actions, fragment_actions
from diloco.staging import HostStaging
from diloco.task import Task
from lowband.codecs import get_codec
from lowband.comm import Communicator, Work
from lowband.errors import ConfigError, PeerLost, ProtocolError, TransportTimeout

logger = logging.getLogger(__name__)


@dataclass
class _Sync:
    """One fragment sync from SEND to APPLY on this worker."""

    fragment: int
    round: int
    # What this worker sends (Δ + residual, or zeros if invalid), host-readable; kept for a
    # redo until the sync's results arrive, then dropped (``DilocoWorker._settle``). Its buffer
    # receives Σ_m x_m when the sum succeeds (``out=``, see ``_launch``).
    x: torch.Tensor | None
    flag: torch.Tensor  # (1,) float32, 1.0 if Δ was finite; host-readable once ``launched``
    launched: Future[None] | None = None  # the staged copies reached the transport
    total: Work[torch.Tensor] | None = None  # Σ_m x_m
    count: Work[torch.Tensor] | None = None  # Σ_m valid_m
    error: PeerLost | None = None
    # Outer step taken as soon as both results arrived (``DilocoWorker._settle``): the valid
    # count it averaged over, and the bytes the two all-reduces moved (the works, which hold
    # the decoded sum, are dropped then). The merge into θ_m still waits for the APPLY.
    stepped: int | None = None
    moved: tuple[int, int] = (0, 0)

    @property
    def valid(self) -> bool:
        """Read only after ``launched`` completed (on CUDA the flag is a staged copy)."""
        return bool(self.flag.reshape(-1)[0] > 0)


class DilocoWorker:
    """One Streaming DiLoCo worker. ``run()`` trains to ``cfg.steps`` and returns a summary."""

    def __init__(
        self,
        cfg: TrainConfig,
        comm: Communicator,
        task: Task,
        *,
        log: MetricsLog | None = None,
        progress: bool = False,
        out_dir: Path | None = None,
        resume: Path | None = None,
        worker_id: str | None = None,
        byte_tokenizer: bool = True,
        on_step: Callable[[int], None] | None = None,
    ) -> None:
        if not isinstance(cfg.mode, DilocoConfig):
            raise ConfigError("mode", "DilocoWorker needs a DilocoConfig (use DDPWorker for DDP)")
        self.cfg, self.mode, self.comm, self.task = cfg, cfg.mode, comm, task
        self.log = log or MetricsLog(None)
        self.out_dir, self.byte_tokenizer, self.on_step = out_dir, byte_tokenizer, on_step
        # θ_m and θ_g (fp32 master copies) and every optimizer state live on the device.
        self.device = resolve_device(cfg.compute.device)
        self.staging = HostStaging(self.device)
        model = task.build_model()
        if cfg.lora is not None:  # only the adapters require a gradient from here on
            from diloco.lora import with_lora

            model = with_lora(model, cfg.lora, cfg.seed)
        self.model = model.to(self.device)
        # θ_g: what the outer optimizers update. Frozen parameters (LoRA's base weights) never
        # move: θ_g shares them with θ_m instead of holding a second copy (4 B per parameter).
        frozen = {id(p): p for p in self.model.parameters() if not p.requires_grad}
        self.global_model = copy.deepcopy(self.model, frozen)
        self.inner = InnerLoop(cfg, task, self.model, self.device)
        self.signature = run_signature(cfg, self.model)
        self.codec = None if self.mode.codec == "fp32" else get_codec(self.mode.codec)
        outer_kernels = optimizer_kernels(
            self.mode.outer.name, self.device, cfg.compute.optimizer_impl
        )
        # Fragments cover what trains: with LoRA the adapters only (frozen weights never move,
        # so they have no pseudo-gradient to send).
        local = {n: p for n, p in self.model.named_parameters() if p.requires_grad}
        glob = {n: p for n, p in self.global_model.named_parameters() if p.requires_grad}
        plan = plan_fragments(
            list(local.items()), self.mode.n_fragments, self.mode.fragment_strategy
        )
        self.fragments = [
            FragmentSync(
                p,
                names,
                [local[n] for n in names],
                [glob[n] for n in names],
                self.mode.outer.build([glob[n] for n in names], outer_kernels),
                self.codec,
                self.mode.error_feedback,
            )
            for p, names in enumerate(plan.names)
        ]
        self.applied = 0  # fragment syncs applied (identical on every worker)
        self.initialized = False  # holds authoritative state (resumed, or agreed with the group)
        self.slot = -1  # data slot: which stream of batches this worker draws (stable for life)
        self.worker_id = worker_id  # names this worker's checkpoint files; default: first rank
        self._resume_dir = resume
        self.inflight: _Sync | None = None
        self.lost: _Sync | None = None  # a sync whose result never arrived here
        self.result = WorkerResult(
            peer_id=comm.membership.peer_id, rank=comm.rank, mode="diloco", start_step=0, steps=0
        )
        rc = ReconcileConfig(
            sync_timeout=cfg.sync_timeout,
            audit_every=cfg.audit_every,
            stride=self.mode.stride,
            final_grace=cfg.final_grace,
        )
        self.reconciler = Reconciler(rc, comm, self, self.log)  # membership and state agreement
        self._checkpoint_due = False
        self._t0 = time.perf_counter()
        self._progress = Progress(cfg.steps, enabled=progress)

    @property
    def step(self) -> int:
        return self.inner.step

    # ---- the loop ------------------------------------------------------------------------------
    def run(self) -> WorkerResult:
        m = self.mode
        self._timed(lambda: self.reconciler.form(self.cfg.workers))
        if self.worker_id is None:
            self.worker_id = str(self.comm.rank)
        self.result.peer_id = self.comm.membership.peer_id
        if self._resume_dir is not None:
            self._resume(self._resume_dir)
        self._timed(lambda: self.reconciler.reconcile("start"))
        if (
            self.step == 0
        ):  # the starting model's loss: the baseline every later eval is read against
            self._evaluate()
        # Wall time and tokens/s count from here: after the group formed and agreed on a state.
        t0 = self._t0 = time.perf_counter()
        self.result.sync_s = 0.0
        self.result.start_step = self.step
        try:
            while self.step < self.cfg.steps:
                self._settle()
                tc = time.perf_counter()
                loss = self.inner.run_step(self.slot)
                self.result.compute_s += time.perf_counter() - tc
                for action in fragment_actions(self.step, m.n_fragments, m.inner_steps, m.tau):
                    self._timed(functools.partial(self._do, action))
                self._after_step(loss)
            for action in drain_actions(self.cfg.steps, m.n_fragments, m.inner_steps, m.tau):
                self._settle()
                if self.inflight is not None:
                    self._timed(functools.partial(self._do, action))
            # A peer lost in the last sync period may still come back for the final state.
            self._timed(lambda: self.reconciler.finish(self.cfg.workers))
        finally:
            # Stop the sender and batch threads (CUDA) on every way out, not only after the
            # final drain, and write a profile still being recorded.
            self.staging.close()
            self.inner.close()
        self.result.wall_s = time.perf_counter() - t0
        return self._finish()

    def _timed(self, fn: Callable[[], object]) -> None:
        t = time.perf_counter()
        fn()
        self.result.sync_s += time.perf_counter() - t

    def _do(self, action: Action) -> None:
        if action.kind is Kind.SEND:
            self._send(action)
        else:
            self._apply(action)

    # ---- SEND / APPLY --------------------------------------------------------------------------
    def _send(self, action: Action) -> None:
        # No host sync here (it runs between two inner steps): Δ and its validity flag are
        # computed on the device, the error-feedback residual on the staging's side stream,
        # copied to pinned host buffers on that stream, and handed to the transport by the
        # staging's sender thread once the copies' event completes (CPU: the same calls,
        # inline and without copies).
        x, flag = self.fragments[action.fragment].device_contribution(self.staging.stream)
        out = self.staging.stage_out(action.fragment, x, flag)
        x_host, flag_host = out.host  # the two tensors staged above, in order
        sync = _Sync(action.fragment, action.round, x_host, flag_host)
        tag = f"frag/{action.fragment}/{action.round}"
        sync.launched = self.staging.launch(out, lambda: self._launch(sync, tag))
        self.inflight = sync

    def _settle(self, wait: bool = False) -> None:
        """The in-flight sync's outer step as soon as both its results arrived (its merge into
        θ_m waits for the APPLY, as the schedule says). Then the sum (4/P B/param, in x's
        buffer: on the CPU Δ's own) is dropped before the next inner step allocates its
        gradients, instead of being held through τ inner steps: a worker's peak memory. θ_g
        is not read between a SEND and its APPLY except by an evaluation, which settles first
        with ``wait=True`` (so what it sees does not depend on when the results arrived).
        Never waits otherwise; a failed sync is left for its APPLY (which logs it and keeps x,
        untouched by the failed sum, for the redo)."""
        sync = self.inflight
        if sync is None or sync.stepped is not None or sync.error is not None:
            return
        if sync.launched is None or sync.total is None or sync.count is None:
            return
        if not wait and not (sync.launched.done() and sync.total.done() and sync.count.done()):
            return
        try:
            total, count = self._wait(sync)
        except (PeerLost, TransportTimeout):
            return  # failed: kept for the redo, the APPLY logs it
        sync.moved = self._moved(sync)
        sync.total = sync.count = None  # the works hold the decoded sum
        sync.x = None
        sync.stepped = self._outer_step(sync.fragment, total, count)

    def _launch(self, sync: _Sync, tag: str) -> None:
        """Start the two all-reduces of a sync on host tensors (the transport's thread reads
        them). May run on the staging's sender thread: it only sets fields of ``sync``.

        The sum is written into x's own buffer (``out=``): a fragment sync holds one float32
        buffer of the fragment (Δ, then Σ), not two, which is what keeps a worker at DiLoCo's
        24 B/param (``benchmarks.diloco_memory``). The transport writes it only on success, so
        a failed sync still has x for its redo."""
        if sync.x is None:
            raise ProtocolError(f"sync of fragment {sync.fragment} launched without its x")
        try:
            sync.total = self.comm.all_reduce_async(
                sync.x,
                "sum",
                codec=self.codec,
                algorithm=self.mode.algorithm,
                tag=tag + "/sum",
                timeout=self.cfg.sync_timeout,
                out=sync.x,
            )
            sync.count = self.comm.all_reduce_async(
                sync.flag, "sum", tag=tag + "/n", timeout=self.cfg.sync_timeout
            )
        except PeerLost as exc:
            sync.error = exc

    def _apply(self, action: Action) -> None:
        sync, self.inflight = self.inflight, None
        if sync is None or (sync.fragment, sync.round) != (action.fragment, action.round):
            raise ProtocolError(f"APPLY {action} without its SEND: schedule and state disagree")
        t = time.perf_counter()
        if sync.stepped is not None:  # the outer step was taken when the results arrived
            if not sync.valid:
                warn_invalid(sync.fragment)
            self._merge(sync.fragment, sync.stepped)
            self._record_sync(sync, time.perf_counter() - t)
            self.reconciler.sync_point()
            return
        try:
            total, count = self._wait(sync)
        except (PeerLost, TransportTimeout) as exc:
            logger.warning(
                "sync of fragment %d round %d failed (%s); recovering at the sync point",
                sync.fragment,
                sync.round,
                exc,
            )
            self.log.log("recovery", step=self.step, fragment=sync.fragment, error=str(exc))
            # Keep what was sent for a redo: the staging reuses the buffers at the next SEND.
            if sync.x is None:  # both results had arrived when x was dropped: not a loss
                raise ProtocolError(f"sync of fragment {sync.fragment} failed after completing")
            sync.x, sync.flag = sync.x.clone(), sync.flag.clone()
            self.lost = sync
        else:
            if not sync.valid:
                warn_invalid(sync.fragment)
            self._outer(sync.fragment, total, count)
            self._record_sync(sync, time.perf_counter() - t)
        self.reconciler.sync_point()

    @staticmethod
    def _wait(sync: _Sync) -> tuple[torch.Tensor, torch.Tensor]:
        """The one point where the host waits for a sync: the schedule needs Δ̄ now."""
        if sync.launched is not None:
            sync.launched.result()  # the staged send reached the transport (re-raises its error)
        if sync.error is not None:
            raise sync.error
        if sync.total is None or sync.count is None:
            raise PeerLost(f"the sync of fragment {sync.fragment} was never launched")
        return sync.total.wait(), sync.count.wait()

    def _outer(
        self, p: int, total: torch.Tensor, count: torch.Tensor, expected: int | None = None
    ) -> None:
        """Average over the valid contributions, outer step, merge (one fragment).
        ``expected``: how many workers had a contribution (default: all of them)."""
        self._merge(p, self._outer_step(p, total, count, expected))

    def _outer_step(
        self, p: int, total: torch.Tensor, count: torch.Tensor, expected: int | None = None
    ) -> int:
        """θ_g ← OuterOpt(θ_g, Σ/n) for fragment p; n, the valid contributions."""
        n = int(round(float(count.reshape(-1)[0])))
        expected = self.comm.world_size if expected is None else expected
        if n < expected:
            logger.warning(
                "fragment %d: %d of %d workers sent a valid pseudo-gradient; averaging over those",
                p,
                n,
                expected,
            )
        if n > 0:
            # H2D on the side stream; the main stream (not the host) waits for it.
            # In place: ``total`` is this worker's own result (or its device copy), used once.
            avg = self.staging.stage_in(total, key=p).reshape(-1).div_(n)
            self.fragments[p].outer_step(avg)
        return n

    def _merge(self, p: int, n: int) -> None:
        """θ_m ← α·θ_m + (1 − α)·θ_g for fragment p (nothing to merge when n = 0)."""
        if n > 0:
            for param in self.fragments[p].merge(self.mode.alpha):
                self.inner.opt.state.pop(param, None)  # restart its moments with the tensor
        self.applied += 1

    @staticmethod
    def _moved(sync: _Sync) -> tuple[int, int]:
        works = [w for w in (sync.total, sync.count) if w is not None]
        return sum(w.stats.bytes_sent for w in works), sum(w.stats.bytes_received for w in works)

    def _record_sync(self, sync: _Sync, wait_s: float) -> None:
        sent, received = sync.moved if sync.stepped is not None else self._moved(sync)
        r = self.result
        r.outer_syncs += 1
        r.peak_sync_bytes = max(r.peak_sync_bytes, sent)
        r.fragment_bytes[sync.fragment] = r.fragment_bytes.get(sync.fragment, 0) + sent
        self.log.log(
            "sync",
            step=self.step,
            fragment=sync.fragment,
            round=sync.round,
            bytes_sent=sent,
            bytes_received=received,
            wait_s=round(wait_s, 6),
            valid=sync.valid,
            world=self.comm.world_size,
        )

    # ---- the reconciler's view of this worker (diloco.reconcile.Replica) ---------------------
    @property
    def lost_sync(self) -> tuple[int, int] | None:
        lost = self.lost
        return None if lost is None else (lost.fragment, lost.round)

    def redo(self, fragment: int, round_: int, *, leader: bool, expected: int, tag: str) -> None:
        """Redo a sync every most-advanced worker lost, with whoever is here now."""
        if leader and self.lost is not None:
            x, flag = self.lost.x, self.lost.flag
        else:  # a newcomer or a worker that is behind: counted out of the average
            x, flag = torch.zeros(self.fragments[fragment].numel), torch.zeros(1)
        sync = _Sync(fragment, round_, x, flag)
        self._launch(sync, tag)
        total, count = self._wait(sync)
        if leader:
            self._outer(fragment, total, count, expected=expected)
            self._record_sync(sync, 0.0)
            self.lost = None
            self.result.retries += 1
            self.log.log(
                "recovery",
                step=self.step,
                fragment=fragment,
                redone=True,
                world=self.comm.world_size,
            )

    # ---- state ---------------------------------------------------------------------------------
    def state_hash(self) -> int:
        """Digest of everything that must be identical across workers: θ_g, outer optimizer
        states, step and syncs applied."""
        tensors: list[torch.Tensor] = [p for p in self.global_model.parameters()]
        for f in self.fragments:
            tensors += optimizer_tensors(f.outer_opt)
        return hash_state(tensors, self.step, self.applied)

    def state(self, *, own: bool) -> State:
        """The full worker state. ``own=True`` (checkpoints) adds what belongs to this worker
        only: error-feedback residuals and the data slot; a state handed to a peer omits them."""
        tensors: dict[str, torch.Tensor] = {}
        for name, p in self.model.named_parameters():
            tensors["local." + name] = p.detach().to("cpu", copy=True)
        for name, p in self.global_model.named_parameters():
            tensors["global." + name] = p.detach().to("cpu", copy=True)
        inner_meta, outer_meta = self._optimizer_sections(tensors, own=own)
        meta = {
            "format": 1,
            "step": self.step,
            "applied": self.applied,
            "inner": inner_meta,
            "outer": outer_meta,
            "slot": self.slot if own else -1,
        }
        return tensors, meta

    def _optimizer_sections(
        self,
        tensors: dict[str, torch.Tensor],
        *,
        own: bool,
        inner: Callable[[torch.Tensor], torch.Tensor] = lambda t: t,
    ) -> tuple[Any, list]:
        """Add the inner and outer optimizer states (and, for ``own``, the error-feedback
        residuals) to ``tensors``; their metadata. ``inner`` maps each inner-state tensor (a
        sharded site turns DTensors into plain ones)."""
        t, inner_meta = optimizer_state(self.inner.opt, "inner")
        tensors.update({k: inner(v) for k, v in t.items()})
        outer_meta = []
        for f in self.fragments:
            t, meta = optimizer_state(f.outer_opt, f"outer{f.index}")
            tensors.update(t)
            outer_meta.append(meta)
            if own and f.residual is not None:
                tensors[f"residual.{f.index}"] = f.residual.to("cpu", copy=True)
        return inner_meta, outer_meta

    @torch.no_grad()
    def load(self, tensors: dict[str, torch.Tensor], meta: dict, *, own: bool) -> None:
        for prefix, model in (("local.", self.model), ("global.", self.global_model)):
            for name, p in model.named_parameters():
                p.copy_(tensors[prefix + name])
        load_optimizer_state(self.inner.opt, "inner", tensors, meta["inner"])
        for f, m in zip(self.fragments, meta["outer"]):
            load_optimizer_state(f.outer_opt, f"outer{f.index}", tensors, m)
            key = f"residual.{f.index}"
            f.residual = tensors[key].to(self.device, copy=True) if own and key in tensors else None
        self.inner.step = int(meta["step"])
        self.applied = int(meta["applied"])
        self.lost = self.inflight = None
        self.initialized = True
        if own:
            self.slot = int(meta.get("slot", -1))

    def _resume(self, directory: Path) -> None:
        """From ``directory``'s complete checkpoint of this worker, or (a checkpoints
        directory) the newest complete one among its subdirectories."""
        name = f"worker-{self.worker_id}"
        stem = latest_state(directory, name)
        if stem is None:
            logger.warning(
                "no complete %s in %s: this worker will take its state from a peer",
                name,
                directory,
            )
            return
        if stem.parent != directory:
            logger.warning("resuming %s from %s, the newest complete checkpoint", name, stem)
        tensors, meta = load_state(stem)
        self.load(tensors, meta, own=True)

    # ---- bookkeeping ---------------------------------------------------------------------------
    def _after_step(self, loss: torch.Tensor) -> None:
        step = self.step
        record_inner_step(
            self.result,
            self.cfg,
            self.log,
            self.comm,
            self._progress,
            step,
            loss,
            self.task.tokens_per_batch(),
            self.inner.lr(),
            self._t0,
        )
        if self.cfg.eval_every and step % self.cfg.eval_every == 0 and step < self.cfg.steps:
            self._settle(wait=True)  # θ_g with every sync sent so far, whenever results came
            self._evaluate()
        if self.cfg.checkpoint_every and step % self.cfg.checkpoint_every == 0:
            self._checkpoint_due = True
        # Only a quiet step (no sync in flight) has a complete state; a due checkpoint waits
        # for the next one (at most τ steps).
        if self._checkpoint_due and self.out_dir is not None and self.inflight is None:
            self.checkpoint(self.out_dir / "checkpoints" / f"step-{step:06d}")
            self._checkpoint_due = False
        if self.on_step is not None:
            self.on_step(step)

    def _evaluate(self) -> float | None:
        if self.comm.rank != 0:  # θ_g is identical everywhere: one worker evaluates it
            return None
        loss = self.task.evaluate(self.global_model)
        sent = self.comm.stats().bytes_sent
        self.result.evals.append({"step": self.step, "loss": loss, "bytes_sent": sent})
        self.log.log("eval", step=self.step, loss=loss, bytes_sent=sent)
        return loss

    def checkpoint(self, directory: Path) -> None:
        save_state(directory / f"worker-{self.worker_id or self.comm.rank}", self.state(own=True))

    def _finish(self) -> WorkerResult:
        r = self.result
        r.steps, r.rank = self.step, self.comm.rank
        r.group, r.finished_at = self.comm.membership.peers, time.time()
        r.transfers = self.reconciler.transfers
        r.final_eval = self._evaluate()
        stats = self.comm.stats()
        r.bytes_sent, r.bytes_received = stats.bytes_sent, stats.bytes_received
        r.state_hash = self.state_hash()
        if self.out_dir is not None:
            self.checkpoint(self.out_dir / "checkpoints" / "final")
            self._export(self.out_dir / "model")
        self.log.log("final", **r.summary())
        self._progress.close()
        return r

    def _export(self, directory: Path) -> None:
        """The final θ_g as a directory ``edge`` / ``transformers`` load; one worker writes it."""
        if self.comm.rank == 0:
            model = self.global_model
            if self.cfg.lora is not None:  # the adapters folded into the base weights
                from diloco.lora import merged

                model = merged(model)
            export_model(model, directory, byte_tokenizer=self.byte_tokenizer)
