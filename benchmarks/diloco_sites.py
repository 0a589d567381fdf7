"""Sites × ranks on this machine: bytes per site rank, outer-step time, DiLoCo overhead.

``python -m benchmarks.diloco_sites --json`` runs 2 sites × N ranks (FSDP2 or DDP over Gloo
inside a site, the ZeroMQ transport over TCP between sites, one coordinator per shard group) and
2 sites × 1 rank, alternating, ``--repeats`` times each. Per configuration it reports (median
[min, max] over the repeats):

* ``sync_bytes_per_rank``: bytes one site rank sent for its outer-sync all-reduces (transport
  stats, from the ``sync`` records of the metrics log);
* ``outer_step_s``: wall time of one outer step as the worker sees it (APPLY: wait for the
  all-reduce + outer Nesterov + merge; ``wait_s`` of the ``sync`` records);
* ``tokens_per_s_site``: tokens the whole site trains per second of wall time, and
  ``overhead``: 1 − (DiLoCo tokens/s) / (tokens/s of the same inner loop without the syncs, i.e.
  tokens / compute_s): the same measure as the GPU issue.

All processes share this machine's cores: the numbers compare the configurations with each
other, not with real multi-GPU sites. The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO

from lowband.proc import free_port
from transport.coordinator import Coordinator, CoordinatorConfig


def start_site(
    site: int,
    ranks: int,
    engine: str,
    coordinators: str,
    out: Path,
    run_args: Sequence[str],
    log: Callable[[int], IO[str] | int] = lambda rank: subprocess.DEVNULL,
) -> list[subprocess.Popen]:
    """Start the ``ranks`` ranks of site ``site`` (``lowband worker --site ENGINE`` over Gloo on
    127.0.0.1, rank r as ``LOCAL_RANK`` r), each in its own session (kill the group when done),
    joining the coordinators ``coordinators`` (comma-separated) with bytes on TCP; rank r's
    output (stdout and stderr) goes to ``log(r)``."""
    port = free_port()
    started = []
    for r in range(ranks):
        env = dict(
            os.environ,
            RANK=str(r),
            LOCAL_RANK=str(r),
            WORLD_SIZE=str(ranks),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
        )
        args = [sys.executable, "-m", "cli", "worker", "--site", engine, "--id", f"s{site}"]
        args += ["--coordinator", coordinators, "--threads", "1", "--bind-host", "127.0.0.1"]
        args += ["--same-host", "off", "--out", str(out), *run_args]  # off: bytes on TCP
        started.append(
            subprocess.Popen(
                args, stdout=log(r), stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
        )
    return started


def run_once(ranks: int, engine: str, run_args: list[str], tmp: Path) -> dict:
    coords = [
        Coordinator(CoordinatorConfig(bind="tcp://127.0.0.1:0")).start() for _ in range(ranks)
    ]
    addrs = ",".join(c.address for c in coords)
    procs = []
    try:
        for site in range(2):
            procs += start_site(
                site, ranks, engine, addrs, tmp / f"site{site}", ["--workers", "2", *run_args]
            )
        for p in procs:
            if p.wait(timeout=600) != 0:
                raise RuntimeError(f"a site rank failed: {p.args}")
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        for c in coords:
            c.stop()
    per_rank, waits, tok, wall, comp = [], [], 0, [], []
    for site in range(2):
        site_tok = 0
        for r in range(ranks):
            recs = [
                json.loads(x)
                for x in (tmp / f"site{site}" / f"metrics-s{site}-r{r}.jsonl")
                .read_text()
                .splitlines()
            ]
            syncs = [x for x in recs if x["event"] == "sync"]
            final = [x for x in recs if x["event"] == "final"][-1]
            per_rank.append(sum(x["bytes_sent"] for x in syncs))
            waits += [x["wait_s"] for x in syncs]
            site_tok += final["tokens"]
            wall.append(final["wall_s"])
            comp.append(final["compute_s"])
        tok = max(tok, site_tok)
    wall_s, compute_s = max(wall), max(comp)
    return {
        "sync_bytes_per_rank": statistics.median(per_rank),
        "outer_step_s": statistics.median(waits),
        "tokens_per_s_site": tok / wall_s,
        "overhead": 1 - compute_s / wall_s,
    }


def _summ(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=2, help="N: ranks per site (default 2)")
    ap.add_argument("--engine", default="fsdp2", choices=["fsdp2", "ddp"])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--json", action="store_true", help="only the JSON line")
    args = ap.parse_args(argv)
    run_args = [
        "--preset",
        args.preset,
        "--steps",
        str(args.steps),
        "-H",
        "20",
        "-P",
        "2",
        "--tau",
        "2",
        "--eval-every",
        "0",
        "--audit-every",
        "0",
    ]
    configs = [1, args.ranks]
    samples: dict[int, list[dict]] = {n: [] for n in configs}
    t0 = time.time()
    for i in range(args.repeats):
        for n in configs if i % 2 == 0 else configs[::-1]:  # alternate the order
            with tempfile.TemporaryDirectory() as d:
                samples[n].append(run_once(n, args.engine, run_args, Path(d)))
            if not args.json:
                print(f"repeat {i} 2x{n}: {samples[n][-1]}", file=sys.stderr)
    out = {
        "bench": "diloco_sites",
        "engine": args.engine,
        "backend": "gloo",
        "preset": args.preset,
        "steps": args.steps,
        "H": 20,
        "P": 2,
        "tau": 2,
        "repeats": args.repeats,
        "wall_s": round(time.time() - t0, 1),
        "configs": {},
    }
    for n in configs:
        out["configs"][f"2x{n}"] = {k: _summ([s[k] for s in samples[n]]) for k in samples[n][0]}
    single = out["configs"]["2x1"]["sync_bytes_per_rank"]["median"]
    out["bytes_ratio"] = out["configs"][f"2x{args.ranks}"]["sync_bytes_per_rank"]["median"] / single
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
