"""The compiled decode step on Gemma 3's maths (and NoPE layers) against the eager path."""

from __future__ import annotations

import pytest
import torch

from edge import fastpath, tp
from edge.quant import kernel as qkernel
from edge.quant import quantize_modules
from lowband.models.config import ModelConfig
from lowband.models.llama import LlamaForCausalLM, Span, fuse_projections, init_weights

pytestmark = pytest.mark.skipif(
    not qkernel.available(), reason=f"C++ kernel unavailable ({qkernel.unavailable_reason()})"
)

# A small Gemma-3-shaped model: (1 + w) norms, sandwich norms, per-head q/k norms, GeGLU, a
# softmax scale of its own, sliding layers with their own rope base and a global layer.
GEMMA3 = dict(
    model_type="gemma3_text",
    vocab_size=97,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=1,
    head_dim=32,
    max_position_embeddings=256,
    sliding_window=4,
    layer_types=("sliding_attention", "sliding_attention", "full_attention"),
    rope_theta=1e6,
    rope_local_theta=1e4,
    norm_unit_offset=True,
    sandwich_norms=True,
    qk_norm=True,
    hidden_act="gelu_pytorch_tanh",
    query_pre_attn_scalar=24,
    scale_embeddings=True,
    tie_word_embeddings=True,
)


def _model(bits: int | None = None, **over) -> LlamaForCausalLM:
    m = LlamaForCausalLM(ModelConfig(**{**GEMMA3, **over})).eval()
    init_weights(m, seed=5)
    # a generator of its own, not the global RNG: the model must not depend on what ran before
    g = torch.Generator().manual_seed(6)
    with torch.no_grad():
        for n, p in m.named_parameters():
            if "norm" in n:  # (1 + w) norms whose weights matter
                p.normal_(0, 0.3, generator=g)
    if bits:
        quantize_modules(m, bits=bits, group=32)
    fuse_projections(m)
    return m


def _decode(m: LlamaForCausalLM, ids: torch.Tensor, prefill: int) -> torch.Tensor:
    cache, out = m.new_cache(), []
    with torch.inference_mode():
        m(ids[:, :prefill], cache=cache)
        for t in range(prefill, ids.shape[1]):
            out.append(m(ids[:, t : t + 1], cache=cache)[0, -1])
    return torch.stack(out)


@pytest.mark.parametrize("bits", [None, 8], ids=["fp32", "q8"])
@pytest.mark.parametrize(
    "over",
    [{}, {"final_logit_softcapping": 3.0}, {"model_type": "smollm3", "no_rope_layers": (1, 0, 1)}],
    ids=["gemma3", "softcap", "nope"],
)
def test_compiled_gemma3_step_matches_eager(bits, over) -> None:
    m = _model(bits, **over)
    ids = torch.randint(0, 97, (1, 14), generator=torch.Generator().manual_seed(1))
    eager = _decode(m, ids, 3)  # 11 decode steps: past the sliding layers' window of 4
    assert fastpath.install(m) is None
    assert fastpath.active(m)
    fast = _decode(m, ids, 3)
    tol = 1e-4 if bits is None else 1e-2
    torch.testing.assert_close(fast, eager, rtol=tol, atol=tol)
    assert torch.equal(fast.argmax(-1), eager.argmax(-1))


def test_gemma3_parts_matter() -> None:
    """Each Gemma part changes the result, so the equality above can fail."""
    base = _model()
    ids = torch.randint(0, 97, (1, 10), generator=torch.Generator().manual_seed(2))
    fastpath.install(base)
    ref = _decode(base, ids, 2)
    for over in (
        {"hidden_act": "silu"},
        {"rope_local_theta": None},
        {"query_pre_attn_scalar": None},
        {"layer_types": None, "sliding_window": None},
    ):
        m = _model(**over)
        assert fastpath.install(m) is None
        assert not torch.allclose(_decode(m, ids, 2), ref, atol=1e-3), over


def test_gemma3_batch_rows_equal_single_rows() -> None:
    m = _model(8)
    assert fastpath.install(m) is None
    fast = m.__dict__["fast_decode"]
    prompts = [[3, 5, 7, 11, 13, 2], [17, 19], [23, 29, 31, 37, 41, 43, 47]]
    caches = [m.new_cache() for _ in prompts]
    with torch.inference_mode():
        for c, p in zip(caches, prompts):
            m(torch.tensor([p]), cache=c)
        x = m.embed(torch.tensor([[5], [6], [7]]))  # (3, 1, H)
        starts = [len(p) for p in prompts]
        batch = fast.layers_batch(x, caches, starts)
        for b, (c, p) in enumerate(zip(caches, prompts)):
            c2 = m.new_cache()
            m(torch.tensor([p]), cache=c2)
            alone = fast.layers(x[b : b + 1], c2, len(p))
            assert torch.equal(batch[b : b + 1], alone)


