"""What Streaming DiLoCo costs a site's compute: DiLoCo workers vs a plain loop vs a peer.

    python -m benchmarks.diloco_overhead --json            # 6.8 M parameters (minutes on 2 cores)
    python -m benchmarks.diloco_overhead --json --tiny     # seconds: the smoke test's size
    python -m benchmarks.diloco_overhead --json --device cuda --precision bf16 --preset 350m
    python -m benchmarks.diloco_overhead --json --device cuda --precision bf16 --preset 1b

Every arm runs M workers as threads of this process on the same model (lowband Llama), batch,
precision, device, torch threads, compile setting and optimizer kernels:

* peer: nanoGPT's ``train.py`` loop written to the same bar, with nothing of lowband's loop in
  it: ``torch.compile`` of the model (static shapes), fused AdamW on CUDA (foreach on the CPU),
  autocast, the model's SDPA causal kernel, the next batch cut and pinned while the device
  works, no host read until the end (torchtitan, the other reference, needs a GPU and a
  distributed launch; it is not run here);
* plain: M ``diloco.common.InnerLoop`` loops, lowband's inner step without DiLoCo (no θ_g copy,
  no communicator, no schedule);
* diloco: M ``DilocoWorker`` s over the ZeroMQ transport on 127.0.0.1 (a real coordinator, TCP
  only: ``same_host="off"``), P fragments, τ > 0, int8 pseudo-gradients with error feedback.

The arms alternate ``repeats`` times (peer, plain, diloco, peer, ...). Each run's first
``warmup`` steps (compilation, allocator, lazy optimizer state) are not timed; tokens/s =
tokens of all M workers over steps ``warmup+1 .. steps`` / the slowest worker's wall time over
those steps (group formation excluded). Reported per arm: medians with min/max and MFU;
``overhead = 1 − diloco/plain`` and ``overhead_vs_peer`` of the medians; ``outer_step_ms``: a
worker's blocking time per fragment sync (Δ, error feedback, staging, waiting, outer Nesterov
step, merge, quorum), and ``exposed_outer_ms``: the wall time per sync that DiLoCo adds to the
plain loop (what τ did not hide). ``mfu`` counts 6·N + 12·L·T·d FLOPs per token (N: the
weights of matrix products, an untied input embedding left out) against the device's dense peak
(``--peak-tflops``; on CUDA a guess from its name, H100/H200 SXM bf16: 989; none on the CPU).
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
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F

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
from diloco.device import autocast, compiles, resolve_device
from diloco.task import Task, lm_task
from lowband.errors import ConfigError
from lowband.models.config import ModelConfig

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class OverheadConfig:
    workers: int = 2  # M
    steps: int = 30  # inner steps per run and worker (the first ``warmup`` are not timed)
    warmup: int = 2  # untimed steps at the start of each run (>= 1)
    inner_steps: int = 30  # H
    n_fragments: int = 3  # P: a fragment sync every H/P = 10 steps
    tau: int = 2  # τ
    codec: str = "int8"
    hidden: int = 256
    layers: int = 6
    heads: int = 8
    kv_heads: int = 0  # GQA key/value heads (0: as many as query heads)
    intermediate: int = 0  # SwiGLU width (0: 8·hidden/3 rounded up to 8)
    vocab_size: int = 4096  # a BPE-sized embedding and head (the corpus bytes use ids < 256)
    seq_len: int = 128
    batch_size: int = 8
    micro_batches: int = 1  # gradient accumulation (every arm)
    repeats: int = 5
    threads: int = 1  # torch intra-op threads (every arm)
    device: str = "auto"
    precision: str = "fp32"
    compile: str = "auto"  # auto (on with CUDA) | on | off, every arm
    peak_tflops: float = 0.0  # the device's dense peak for MFU (0: a guess from its name)

    def __post_init__(self) -> None:
        if self.workers < 2:
            raise ConfigError("workers", "the DiLoCo arm needs >= 2 workers (a real all-reduce)")
        if self.repeats < 1 or self.steps < 1:
            raise ConfigError("repeats", "repeats and steps must be >= 1")
        if not 1 <= self.warmup < self.steps:
            raise ConfigError("warmup", f"must be in [1, steps), got {self.warmup}")
        if self.compile not in ("auto", "on", "off"):
            raise ConfigError("compile", f"auto, on or off, got {self.compile!r}")

    def model_config(self) -> ModelConfig:
        m = byte_llama(
            self.hidden, self.layers, self.heads, seq_len=self.seq_len, vocab_size=self.vocab_size
        )
        return dataclasses.replace(
            m,
            num_key_value_heads=self.kv_heads or None,
            intermediate_size=self.intermediate or m.intermediate_size,
        )

    def train_config(self) -> TrainConfig:
        compile = {"auto": None, "on": True, "off": False}[self.compile]
        return TrainConfig(
            model=self.model_config(),
            data=DataConfig(seq_len=self.seq_len, batch_size=self.batch_size, eval_batches=1),
            compute=ComputeConfig(
                device=self.device,
                precision=self.precision,  # type: ignore[arg-type]
                micro_batches=self.micro_batches,
                compile=compile,
            ),
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
        warmup=1,
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


def preset_350m() -> OverheadConfig:
    """The 368 M-parameter Llama of the H100 figures (``diloco.config.llama_350m``): batch
    8 × 1024 per worker, 40 steps, 8 torch threads."""
    return OverheadConfig(
        hidden=1024,
        layers=24,
        heads=16,
        vocab_size=32000,
        seq_len=1024,
        batch_size=8,
        steps=40,
        warmup=3,
        threads=8,
    )


def preset_1b() -> OverheadConfig:
    """The 1.1 B-parameter Llama (``diloco.config.llama_1b``, TinyLlama's shape): batch 4 × 2048
    per worker in 2 micro-batches. Two DiLoCo workers hold 2 × ~31 GB of fp32 state (θ_m, its
    gradients, AdamW moments, θ_g, outer momentum, residual) plus activations: an H200, or an
    H100 with ``--batch-size 2 --micro-batches 1``."""
    return OverheadConfig(
        hidden=2048,
        layers=22,
        heads=32,
        kv_heads=4,
        intermediate=5632,
        vocab_size=32000,
        seq_len=2048,
        batch_size=4,
        micro_batches=2,
        steps=30,
        warmup=3,
        threads=8,
    )


BENCH_PRESETS: dict[str, Callable[[], OverheadConfig]] = {
    "tiny": tiny_overhead,
    "350m": preset_350m,
    "1b": preset_1b,
}


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


class _Window:
    """Wall time of steps ``warmup+1 .. steps`` of one worker: stamped after step ``warmup``
    and after the last step, the device drained first so queued kernels are counted. The M
    workers of a run share ``start``: each waits there after its warm-up, so no worker's timed
    steps overlap another's compilation or lazy set-up (that would flatter every arm)."""

    def __init__(
        self, cfg: TrainConfig, warmup: int, device: torch.device, start: threading.Barrier
    ) -> None:
        self.cfg, self.warmup, self.device, self.start = cfg, warmup, device, start
        self.t0 = self.t1 = 0.0

    def __call__(self, step: int) -> None:
        if step not in (self.warmup, self.cfg.steps):
            return
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        if step == self.warmup:
            self.start.wait(timeout=600)
            self.t0 = time.perf_counter()
        if step == self.cfg.steps:
            self.t1 = time.perf_counter()

    @property
    def wall_s(self) -> float:
        return self.t1 - self.t0


def peer_run(cfg: TrainConfig, task: Task, warmup: int) -> dict[str, float]:
    """M loops as nanoGPT's ``train.py`` writes them: nothing of ``InnerLoop`` in the step."""
    device = resolve_device(cfg.compute.device)
    c, inner = cfg.compute, cfg.inner
    n = c.micro_batches
    start = threading.Barrier(cfg.workers)

    def one(r: int) -> float:
        model = task.build_model().to(device)
        fwd = torch.compile(model, dynamic=False) if compiles(c.compile, device) else model
        kernels = {"fused": True} if device.type == "cuda" else {"foreach": True}
        opt = torch.optim.AdamW(
            model.parameters(),
            lr=inner.lr,
            betas=inner.betas,
            eps=inner.eps,
            weight_decay=inner.weight_decay,
            **kernels,
        )
        scaler = torch.amp.GradScaler(device.type) if c.precision == "fp16" else None
        pool = ThreadPoolExecutor(1)

        def fetch(step: int) -> torch.Tensor:  # nanoGPT's get_batch: pinned, copied async
            b = task.train_batch(r, step)
            return b.pin_memory() if device.type == "cuda" else b

        window = _Window(cfg, warmup, device, start)
        nxt = pool.submit(fetch, 0)
        for step in range(cfg.steps):
            batch = nxt.result().to(device, non_blocking=True)
            nxt = pool.submit(fetch, step + 1)
            for g in opt.param_groups:
                g["lr"] = inner.lr * cfg.lr_schedule.factor(step, cfg.steps)
            for micro in batch.chunk(n):
                with autocast(device, c.precision):
                    logits = fwd(micro[:, :-1])
                    loss = F.cross_entropy(
                        logits.reshape(-1, logits.shape[-1]).float(), micro[:, 1:].reshape(-1)
                    )
                (loss / n if scaler is None else scaler.scale(loss / n)).backward()
            if scaler is not None:
                scaler.unscale_(opt)
            if cfg.grad_clip is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
            if scaler is not None:
                scaler.step(opt)
                scaler.update()
            else:
                opt.step()
            opt.zero_grad(set_to_none=True)
            window(step + 1)
        pool.shutdown(wait=True)
        return window.wall_s

    return {"wall_s": max(_threads(one, cfg.workers))}


def plain_run(cfg: TrainConfig, task: Task, warmup: int) -> dict[str, float]:
    """M plain loops: the same InnerLoop step (model, batch, autocast, clip, AdamW kernels)."""
    device = resolve_device(cfg.compute.device)
    start = threading.Barrier(cfg.workers)

    def one(r: int) -> float:
        loop = InnerLoop(cfg, task, task.build_model().to(device), device)
        window = _Window(cfg, warmup, device, start)
        while loop.step < cfg.steps:
            loop.run_step(r)
            window(loop.step)
        loop.close()
        return window.wall_s

    return {"wall_s": max(_threads(one, cfg.workers))}


def diloco_run(cfg: TrainConfig, task: Task, warmup: int) -> dict[str, float]:
    from diloco.common import run_signature
    from diloco.trainer import DilocoWorker
    from transport.coordinator import Coordinator, CoordinatorConfig
    from transport.zmq_comm import ZmqConfig, connect

    device = resolve_device(cfg.compute.device)
    sig = run_signature(cfg, task.build_model()).hex()
    start = threading.Barrier(cfg.workers)
    with Coordinator(CoordinatorConfig(bind="tcp://127.0.0.1:0", heartbeat_interval=1.0)) as co:

        def one(r: int) -> Any:
            comm = connect(
                co.address,
                ZmqConfig(bind_host="127.0.0.1", same_host="off", timeout=cfg.sync_timeout),
                signature=sig,
            )
            window = _Window(cfg, warmup, device, start)
            try:
                result = DilocoWorker(cfg, comm, task, on_step=window).run()
                comm.barrier(tag="bench/done", timeout=cfg.sync_timeout)
                return result, window.wall_s
            finally:
                comm.close()

        results = _threads(one, cfg.workers)
    syncs = max(1, max(r.outer_syncs for r, _ in results))
    return {
        "wall_s": max(w for _, w in results),
        "outer_step_ms": 1000 * statistics.mean(r.sync_s for r, _ in results) / syncs,
        "outer_syncs": syncs,
        "bytes_per_worker": statistics.mean(r.bytes_sent for r, _ in results),
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


ARMS = ("peer", "plain", "diloco")


def _mfu(tokens_per_s: float, fpt: float, peak: float) -> float | None:
    return tokens_per_s * fpt / (peak * 1e12) if peak else None


def run_overhead(b: OverheadConfig) -> dict[str, Any]:
    torch.set_num_threads(b.threads)
    cfg = b.train_config()
    task = lm_task(cfg)
    with torch.device("meta"):
        params = sum(p.numel() for p in task.build_model().parameters())
    tokens = b.workers * (b.steps - b.warmup) * b.batch_size * b.seq_len
    runs = {"peer": peer_run, "plain": plain_run, "diloco": diloco_run}
    tps: dict[str, list[float]] = {a: [] for a in ARMS}
    walls: dict[str, list[float]] = {a: [] for a in ARMS}
    outer_ms, syncs = [], 0
    t_start = time.perf_counter()
    for i in range(b.repeats):  # alternate: the machine's load drifts, the arms see the same
        line = []
        for arm in ARMS:
            t0 = time.perf_counter()
            res = runs[arm](cfg, task, b.warmup)
            walls[arm].append(res["wall_s"])
            tps[arm].append(tokens / res["wall_s"])
            line.append(f"{arm} {res['wall_s']:.2f} s ({time.perf_counter() - t0:.1f} s in all)")
            if arm == "diloco":
                outer_ms.append(res["outer_step_ms"])
                syncs = int(res["outer_syncs"])
        print(
            f"repeat {i}: " + ", ".join(line) + f", outer step {outer_ms[-1]:.1f} ms; "
            f"{time.perf_counter() - t_start:.0f} s so far",
            file=sys.stderr,
            flush=True,
        )
    device = resolve_device(b.device)
    med = {a: statistics.median(tps[a]) for a in ARMS}
    fpt = flops_per_token(cfg, params)
    peak = b.peak_tflops
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        peak = peak or next((v for k, v in PEAK_TFLOPS.items() if k in name), 0.0)
    out: dict[str, Any] = {
        "device": str(device),
        "params": params,
        "dtype": b.precision,
        "compiled": compiles(cfg.compute.compile, device),
        "workers": b.workers,
        "threads_per_worker": b.threads,
        "steps": b.steps,
        "warmup": b.warmup,
        "repeats": b.repeats,
        "H": b.inner_steps,
        "P": b.n_fragments,
        "tau": b.tau,
        "codec": b.codec,
        "transport": "ZeroMQ, 127.0.0.1 TCP (same_host=off), workers as threads",
        "batch_tokens": b.batch_size * b.seq_len,
        "micro_batches": b.micro_batches,
        "tokens_per_s_peer": med["peer"],
        "tokens_per_s_plain": med["plain"],
        "tokens_per_s_diloco": med["diloco"],
        "overhead": 1 - med["diloco"] / med["plain"],
        "overhead_vs_peer": 1 - med["diloco"] / med["peer"],
        "plain_vs_peer": 1 - med["plain"] / med["peer"],
        "outer_step_ms": statistics.median(outer_ms),
        "exposed_outer_ms": 1000
        * (statistics.median(walls["diloco"]) - statistics.median(walls["plain"]))
        / max(1, syncs),
        "outer_syncs_per_run": syncs,
        **{a: _stats(tps[a]) for a in ARMS},
        "outer_step_ms_stats": _stats(outer_ms),
        "pairs_overhead": [1 - d / p for p, d in zip(tps["plain"], tps["diloco"])],
        "flops_per_token": fpt,
        "peak_tflops": peak or None,
        **{f"mfu_{a}": _mfu(med[a], fpt, peak) for a in ARMS},
    }
    out["mfu"] = out["mfu_diloco"]
    if device.type == "cuda":
        out["gpu"] = torch.cuda.get_device_name(device)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.diloco_overhead",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--json", action="store_true", help="print only the JSON line")
    p.add_argument("--tiny", action="store_true", help="smoke-test size (seconds)")
    p.add_argument(
        "--preset",
        choices=sorted(BENCH_PRESETS),
        help="a model size (flags still override its fields): 350m, 1b or tiny",
    )
    for f in dataclasses.fields(OverheadConfig):
        kind = {"int": int, "float": float, "str": str}[str(f.type)]
        p.add_argument("--" + f.name.replace("_", "-"), type=kind, default=None)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if args.tiny and args.preset not in (None, "tiny"):
        raise SystemExit("--tiny is --preset tiny; give one size")
    name = "tiny" if args.tiny else args.preset
    base = BENCH_PRESETS[name]() if name else OverheadConfig()
    over = {
        f.name: getattr(args, f.name)
        for f in dataclasses.fields(OverheadConfig)
        if getattr(args, f.name) is not None
    }
    result = run_overhead(dataclasses.replace(base, **over))
    if not args.json:
        print(
            f"{result['params'] / 1e6:.2f} M params on {result['device']} ({result['dtype']}): "
            f"peer {result['tokens_per_s_peer']:.0f} tok/s, "
            f"plain {result['tokens_per_s_plain']:.0f} tok/s, DiLoCo "
            f"{result['tokens_per_s_diloco']:.0f} tok/s, overhead {result['overhead']:+.1%}"
        )
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
