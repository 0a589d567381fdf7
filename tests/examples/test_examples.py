"""Every example runs as a subprocess at its --tiny size and prints real, checked results.

examples/flower_diloco is not run here: tests/diloco/test_flower.py checks it is exactly the app
that ``diloco.flower.app.write_app`` generates, and tests/diloco/test_flower_deploy.py deploys that
app with a real SuperLink and SuperNodes.
"""

from __future__ import annotations

import json
import math
import subprocess
from pathlib import Path

import pytest

from tests.conftest import PY, REPO

EXAMPLES = REPO / "examples"
pytestmark = [pytest.mark.slow, pytest.mark.timeout(150)]


def run_example(spawn, name: str, *args: str, timeout: float = 120) -> tuple[dict, str]:
    """Run examples/<name>/main.py; returns its last line parsed as JSON, and all output."""
    p = spawn(
        [PY, str(EXAMPLES / name / "main.py"), "--tiny", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    out, _ = p.communicate(timeout=timeout)
    assert p.returncode == 0, out[-3000:]
    return json.loads(out.strip().splitlines()[-1]), out


def test_index_lists_every_example():
    index = (EXAMPLES / "README.md").read_text()
    for d in sorted(p for p in EXAMPLES.iterdir() if p.is_dir()):
        assert f"({d.name}/)" in index, d.name
        assert (d / "README.md").exists(), d.name


def test_multisite_diloco(spawn):
    res, out = run_example(spawn, "multisite_diloco", "--sites", "3")
    sites = res["sites"]
    assert [s["rank"] for s in sites] == [0, 1, 2]
    assert all(s["syncs"] > 0 and s["bytes_sent"] > 0 and s["bytes_received"] > 0 for s in sites)
    assert 0 < res["final_eval"] < 4.5  # from ~5.55 (uniform over 256 bytes)
    assert "held-out loss by step" in out


def test_ddp_vs_diloco(spawn):
    res, out = run_example(spawn, "ddp_vs_diloco")
    ddp, dl = res["runs"]["DDP"], res["runs"]["Streaming DiLoCo"]
    for r in (ddp, dl):
        assert math.isfinite(r["eval_loss"]) and r["eval_loss"] < res["initial_eval"] - 1.0
    assert res["bytes_ratio"] > 10 and dl["bytes_per_worker"] * 10 < ddp["bytes_per_worker"]
    assert ddp["syncs"] == 40 and "fewer bytes" in out


def test_train_then_serve(spawn, tmp_path):
    res, out = run_example(
        spawn, "train_then_serve", "--out", str(tmp_path / "run"), "--max-tokens", "24"
    )
    model = Path(res["model_dir"])
    assert (model / "config.json").exists() and (model / "model.safetensors").exists()
    assert res["final_eval"] < 4.5
    assert res["wire_bytes"] > 0  # the activations really crossed the TP link
    assert res["tp2_text"] and res["tp2_text"] == res["single_text"]
    assert "TP-2 generated 24 tokens" in out


def test_edge_http(spawn, tmp_path):
    res, _ = run_example(
        spawn, "edge_http", "--out", str(tmp_path / "run"), "--max-tokens", "16", timeout=140
    )
    assert res["health"]["devices"] == 2 and res["health"]["healthy"]
    assert res["usage"]["completion_tokens"] == 16 and res["finish_reason"] == "length"
    assert res["text"] and res["streamed"] == res["text"]  # greedy: the same answer both ways


def test_moe_budget(spawn, tmp_path):
    res, _ = run_example(spawn, "moe_budget", "--out", str(tmp_path / "run"), "--max-tokens", "16")
    runs = res["runs"]
    full, hebf, lru = runs["int8, all resident"], runs["HEBF (8..2 bits)"], runs["int8 LRU"]
    assert res["budget_bytes"] < res["int8_expert_bytes"]
    for r in (hebf, lru):
        assert 0 < r["peak_bytes"] <= res["budget_bytes"]
    assert hebf["mean_bits"] < 8 and lru["mean_bits"] == 8
    assert hebf["hit_rate"] > lru["hit_rate"]  # narrower experts: more of them fit
    assert math.isfinite(hebf["ppl"]) and hebf["ppl"] < 1.5 * full["ppl"] < 256
