"""Benchmark: Flower rounds of FedAvg vs DiLoCo (Nesterov), and the uplink codecs.

    python -m benchmarks.flower [--rounds 8] [--inner-steps 20] [--nodes 2] [--preset tiny]
    python -m benchmarks.flower --deploy     # also one real SuperLink + SuperNodes run

Every variant runs the real ClientApp and :class:`DiLoCoStrategy` code for the same number of
inner steps per node through an in-process Grid, so the numbers are the algorithm's (loss, bytes)
without Flower's process start-up and 3 s polling; ``--deploy`` adds one real deployment of the
first DiLoCo variant and reports its per-round wall time. ``fedavg`` is DiLoCo with outer SGD
lr 1 and no momentum: θ_g ← θ_g − mean(θ_g − θ_m) = mean(θ_m), i.e. FedAvg with equal weights.
Streaming variants sync one of P fragments per round (H/P steps), so they run P× the rounds
for the same steps and bytes, at 1/P of the peak bytes per round. Prints a table, then one JSON
line.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

VARIANTS: dict[str, dict[str, Any]] = {
    "fedavg-fp32": {"outer-lr": 1.0, "outer-momentum": 0.0, "codec": "fp32"},
    "diloco-fp32": {"codec": "fp32"},
    "diloco-int8": {"codec": "int8"},
    "diloco-nf4": {"codec": "nf4"},
    "diloco-nf4-ef": {"codec": "nf4", "error-feedback": True},
    "streaming-p2-int8": {"codec": "int8", "fragments": 2},
    "streaming-p4-int8": {"codec": "int8", "fragments": 4},
}


def run_variant(name: str, args: argparse.Namespace) -> dict[str, Any]:
    from diloco.flower.client import handle
    from diloco.flower.config import from_run_config
    from diloco.flower.inprocess import InProcessGrid
    from diloco.flower.server import run_server
    from diloco.metrics import read_jsonl

    v = VARIANTS[name]
    p = int(v.get("fragments", 1))
    with tempfile.TemporaryDirectory() as out:
        # Same H for every variant (each fragment syncs every H steps), P× the rounds of H/P
        # steps: every variant trains rounds·H steps per node and sends the same total bytes.
        rc = {
            "preset": args.preset,
            "inner-steps": args.inner_steps,
            "num-server-rounds": args.rounds * p,
            "min-available-nodes": args.nodes,
            "warmup-steps": args.warmup,
            "out-dir": out,
            **v,
        }
        cfg = from_run_config(rc)
        grid = InProcessGrid(handle, rc, {100 + i: {"partition-id": i} for i in range(args.nodes)})
        t0 = time.perf_counter()
        s = run_server(grid, cfg)
        wall = time.perf_counter() - t0
        rounds = [r for r in read_jsonl(Path(out) / "metrics.jsonl") if r["event"] == "round"]
    return {
        "variant": name,
        "rounds": cfg.federation.rounds,
        "steps": cfg.train.steps,
        "final_eval": s["final_eval"],
        "initial_eval": s["initial_eval"],
        "bytes_up": s["bytes_up"],
        "bytes_down": s["bytes_down"],
        "peak_round_up": max(r["bytes_up"] for r in rounds),
        "uplink_reduction": s["uplink_reduction"],
        "wall_s": round(wall, 2),
    }


def run_deployment(args: argparse.Namespace) -> dict[str, Any]:
    from diloco.flower.federation import LocalRunConfig, run_local
    from diloco.metrics import read_jsonl

    with tempfile.TemporaryDirectory() as out:
        cfg = LocalRunConfig(
            supernodes=args.nodes,
            out_dir=out,
            timeout=3600.0,
            run_config={
                "preset": args.preset,
                "inner-steps": args.inner_steps,
                "num-server-rounds": args.rounds,
                "warmup-steps": args.warmup,
                "codec": "int8",
                "threads": args.threads,
            },
        )
        t0 = time.perf_counter()
        s = run_local(cfg)
        wall = time.perf_counter() - t0
        times = [
            r["wall_s"] for r in read_jsonl(Path(out) / "metrics.jsonl") if r["event"] == "round"
        ]
    per_round = [b - a for a, b in zip([0.0] + times[:-1], times)]
    return {
        "variant": "deployment-diloco-int8",
        "rounds": args.rounds,
        "final_eval": s["final_eval"],
        "bytes_up": s["bytes_up"],
        "total_wall_s": round(wall, 1),
        "round_wall_s": [round(x, 1) for x in per_round],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=8, help="rounds of the P = 1 variants")
    ap.add_argument(
        "--inner-steps", type=int, default=20, help="H: inner steps between two syncs of a fragment"
    )
    ap.add_argument("--nodes", type=int, default=2)
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--warmup", type=int, default=10, help="inner-lr warmup steps")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (this process)")
    ap.add_argument(
        "--variants",
        default=",".join(VARIANTS),
        help=f"comma-separated subset of {', '.join(VARIANTS)}",
    )
    ap.add_argument("--deploy", action="store_true", help="also a real local deployment")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    names = [n for n in args.variants.split(",") if n]
    unknown = set(names) - set(VARIANTS)
    if unknown:
        ap.error(f"unknown variants {sorted(unknown)}")
    results = [run_variant(n, args) for n in names]
    # Two uplink ratios, labelled: ``uplink_reduction`` divides a COMPUTED fp32 size (4 bytes per
    # element sent) by the bytes measured; ``uplink_reduction_measured`` divides the bytes the
    # measured diloco-fp32 run sent by this variant's (same steps, same model), when both ran.
    fp32 = next((r["bytes_up"] for r in results if r["variant"] == "diloco-fp32"), None)
    for r in results:
        r["uplink_reduction_is"] = "computed fp32 bytes / measured bytes"
        r["uplink_reduction_measured"] = (
            round(fp32 / r["bytes_up"], 3) if fp32 and r["bytes_up"] else None
        )
    print(
        f"{'variant':<20} {'rounds':>6} {'eval':>7} {'up MiB':>8} {'peak KiB':>9} "
        f"{'down MiB':>9} {'x fp32':>7} {'x meas.':>7} {'wall s':>7}"
    )
    for r in results:
        print(
            f"{r['variant']:<20} {r['rounds']:>6} {r['final_eval']:>7.4f} "
            f"{r['bytes_up'] / 2**20:>8.3f} {r['peak_round_up'] / 1024:>9.1f} "
            f"{r['bytes_down'] / 2**20:>9.3f} {r['uplink_reduction'] or 0:>7.2f} "
            f"{r['uplink_reduction_measured'] or 0:>7.2f} {r['wall_s']:>7.1f}"
        )
    out: dict[str, Any] = {
        "config": {
            "rounds": args.rounds,
            "inner_steps_per_round": args.inner_steps,
            "nodes": args.nodes,
            "preset": args.preset,
        },
        "results": results,
    }
    if args.deploy:
        out["deployment"] = run_deployment(args)
        print(f"deployment: {out['deployment']}")
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
