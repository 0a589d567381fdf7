"""A Streaming DiLoCo worker's peak resident memory per parameter (fp32 training on the CPU).

What a worker must hold: θ_m, its gradient and AdamW's two moments (16 B/param), the global copy
θ_g and the outer Nesterov momentum (+8 B/param): 24 B/param, plus activations and one
fragment's sync buffers. Each arm runs in a fresh process (``--child``): the process's
baseline (interpreter, torch, the tokenized corpus) is read before the model is built, its peak
(``ru_maxrss``) after training; bytes per parameter are (peak − baseline) / parameters. The
peer arm is DDP on the same model (weights, gradients, moments and one flat gradient buffer).

    python -m benchmarks.diloco_memory --json          # a 50 M-parameter byte-level Llama
    python -m benchmarks.diloco_memory --model FILE.gguf --repeats 1 --json   # e.g. Gemma 3 270M
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import resource
import statistics
import subprocess
import sys
import time


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def _peak() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def _warm_up(seq_len: int) -> None:
    """One AdamW step and one evaluation of a tiny Llama, so that the baseline holds what any
    torch process that trains holds (the kernels' code and thread pools paged in), not the
    model."""
    import torch
    import torch.nn.functional as F

    from diloco.config import byte_llama
    from lowband.models.llama import LlamaForCausalLM

    model = LlamaForCausalLM(byte_llama(64, 1, 1))
    opt = torch.optim.AdamW(model.parameters(), fused=True)
    ids = torch.randint(0, 256, (2, seq_len + 1))
    for grad in (True, False):
        with torch.set_grad_enabled(grad):
            logits = model(ids[:, :-1])
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
        if grad:
            loss.backward()
            opt.step()


def child(args: argparse.Namespace) -> dict:
    import torch

    from diloco.config import DDPConfig, DilocoConfig, byte_llama, preset, with_overrides
    from diloco.device import limit_heap_retention
    from diloco.launch import run_threads
    from diloco.task import lm_task

    torch.set_num_threads(1)
    if args.model.startswith("llama:"):  # llama:HIDDEN:LAYERS, a byte-level Llama of that shape
        hidden, layers = (int(x) for x in args.model.split(":")[1:])
        base = dataclasses.replace(
            preset("tiny"), model=byte_llama(hidden, layers, max(1, hidden // 64))
        )
    else:
        base = preset("tiny" if args.model.endswith(".gguf") else args.model)
    over: dict = dict(
        workers=1,
        steps=args.steps,
        eval_every=0,
        batch_size=args.batch_size,
        seq_len=args.seq_len,
        inner_steps=args.steps // 2,
        n_fragments=args.fragments,
        tau=1,
        codec=args.codec,
        error_feedback=args.error_feedback,
        optimizer_impl=args.optimizer_impl,
    )
    pretrained = None
    if args.model.endswith(".gguf"):
        from edge.formats.gguf_train import GGUFPretrained

        over["gguf_model"], pretrained = args.model, GGUFPretrained()
    cfg = with_overrides(base, **over)
    if args.arm == "ddp":
        cfg = dataclasses.replace(cfg, mode=DDPConfig())
    elif args.lora_rank:
        cfg = with_overrides(cfg, lora_rank=args.lora_rank)
    else:
        assert isinstance(cfg.mode, DilocoConfig)
    limit_heap_retention()  # as the launchers do, before anything is built
    if args.lora_rank:
        import peft  # noqa: F401  (its import, ~170 MB with transformers, is baseline)
    task = lm_task(cfg, pretrained)
    cold = _rss()
    _warm_up(args.seq_len)
    baseline = _rss()  # the interpreter, torch with its kernels paged in, the tokenized corpus
    peak_before = _peak()
    t0 = time.perf_counter()
    results = run_threads(cfg, task=task)
    wall = time.perf_counter() - t0
    peak = _peak()  # before anything else is built
    assert results[0].steps == args.steps
    params = sum(p.numel() for p in task.build_model().parameters())
    return {
        "arm": args.arm,
        "params": params,
        "baseline_bytes": baseline,
        "cold_baseline_bytes": cold,
        "peak_bytes": peak,
        "peak_before_model_bytes": peak_before,
        "bytes_per_param": round((peak - baseline) / params, 2),
        "total_bytes_per_param": round(peak / params, 2),
        "wall_s": round(wall, 2),
    }


def _run_child(arm: str, args: argparse.Namespace) -> dict:
    argv = [sys.executable, "-m", "benchmarks.diloco_memory", "--child", "--arm", arm]
    argv += ["--model", args.model, "--steps", str(args.steps), "--codec", args.codec]
    argv += ["--fragments", str(args.fragments), "--batch-size", str(args.batch_size)]
    argv += ["--seq-len", str(args.seq_len), "--optimizer-impl", args.optimizer_impl]
    argv += ["--error-feedback" if args.error_feedback else "--no-error-feedback"]
    argv += ["--lora-rank", str(args.lora_rank)]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=args.timeout, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"{arm} child failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _stats(xs: list[float]) -> dict:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--model", default="llama:1024:4", help="llama:HIDDEN:LAYERS, a preset name or a GGUF file"
    )
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--fragments", type=int, default=2, help="P")
    p.add_argument("--codec", default="int8")
    p.add_argument("--error-feedback", action=argparse.BooleanOptionalAction, default=False)
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--optimizer-impl", default="auto", choices=["auto", "fused", "foreach", "loop"])
    p.add_argument("--lora-rank", type=int, default=0, help="r > 0: the DiLoCo arm trains LoRA")
    p.add_argument("--arms", default="diloco,ddp")
    p.add_argument("--timeout", type=float, default=1800)
    p.add_argument("--json", action="store_true")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--arm", default="diloco", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        res = child(args)
        print(json.dumps(res))
        return res
    runs: dict[str, list[dict]] = {a: [] for a in args.arms.split(",")}
    for _ in range(args.repeats):
        for arm in runs:  # arms alternate
            runs[arm].append(_run_child(arm, args))
    out = {
        "benchmark": "diloco_memory",
        "model": args.model,
        "params": next(iter(runs.values()))[0]["params"],
        "settings": {
            k: getattr(args, k)
            for k in (
                "steps",
                "fragments",
                "codec",
                "error_feedback",
                "batch_size",
                "seq_len",
                "optimizer_impl",
                "lora_rank",
            )
        },
        "repeats": args.repeats,
        "arms": {
            arm: {
                "bytes_per_param": _stats([r["bytes_per_param"] for r in rs]),
                "total_bytes_per_param": _stats([r["total_bytes_per_param"] for r in rs]),
                "peak_bytes": _stats([float(r["peak_bytes"]) for r in rs]),
                "baseline_bytes": _stats([float(r["baseline_bytes"]) for r in rs]),
                "cold_baseline_bytes": _stats([float(r["cold_baseline_bytes"]) for r in rs]),
                "wall_s": _stats([r["wall_s"] for r in rs]),
            }
            for arm, rs in runs.items()
        },
    }
    if args.json:
        print(json.dumps(out))
    else:
        for arm, r in out["arms"].items():
            print(f"{arm}: {r['bytes_per_param']['median']} B/param (peak − baseline)")
    return out


if __name__ == "__main__":
    main()
