"""Expert store: decode through the store equals decode with dequantized weights, LRU order,
the budget is never exceeded (with prefetch and a slow device), bad input is refused up front."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from edge import fastpath
from edge.moe.checkpoint import NestedCheckpoint, load_dense, quantize_nested_checkpoint
from edge.moe.quant import NestedQuantConfig
from edge.moe.store import (
    ExpertCache,
    ExpertStoreConfig,
    HEBFConfig,
    LRUConfig,
    PrefetchConfig,
    attach,
    open_store,
)
from lowband.errors import ConfigError, CorruptWeights
from lowband.models.llama import LlamaForCausalLM, init_weights
from lowband.models.weights import save_pretrained
from tests.edge.moe.test_nested import tiny_moe_config

pytestmark = pytest.mark.timeout(120)

PROMPT = torch.tensor([list(b"Now is the winter of our discontent")])


@pytest.fixture(scope="module")
def nested_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("store")
    model = LlamaForCausalLM(tiny_moe_config(num_local_experts=8, num_hidden_layers=3))
    init_weights(model, seed=11)
    # Larger router weights make routing vary from token to token, as in a trained model.
    with torch.no_grad():
        for layer in model.model.layers:
            layer.block_sparse_moe.gate.weight.mul_(20)
    src = save_pretrained(model, root / "src")
    return quantize_nested_checkpoint(src, root / "nested", NestedQuantConfig(group_size=32))


@pytest.fixture(scope="module")
def sizes(nested_dir: Path) -> dict:
    ck = NestedCheckpoint(nested_dir)
    try:
        return ck.sizes()
    finally:
        ck.close()


def int8_total(sizes: dict) -> int:
    return sum(s[8] for s in sizes.values())


def decode(
    model: LlamaForCausalLM, ids: torch.Tensor, steps: int
) -> tuple[torch.Tensor, list[int]]:
    """Prefill, then teacher-force ``steps`` tokens one at a time; all logits and greedy picks."""
    kv = model.new_cache()
    with torch.no_grad():
        logits = [model(ids[:, :4], cache=kv)[:, -1]]
        for t in range(4, 4 + steps):
            logits.append(model(ids[:, t : t + 1], cache=kv)[:, -1])
    out = torch.cat(logits)
    return out, out.argmax(-1).tolist()


@pytest.mark.parametrize("bits", [8, 4, 2])
def test_lru_decode_equals_dequantized_model(nested_dir: Path, sizes: dict, bits: int) -> None:
    dense = load_dense(nested_dir, bits)
    want, _ = decode(dense, PROMPT, 20)
    # A budget of 3 experts: misses, evictions and reloads all happen during the run.
    cfg = ExpertStoreConfig(
        budget_bytes=3 * next(iter(sizes.values()))[bits], policy=LRUConfig(bits=bits)
    )
    model, cache = open_store(nested_dir, cfg)
    try:
        got, _ = decode(model, PROMPT, 20)
        rep = cache.report()
    finally:
        cache.close()
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    assert rep["misses"] > 0 and rep["evictions"] > 0
    assert rep["peak_bytes"] <= cfg.budget_bytes
    assert rep["calls_by_bits"] == {str(bits): rep["hits"] + rep["misses"] + rep["waits"]}


def test_lru_eviction_order(nested_dir: Path, sizes: dict) -> None:
    one = sizes[(0, 0)][8]
    ck = NestedCheckpoint(nested_dir)
    cache = ExpertCache(ck, ExpertStoreConfig(budget_bytes=3 * one, policy=LRUConfig(bits=8)))
    x = torch.randn(2, 32)
    try:
        for e in (0, 1, 2):
            cache.forward(0, e, x)
        cache.forward(0, 0, x)  # 0 is now the most recent; 1 the least
        cache.forward(0, 3, x)  # evicts 1
        assert set(cache.resident_bits()) == {(0, 0), (0, 2), (0, 3)}
        cache.forward(0, 4, x)  # evicts 2
        assert list(cache.resident_bits()) == [(0, 0), (0, 3), (0, 4)]
        rep = cache.report()
        assert (rep["hits"], rep["misses"], rep["evictions"]) == (1, 5, 2)
        assert cache.resident_bytes == 3 * one
    finally:
        cache.close()


def test_hebf_expert_calls_use_exactly_the_resident_bits(nested_dir: Path, sizes: dict) -> None:
    dense = {b: load_dense(nested_dir, b) for b in (8, 4, 3, 2)}
    cfg = ExpertStoreConfig(
        budget_bytes=int(0.4 * int8_total(sizes)),
        policy=HEBFConfig(replan_every=1),
        prefetch=PrefetchConfig(top=2),
    )
    model, cache = open_store(nested_dir, cfg)
    try:
        decode(model, PROMPT, 12)  # builds hotness, plans, upgrades, downgrades
        cache.drain()  # else a read in flight may change a width under us
        torch.manual_seed(0)
        x = torch.randn(3, 32)
        bits = cache.resident_bits()
        assert len(set(bits.values())) > 1, bits  # a genuinely mixed-precision state
        for (layer, e), b in bits.items():
            ref = dense[b].model.layers[layer].block_sparse_moe.experts[e](x)
            torch.testing.assert_close(cache.forward(layer, e, x), ref, rtol=0, atol=1e-6)
        rep = cache.report()
        assert rep["peak_bytes"] <= cfg.budget_bytes
        assert rep["upgrades"] > 0 and rep["downgrades"] > 0
    finally:
        cache.close()


def test_hebf_hot_experts_get_more_bits(nested_dir: Path, sizes: dict) -> None:
    cfg = ExpertStoreConfig(
        budget_bytes=int(0.45 * int8_total(sizes)), policy=HEBFConfig(replan_every=1)
    )
    ck = NestedCheckpoint(nested_dir)
    cache = ExpertCache(ck, cfg)
    x = torch.randn(1, 32)
    try:
        cache.warm()
        for _ in range(30):  # layer 1 routes to experts 2 and 5 only
            for layer in range(3):
                chosen = torch.tensor([[2, 5]]) if layer == 1 else torch.tensor([[0, 1]])
                cache.on_route(layer, chosen)
                for e in chosen[0].tolist():
                    cache.forward(layer, e, x)
        cache.drain()
        bits = cache.resident_bits()
        cold = [bits.get((1, e), 0) for e in (0, 1, 3, 4, 6, 7)]
        assert bits[(1, 2)] > max(cold) and bits[(1, 5)] > max(cold)
        assert cache.report()["peak_bytes"] <= cfg.budget_bytes
    finally:
        cache.close()


# HEBF at 40% covers every expert at 2-4 bits, leaving nothing to prefetch: give it 20%.
@pytest.mark.parametrize(
    "policy,frac", [(LRUConfig(bits=8), 0.4), (HEBFConfig(replan_every=2), 0.2)]
)
def test_prefetch_on_a_slow_device_keeps_results_and_budget(
    nested_dir: Path, sizes: dict, policy, frac: float
) -> None:
    bits = 8 if isinstance(policy, LRUConfig) else None
    budget = int(frac * int8_total(sizes))
    cfg = ExpertStoreConfig(
        budget_bytes=budget, policy=policy, prefetch=PrefetchConfig(top=3), read_mb_per_s=20.0
    )
    model, cache = open_store(nested_dir, cfg)
    try:
        _, picks = decode(model, PROMPT, 16)
        rep = cache.report()
    finally:
        cache.close()
    assert rep["peak_bytes"] <= budget
    assert rep["prefetched"] > 0 and rep["bytes_read"] > 0
    # reads are paced: at 20 MB/s the device was busy at least bytes/20e6 seconds
    assert rep["io_busy_s"] >= rep["bytes_read"] / 20e6 * 0.99
    if bits == 8:  # int8 LRU with prefetch still computes exactly the 8-bit model
        _, want = decode(load_dense(nested_dir, 8), PROMPT, 16)
        assert picks == want


def test_budget_smaller_than_one_expert_is_refused_before_loading(
    nested_dir: Path, sizes: dict
) -> None:
    two_bit = max(s[2] for s in sizes.values())
    with pytest.raises(ConfigError, match="cannot hold one expert"):
        open_store(nested_dir, ExpertStoreConfig(budget_bytes=two_bit - 1, policy=HEBFConfig()))
    with pytest.raises(ConfigError, match="cannot hold one expert"):
        open_store(
            nested_dir, ExpertStoreConfig(budget_bytes=two_bit + 1, policy=LRUConfig(bits=8))
        )


def test_corrupt_plane_is_refused_at_open(nested_dir: Path, tmp_path: Path) -> None:
    bad = tmp_path / "bad"
    shutil.copytree(nested_dir, bad)
    f = bad / "experts" / "L002_E007.lbn"
    data = bytearray(f.read_bytes())
    data[-5] ^= 0xFF  # the least significant plane of the last expert
    f.write_bytes(bytes(data))
    with pytest.raises(CorruptWeights, match="bit-plane 7"):
        open_store(bad, ExpertStoreConfig(budget_bytes=10**7, policy=HEBFConfig()))
    # Without the up-front scan the damage is still caught when the plane is read, and only
    # the 8-bit read touches plane 7: a 4-bit server of this file is unaffected.
    cfg = ExpertStoreConfig(budget_bytes=10**7, policy=LRUConfig(bits=8), verify_on_open=False)
    model, cache = open_store(bad, cfg, warm=False)
    try:
        with pytest.raises(CorruptWeights, match="bit-plane 7"):
            cache.forward(2, 7, torch.randn(1, 32))
        assert cache.resident_bytes == 0 or (2, 7) not in cache.resident_bits()
    finally:
        cache.close()
    cfg4 = ExpertStoreConfig(budget_bytes=10**7, policy=LRUConfig(bits=4), verify_on_open=False)
    model, cache = open_store(bad, cfg4, warm=False)
    try:
        cache.forward(2, 7, torch.randn(1, 32))
    finally:
        cache.close()


def test_store_serves_a_subset_of_experts(nested_dir: Path, sizes: dict) -> None:
    mine = [(0, 1), (0, 2), (2, 7)]
    cfg = ExpertStoreConfig(budget_bytes=sizes[(0, 1)][8] * 2, policy=LRUConfig(bits=8))
    model, cache = open_store(nested_dir, cfg, experts=mine)
    try:
        assert sorted(cache.keys) == sorted(mine)
        dense = load_dense(nested_dir, 8)
        x = torch.randn(2, 32)
        torch.testing.assert_close(
            cache.forward(2, 7, x),
            dense.model.layers[2].block_sparse_moe.experts[7](x),
            rtol=0,
            atol=1e-6,
        )
        with pytest.raises(ConfigError, match="not held"):
            cache.forward(1, 0, x)
    finally:
        cache.close()


def test_plain_int8_layout_serves_lru_only(nested_dir: Path, tmp_path: Path) -> None:
    src = nested_dir.parent / "src"
    plain = quantize_nested_checkpoint(
        src, tmp_path / "int8", NestedQuantConfig(group_size=32, layout="bytes")
    )
    dense = load_dense(nested_dir, 8)
    with pytest.raises(ConfigError, match="bit-nested"):
        open_store(plain, ExpertStoreConfig(budget_bytes=10**7, policy=HEBFConfig()))
    ck = NestedCheckpoint(plain)
    one = ck.sizes()[(0, 0)][8]
    ck.close()
    model, cache = open_store(
        plain, ExpertStoreConfig(budget_bytes=3 * one, policy=LRUConfig(bits=8))
    )
    try:
        got, _ = decode(model, PROMPT, 8)
        assert cache.report()["misses"] > 0
    finally:
        cache.close()
    want, _ = decode(dense, PROMPT, 8)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)  # same codes, same model


def test_store_works_across_inference_mode_and_no_grad(nested_dir: Path, sizes: dict) -> None:
    """Buffers first made under torch.inference_mode (the edge engine) are reused under
    no_grad later, and the other way round."""
    import edge.moe.quant

    edge.moe.quant._scratch.__dict__.clear()  # this thread's decode buffers start afresh
    cfg = ExpertStoreConfig(budget_bytes=int(0.3 * int8_total(sizes)), policy=HEBFConfig())
    model, cache = open_store(nested_dir, cfg, warm=False)
    try:
        with torch.inference_mode():
            a = model(PROMPT[:, :6])
        with torch.no_grad():
            b = model(PROMPT[:, :6])
        with torch.inference_mode():
            c = model(PROMPT[:, :6])
    finally:
        cache.close()
    assert a.shape == b.shape == c.shape and torch.isfinite(b).all()


def test_in_memory_experts_compile_and_a_store_is_called_back(
    nested_dir: Path, sizes: dict
) -> None:
    """Experts held in the model (dequantized) decode through the compiled step with the eager
    path's logits; attaching an expert store drops that step (it would skip the store), and
    installed again the compiled step calls the store's experts back: the eager path's
    logits and greedy picks, with the store serving every expert call."""
    dense = load_dense(nested_dir, 8)
    want, picks = decode(dense, PROMPT, 12)
    assert fastpath.install(dense) is None
    got, got_picks = decode(dense, PROMPT, 12)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert got_picks == picks
    cfg = ExpertStoreConfig(budget_bytes=int8_total(sizes), policy=LRUConfig(bits=8))
    model, cache = open_store(nested_dir, cfg)
    try:
        attach(dense, cache)
        assert not fastpath.active(dense)
        stored, stored_picks = decode(dense, PROMPT, 12)  # eager, through the store
        calls = cache.report()["hits"] + cache.report()["misses"]
        assert fastpath.install(dense) is None
        fast, fast_picks = decode(dense, PROMPT, 12)
        fast_calls = cache.report()["hits"] + cache.report()["misses"] - calls
    finally:
        cache.close()
    torch.testing.assert_close(stored, want, rtol=0, atol=1e-5)
    torch.testing.assert_close(fast, stored, rtol=1e-4, atol=1e-4)
    assert fast_picks == stored_picks == picks
    assert fast_calls == calls > 0  # the compiled step asked the store for the same experts
