"""Benchmark of a bit-nested MoE in the edge runtime: one device, one device with the backbone
streamed through the sliding window, and two devices (``lowband edge run --devices 2``, experts
placed whole on the devices).

``python -m benchmarks.moe_serve --json`` prints one JSON object as its last line. For every
case: ``<case>.tokens_per_s`` (greedy decode, the engine's own per-token latency),
``<case>.peak_rss_mb`` (VmHWM of each process, summed over the cluster's processes),
``<case>.model_rss_mb`` (the same above the RSS the process had before loading the model: what
the serving configuration costs), and the expert store's ``hit_rate``, ``mean_bits``,
``bytes_read_mb``, ``stall_s``. ``tp2.wire_bytes_per_token`` is what the master moved per token,
next to ``tp2.dense_tp_wire_bytes_per_token_formula``: the bytes a dense model of the same shape
would move with the same two all-reduces per layer, COMPUTED from the shape (hidden·4 for the
token + 2 all-reduces × layers × 2 directions × hidden·4), not measured. Equal means placing
experts cost no extra message.

Baselines get their best configuration: the int8 LRU reads a plain int8 conversion (one code
byte per weight, no bit-planes to reassemble on a miss, as a conventional int8 runtime would),
once with the runtime's default prefetch (2 experts) and once without; ``best_lru`` names the
faster by median and ``hebf_vs_best_lru`` is the headline. Every case runs ``--repeats`` times,
the cases in an order rotated by one per round; medians with min/max are reported.

The model is a random-init Mixtral (speed and memory do not depend on what the weights say;
quality per width is ``benchmarks.moe``), converted once and cached under ``--cache-dir``. Each
case runs in its own process(es) for a clean peak RSS. Reads are not paced (page-cache speed);
``benchmarks.moe`` models slow storage.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from lowband.proc import free_port

PROMPT = "ROMEO: But soft, what light through yonder window breaks? It is the east, and"


@dataclass(frozen=True, kw_only=True)
class Shape:
    hidden: int = 512
    intermediate: int = 1024
    layers: int = 8
    experts: int = 8
    heads: int = 8
    kv_heads: int = 4


TINY = Shape(hidden=64, intermediate=128, layers=2, experts=4, heads=4, kv_heads=2)


def prepare(cache_dir: Path, shape: Shape) -> tuple[Path, Path]:
    """(nested, plain int8) directories for ``shape`` (built once: random init, then
    ``quantize --nested`` with the bit-plane layout and with the plain int8 byte layout)."""
    import torch

    from edge.moe.checkpoint import quantize_nested_checkpoint
    from edge.moe.quant import NestedQuantConfig
    from lowband.models.config import ModelConfig
    from lowband.models.llama import LlamaForCausalLM, init_weights
    from lowband.models.tokenizer import ByteTokenizer
    from lowband.models.weights import save_pretrained

    tag = f"h{shape.hidden}_i{shape.intermediate}_l{shape.layers}_e{shape.experts}"
    out, int8 = cache_dir / tag / "nested", cache_dir / tag / "int8"
    if (out / "nested.json").exists() and (int8 / "nested.json").exists():
        return out, int8
    cfg = ModelConfig(
        model_type="mixtral",
        vocab_size=256,
        hidden_size=shape.hidden,
        intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        num_local_experts=shape.experts,
        num_experts_per_tok=2,
        max_position_embeddings=1024,
    )
    model = LlamaForCausalLM(cfg)
    init_weights(model, std=0.05, seed=1)
    with torch.no_grad():  # sharp routers: routing moves between experts as in a trained model
        for layer in model.model.layers:
            layer.block_sparse_moe.gate.weight.mul_(20)
    src = save_pretrained(model, cache_dir / tag / "src")
    ByteTokenizer().save(src)
    return (
        quantize_nested_checkpoint(src, out, NestedQuantConfig(group_size=64)),
        quantize_nested_checkpoint(src, int8, NestedQuantConfig(group_size=64, layout="bytes")),
    )


def _hwm_kb(pid: int | str = "self") -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    return 0


def _rss_kb(pid: int | str = "self") -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def _store(rep: dict) -> dict:
    return {
        "hit_rate": round(rep["hit_rate"], 4),
        "mean_bits": rep["mean_bits_per_call"],
        "bytes_read_mb": round(rep["bytes_read"] / 1e6, 3),
        "stall_s": rep["stall_s"],
    }


def run_local(
    nested: Path,
    budget_mb: float,
    policy: str,
    window: int | None,
    tokens: int,
    threads: int,
    prefetch: int = 2,
) -> dict:
    """Inside a subprocess: one device, the engine, greedy decode."""
    import torch

    from edge.engine import Engine, LocalRunner
    from edge.moe.serve import ExpertServeConfig, load_nested_shard
    from edge.sampling import SamplingParams
    from edge.shardio import WindowConfig
    from lowband.models.tokenizer import ByteTokenizer

    torch.set_num_threads(threads)
    torch.ones(64, 64) @ torch.ones(64, 64)  # runtime pools before the baseline
    base = _rss_kb()
    cfg = ExpertServeConfig(budget_mb=budget_mb, policy=policy, prefetch=prefetch)
    shard = load_nested_shard(
        nested, experts=cfg, window=WindowConfig(window=window) if window else None
    )
    try:
        eng = Engine(LocalRunner(shard.model), ByteTokenizer(), model_name="bench")
        eng.complete(PROMPT, SamplingParams(max_tokens=4))  # warm the kernels
        eng.metrics.token_s.clear()
        _, _, n = eng.complete(PROMPT + " ", SamplingParams(max_tokens=tokens))
        m = eng.metrics.snapshot()
        rep = shard.store_report()
    finally:
        shard.close()
    peak = _hwm_kb()
    return {
        "tokens": n,
        "tokens_per_s": round(m["decode_tokens_per_s"], 2),
        "peak_rss_mb": round(peak / 1024, 1),
        "model_rss_mb": round((peak - base) / 1024, 1),
        **_store(rep),
    }


def _http(port: int, path: str, body: dict | None = None) -> dict:
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}",
        data=None if body is None else json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.loads(r.read())


def run_cluster(nested: Path, devices: int, budget_mb: float, policy: str, tokens: int) -> dict:
    """``lowband edge run --devices N`` over 127.0.0.1, driven through its HTTP API."""
    import psutil

    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "cli",
        "edge",
        "run",
        str(nested),
        "--devices",
        str(devices),
        "--port",
        str(port),
        "--expert-budget-mb",
        str(budget_mb),
        "--expert-policy",
        policy,
        "--threads",
        "1",
    ]
    proc = subprocess.Popen(cmd, start_new_session=True, stdout=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 300
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"edge run exited with {proc.returncode}")
            try:
                _http(port, "/health")
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.3)
        _http(port, "/v1/completions", {"prompt": PROMPT, "max_tokens": 4, "temperature": 0})
        before = _http(port, "/metrics")
        out = _http(
            port,
            "/v1/completions",
            {"prompt": PROMPT + " ", "max_tokens": tokens, "temperature": 0},
        )
        m = _http(port, "/metrics")
        procs = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
        peak = sum(_hwm_kb(p.pid) for p in procs)
        n_new = m["completion_tokens_total"] - before["completion_tokens_total"]
        return {
            "tokens": out["usage"]["completion_tokens"],
            "devices": devices,
            "tokens_per_s": round(m["decode_tokens_per_s"], 2),
            "peak_rss_mb": round(peak / 1024, 1),
            "processes": len(procs),
            "wire_bytes_per_token": m["wire_bytes_per_token"],
            "new_tokens": n_new,
            **_store(m["expert_store"]),
        }
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _sub(args: list[str]) -> dict:
    cmd = [sys.executable, "-m", "benchmarks.moe_serve", *args]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    if p.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{p.stderr[-3000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def _spread(xs: list[float]) -> dict[str, float]:
    return {"median": round(statistics.median(xs), 3), "min": min(xs), "max": max(xs)}


def main(
    cache_dir: Path, shape: Shape, budget_frac: float, tokens: int, threads: int, repeats: int = 5
) -> dict:
    from edge.moe.serve import manifest_sizes

    nested, int8 = prepare(cache_dir, shape)
    int8_mb = sum(s[8] for s in manifest_sizes(nested).values()) / 1e6
    budget = round(budget_frac * int8_mb, 6)
    out: dict[str, object] = {
        "shape": shape.__dict__,
        "int8_experts_mb": round(int8_mb, 3),
        "budget_mb": budget,
        "budget_frac": budget_frac,
        "tokens": tokens,
        "repeats": repeats,
        "reads": "unpaced (page-cache speed)",
    }
    common = ["--tokens", str(tokens), "--threads", str(threads), "--budget-mb", str(budget)]
    local = {
        "one_device_lru8": ["--nested", str(int8), "--policy", "lru", "--prefetch", "2"],
        "one_device_lru8_noprefetch": ["--nested", str(int8), "--policy", "lru", "--prefetch", "0"],
        "one_device_hebf": ["--nested", str(nested), "--policy", "hebf"],
        "one_device_hebf_window1": ["--nested", str(nested), "--policy", "hebf", "--window", "1"],
    }
    names = [*local, "tp2"]
    runs: dict[str, list[dict]] = {n: [] for n in names}
    for r in range(repeats):  # each case once per round, the order rotated by one per round
        for name in names[r % len(names) :] + names[: r % len(names)]:
            runs[name].append(
                run_cluster(nested, 2, budget, "hebf", tokens)
                if name == "tp2"
                else _sub(["--case", "local", *common, *local[name]])
            )
    for name, rs in runs.items():
        key = "tp2" if name == "tp2" else name
        for k in rs[0]:
            vals = [x[k] for x in rs]
            if k == "tokens_per_s":
                out[f"{key}.tokens_per_s"] = _spread(vals)
            elif all(isinstance(v, (int, float)) for v in vals) and len(set(vals)) > 1:
                out[f"{key}.{k}"] = round(statistics.median(vals), 4)
            else:
                out[f"{key}.{k}"] = vals[0]
    med = {n: out[f"{n}.tokens_per_s"]["median"] for n in names}  # type: ignore[index]
    best = max(("one_device_lru8", "one_device_lru8_noprefetch"), key=lambda n: med[n])
    out["best_lru"] = best
    per_round = [
        h["tokens_per_s"] / b["tokens_per_s"] for h, b in zip(runs["one_device_hebf"], runs[best])
    ]
    out["hebf_vs_best_lru"] = _spread([round(x, 3) for x in per_round])
    H, L = shape.hidden, shape.layers
    out["tp2.dense_tp_wire_bytes_per_token_formula"] = H * 4 + 2 * L * 2 * H * 4  # star, 1 worker
    out["window_saving_mb"] = round(
        out["one_device_hebf.model_rss_mb"] - out["one_device_hebf_window1.model_rss_mb"], 1
    )
    return out


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.moe_serve",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--json", action="store_true", help="print only the JSON line")
    p.add_argument("--tiny", action="store_true", help="a 2-layer toy (smoke test)")
    p.add_argument("--cache-dir", default="/tmp/lowband_moe_serve_bench")
    p.add_argument("--budget-frac", type=float, default=0.4, help="expert budget / int8 experts")
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=1, help="torch threads per device")
    p.add_argument("--repeats", type=int, default=5, help="runs of every case (interleaved)")
    p.add_argument("--prefetch", type=int, default=2, help=argparse.SUPPRESS)
    p.add_argument("--case", choices=("local",), help=argparse.SUPPRESS)
    p.add_argument("--nested", help=argparse.SUPPRESS)
    p.add_argument("--budget-mb", type=float, help=argparse.SUPPRESS)
    p.add_argument("--policy", default="hebf", help=argparse.SUPPRESS)
    p.add_argument("--window", type=int, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def cli(argv: Sequence[str] | None = None) -> int:
    a = _parse(argv)
    if a.case == "local":
        res = run_local(
            Path(a.nested), a.budget_mb, a.policy, a.window, a.tokens, a.threads, a.prefetch
        )
    else:
        res = main(
            Path(a.cache_dir),
            TINY if a.tiny else Shape(),
            a.budget_frac,
            a.tokens,
            a.threads,
            a.repeats,
        )
        if not a.json:
            for k, v in res.items():
                print(f"{k:45s} {v}")
    print(json.dumps(res))
    return 0


if __name__ == "__main__":
    sys.exit(cli())
