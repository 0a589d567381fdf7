"""The compiled step for B sequences at once (``FastDecode.layers_batch``) and for ggml K-quant
linears: a batch row equals the same token run alone (hidden state, the K/V written, logits),
for fp32, Q8/Q4 and ggml blocks, windowed caches that shift and grow between steps, tensor
parallelism (one all-reduce per block for the whole batch, natively or through Python), and a
GGUF Q4_K_M-style model decodes on the compiled step with the eager path's greedy tokens."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from edge import fastpath
from edge.formats.quantized_checkpoint import fuse_quant_rows
from edge.quant import quantize_modules
from edge.quant.ggml import GGML_TYPES, GGMLWeight
from edge.quant.linear import GGMLLinear
from edge.tp import make_plan, make_reduce, shard
from lowband.models.config import ModelConfig
from lowband.models.llama import KVCache, LlamaForCausalLM, fuse_projections, init_weights
from tests.conftest import run_ranks
from tests.edge.test_fastpath import _star
from tests.edge.test_ggml_quant import random_blocks

pytestmark = pytest.mark.timeout(600)  # the first test may build the C++ extension (minutes)

BASE = dict(
    vocab_size=97,
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
)
# |q * scale| of each ggml format at most: blocks with d ~ 0.1 / MAG give weights of ~0.1.
MAG = {"Q2_K": 45, "Q3_K": 128, "Q4_K": 945, "Q5_K": 1953, "Q6_K": 4064}
MAG |= {"Q4_1": 15, "Q5_0": 16, "Q5_1": 31}


def _ggml(m: LlamaForCausalLM, types: list[str]) -> None:
    """Every linear of ``m`` (head included) becomes random ggml blocks, types taken in turn."""
    names = [n for n, mod in m.named_modules() if type(mod) is nn.Linear]
    for i, name in enumerate(names):
        lin = m.get_submodule(name)
        kind = types[i % len(types)]
        n, k = lin.weight.shape
        raw = random_blocks(kind, n, k, seed=i, scale=0.1 / MAG[kind])
        w = GGMLWeight(GGML_TYPES[kind], (n, k), torch.from_numpy(raw))
        bias = None if lin.bias is None else lin.bias.detach()
        parent, _, child = name.rpartition(".")
        setattr(m.get_submodule(parent) if parent else m, child, GGMLLinear(w, bias))


def _model(kind: str = "fp32", fuse: bool = True, **over) -> LlamaForCausalLM:
    m = LlamaForCausalLM(ModelConfig(**{**BASE, **over})).eval()
    init_weights(m, seed=3)
    with torch.no_grad():
        for n, p in m.named_parameters():
            if n.endswith("bias"):
                p.normal_(0, 0.1)
    if kind in ("q8", "q4"):
        quantize_modules(m, bits=int(kind[1]), group=32)
    elif kind != "fp32":
        _ggml(m, kind.split("+"))
    if fuse:
        fuse_projections(m, fuse_quant_rows)
    return m


def _prefilled(m: LlamaForCausalLM, lengths: list[int], seed: int = 0) -> list[KVCache]:
    """One cache per sequence, each prefilled with its own random tokens on the eager path."""
    fast = m.__dict__["fast_decode"]
    fastpath.uninstall(m)
    caches = []
    with torch.inference_mode():
        for i, n in enumerate(lengths):
            ids = torch.randint(0, 97, (1, n), generator=torch.Generator().manual_seed(seed + i))
            cache = m.new_cache()
            m(ids, cache=cache)
            caches.append(cache)
    m.__dict__["fast_decode"] = fast
    return caches


def _alone(fast, x: torch.Tensor, cache: KVCache, start: int) -> torch.Tensor:
    """One row through the single-sequence step, as ``forward_layers`` drives it."""
    cache.prepare(start, 1)
    out = fast.layers(x, cache, start)
    cache.length = start + 1
    return out


def _held(cache: KVCache, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The K/V of every position ``cache`` holds (slots 0..length-base-1)."""
    n = cache.length - cache.base
    return cache.k[layer][:, :, :n], cache.v[layer][:, :, :n]  # type: ignore[index]


