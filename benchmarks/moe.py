"""Benchmark of bit-nested MoE serving: quality per width, HEBF vs an int8 LRU cache.

``python -m benchmarks.moe --json`` prints one JSON object as its last line:

* quality, for every width b in (8, 4, 3, 2): ``nested.<b>.rel_err`` / ``independent.<b>.rel_err``
  (relative Frobenius error over all expert weights: the b-bit slice of the nested int8 codes,
  and a natively quantized b-bit model with the same group size and float16 parameters) and
  ``nested.<b>.ppl`` / ``independent.<b>.ppl`` (held-out byte perplexity with every expert at b);
* serving, decoding held-out text one token at a time (teacher-forced, so the perplexity of
  exactly the run that was timed is reported too) with the expert budget at ``--budget-frac``
  of the int8 experts: ``hebf.*``, ``lru_int8.*``, ``int8_resident.*`` (every expert resident
  at int8), ``throughput_ratio`` (hebf / the best int8 LRU: ``best_lru`` names the faster of
  ``lru_int8`` and ``lru_int8_prefetch`` by median tokens/s, both reading plain int8 codes, so
  the baseline gets its best configuration) and ``memory_ratio`` (hebf /
  int8_resident peak memory of the model: peak RSS above the process's RSS before the model
  was loaded; ``memory_ratio_abs`` uses whole-process peak RSS, which includes ~200-250 MB of
  Python + torch that no serving policy can remove).

Storage. Each read costs at least bytes / ``--read-mb-per-s`` (``StorageDevice``): this build
machine's page cache would otherwise serve "flash" reads at memory speed. The default, 100 MB/s,
is microSD-class storage (a Raspberry Pi). ``sweep_io.<MB/s>.*`` repeats HEBF and the int8 LRU
at other speeds (``0`` = unpaced: page-cache speed) and ``sweep_budget.<fraction>.*`` at other
budgets, so the dependence on the device and the budget is visible. The unpaced ratio is always
measured and reported beside the paced one (``throughput_ratio_unpaced``): on this machine's page
cache the two policies are close, and the paced gain is a property of slow storage.

Every serving configuration runs in its own subprocess (clean peak RSS), alternating the order
over ``--repeats`` rounds; medians are reported, with every run's tokens/s and the decoding
thread's CPU seconds (``decode_cpu_s``: compute, without waiting for reads or for the CPU on a
busy machine). The trained model and its conversions are cached under ``--cache-dir`` (trained
from scratch if absent) on ``--text``: the Shakespeare sample packaged in ``lowband/data/`` unless
another corpus is passed; ``train_text`` in the result says which.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import math
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Sequence

import torch

from edge.moe.checkpoint import load_dense, quantize_nested_checkpoint
from edge.moe.planes import VERSION
from edge.moe.quant import WIDTHS, NestedQuantConfig, quantize_independent
from edge.moe.train import (
    TRAIN_LOG,
    MoETrainConfig,
    bench_preset,
    heldout_ppl,
    load_splits,
    tiny_preset,
    train,
)
from lowband import SAMPLE_TEXT

logger = logging.getLogger(__name__)

POLICIES = ("int8_resident", "lru_int8", "hebf", "lru_int8_prefetch")
BASELINES = ("lru_int8", "lru_int8_prefetch")  # the headline is HEBF against the faster one


@dataclass(frozen=True, kw_only=True)
class BenchConfig:
    cache_dir: Path
    tiny: bool = False
    text: Path = SAMPLE_TEXT  # the corpus the MoE is trained and evaluated on
    budget_frac: float = 0.4  # expert budget / bytes of every expert at int8
    read_mb_per_s: float = 100.0  # B_io of the modelled device (0 = unpaced)
    sweep_mb_per_s: tuple[float, ...] = (0.0, 1000.0, 300.0)  # 0 (unpaced) is always run
    sweep_budget_frac: tuple[float, ...] = (0.3, 0.5)
    tokens: int = 256  # timed decode steps per run
    warmup: int = 48  # untimed decode steps first (hotness and caches settle)
    repeats: int = 3
    eval_tokens: int = 16384  # held-out tokens per quality perplexity
    group_size: int = 64
    threads: int = 1
    train_steps: int | None = None  # the training preset's step count unless set

    def __post_init__(self) -> None:
        if not 0 < self.budget_frac <= 1:
            raise ValueError(f"budget_frac must be in (0, 1], got {self.budget_frac}")
        if self.tokens < 1 or self.warmup < 0 or self.repeats < 1:
            raise ValueError("tokens >= 1, warmup >= 0, repeats >= 1")
        if self.train_steps is not None and self.train_steps < 1:
            raise ValueError(f"train_steps must be >= 1, got {self.train_steps}")


def tiny_bench(cache_dir: Path) -> BenchConfig:
    """Seconds-scale run for the test-suite: tiny model, few tokens, no sweep."""
    return BenchConfig(
        cache_dir=cache_dir,
        tiny=True,
        tokens=16,
        warmup=4,
        repeats=1,
        eval_tokens=1024,
        group_size=32,
        sweep_mb_per_s=(),
        sweep_budget_frac=(),
    )


# ---- model preparation ---------------------------------------------------------------------------
def _train_cfg(cfg: BenchConfig, out: Path) -> MoETrainConfig:
    tcfg = (tiny_preset if cfg.tiny else bench_preset)(out, cfg.text)
    return tcfg if cfg.train_steps is None else replace(tcfg, steps=cfg.train_steps)


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def prepare(cfg: BenchConfig) -> tuple[Path, Path, Path, MoETrainConfig]:
    """(trained checkpoint, nested conversion, plain int8 conversion), reusing the cache when
    the recipe matches. The int8 baselines read plain int8 codes, as a conventional int8 runtime
    would, so they pay no plane decoding on a miss."""
    tcfg = _train_cfg(cfg, Path("."))
    recipe = json.dumps(
        {k: str(v) for k, v in asdict(tcfg).items() if k != "out_dir"}, sort_keys=True
    )
    root = cfg.cache_dir / (("tiny-" if cfg.tiny else "bench-") + _digest(recipe))
    qcfg = NestedQuantConfig(group_size=cfg.group_size)
    model_dir = root / "model"
    nested_dir = root / f"nested-v{VERSION}-{_digest(repr(qcfg))}"
    int8_dir = root / f"int8-v{VERSION}-{_digest(repr(replace(qcfg, layout='bytes')))}"
    tcfg = replace(tcfg, out_dir=model_dir)
    if not (model_dir / TRAIN_LOG).exists():
        logger.info("training the benchmark MoE into %s", model_dir)
        train(tcfg)
    if not (nested_dir / "nested.json").exists():
        quantize_nested_checkpoint(model_dir, nested_dir, qcfg)
    if not (int8_dir / "nested.json").exists():
        quantize_nested_checkpoint(model_dir, int8_dir, replace(qcfg, layout="bytes"))
    return model_dir, nested_dir, int8_dir, tcfg


# ---- quality -------------------------------------------------------------------------------------
def quality(cfg: BenchConfig, model_dir: Path, nested_dir: Path, tcfg: MoETrainConfig) -> dict:
    from lowband.models.weights import load_pretrained

    manifest = json.loads((nested_dir / "nested.json").read_text())
    _, heldout = load_splits(tcfg.data, tcfg.heldout_frac)
    out: dict[str, float] = {}
    norm2 = sum(e["norm2"] for e in manifest["experts"])
    with torch.no_grad():
        out["fp32.ppl"] = heldout_ppl(
            load_pretrained(model_dir), heldout, max_tokens=cfg.eval_tokens
        )
        for b in WIDTHS:
            for kind in ("nested", "independent"):
                err2 = sum(e["err2"][kind][str(b)] for e in manifest["experts"])
                out[f"{kind}.{b}.rel_err"] = math.sqrt(err2 / norm2)
            out[f"nested.{b}.ppl"] = heldout_ppl(
                load_dense(nested_dir, b), heldout, max_tokens=cfg.eval_tokens
            )
            model = load_pretrained(model_dir)
            for layer in model.model.layers:
                for expert in layer.block_sparse_moe.experts:
                    for lin in (expert.w1, expert.w2, expert.w3):
                        lin.weight.copy_(quantize_independent(lin.weight, b, cfg.group_size))
            out[f"independent.{b}.ppl"] = heldout_ppl(model, heldout, max_tokens=cfg.eval_tokens)
    return out


# ---- serving (one subprocess per configuration) --------------------------------------------------
def _status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


@dataclass(frozen=True, kw_only=True)
class ServeRun:
    """One serving configuration, run in its own process."""

    nested: Path
    text: Path  # JSON list of token ids: 16 prompt + warmup + tokens + 1
    policy: str  # one of POLICIES
    budget: int  # expert budget in bytes
    read_mb_per_s: float  # 0 = unpaced
    tokens: int
    warmup: int
    threads: int = 1


def _runtime_warmup() -> None:
    """Pay the runtime's one-off costs before the memory baseline is taken: thread pools, kernel
    caches, and the ~75 MB of modules (sympy among them) that torch imports the first time a
    ``torch.device("meta")`` context is entered. They are the same for every policy."""
    from edge.moe.train import tiny_model
    from lowband.models.llama import LlamaForCausalLM

    with torch.device("meta"):
        LlamaForCausalLM(tiny_model())
    model = LlamaForCausalLM(tiny_model()).eval()
    kv = model.new_cache()
    with torch.no_grad():
        model(torch.zeros(1, 8, dtype=torch.long), cache=kv)
        model(torch.zeros(1, 1, dtype=torch.long), cache=kv)
    t = threading.Thread(target=lambda: torch.ones(8) + 1)  # a second thread's malloc arena
    t.start()
    t.join()


def serve_worker(args: ServeRun) -> dict:
    """Run inside the subprocess: load, warm, decode held-out text, report. Nothing is inherited
    from the parent process, so the peak RSS is this configuration's alone."""
    import torch.nn.functional as F

    from edge.moe.store import ExpertStoreConfig, HEBFConfig, LRUConfig, PrefetchConfig, open_store

    torch.set_num_threads(args.threads)
    _runtime_warmup()
    ids = torch.tensor(json.loads(Path(args.text).read_text()), dtype=torch.long)
    base_kb = _status_kb("VmRSS")
    try:
        Path("/proc/self/clear_refs").write_text("5")  # restart the peak-RSS counter here
    except OSError:
        pass
    policy = HEBFConfig() if args.policy == "hebf" else LRUConfig(bits=8)
    prefetch = PrefetchConfig() if args.policy in ("hebf", "lru_int8_prefetch") else None
    cfg = ExpertStoreConfig(
        budget_bytes=args.budget,
        policy=policy,
        prefetch=prefetch,
        read_mb_per_s=args.read_mb_per_s or None,
    )
    t0 = time.perf_counter()
    model, cache = open_store(args.nested, cfg)
    load_s = time.perf_counter() - t0
    kv = model.new_cache()
    nll, n = 0.0, 0
    with torch.no_grad():
        logits = model(ids[None, :16], cache=kv)[0, -1]
        for t in range(16, 16 + args.warmup + args.tokens):
            if t == 16 + args.warmup:  # statistics cover the timed tokens only
                cache.stats = type(cache.stats)(peak_bytes=cache.stats.peak_bytes)
                cache.device.bytes_read, cache.device.busy_s = 0, 0.0
                start, cpu0 = time.perf_counter(), time.thread_time()
            if t >= 16 + args.warmup:
                nll += float(F.cross_entropy(logits[None].float(), ids[t : t + 1]))
                n += 1
            logits = model(ids[None, t : t + 1], cache=kv)[0, -1]
    elapsed, cpu = time.perf_counter() - start, time.thread_time() - cpu0
    rep = cache.report()
    cache.close()
    peak_kb = _status_kb("VmHWM")
    return {
        "tokens_per_s": n / elapsed,
        "decode_cpu_s": cpu,
        "wall_s": elapsed,
        "ppl": math.exp(nll / n),
        "load_s": round(load_s, 3),
        "peak_rss_mb": peak_kb / 1024,
        "base_rss_mb": base_kb / 1024,
        "model_rss_mb": (peak_kb - base_kb) / 1024,
        "hit_rate": rep["hit_rate"],
        "mean_bits": rep["mean_bits_per_call"],
        "stall_s": rep["stall_s"],
        "read_mb": rep["bytes_read"] / 1e6,
        "budget_mb": args.budget / 1e6,
        "cache_peak_mb": rep["peak_bytes"] / 1e6,
        "upgrades": rep["upgrades"],
        "downgrades": rep["downgrades"],
        "evictions": rep["evictions"],
    }


