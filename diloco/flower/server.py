"""The ServerApp side: build θ_g, run :class:`DiLoCoStrategy` for R rounds, evaluate, checkpoint.

The server evaluates θ_g itself (Flower's ``evaluate_fn``) on the run's held-out data before the
first round and after every round, so the metrics show the global model's loss against the
bytes moved whatever the clients do. With ``out-dir`` set it writes there:

* ``metrics.jsonl`` — ``round``, ``eval``, ``fed_eval`` and ``final`` records (``diloco.metrics``);
* ``checkpoints/round-NNNN/`` every ``checkpoint-every`` rounds and ``checkpoint/`` at the end:
  HF-format ``config.json`` + ``model.safetensors`` (loadable by ``edge`` and ``transformers``)
  plus ``outer.safetensors``/``outer.json`` (the Nesterov momentum of every fragment);
* ``summary.json`` — the ``final`` record.

The run's state lives on the server alone (a client keeps no θ_g between rounds), so the
summary's :class:`~diloco.metrics.RunSummary` expects one final state, the server's.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, MetricRecord
from flwr.serverapp import Grid, ServerApp

from diloco.flower.config import FlowerConfig, from_run_config
from diloco.flower.records import BYTES_UP, BYTES_UP_FP32, EVAL_LOSS, summary_key
from diloco.flower.strategy import DiLoCoStrategy
from diloco.metrics import MetricsLog, RunSummary
from diloco.task import Task, lm_task


def run_server(grid: Grid, cfg: FlowerConfig, *, task: Task | None = None) -> dict[str, Any]:
    """Run the federation on ``grid``; return the summary (also ``summary.json`` in out-dir)."""
    t0 = time.perf_counter()
    task = task or lm_task(cfg.train)
    out = Path(cfg.out_dir) if cfg.out_dir else None
    log = MetricsLog(out / "metrics.jsonl" if out else None, worker="server")
    strategy = DiLoCoStrategy(
        task.build_model(),
        cfg,
        log=log,
        checkpoint_dir=out / "checkpoints" if out else None,
        byte_tokenizer=cfg.train.data.kind != "tokens",
    )
    evals: dict[int, float] = {}
    per_client_up = 0.0

    def evaluate_fn(server_round: int, arrays: ArrayRecord) -> MetricRecord:
        # θ_g lives in the strategy's model; ``arrays`` is a serialized copy of it.
        nonlocal per_client_up
        if server_round > 0 and strategy.history and strategy.history[-1]["replies"]:
            last = strategy.history[-1]
            per_client_up += last[BYTES_UP] / last["replies"]
        loss = task.evaluate(strategy.model)
        evals[server_round] = loss
        log.log(
            "eval",
            round=server_round,
            step=server_round * cfg.steps_per_round,
            loss=loss,
            bytes_sent=int(per_client_up),
            **strategy.totals,
        )
        return MetricRecord({EVAL_LOSS: loss})

    strategy.start(
        grid=grid,
        initial_arrays=strategy.global_record(),
        num_rounds=cfg.federation.rounds,
        timeout=cfg.federation.round_timeout,
        train_config=ConfigRecord(),
        evaluate_config=ConfigRecord(),
        evaluate_fn=evaluate_fn,
    )
    if out is not None:
        strategy.save_checkpoint(out / "checkpoint", cfg.federation.rounds)
    t = strategy.totals
    up, up32 = summary_key(BYTES_UP), summary_key(BYTES_UP_FP32)
    final = {"state_hash": strategy.state_hash()}
    run = RunSummary.from_finals(["server"], {"server": final})
    summary: dict[str, Any] = {
        "rounds": cfg.federation.rounds,
        "rounds_applied": sum(r["applied"] for r in strategy.history),
        "failures": sum(r["failures"] for r in strategy.history),
        "initial_eval": evals.get(0),
        "final_eval": evals.get(cfg.federation.rounds),
        "codec": cfg.mode.codec,
        "fragments": cfg.mode.n_fragments,
        "inner_steps": cfg.mode.inner_steps,
        **t,
        "uplink_reduction": t[up32] / t[up] if t[up] else None,
        "wall_s": round(time.perf_counter() - t0, 3),
        **final,
        **run.to_dict(),
    }
    log.log("final", **summary)
    log.close()
    if out is not None:
        (out / "summary.json").write_text(json.dumps(summary, indent=2, sort_keys=True))
    return summary


def make_server_app() -> ServerApp:
    """The ServerApp: parses Flower's run config and calls :func:`run_server`."""
    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        cfg = from_run_config(context.run_config)
        if cfg.threads:  # the ServerApp is its own process: the setting is ours to make
            torch.set_num_threads(cfg.threads)
        run_server(grid, cfg)

    return app