def _check_step(m: LlamaForCausalLM, caches: list[KVCache], x: torch.Tensor) -> torch.Tensor:
    """layers_batch on ``caches`` against one ``layers`` call per row on copies of them."""
    fast = m.fast_decode
    starts = [c.length for c in caches]
    refs = [copy.deepcopy(c) for c in caches]
    with torch.inference_mode():  # as a runtime decodes (the prefilled caches need it)
        got = fast.layers_batch(x, caches, starts)
        want = torch.cat([_alone(fast, x[b : b + 1], refs[b], s) for b, s in enumerate(starts)])
    assert got.shape == x.shape
    want = want.view(x.shape)
    scale = max(1.0, want.abs().max().item())
    assert (got - want).abs().max().item() <= 1e-4 * scale
    # the kernels treat rows independently and in the same order: bit for bit the same
    assert torch.equal(got, want)
    for c, r, s in zip(caches, refs, starts):
        assert c.length == r.length == s + 1 and c.base == r.base
        for layer in range(m.config.num_hidden_layers):
            for a, b in zip(_held(c, layer), _held(r, layer)):
                assert torch.equal(a, b)
            # and the new position's K/V are really there (not zeros)
            assert _held(c, layer)[0][:, :, s - c.base].abs().sum() > 0
    return got


KINDS = ["fp32", "q8", "q4", "Q4_K", "Q6_K", "Q4_K+Q6_K+Q5_0+Q2_K"]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("fuse", [True, False], ids=["fused", "unfused"])
def test_batch_rows_equal_single_rows(kind, fuse) -> None:
    m = _model(kind, fuse)
    assert fastpath.install(m) is None, fastpath.unsupported_reason(m)
    lengths = [3, 11, 1, 30, 7, 18]  # B = 6: row tiles of 4 + 2
    caches = _prefilled(m, lengths)
    gen = torch.Generator().manual_seed(7)
    for _ in range(3):  # consecutive steps: positions advance per row
        x = torch.randn(len(lengths), 1, m.config.hidden_size, generator=gen)
        h = _check_step(m, caches, x)
    logits = m.fast_decode.head(h)
    assert logits.shape == (len(lengths), 1, m.config.vocab_size)
    rows = torch.cat([m.fast_decode.head(h[b : b + 1]) for b in range(len(lengths))])
    assert torch.equal(logits, rows)
    flat = m.fast_decode.head(h.view(len(lengths), -1))  # (B, H) -> (B, V)
    assert torch.equal(flat, logits.view(len(lengths), -1))


def test_qwen3_batch_rows_equal_single_rows() -> None:
    """Qwen3's per-head q/k norms in the batched step: each row as the same token alone."""
    m = _model("Q4_K", model_type="qwen3", qk_norm=True, head_dim=128)
    with torch.no_grad():
        for layer in m.model.layers:
            layer.self_attn.q_norm.weight.normal_(1, 0.3)
            layer.self_attn.k_norm.weight.normal_(1, 0.3)
    assert fastpath.install(m) is None, fastpath.unsupported_reason(m)
    caches = _prefilled(m, [3, 11, 1, 7, 18])
    gen = torch.Generator().manual_seed(8)
    for _ in range(2):
        _check_step(m, caches, torch.randn(5, 1, m.config.hidden_size, generator=gen))


