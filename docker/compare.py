"""DDP vs Streaming DiLoCo from two run directories: the last step of the compose demo.

Every ``lowband worker --out DIR`` appends its records to ``DIR/metrics-<id>.jsonl``; this reads
each worker's ``final`` record (bytes on the wire measured by the communicator, wall time,
tokens) and the ``eval`` records of the worker that evaluated, prints a table, writes the
eval-loss-vs-bytes plot and ends with one JSON line.

    python docker/compare.py --diloco /runs/diloco --ddp /runs/ddp --plot /runs/eval_vs_bytes.png
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from diloco.metrics import RunSummary, plot_runs, read_jsonl


class MissingRun(Exception):
    """A run directory has no finished worker."""


def load_run(directory: Path) -> dict[str, Any]:
    """Summary of one run: workers, final eval loss, bytes per worker, wall time, the curve.

    Every worker that wrote a metrics file is expected to finish: one that started and has no
    ``final`` record makes the run inconsistent (``missing`` says which)."""
    finals: list[dict[str, Any]] = []
    evals: list[dict[str, Any]] = []
    started: list[str] = []
    by_worker: dict[str, dict[str, Any]] = {}
    for path in sorted(directory.glob("metrics-*.jsonl")):
        records = read_jsonl(path)
        done = [r for r in records if r.get("event") == "final"]
        finals += done
        evals += [r for r in records if r.get("event") == "eval"]
        started.append(path.stem.removeprefix("metrics-").removeprefix("worker"))
        if done:
            by_worker[started[-1]] = done[-1]
    if not finals:
        raise MissingRun(f"no finished worker in {directory} (metrics-*.jsonl with a final record)")
    losses = [r["final_eval"] for r in finals if r.get("final_eval") is not None]
    wall = max(r["wall_s"] for r in finals)
    steps = max(r.get("steps", 0) for r in finals)
    run = RunSummary.from_finals(started, by_worker, steps=steps)
    return {
        "workers": len(finals),
        "steps": steps,
        "steps_per_s": steps / wall if wall > 0 and steps else None,
        # every worker of a run ends with the same parameters; a mismatch is a broken run
        **run.to_dict(),
        "final_eval": losses[0] if losses else None,
        "bytes_per_worker": sum(r["bytes_sent"] for r in finals) / len(finals),
        "peak_sync_bytes": max(r.get("peak_sync_bytes", 0) for r in finals),
        "wall_s": wall,
        "sync_s": sum(r.get("sync_s", 0.0) for r in finals) / len(finals),
        "tokens_per_s": sum(r.get("tokens", 0) for r in finals) / wall if wall > 0 else None,
        "evals": sorted(evals, key=lambda r: r["step"]),
    }


def compare(diloco: dict[str, Any], ddp: dict[str, Any]) -> dict[str, Any]:
    """The headline ratios: bytes saved and the loss paid for it."""
    out: dict[str, Any] = {"bytes_ratio": None, "loss_gap": None, "speedup": None}
    if diloco["bytes_per_worker"] > 0:
        out["bytes_ratio"] = ddp["bytes_per_worker"] / diloco["bytes_per_worker"]
    if diloco["final_eval"] is not None and ddp["final_eval"]:
        out["loss_gap"] = (diloco["final_eval"] - ddp["final_eval"]) / ddp["final_eval"]
    if diloco["wall_s"] > 0:
        out["speedup"] = ddp["wall_s"] / diloco["wall_s"]  # same steps: the steps/s ratio
    return out


def table(runs: dict[str, dict[str, Any]]) -> str:
    def fmt(v: Any, spec: str) -> str:
        return "-" if v is None else format(v, spec)

    lines = [
        f"{'run':<18} {'workers':>7} {'eval loss':>9} {'MiB/worker':>11} {'wall s':>8} "
        f"{'steps/s':>8} {'sync s':>8} {'tok/s':>9}"
    ]
    for name, r in runs.items():
        lines.append(
            f"{name:<18} {r['workers']:>7} {fmt(r['final_eval'], '.4f'):>9} "
            f"{r['bytes_per_worker'] / 2**20:>11.2f} {r['wall_s']:>8.1f} "
            f"{fmt(r['steps_per_s'], '.2f'):>8} "
            f"{r['sync_s']:>8.1f} {fmt(r['tokens_per_s'], '.0f'):>9}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--diloco", type=Path, required=True, help="the Streaming DiLoCo run directory")
    ap.add_argument("--ddp", type=Path, required=True, help="the DDP run directory")
    ap.add_argument("--plot", type=Path, help="write eval loss vs bytes (PNG) here")
    ap.add_argument("--json", type=Path, help="also write the final JSON line to this file")
    args = ap.parse_args(argv)
    try:
        runs = {"DDP": load_run(args.ddp), "Streaming DiLoCo": load_run(args.diloco)}
    except MissingRun as exc:
        print(f"compare: {exc}", file=sys.stderr)
        return 1
    print(table(runs))
    result = compare(runs["Streaming DiLoCo"], runs["DDP"])
    if result["bytes_ratio"] is not None:
        print(
            f"Streaming DiLoCo sent {result['bytes_ratio']:.0f}x fewer bytes per worker"
            + (
                f", eval loss {100 * result['loss_gap']:+.2f}% vs DDP"
                if result["loss_gap"] is not None
                else ""
            )
        )
    if args.plot is not None:
        plot_runs(
            {k: v["evals"] for k, v in runs.items()},
            args.plot,
            title="DDP vs Streaming DiLoCo on shaped links",
        )
        result["plot"] = str(args.plot)
    summary = {k: {kk: vv for kk, vv in v.items() if kk != "evals"} for k, v in runs.items()}
    line = json.dumps({"runs": summary, **result})
    if args.json is not None:
        args.json.write_text(line + "\n")
    print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
