"""GGUF files as published (Q4_K_M-style mixes of K-quants and the 32-blocks Q4_1/Q5_0/Q5_1):
the matrices load as ``GGMLLinear`` with the file's bytes untouched, the model's logits equal a
model built from gguf-py's dequantization of the same blocks, TP shards them on block
boundaries (and refuses a split that cuts a block), IQ*/TQ* types are refused by name. A tied
head (no ``output.weight``) is a ``GGMLLinear`` over the quantized embedding's own blocks.

The blocks are random bytes with valid fp16 scale fields: gguf-py (0.19) cannot quantize to
K-quants, and any byte pattern is a valid block of these formats."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors import safe_open
from torch import nn

from edge.formats.gguf import (
    _permute,
    convert_gguf,
    float_embedding,
    load_gguf,
    load_gguf_shard,
    write_gguf,
)
from edge.formats.gguf_reader import open_reader
from edge.formats.split_layout import SPLIT_MARKER, head_file
from edge.quant import kernel
from edge.quant.embedding import GGMLEmbedding
from edge.quant.ggml import GGML_TYPES
from edge.quant.linear import GGMLLinear
from edge.shardio import load_shard, split_checkpoint
from edge.tp import make_reduce
from lowband.errors import ConfigError
from lowband.models.config import ModelConfig
from lowband.models.llama import LlamaForCausalLM, init_weights
from tests.conftest import run_ranks, tp_head
from tests.edge.test_ggml_quant import random_blocks
from transport.loopback import LoopbackGroup

pytestmark = pytest.mark.timeout(600)  # may build the C++ extension first (minutes here)

CFG = dict(
    vocab_size=300,
    hidden_size=512,
    intermediate_size=512,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
)
TIE = dict(tie_word_embeddings=True)
# A Q4_K_M-like mix that also covers every other supported block type.
TYPES = {
    "token_embd.weight": "Q6_K",
    "output.weight": "Q6_K",
    "blk.0.attn_q.weight": "Q4_K",
    "blk.0.attn_k.weight": "Q5_K",
    "blk.0.attn_v.weight": "Q6_K",
    "blk.0.attn_output.weight": "Q3_K",
    "blk.0.ffn_gate.weight": "Q2_K",
    "blk.0.ffn_up.weight": "Q4_1",
    "blk.0.ffn_down.weight": "Q5_0",
    "blk.1.attn_q.weight": "Q5_1",
    "blk.1.attn_k.weight": "Q4_K",
    "blk.1.attn_v.weight": "Q6_K",
    "blk.1.attn_output.weight": "Q4_K",
    "blk.1.ffn_gate.weight": "Q4_K",
    "blk.1.ffn_up.weight": "Q4_K",
    "blk.1.ffn_down.weight": "Q6_K",
}
# |q * sc| of each format at most, so that d ~ 0.1 / MAG gives weights of ~0.1.
MAG = {"Q2_K": 45, "Q3_K": 128, "Q4_K": 945, "Q5_K": 1953, "Q6_K": 4064}
MAG |= {"Q4_1": 15, "Q5_0": 16, "Q5_1": 31}
HF = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output.weight": "lm_head.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}


def _hf_name(g: str) -> str:
    if g in HF:
        return HF[g]
    _, i, rest = g.split(".", 2)
    return f"model.layers.{i}.{HF[rest]}"


def write_mixed(path: Path, types: dict[str, str], **over) -> tuple[LlamaForCausalLM, Path]:
    """A GGUF whose listed tensors are random blocks of the given types (GGUF row order), and
    the fp32 model with gguf-py's dequantization of those blocks in HF row order."""
    ref = LlamaForCausalLM(ModelConfig(**{**CFG, **over})).eval()
    init_weights(ref, std=0.1, seed=4)
    cfg = ref.config
    f32 = write_gguf(ref, path.with_suffix(".f32.gguf"))
    r = open_reader(str(f32))
    w = gguf.GGUFWriter(str(path), "llama")
    for f in r.fields.values():
        if f.name.startswith("GGUF.") or f.name == "general.architecture":
            continue
        sub = f.types[-1] if len(f.types) > 1 else None
        w.add_key_value(f.name, f.contents(), f.types[0], sub_type=sub)
    state = ref.state_dict()
    for i, t in enumerate(r.tensors):
        kind = types.get(t.name)
        if kind is None:
            w.add_tensor(t.name, np.array(t.data, dtype=np.float32))
            continue
        hf = _hf_name(t.name)
        n, k = state[hf].shape
        raw = random_blocks(kind, n, k, seed=i, scale=0.1 / MAG[kind])  # HF row order
        qt = gguf.GGMLQuantizationType[kind]
        state[hf].copy_(torch.from_numpy(gguf.quants.dequantize(raw, qt)))
        rows = torch.from_numpy(raw)
        if t.name.endswith("attn_q.weight"):
            rows = _permute(rows, cfg.num_attention_heads)
        elif t.name.endswith("attn_k.weight"):
            rows = _permute(rows, cfg.n_kv_heads)
        w.add_tensor(t.name, rows.contiguous().numpy(), raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return ref, path


def _ids() -> torch.Tensor:
    return torch.randint(0, 300, (1, 7), generator=torch.Generator().manual_seed(2))


@pytest.fixture
def no_kernel():
    saved = kernel.get_config()
    kernel.configure(enabled=False)
    yield
    kernel.configure(enabled=saved.enabled)


def test_kquant_mix_logits_with_the_kernel(tmp_path) -> None:
    """The C++ kernel's int8 activations (per 32 values) move each matmul by ~0.5%; through 2
    layers of random blocks the logits move by 1.85% (the existing Q8_0 kernel: 1.86% on the
    same model's weights), so this is a sanity bound; the kernel's exactness is asserted per
    matmul against an emulation in test_ggml_quant.py."""
    ref, path = write_mixed(tmp_path / "m.gguf", TYPES)
    got = load_gguf(path)
    assert kernel.available(), kernel.unavailable_reason()
    with torch.no_grad():
        want, logits = ref(_ids()), got(_ids())
    assert ((logits - want).norm() / want.norm()).item() < 3e-2


def test_kquant_mix_loads_packed_and_matches_dequantized(tmp_path, no_kernel) -> None:
    """With exact fp32 matmuls (the fallback) the logits equal the dequantized model's."""
    ref, path = write_mixed(tmp_path / "m.gguf", TYPES)
    got = load_gguf(path)
    r = open_reader(str(path))
    by_name = {t.name: t for t in r.tensors}
    for g, kind in TYPES.items():
        if g == "token_embd.weight":
            continue
        mod = got.get_submodule(_hf_name(g).rpartition(".")[0])
        assert isinstance(mod, GGMLLinear) and mod.qtype.name == kind, g
        if "attn_q" not in g and "attn_k" not in g:  # q/k rows are un-permuted
            want = np.asarray(by_name[g].data).view(np.uint8).reshape(mod.out_features, -1)
            assert np.array_equal(mod.blocks.numpy(), want), g
    with torch.no_grad():
        want = ref(_ids())
        logits = got(_ids())
        for g in TYPES:  # every matrix equals gguf-py's dequantization (q/k rows un-permuted)
            hf = _hf_name(g)
            mod = got.get_submodule(hf.rpartition(".")[0])
            # GGMLLinear, or GGMLEmbedding for token_embd
            assert torch.equal(mod.dequantize_weight(), ref.state_dict()[hf]), g
    scale = want.abs().max().item()
    assert scale > 0.1
    assert (logits - want).abs().max().item() <= 1e-5 * scale  # fp32 summation order only


def test_kquant_tp_shards_on_block_boundaries(tmp_path) -> None:
    _, path = write_mixed(tmp_path / "m.gguf", TYPES)
    whole = load_gguf(path)  # the same kernels unsharded: slices on block boundaries keep the
    with torch.no_grad():  # 32-value activation blocks, so only the fp32 sum order differs
        want = whole(_ids())
    x = whole.embed(_ids()).detach()
    comms = LoopbackGroup(2, timeout=60).comms()

    def rank_fn(r: int):
        def body():
            reduce = make_reduce(comms[r])
            sh, plan = load_gguf_shard(path, r, 2, reduce=reduce)
            down = sh.model.layers[1].mlp.down_proj
            assert isinstance(down, GGMLLinear) and down.in_features == 256
            with torch.no_grad():
                h = sh.forward_layers(x, cache=None, start=0)
                return tp_head(sh, plan, r, h, reduce)

        return body

    got = run_ranks([rank_fn(0), rank_fn(1)], timeout=120)[0]
    assert (got - want).abs().max().item() <= 1e-5 * want.abs().max().item()


def test_split_that_cuts_a_block_is_refused(tmp_path) -> None:
    # hidden 256 = 4 heads of 64: o_proj's columns split 128 + 128, inside one Q4_K block.
    types = {"blk.0.attn_output.weight": "Q4_K", "blk.1.attn_output.weight": "Q4_K"}
    _, path = write_mixed(tmp_path / "m.gguf", types, hidden_size=256)
    assert isinstance(load_gguf(path).model.layers[0].self_attn.o_proj, GGMLLinear)
    with pytest.raises(
        ConfigError, match="attn.o_proj: columns .* cut a quantization group of 256"
    ):
        load_gguf_shard(path, 0, 2)
    with pytest.raises(ConfigError, match="Q4_K .*serve the .gguf directly"):
        convert_gguf(path, tmp_path / "out")


# Llama 3.2 / Qwen2.5 as llama.cpp quantizes them: no output.weight, the head is token_embd.
TIED = {k: v for k, v in TYPES.items() if k != "output.weight"}


def _greedy(model: LlamaForCausalLM, n: int = 8) -> list[int]:
    """Greedy continuation of ``_ids()`` through the KV cache (prefill, then one token a step)."""
    cache, out = model.new_cache(), []
    with torch.no_grad():
        logits = model(_ids(), cache=cache)
        for _ in range(n):
            out.append(int(logits[0, -1].argmax()))
            logits = model(torch.tensor([[out[-1]]]), cache=cache)
    return out


def _storage_bytes(model: nn.Module) -> int:
    """Bytes of every distinct storage behind the model's parameters and buffers."""
    seen = {}
    for t in [*model.parameters(), *model.buffers()]:
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())


