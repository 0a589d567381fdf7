"""Data-parallel baseline in the same harness: gradients averaged across workers every step.

Same model, data slots, inner optimizer, schedule and metrics as the DiLoCo worker, so the bench
compares like with like: M workers each take a batch of B sequences per step, which makes the
DDP step equal to one large-batch step of M·B sequences. The gradients are all-reduced as one
flat float32 buffer (or through ``DDPConfig.codec``).

It is a baseline, not a fault-tolerant trainer: a lost peer ends the run with PeerLost.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Callable

import torch

from diloco.checkpoint import export_model
from diloco.common import (
    InnerLoop,
    WorkerResult,
    hash_state,
    record_inner_step,
    run_signature,
    signature_int,
)
from diloco.config import DDPConfig, TrainConfig
from diloco.device import resolve_device
from diloco.metrics import MetricsLog, Progress
from diloco.staging import HostStaging
from diloco.task import Task
from lowband.codecs import get_codec
from lowband.comm import Communicator
from lowband.errors import ConfigError, IncompatiblePeer

logger = logging.getLogger(__name__)


class DDPWorker:
    def __init__(
        self,
        cfg: TrainConfig,
        comm: Communicator,
        task: Task,
        *,
        log: MetricsLog | None = None,
        progress: bool = False,
        out_dir: Path | None = None,
        byte_tokenizer: bool = True,
        on_step: Callable[[int], None] | None = None,
    ) -> None:
        if not isinstance(cfg.mode, DDPConfig):
            raise ConfigError("mode", "DDPWorker needs a DDPConfig")
        self.cfg, self.comm, self.task = cfg, comm, task
        self.log = log or MetricsLog(None)
        self.out_dir, self.byte_tokenizer, self.on_step = out_dir, byte_tokenizer, on_step
        self.device = resolve_device(cfg.compute.device)
        self.staging = HostStaging(self.device)
        self.model = task.build_model().to(self.device)
        self.inner = InnerLoop(cfg, task, self.model, self.device)
        self.signature = run_signature(cfg, self.model)
        self.codec = None if cfg.mode.codec == "fp32" else get_codec(cfg.mode.codec)
        self.result = WorkerResult(
            peer_id=comm.membership.peer_id, rank=comm.rank, mode="ddp", start_step=0, steps=0
        )
        self._progress = Progress(cfg.steps, enabled=progress, desc="ddp")
        self._t0 = time.perf_counter()

    def run(self) -> WorkerResult:
        self.comm.quorum(min_world=self.cfg.workers, timeout=3 * self.cfg.sync_timeout)
        self._check_start()
        if self.inner.step == 0:  # the starting model's loss (the baseline of the curve)
            self._evaluate()
        t0 = self._t0 = time.perf_counter()  # wall time counts once the group has formed
        r = self.result
        while self.inner.step < self.cfg.steps:
            tc, s0 = time.perf_counter(), r.sync_s
            loss = self.inner.run_step(self.comm.rank, grad_hook=self._average_gradients)
            r.compute_s += time.perf_counter() - tc - (r.sync_s - s0)
            self._after_step(loss)
        r.wall_s = time.perf_counter() - t0
        return self._finish()

    def _check_start(self) -> None:
        """Every worker must start from the same parameters and configuration."""
        mine = torch.tensor([signature_int(self.signature), self.state_hash()], dtype=torch.int64)
        rows = [
            t.tolist()
            for t in self.comm.all_gather(mine, tag="ddp/start", timeout=self.cfg.sync_timeout)
        ]
        if any(row != rows[0] for row in rows):
            raise IncompatiblePeer(f"DDP workers disagree on signature/initial state: {rows}")

    def _average_gradients(self, params: list[torch.nn.Parameter]) -> None:
        t = time.perf_counter()
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        flat = self.staging.to_host(torch.cat([g.reshape(-1).float() for g in grads]), "grad")
        work = self.comm.all_reduce_async(
            flat,
            "avg",
            codec=self.codec,
            tag=f"grad/{self.inner.step}",
            timeout=self.cfg.sync_timeout,
            out=flat,  # the average replaces the flat gradient: one buffer, not two
        )
        avg = self.staging.to_device(work.wait())
        offset = 0
        for p in params:
            n = p.numel()
            p.grad = avg[offset : offset + n].view_as(p).to(p.dtype)
            offset += n
        r = self.result
        r.outer_syncs += 1
        r.peak_sync_bytes = max(r.peak_sync_bytes, work.stats.bytes_sent)
        r.sync_s += time.perf_counter() - t

    def state_hash(self) -> int:
        return hash_state(list(self.model.parameters()), self.inner.step)

    def _after_step(self, loss: torch.Tensor) -> None:
        step = self.inner.step
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
            self._evaluate()
        if self.on_step is not None:
            self.on_step(step)

    def _evaluate(self) -> float | None:
        if self.comm.rank != 0:
            return None
        loss = self.task.evaluate(self.model)
        sent = self.comm.stats().bytes_sent
        self.result.evals.append({"step": self.inner.step, "loss": loss, "bytes_sent": sent})
        self.log.log("eval", step=self.inner.step, loss=loss, bytes_sent=sent)
        return loss

    def _finish(self) -> WorkerResult:
        r = self.result
        r.steps, r.rank = self.inner.step, self.comm.rank
        r.final_eval = self._evaluate()
        stats = self.comm.stats()
        r.bytes_sent, r.bytes_received = stats.bytes_sent, stats.bytes_received
        r.state_hash = self.state_hash()
        if self.out_dir is not None and self.comm.rank == 0:
            export_model(self.model, self.out_dir / "model", byte_tokenizer=self.byte_tokenizer)
        self.log.log("final", **r.summary())
        self._progress.close()
        return r
