"""Pieces shared by the DiLoCo and DDP workers: the inner optimization step, run signatures,
state hashes and the per-worker result."""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import math
import struct
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import torch
from torch import nn
from torch.profiler import record_function

from diloco.config import TrainConfig
from diloco.prefetch import BatchPrefetcher
from diloco.profiling import INNER_STEP, StepProfiler
from diloco.task import Task
from lowband.errors import PeerLost, TransportTimeout

logger = logging.getLogger(__name__)

GradHook = Callable[[list[torch.nn.Parameter]], None]


class InnerLoop:
    """Model + optimizer + learning-rate schedule: one call of :meth:`step` is one inner step.

    The model must already be on ``device`` (the trainer moves θ_m and θ_g together). One step:
    ``compute.micro_batches`` forward/backward passes under autocast (gradients accumulate,
    each micro-loss scaled by 1/n so the sum is the batch mean), the fp16 loss scaler if any,
    ``grad_hook`` (DDP averages gradients there), clipping, the optimizer.

    On CUDA the forward is compiled by default (static shapes: every micro-batch has
    the same (B/n, T)), AdamW is the fused kernel and the step makes no host read: the loss is
    returned as a device tensor (read in batches at log steps), clipping scales by a device
    tensor, the next batch is drawn and pinned on a helper thread (``diloco.prefetch``). The one
    exception is fp16, whose ``GradScaler.step`` reads its overflow flag on the host.
    """

    def __init__(
        self, cfg: TrainConfig, task: Task, model: nn.Module, device: torch.device | None = None
    ) -> None:
        from diloco import device as dev

        self.cfg = cfg
        self.task = task
        self.model = model
        self.device = device or dev.model_device(model)
        c = cfg.compute
        if c.activation_checkpointing:
            dev.enable_checkpointing(model)
        # The compiled module shares the parameters; names and export keep using ``model``.
        self.forward_model: nn.Module = model
        if dev.compiles(c.compile, self.device):
            self.forward_model = torch.compile(  # type: ignore[assignment]
                model, backend=c.compile_backend, dynamic=False
            )
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.opt = cfg.inner.build(
            self.params, dev.optimizer_kernels(cfg.inner.name, self.device, c.optimizer_impl)
        )
        self.scaler = dev.grad_scaler(self.device, c.precision)
        self.base_lrs = [g["lr"] for g in self.opt.param_groups]
        self.batches = BatchPrefetcher(task.train_batch, self.device)
        self.profiler = StepProfiler(c.profile, self.device)
        self.step = 0  # completed inner steps

    def lr(self) -> float:
        return self.base_lrs[0] * self.cfg.lr_schedule.factor(self.step, self.cfg.steps)

    def run_step(self, slot: int, grad_hook: GradHook | None = None) -> torch.Tensor:
        """One inner step; the batch-mean training loss as a 0-dim tensor on the device (turning
        it into a float is a host sync on a GPU, so callers defer it, see
        :meth:`WorkerResult.record_step`)."""
        self.profiler.tick(slot, self.step)
        with record_function(INNER_STEP):
            loss = self._step(slot, grad_hook)
        self.step += 1
        if self.step >= self.cfg.steps:
            self.profiler.finish()
        return loss

    def _step(self, slot: int, grad_hook: GradHook | None) -> torch.Tensor:
        factor = self.cfg.lr_schedule.factor(self.step, self.cfg.steps)
        for group, base in zip(self.opt.param_groups, self.base_lrs):
            group["lr"] = base * factor
        from diloco.device import autocast

        batch = self.batches.get(slot, self.step)
        self.model.train()
        self.opt.zero_grad(set_to_none=True)
        n = self.cfg.compute.micro_batches
        total = torch.zeros((), device=self.device)
        for micro in batch.chunk(n) if n > 1 else (batch,):
            with autocast(self.device, self.cfg.compute.precision):
                loss = self.task.loss(self.forward_model, micro)
            scaled = loss / n if n > 1 else loss
            (self.scaler.scale(scaled) if self.scaler is not None else scaled).backward()
            total += scaled.detach().float()
        if self.scaler is not None:
            self.scaler.unscale_(self.opt)  # clip and all-reduce true gradients
        if grad_hook is not None:
            grad_hook(self.params)
        if self.cfg.grad_clip is not None:
            torch.nn.utils.clip_grad_norm_(self.params, self.cfg.grad_clip)
        if self.scaler is not None:
            self.scaler.step(self.opt)  # skipped if the scaled gradients overflowed
            self.scaler.update()
        else:
            self.opt.step()
        # Free the gradients now, not at the next step: the syncs and evaluations that run
        # between two steps then have their 4 B/param to themselves (a worker's peak memory).
        self.opt.zero_grad(set_to_none=True)
        return total

    def close(self) -> None:
        """Write a trace still being recorded and stop the batch thread."""
        self.profiler.finish()
        self.batches.close()