def test_a_tensor_parallel_rank_without_kv_heads_batches_rows_at_one_position() -> None:
    """Gemma 3's single KV head lives on one rank of a TP-2 split; the other rank's caches
    hold no buffer at all. Two sequences at the same position in one batched step are then
    distinct caches (the compiled step refused them as one cache written twice), and each row
    computes what it computes alone."""
    m = _model(8, intermediate_size=128)  # down_proj's columns split on whole groups of 32
    plan = tp.make_plan(m.config, 2)
    assert plan.kv[1] == (1, 1)  # rank 1 holds none of the one KV head
    tp.shard(m, plan, 1, 2, lambda x: x)  # rank 1 alone: its partial sums, unreduced
    assert fastpath.install(m) is None
    x = torch.randn(3, 1, m.config.hidden_size, generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        caches = [m.new_cache() for _ in range(3)]
        batch = m.forward_ragged(x.view(1, 3, -1), [Span(c, 0, 1) for c in caches])
        for b in range(3):
            alone = m.forward_ragged(x[b].view(1, 1, -1), [Span(m.new_cache(), 0, 1)])
            assert torch.equal(batch[0, b], alone[0, 0])


@pytest.mark.parametrize("bits", [None, 8], ids=["fp32", "q8"])
@pytest.mark.parametrize("fast", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("kv", [1, 2], ids=["one-kv-head", "two-kv-heads"])
def test_gemma3_tensor_parallel_equals_one_device(bits, fast, kv) -> None:
    """Gemma 3's sandwich norms take the all-reduced sums (a norm of partial sums would not
    add up); with one KV head the second rank holds no attention at all. fp32 within 1e-5.
    int8 (``QuantLinear``: no split-K tree, see edge/tp.py "Bit-exact TP") adds a row-parallel
    matrix's halves in another order than one device's kernel, and the next layer re-quantizes
    activations per 32 values, so a last-bit difference can move one value by a quantization
    step (0.006 on logits of about 0.2 for some draws of the norm weights, 0 for others)."""
    from tests.edge.test_tp import _tp_logits

    full = _model(bits, intermediate_size=128, num_key_value_heads=kv)
    ids = torch.randint(0, 97, (1, 12), generator=torch.Generator().manual_seed(7))
    with torch.inference_mode():
        ref = full(ids)
    got, _ = _tp_logits(full, 2, None, ids, fast=fast)
    assert (got - ref).abs().max().item() <= (1e-5 if bits is None else 2e-2)


def test_thread_count_does_not_change_the_bits() -> None:
    """Rows of each linear and (with one KV head) the query heads of attention are split over
    threads; every value is computed as on one thread."""
    m = _model(8, num_attention_heads=3)  # a group of 3 heads splits unevenly over 2 threads
    assert fastpath.install(m) is None
    ids = torch.randint(0, 97, (1, 12), generator=torch.Generator().manual_seed(4))
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = _decode(m, ids, 3)
        torch.set_num_threads(2)
        two = _decode(m, ids, 3)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)


def _chunked_logits(m: LlamaForCausalLM, ids: list[int], cuts: list[int]) -> torch.Tensor:
    """Logits of every position of ``ids``, the prompt fed in chunks ending at ``cuts``."""
    cache, out, start = m.new_cache(), [], 0
    with torch.inference_mode():
        for end in [*cuts, len(ids)]:
            h = m.forward_ragged(
                m.embed(torch.tensor([ids[start:end]])), [Span(cache, start, end - start)]
            )
            out.append(m.head(h[0]))
            start = end
    return torch.cat(out)


@pytest.mark.parametrize("bits", [None, 8], ids=["fp32", "q8"])
@pytest.mark.parametrize("family", ["gemma3", "llama"])
def test_a_token_computes_the_same_however_its_prompt_was_chunked(bits, family) -> None:
    """Repeatable temperature 0: one token at a time, the whole prompt at once, or chunks
    crossing the sliding window (as the prefix cache and chunked prefill cut it) give every
    position the same bits, and so do the model's own forward and the engine's ragged pass."""
    over = (
        {}
        if family == "gemma3"
        else {
            "model_type": "llama",
            "sliding_window": None,
            "layer_types": None,
            "norm_unit_offset": False,
            "sandwich_norms": False,
            "qk_norm": False,
            "hidden_act": "silu",
            "query_pre_attn_scalar": None,
            "scale_embeddings": False,
        }
    )
    m = _model(bits, **over)
    assert fastpath.install(m) is None
    ids = torch.randint(0, 97, (23,), generator=torch.Generator().manual_seed(9)).tolist()
    alone = _chunked_logits(m, ids, list(range(1, 23)))
    for cuts in ([], [5], [3, 11, 12], [22]):
        assert torch.equal(_chunked_logits(m, ids, cuts), alone), cuts
    cache = m.new_cache()
    with torch.inference_mode():
        whole = m(torch.tensor([ids]), cache=cache)[0]
    assert torch.equal(whole, alone)


def test_fast_prompts_is_the_engines_choice() -> None:
    """``BatchConfig.repeatable`` (``--fast-prompts`` clears it) reaches the compiled step:
    long prompt spans then go through the eager layers; on, any span up to the step's batch."""
    from edge.engine import LocalRunner
    from edge.launch import BatchConfig, make_engine
    from lowband.models.llama import ROWWISE_ROWS
    from lowband.models.tokenizer import ByteTokenizer

    m = _model(8)
    assert fastpath.install(m) is None
    fast = m.__dict__["fast_decode"]
    assert fast.max_rows == fastpath.MAX_BATCH
    make_engine(LocalRunner(m), ByteTokenizer(), "m", BatchConfig(parallel=1, repeatable=False))
    assert fast.max_rows == ROWWISE_ROWS
    make_engine(LocalRunner(m), ByteTokenizer(), "m", BatchConfig(parallel=1))
    assert fast.max_rows == fastpath.MAX_BATCH
