"""The compiled decode step on routed-expert layers (Mixtral, Qwen3-MoE) against the eager
path: fp32, Q8/Q4 packed and ggml K-quant experts, renormalised and raw top-k weights, batch
rows and prompt rows equal to the same token alone; experts outside the model (the bit-nested
store) are called back."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from edge import fastpath
from edge.quant import kernel as qkernel
from edge.quant import quantize_modules
from edge.quant.ggml import GGML_TYPES, GGMLWeight
from edge.quant.linear import GGMLLinear
from lowband.models.config import ModelConfig
from lowband.models.llama import LlamaForCausalLM, SparseMoE, fuse_projections, init_weights
from tests.edge.test_fastpath import _decode
from tests.edge.test_fastpath_batch import MAG
from tests.edge.test_ggml_quant import random_blocks

pytestmark = [
    pytest.mark.timeout(600),  # the first test may build the C++ extension (minutes)
    pytest.mark.skipif(
        not qkernel.available(), reason=f"C++ kernel unavailable ({qkernel.unavailable_reason()})"
    ),
]

# 256 wide so every linear (experts' w2 included) holds whole K-quant super-blocks.
BASE = dict(
    vocab_size=97,
    hidden_size=256,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    num_local_experts=8,
)
FAMILIES = {
    "mixtral": dict(model_type="mixtral", num_experts_per_tok=2),
    # Qwen3-MoE: per-head q/k norms; the raw top-k probabilities, and renormalised ones
    "qwen3moe": dict(model_type="qwen3_moe", qk_norm=True, num_experts_per_tok=3),
    "qwen3moe-norm": dict(
        model_type="qwen3_moe", qk_norm=True, num_experts_per_tok=4, norm_topk_prob=True
    ),
}


def _model(kind: str = "fp32", **over) -> LlamaForCausalLM:
    m = LlamaForCausalLM(ModelConfig(**{**BASE, "norm_topk_prob": False, **over})).eval()
    init_weights(m, seed=7)
    with torch.no_grad():
        for layer in m.model.layers:
            moe = layer.block_sparse_moe
            moe.gate.weight.mul_(6)  # routing that changes from token to token
            for e in moe.experts:  # experts whose outputs weigh in the residual stream
                e.w2.weight.mul_(8)
    if kind in ("q8", "q4"):
        quantize_modules(m, bits=int(kind[1]), group=32)
    elif kind != "fp32":
        _ggml(m, kind.split("+"))
    fuse_projections(m)
    return m


def _ggml(m: LlamaForCausalLM, types: list[str]) -> None:
    """Every linear but the routers becomes random ggml blocks, types taken in turn (a GGUF
    file keeps ``ffn_gate_inp`` in F32, as llama.cpp's quantizer does)."""
    names = [n for n, mod in m.named_modules() if type(mod) is nn.Linear]
    for i, name in enumerate(n for n in names if not n.endswith(".gate")):
        lin = m.get_submodule(name)
        kind = types[i % len(types)]
        n, k = lin.weight.shape
        raw = random_blocks(kind, n, k, seed=i, scale=0.1 / MAG[kind])
        w = GGMLWeight(GGML_TYPES[kind], (n, k), torch.from_numpy(raw))
        parent, _, child = name.rpartition(".")
        setattr(m.get_submodule(parent), child, GGMLLinear(w, None))


def _routes(m: LlamaForCausalLM, ids: torch.Tensor) -> set[int]:
    """The experts the eager path routes ``ids`` to in every layer (ids only, all layers)."""
    seen: set[int] = set()
    for layer in m.model.layers:
        layer.block_sparse_moe.on_route = lambda chosen: seen.update(chosen.view(-1).tolist())
    try:
        with torch.inference_mode():
            m(ids)
    finally:
        for layer in m.model.layers:
            layer.block_sparse_moe.on_route = None
    return seen


@pytest.mark.parametrize("kind", ["fp32", "q8", "q4", "Q4_K+Q6_K"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_compiled_moe_step_matches_eager(family, kind) -> None:
    m = _model(kind, **FAMILIES[family])
    ids = torch.randint(0, 97, (1, 18), generator=torch.Generator().manual_seed(1))
    assert len(_routes(m, ids)) >= 6  # routing changes from token to token
    eager = _decode(m, ids, 5)
    assert fastpath.install(m) is None
    assert fastpath.active(m)
    fast = _decode(m, ids, 5)
    # fp32: only the order of fp32 sums differs; packed / ggml: that can flip the rounding of
    # one int8-quantized activation (the kernels quantize x per block), ~1e-3 on a logit
    tol = 1e-4 if kind == "fp32" else 1e-2
    assert (fast - eager).abs().max().item() <= tol * max(1.0, eager.abs().max().item())
    assert torch.equal(fast.argmax(-1), eager.argmax(-1))


def test_routing_parts_matter() -> None:
    """Renormalising the top k and k itself change the compiled step's logits (so the equality
    above can fail), and each compiled variant still equals its eager step."""
    ids = torch.randint(0, 97, (1, 12), generator=torch.Generator().manual_seed(2))
    outs = []
    for over in ({}, {"norm_topk_prob": True}, {"num_experts_per_tok": 2}):
        m = _model(**{**FAMILIES["qwen3moe"], **over})
        eager = _decode(m, ids, 3)
        assert fastpath.install(m) is None
        fast = _decode(m, ids, 3)
        assert (fast - eager).abs().max().item() <= 1e-4 * max(1.0, eager.abs().max().item())
        outs.append(fast)
    for other in outs[1:]:
        assert (other - outs[0]).abs().max().item() > 2e-2


@pytest.mark.parametrize("kind", ["fp32", "q4", "Q4_K"])
def test_moe_batch_and_prompt_rows_equal_single_rows(kind) -> None:
    """layers_batch rows (sequences routed to different experts, gathered per expert into one
    pass over its weights) and a prompt's rows through layers_spans equal each token alone."""
    m = _model(kind, **FAMILIES["mixtral"])
    assert fastpath.install(m) is None
    fast = m.fast_decode
    prompts = [[3, 5, 7, 11, 13, 2], [17, 19], [23, 29, 31, 37, 41, 43, 47], [53]]
    x = m.embed(torch.tensor([[5], [6], [7], [8]]))  # (4, 1, H)
    with torch.inference_mode():
        caches = [m.new_cache() for _ in prompts]
        for c, p in zip(caches, prompts):
            m(torch.tensor([p]), cache=c)  # a prompt: rows through layers_spans
        batch = fast.layers_batch(x, caches, [len(p) for p in prompts])
        for b, p in enumerate(prompts):
            alone = m.new_cache()
            for t, tok in enumerate(p):  # the prompt token by token
                h = fast.layers(m.embed(torch.tensor([[tok]])), alone, t)
                alone.length = t + 1
            assert torch.equal(alone.k[0][:, :, : len(p)], caches[b].k[0][:, :, : len(p)])
            assert torch.equal(alone.v[1][:, :, : len(p)], caches[b].v[1][:, :, : len(p)])
            h = fast.layers(x[b : b + 1], alone, len(p))
            assert torch.equal(batch[b : b + 1], h)


def test_experts_outside_the_model_are_called_back() -> None:
    """Experts served from outside the model (an expert store's expert_fn, the bit-nested
    runtime) and a block's pre-hook run through the compiled step's call back: every routed
    expert goes through expert_fn, and the logits equal the eager path's."""
    m = _model(**FAMILIES["qwen3moe"])
    ids = torch.randint(0, 97, (1, 12), generator=torch.Generator().manual_seed(3))
    calls: list[tuple[int, int]] = []
    seen: list[int] = []
    for i, layer in enumerate(m.model.layers):
        moe = layer.block_sparse_moe
        assert isinstance(moe, SparseMoE)

        def outside(e: int, x: torch.Tensor, moe: SparseMoE = moe, i: int = i) -> torch.Tensor:
            calls.append((i, e))
            return moe.experts[e](x)

        moe.expert_fn = outside
        moe.register_forward_pre_hook(lambda _m, args: seen.append(args[0].shape[1]))
    eager = _decode(m, ids, 4)
    n_eager, n_seen = len(calls), len(seen)
    assert fastpath.install(m) is None and fastpath.active(m)
    calls.clear()
    seen.clear()
    fast = _decode(m, ids, 4)
    assert (fast - eager).abs().max().item() <= 1e-4 * max(1.0, eager.abs().max().item())
    assert torch.equal(fast.argmax(-1), eager.argmax(-1))
    assert len(calls) == n_eager and len(seen) == n_seen == 2 * (1 + ids.shape[1] - 4)
    moe = m.model.layers[0].block_sparse_moe
    moe.register_forward_hook(lambda *_: None)
    why = fastpath.install(m)
    assert why is not None and "forward hooks" in why and "layer 0" in why
