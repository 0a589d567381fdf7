"""Composition root of one site rank (``lowband worker --site ...`` under torchrun).

Rank r of a site of N ranks joins the site's torch.distributed group (Gloo on CPU, NCCL on CUDA)
and lowband group r (``coordinators[r]``: one coordinator per shard, each grouping rank r of every
site), then runs a :class:`diloco.site.SiteWorker`. The caller (the CLI) reads torchrun's
environment; this module only receives values.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

from diloco.common import WorkerResult, leave_together
from diloco.config import DilocoConfig, TrainConfig
from diloco.sharding import ENGINES, Engine, ShardLayout
from lowband.errors import ConfigError, LowbandError

logger = logging.getLogger(__name__)


class SiteFailed(LowbandError):
    """This rank of a site stopped training (a site collective failed because another rank of
    the site died, or this rank hit an error). It has left its lowband group already; the whole
    site must be restarted (torchrun does), and it then rejoins every shard group as a
    newcomer. The process should exit at once: see ``lowband.cli.train``."""


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
    bind_host: str = "0.0.0.0"
    advertise_host: str | None = None
    connections: int = 4
    token: str | None = None
    same_host: str = "auto"
    dist_timeout: float = 60.0  # seconds a site collective may wait for a dead rank
    resume: Path | None = None  # a checkpoints/step-* directory of this site (sharded, DCP)
    layout: ShardLayout = field(init=False)

    def __post_init__(self) -> None:
        if not isinstance(self.train.mode, DilocoConfig):
            raise ConfigError("mode", "a multi-rank site runs Streaming DiLoCo, not the DDP baseline")
        if self.engine not in ENGINES:
            raise ConfigError("site.engine", f"must be one of {ENGINES}, got {self.engine!r}")
        if len(self.coordinators) != self.size:
            raise ConfigError("coordinators", f"a site of {self.size} ranks needs one lowband "
                              f"coordinator per shard, got {len(self.coordinators)}")
        object.__setattr__(self, "layout", ShardLayout(size=self.size, rank=self.rank,
                                                       engine=self.engine))


def site_main(cfg: SiteLaunch) -> WorkerResult:
    import torch
    import torch.distributed as dist

    from diloco.common import run_signature
    from diloco.metrics import MetricsLog
    from diloco.site import SiteWorker, site_signature
    from diloco.task import lm_task
    from transport.zmq_comm import ZmqConfig, connect

    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    dist.init_process_group(cfg.backend, init_method=f"tcp://{cfg.master}", rank=cfg.rank,
                            world_size=cfg.size, timeout=timedelta(seconds=cfg.dist_timeout))
    task = lm_task(cfg.train)
    signature = site_signature(run_signature(cfg.train, task.build_model()), cfg.layout).hex()
    zcfg = ZmqConfig(bind_host=cfg.bind_host, advertise_host=cfg.advertise_host,
                     connections=cfg.connections, timeout=cfg.train.sync_timeout, token=cfg.token,
                     same_host=cfg.same_host)
    worker_id = f"{cfg.site_id}-r{cfg.rank}"
    comm = connect(cfg.coordinators[cfg.rank], zcfg, signature=signature,
                   meta={"worker_id": worker_id, "layout": cfg.layout.describe()})
    log = MetricsLog(cfg.out_dir / f"metrics-{worker_id}.jsonl" if cfg.out_dir else None,
                     worker=worker_id)
    try:
        worker = SiteWorker(cfg.train, comm, task, layout=cfg.layout, log=log,
                            out_dir=cfg.out_dir, worker_id=worker_id, resume=cfg.resume,
                            byte_tokenizer=cfg.train.data.kind != "tokens")
        result = worker.run()
        leave_together(comm, cfg.train.sync_timeout)
        return result
    except Exception as exc:  # any failure of a rank takes its whole site down
        # No half-site: leave lowband group r now (peers get PEER_LOST at once and redo or
        # reconcile without this site), before anything else can block.
        comm.close()
        log.log("site_failed", rank=cfg.rank, error=f"{type(exc).__name__}: {exc}")
        raise SiteFailed(f"rank {cfg.rank} of site {cfg.site_id!r} stopped ({type(exc).__name__}: "
                         f"{exc}); it left lowband group {cfg.rank}: restart the whole site "
                         "(torchrun does) and it rejoins as a newcomer") from exc
    finally:
        log.close()
        comm.close()
        dist.destroy_process_group()
