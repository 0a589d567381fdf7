"""GGUF: a file written here reads back to the same model; Q8_0/Q4_0 blocks land in the
edge.quant layouts bit for bit (what our own quantizer produces from the same fp32 weights);
unsupported types are refused by name; a GGUF serves through the runtime and TP."""

from __future__ import annotations

import copy

import gguf
import pytest
import torch

from edge.formats.gguf import (
    convert_gguf,
    float_embedding,
    load_gguf,
    load_gguf_shard,
    write_gguf,
)
from edge.formats.gguf_reader import open_reader
from edge.formats.quantized_checkpoint import QuantConfig, quantize_model
from edge.quant import QuantLinear, dequantize, kernel, quantize
from edge.quant.embedding import QuantEmbedding
from edge.shardio import load_shard
from edge.tp import make_reduce
from lowband.errors import ConfigError
from lowband.models.config import ModelConfig
from lowband.models.llama import ROWWISE_ROWS, LlamaForCausalLM, init_weights
from tests.conftest import run_ranks, tp_head
from transport.loopback import LoopbackGroup

pytestmark = pytest.mark.timeout(120)

CFG = dict(
    vocab_size=300,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
)


def _model(**over) -> LlamaForCausalLM:
    m = LlamaForCausalLM(ModelConfig(**{**CFG, **over})).eval()
    init_weights(m, std=0.1, seed=4)
    return m


def _ids() -> torch.Tensor:
    # longer than ROWWISE_ROWS: a plain nn.Linear and the converted shard's linears then both run
    # one GEMM (below it the plain one runs row by row, as single-token decodes do)
    return torch.randint(0, 300, (1, 7 + ROWWISE_ROWS), generator=torch.Generator().manual_seed(2))


@pytest.mark.parametrize("tied", [False, True])
def test_f32_roundtrip_is_exact(tmp_path, tied) -> None:
    m = _model(tie_word_embeddings=tied)
    got = load_gguf(write_gguf(m, tmp_path / "m.gguf"))
    assert got.config.tie_word_embeddings is tied
    for k, v in m.state_dict().items():  # Q/K rows come back un-permuted
        assert torch.equal(got.state_dict()[k], v), k


@pytest.mark.parametrize("ftype,bits", [("q8_0", 8), ("q4_0", 4)])
def test_quant_blocks_map_without_requantizing(tmp_path, ftype, bits) -> None:
    m = _model()
    got = load_gguf(write_gguf(m, tmp_path / "m.gguf", ftype=ftype))
    q = got.model.layers[1].self_attn.k_proj
    assert isinstance(q, QuantLinear) and q.bits == bits and q.group == 32
    ref = quantize_model(copy.deepcopy(m), QuantConfig(bits=bits, group=32))
    ours = copy.deepcopy(m)
    quantize_model(ours, QuantConfig(bits=bits, group=32))
    for name, mod in ours.named_modules():
        if isinstance(mod, QuantLinear):
            other = got.get_submodule(name)
            assert torch.equal(other.qweight, mod.qweight), name
            assert torch.equal(other.scales, mod.scales), name
    # The quantized token embedding keeps the file's groups; a lookup dequantizes its rows.
    packed = quantize(m.model.embed_tokens.weight.detach(), bits, 32)
    table = got.model.embed_tokens
    assert isinstance(table, QuantEmbedding)
    assert torch.equal(table.qweight, packed.qweight) and torch.equal(table.scales, packed.scales)
    emb = dequantize(packed)
    assert torch.equal(table(_ids()), emb[_ids()])
    with torch.no_grad():
        ours.model.embed_tokens.weight.copy_(emb)
        assert (got(_ids()) - ours(_ids())).abs().max().item() <= 1e-4
    assert ref.bits == bits