@pytest.mark.parametrize("kind", ["fp32", "q4"])
def test_head_of_many_rows(kind) -> None:
    """Past 32 rows an fp32 head runs on PyTorch's GEMM (faster there); packed heads stay
    compiled. Either way the logits are the per-row ones."""
    m = _model(kind)
    assert fastpath.install(m) is None
    fast = m.fast_decode
    h = torch.randn(1, 40, m.config.hidden_size, generator=torch.Generator().manual_seed(5))
    with torch.inference_mode():
        got = fast.head(h)
        rows = torch.cat([fast.head(h[:, t : t + 1]) for t in range(40)], dim=1)
        eager = m.lm_head(m.model.norm(h))
    assert got.shape == (1, 40, m.config.vocab_size)
    if kind == "fp32":
        assert torch.equal(got, eager)
        assert torch.allclose(got, rows, atol=1e-4)
    else:
        assert torch.equal(got, rows)


@pytest.mark.parametrize("kind", ["fp32", "q4", "Q4_K"])
def test_large_batch_and_two_dim_rows(kind) -> None:
    """B = 37: more rows than one activation group of the tiled kernels (32), x given (B, H)."""
    m = _model(kind, num_hidden_layers=1)
    assert fastpath.install(m) is None
    lengths = [1 + (7 * i) % 23 for i in range(37)]
    caches = _prefilled(m, lengths, seed=100)
    x = torch.randn(37, m.config.hidden_size, generator=torch.Generator().manual_seed(8))
    _check_step(m, caches, x)


def test_batch_of_one_equals_layers() -> None:
    m = _model("q8")
    assert fastpath.install(m) is None
    (cache,) = _prefilled(m, [9])
    _check_step(m, [cache], torch.randn(1, 1, m.config.hidden_size))


@pytest.mark.parametrize("kind", ["q8", "Q6_K"])
def test_sliding_window_batch_shifts_and_grows(kind) -> None:
    """A windowed model: one sequence's cache drops old keys (base moves) and another's grows
    past its capacity between batch steps; the C++ side takes the new buffers each time."""
    m = _model(kind, sliding_window=5, model_type="qwen2", attention_bias=True)
    assert fastpath.install(m) is None
    lengths = [2, 62, 9, 40]  # the 62-long one reaches its capacity (64) in the loop
    caches = _prefilled(m, lengths)
    gens = [c.generation for c in caches]
    gen = torch.Generator().manual_seed(9)
    for _ in range(6):
        x = torch.randn(len(lengths), 1, m.config.hidden_size, generator=gen)
        _check_step(m, caches, x)
    assert caches[1].base > 0  # it shifted instead of growing
    assert caches[1].generation != gens[1]
    # a model without a window grows instead
    m2 = _model(kind)
    assert fastpath.install(m2) is None
    caches = _prefilled(m2, [63, 4])
    cap = caches[0].capacity()
    for _ in range(3):
        _check_step(m2, caches, torch.randn(2, 1, m2.config.hidden_size, generator=gen))
    assert caches[0].capacity() > cap and caches[0].base == 0


