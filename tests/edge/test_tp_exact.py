"""Tensor parallelism on ggml files gives one device's bits (edge/tp.py, "Bit-exact TP"): the
row-parallel matrices of a whole model compute split-K in the 2-leaf tree an even 2-way split
reproduces (csrc/splitk.h), on every kernel route, eager and compiled; where the split is off
the leaves the result is only close."""

from __future__ import annotations

import argparse

import pytest
import torch

from edge import fastpath
from edge.formats.gguf import load_gguf, load_gguf_shard
from edge.quant import kernel
from edge.quant.ggml import narrow_ggml
from edge.quant.linear import GGMLLinear
from edge.tp import canonical_chunk, make_reduce
from tests.conftest import run_ranks, tp_head
from tests.edge.test_ggml_quant import weight
from tests.edge.test_gguf_kquants import TYPES, _ids, write_mixed
from transport.loopback import LoopbackGroup

pytestmark = pytest.mark.timeout(600)  # may build the C++ extension first (minutes here)


def test_canonical_chunk() -> None:
    assert canonical_chunk(2048, 256) == 1024  # two leaves of whole super-blocks
    assert canonical_chunk(1024, 256, leaves=4) == 256
    assert canonical_chunk(768, 256, leaves=4) == 0  # 3 blocks: no power-of-two cut
    assert canonical_chunk(256, 256) == 0  # one block: nothing to split
    assert canonical_chunk(640, 32) == 320


@pytest.mark.parametrize("kind", ["Q4_K", "Q6_K", "Q3_K", "Q5_0", "Q4_1"])
@pytest.mark.parametrize("rows", [1, 3, 12, 40])
def test_split_kernel_is_the_tree_of_its_leaves(kind: str, rows: int) -> None:
    """The C++ split-K (any number of activation rows: the decode, batch and GEMM routes, with
    and without the repacked layout) is exactly leaf 0 + leaf 1 of the same kernel."""
    if not kernel.available():
        pytest.skip(f"the C++ kernel is unavailable: {kernel.unavailable_reason()}")
    w = weight(kind, 40, 1024, seed=3, scale=0.01)
    x = torch.randn(rows, 1024, generator=torch.Generator().manual_seed(rows))
    leaves = [
        kernel.ggml_gemv(x[:, a : a + 512].contiguous(), narrow_ggml(w, 1, a, 512))
        for a in (0, 512)
    ]
    want = leaves[0] + leaves[1]
    lin = GGMLLinear(w)
    lin.split_k(512)
    assert torch.equal(lin(x), want)
    if lin.repack():  # the leaves' repacked layouts back to back (AVX-512 VNNI K-quants)
        assert torch.equal(lin(x), want)
    lin.split_k(0)
    assert not torch.equal(lin(x), want)  # unsplit adds in another order


def test_split_fallback_is_the_tree_of_its_leaves() -> None:
    w = weight("Q4_K", 24, 1024, seed=5, scale=0.01)
    x = torch.randn(5, 1024, generator=torch.Generator().manual_seed(1))
    leaves = [
        kernel.ggml_gemv_fallback(x[:, a : a + 256].contiguous(), narrow_ggml(w, 1, a, 256))
        for a in (0, 256, 512, 768)
    ]
    want = (leaves[0] + leaves[1]) + (leaves[2] + leaves[3])
    assert torch.equal(kernel.ggml_gemv_fallback(x, w, chunk=256), want)


def test_narrow_in_keeps_whole_subtrees_only() -> None:
    lin = GGMLLinear(weight("Q4_K", 8, 2048, seed=1))
    lin.split_k(512)  # 4 leaves
    assert lin.narrow_in(0, 1024).k_chunk == 512  # leaves 0-1: a subtree
    assert lin.narrow_in(1024, 1024).k_chunk == 512
    assert lin.narrow_in(512, 512).k_chunk == 0  # one leaf: its plain sum is the leaf
    assert lin.narrow_in(512, 1024).k_chunk == 0  # leaves 1-2: not a subtree
    assert lin.narrow_in(0, 1536).k_chunk == 0  # 3 leaves
    assert lin.narrow_out(0, 4).k_chunk == 512


def _repack(model) -> None:
    for m in model.modules():
        if isinstance(m, GGMLLinear):
            m.repack()


def _tp_logits(
    path, world: int, weights, compiled: bool, repack: bool = False
) -> tuple[torch.Tensor, list]:
    """Rank 0's logits of ``_ids()`` under ``world``-way TP (prefill then 3 decode steps when
    ``compiled``: the compiled step's rows, else one eager forward), and each rank's
    row-parallel split-K chunks."""
    ids = _ids()
    comms = LoopbackGroup(world, timeout=60).comms()
    x = load_gguf(path).embed(ids).detach()

    def rank_fn(r: int):
        def body():
            reduce = make_reduce(comms[r])
            sh, plan = load_gguf_shard(path, r, world, weights=weights, reduce=reduce)
            chunks = [lay.mlp.down_proj.k_chunk for lay in sh.model.layers]
            if repack:
                _repack(sh)
            with torch.inference_mode():
                if not compiled:
                    return tp_head(
                        sh, plan, r, sh.forward_layers(x, cache=None, start=0), reduce
                    ), chunks
                assert fastpath.install(sh) is None and fastpath.active(sh)
                cache, T, outs = sh.new_cache(), ids.shape[1], []
                for a, b in [(0, T - 3)] + [(t, t + 1) for t in range(T - 3, T)]:
                    h = sh.forward_layers(x[:, a:b], cache=cache, start=a)
                    outs.append(tp_head(sh, plan, r, h, reduce))
                return (torch.cat(outs, 1) if r == 0 else None), chunks

        return body

    res = run_ranks([rank_fn(r) for r in range(world)], timeout=300)
    return res[0][0], [c for _, c in res]


