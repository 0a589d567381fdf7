"""Sliding-window scheduler: the pure plan exhaustively, and a windowed run == a resident run."""

from __future__ import annotations

import pytest
import torch

from edge.formats.gguf import write_gguf
from edge.shardio import WindowConfig, load_shard, split_checkpoint
from edge.tp import make_reduce
from edge.window import window_for_budget, window_plan, window_warmup
from lowband.errors import ConfigError
from lowband.models.config import ModelConfig
from lowband.models.llama import LlamaForCausalLM, init_weights
from lowband.models.weights import save_pretrained
from tests.conftest import run_ranks, tp_head
from transport.loopback import LoopbackGroup


@pytest.mark.parametrize("n", range(1, 9))
def test_window_plan_invariants(n: int) -> None:
    for w in range(1, n + 3):
        resident = set(window_warmup(n, w))
        assert len(resident) == min(w, n)
        start = set(resident)
        loads = 0
        for _pass in range(3):
            for i in range(n):
                assert i in resident, (n, w, i)  # loaded (or in flight) before it computes
                assert len(resident) <= w
                step = window_plan(i, n, w)
                for e in step.evict:
                    resident.remove(e)
                for b in step.load:
                    assert b not in resident
                    resident.add(b)
                    loads += 1
                assert len(resident) <= w
                # after block i, the next W blocks of the cycle are resident
                ahead = {(i + 1 + k) % n for k in range(min(w, n))}
                assert ahead == resident
        assert resident == start  # the schedule is cyclic
        assert loads == (0 if w >= n else 3 * n)


def test_window_plan_errors_and_budget() -> None:
    with pytest.raises(ConfigError):
        window_plan(3, 3, 1)
    with pytest.raises(ConfigError):
        window_warmup(3, 0)
    mb = 2**20
    assert window_for_budget(10 * mb, [3 * mb] * 5, fixed_bytes=0) == 3
    assert window_for_budget(10 * mb, [3 * mb] * 5, fixed_bytes=2 * mb) == 2
    assert window_for_budget(100 * mb, [3 * mb] * 5) == 5
    with pytest.raises(ConfigError, match="need at least 5 MB"):
        window_for_budget(4 * mb, [3 * mb] * 5, fixed_bytes=2 * mb)
    with pytest.raises(ConfigError):
        WindowConfig(window=2, memory_budget_mb=10)


CFG = dict(
    vocab_size=64,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=5,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    d = tmp_path_factory.mktemp("ckpt")
    m = LlamaForCausalLM(ModelConfig(**CFG)).eval()
    init_weights(m, seed=9)
    save_pretrained(m, d)
    return d, m


def _decode(model, ids, steps=4):
    cache = model.new_cache()
    with torch.no_grad():
        outs = [model(ids, cache=cache)]
        for t in range(steps):
            outs.append(model(torch.tensor([[t + 1]]), cache=cache))
    return torch.cat(outs, 1)


@pytest.mark.parametrize("w", [1, 2, 5])
def test_windowed_run_equals_resident(ckpt, tmp_path, w: int) -> None:
    d, ref_model = ckpt
    out = split_checkpoint(d, tmp_path / "split", devices=1)
    ids = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])
    ref = _decode(ref_model, ids)
    sh = load_shard(out, window=WindowConfig(window=w), fast=False)  # exact: both eager
    try:
        got = _decode(sh.model, ids)
        assert len(sh.scheduler.resident()) == min(w, 5)
    finally:
        sh.close()
    assert torch.equal(got, ref)


def test_window_needs_split_dir(ckpt) -> None:
    d, _ = ckpt
    with pytest.raises(ConfigError, match="edge split"):
        load_shard(d, window=WindowConfig(window=2))
    out = split_checkpoint(d, d.parent / "split_budget", devices=1)
    with pytest.raises(ConfigError, match="cannot hold"):  # budget below one layer block
        load_shard(out, window=WindowConfig(memory_budget_mb=0.01))


