"""DDP vs Streaming DiLoCo: the same model, data, workers and token budget; a comparison table.

    python examples/ddp_vs_diloco/main.py            # ~1 minute on 2 cores
    python examples/ddp_vs_diloco/main.py --tiny     # seconds (the smoke test)

Workers run as threads over the in-process loopback communicator (``transport.loopback``), which
counts the bytes each worker would put on the wire. Swap in the ZeroMQ communicator to train
across machines (examples/multisite_diloco), or run ``lowband demo`` to see the same comparison
over shaped links with wall-clock times.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time

import torch

from diloco.config import (
    DataConfig,
    DDPConfig,
    DilocoConfig,
    LrSchedule,
    OptimizerConfig,
    TrainConfig,
    byte_llama,
)
from diloco.launch import run_threads
from diloco.task import lm_task


def base_config(tiny: bool, workers: int) -> TrainConfig:
    steps = 40 if tiny else 600
    return TrainConfig(
        model=byte_llama(hidden=64, layers=2, heads=4, seq_len=64),
        data=DataConfig(seq_len=32 if tiny else 64, batch_size=4 if tiny else 8, eval_batches=8),
        inner=OptimizerConfig(name="adamw", lr=6e-3, weight_decay=0.1),
        lr_schedule=LrSchedule(warmup_steps=4 if tiny else 40),
        steps=steps,
        workers=workers,
        eval_every=steps // 4,
    )


def streaming_diloco(tiny: bool) -> DilocoConfig:
    """Settings tuned by ``python -m benchmarks.diloco`` (see docs/training.md)."""
    return DilocoConfig(
        inner_steps=10 if tiny else 60,
        n_fragments=2 if tiny else 3,
        tau=1 if tiny else 5,
        alpha=0.5,
        codec="nf4",
        error_feedback=True,
        outer=OptimizerConfig(name="sgd", lr=1.0, momentum=0.9, nesterov=True),
    )


def summarize(results) -> dict:
    """Worker 0 evaluates the global model; bytes are averaged over the workers."""
    lead = next(r for r in results if r.final_eval is not None)
    return {
        "eval_loss": lead.final_eval,
        "bytes_per_worker": sum(r.bytes_sent for r in results) / len(results),
        "syncs": lead.outer_syncs,
        "curve": [(e["step"], e["loss"]) for e in lead.evals],
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--workers", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(1)  # the workers are threads: one core each

    base = base_config(args.tiny, args.workers)
    runs = {
        # DDP: fp32 gradients averaged after every step; lr halved for its M-times larger batch
        "DDP": dataclasses.replace(
            base, mode=DDPConfig(), inner=dataclasses.replace(base.inner, lr=3e-3)
        ),
        "Streaming DiLoCo": dataclasses.replace(base, mode=streaming_diloco(args.tiny)),
    }
    task = lm_task(base)  # one corpus and one initial model for both runs
    initial = task.evaluate(task.build_model())
    out = {}
    for name, cfg in runs.items():
        t0 = time.perf_counter()
        out[name] = summarize(run_threads(cfg, task=task))
        out[name]["wall_s"] = round(time.perf_counter() - t0, 1)

    ddp, dl = out["DDP"], out["Streaming DiLoCo"]
    tokens = base.workers * base.steps * base.tokens_per_step()
    print(
        f"{base.workers} workers, {base.steps} steps each, {tokens:,} tokens; "
        f"initial held-out loss {initial:.4f}"
    )
    print(f"{'run':<17} {'eval loss':>9} {'MiB sent/worker':>16} {'syncs':>6} {'wall s':>7}")
    for name, r in out.items():
        print(
            f"{name:<17} {r['eval_loss']:>9.4f} {r['bytes_per_worker'] / 2**20:>16.3f} "
            f"{r['syncs']:>6} {r['wall_s']:>7.1f}"
        )
    ratio = ddp["bytes_per_worker"] / dl["bytes_per_worker"]
    gap = (dl["eval_loss"] - ddp["eval_loss"]) / ddp["eval_loss"]
    print(f"Streaming DiLoCo sent {ratio:.0f}x fewer bytes; eval loss {100 * gap:+.2f}% vs DDP")
    print(json.dumps({"initial_eval": initial, "runs": out, "bytes_ratio": ratio, "loss_gap": gap}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