def _one_device(path, compiled: bool, repack: bool = False) -> torch.Tensor:
    m = load_gguf(path)
    if repack:
        _repack(m)
    with torch.inference_mode():
        if not compiled:
            return m(_ids())
        assert fastpath.install(m) is None
        cache, ids, T, outs = m.new_cache(), _ids(), _ids().shape[1], []
        for a, b in [(0, T - 3)] + [(t, t + 1) for t in range(T - 3, T)]:
            outs.append(m(ids[:, a:b], cache=cache, start=a))
        return torch.cat(outs, 1)


@pytest.mark.parametrize(
    "compiled,repack",
    [(False, False), (True, False), (False, True)],
    ids=["eager", "compiled", "repacked"],
)
def test_tp2_on_kquants_has_one_devices_bits(tmp_path, compiled: bool, repack: bool) -> None:
    """Q4_K_M-like mix, every block type: o_proj (Q3_K, Q4_K) and down_proj (Q5_0, Q6_K) are
    row-parallel; 2 ranks give one device's logits exactly (``repacked``: 7 rows of K-quants in the
    batch GEMM's layout, split-K leaves' layouts back to back)."""
    if not kernel.available():
        pytest.skip(f"the C++ kernel is unavailable: {kernel.unavailable_reason()}")
    _, path = write_mixed(tmp_path / "m.gguf", TYPES)
    assert [lay.mlp.down_proj.k_chunk for lay in load_gguf(path).model.layers] == [256, 256]
    want = _one_device(path, compiled, repack)
    got, chunks = _tp_logits(path, 2, None, compiled, repack)
    assert chunks == [[0, 0], [0, 0]]  # each rank holds one leaf of each down_proj
    assert torch.equal(got, want)


def test_an_uneven_split_is_close_not_exact(tmp_path) -> None:
    """Where bit-exactness cannot hold: a 2-way split off the leaf boundary (weights 3:1 cut
    down_proj's 1024 columns 768 + 256; the tree's leaves are 512 + 512)."""
    if not kernel.available():
        pytest.skip(f"the C++ kernel is unavailable: {kernel.unavailable_reason()}")
    _, path = write_mixed(tmp_path / "m.gguf", TYPES, intermediate_size=1024)
    want = _one_device(path, False)
    got, chunks = _tp_logits(path, 2, [3, 1], False)
    assert chunks == [[0, 0], [0, 0]]
    assert not torch.equal(got, want)
    assert (got - want).abs().max().item() <= 1e-5 * want.abs().max().item()


def test_benchmark_smoke(tmp_path) -> None:
    """benchmarks.edge_tp_agreement on a tiny file: TP-2 agrees everywhere, bits included."""
    if not kernel.available():
        pytest.skip(f"the C++ kernel is unavailable: {kernel.unavailable_reason()}")
    from benchmarks.edge_tp_agreement import measure

    _, path = write_mixed(tmp_path / "m.gguf", TYPES)
    a = argparse.Namespace(
        gguf=str(path), world=2, len=12, prompts=1, prompt_len=4, tokens=4, seed=0,
        eager=False, timeout=120.0,
    )  # fmt: skip
    res = measure(a)
    assert res["top1_vs_1dev"] == 1.0 and res["hidden_bit_equal"] == 1.0
    assert res["greedy_equal"] == [True]


@pytest.mark.slow
def test_real_gemma3_tp2_greedy_equals_one_device(real_gemma3) -> None:
    """The published (trained) Gemma 3 270M Q4_K_M: TP-2 through the compiled step gives one
    device's hidden states bit for bit over 128 teacher-forced positions, and its greedy
    continuations token for token."""
    from benchmarks.edge_tp_agreement import measure

    a = argparse.Namespace(
        gguf=str(real_gemma3), world=2, len=128, prompts=2, prompt_len=8, tokens=16, seed=0,
        eager=False, timeout=600.0,
    )  # fmt: skip
    res = measure(a)
    assert res["hidden_bit_equal"] == 1.0 and res["top1_vs_1dev"] == 1.0
    assert res["greedy_equal"] == [True, True]


def test_a_split_directory_keeps_the_leaves(tmp_path) -> None:
    """``edge split`` stores each packed matrix's split-K chunk: a 1-way split loads with one
    device's leaves (and logits), a 2-way split's ranks with theirs."""
    from edge.formats.gguf_split import split_gguf
    from edge.shardio import load_shard

    _, path = write_mixed(tmp_path / "m.gguf", TYPES)
    one = split_gguf(path, tmp_path / "s1", 1, None, None)
    got = load_shard(one, fuse=False, fast=False).model
    assert [lay.mlp.down_proj.k_chunk for lay in got.model.layers] == [256, 256]
    assert [lay.self_attn.o_proj.k_chunk for lay in got.model.layers] == [256, 256]
    with torch.inference_mode():
        assert torch.equal(got(_ids()), load_gguf(path)(_ids()))
    two = split_gguf(path, tmp_path / "s2", 2, None, None)
    r0 = load_shard(two, 0, 2, fuse=False, fast=False).model
    assert [lay.mlp.down_proj.k_chunk for lay in r0.model.layers] == [0, 0]  # one leaf each