def test_bad_batches_are_refused() -> None:
    m = _model()
    assert fastpath.install(m) is None
    fast = m.fast_decode
    H = m.config.hidden_size
    caches = _prefilled(m, [3, 4])
    with pytest.raises(ValueError, match="2 caches but 3 positions"):
        fast.layers_batch(torch.zeros(2, 1, H), caches, [3, 4, 5])
    with pytest.raises(ValueError, match="x must be"):
        fast.layers_batch(torch.zeros(3, 1, H), caches, [3, 4])
    with pytest.raises(ValueError, match="x must be"):
        fast.layers_batch(torch.zeros(2, 1, H + 1), caches, [3, 4])
    with pytest.raises(ValueError, match="x must be"):
        fast.layers_batch(torch.zeros(2, 2, H), caches, [3, 4])
    with pytest.raises(ValueError, match="own KVCache"):
        fast.layers_batch(torch.zeros(2, 1, H), [caches[0], caches[0]], [3, 3])
    with pytest.raises(ValueError, match="1..1024 rows"):
        fast.layers_batch(torch.zeros(0, 1, H), [], [])
    with pytest.raises(ValueError, match=">= 0"):
        fast.layers_batch(torch.zeros(2, 1, H), caches, [3, -1])
    assert [c.length for c in caches] == [3, 4]  # nothing ran
    # the C++ side checks what reaches it too
    dec = fast._dec
    t0 = fast._cache_table(caches[0], 3)
    with pytest.raises(RuntimeError, match="one of each per row"):
        dec.layers_batch(torch.zeros(2, H), [3, 4], [0], [t0, t0])
    with pytest.raises(RuntimeError, match="rows of hidden_size"):
        dec.layers_batch(torch.zeros(1, H + 1), [3], [0], [t0])
    with pytest.raises(RuntimeError, match="cannot hold position"):
        dec.layers_batch(torch.zeros(1, H), [t0[0, 2].item()], [0], [t0])
    with pytest.raises(RuntimeError, match="write one position of one KV cache"):
        dec.layers_batch(torch.zeros(2, H), [3, 3], [0, 0], [t0, t0])
    with pytest.raises(ValueError, match="each at least one"):
        fast.layers_spans(torch.zeros(2, H), caches, [3, 4], [2, 0])
    with pytest.raises(ValueError, match="x must hold 3 rows"):
        fast.layers_spans(torch.zeros(2, H), caches, [3, 4], [2, 1])
    with pytest.raises(RuntimeError, match="not a cache table"):
        dec.layers_batch(torch.zeros(1, H), [3], [0], [torch.zeros(3, 3)])
    other = _model()
    assert fastpath.install(other) is None
    foreign = other.fast_decode._cache_table(other.new_cache(), 0)
    with pytest.raises(RuntimeError, match="another decoder"):
        dec.layers_batch(torch.zeros(1, H), [0], [0], [foreign])
    # a well-formed batch still runs afterwards
    _check_step(m, caches, torch.randn(2, 1, H))


def test_reduce_hook_runs_once_per_block_for_the_batch() -> None:
    m = _model("q8")
    seen: list[tuple[int, ...]] = []

    def reduce(x: torch.Tensor) -> torch.Tensor:
        seen.append(tuple(x.shape))
        return x  # one device: the sum is the partial sum itself

    for layer in m.model.layers:
        layer.self_attn.reduce = reduce
        layer.mlp.reduce = reduce
    assert fastpath.install(m) is None
    caches = _prefilled(m, [4, 9, 2])
    seen.clear()
    x = torch.randn(3, 1, m.config.hidden_size)
    _check_step(m, caches, x)  # the single-row reference calls it too, after the batch
    L = m.config.num_hidden_layers
    assert seen[: 2 * L] == [(1, 3, m.config.hidden_size)] * (2 * L)
    assert seen[2 * L :] == [(1, 1, m.config.hidden_size)] * (2 * L * 3)


