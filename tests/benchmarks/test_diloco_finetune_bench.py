"""benchmarks.diloco_finetune smoke-run on a tiny random Llama (seconds): the JSON line, the same
tokens and the same starting loss in every arm, fewer bytes for DiLoCo and fewer still for LoRA,
and the summary's figures computed from the runs."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


@pytest.fixture(scope="module")
def result() -> dict:
    argv = [sys.executable, "-m", "benchmarks.diloco_finetune", "--model", "llama:64:2"]
    argv += ["--steps", "4", "--inner-steps", "4", "--seq-len", "32", "--batch-size", "2"]
    argv += ["--seeds", "1", "--eval-batches", "2", "--json"]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=300, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_prints_every_arm(result: dict) -> None:
    assert result["benchmark"] == "diloco_finetune" and result["corpus"] == "paradise_lost.txt"
    assert set(result["arms"]) == {"diloco", "ddp", "lora"}
    runs = result["runs"]
    # the same tokens and the same starting model everywhere
    assert len({r[0]["tokens"] for r in runs.values()}) == 1
    assert result["tokens"] == 2 * 2 * 32 * 4
    assert len({r[0]["eval_before"] for r in runs.values()}) == 1
    for arm in runs.values():
        r = arm[0]
        assert r["peak_bytes"] > r["baseline_bytes"] > 0 and r["bytes_per_param"] > 0
        assert r["eval_after"] < r["eval_before"]  # 4 steps of training lower the held-out loss


def test_bytes_diloco_below_ddp_and_lora_below_diloco(result: dict) -> None:
    sent = {a: r[0]["bytes_sent_per_worker"] for a, r in result["runs"].items()}
    assert sent["lora"] < sent["diloco"] < sent["ddp"]
    lora = result["arms"]["lora"]
    assert lora["trained_params"] < result["params"]
    ratio = sent["ddp"] / sent["diloco"]
    assert result["arms"]["diloco"]["fewer_bytes_than_ddp"]["median"] == pytest.approx(ratio, 0.01)
    gap = 100 * (
        result["runs"]["diloco"][0]["eval_after"] / result["runs"]["ddp"][0]["eval_after"] - 1
    )
    assert result["arms"]["diloco"]["eval_gap_vs_ddp_pct"]["median"] == pytest.approx(gap, abs=1e-3)


def test_merge_of_seeds_run_apart(result: dict, tmp_path) -> None:
    from benchmarks.diloco_finetune import merge

    other = json.loads(json.dumps(result))
    for rs in other["runs"].values():
        for r in rs:
            r["seed"] = 1
            r["eval_after"] += 0.5
    out = merge([result, other])
    assert out["seeds"] == 2 and all(len(rs) == 2 for rs in out["runs"].values())
    after = out["arms"]["ddp"]["eval_after"]
    assert after["min"] == result["runs"]["ddp"][0]["eval_after"]
    assert after["max"] == pytest.approx(after["min"] + 0.5)
    with pytest.raises(ValueError, match="twice"):
        merge([result, result])


def test_split_and_outer_flags_reach_the_config() -> None:
    import argparse

    from benchmarks.diloco_finetune import _config

    base = dict(
        model="llama:64:2", corpus="c.txt", steps=4, seed=0, eval_batches=2, batch_size=1,
        seq_len=8, inner_steps=4, fragments=2, tau=1, codec="int8", inner_lr=1e-4,
        lora_lr=1e-3, lora_rank=8, warmup=1, outer_lr=1.5, outer_momentum=0.0,
        ddp_lr=3e-5, lora_outer_lr=0.7,
        test_fraction=0.1, eval_split="test",
    )  # fmt: skip
    cfg, _ = _config(argparse.Namespace(arm="diloco", **base))
    assert (cfg.data.test_fraction, cfg.data.eval_split) == (0.1, "test")
    outer = cfg.mode.outer
    assert (outer.lr, outer.momentum, outer.nesterov) == (1.5, 0.0, False)
    assert cfg.inner.lr == 1e-4
    lora, _ = _config(argparse.Namespace(arm="lora", **base))
    assert (lora.mode.outer.lr, lora.inner.lr) == (0.7, 1e-3)
    ddp, _ = _config(argparse.Namespace(arm="ddp", **{**base, "eval_split": "validation"}))
    assert ddp.data.eval_split == "validation" and not hasattr(ddp.mode, "outer")
    assert ddp.inner.lr == 3e-5
    same, _ = _config(argparse.Namespace(arm="ddp", **{**base, "ddp_lr": 0.0}))
    assert same.inner.lr == 1e-4
