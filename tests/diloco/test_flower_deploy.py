"""A real Flower deployment on loopback: flower-superlink, 3 flower-supernode processes (one of
them misconfigured), ``flwr run --stream``; the global model must improve, the int8 codec must
shrink the uplink, the broken site must be tolerated, and no Flower process may outlive the run."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import flwr  # noqa: F401 - required (the dev extra): a broken install fails, not skips
import pytest

from diloco.flower.federation import (
    LocalRunConfig,
    run_local,
    summary_table,  # noqa: E402
    tagged_pids,
)
from diloco.metrics import read_jsonl  # noqa: E402


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_superlink_and_supernodes_run_federated_diloco(spawn, tmp_path, monkeypatch):
    # as from `/venv/bin/lowband flower local` in a shell whose venv is not activated: Flower's
    # executables (flower-superexec included, which the SuperNodes look up) must still be found
    monkeypatch.setenv("PATH", os.pathsep.join(["/usr/sbin", "/usr/bin", "/sbin", "/bin"]))
    assert shutil.which("flower-superexec") is None
    procs: list[subprocess.Popen] = []

    def starter(args, **kw):  # the spawn fixture kills every group even if the test fails
        procs.append(spawn(args, **kw))
        return procs[-1]

    out = tmp_path / "out"
    cfg = LocalRunConfig(
        supernodes=3,
        # federated evaluation is covered in-process (tests/diloco/test_flower.py); here the server
        # evaluates θ_g itself, which keeps the run to two rounds of ClientApp processes
        run_config={
            "num-server-rounds": 2,
            "inner-steps": 40,
            "fragments": 2,
            "codec": "int8",
            "evaluate-every": 0,
            "min-train-replies": 2,
            "threads": 1,
            "round-timeout": 180.0,
        },
        # the third site points at data it does not have: its ClientApp raises every round
        node_configs=({}, {}, {"data-kind": "text", "data-path": str(tmp_path / "missing.txt")}),
        out_dir=str(out),
        timeout=360.0,
        workdir=str(tmp_path / "federation"),
    )
    summary = run_local(cfg, starter=starter)

    assert summary["rounds_applied"] == 2
    assert summary["final_eval"] < summary["initial_eval"] - 1.0, summary
    assert summary["uplink_reduction"] == pytest.approx(32 / 8.125, rel=0.02)  # int8 + scales
    rounds = [r for r in read_jsonl(out / "metrics.jsonl") if r["event"] == "round"]
    assert [(r["fragment"], r["replies"], r["failures"]) for r in rounds] == [(0, 2, 1), (1, 2, 1)]
    # round 1 ships the whole model to every node; round 2 only fragment 0, just updated
    assert 0 < rounds[1]["bytes_down"] < 0.75 * rounds[0]["bytes_down"]
    assert json.loads((out / "summary.json").read_text()) == summary
    assert (out / "checkpoint" / "model.safetensors").exists()
    assert "eval" in summary_table(out)

    # Flower's transport and the SuperNodes' Context.state change nothing: the same rounds run
    # in this process give the same model, bit for bit
    import torch

    from diloco.flower.client import handle
    from diloco.flower.config import from_run_config
    from diloco.flower.inprocess import InProcessGrid
    from diloco.flower.server import run_server
    from lowband.models.weights import load_pretrained

    rc = {**cfg.effective_run_config(), "out-dir": str(tmp_path / "inprocess")}
    nodes = {
        10 + i: {"partition-id": i, "num-partitions": 3, **extra}
        for i, extra in enumerate(cfg.node_configs)
    }
    threads = torch.get_num_threads()
    try:
        local = run_server(InProcessGrid(handle, rc, nodes), from_run_config(rc))
    finally:
        torch.set_num_threads(threads)
    assert local["final_eval"] == summary["final_eval"]
    deployed = load_pretrained(out / "checkpoint").state_dict()
    for name, t in load_pretrained(tmp_path / "inprocess" / "checkpoint").state_dict().items():
        assert torch.equal(t, deployed[name]), name

    # every Flower process and its superexec children are gone (whole process groups)
    assert len(procs) == 5 and all(p.poll() is not None for p in procs)
    for p in procs:
        with pytest.raises(ProcessLookupError):
            os.killpg(p.pid, 0)
    # ... and so are the ServerApp/ClientApp processes Flower starts in groups of their own
    assert tagged_pids("FLWR_HOME", str(tmp_path / "federation" / "flwr-home")) == []


def test_flower_children_find_scripts_of_this_interpreter_first():
    from diloco.flower.federation import _flwr_env, _path_with_own_bin

    own = str(Path(sys.executable).parent)
    assert _path_with_own_bin("/usr/bin:/bin") == os.pathsep.join([own, "/usr/bin", "/bin"])
    assert _path_with_own_bin(f"/bin:{own}:") == os.pathsep.join([own, "/bin"])  # once, first
    env = _flwr_env(Path("/tmp/h"))
    assert env["FLWR_HOME"] == "/tmp/h" and env["PATH"].split(os.pathsep)[0] == own