def record_inner_step(
    result: "WorkerResult",
    cfg: TrainConfig,
    log: Any,
    comm: Any,
    progress: Any,
    step: int,
    loss: torch.Tensor,
    tokens: int,
    lr: float,
    t0: float,
) -> None:
    """Bookkeeping shared by the DiLoCo and DDP workers after an inner step: record the loss
    (kept on the device), and on log steps write the metrics line and show it on the bar.
    Only logged steps read the loss: reading it every step would be a host sync per step on a
    GPU."""
    result.record_step(step, loss, tokens)
    if step % cfg.log_every == 0 or step == cfg.steps:
        stats = comm.stats()
        value = result.losses[step]
        log.log(
            "step",
            **result.step_record(
                step, value, lr, time.perf_counter() - t0, stats.bytes_sent, stats.bytes_received
            ),
        )
        progress.update(step, loss=f"{value:.3f}")
    else:
        progress.update(step)


def leave_together(comm: Any, timeout: float) -> None:
    """The final barrier of a worker: leave only once every worker is done (a peer that closes
    while another still waits for its last chunks makes that one fail with PeerLost). Failing
    here changes nothing, so it is only logged."""
    try:
        comm.barrier(tag="diloco/finished", timeout=timeout)
    except (PeerLost, TransportTimeout) as exc:
        logger.info("final barrier: %s", exc)


def _signature_text(cfg: TrainConfig, model: nn.Module) -> str:
    # Everything that must agree for workers to train one model together. The data source is
    # left out on purpose: sites may train on their own data (only batch shapes must agree).
    desc = {
        "params": [[n, list(p.shape), str(p.dtype)] for n, p in model.named_parameters()],
        "model": repr(cfg.model),
        "mode": repr(cfg.mode),
        "inner": repr(cfg.inner),
        "lr_schedule": repr(cfg.lr_schedule),
        "steps": cfg.steps,
        "seed": cfg.seed,
        "grad_clip": cfg.grad_clip,
        "seq_len": cfg.data.seq_len,
        "batch_size": cfg.data.batch_size,
    }
    return json.dumps(desc, sort_keys=True)


def run_signature(cfg: TrainConfig, model: nn.Module) -> bytes:
    """16-byte digest of the parameter names/shapes and the configuration workers must share.
    Passed to the transport at connect time (refused there if it differs) and compared again
    by the trainer when a worker joins."""
    return hashlib.blake2b(_signature_text(cfg, model).encode(), digest_size=16).digest()


def signature_int(sig: bytes) -> int:
    """The first 8 bytes of a signature as a signed int64 (fits a status tensor)."""
    return int.from_bytes(sig[:8], "little", signed=True)


_P = (1 << 31) - 1  # a Mersenne prime: the per-row lanes are reduced modulo it
_ROW = 1 << 15  # 16-bit words per row: |word·k| < 2**35, a row's sum < 2**50 (exact in float64)
_LANES = 4
_BLOCK_ROWS = 512  # rows per product: bounds the float64 copy (~128 MB at a time)


@functools.cache
def _row_weights(device: torch.device) -> torch.Tensor:
    """Fixed pseudo-random weights in [2**17, 2**20), one column per lane (the same on every
    machine: a seeded CPU generator), kept on ``device``."""
    g = torch.Generator().manual_seed(0x10BA4D)
    k = torch.randint(1 << 17, 1 << 20, (_ROW, _LANES), generator=g, dtype=torch.int64)
    return k.to(torch.float64).to(device)


def _word_sums(t: torch.Tensor) -> torch.Tensor:
    """``_LANES`` exact checksums of a tensor's bytes, computed where the tensor lives.

    The bytes are read as signed 16-bit words (bytes when the size is odd), cut into rows of
    ``_ROW`` words; each row is multiplied by a fixed weight matrix in float64, which is exact
    (every partial sum is an integer below 2**53), so any device and any summation order give
    the same integers. A changed word moves every lane by ``d·k ≠ 0``. Rows are then folded
    modulo a prime with a distinct non-zero multiplier per row. On a GPU this is one product per
    block of rows instead of copying the tensor to the host.
    """
    raw = t.detach().contiguous().reshape(-1).view(torch.uint8)
    words = raw.view(torch.int16) if raw.numel() % 2 == 0 else raw
    n, dev = words.numel(), words.device
    k = _row_weights(dev)
    full = n // _ROW * _ROW
    parts = [
        words[i : min(i + _BLOCK_ROWS * _ROW, full)].view(-1, _ROW).to(torch.float64) @ k
        for i in range(0, full, _BLOCK_ROWS * _ROW)
    ]
    if full < n:
        parts.append((words[full:].to(torch.float64) @ k[: n - full]).reshape(1, _LANES))
    if not parts:
        return torch.zeros(_LANES, dtype=torch.int64, device=dev)
    rows = torch.cat(parts).to(torch.int64).remainder(_P)  # exact integers below 2**50
    r = torch.arange(rows.shape[0], dtype=torch.int64, device=dev)
    mult = 1 + (r * 48_271 + 11) % (_P - 1)  # never 0 modulo P
    return ((rows * mult[:, None]) % _P).sum(dim=0) % _P


