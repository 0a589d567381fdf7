"""The compiled single-token decode step (edge.fastpath) against the eager PyTorch path."""

from __future__ import annotations

import pytest
import torch

from edge import fastpath
from edge.formats.quantized import fuse_quant_rows
from edge.quant import kernel as qkernel
from edge.quant import quantize_modules
from edge.shardio import load_shard
from lowband.models.config import ModelConfig
from lowband.models.llama import LlamaForCausalLM, fuse_projections, init_weights, unfuse_projections
from lowband.models.weights import save_pretrained

BASE = dict(vocab_size=97, hidden_size=128, intermediate_size=192, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)


def _model(bits=None, fuse=True, **over) -> LlamaForCausalLM:
    m = LlamaForCausalLM(ModelConfig(**{**BASE, **over})).eval()
    init_weights(m, seed=3)
    with torch.no_grad():
        for n, p in m.named_parameters():
            if n.endswith("bias"):
                p.normal_(0, 0.1)
    if bits:
        quantize_modules(m, bits=bits, group=32)
    if fuse:
        fuse_projections(m, fuse_quant_rows)
    return m


def _tol(bits) -> float:
    """Same weights and the same packed kernels on both paths; only the order of fp32 sums
    differs. For packed layers that difference can flip the rounding of one int8-quantized
    activation (the kernels quantize x per group), which moves a logit by ~1e-3."""
    return 1e-4 if bits is None else 1e-2


def _decode(m: LlamaForCausalLM, ids: torch.Tensor, prefill: int) -> torch.Tensor:
    """Prefill ``prefill`` tokens, then one token at a time; logits of every decoded step."""
    cache, out = m.new_cache(), []
    with torch.inference_mode():
        m(ids[:, :prefill], cache=cache)
        for t in range(prefill, ids.shape[1]):
            out.append(m(ids[:, t:t + 1], cache=cache)[0, -1])
    assert cache.length == ids.shape[1]
    return torch.stack(out)


@pytest.mark.parametrize("bits", [None, 8, 4], ids=["fp32", "q8", "q4"])
@pytest.mark.parametrize("over", [{}, {"sliding_window": 5, "model_type": "qwen2", "attention_bias": True},
                                  {"num_key_value_heads": 4}, {"tie_word_embeddings": True}],
                         ids=["llama", "window+bias", "mha", "tied"])
@pytest.mark.parametrize("fuse", [True, False], ids=["fused", "unfused"])
def test_compiled_step_matches_eager(bits, over, fuse) -> None:
    m = _model(bits, fuse, **over)
    ids = torch.randint(0, 97, (1, 20), generator=torch.Generator().manual_seed(1))
    ref = _decode(m, ids, 6)
    assert fastpath.install(m) is None
    assert fastpath.active(m)
    got = _decode(m, ids, 6)
    assert (got - ref).abs().max().item() <= _tol(bits) * max(1.0, ref.abs().max().item())
    if bits is None:
        assert torch.equal(got.argmax(-1), ref.argmax(-1))


def test_cache_growth_and_mixed_prefill() -> None:
    """Decode past the cache's first capacity (reallocation under the compiled step), then a
    multi-token chunk on the eager path reads what the compiled step wrote, and back."""
    m = _model(8)
    ids = torch.randint(0, 97, (1, 150), generator=torch.Generator().manual_seed(2))

    def run(fast: bool) -> torch.Tensor:
        (fastpath.install if fast else fastpath.uninstall)(m)
        cache, out = m.new_cache(), []
        with torch.inference_mode():
            m(ids[:, :2], cache=cache)
            for t in range(2, 100):  # capacity 64 -> 128 mid-way
                out.append(m(ids[:, t:t + 1], cache=cache)[0, -1])
            out.extend(m(ids[:, 100:130], cache=cache)[0])  # eager chunk after compiled steps
            for t in range(130, 150):  # 128 -> 256
                out.append(m(ids[:, t:t + 1], cache=cache)[0, -1])
        return torch.stack(out)

    ref, got = run(False), run(True)
    assert (got - ref).abs().max().item() <= _tol(8) * max(1.0, ref.abs().max().item())


def test_eager_fallback_reasons() -> None:
    moe = _model(model_type="mixtral", num_local_experts=4, num_experts_per_tok=2)
    assert "MoE" in fastpath.install(moe) and not fastpath.active(moe)
    half = _model().to(torch.bfloat16)
    assert "float32" in fastpath.install(half) and not fastpath.active(half)
    m = _model()
    assert fastpath.install(m) is None
    unfuse_projections(m)  # re-slicing drops the compiled step that read the fused weights
    assert not fastpath.active(m)
    try:
        qkernel.configure(enabled=False)
        assert "unavailable" in fastpath.install(m)
        ids = torch.randint(0, 97, (1, 8), generator=torch.Generator().manual_seed(3))
        assert _decode(m, ids, 4).shape == (4, 97)  # the eager path keeps serving
    finally:
        qkernel.configure(enabled=True)


def test_bad_inputs_are_refused() -> None:
    m = _model()
    assert fastpath.install(m) is None
    fast = m.fast_decode
    cache = m.new_cache()
    with pytest.raises(RuntimeError, match="hidden_size"):
        fast.layers(torch.zeros(1, 1, 64), cache, 0)
    x = torch.zeros(1, 1, 128)
    fast.layers(x, cache, 0)
    fast._dec.set_cache(cache.k, cache.v)
    with pytest.raises(RuntimeError, match="cannot hold position"):
        fast._dec.layers(x, cache.capacity(), None)
    with pytest.raises(RuntimeError, match="one K and one V"):
        fast._dec.set_cache(cache.k[:1], cache.v[:1])


def test_load_shard_installs_it(tmp_path) -> None:
    m = _model(fuse=False)
    save_pretrained(m, tmp_path / "m")
    shard = load_shard(tmp_path / "m")
    assert fastpath.active(shard.model)
    assert not fastpath.active(load_shard(tmp_path / "m", fast=False).model)
    ids = torch.randint(0, 97, (1, 12), generator=torch.Generator().manual_seed(4))
    eager = load_shard(tmp_path / "m", fast=False).model
    assert torch.allclose(_decode(shard.model, ids, 4), _decode(eager, ids, 4), atol=1e-4)
