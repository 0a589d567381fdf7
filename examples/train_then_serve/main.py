"""Train a tiny Llama with Streaming DiLoCo, export it as a Hugging Face checkpoint, and generate
text with it split over two devices (tensor parallelism, TP-2) by the edge runtime.

    python examples/train_then_serve/main.py --out run          # ~1 minute on 2 cores
    python examples/train_then_serve/main.py --out run --tiny   # seconds (the smoke test)

Steps:
1. two DiLoCo workers (loopback threads) train a byte-level Llama on the embedded Shakespeare
   sample; worker 0 exports the global model to ``OUT/model``: ``config.json`` +
   ``model.safetensors`` (HF names, loadable by ``transformers``) + the byte-tokenizer marker;
2. the export is loaded back (``lowband.models.weights.load_pretrained``) and must score the same
   held-out loss as the trainer's final evaluation;
3. a coordinator and one ``lowband edge worker`` process (device 2) are started; this process is
   the master (device 1) and runs the engine: every layer's attention heads and MLP columns are
   split between the two devices, activations all-reduced over TCP;
4. the same prompt is completed on one device with the same seeded sampler, for comparison.

The CLI equivalent of steps 3-4: ``lowband edge run OUT/model --devices 2`` (HTTP API, see
examples/edge_http) or ``lowband edge generate OUT/model --prompt ...``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import torch

from diloco.config import (
    DataConfig,
    DilocoConfig,
    LrSchedule,
    OptimizerConfig,
    TrainConfig,
    byte_llama,
)
from diloco.launch import run_threads
from diloco.task import lm_task
from edge.cluster import ClusterConfig
from edge.engine import Engine, LocalRunner
from edge.launch import ServeMasterConfig, build_engine
from edge.sampling import SamplingParams
from lowband.models.tokenizer import ByteTokenizer
from lowband.models.weights import load_pretrained
from transport.coordinator import Coordinator, CoordinatorConfig


def train(out: Path, tiny: bool) -> tuple[Path, float]:
    steps = 60 if tiny else 600
    cfg = TrainConfig(
        model=byte_llama(hidden=64, layers=2, heads=4, seq_len=128),  # 4 heads: 2 per device
        data=DataConfig(seq_len=64, batch_size=8),
        mode=DilocoConfig(
            inner_steps=20 if tiny else 60,
            n_fragments=2 if tiny else 3,
            tau=2,
            alpha=0.5,
            codec="nf4",
            error_feedback=True,
            outer=OptimizerConfig(name="sgd", lr=1.0, momentum=0.9, nesterov=True),
        ),
        inner=OptimizerConfig(name="adamw", lr=6e-3, weight_decay=0.1),
        lr_schedule=LrSchedule(warmup_steps=10 if tiny else 60),
        steps=steps,
        workers=2,
        eval_every=0,
    )
    results = run_threads(cfg, out_dir=out)  # worker 0 writes out/model at the end
    final = next(r.final_eval for r in results if r.final_eval is not None)
    reloaded = lm_task(cfg).evaluate(load_pretrained(out / "model"))
    print(
        f"trained {steps} steps x 2 workers: held-out loss {final:.4f}; "
        f"reloaded export: {reloaded:.4f}"
    )
    if abs(reloaded - final) > 1e-4:
        raise SystemExit("the exported checkpoint does not reproduce the trained model")
    return out / "model", final


def generate_tp2(model_dir: Path, prompt: str, params: SamplingParams) -> tuple[str, int]:
    """Master (this process) + one worker process; returns (text, activation bytes moved)."""
    coord = Coordinator(CoordinatorConfig(bind="tcp://127.0.0.1:0")).start()
    worker = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "cli",
            "edge",
            "worker",
            "--master",
            coord.address,
            "--threads",
            "1",
            "--model-dir",
            str(model_dir),
        ],
        start_new_session=True,
    )
    engine = comm = None
    try:
        serve = ServeMasterConfig(model_dir=str(model_dir), cluster=ClusterConfig(devices=2))
        engine, coord, comm = build_engine(serve, coord)  # waits for the worker, sends its slice
        text, _reason, n = engine.complete(prompt, params)
        print(f"TP-2 generated {n} tokens")
        return text, engine.runner.wire_bytes()
    finally:
        if engine is not None:
            engine.runner.close()  # tells the worker to shut down
        if comm is not None:
            comm.close()
        coord.stop()
        try:
            worker.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(worker.pid, signal.SIGKILL)
            worker.wait()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("train-then-serve"))
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--prompt", default="ROMEO:\n")
    ap.add_argument("--max-tokens", type=int, default=48)
    args = ap.parse_args()
    torch.set_num_threads(1)

    model_dir, final = train(args.out, args.tiny)
    print(f"exported {model_dir}: {sorted(p.name for p in model_dir.iterdir())}")
    # Seeded sampling: both runs draw the same random numbers, so equal logits give equal text.
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.8, top_k=40, seed=0)
    tp_text, wire = generate_tp2(model_dir, args.prompt, params)
    local = Engine(LocalRunner(load_pretrained(model_dir)), ByteTokenizer(), model_name="local")
    one_text, _, _ = local.complete(args.prompt, params)
    print(f"--- TP-2 over TCP ({wire / 1024:.1f} KiB of activations) ---\n{args.prompt}{tp_text}")
    print(f"--- same prompt on one device: {'identical' if one_text == tp_text else 'DIFFERENT'}")
    print(
        json.dumps(
            {
                "final_eval": final,
                "model_dir": str(model_dir),
                "tp2_text": tp_text,
                "single_text": one_text,
                "wire_bytes": wire,
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
