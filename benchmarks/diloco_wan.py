"""Wall clock over a real bandwidth-limited network: DDP vs DiLoCo without overlap vs Streaming
DiLoCo with overlap, repeated and interleaved. One JSON line, last. Needs root and iproute2
(``ip netns``, ``tc``).

    python -m benchmarks.diloco_wan --json --rate-mbit 2 --workers 3 --repeats 5

Each worker is a separate ``lowband worker`` process in its own network namespace, attached to
a bridge by a veth pair whose two ends are shaped by ``tc tbf`` to ``rate_mbit``: every byte a
worker sends or receives crosses its own shaped link (kernel TCP, the ZeroMQ transport). The
coordinator runs in this process on the bridge. This kernel has no ``netem``, so the links add
no propagation delay: the comparison is about bandwidth. Model and DiLoCo settings are those of
``benchmarks.diloco`` (``BenchConfig``); DDP runs fewer steps because each of its steps moves the
whole gradient, and throughput is compared as steps per second.

Why repeats and a decomposition: on a shared machine two runs of the same variant differ by more
than the overlap's effect, so one run of each, always in the same order, says little. Each repeat
runs every variant once, in an order rotated by one per repeat (so no variant always goes first
or last); medians with min/max are reported. Each run's wall time is split, per worker, into
``compute_s`` (inner steps), ``wait_s`` (blocked waiting for a fragment's all-reduce: the exposed
communication, what τ is meant to hide), and ``other_s`` (the rest: encode/decode, outer steps,
bookkeeping). The overlap's gain is read from that split — ``explained_speedup`` is the no-overlap
wall time over the same minus the wait that overlap removed — beside the measured ratio of the
paired runs (``speedup_overlap_vs_no_overlap``: median and min/max over repeats).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.diloco import BenchConfig
from diloco.config import DDPConfig, TrainConfig, config_to_dict
from lowband.errors import ConfigError
from transport.links.netns import NetnsConfig, Testbed

VARIANTS = ("ddp", "diloco_no_overlap", "streaming_overlap")


@dataclass(frozen=True, kw_only=True)
class WanBench:
    workers: int = 3
    rate_mbit: float = 4.0  # tbf rate on each worker's link (both directions)
    steps: int = 120  # DiLoCo runs
    ddp_steps: int = 10
    repeats: int = 5  # every variant runs this many times, interleaved
    variants: tuple[str, ...] = VARIANTS
    net: int = 177  # 10.<net>.0.0/24
    timeout: float = 600.0

    def __post_init__(self) -> None:
        if not 0.05 <= self.rate_mbit <= 10_000:
            raise ConfigError("rate_mbit", f"must be in [0.05, 10000], got {self.rate_mbit}")
        if not 2 <= self.workers <= 32:
            raise ConfigError("workers", "must be in [2, 32]")
        if not 1 <= self.net <= 254:
            raise ConfigError("net", "must be in [1, 254]")
        if not 1 <= self.repeats <= 100:
            raise ConfigError("repeats", "must be in [1, 100]")
        if (
            not self.variants
            or set(self.variants) - set(VARIANTS)
            or len(set(self.variants)) != len(self.variants)
        ):
            raise ConfigError("variants", f"a non-empty subset of {VARIANTS} without repeats")


def run_order(variants: tuple[str, ...], repeats: int) -> list[tuple[int, str]]:
    """(repeat, variant) in run order: each repeat rotates the order by one, so every variant
    takes every position equally often (over len(variants) repeats)."""
    n = len(variants)
    return [(r, variants[(r + i) % n]) for r in range(repeats) for i in range(n)]


def spread(xs: list[float], nd: int = 3) -> dict[str, float]:
    """Median with min and max (what every repeated figure is reported as)."""
    return {
        "median": round(statistics.median(xs), nd),
        "min": round(min(xs), nd),
        "max": round(max(xs), nd),
    }


def decompose(finals: list[dict[str, Any]], waits: list[float], steps: int) -> dict[str, Any]:
    """One run's figures from its workers' final records and their summed fragment waits.

    The wall time is the slowest worker's; compute, wait and sync are worker means. DDP logs no
    fragment waits: its whole ``sync_s`` is the gradient all-reduce, so that is its wait."""
    n = len(finals)
    wall = max(f["wall_s"] for f in finals)
    compute = sum(f["compute_s"] for f in finals) / n
    sync = sum(f["sync_s"] for f in finals) / n
    wait = sum(waits) / len(waits) if waits else sync
    return {
        "steps": steps,
        "wall_s": round(wall, 3),
        "steps_per_s": round(steps / wall, 3),
        "compute_s": round(compute, 3),
        "wait_s": round(wait, 3),
        "sync_s": round(sync, 3),
        "other_s": round(wall - compute - wait, 3),
        "bytes_per_worker": sum(f["bytes_sent"] for f in finals) / n,
    }


def summarize(runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Medians (min/max) per variant and the paired overlap / DDP ratios over repeats."""
    out: dict[str, Any] = {}
    for name, rs in runs.items():
        out[name] = {
            "runs": len(rs),
            "steps": rs[0]["steps"],
            "bytes_per_worker": rs[0]["bytes_per_worker"],
            **{
                k: spread([r[k] for r in rs])
                for k in ("wall_s", "steps_per_s", "compute_s", "wait_s", "other_s")
            },
        }
    no, ov = runs.get("diloco_no_overlap"), runs.get("streaming_overlap")
    if no and ov:
        # paired: repeat r of one with repeat r of the other (they ran back to back)
        out["speedup_overlap_vs_no_overlap"] = spread(
            [o["steps_per_s"] / n["steps_per_s"] for n, o in zip(no, ov)]
        )
        # what the decomposition can explain: the no-overlap wall minus the wait overlap removed
        out["explained_speedup"] = spread(
            [n["wall_s"] / (n["wall_s"] - (n["wait_s"] - o["wait_s"])) for n, o in zip(no, ov)]
        )
        out["wait_removed_s"] = spread([n["wait_s"] - o["wait_s"] for n, o in zip(no, ov)])
        # and how much the same variant moves between repeats (noise against the effect)
        out["no_overlap_wall_spread"] = round(
            (max(r["wall_s"] for r in no) - min(r["wall_s"] for r in no))
            / statistics.median(r["wall_s"] for r in no),
            3,
        )
    ddp = runs.get("ddp")
    if ddp and ov:
        out["speedup_streaming_vs_ddp"] = spread(
            [o["steps_per_s"] / d["steps_per_s"] for d, o in zip(ddp, ov)]
        )
    return out