@pytest.mark.parametrize("source", ["split", "checkpoint"])
def test_tp_shards_from_disk_with_window(ckpt, tmp_path, source: str) -> None:
    """3 uneven ranks, each loading only its slice (split files + window, or straight from
    the HF checkpoint), equal the unsharded model."""
    d, ref_model = ckpt
    world, weights = 3, [2.0, 1.0, 1.0]
    path = split_checkpoint(d, tmp_path / "s3", world, weights) if source == "split" else d
    ids = torch.tensor([[7, 7, 1, 2, 3]])
    with torch.no_grad():
        ref = ref_model(ids)
    x = ref_model.embed(ids).detach()
    got = _tp_forward(
        path,
        world,
        x,
        weights=weights,
        window=lambda r: WindowConfig(window=2) if source == "split" and r > 0 else None,
    )
    assert (got - ref).abs().max().item() <= 1e-5


@pytest.mark.parametrize("source", ["split", "checkpoint", "gguf"])
def test_tied_head_split_by_vocabulary(tmp_path, source: str) -> None:
    """Tied embeddings with a vocabulary-parallel head: rank 0's head is a view of its rows of
    the embedding, a worker's head is its rows read from the embedding (split files or the
    checkpoint's memory map); gathered logits equal the unsharded model's, and the plan of an
    older split (no ``vocab`` entry) still loads with the whole head on rank 0."""
    import json

    m = LlamaForCausalLM(ModelConfig(**{**CFG, "tie_word_embeddings": True})).eval()
    init_weights(m, seed=4)
    d = save_pretrained(m, tmp_path / "tied")
    world = 2
    path = (
        split_checkpoint(d, tmp_path / "s2", world)
        if source == "split"
        else write_gguf(m, tmp_path / "tied.gguf")
        if source == "gguf"
        else d
    )
    ids = torch.tensor([[5, 9, 2, 7]])
    with torch.no_grad():
        ref = m(ids)
    x = m.embed(ids).detach()

    def check(r, sh):
        a, b = sh.plan.vocab_rows(r, CFG["vocab_size"])
        assert sh.model.lm_head.weight.shape[0] == b - a
        if r == 0 and b > a and sh.plan.vocab_split:  # a view, not a copy
            assert (
                sh.model.lm_head.weight.data_ptr() == sh.model.model.embed_tokens.weight.data_ptr()
            )

    def run(path):
        return _tp_forward(path, world, x, check=check)

    assert (run(path) - ref).abs().max().item() <= 1e-5
    if source == "split":  # an older split: whole head on rank 0
        legacy = split_checkpoint(d, tmp_path / "old", world)
        meta = json.loads((legacy / "lowband_split.json").read_text())
        del meta["plan"]["vocab"]
        (legacy / "lowband_split.json").write_text(json.dumps(meta))
        (legacy / "rank1" / "head.safetensors").unlink()
        _rewrite_head_whole(d, legacy)
        assert (run(legacy) - ref).abs().max().item() <= 1e-5


def _rewrite_head_whole(src, split) -> None:
    """Rank 0's head file as an older split wrote it: embedding, norm (and no head rows: tied)."""
    from safetensors.torch import load_file, save_file

    full = load_file(str(src / "model.safetensors"))
    keep = {k: v for k, v in full.items() if not k.startswith("model.layers.")}
    save_file(keep, str(split / "rank0" / "head.safetensors"), metadata={"format": "pt"})


def _tp_forward(path, world, x, *, weights=None, window=lambda r: None, check=lambda r, sh: None):
    """Every rank loads its slice of ``path`` (``window(r)``: its sliding window), runs the
    layers on ``x`` over a loopback group and the vocabulary-parallel head; rank 0's logits."""
    comms = LoopbackGroup(world, timeout=30).comms()

    def body(r):
        def run():
            sh = load_shard(
                path, r, world, weights=weights, reduce=make_reduce(comms[r]), window=window(r)
            )
            try:
                check(r, sh)
                with torch.no_grad():
                    h = sh.model.forward_layers(x, cache=None, start=0)
                    return tp_head(sh.model, sh.plan, r, h, sh.reduce)
            finally:
                sh.close()

        return run

    return run_ranks([body(r) for r in range(world)])[0]