@pytest.mark.parametrize("tied", [False, True])
def test_gguf_serves_through_shard_and_tp(tmp_path, tied) -> None:
    m = _model(tie_word_embeddings=tied)
    path = write_gguf(m, tmp_path / "m.gguf", ftype="q4_0")
    ref = load_shard(path).model  # the runtime's loader takes a .gguf directly
    with torch.no_grad():
        want = ref(_ids())
    x = ref.embed(_ids()).detach()
    comms = LoopbackGroup(2, timeout=30).comms()

    def rank_fn(r: int):
        def body():
            reduce = make_reduce(comms[r])
            sh, plan = load_gguf_shard(path, r, 2, reduce=reduce)
            assert isinstance(sh.model.layers[0].mlp.down_proj, QuantLinear)
            with torch.no_grad():
                h = sh.forward_layers(x, cache=None, start=0)
                return tp_head(sh, plan, r, h, reduce)

        return body

    got = run_ranks([rank_fn(0), rank_fn(1)], timeout=60)[0]
    assert (got - want).abs().max().item() <= 1e-4
    d = convert_gguf(path, tmp_path / "conv")
    stored = load_gguf(
        path
    )  # what the directory holds: the table in float32 (a float head if tied)
    float_embedding(stored)
    with torch.no_grad():
        assert (load_shard(d).model(_ids()) - stored(_ids())).abs().max().item() <= 1e-4


@pytest.mark.parametrize("ftype", ["q8_0", "q4_0"])
def test_tied_q8_0_q4_0_embedding_is_the_packed_head(tmp_path, ftype) -> None:
    """No output.weight and a Q8_0/Q4_0 token_embd: the head is a QuantLinear over the
    embedding's own groups (no float32 table); with exact fp32 matmuls the logits equal the
    float32 table's that the loader built before; ``edge convert`` still writes that table."""
    m = _model(tie_word_embeddings=True)
    path = write_gguf(m, tmp_path / "t.gguf", ftype=ftype)
    got = load_gguf(path)
    emb, head = got.model.embed_tokens, got.lm_head
    assert isinstance(emb, QuantEmbedding) and isinstance(head, QuantLinear)
    assert head.qweight.data_ptr() == emb.qweight.data_ptr()
    assert head.scales.data_ptr() == emb.scales.data_ptr()
    assert all(p.dim() == 1 for p in got.parameters())  # the norms alone
    before = load_gguf(path)
    float_embedding(before)
    assert before.lm_head.weight is before.model.embed_tokens.weight
    saved = kernel.get_config()
    kernel.configure(enabled=False)
    try:
        with torch.no_grad():
            want, logits = before(_ids()), got(_ids())
            assert torch.equal(emb(_ids()), before.model.embed_tokens(_ids()))
            conv = load_shard(convert_gguf(path, tmp_path / "conv"), fuse=False, fast=False)
            assert torch.equal(conv.model(_ids()), want)
    finally:
        kernel.configure(enabled=saved.enabled)
    torch.testing.assert_close(logits, want, rtol=0, atol=1e-5 * want.abs().max().item())


def test_unsupported_type_is_named(tmp_path) -> None:
    w = gguf.GGUFWriter(str(tmp_path / "bad.gguf"), "llama")
    m = _model()
    write_gguf(m, tmp_path / "ok.gguf")
    r = open_reader(str(tmp_path / "ok.gguf"))
    for f in r.fields.values():
        if f.name.startswith("GGUF.") or f.name == "general.architecture":
            continue
        w.add_key_value(
            f.name,
            f.contents(),
            f.types[0] if len(f.types) == 1 else f.types[0],
            sub_type=f.types[-1] if len(f.types) > 1 else None,
        )
    for t in r.tensors:
        a = (
            torch.from_numpy(t.data.copy()).float().numpy()
            if t.tensor_type.name == "F32"
            else t.data
        )
        if t.name == "blk.0.ffn_up.weight":
            a = a.reshape(tuple(int(s) for s in reversed(t.shape)))
            qt = gguf.GGMLQuantizationType.MXFP4
            w.add_tensor(t.name, gguf.quants.quantize(a, qt), raw_dtype=qt)
        else:
            w.add_tensor(t.name, a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ConfigError, match="blk.0.ffn_up.weight has type MXFP4"):
        load_gguf(tmp_path / "bad.gguf")
