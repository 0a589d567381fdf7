"""Tiers 3-4: real worker processes over ZeroMQ on 127.0.0.1 (with a kill -9), and the CLI."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from diloco.config import DilocoConfig, config_to_dict
from diloco.metrics import read_jsonl
from tests.diloco.configs import small_lm

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

PY = sys.executable


def small_cfg(**over):
    kw = dict(
        workers=3,
        steps=160,
        log_every=5,
        mode=DilocoConfig(inner_steps=8, n_fragments=2, tau=1, codec="int8", error_feedback=True),
        sync_timeout=10.0,
    )
    return small_lm(**{**kw, **over})


def _wait_for(pred, timeout, what):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def _last_step(path: Path) -> int:
    if not path.exists():
        return 0
    steps = [r["step"] for r in read_jsonl(path) if r["event"] == "step"]
    return max(steps, default=0)


def test_real_processes_survive_kill_9_and_admit_a_newcomer(tmp_path, spawn):
    """Three `lowband worker` processes; one is killed with SIGKILL mid-run, a fourth joins
    later. The survivors and the newcomer must all finish bit-identical in the global state."""
    from transport.coordinator import Coordinator, CoordinatorConfig

    cfg = small_cfg(steps=300)
    (tmp_path / "config.json").write_text(json.dumps(config_to_dict(cfg)))

    def worker(i):
        log = (tmp_path / f"out{i}.txt").open("w")
        return spawn(
            [
                PY,
                "-m",
                "cli",
                "worker",
                "--coordinator",
                coord.address,
                "--config",
                str(tmp_path / "config.json"),
                "--id",
                str(i),
                "--out",
                str(tmp_path),
                "--threads",
                "1",
                "--bind-host",
                "127.0.0.1",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )

    with Coordinator(CoordinatorConfig(bind="tcp://127.0.0.1:0", heartbeat_interval=2.0)) as coord:
        procs = [worker(i) for i in range(3)]
        victim = tmp_path / "metrics-worker2.jsonl"
        _wait_for(lambda: _last_step(victim) >= 20, 120, "worker 2 to train 20 steps")
        os.killpg(procs[2].pid, signal.SIGKILL)
        procs.append(worker(3))  # joins the running group at its next sync point
        codes = [procs[i].wait(timeout=150) for i in (0, 1, 3)]
        outs = {i: (tmp_path / f"out{i}.txt").read_text() for i in (0, 1, 3)}
        assert codes == [0, 0, 0], outs
    assert procs[2].wait(10) == -signal.SIGKILL
    finals = {i: json.loads(o.strip().splitlines()[-1]) for i, o in outs.items()}
    assert {f["steps"] for f in finals.values()} == {300}
    assert len({f["state_hash"] for f in finals.values()}) == 1  # bit-identical global state
    assert finals[3]["start_step"] > 20 and finals[3]["transfers"] == 1
    events = read_jsonl(tmp_path / "metrics-worker0.jsonl")
    changes = [e for e in events if e["event"] == "membership"]
    assert any(len(e["left"]) == 1 for e in changes) and any(e["joined"] for e in changes)
    assert _last_step(victim) < 300
    # Syncs in flight at the kill failed with PeerLost on the survivors, not at their deadline.
    recoveries = [
        e
        for i in (0, 1)
        for e in read_jsonl(tmp_path / f"metrics-worker{i}.jsonl")
        if e["event"] == "recovery"
    ]
    assert not [e for e in recoveries if "did not complete within" in e.get("error", "")], (
        recoveries
    )


def test_different_model_is_refused_by_the_coordinator(tmp_path):
    from diloco.common import run_signature
    from diloco.launch import WorkerLaunch, worker_main
    from diloco.task import lm_task
    from lowband.errors import IncompatiblePeer
    from transport.coordinator import Coordinator, CoordinatorConfig
    from transport.zmq_comm import ZmqConfig, connect

    cfg = small_cfg(workers=2)
    other = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, num_hidden_layers=3))
    with Coordinator(CoordinatorConfig(bind="tcp://127.0.0.1:0")) as coord:
        sig = run_signature(cfg, lm_task(cfg).build_model()).hex()
        first = connect(coord.address, ZmqConfig(bind_host="127.0.0.1"), signature=sig)
        try:
            with pytest.raises(IncompatiblePeer):
                worker_main(
                    WorkerLaunch(
                        train=other,
                        coordinator=coord.address,
                        transport=ZmqConfig(bind_host="127.0.0.1"),
                    )
                )
        finally:
            first.close()


def test_cli_train_loopback_writes_a_model_edge_loads(tmp_path, capsys):
    from cli import main
    from lowband.models.weights import load_pretrained

    out = tmp_path / "run"
    rc = main(
        [
            "train",
            "--workers",
            "2",
            "--preset",
            "tiny",
            "--steps",
            "20",
            "--eval-every",
            "10",
            "-H",
            "10",
            "-P",
            "2",
            "--tau",
            "1",
            "--codec",
            "nf4",
            "--loopback",
            "--no-progress",
            "--out",
            str(out),
        ]
    )
    assert rc == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["consistent"] and len(summary["finished"]) == 2
    assert summary["final_eval"] < 5.0
    # The starting model's loss is the first point: random init over 256 bytes, ~ln 256.
    assert summary["initial_eval"] == pytest.approx(np.log(256), abs=0.3)
    assert summary["initial_eval"] > summary["final_eval"]
    assert (out / "eval_vs_bytes.png").stat().st_size > 1000
    assert json.loads((out / "config.json").read_text())["mode"]["codec"] == "nf4"
    model = load_pretrained(out / "model")
    assert model(torch.tensor([[1, 2, 3]])).shape == (1, 3, 256)


def test_cli_refuses_bad_config_before_starting(tmp_path, capsys):
    from cli import main

    assert (
        main(["train", "--workers", "2", "-H", "10", "-P", "3", "--out", str(tmp_path / "x")]) == 2
    )
    assert "n_fragments" in capsys.readouterr().err and not (tmp_path / "x").exists()
    assert main(["train", "--tau", "5", "-H", "10", "-P", "2", "--out", str(tmp_path / "x")]) == 2
    assert "tau" in capsys.readouterr().err
    assert main(["train", "--codec", "int3", "--out", str(tmp_path / "x")]) == 2
    assert "codec" in capsys.readouterr().err
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    assert main(["train", "--data", str(empty), "--out", str(tmp_path / "y")]) == 2
    err = capsys.readouterr().err
    assert "empty" in err and "data.path" in err and not (tmp_path / "y").exists()
