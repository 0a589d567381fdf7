"""What Streaming DiLoCo costs a site's compute: DiLoCo workers vs a plain PyTorch loop.

    python -m benchmarks.diloco_overhead --json            # 6.8 M parameters (minutes on 2 cores)
    python -m benchmarks.diloco_overhead --json --tiny     # seconds: the smoke test's size

Both arms run M workers as threads of this process on the same model (lowband Llama, BPE-sized
vocabulary), batch, precision, device, torch threads and optimizer kernels:

* plain: M independent ``model → loss → backward → clip → AdamW`` loops, no DiLoCo at all (no
  θ_g copy, no communicator, no schedule);
* diloco: M ``DilocoWorker`` s over the ZeroMQ transport on 127.0.0.1 (a real coordinator, TCP
  only: ``same_host="off"``), P fragments, τ > 0, int8 pseudo-gradients with error feedback.

The arms alternate ``repeats`` times (plain, diloco, plain, ...); tokens/s = tokens of all M
workers / the slowest worker's wall time over the timed steps (group formation excluded in both).
Reported: medians with min/max, ``overhead = 1 − diloco/plain`` of the medians, and
``outer_step_ms``: a worker's blocking time per fragment sync (Δ, error feedback, staging,
waiting, outer Nesterov step, merge, quorum). On CUDA ``mfu`` counts 6·N + 12·L·T·d FLOPs per
token (N: the weights of matrix products, an untied input embedding left out) against the
device's dense bf16 peak (``--peak-tflops``; H100/H200 SXM: 989).
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
from typing import Any

import torch

from diloco.common import InnerLoop
from diloco.config import (
    ComputeConfig,
    DataConfig,
    DilocoConfig,
    LrSchedule,
    OptimizerConfig,
    TrainConfig,
    byte_llama,
)
from diloco.device import resolve_device
from diloco.task import Task, lm_task
from lowband.errors import ConfigError

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class OverheadConfig:
    workers: int = 2  # M
    steps: int = 30  # timed inner steps per run and worker
    inner_steps: int = 30  # H
    n_fragments: int = 3  # P: a fragment sync every H/P = 10 steps
    tau: int = 2  # τ
    codec: str = "int8"
    hidden: int = 256
    layers: int = 6
    heads: int = 8
    vocab_size: int = 4096  # a BPE-sized embedding and head (the corpus bytes use ids < 256)
    seq_len: int = 128
    batch_size: int = 8
    repeats: int = 5
    threads: int = 1  # torch intra-op threads (both arms)
    device: str = "auto"
    precision: str = "fp32"
    peak_tflops: float = 0.0  # the device's dense peak for MFU (0: a guess from its name)

    def __post_init__(self) -> None:
        if self.workers < 2:
            raise ConfigError("workers", "the DiLoCo arm needs >= 2 workers (a real all-reduce)")
        if self.repeats < 1 or self.steps < 1:
            raise ConfigError("repeats", "repeats and steps must be >= 1")

    def train_config(self) -> TrainConfig:
        return TrainConfig(
            model=byte_llama(
                self.hidden,
                self.layers,
                self.heads,
                seq_len=self.seq_len,
                vocab_size=self.vocab_size,
            ),
            data=DataConfig(seq_len=self.seq_len, batch_size=self.batch_size, eval_batches=1),
            compute=ComputeConfig(device=self.device, precision=self.precision),  # type: ignore[arg-type]
            mode=DilocoConfig(
                inner_steps=self.inner_steps,
                n_fragments=self.n_fragments,
                tau=self.tau,
                alpha=0.5,
                codec=self.codec,
                error_feedback=True,
            ),
            inner=OptimizerConfig(name="adamw", lr=1e-3, weight_decay=0.1),
            lr_schedule=LrSchedule(warmup_steps=2),
            steps=self.steps,
            workers=self.workers,
            eval_every=0,
            checkpoint_every=0,
            log_every=max(1, self.steps),
        )


def tiny_overhead() -> OverheadConfig:
    return OverheadConfig(
        steps=8,
        inner_steps=8,
        n_fragments=2,
        tau=1,
        hidden=32,
        layers=2,
        heads=2,
        vocab_size=256,
        seq_len=16,
        batch_size=4,
        repeats=2,
    )


def _threads(fn, n: int) -> list[Any]:  # type: ignore[no-untyped-def]
    out: list[Any] = [None] * n
    errors: list[BaseException] = []

    def body(r: int) -> None:
        try:
            out[r] = fn(r)
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            errors.append(exc)

    ts = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(n)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(600)
    if errors:
        raise errors[0]
    return out


def plain_run(cfg: TrainConfig, task: Task) -> dict[str, float]:
    """M plain loops: the same InnerLoop step (model, batch, autocast, clip, AdamW kernels)."""
    device = resolve_device(cfg.compute.device)

    def one(r: int) -> float:
        loop = InnerLoop(cfg, task, task.build_model().to(device), device)
        t0 = time.perf_counter()
        while loop.step < cfg.steps:
            loop.run_step(r)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter() - t0

    walls = _threads(one, cfg.workers)
    return {"wall_s": max(walls)}


def diloco_run(cfg: TrainConfig, task: Task) -> dict[str, float]:
    from diloco.common import run_signature
    from diloco.trainer import DilocoWorker
    from transport.coordinator import Coordinator, CoordinatorConfig
    from transport.zmq_comm import ZmqConfig, connect

    sig = run_signature(cfg, task.build_model()).hex()
    with Coordinator(CoordinatorConfig(bind="tcp://127.0.0.1:0", heartbeat_interval=1.0)) as co:

        def one(r: int) -> Any:
            comm = connect(
                co.address,
                ZmqConfig(bind_host="127.0.0.1", same_host="off", timeout=cfg.sync_timeout),
                signature=sig,
            )
            try:
                result = DilocoWorker(cfg, comm, task).run()
                comm.barrier(tag="bench/done", timeout=cfg.sync_timeout)
                return result
            finally:
                comm.close()

        results = _threads(one, cfg.workers)
    syncs = max(1, max(r.outer_syncs for r in results))
    return {
        "wall_s": max(r.wall_s for r in results),
        "outer_step_ms": 1000 * statistics.mean(r.sync_s for r in results) / syncs,
        "outer_syncs": syncs,
        "bytes_per_worker": statistics.mean(r.bytes_sent for r in results),
    }


def _stats(xs: list[float]) -> dict[str, float]:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}


def flops_per_token(cfg: TrainConfig, params: int) -> float:
    """Training FLOPs per token: 6 per weight that a token multiplies through (forward 2,
    backward 4) plus attention's 12·L·T·d. The input embedding is a lookup, not a product, so
    an untied one is left out (a tied one is the head's product and stays in)."""
    m = cfg.model
    assert m is not None  # the bench builds its own ModelConfig
    matmul = params if m.tie_word_embeddings else params - m.vocab_size * m.hidden_size
    return 6 * matmul + 12 * m.num_hidden_layers * cfg.data.seq_len * m.hidden_size


PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0, "L4": 121.0, "A10": 125.0}


