"""Several sites train one model with Streaming DiLoCo over the ZeroMQ transport.

    python examples/multisite_diloco/main.py                # coordinator + 3 sites on this machine
    python examples/multisite_diloco/main.py --tiny         # a few seconds (the smoke test)

Across machines, start the coordinator once and one site per machine (same flags everywhere):

    python main.py --coordinator-only --bind tcp://0.0.0.0:29500
    python main.py --join tcp://COORD_HOST:29500 --sites 3          # on each of the 3 machines

Everything below uses the Python API (no `lowband` CLI): ``Coordinator`` (membership, no tensor
data), ``connect`` (one site's communicator: K striped TCP connections to every other site),
``DilocoWorker`` (the Streaming DiLoCo loop on any ``Communicator``).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time

from diloco.common import run_signature
from diloco.config import (
    DataConfig,
    DilocoConfig,
    LrSchedule,
    OptimizerConfig,
    TrainConfig,
    byte_llama,
)
from diloco.task import lm_task
from diloco.trainer import DilocoWorker
from transport.coordinator import Coordinator, CoordinatorConfig
from transport.zmq_comm import ZmqConfig, connect


def train_config(sites: int, tiny: bool) -> TrainConfig:
    """Every site must build exactly this (the coordinator refuses a site whose differs)."""
    steps = 24 if tiny else 300
    return TrainConfig(
        model=byte_llama(hidden=64, layers=2, heads=4, seq_len=64),  # ~0.13 M parameters
        data=DataConfig(seq_len=32 if tiny else 64, batch_size=4 if tiny else 8),  # embedded text
        mode=DilocoConfig(
            inner_steps=8 if tiny else 30,  # H: inner steps between two syncs of a fragment
            n_fragments=2 if tiny else 3,  # P: a fragment syncs every H/P steps
            tau=1 if tiny else 2,  # τ: steps a sync overlaps with compute
            alpha=0.5,  # α: merge weight of the local parameters
            codec="nf4",
            error_feedback=True,  # 4-bit pseudo-gradients, residual carried over
            outer=OptimizerConfig(name="sgd", lr=1.0, momentum=0.9, nesterov=True),
        ),
        inner=OptimizerConfig(name="adamw", lr=6e-3, weight_decay=0.1),
        lr_schedule=LrSchedule(warmup_steps=4 if tiny else 30),
        steps=steps,
        workers=sites,
        eval_every=steps // 4,
    )


def run_site(coordinator: str, cfg: TrainConfig, bind_host: str) -> dict:
    """One site: join the group, train, report. Rank 0 also evaluates the global model."""
    task = lm_task(cfg)  # the model + the data; site r trains on its own stream of batches
    signature = run_signature(cfg, task.build_model()).hex()
    comm = connect(coordinator, ZmqConfig(bind_host=bind_host, connections=4), signature=signature)
    try:
        worker = DilocoWorker(cfg, comm, task)
        result = worker.run()  # waits for cfg.workers sites, then trains cfg.steps steps
        comm.barrier(tag="example/done", timeout=60)  # leave together: nobody waits on a gone peer
    finally:
        comm.close()
    last = max(result.losses)
    return {
        "rank": result.rank,
        "train_loss": round(result.losses[last], 4),
        "eval": result.evals,
        "final_eval": result.final_eval,
        "bytes_sent": result.bytes_sent,
        "bytes_received": result.bytes_received,
        "syncs": result.outer_syncs,
        "wall_s": round(result.wall_s, 2),
    }


def run_local(sites: int, tiny: bool) -> list[dict]:
    """A coordinator in this process and one site process per site (this script, --join)."""
    with Coordinator(CoordinatorConfig(bind="tcp://127.0.0.1:0")) as coord:
        procs = [
            subprocess.Popen(
                [
                    sys.executable,
                    __file__,
                    "--join",
                    coord.address,
                    "--sites",
                    str(sites),
                    "--bind-host",
                    "127.0.0.1",
                ]
                + (["--tiny"] if tiny else []),
                stdout=subprocess.PIPE,
                text=True,
                start_new_session=True,
            )
            for _ in range(sites)
        ]
        try:
            deadline = time.monotonic() + 900
            while any(p.poll() is None for p in procs):  # a failed site ends the run at once
                if any(p.poll() for p in procs) or time.monotonic() > deadline:
                    raise SystemExit(f"a site failed: exit codes {[p.poll() for p in procs]}")
                time.sleep(0.2)
            outs = [p.stdout.read() for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    if any(p.returncode for p in procs):
        raise SystemExit(f"a site failed: exit codes {[p.returncode for p in procs]}")
    return sorted((json.loads(o.strip().splitlines()[-1]) for o in outs), key=lambda r: r["rank"])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sites", type=int, default=3)
    ap.add_argument("--tiny", action="store_true", help="a few seconds")
    ap.add_argument("--join", metavar="tcp://HOST:PORT", help="run one site of a coordinator's run")
    ap.add_argument("--bind-host", default="0.0.0.0", help="this site's data interface")
    ap.add_argument("--coordinator-only", action="store_true")
    ap.add_argument("--bind", default="tcp://0.0.0.0:29500", help="with --coordinator-only")
    args = ap.parse_args()
    cfg = train_config(args.sites, args.tiny)
    if args.coordinator_only:
        with Coordinator(CoordinatorConfig(bind=args.bind)) as coord:
            print(f"coordinator at {coord.address}; Ctrl-C to stop", flush=True)
            try:
                while True:
                    time.sleep(3600)
            except KeyboardInterrupt:
                pass
        return 0
    if args.join:
        print(json.dumps(run_site(args.join, cfg, args.bind_host)))
        return 0

    results = run_local(args.sites, args.tiny)
    print(
        f"{'site':>4} {'train loss':>10} {'MiB sent':>9} {'MiB recv':>9} {'syncs':>6} {'wall s':>7}"
    )
    for r in results:
        print(
            f"{r['rank']:>4} {r['train_loss']:>10.4f} {r['bytes_sent'] / 2**20:>9.3f} "
            f"{r['bytes_received'] / 2**20:>9.3f} {r['syncs']:>6} {r['wall_s']:>7.1f}"
        )
    lead = results[0]
    print(
        "global model, held-out loss by step: "
        + ", ".join(f"{e['step']}: {e['loss']:.3f}" for e in lead["eval"])
        + f", final: {lead['final_eval']:.4f}"
    )
    print(json.dumps({"sites": results, "final_eval": lead["final_eval"]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
