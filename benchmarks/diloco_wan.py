"""Wall clock over a real bandwidth-limited network: DDP vs DiLoCo without overlap vs Streaming
DiLoCo with overlap. One JSON line, last. Needs root and iproute2 (``ip netns``, ``tc``).

    python -m benchmarks.diloco_wan --json --rate-mbit 4 --workers 3

Each worker is a separate ``lowband worker`` process in its own network namespace, attached to
a bridge by a veth pair whose two ends are shaped by ``tc tbf`` to ``rate_mbit``: every byte a
worker sends or receives crosses its own shaped link (kernel TCP, the ZeroMQ transport). The
coordinator runs in this process on the bridge. This kernel has no ``netem``, so the links add
no propagation delay: the comparison is about bandwidth. Model and DiLoCo settings are those of
``benchmarks.diloco`` (``BenchConfig``); DDP runs fewer steps because each of its steps moves the
whole gradient, and throughput is compared as steps per second.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.diloco import BenchConfig, with_speedups
from diloco.config import DDPConfig, TrainConfig, config_to_dict
from lowband.errors import ConfigError
from transport.links.netns import NetnsConfig, Testbed


@dataclass(frozen=True, kw_only=True)
class WanBench:
    workers: int = 3
    rate_mbit: float = 4.0  # tbf rate on each worker's link (both directions)
    steps: int = 120  # DiLoCo runs
    ddp_steps: int = 10
    net: int = 177  # 10.<net>.0.0/24
    timeout: float = 600.0

    def __post_init__(self) -> None:
        if not 0.05 <= self.rate_mbit <= 10_000:
            raise ConfigError("rate_mbit", f"must be in [0.05, 10000], got {self.rate_mbit}")
        if not 2 <= self.workers <= 32:
            raise ConfigError("workers", "must be in [2, 32]")
        if not 1 <= self.net <= 254:
            raise ConfigError("net", "must be in [1, 254]")


def _run(bed: Testbed, cfg: TrainConfig, work: Path, timeout: float) -> dict[str, Any]:
    from transport.coordinator import Coordinator, CoordinatorConfig

    work.mkdir(parents=True)
    (work / "config.json").write_text(json.dumps(config_to_dict(cfg)))
    procs = []
    with Coordinator(CoordinatorConfig(bind=f"tcp://{bed.host}:0", heartbeat_interval=5.0)) as coord:
        try:
            for i, ns in enumerate(bed.ns):
                log = (work / f"out{i}.txt").open("w")
                procs.append(subprocess.Popen(
                    ["ip", "netns", "exec", ns, sys.executable, "-m", "lowband", "worker",
                     "--coordinator", coord.address, "--config", str(work / "config.json"),
                     "--id", str(i), "--threads", "1", "--bind-host", bed.addr(i)],
                    stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
            codes = [p.wait(timeout) for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGKILL)
                    p.wait()
    outs = [(work / f"out{i}.txt").read_text() for i in range(len(procs))]
    if any(codes):
        raise RuntimeError(f"a worker failed: {codes}\n" + outs[codes.index(next(c for c in codes if c))][-3000:])
    finals = [json.loads(o.strip().splitlines()[-1]) for o in outs]
    wall = max(f["wall_s"] for f in finals)
    return {"steps": cfg.steps, "wall_s": round(wall, 2),
            "steps_per_s": round(cfg.steps / wall, 3),
            "sync_s": round(sum(f["sync_s"] for f in finals) / len(finals), 2),
            "compute_s": round(sum(f["compute_s"] for f in finals) / len(finals), 2),
            "bytes_per_worker": sum(f["bytes_sent"] for f in finals) / len(finals)}


def run_wanbench(w: WanBench, b: BenchConfig) -> dict[str, Any]:
    b = dataclasses.replace(b, workers=w.workers)
    variants = {
        "ddp": b.train_config(DDPConfig(), w.ddp_steps),
        "diloco_no_overlap": b.train_config(b.diloco_mode(tau=0), w.steps),
        "streaming_overlap": b.train_config(b.diloco_mode(), w.steps),
    }
    out: dict[str, Any] = {"link": f"REAL: tc tbf {w.rate_mbit} Mbit/s per worker link "
                           "(both directions), no added delay; ZeroMQ over kernel TCP",
                           "workers": w.workers, "H": b.inner_steps, "P": b.n_fragments,
                           "tau": b.tau, "codec": b.codec}
    with tempfile.TemporaryDirectory(prefix="wanbench") as tmp, \
            Testbed(NetnsConfig(sites=w.workers, rate_mbit=w.rate_mbit, net=w.net, queue_ms=100.0)) as bed:
        for name, cfg in variants.items():
            cfg = dataclasses.replace(cfg, eval_every=0, audit_every=0, sync_timeout=300.0)
            out[name] = _run(bed, cfg, Path(tmp) / name, w.timeout)
    return with_speedups(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.diloco_wan", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", action="store_true")
    p.add_argument("--workers", type=int, default=3)
    p.add_argument("--rate-mbit", type=float, default=4.0)
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--ddp-steps", type=int, default=10)
    p.add_argument("--tau", type=int, help="overlap of the streaming run (default: the bench's)")
    p.add_argument("--hidden", type=int)
    p.add_argument("--layers", type=int)
    args = p.parse_args(argv)
    w = WanBench(workers=args.workers, rate_mbit=args.rate_mbit, steps=args.steps,
                 ddp_steps=args.ddp_steps)
    over = {k: v for k, v in (("tau", args.tau), ("hidden", args.hidden),
                              ("layers", args.layers)) if v is not None}
    print(json.dumps(run_wanbench(w, dataclasses.replace(BenchConfig(), **over))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
