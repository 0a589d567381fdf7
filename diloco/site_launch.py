"""Composition root of one site rank (``lowband worker --site ...`` under torchrun).

Rank r of a site of N ranks joins the site's torch.distributed group (Gloo on CPU, NCCL on CUDA)
and lowband group r (``coordinators[r]``: one coordinator per shard, each grouping rank r of every
site), then runs a :class:`diloco.site.SiteWorker`. The caller (the CLI) reads torchrun's
environment; this module only receives values (:func:`site_device` maps the ``LOCAL_RANK`` it
is given to the rank's device).

Backends and devices. NCCL runs collectives on CUDA tensors only, one GPU per rank: every rank
computes on ``cuda:LOCAL_RANK`` and the site's own collectives use tensors there. Gloo is the
CPU backend; it also accepts CUDA tensors for the collectives DDP issues, and that is all this
module relies on (see :func:`check_site_device`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING

from diloco.common import WorkerResult, leave_together
from diloco.config import DilocoConfig, TrainConfig
from diloco.launch import default_transport
from diloco.sharding import ENGINES, Engine, ShardLayout
from lowband.errors import ConfigError, LowbandError

if TYPE_CHECKING:
    from transport.config import ZmqConfig

logger = logging.getLogger(__name__)

BACKENDS = ("gloo", "nccl")


def site_device(spec: str, *, backend: str, engine: str, local_rank: int, cuda: bool) -> str:
    """The compute device of the site rank that torchrun numbers ``local_rank`` on its host.

    ``spec`` is ``--device``; ``cuda`` whether torch sees a GPU. ``auto`` means ``cuda`` under
    NCCL and the CPU under Gloo (Gloo is the CPU backend; ask for ``--device cuda`` to put Gloo
    ranks on GPUs); ``cuda`` means ``cuda:LOCAL_RANK``, one GPU per rank of a host. ``cpu`` and
    ``cuda:N`` are taken as given (``cuda:N`` lets Gloo ranks share one GPU). The result is
    checked by :func:`check_site_device`. Pure."""
    if spec == "auto":
        if backend == "nccl" and not cuda:
            raise ConfigError(
                "site.backend",
                "--site-backend nccl needs one CUDA GPU per rank and "
                "torch sees none (--device auto): use --site-backend gloo on CPUs",
            )
        spec = "cuda" if backend == "nccl" else "cpu"
    if spec.startswith("cuda") and not cuda:
        fix = "--site-backend gloo --device cpu" if backend == "nccl" else "--device cpu"
        raise ConfigError(
            "compute.device",
            f"--device {spec} asked for, but torch sees no CUDA "
            f"device (a CPU build of torch, or no GPU): use {fix}",
        )
    if spec == "cuda":
        spec = f"cuda:{local_rank}"
    check_site_device(backend, engine, spec)
    return spec


def check_site_device(backend: str, engine: str, device: str) -> None:
    """Refuse a backend/engine/device combination a site cannot run (before any process
    group forms).

    What this relies on: NCCL takes CUDA tensors only. Gloo takes CPU tensors for every
    collective and CUDA tensors for all_reduce, broadcast and all_gather (it stages them through
    host memory); DDP needs no more than all_reduce (gradient buckets) and broadcast (the
    initial parameters and buffers), so DDP over Gloo may compute on GPUs. FSDP2 issues
    all_gather_into_tensor and reduce_scatter_tensor, which Gloo does not promise for CUDA
    tensors, so FSDP2 over Gloo stays on the CPU. The site's own control collectives run on host
    tensors under Gloo either way (``diloco.site.collective_device``)."""
    if backend not in BACKENDS:
        raise ConfigError("site.backend", f"must be one of {BACKENDS}, got {backend!r}")
    if device == "auto" or device == "cuda":
        raise ConfigError(
            "compute.device",
            f"a site rank needs its own device (cpu or cuda:N), "
            f"got {device!r}: map it with site_device (the CLI does)",
        )
    on_gpu = device.startswith("cuda")
    if backend == "nccl" and not on_gpu:
        raise ConfigError(
            "site.backend",
            f"--site-backend nccl runs collectives on CUDA tensors "
            f"only, but this rank computes on {device!r}: use --device cuda (rank "
            "r of a host takes cuda:LOCAL_RANK) or --site-backend gloo",
        )
    if backend == "gloo" and on_gpu and engine == "fsdp2":
        raise ConfigError(
            "site.backend",
            f"FSDP2 over Gloo cannot compute on {device!r} (Gloo "
            "has no CUDA reduce-scatter to rely on): use --site-backend nccl, "
            "--site ddp, or --device cpu",
        )


class SiteFailed(LowbandError):
    """This rank of a site stopped training (a site collective failed because another rank of
    the site died, or this rank hit an error). It has left its lowband group already; the whole
    site must be restarted (torchrun does), and it then rejoins every shard group as a
    newcomer. The process should exit at once: see ``cli.train``."""


@dataclass(frozen=True, kw_only=True)
class SiteLaunch:
    """One rank of a site: its place in the site and the lowband groups of the shards."""

    train: TrainConfig
    coordinators: tuple[str, ...]  # tcp://HOST:PORT of lowband group r, r = 0..N-1
    rank: int  # r: rank in the site (torchrun RANK)
    size: int  # N: ranks in the site (torchrun WORLD_SIZE)
    master: str  # HOST:PORT of the site's torch.distributed rendezvous (MASTER_ADDR:PORT)
    engine: Engine = "fsdp2"  # inner data parallelism inside the site
    backend: str = "gloo"  # torch.distributed backend: gloo (CPU) or nccl (CUDA)
    site_id: str = "site"  # names the site's files; the rank is appended
    out_dir: Path | None = None
    threads: int | None = None
    # The rank's transport to its shard group (as diloco.launch.WorkerLaunch.transport; its
    # ``timeout`` is replaced by ``train.sync_timeout`` at launch).
    transport: ZmqConfig = field(default_factory=default_transport)
    dist_timeout: float = 60.0  # seconds a site collective may wait for a dead rank
    # The rank's device is train.compute.device: cpu or cuda:N (site_device maps auto/cuda).
    resume: Path | None = None  # a checkpoints/step-* directory of this site (sharded, DCP)
    layout: ShardLayout = field(init=False)

    def __post_init__(self) -> None:
        if not isinstance(self.train.mode, DilocoConfig):
            raise ConfigError(
                "mode", "a multi-rank site runs Streaming DiLoCo, not the DDP baseline"
            )
        if self.engine not in ENGINES:
            raise ConfigError("site.engine", f"must be one of {ENGINES}, got {self.engine!r}")
        check_site_device(self.backend, self.engine, self.train.compute.device)
        if not self.dist_timeout > 0:
            raise ConfigError("site.dist_timeout", f"must be > 0 seconds, got {self.dist_timeout}")
        if len(self.coordinators) != self.size:
            raise ConfigError(
                "coordinators",
                f"a site of {self.size} ranks needs one lowband "
                f"coordinator per shard, got {len(self.coordinators)}",
            )
        object.__setattr__(
            self, "layout", ShardLayout(size=self.size, rank=self.rank, engine=self.engine)
        )


def site_main(cfg: SiteLaunch) -> WorkerResult:
    import torch
    import torch.distributed as dist

    from diloco.common import run_signature
    from diloco.device import limit_heap_retention, resolve_device
    from diloco.metrics import MetricsLog
    from diloco.site import SiteWorker, site_signature
    from diloco.task import lm_task
    from transport.zmq_comm import connect

    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    limit_heap_retention()
    device = resolve_device(cfg.train.compute.device)  # cuda:N must exist on this host
    if device.type == "cuda":
        # Before the process group forms: NCCL binds its communicator, and FSDP2 and DCP's
        # object collectives pick their device, from the current CUDA device.
        torch.cuda.set_device(device)
    dist.init_process_group(
        cfg.backend,
        init_method=f"tcp://{cfg.master}",
        rank=cfg.rank,
        world_size=cfg.size,
        timeout=timedelta(seconds=cfg.dist_timeout),
    )
    task = lm_task(cfg.train)
    signature = site_signature(run_signature(cfg.train, task.build_model()), cfg.layout).hex()
    zcfg = replace(cfg.transport, timeout=cfg.train.sync_timeout)
    worker_id = f"{cfg.site_id}-r{cfg.rank}"
    comm = connect(
        cfg.coordinators[cfg.rank],
        zcfg,
        signature=signature,
        meta={"worker_id": worker_id, "layout": cfg.layout.describe()},
    )
    log = MetricsLog(
        cfg.out_dir / f"metrics-{worker_id}.jsonl" if cfg.out_dir else None, worker=worker_id
    )
    try:
        worker = SiteWorker(
            cfg.train,
            comm,
            task,
            layout=cfg.layout,
            log=log,
            out_dir=cfg.out_dir,
            worker_id=worker_id,
            resume=cfg.resume,
            byte_tokenizer=cfg.train.data.kind != "tokens",
        )
        result = worker.run()
        leave_together(comm, cfg.train.sync_timeout)
        return result
    except Exception as exc:  # any failure of a rank takes its whole site down
        # No half-site: leave lowband group r now (peers get PEER_LOST at once and redo or
        # reconcile without this site), before anything else can block.
        comm.close()
        log.log("site_failed", rank=cfg.rank, error=f"{type(exc).__name__}: {exc}")
        raise SiteFailed(
            f"rank {cfg.rank} of site {cfg.site_id!r} stopped ({type(exc).__name__}: "
            f"{exc}); it left lowband group {cfg.rank}: restart the whole site "
            "(torchrun does) and it rejoins as a newcomer"
        ) from exc
    finally:
        log.close()
        comm.close()
        dist.destroy_process_group()