def hash_state(tensors: Iterable[torch.Tensor], *counters: int) -> int:
    """A signed int64 digest of tensors' exact bytes and some counters (bit-parity audits).

    Each tensor is reduced on its own device (``_word_sums``), so a GPU worker does not copy its
    state to the host: a 368 M-parameter worker's θ_g and outer state took ~4 s to copy and hash
    on the host at every audit. Only ``_LANES`` integers per tensor reach the host, in one
    transfer per device, hashed there with the tensors' byte sizes and the counters. The digest
    does not depend on the device, so CPU and GPU workers of one run compare equal.
    """
    tensors = list(tensors)
    h = hashlib.blake2b(digest_size=8)
    h.update(struct.pack(f"<{len(counters)}q", *counters))
    sums: dict[int, torch.Tensor] = {}
    for dev in dict.fromkeys(t.device for t in tensors):
        idx = [n for n, t in enumerate(tensors) if t.device == dev]
        sums.update(zip(idx, torch.stack([_word_sums(tensors[n]) for n in idx]).cpu()))
    for n, t in enumerate(tensors):
        h.update(struct.pack("<q", t.numel() * t.element_size()))
        h.update(sums[n].numpy().tobytes())
    return int.from_bytes(h.digest(), "little", signed=True)


def optimizer_tensors(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The optimizer's state tensors in a deterministic order (for hashing)."""
    out = []
    for group in opt.param_groups:
        for p in group["params"]:
            for key, value in sorted(opt.state.get(p, {}).items()):
                if isinstance(value, torch.Tensor):
                    out.append(value)
    return out


@dataclass
class WorkerResult:
    """What one worker reports at the end of a run (the bench and the tests read it)."""

    peer_id: str
    rank: int  # rank in the final membership epoch
    mode: str  # "diloco" or "ddp"
    start_step: int  # 0, or the step at which this worker joined / resumed
    steps: int
    _losses: dict[int, float] = field(default_factory=dict, repr=False)
    _pending: list = field(default_factory=list, repr=False)  # (step, 0-dim device tensor)
    evals: list[dict[str, Any]] = field(default_factory=list)  # {"step", "loss", "bytes_sent"}
    final_eval: float | None = None
    bytes_sent: int = 0
    bytes_received: int = 0
    peak_sync_bytes: int = 0  # most bytes this worker sent for one sync (fragment or gradient)
    outer_syncs: int = 0  # syncs applied (DiLoCo) or gradient all-reduces (DDP)
    retries: int = 0  # syncs redone with the survivors after a peer was lost
    transfers: int = 0  # times this worker received the full state from a peer
    compute_s: float = 0.0
    sync_s: float = 0.0  # time blocked on the network (waits, quorum, recovery)
    wall_s: float = 0.0
    tokens: int = 0
    state_hash: int = 0
    fragment_bytes: dict[int, int] = field(default_factory=dict)  # fragment -> bytes sent
    group: tuple[str, ...] = ()  # peer ids of the final membership (who it finished with)
    finished_at: float = 0.0  # wall clock (time.time()) when its final state was taken

    def summary(self) -> dict[str, Any]:
        keys = (
            "peer_id",
            "rank",
            "mode",
            "start_step",
            "steps",
            "final_eval",
            "bytes_sent",
            "bytes_received",
            "peak_sync_bytes",
            "outer_syncs",
            "retries",
            "transfers",
            "compute_s",
            "sync_s",
            "wall_s",
            "tokens",
            "state_hash",
        )
        out = {k: getattr(self, k) for k in keys}
        out["group"] = list(self.group)
        out["finished_at"] = self.finished_at
        out["tokens_per_s"] = self.tokens / self.wall_s if self.wall_s > 0 else math.nan
        return out

    @property
    def losses(self) -> dict[int, float]:
        """Inner step -> local training loss (device values are read here, in one transfer)."""
        self.flush_losses()
        return self._losses

    def flush_losses(self) -> None:
        if self._pending:
            values = torch.stack([t.detach().float() for _, t in self._pending]).cpu().tolist()
            for (step, _), v in zip(self._pending, values):
                self._losses[step] = v
            self._pending.clear()

    def record_step(self, step: int, loss: float | torch.Tensor, tokens: int) -> None:
        """A tensor loss is kept on its device until read (no host sync per step)."""
        if isinstance(loss, torch.Tensor):
            self._pending.append((step, loss))
        else:
            self._losses[step] = float(loss)
        self.tokens += tokens

    def step_record(
        self,
        step: int,
        loss: float,
        lr: float,
        elapsed_s: float,
        bytes_sent: int,
        bytes_received: int,
    ) -> dict[str, Any]:
        """The fields of a ``step`` line of the metrics log (DiLoCo and DDP log the same)."""
        return dict(
            step=step,
            loss=loss,
            lr=lr,
            tokens=self.tokens,
            tokens_per_s=round(self.tokens / max(elapsed_s, 1e-9), 1),
            compute_s=round(self.compute_s, 4),
            sync_s=round(self.sync_s, 4),
            bytes_sent=bytes_sent,
            bytes_received=bytes_received,
        )
