"""End to end: train a tiny MoE here, convert it, serve it under a memory budget through the
edge engine and the CLI."""

from __future__ import annotations

import json
import math
import subprocess
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from edge.engine import Engine, LocalRunner
from edge.moe.checkpoint import NestedCheckpoint, load_dense, quantize_nested_checkpoint
from edge.moe.quant import NestedQuantConfig
from edge.moe.store import ExpertStoreConfig, HEBFConfig, LRUConfig, PrefetchConfig, open_store
from edge.moe.train import TRAIN_LOG, tiny_preset, train
from edge.sampling import SamplingParams
from lowband.models.tokenizer import ByteTokenizer
from tests.conftest import PY

pytestmark = pytest.mark.timeout(240)

PROMPT = "KING HENRY:\nNow, lords,"


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("moe")
    cfg = replace(tiny_preset(root / "model"), steps=30)
    model_dir = train(cfg)
    nested = quantize_nested_checkpoint(
        model_dir, root / "nested", NestedQuantConfig(group_size=32)
    )
    return model_dir, nested


def budget(nested: Path, frac: float) -> int:
    ck = NestedCheckpoint(nested, verify=False)
    try:
        return int(frac * sum(s[8] for s in ck.sizes().values()))
    finally:
        ck.close()


def test_training_learns_bytes(trained: tuple[Path, Path]) -> None:
    log = json.loads((trained[0] / TRAIN_LOG).read_text())
    assert log["heldout_ppl"] < 40  # a uniform byte model has perplexity 256
    assert (trained[0] / "lowband_tokenizer.json").exists()


def complete(model, nested: Path, n: int = 24) -> str:
    engine = Engine(LocalRunner(model), ByteTokenizer(), model_name="tiny-moe")
    text, _, count = engine.complete(PROMPT, SamplingParams(max_tokens=n))
    assert count == n
    return text


def test_engine_serves_int8_lru_under_budget_exactly_like_the_dense_model(trained) -> None:
    _, nested = trained
    want = complete(load_dense(nested, 8), nested)
    cfg = ExpertStoreConfig(
        budget_bytes=budget(nested, 0.4), policy=LRUConfig(bits=8), prefetch=PrefetchConfig()
    )
    model, cache = open_store(nested, cfg)
    try:
        got = complete(model, nested)
        rep = cache.report()
    finally:
        cache.close()
    assert got == want
    assert rep["misses"] > 0 and rep["peak_bytes"] <= cfg.budget_bytes


def nll_through(model, ids: torch.Tensor) -> float:
    """Mean teacher-forced next-byte NLL, decoding one token at a time through the KV cache."""
    kv, total = model.new_cache(), 0.0
    with torch.no_grad():
        logits = model(ids[None, :8], cache=kv)[0, -1]
        for t in range(8, len(ids)):
            total += float(F.cross_entropy(logits[None], ids[t : t + 1]))
            logits = model(ids[None, t : t + 1], cache=kv)[0, -1]
    return total / (len(ids) - 8)


def test_hebf_under_40_percent_budget_keeps_quality(trained) -> None:
    _, nested = trained
    ids = torch.tensor(list(b"Than my poor tongue can utter. O, my lord, what shall we do?\n"))
    int8 = nll_through(load_dense(nested, 8), ids)
    cfg = ExpertStoreConfig(
        budget_bytes=budget(nested, 0.4), policy=HEBFConfig(), prefetch=PrefetchConfig()
    )
    model, cache = open_store(nested, cfg)
    try:
        hebf = nll_through(model, ids)
        text = complete(model, nested)
        rep = cache.report()
    finally:
        cache.close()
    assert rep["peak_bytes"] <= cfg.budget_bytes
    assert 2.0 <= rep["mean_bits_per_call"] < 8.0
    assert math.exp(hebf) < math.exp(int8) * 1.25, (math.exp(hebf), math.exp(int8))
    assert len(text) > 0


def test_cli_quantize_and_generate(trained, tmp_path: Path, spawn) -> None:
    model_dir, _ = trained
    out = tmp_path / "cli"
    p = spawn(
        [
            PY,
            "-m",
            "cli",
            "edge",
            "quantize",
            str(model_dir),
            "--nested",
            "--out",
            str(out),
            "--group-size",
            "32",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    stdout, stderr = p.communicate(timeout=120)
    assert p.returncode == 0, stderr
    assert "wrote 16 experts" in stdout and (out / "nested.json").exists()
    mb = budget(out, 0.3) / 1e6
    p = spawn(
        [
            PY,
            "-m",
            "cli",
            "edge",
            "moe-generate",
            str(out),
            "--prompt",
            PROMPT,
            "--max-tokens",
            "8",
            "--budget-mb",
            f"{mb:.4f}",
            "--read-mb-per-s",
            "200",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    stdout, stderr = p.communicate(timeout=120)
    assert p.returncode == 0, stderr
    stats = json.loads(stderr.strip().splitlines()[-1])
    assert stats["tokens"] == 8 and stats["peak_expert_mb"] <= mb + 1e-9
    # A budget below one 2-bit expert is refused with a message, before any token.
    p = spawn(
        [
            PY,
            "-m",
            "cli",
            "edge",
            "moe-generate",
            str(out),
            "--prompt",
            "x",
            "--budget-mb",
            "0.001",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    _, stderr = p.communicate(timeout=120)
    assert p.returncode == 2 and "cannot hold one expert" in stderr
