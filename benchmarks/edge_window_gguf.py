"""The sliding window straight on a GGUF file: ``python -m benchmarks.edge_window_gguf --model
FILE.gguf --json`` (last line of output is JSON).

Arms, alternating round by round, each in its own process pinned to one core with one torch
thread (the window's loader thread on the other core):

* ``resident``: the file loaded into memory as ``edge serve FILE.gguf`` does without a window
  (copies; fused projections; the compiled step);
* ``eager`` (``--eager-arm``): the file in memory, unfused and eager like a streaming window's
  model: what the window's re-mapping costs, apart from leaving the compiled step;
* ``W=<n>``: ``--window n``: the layers' stored tensors mapped from the file, n blocks
  resident (n = the layer count: everything mapped, compiled; fewer: eager, streaming).

Per run: greedy decode ms/token (median of the timed tokens, the page cache warm), the process's
RSS after decoding and its peak (VmHWM, includes loading), the Rss of the file's mapping, the
largest block and the always-resident (fixed) bytes the window counts. ``--paced-mbps``: the
smallest window's block reads also paced to that storage rate (``edge.moe.store.StorageDevice``,
as ``benchmarks.edge`` does), what a device that cannot keep the file in its page cache pays.
Figures: per arm, the median over rounds of each run's median, with min and max.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch


def _status_mb(key: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) / 1024.0
    return float("nan")


def _decode(runner, prompt: list[int], tokens: int, warmup: int) -> tuple[list[float], list[int]]:
    logits = runner.forward(prompt, 0)
    pos, tok, out, times = len(prompt), int(torch.argmax(logits)), [], []
    for i in range(warmup + tokens):
        out.append(tok)
        t = time.perf_counter()
        logits = runner.forward([tok], pos, 1)
        if i >= warmup:
            times.append(time.perf_counter() - t)
        pos += 1
        tok = int(torch.argmax(logits))
    return times, out


def role(a) -> dict:
    """One arm in this process."""
    from edge import fastpath
    from edge.engine import LocalRunner
    from edge.formats.gguf_window import fixed_bytes
    from edge.launch import DeviceConfig
    from edge.shardio import WindowConfig, load_shard

    cores = os.cpu_count() or 1
    DeviceConfig(threads=1, cores=(0,)).apply()
    win = None
    if a.window > 0:
        win = WindowConfig(window=a.window, loader_cores=(1 % cores,))
    eager = a.window < 0  # the eager arm: in memory, as a streaming window's model runs
    shard = load_shard(a.model, window=win, fuse=not eager, fast=not eager)
    runner = LocalRunner(shard.model)
    prompt = list(range(1, a.prompt_len + 1))
    times, toks = _decode(runner, prompt, a.tokens, a.warmup)
    res: dict = {
        "ms_per_token": 1e3 * statistics.median(times),
        "tokens": toks,
        "rss_mb": _status_mb("VmRSS"),
        "peak_rss_mb": _status_mb("VmHWM"),
        "compiled": fastpath.active(shard.model),
    }
    sched = shard.scheduler
    if sched is not None:
        mapping = sched.files[0].file
        sched.settle()
        res["mapped_mb"] = (mapping.resident_bytes() or 0) / 2**20
        res["blocks"] = sched.n
        res["window"] = sched.window
        res["block_mb_max"] = max(f.size for f in sched.files) / 2**20
        res["blocks_mb"] = sum(f.size for f in sched.files) / 2**20
        res["fixed_mb"] = fixed_bytes(shard.model, mapping, range(sched.n)) / 2**20
        if a.paced_mbps > 0:
            from edge.moe.store import StorageDevice

            dev = StorageDevice(a.paced_mbps * 1e6)
            for f in sched.files:
                plain = f.populate
                f.populate = lambda f=f, plain=plain: dev.read(plain, f.size)
            runner.reset()
            paced, _ = _decode(runner, prompt, a.paced_tokens, 1)
            res["paced_ms_per_token"] = 1e3 * statistics.median(paced)
    shard.close()
    return res


def _run(a, window: int, paced: float) -> dict:
    args = [sys.executable, "-m", "benchmarks.edge_window_gguf", "--role", "--model", a.model]
    args += ["--window", str(window), "--tokens", str(a.tokens), "--warmup", str(a.warmup)]
    args += ["--prompt-len", str(a.prompt_len), "--paced-mbps", str(paced)]
    args += ["--paced-tokens", str(a.paced_tokens)]
    out = subprocess.run(args, capture_output=True, text=True, timeout=a.timeout)
    if out.returncode != 0:
        raise RuntimeError(f"window {window} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _summary(runs: list[dict], key: str) -> dict:
    """Median, min and max over rounds, unrounded (a tiny model's mapped MB are fractions)."""
    vals = [r[key] for r in runs if key in r]
    return {"median": statistics.median(vals), "min": min(vals), "max": max(vals)}


def bench(a) -> dict:
    windows = [0] + ([-1] if a.eager_arm else []) + [int(w) for w in a.windows.split(",") if w]
    smallest = min((w for w in windows if w > 0), default=0)
    runs: dict[int, list[dict]] = {w: [] for w in windows}
    for r in range(a.repeats):
        for w in windows if r % 2 == 0 else reversed(windows):
            paced = a.paced_mbps if w == smallest and r < a.paced_rounds else 0.0
            runs[w].append(_run(a, w, paced))
    ref = runs[0][0]["tokens"]
    arms = {}
    for w, rs in runs.items():
        name = {0: "resident", -1: "eager"}.get(w, f"W={w}")
        arm = {k: _summary(rs, k) for k in ("ms_per_token", "rss_mb", "peak_rss_mb")}
        for k in ("mapped_mb", "paced_ms_per_token"):
            if any(k in x for x in rs):
                arm[k] = _summary(rs, k)
        first = rs[0]
        for k in ("blocks", "window", "block_mb_max", "blocks_mb", "fixed_mb", "compiled"):
            if k in first:
                arm[k] = round(first[k], 2) if isinstance(first[k], float) else first[k]
        arm["same_tokens_as_resident"] = all(x["tokens"] == ref for x in rs)
        arms[name] = arm
    return {
        "model": Path(a.model).name,
        "file_mb": round(os.path.getsize(a.model) / 2**20, 1),
        "repeats": a.repeats,
        "tokens": a.tokens,
        "prompt_len": a.prompt_len,
        "paced_mbps": a.paced_mbps,
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "arms": arms,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.edge_window_gguf", description=__doc__.split("\n")[0]
    )
    p.add_argument("--model", required=True, help="a GGUF file")
    p.add_argument("--windows", default="18,6,2,1", help="W of each window arm (comma list)")
    p.add_argument("--repeats", type=int, default=5, help="rounds, arms alternating")
    p.add_argument("--tokens", type=int, default=24, help="timed decode tokens per run")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--eager-arm", action="store_true", help="also the file in memory, eager")
    p.add_argument("--paced-mbps", type=float, default=0.0, help="storage MB/s (0: not paced)")
    p.add_argument("--paced-tokens", type=int, default=3)
    p.add_argument("--paced-rounds", type=int, default=1, help="rounds with the paced figure")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per child process")
    p.add_argument("--json", action="store_true", help="print only the JSON result line")
    p.add_argument("--role", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--window", type=int, default=0, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.role:
        print(json.dumps(role(a)))
        return 0
    res = bench(a)
    if not a.json:
        for name, arm in res["arms"].items():
            print(name, json.dumps(arm), file=sys.stderr)
    print(json.dumps(res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
