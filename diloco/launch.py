"""Composition roots: build the task, the communicator and the workers, and run them.

``run_threads`` runs M workers as threads over the in-process loopback group (tests, the bench,
``lowband train --loopback``). ``run_worker`` runs one worker over any communicator (the
``lowband worker`` process). The multi-process launcher lives in ``lowband.cmd_train``.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Callable

from diloco.common import WorkerResult
from diloco.config import DilocoConfig, TrainConfig
from diloco.data import load_corpus
from diloco.ddp import DDPWorker
from diloco.metrics import MetricsLog
from diloco.task import LMTask, Task
from diloco.trainer import DilocoWorker
from lowband.comm import Communicator
from lowband.errors import ConfigError

logger = logging.getLogger(__name__)

Worker = DilocoWorker | DDPWorker


def lm_task(cfg: TrainConfig) -> LMTask:
    """The default task: the configured corpus (ConfigError if missing or empty) and model."""
    if cfg.model is None:
        raise ConfigError("model", "the language-model task needs a ModelConfig (use a preset)")
    return LMTask(cfg, load_corpus(cfg.data, cfg.model.vocab_size))


def make_worker(cfg: TrainConfig, comm: Communicator, task: Task, *, worker_id: str,
                out_dir: Path | None = None, resume: Path | None = None,
                progress: bool = False, on_step: Callable[[int], None] | None = None) -> Worker:
    """A DiLoCo or DDP worker logging to ``out_dir/metrics-worker{worker_id}.jsonl``."""
    name = f"worker{worker_id}"
    log = MetricsLog(out_dir / f"metrics-{name}.jsonl" if out_dir else None, worker=name)
    byte_tok = cfg.data.kind != "tokens"
    if isinstance(cfg.mode, DilocoConfig):
        return DilocoWorker(cfg, comm, task, log=log, progress=progress, out_dir=out_dir,
                            resume=resume, worker_id=worker_id, byte_tokenizer=byte_tok,
                            on_step=on_step)
    if resume is not None:
        logger.warning("the DDP baseline does not resume; starting from step 0")
    return DDPWorker(cfg, comm, task, log=log, progress=progress, out_dir=out_dir,
                     byte_tokenizer=byte_tok, on_step=on_step)


def run_threads(cfg: TrainConfig, *, task: Task | None = None, out_dir: Path | None = None,
                resume: Path | None = None, progress: bool = False,
                timeout: float = 600.0) -> list[WorkerResult]:
    """Run ``cfg.workers`` workers as threads over a loopback group; results by rank."""
    from transport.loopback import LoopbackGroup  # composition root: the one place it is wired

    task = task or lm_task(cfg)
    group = LoopbackGroup(cfg.workers, timeout=cfg.sync_timeout)
    comms = group.comms()
    workers = [make_worker(cfg, c, task, worker_id=str(r), out_dir=out_dir, resume=resume,
                           progress=progress and r == 0) for r, c in enumerate(comms)]
    results: list[WorkerResult | None] = [None] * len(workers)
    errors: list[BaseException | None] = [None] * len(workers)

    def body(r: int) -> None:
        try:
            results[r] = workers[r].run()
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread below
            errors[r] = exc
            group.kill(comms[r])  # the others see PeerLost instead of waiting for it
        finally:
            workers[r].log.close()

    threads = [threading.Thread(target=body, args=(r,), name=f"worker{r}", daemon=True)
               for r in range(len(workers))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
        if t.is_alive():
            raise TimeoutError(f"worker thread {t.name} still running after {timeout:.0f}s")
    for exc in errors:
        if exc is not None:
            raise exc
    return [r for r in results if r is not None]