def _run(bed: Testbed, cfg: TrainConfig, work: Path, timeout: float) -> dict[str, Any]:
    from diloco.metrics import read_jsonl
    from transport.coordinator import Coordinator, CoordinatorConfig

    work.mkdir(parents=True)
    (work / "config.json").write_text(json.dumps(config_to_dict(cfg)))
    procs = []
    with Coordinator(
        CoordinatorConfig(bind=f"tcp://{bed.host}:0", heartbeat_interval=5.0)
    ) as coord:
        try:
            for i, ns in enumerate(bed.ns):
                log = (work / f"out{i}.txt").open("w")
                procs.append(
                    subprocess.Popen(
                        [
                            "ip",
                            "netns",
                            "exec",
                            ns,
                            sys.executable,
                            "-m",
                            "cli",
                            "worker",
                            "--coordinator",
                            coord.address,
                            "--config",
                            str(work / "config.json"),
                            "--id",
                            str(i),
                            "--threads",
                            "1",
                            "--bind-host",
                            bed.addr(i),
                            "--insecure",  # the namespaces and their bridge exist only here
                            "--out",
                            str(work),
                        ],
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,
                    )
                )
            codes = [p.wait(timeout) for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGKILL)
                    p.wait()
    outs = [(work / f"out{i}.txt").read_text() for i in range(len(procs))]
    if any(codes):
        raise RuntimeError(
            f"a worker failed: {codes}\n" + outs[codes.index(next(c for c in codes if c))][-3000:]
        )
    finals = [json.loads(o.strip().splitlines()[-1]) for o in outs]
    waits = []
    for path in sorted(work.glob("**/metrics-*.jsonl")):
        syncs = [r["wait_s"] for r in read_jsonl(path) if r["event"] == "sync"]
        if syncs:
            waits.append(sum(syncs))
    return decompose(finals, waits, cfg.steps)


def run_wanbench(w: WanBench, b: BenchConfig) -> dict[str, Any]:
    b = dataclasses.replace(b, workers=w.workers)
    configs = {
        "ddp": b.train_config(DDPConfig(), w.ddp_steps),
        "diloco_no_overlap": b.train_config(b.diloco_mode(tau=0), w.steps),
        "streaming_overlap": b.train_config(b.diloco_mode(), w.steps),
    }
    out: dict[str, Any] = {
        "link": f"REAL: tc tbf {w.rate_mbit} Mbit/s per worker link "
        "(both directions), no added delay; ZeroMQ over kernel TCP",
        "workers": w.workers,
        "H": b.inner_steps,
        "P": b.n_fragments,
        "tau": b.tau,
        "codec": b.codec,
        "repeats": w.repeats,
        "order": "interleaved, rotated by one per repeat",
    }
    runs: dict[str, list[dict[str, Any]]] = {v: [None] * w.repeats for v in w.variants}  # type: ignore[misc]
    with (
        tempfile.TemporaryDirectory(prefix="wanbench") as tmp,
        Testbed(
            NetnsConfig(sites=w.workers, rate_mbit=w.rate_mbit, net=w.net, queue_ms=100.0)
        ) as bed,
    ):
        for r, name in run_order(w.variants, w.repeats):
            cfg = dataclasses.replace(
                configs[name], eval_every=0, audit_every=0, sync_timeout=300.0
            )
            runs[name][r] = _run(bed, cfg, Path(tmp) / f"{name}-{r}", w.timeout)
            print(f"repeat {r} {name}: {json.dumps(runs[name][r])}", file=sys.stderr, flush=True)
    out.update(summarize(runs))
    out["raw"] = runs
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.diloco_wan",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--json", action="store_true")
    p.add_argument("--workers", type=int, default=3)
    p.add_argument("--rate-mbit", type=float, default=4.0)
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--ddp-steps", type=int, default=10)
    p.add_argument("--repeats", type=int, default=5, help="runs of each variant (interleaved)")
    p.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    p.add_argument("--tau", type=int, help="overlap of the streaming run (default: the bench's)")
    p.add_argument("--hidden", type=int)
    p.add_argument("--layers", type=int)
    p.add_argument("--inner-steps", type=int, help="H (default: the bench's)")
    args = p.parse_args(argv)
    w = WanBench(
        workers=args.workers,
        rate_mbit=args.rate_mbit,
        steps=args.steps,
        ddp_steps=args.ddp_steps,
        repeats=args.repeats,
        variants=tuple(args.variants),
    )
    over = {
        k: v
        for k, v in (
            ("tau", args.tau),
            ("hidden", args.hidden),
            ("layers", args.layers),
            ("inner_steps", args.inner_steps),
        )
        if v is not None
    }
    print(json.dumps(run_wanbench(w, dataclasses.replace(BenchConfig(), **over))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