def run_overhead(b: OverheadConfig) -> dict[str, Any]:
    torch.set_num_threads(b.threads)
    cfg = b.train_config()
    task = lm_task(cfg)
    params = sum(p.numel() for p in task.build_model().parameters())
    tokens = b.workers * b.steps * b.batch_size * b.seq_len
    plain, dl, outer_ms, syncs = [], [], [], 0
    t_start = time.perf_counter()
    for i in range(b.repeats):  # alternate: the machine's load drifts, the pairs see the same
        t0 = time.perf_counter()
        p = plain_run(cfg, task)
        plain.append(tokens / p["wall_s"])
        t1 = time.perf_counter()
        d = diloco_run(cfg, task)
        dl.append(tokens / d["wall_s"])
        t2 = time.perf_counter()
        print(
            f"repeat {i}: plain {p['wall_s']:.2f} s timed ({t1 - t0:.1f} s with setup), "
            f"diloco {d['wall_s']:.2f} s timed ({t2 - t1:.1f} s with setup), outer step "
            f"{d['outer_step_ms']:.1f} ms; {t2 - t_start:.0f} s so far",
            file=sys.stderr,
            flush=True,
        )
        outer_ms.append(d["outer_step_ms"])
        syncs = int(d["outer_syncs"])
    device = resolve_device(b.device)
    out: dict[str, Any] = {
        "device": str(device),
        "params": params,
        "dtype": b.precision,
        "workers": b.workers,
        "threads_per_worker": b.threads,
        "steps": b.steps,
        "repeats": b.repeats,
        "H": b.inner_steps,
        "P": b.n_fragments,
        "tau": b.tau,
        "codec": b.codec,
        "transport": "ZeroMQ, 127.0.0.1 TCP (same_host=off), workers as threads",
        "batch_tokens": b.batch_size * b.seq_len,
        "tokens_per_s_plain": statistics.median(plain),
        "tokens_per_s_diloco": statistics.median(dl),
        "overhead": 1 - statistics.median(dl) / statistics.median(plain),
        "outer_step_ms": statistics.median(outer_ms),
        "outer_syncs_per_run": syncs,
        "plain": _stats(plain),
        "diloco": _stats(dl),
        "outer_step_ms_stats": _stats(outer_ms),
        "pairs_overhead": [1 - d / p for p, d in zip(plain, dl)],
    }
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        peak = b.peak_tflops or next((v for k, v in PEAK_TFLOPS.items() if k in name), 0.0)
        fpt = flops_per_token(cfg, params)
        out["gpu"] = name
        out["flops_per_token"] = fpt
        out["peak_tflops"] = peak
        out["mfu"] = (statistics.median(dl) * fpt / (peak * 1e12)) if peak else None
        out["mfu_plain"] = (statistics.median(plain) * fpt / (peak * 1e12)) if peak else None
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.diloco_overhead",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--json", action="store_true", help="print only the JSON line")
    p.add_argument("--tiny", action="store_true", help="smoke-test size (seconds)")
    for f in dataclasses.fields(OverheadConfig):
        kind = {"int": int, "float": float, "str": str}[str(f.type)]
        p.add_argument("--" + f.name.replace("_", "-"), type=kind, default=None)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    base = tiny_overhead() if args.tiny else OverheadConfig()
    over = {
        f.name: getattr(args, f.name)
        for f in dataclasses.fields(OverheadConfig)
        if getattr(args, f.name) is not None
    }
    result = run_overhead(dataclasses.replace(base, **over))
    if not args.json:
        print(
            f"{result['params'] / 1e6:.2f} M params on {result['device']} ({result['dtype']}): "
            f"plain {result['tokens_per_s_plain']:.0f} tok/s, DiLoCo "
            f"{result['tokens_per_s_diloco']:.0f} tok/s, overhead {result['overhead']:+.1%}"
        )
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