def run_config(
    cfg: BenchConfig, nested_dir: Path, text: Path, policy: str, budget: int, read_mb_per_s: float
) -> dict:
    cmd = [
        sys.executable,
        "-m",
        "benchmarks.moe",
        "_serve",
        "--nested",
        str(nested_dir),
        "--text",
        str(text),
        "--policy",
        policy,
        "--budget",
        str(budget),
        "--read-mb-per-s",
        str(read_mb_per_s),
        "--tokens",
        str(cfg.tokens),
        "--warmup",
        str(cfg.warmup),
        "--threads",
        str(cfg.threads),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        raise RuntimeError(f"{policy} run failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def serving(cfg: BenchConfig, nested_dir: Path, int8_dir: Path, tcfg: MoETrainConfig) -> dict:
    manifest = json.loads((nested_dir / "nested.json").read_text())
    int8_bytes = sum(e["bytes"]["8"] for e in manifest["experts"])
    _, heldout = load_splits(tcfg.data, tcfg.heldout_frac)
    text = nested_dir / "bench_text.json"
    text.write_text(json.dumps(heldout[: 16 + cfg.warmup + cfg.tokens + 1].tolist()))
    # Cases: (policy, storage MB/s, budget fraction). The headline set, then the sweeps.
    head = [(p, cfg.read_mb_per_s, cfg.budget_frac) for p in POLICIES]
    rates = list(dict.fromkeys([0.0, *cfg.sweep_mb_per_s]))  # unpaced always, beside the paced
    rates = [r for r in rates if r != cfg.read_mb_per_s]
    sweep = [(p, r, cfg.budget_frac) for r in rates for p in BASELINES + ("hebf",)]
    sweep += [
        (p, cfg.read_mb_per_s, f) for f in cfg.sweep_budget_frac for p in BASELINES + ("hebf",)
    ]
    runs: dict[tuple[str, float, float], list[dict]] = {}
    for rnd in range(cfg.repeats):  # alternate the order: drifting machine load hits all alike
        for case in head + sweep if rnd % 2 == 0 else (head + sweep)[::-1]:
            policy, rate, frac = case
            b = int8_bytes + 1 if policy == "int8_resident" else int(frac * int8_bytes)
            src = nested_dir if policy == "hebf" else int8_dir
            runs.setdefault(case, []).append(run_config(cfg, src, text, policy, b, rate))
            logger.info(
                "%s at %g MB/s, budget %.2f: %.1f tokens/s",
                policy,
                rate,
                frac,
                runs[case][-1]["tokens_per_s"],
            )
    out: dict[str, object] = {
        "budget_frac": cfg.budget_frac,
        "budget_mb": int(cfg.budget_frac * int8_bytes) / 1e6,
        "int8_experts_mb": int8_bytes / 1e6,
        "read_mb_per_s": cfg.read_mb_per_s,
        "tokens": cfg.tokens,
        "repeats": cfg.repeats,
    }

    def med(case: tuple[str, float, float], key: str) -> float:
        return statistics.median(r[key] for r in runs[case])

    for case in head:
        for key in (
            "tokens_per_s",
            "peak_rss_mb",
            "model_rss_mb",
            "ppl",
            "hit_rate",
            "mean_bits",
            "stall_s",
            "read_mb",
            "decode_cpu_s",
        ):
            out[f"{case[0]}.{key}"] = med(case, key)
        out[f"{case[0]}.tokens_per_s_runs"] = [round(r["tokens_per_s"], 2) for r in runs[case]]
    best = max(BASELINES, key=lambda p: out[f"{p}.tokens_per_s"])
    out["best_lru"] = best
    out["throughput_ratio"] = out["hebf.tokens_per_s"] / out[f"{best}.tokens_per_s"]
    out["throughput_ratio_vs_lru_no_prefetch"] = (
        out["hebf.tokens_per_s"] / out["lru_int8.tokens_per_s"]
    )
    out["throughput_ratio_vs_lru_prefetch"] = (
        out["hebf.tokens_per_s"] / out["lru_int8_prefetch.tokens_per_s"]
    )
    # per round: hebf over the best baseline of the same round (min/max beside the median)
    ratios = [
        h["tokens_per_s"]
        / max(runs[(p, cfg.read_mb_per_s, cfg.budget_frac)][i]["tokens_per_s"] for p in BASELINES)
        for i, h in enumerate(runs[("hebf", cfg.read_mb_per_s, cfg.budget_frac)])
    ]
    out["throughput_ratio_runs"] = {
        "median": statistics.median(ratios),
        "min": min(ratios),
        "max": max(ratios),
    }
    out["memory_ratio"] = out["hebf.model_rss_mb"] / out["int8_resident.model_rss_mb"]
    out["memory_ratio_abs"] = out["hebf.peak_rss_mb"] / out["int8_resident.peak_rss_mb"]

    def best_of(rate: float, frac: float) -> tuple[str, float, float]:
        return max(((p, rate, frac) for p in BASELINES), key=lambda c: med(c, "tokens_per_s"))

    for rate in rates:
        h, lru = ("hebf", rate, cfg.budget_frac), best_of(rate, cfg.budget_frac)
        tag = f"sweep_io.{rate:g}"
        out[f"{tag}.hebf.tokens_per_s"] = med(h, "tokens_per_s")
        for p in BASELINES:
            out[f"{tag}.{p}.tokens_per_s"] = med((p, rate, cfg.budget_frac), "tokens_per_s")
        out[f"{tag}.best_lru"] = lru[0]
        out[f"{tag}.throughput_ratio"] = med(h, "tokens_per_s") / med(lru, "tokens_per_s")
    # the page-cache figure, always beside the paced headline
    out["throughput_ratio_unpaced"] = (
        out["throughput_ratio"] if cfg.read_mb_per_s == 0 else out["sweep_io.0.throughput_ratio"]
    )
    for frac in cfg.sweep_budget_frac:
        h, lru = ("hebf", cfg.read_mb_per_s, frac), best_of(cfg.read_mb_per_s, frac)
        tag = f"sweep_budget.{frac:g}"
        out[f"{tag}.best_lru"] = lru[0]
        for key in ("tokens_per_s", "model_rss_mb", "ppl", "mean_bits", "hit_rate"):
            out[f"{tag}.hebf.{key}"] = med(h, key)
            out[f"{tag}.lru_int8.{key}"] = med(lru, key)  # the best LRU's (``best_lru``)
        out[f"{tag}.throughput_ratio"] = med(h, "tokens_per_s") / med(lru, "tokens_per_s")
        out[f"{tag}.memory_ratio"] = med(h, "model_rss_mb") / out["int8_resident.model_rss_mb"]
    return out


def main(cfg: BenchConfig) -> dict:
    t0 = time.perf_counter()
    model_dir, nested_dir, int8_dir, tcfg = prepare(cfg)
    log = json.loads((model_dir / TRAIN_LOG).read_text())
    result: dict[str, object] = {
        "model_dir": str(model_dir),
        "train_text": str(tcfg.data),
        "train_tokens": log["tokens"],
        "train_s": log["train_s"],
    }
    logger.info("quality evaluation (%.0fs so far)", time.perf_counter() - t0)
    result.update(quality(cfg, model_dir, nested_dir, tcfg))
    logger.info("serving runs (%.0fs so far)", time.perf_counter() - t0)
    result.update(serving(cfg, nested_dir, int8_dir, tcfg))
    result["bench_s"] = round(time.perf_counter() - t0, 1)
    return result


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.moe", description=__doc__.split("\n")[0])
    p.add_argument("--json", action="store_true", help="print the result as one JSON line")
    p.add_argument("--tiny", action="store_true", help="seconds-scale smoke run")
    p.add_argument(
        "--cache-dir", type=Path, default=Path.home() / ".cache" / "lowband" / "moe_bench"
    )
    p.add_argument(
        "--text",
        type=Path,
        default=SAMPLE_TEXT,
        help="UTF-8 corpus to train on (default: the packaged Shakespeare sample)",
    )
    p.add_argument("--budget-frac", type=float, default=None)
    p.add_argument("--read-mb-per-s", type=float, default=None)
    p.add_argument("--tokens", type=int, default=None)
    p.add_argument("--repeats", type=int, default=None)
    p.add_argument(
        "--train-steps", type=int, default=None, help="override the training preset's step count"
    )
    return p.parse_args(argv)


def _parse_worker(argv: Sequence[str]) -> ServeRun:
    p = argparse.ArgumentParser(prog="python -m benchmarks.moe _serve")
    p.add_argument("--nested", type=Path, required=True)
    p.add_argument("--text", type=Path, required=True)
    p.add_argument("--policy", choices=POLICIES, required=True)
    p.add_argument("--budget", type=int, required=True)
    p.add_argument("--read-mb-per-s", type=float, default=0.0)
    p.add_argument("--tokens", type=int, required=True)
    p.add_argument("--warmup", type=int, required=True)
    p.add_argument("--threads", type=int, default=1)
    return ServeRun(**vars(p.parse_args(argv)))


if __name__ == "__main__":
    argv = sys.argv[1:]
    if argv[:1] == ["_serve"]:
        print(json.dumps(serve_worker(_parse_worker(argv[1:]))))
        sys.exit(0)
    ns = _parse(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stderr)
    torch.set_flush_denormal(True)
    bench = tiny_bench(ns.cache_dir) if ns.tiny else BenchConfig(cache_dir=ns.cache_dir)
    bench = replace(bench, text=ns.text)
    overrides = {
        k: v
        for k, v in (
            ("budget_frac", ns.budget_frac),
            ("read_mb_per_s", ns.read_mb_per_s),
            ("tokens", ns.tokens),
            ("repeats", ns.repeats),
            ("train_steps", ns.train_steps),
        )
        if v is not None
    }
    bench = replace(bench, **overrides)
    res = main(bench)
    if ns.json:
        print(json.dumps(res))
    else:
        print(json.dumps(res, indent=1))