@pytest.mark.parametrize("native", [(True, True), (True, False)], ids=["both", "master-native"])
def test_batch_over_native_star_link_matches_single_device(native) -> None:
    """TP-2 over a real star link: each rank runs layers_batch on its shard; the (1, B, H)
    partial sums go natively (or from Python on the worker: same bytes on the wire)."""
    full = _model("q8", fuse=False)
    lengths = [5, 2, 13]
    B, world = len(lengths), 2
    H = full.config.hidden_size
    one = copy.deepcopy(full)
    fuse_projections(one, fuse_quant_rows)
    assert fastpath.install(one) is None
    ref_caches = _prefilled(one, lengths)
    xs = torch.randn(2, B, 1, H, generator=torch.Generator().manual_seed(11))
    want = [one.fast_decode.layers_batch(x, ref_caches, [c.length for c in ref_caches]) for x in xs]
    ids = [
        torch.randint(0, 97, (1, n), generator=torch.Generator().manual_seed(i))
        for i, n in enumerate(lengths)
    ]
    emb = [full.embed(t).detach() for t in ids]
    links = _star(world)
    plan = make_plan(full.config, world, None, ffn_unit=32)

    def rank_fn(r: int):
        def body():
            reduce = make_reduce(links[r], timeout=20)
            m = shard(copy.deepcopy(full), plan, r, world, reduce)
            fuse_projections(m, fuse_quant_rows)
            assert fastpath.install(m) is None and m.fast_decode.link is links[r]
            if not native[r]:
                m.fast_decode.link = None  # the C++ step calls the Python hook instead
            caches = [m.new_cache() for _ in lengths]
            outs = []
            with torch.inference_mode():
                for c, e in zip(caches, emb):
                    m.forward_layers(e, cache=c, start=0)
                for x in xs:
                    outs.append(m.fast_decode.layers_batch(x, caches, [c.length for c in caches]))
            return outs

        return body

    try:
        got = run_ranks([rank_fn(r) for r in range(world)], timeout=60)[0]
        L = full.config.num_hidden_layers
        prefill = sum(2 * L * 4 * H * n for n in lengths)
        assert links[1].stats().bytes_sent == prefill + len(xs) * 2 * L * 4 * H * B
        # one all-reduce per block per step, whatever B
        assert links[0]._seq == links[1]._seq == 2 * L * (len(lengths) + len(xs))
    finally:
        for link in links:
            link.close()
    for g, w in zip(got, want):
        assert (g - w).abs().max().item() <= 1e-2 * max(1.0, w.abs().max().item())


# ---- ggml blocks in the compiled step --------------------------------------------------------
def _greedy(m: LlamaForCausalLM, prompt: torch.Tensor, steps: int, compiled: bool = False):
    """The prompt through the eager layers, then ``steps`` greedy decode steps through the
    compiled step (``compiled``) or the eager layers: the decode steps are what is compared
    (the compiled path's prompt rows differ from the eager GEMMs by int8 rounding flips)."""
    fastpath.uninstall(m)
    cache, toks, logits = m.new_cache(), [], []
    with torch.inference_mode():
        out = m(prompt, cache=cache)[0, -1]
        if compiled:
            assert fastpath.install(m) is None
        for _ in range(steps):
            logits.append(out)
            tok = int(out.argmax())
            toks.append(tok)
            out = m(torch.tensor([[tok]]), cache=cache)[0, -1]
    return toks, torch.stack(logits)


def test_ggml_model_installs_and_decodes_like_eager() -> None:
    m = _model("Q4_K+Q6_K+Q5_1+Q3_K", fuse=False)
    assert fastpath.unsupported_reason(m) is None
    prompt = torch.randint(0, 97, (1, 6), generator=torch.Generator().manual_seed(12))
    want_toks, want = _greedy(m, prompt, 16)
    got_toks, got = _greedy(m, prompt, 16, compiled=True)
    assert m.fast_decode._head is not None  # ggml head too
    assert got_toks == want_toks
    # both run the same int8-activation kernels; only fp32 sums (norms, attention) differ
    assert (got - want).abs().max().item() <= 1e-2 * max(1.0, want.abs().max().item())


def test_gguf_q4_k_m_file_runs_on_the_compiled_step(tmp_path) -> None:
    """A GGUF file with a Q4_K_M-style mix (and every other K-quant) loaded as published is no
    longer refused, and greedy decoding matches the eager path."""
    from edge.formats.gguf import load_gguf
    from tests.edge.test_gguf_kquants import TYPES, write_mixed

    _, path = write_mixed(tmp_path / "m.gguf", TYPES)
    m = load_gguf(path)
    assert any(isinstance(mod, GGMLLinear) for mod in m.modules())
    assert fastpath.unsupported_reason(m) is None
    prompt = torch.randint(0, 300, (1, 5), generator=torch.Generator().manual_seed(13))
    want_toks, want = _greedy(m, prompt, 12)
    got_toks, got = _greedy(m, prompt, 12, compiled=True)
    assert got_toks == want_toks
    assert (got - want).abs().max().item() <= 1e-2 * max(1.0, want.abs().max().item())