@pytest.mark.parametrize("embd", ["Q6_K", "Q4_K"])
def test_tied_quantized_embedding_is_the_packed_head(tmp_path, no_kernel, embd) -> None:
    """The tied head is a GGMLLinear over the embedding's blocks: no float32 table anywhere
    (the parameters are the norms alone; every storage together fits in the file), and with
    exact fp32 matmuls the logits and greedy tokens are those of the float32 table that the
    loader built before (``float_embedding``)."""
    ref, path = write_mixed(tmp_path / "t.gguf", {**TIED, "token_embd.weight": embd}, **TIE)
    got = load_gguf(path)
    assert got.config.tie_word_embeddings
    emb, head = got.model.embed_tokens, got.lm_head
    assert isinstance(emb, GGMLEmbedding) and isinstance(head, GGMLLinear)
    assert emb.qtype.name == head.qtype.name == embd
    assert (head.out_features, head.in_features) == (300, 512)
    assert head.blocks.data_ptr() == emb.blocks.data_ptr()  # one copy of the bytes
    norms = (2 * 2 + 1) * 512
    assert sum(p.numel() * p.element_size() for p in got.parameters()) == 4 * norms
    assert _storage_bytes(got) <= path.stat().st_size
    before = load_gguf(path)
    float_embedding(before)
    assert isinstance(before.lm_head, nn.Linear)
    assert before.lm_head.weight is before.model.embed_tokens.weight
    assert sum(p.numel() for p in before.parameters()) == 300 * 512 + norms
    assert _storage_bytes(before) > path.stat().st_size  # the float32 table did not fit
    with torch.no_grad():
        assert torch.equal(emb(_ids()), before.model.embed_tokens(_ids()))
        assert torch.equal(before.model.embed_tokens.weight, ref.model.embed_tokens.weight)
        want, logits = before(_ids()), got(_ids())
    scale = want.abs().max().item()
    assert scale > 0.1
    torch.testing.assert_close(logits, want, rtol=0, atol=1e-5 * scale)  # fp32 sum order only
    assert _greedy(got) == _greedy(before)


