"""Composition roots: build the task, the communicator and the workers, and run them.

* ``run_threads``: M workers as threads over the in-process loopback group (tests, the bench,
  ``lowband train --loopback``).
* ``worker_main``: one worker process over the ZeroMQ transport (``lowband worker``).
* ``train_main``: a coordinator plus M worker processes on this machine (``lowband train``),
  then a summary, the eval-loss-vs-bytes plot and the final model for ``edge``.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from diloco.common import WorkerResult, leave_together
from diloco.config import DDPConfig, DilocoConfig, TrainConfig, config_to_dict
from diloco.ddp import DDPWorker
from diloco.metrics import MetricsLog, RunSummary, plot_runs, read_jsonl
from diloco.task import Pretrained, Task, lm_task
from diloco.trainer import DilocoWorker
from lowband.comm import Communicator
from lowband.errors import ConfigError
from lowband.proc import die_with_parent

if TYPE_CHECKING:
    from transport.config import ZmqConfig
    from transport.coordinator import Liveness

logger = logging.getLogger(__name__)

Worker = DilocoWorker | DDPWorker


def make_worker(
    cfg: TrainConfig,
    comm: Communicator,
    task: Task,
    *,
    worker_id: str,
    out_dir: Path | None = None,
    resume: Path | None = None,
    progress: bool = False,
    on_step: Callable[[int], None] | None = None,
) -> Worker:
    """A DiLoCo or DDP worker logging to ``out_dir/metrics-worker{worker_id}.jsonl``."""
    name = f"worker{worker_id}"
    log = MetricsLog(out_dir / f"metrics-{name}.jsonl" if out_dir else None, worker=name)
    byte_tok = cfg.data.kind != "tokens" and cfg.data.tokenizer is None and cfg.gguf_model is None
    if isinstance(cfg.mode, DilocoConfig):
        return DilocoWorker(
            cfg,
            comm,
            task,
            log=log,
            progress=progress,
            out_dir=out_dir,
            resume=resume,
            worker_id=worker_id,
            byte_tokenizer=byte_tok,
            on_step=on_step,
        )
    if resume is not None:
        logger.warning("the DDP baseline does not resume; starting from step 0")
    return DDPWorker(
        cfg,
        comm,
        task,
        log=log,
        progress=progress,
        out_dir=out_dir,
        byte_tokenizer=byte_tok,
        on_step=on_step,
    )


def run_threads(
    cfg: TrainConfig,
    *,
    task: Task | None = None,
    out_dir: Path | None = None,
    resume: Path | None = None,
    progress: bool = False,
    timeout: float | None = None,
) -> list[WorkerResult]:
    """Run ``cfg.workers`` workers as threads over a loopback group; results by rank.

    The workers cannot wait forever (every collective raises after ``cfg.sync_timeout`` and a
    failing worker is removed from the group), so by default this waits for as long as the
    training takes (hours for a real run); ``timeout`` caps the whole run in seconds
    (TimeoutError)."""
    from diloco.device import limit_heap_retention
    from transport.loopback import LoopbackGroup  # composition root: the one place it is wired

    limit_heap_retention()
    task = task or lm_task(cfg)
    group = LoopbackGroup(cfg.workers, timeout=cfg.sync_timeout)
    comms = group.comms()
    workers = [
        make_worker(
            cfg,
            c,
            task,
            worker_id=str(r),
            out_dir=out_dir,
            resume=resume,
            progress=progress and r == 0,
        )
        for r, c in enumerate(comms)
    ]
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

    threads = [
        threading.Thread(target=body, args=(r,), name=f"worker{r}", daemon=True)
        for r in range(len(workers))
    ]
    for t in threads:
        t.start()
    deadline = None if timeout is None else time.monotonic() + timeout
    for t in threads:
        t.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        if t.is_alive():
            raise TimeoutError(f"worker thread {t.name} still running after {timeout:.0f}s")
    for exc in errors:
        if exc is not None:
            raise exc
    return [r for r in results if r is not None]


# ---- processes: a coordinator and M worker processes over the ZeroMQ transport -------------
def default_transport() -> "ZmqConfig":
    """``ZmqConfig()``, imported when a launch is made (the transport stays out of the import
    of this module: ``lowband train`` parses its flags without loading ZeroMQ)."""
    from transport.config import ZmqConfig

    return ZmqConfig()


@dataclass(frozen=True, kw_only=True)
class WorkerLaunch:
    """One worker process joining a run (``lowband worker``)."""

    train: TrainConfig
    coordinator: str  # tcp://HOST:PORT of the run's coordinator
    worker_id: str | None = None  # names metrics/checkpoint files; default: the transport peer id
    out_dir: Path | None = None
    resume: Path | None = None
    threads: int | None = None  # torch intra-op threads of this process
    progress: bool = False
    # The peer's transport: data socket, K connections, credentials, same-host shortcuts,
    # register_timeout (the heartbeat deadlines are the coordinator's: it tells them at
    # registration). Its ``timeout`` is replaced by ``train.sync_timeout`` at launch.
    transport: ZmqConfig = field(default_factory=default_transport)
    pretrained: Pretrained | None = None  # reads train.gguf_model (the CLI's GGUF reader)

    def __post_init__(self) -> None:
        if not self.coordinator.startswith(("tcp://", "ipc://")):
            raise ConfigError(
                "coordinator", f"must look like tcp://HOST:PORT, got {self.coordinator!r}"
            )
        if self.threads is not None and self.threads < 1:
            raise ConfigError("threads", f"must be >= 1, got {self.threads}")


def worker_main(cfg: WorkerLaunch) -> WorkerResult:
    """Connect to the coordinator (refused there if the run signature differs) and train."""
    import torch

    from diloco.common import run_signature
    from diloco.device import limit_heap_retention
    from transport.zmq_comm import connect

    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    limit_heap_retention()
    task = lm_task(cfg.train, cfg.pretrained)
    signature = run_signature(cfg.train, task.build_model()).hex()
    zcfg = replace(cfg.transport, timeout=cfg.train.sync_timeout)
    comm = connect(
        cfg.coordinator, zcfg, signature=signature, meta={"worker_id": cfg.worker_id or ""}
    )
    try:
        worker = make_worker(
            cfg.train,
            comm,
            task,
            worker_id=cfg.worker_id or comm.peer_id,
            out_dir=cfg.out_dir,
            resume=cfg.resume,
            progress=cfg.progress,
        )
        try:
            result = worker.run()
        finally:
            worker.log.close()
        leave_together(comm, cfg.train.sync_timeout)
        return result
    finally:
        comm.close()


@dataclass(frozen=True, kw_only=True)
class LocalLaunch:
    """``lowband train``: a coordinator and ``train.workers`` worker processes on this machine."""

    train: TrainConfig
    out_dir: Path
    resume: Path | None = None
    loopback: bool = False  # threads over the in-process loopback group instead of processes
    bind: str = "tcp://127.0.0.1:0"  # the coordinator's endpoint (port 0: a free one)
    threads: int = 1  # torch threads per worker process
    # The coordinator's deadlines; None: a 2 s heartbeat (a peer is lost after 4 s of silence
    # with a dead connection, 60 s with a live one): local processes on a busy machine.
    liveness: Liveness | None = None
    progress: bool = True
    pretrained: Pretrained | None = None  # reads train.gguf_model (the CLI's GGUF reader)

    def __post_init__(self) -> None:
        if self.threads < 1:
            raise ConfigError("threads", f"must be >= 1, got {self.threads}")
        if self.resume is not None and not self.resume.is_dir():
            raise ConfigError("resume", f"{self.resume} is not a checkpoint directory")


def train_main(cfg: LocalLaunch) -> dict:
    """Run the job; returns the summary also written to ``out_dir/summary.json``."""
    # A missing/empty corpus or an unreadable model file fails here, before any process starts.
    task = lm_task(cfg.train, cfg.pretrained)
    cfg.out_dir.mkdir(parents=True, exist_ok=True)
    config_file = cfg.out_dir / "config.json"
    config_file.write_text(json.dumps(config_to_dict(cfg.train), indent=2))
    t0 = time.time()
    if cfg.loopback:
        run_threads(
            cfg.train, task=task, out_dir=cfg.out_dir, resume=cfg.resume, progress=cfg.progress
        )
        codes: dict[int, int] = {i: 0 for i in range(cfg.train.workers)}
    else:
        codes = _run_processes(cfg, config_file)
    return _summarize(cfg, codes, time.time() - t0)


def _run_processes(cfg: LocalLaunch, config_file: Path) -> dict[int, int]:
    from transport.coordinator import Coordinator, Liveness

    liveness = cfg.liveness or Liveness(heartbeat_interval=2.0)
    coord = Coordinator(liveness.coordinator(bind=cfg.bind)).start()
    procs: dict[int, subprocess.Popen] = {}
    try:
        for i in range(cfg.train.workers):
            args = [
                sys.executable,
                "-m",
                "cli",
                "worker",
                "--coordinator",
                coord.address,
                "--config",
                str(config_file),
                "--id",
                str(i),
                "--out",
                str(cfg.out_dir),
                "--threads",
                str(cfg.threads),
                "--bind-host",
                "127.0.0.1",
            ]
            if cfg.resume is not None:
                args += ["--resume", str(cfg.resume)]
            show = cfg.progress and i == 0
            if show:
                args.append("--progress")
            log = (cfg.out_dir / f"worker{i}.log").open("w")
            # Own session: the whole worker (and anything it starts) can be killed as a group.
            procs[i] = subprocess.Popen(
                args,
                stdout=log,
                stderr=None if show else log,
                start_new_session=True,
                preexec_fn=die_with_parent,
            )
        (cfg.out_dir / "workers.json").write_text(
            json.dumps({"coordinator": coord.address, "pids": {i: p.pid for i, p in procs.items()}})
        )
        return {i: p.wait() for i, p in procs.items()}
    finally:
        for p in procs.values():
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        coord.stop()


def _summarize(cfg: LocalLaunch, codes: dict[int, int], wall_s: float) -> dict:
    finals, records = {}, {}
    for path in sorted(cfg.out_dir.glob("metrics-worker*.jsonl")):
        recs = read_jsonl(path)
        records[path.stem] = recs
        done = [r for r in recs if r["event"] == "final"]
        if done:
            finals[path.stem] = done[-1]
    evals = [r for recs in records.values() for r in recs if r["event"] == "eval"]
    label = "DDP" if isinstance(cfg.train.mode, DDPConfig) else "Streaming DiLoCo"
    plot = None
    if evals:
        plot = str(
            plot_runs(
                {label: sorted(evals, key=lambda r: r["step"])},
                cfg.out_dir / "eval_vs_bytes.png",
                title=f"{label}, {cfg.train.workers} workers",
            )
        )
    names = {stem: stem.removeprefix("metrics-") for stem in records}
    # Only workers that reached the last step together (exit 0) count: a worker that died or
    # left early has an older state, and must not make the run look healthy.
    run = RunSummary.from_finals(
        [f"worker{i}" for i in range(cfg.train.workers)],
        {names[k]: f for k, f in finals.items()},
        steps=cfg.train.steps,
        exit_codes={f"worker{i}": c for i, c in codes.items()},
    )
    summary = {
        "workers": cfg.train.workers,
        "exit_codes": codes,
        "finished": sorted(finals),
        "finished_together": list(run.finished),
        **run.to_dict(),
        "died": [{"worker": f"worker{i}", "exit_code": c} for i, c in sorted(codes.items()) if c],
        "rejoined": _outages(records, finals, names),
        "syncs_redone": max((f["retries"] for f in finals.values()), default=0),
        "transfers": {names[k]: f["transfers"] for k, f in sorted(finals.items())},
        "wall_s": round(wall_s, 2),
        "initial_eval": next(
            (r["loss"] for r in sorted(evals, key=lambda r: r["step"]) if r["step"] == 0), None
        ),
        "final_eval": next(
            (f["final_eval"] for f in finals.values() if f["final_eval"] is not None), None
        ),
        "bytes_sent_per_worker": {k: f["bytes_sent"] for k, f in finals.items()},
        "model": str(cfg.out_dir / "model"),
        "plot": plot,
    }
    (cfg.out_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def _outages(
    records: dict[str, list[dict]], finals: dict[str, dict], names: dict[str, str]
) -> list[dict]:
    """Workers that were declared lost and came back, with how long they were out, as one
    survivor saw it: from the membership change without them to the one with them again (one
    clock). 0 when it was back before the survivors' next quorum noticed it gone."""
    by_peer = {f["peer_id"]: names[k] for k, f in finals.items()}
    seen: dict[str, dict] = {}
    for recs in records.values():
        gone: dict[str, float] = {}
        for r in recs:
            if r.get("event") != "membership":
                continue
            for pid in r.get("left", []):
                gone.setdefault(pid, r["time"])
            for pid in r.get("joined", []):
                if pid in gone and pid in by_peer:
                    out = round(r["time"] - gone.pop(pid), 2)
                    best = seen.get(pid)
                    if best is None or out > best["out_s"]:
                        seen[pid] = {
                            "worker": by_peer[pid],
                            "peer_id": pid,
                            "out_s": out,
                            "back_at_step": r["step"],
                        }
    return sorted(seen.values(), key=lambda d: d["worker"])
