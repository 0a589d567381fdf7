"""DDP vs Streaming DiLoCo: same model, data, workers and token budget. One JSON line, last.

    python -m benchmarks.diloco --json                 # the default comparison (minutes)
    python -m benchmarks.diloco --json --seeds 3       # the same over three seeds (means)
    python -m benchmarks.diloco --json --tiny          # seconds: the smoke test's size

Quality part: M workers as loopback threads train the preset model for T steps of B×T tokens
each, once with DDP (fp32 gradients all-reduced every step) and once with Streaming DiLoCo; the
held-out loss of the final (global) model and the bytes each worker put on the wire, as counted
by the communicator (``Communicator.stats()``), are compared:
``bytes_ratio = ddp.bytes_per_worker / diloco.bytes_per_worker`` and
``loss_gap = (diloco.eval_loss − ddp.eval_loss) / ddp.eval_loss``.

Wall-clock part (``--link-mbit``): shorter runs of DDP, DiLoCo without overlap (τ = 0) and
Streaming DiLoCo with overlap behind a *modelled* link (``transport.links.model``: bandwidth and
latency applied to the loopback's byte counts; compute is real). It is labelled as a model in the
output; real-link numbers come from the ZeroMQ transport on a shaped interface.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import statistics
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from diloco.common import WorkerResult
from diloco.config import (
    ComputeConfig,
    DataConfig,
    DDPConfig,
    DilocoConfig,
    LrSchedule,
    OptimizerConfig,
    TrainConfig,
    byte_llama,
)
from diloco.data import PACKAGED_TEXTS
from diloco.launch import make_worker, run_threads
from diloco.task import Task, lm_task
from lowband.errors import ConfigError

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class BenchConfig:
    """Defaults: the comparison tuned on the embedded sample's *validation* split only (the
    sweep and its validation figures: docs/training.md, benchmarks/results/);
    the losses it reports are the *test* split's, which no setting was tuned on."""

    workers: int = 2  # M
    steps: int = 3200  # T: inner steps (DDP: steps), the same token budget for both
    inner_steps: int = 60  # H
    n_fragments: int = 3  # P
    tau: int = 5  # τ
    alpha: float = 0.5  # α
    codec: str = "nf4"
    error_feedback: bool = True
    outer_lr: float = 1.0
    outer_momentum: float = 0.9
    inner_lr: float = 6e-3  # DiLoCo inner AdamW peak lr
    ddp_lr: float = 6e-3  # DDP AdamW peak lr: its best of 3e-3/4.5e-3/6e-3/9e-3 on validation
    warmup_steps: int = 60
    hidden: int = 64
    layers: int = 2
    heads: int = 4
    seq_len: int = 64
    batch_size: int = 8  # B per worker per step
    eval_batches: int = 128  # 128 × B × T = 65,536 scored tokens (>= 64 k: see the gap's noise)
    seed: int = 0
    wall_steps: int = 120  # DiLoCo steps of each wall-clock run (0: skip the wall-clock part)
    wall_ddp_steps: int = 10  # DDP steps of its wall-clock run (each moves the full gradient)
    link_mbit: float = 5.0  # modelled per-worker link bandwidth, Mbit/s
    link_latency_ms: float = 50.0  # modelled one-way latency
    threads: int = 1  # torch intra-op threads (the workers are threads of one process)
    corpus: str | None = None  # a UTF-8 text file or a packaged text's name (default: embedded)
    tokenizer: str | None = None  # tokenizer.json or bpe:N (default: bytes)
    vocab_size: int = 256  # of the model (the tokenizer's size when one is given)
    eval_fraction: float = 0.1  # validation: what the settings were tuned on
    test_fraction: float = 0.1  # test: what the reported losses are measured on
    eval_split: str = "test"  # the split the final losses report (validation: for tuning)
    slices: int = 0  # disjoint training slices per worker (0: shared)
    device: str = "auto"
    precision: str = "fp32"
    plot: Path | None = None

    def __post_init__(self) -> None:
        if self.workers < 1 or self.steps < 1:
            raise ConfigError("workers/steps", "must be >= 1")
        if self.wall_steps < 0:
            raise ConfigError("wall_steps", "must be >= 0")
        if self.link_mbit <= 0 or self.link_latency_ms < 0:
            raise ConfigError("link_mbit", "bandwidth must be > 0 and latency >= 0")

    def train_config(self, mode: DilocoConfig | DDPConfig, steps: int | None = None) -> TrainConfig:
        lr = self.ddp_lr if isinstance(mode, DDPConfig) else self.inner_lr
        steps = steps or self.steps
        return TrainConfig(
            model=byte_llama(
                self.hidden,
                self.layers,
                self.heads,
                seq_len=self.seq_len,
                vocab_size=self.vocab_size,
            ),
            data=DataConfig(
                kind="text" if self.corpus else "embedded",
                path=self.corpus_path(),
                tokenizer=self.tokenizer,
                seq_len=self.seq_len,
                batch_size=self.batch_size,
                eval_batches=self.eval_batches,
                eval_fraction=self.eval_fraction,
                test_fraction=self.test_fraction,
                eval_split=self.eval_split,  # type: ignore[arg-type]
                slices=self.slices,
            ),
            compute=ComputeConfig(device=self.device, precision=self.precision),  # type: ignore[arg-type]
            mode=mode,
            inner=OptimizerConfig(name="adamw", lr=lr, weight_decay=0.1),
            lr_schedule=LrSchedule(warmup_steps=min(self.warmup_steps, steps // 2)),
            steps=steps,
            workers=self.workers,
            seed=self.seed,
            eval_every=max(1, self.steps // 12),
            audit_every=8,
        )

    def corpus_path(self) -> str | None:
        """``corpus`` as a file: a packaged text's name (``diloco.data.PACKAGED_TEXTS``, e.g.
        ``paradise_lost``) resolves to the file shipped in ``lowband/data``."""
        if self.corpus is None:
            return None
        return str(PACKAGED_TEXTS.get(self.corpus, self.corpus))

    def diloco_mode(self, tau: int | None = None) -> DilocoConfig:
        return DilocoConfig(
            inner_steps=self.inner_steps,
            n_fragments=self.n_fragments,
            tau=self.tau if tau is None else tau,
            alpha=self.alpha,
            codec=self.codec,
            error_feedback=self.error_feedback,
            algorithm="ring",  # every worker sends the same bytes: clean curves
            outer=OptimizerConfig(
                name="sgd",
                lr=self.outer_lr,
                momentum=self.outer_momentum,
                nesterov=self.outer_momentum > 0,
            ),
        )


def tiny_bench() -> BenchConfig:
    """The smoke-test size: seconds."""
    return BenchConfig(
        workers=2,
        steps=24,
        inner_steps=12,
        n_fragments=2,
        tau=1,
        hidden=32,
        layers=2,
        heads=2,
        seq_len=16,
        batch_size=4,
        eval_batches=2,
        warmup_steps=4,
        wall_steps=12,
        wall_ddp_steps=4,
        link_mbit=50.0,
        link_latency_ms=5.0,
    )


def scale_bench() -> BenchConfig:
    """The ``scale`` training preset as a comparison: BPE 4096, 6.8 M parameters, M = 4,
    disjoint slices, NF4 + error feedback (see ``diloco.config.scale``); 64 × 8 × 128 = 65,536
    scored test tokens."""
    return BenchConfig(
        workers=4,
        steps=360,
        inner_steps=60,
        n_fragments=3,
        tau=5,
        alpha=0.5,
        codec="nf4",
        error_feedback=True,
        outer_lr=0.9,
        inner_lr=2e-3,
        ddp_lr=2e-3,
        warmup_steps=30,
        hidden=256,
        layers=6,
        heads=8,
        seq_len=128,
        batch_size=8,
        eval_batches=64,
        tokenizer="bpe:4096",
        vocab_size=4096,
        slices=4,
        test_fraction=0.21,
        wall_steps=0,
        threads=2,
    )


def _summarize(results: list[WorkerResult]) -> dict[str, Any]:
    lead = next(r for r in results if r.final_eval is not None)
    return {
        "eval_loss": lead.final_eval,
        "bytes_per_worker": statistics.mean(r.bytes_sent for r in results),
        "bytes_received_per_worker": statistics.mean(r.bytes_received for r in results),
        "peak_sync_bytes": max(r.peak_sync_bytes for r in results),
        "outer_syncs": lead.outer_syncs,
        "wall_s": round(max(r.wall_s for r in results), 3),
        "compute_s": round(statistics.mean(r.compute_s for r in results), 3),
        "sync_s": round(statistics.mean(r.sync_s for r in results), 3),
        "curve": [[e["step"], round(e["loss"], 4), e["bytes_sent"]] for e in lead.evals],
    }


def _run_shaped(cfg: TrainConfig, task: Task, bandwidth: float, latency: float) -> dict[str, Any]:
    """One run behind the modelled link; wall time and time blocked on the network."""
    from transport.links.model import ShapedComm
    from transport.loopback import LoopbackGroup

    group = LoopbackGroup(cfg.workers, timeout=cfg.sync_timeout)
    comms = [ShapedComm(c, bandwidth_bytes_s=bandwidth, latency_s=latency) for c in group.comms()]
    workers = [make_worker(cfg, c, task, worker_id=str(r)) for r, c in enumerate(comms)]
    results: list[WorkerResult | None] = [None] * len(workers)

    def body(r: int) -> None:
        results[r] = workers[r].run()

    threads = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(len(workers))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(cfg.sync_timeout * 4)
    done = [r for r in results if r is not None]
    if len(done) != len(workers):
        raise RuntimeError("a wall-clock run did not finish")
    wall = max(r.wall_s for r in done)
    return {
        "steps": cfg.steps,
        "wall_s": round(wall, 3),
        "sync_s": round(statistics.mean(r.sync_s for r in done), 3),
        "compute_s": round(statistics.mean(r.compute_s for r in done), 3),
        "steps_per_s": round(cfg.steps / wall, 3),
        "bytes_per_worker": statistics.mean(r.bytes_sent for r in done),
    }


def _pair(b: BenchConfig) -> tuple[dict[str, Any], dict[str, Any], Task, dict[str, float]]:
    """DDP and Streaming DiLoCo with the same corpus, model init, batches and eval set."""
    ddp_cfg = b.train_config(DDPConfig())
    dl_cfg = b.train_config(b.diloco_mode())
    task = lm_task(dl_cfg)
    t0 = time.perf_counter()
    ddp = _summarize(run_threads(ddp_cfg, task=task))
    t1 = time.perf_counter()
    dl = _summarize(run_threads(dl_cfg, task=task))
    return ddp, dl, task, {"ddp": round(t1 - t0, 1), "diloco": round(time.perf_counter() - t1, 1)}


def run_bench(b: BenchConfig, seeds: int = 1) -> dict[str, Any]:
    """The comparison for seeds ``b.seed .. b.seed+seeds-1``; the eval losses reported at the
    top level are means over the seeds (the curves are the first seed's)."""
    torch.set_num_threads(b.threads)
    per_seed = []
    ddp, dl, task, timing = _pair(b)
    per_seed.append((b.seed, ddp["eval_loss"], dl["eval_loss"]))
    for seed in range(b.seed + 1, b.seed + seeds):
        d, l, _, _ = _pair(dataclasses.replace(b, seed=seed))
        per_seed.append((seed, d["eval_loss"], l["eval_loss"]))
    if seeds > 1:
        ddp["eval_loss"] = statistics.mean(p[1] for p in per_seed)
        dl["eval_loss"] = statistics.mean(p[2] for p in per_seed)
    tokens = b.workers * b.steps * b.batch_size * b.seq_len
    scored = b.eval_batches * b.batch_size * b.seq_len  # windows the final loss averages over
    if b.eval_split == "test" and min(task.corpus.eval.size, scored) < 65536:
        logger.warning(
            "the test split has %d tokens, %d scored (< 64 k): noisy", task.corpus.eval.size, scored
        )
    out: dict[str, Any] = {
        "config": {
            "workers": b.workers,
            "H": b.inner_steps,
            "P": b.n_fragments,
            "tau": b.tau,
            "alpha": b.alpha,
            "codec": b.codec,
            "error_feedback": b.error_feedback,
            "outer_lr": b.outer_lr,
            "outer_momentum": b.outer_momentum,
            "inner_lr": b.inner_lr,
            "ddp_lr": b.ddp_lr,
            "steps": b.steps,
            "tokens": tokens,
            "batch_size": b.batch_size,
            "seq_len": b.seq_len,
            "model": {
                "hidden": b.hidden,
                "layers": b.layers,
                "heads": b.heads,
                "parameters": sum(p.numel() for p in task.build_model().parameters()),
            },
            "transport": "loopback threads (bytes as a ring/star all-reduce would send)",
        },
        "ddp": ddp,
        "diloco": dl,
        "bytes_ratio": ddp["bytes_per_worker"] / dl["bytes_per_worker"],
        "loss_gap": (dl["eval_loss"] - ddp["eval_loss"]) / ddp["eval_loss"],
        "seeds": [
            {"seed": sd, "ddp_eval": d, "diloco_eval": l, "loss_gap": (l - d) / d}
            for sd, d, l in per_seed
        ],
        "loss_gap_sd": (
            statistics.stdev((l - d) / d for _, d, l in per_seed) if len(per_seed) > 1 else 0.0
        ),
        "eval": {
            "corpus": b.corpus or "embedded",
            "split": b.eval_split,
            "tokens": int(task.corpus.eval.size),
            "scored_tokens": scored,
            "tokenizer": b.tokenizer or "bytes",
        },
        "quality_wall_s": timing,
    }
    if b.wall_steps:
        out["wallclock"] = _wallclock(b, task)
    if b.plot is not None:
        from diloco.metrics import plot_runs

        plot_runs(
            {
                "DDP": [
                    {"event": "eval", "step": s, "loss": l, "bytes_sent": n}
                    for s, l, n in ddp["curve"]
                ],
                f"Streaming DiLoCo ({b.codec}, H={b.inner_steps}, P={b.n_fragments})": [
                    {"event": "eval", "step": s, "loss": l, "bytes_sent": n}
                    for s, l, n in dl["curve"]
                ],
            },
            b.plot,
            title=f"{b.workers} workers, {tokens:,} tokens",
        )
        out["plot"] = str(b.plot)
    return out


def _wallclock(b: BenchConfig, task: Task) -> dict[str, Any]:
    bw, lat = b.link_mbit * 1e6 / 8, b.link_latency_ms / 1000
    runs = {
        "ddp": b.train_config(DDPConfig(), b.wall_ddp_steps),
        "diloco_no_overlap": b.train_config(b.diloco_mode(tau=0), b.wall_steps),
        "streaming_overlap": b.train_config(b.diloco_mode(), b.wall_steps),
    }
    runs = {k: dataclasses.replace(c, eval_every=0, audit_every=0) for k, c in runs.items()}
    out: dict[str, Any] = {
        "link": f"MODELLED (transport.links.model): {b.link_mbit} Mbit/s, "
        f"{b.link_latency_ms} ms one way, per worker; compute is real"
    }
    for name, cfg in runs.items():
        out[name] = _run_shaped(cfg, task, bw, lat)
    return with_speedups(out)


def with_speedups(out: dict[str, Any]) -> dict[str, Any]:
    """Add the overlap and DDP speedups (steps/s ratios) to a three-run wall-clock result."""
    out["speedup_overlap_vs_no_overlap"] = (
        out["streaming_overlap"]["steps_per_s"] / out["diloco_no_overlap"]["steps_per_s"]
    )
    out["speedup_streaming_vs_ddp"] = (
        out["streaming_overlap"]["steps_per_s"] / out["ddp"]["steps_per_s"]
    )
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.diloco",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--json", action="store_true", help="print the result as one JSON line")
    p.add_argument("--tiny", action="store_true", help="smoke-test size (seconds)")
    p.add_argument(
        "--scale",
        action="store_true",
        help="the scale preset: BPE 4096, 6.8 M parameters, M = 4 (about 15 min "
        "per seed on 2 idle cores: DDP, then DiLoCo)",
    )
    p.add_argument("--plot", type=Path, help="write eval loss vs bytes (PNG)")
    p.add_argument(
        "--seeds",
        type=int,
        default=1,
        help="repeat the quality comparison over this many seeds (means reported)",
    )
    for f in dataclasses.fields(BenchConfig):
        if f.name in ("plot",):
            continue
        flag = "--" + f.name.replace("_", "-")
        if f.type in ("bool",):
            p.add_argument(flag, action=argparse.BooleanOptionalAction, default=None)
        else:
            kind = {"int": int, "float": float, "str": str, "str | None": str}[str(f.type)]
            p.add_argument(flag, type=kind, default=None)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    base = tiny_bench() if args.tiny else scale_bench() if args.scale else BenchConfig()
    over = {
        f.name: getattr(args, f.name)
        for f in dataclasses.fields(BenchConfig)
        if f.name != "plot" and getattr(args, f.name) is not None
    }
    cfg = dataclasses.replace(base, plot=args.plot, **over)
    if args.seeds < 1:
        raise ConfigError("seeds", "must be >= 1")
    result = run_bench(cfg, seeds=args.seeds)
    if not args.json:
        print(
            f"DDP      eval {result['ddp']['eval_loss']:.4f}  "
            f"{result['ddp']['bytes_per_worker'] / 1e6:.1f} MB/worker"
        )
        print(
            f"DiLoCo   eval {result['diloco']['eval_loss']:.4f}  "
            f"{result['diloco']['bytes_per_worker'] / 1e6:.3f} MB/worker"
        )
        print(f"bytes_ratio {result['bytes_ratio']:.0f}  loss_gap {result['loss_gap']:+.4f}")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