def test_tied_quantized_head_with_the_kernel(tmp_path) -> None:
    """The runtime's loader (fused projections, the compiled step where it applies): the C++
    row decoders give the float table's rows to fp32 rounding, and the head's int8 activations
    move the logits by well under the layers' own kernel error (test above: 3e-2)."""
    _, path = write_mixed(tmp_path / "t.gguf", {**TIED, "token_embd.weight": "Q6_K"}, **TIE)
    got = load_shard(path).model
    assert isinstance(got.lm_head, GGMLLinear) and kernel.available()
    before = load_gguf(path)
    float_embedding(before)
    with torch.no_grad():
        torch.testing.assert_close(
            got.model.embed_tokens(_ids()), before.model.embed_tokens(_ids())
        )
        want, logits = before(_ids()), got(_ids())
    assert ((logits - want).norm() / want.norm()).item() < 3e-2


def test_tied_quantized_head_splits_by_vocabulary(tmp_path) -> None:
    """2-way TP straight from the file and from ``edge split``: rank 0 embeds with the packed
    table and its head rows are a view of it; rank 1 holds only its head rows; the gathered
    logits equal the one-device model's."""
    _, path = write_mixed(tmp_path / "t.gguf", {**TIED, "token_embd.weight": "Q6_K"}, **TIE)
    whole = load_gguf(path)
    with torch.no_grad():
        want = whole(_ids())
        x = whole.embed(_ids())
    out = split_checkpoint(path, tmp_path / "split", 2)
    meta = json.loads((out / SPLIT_MARKER).read_text())["packed"]
    assert meta["0"]["model.embed_tokens"] == {
        "ggml": "Q6_K",
        "shape": [300, 512],
        "embedding": True,
    }
    assert "lm_head" not in meta["0"] and "model.embed_tokens" not in meta["1"]
    with safe_open(str(head_file(out, 0)), framework="pt") as sf:
        assert not any(k.startswith("lm_head.") for k in sf.keys())
        assert sf.get_tensor("model.embed_tokens.blocks").dtype == torch.uint8

    def rank_fn(r: int, src: Path, comms):
        def body():
            reduce = make_reduce(comms[r])
            sh = load_shard(src, r, 2, reduce=reduce)
            m, (a, b) = sh.model, sh.plan.vocab_rows(r, 300)
            assert isinstance(m.lm_head, GGMLLinear) and m.lm_head.out_features == b - a > 0
            if r == 0:
                assert isinstance(m.model.embed_tokens, GGMLEmbedding)
                assert m.lm_head.blocks.data_ptr() == m.model.embed_tokens.blocks.data_ptr()
            else:
                assert m.model.embed_tokens.weight.numel() == 0
            with torch.no_grad():
                h = m.forward_layers(x, cache=None, start=0)
                return tp_head(m, sh.plan, r, h, reduce)

        return body

    for src in (path, out):
        comms = LoopbackGroup(2, timeout=60).comms()
        got = run_ranks([rank_fn(0, src, comms), rank_fn(1, src, comms)], timeout=120)[0]
        assert (got - want).abs().max().item() <= 1e-5 * want.abs().max().item(), src


@pytest.mark.parametrize("kind", ["IQ4_XS", "TQ2_0"])
def test_unsupported_block_type_names_tensor_and_type(tmp_path, kind) -> None:
    _, ok = write_mixed(tmp_path / "ok.gguf", {})
    r = open_reader(str(ok))
    w = gguf.GGUFWriter(str(tmp_path / "bad.gguf"), "llama")
    for f in r.fields.values():
        if f.name.startswith("GGUF.") or f.name == "general.architecture":
            continue
        sub = f.types[-1] if len(f.types) > 1 else None
        w.add_key_value(f.name, f.contents(), f.types[0], sub_type=sub)
    qt = gguf.GGMLQuantizationType[kind]
    qk, size = gguf.GGML_QUANT_SIZES[qt]
    for t in r.tensors:
        a = np.array(t.data, dtype=np.float32)
        if t.name == "blk.1.ffn_gate.weight":
            n, k = a.shape
            w.add_tensor(t.name, np.zeros((n, k // qk * size), np.uint8), raw_dtype=qt)
        else:
            w.add_tensor(t.name, a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ConfigError, match=f"blk.1.ffn_gate.weight has type {kind}"):
        load_gguf(tmp_path / "bad.gguf")
    assert kind not in GGML_TYPES
