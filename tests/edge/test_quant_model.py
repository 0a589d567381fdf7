"""Quantized checkpoints end to end: quantize -> save -> load (one device, TP slices, split
files, sliding window) equals the in-memory quantized model; fused projections change nothing."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from edge.formats.quantized_checkpoint import (
    QuantConfig,
    quantize_checkpoint,
    quantize_model,
    read_layout,
)
from edge.quant import QuantLinear
from edge.shardio import WindowConfig, load_shard, split_checkpoint
from edge.tp import make_plan, make_reduce, shard
from lowband.errors import ConfigError
from lowband.models.config import ModelConfig
from lowband.models.llama import LlamaForCausalLM, fuse_projections, init_weights
from lowband.models.weights import save_pretrained
from tests.conftest import run_ranks, tp_head
from transport.loopback import LoopbackGroup

pytestmark = pytest.mark.timeout(120)

BASE = dict(
    vocab_size=97,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
)


def _model(**over) -> LlamaForCausalLM:
    m = LlamaForCausalLM(ModelConfig(**{**BASE, **over})).eval()
    init_weights(m, seed=3)
    return m


def _ids() -> torch.Tensor:
    return torch.randint(0, 97, (1, 9), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("bits,group", [(8, 32), (4, 64)])
def test_saved_quantized_loads_as_stored(tmp_path, bits, group) -> None:
    full = _model(tie_word_embeddings=True)
    src = save_pretrained(full, tmp_path / "fp32")
    out = quantize_checkpoint(src, tmp_path / "q", QuantConfig(bits=bits, group=group))
    layout = read_layout(ModelConfig.from_json(out))
    assert layout.bits == bits and "lm_head" in layout.modules
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is False
    ref = quantize_model(copy.deepcopy(full), QuantConfig(bits=bits, group=group))
    ref_model = copy.deepcopy(full)
    quantize_model(ref_model, QuantConfig(bits=bits, group=group))
    got = load_shard(out).model
    assert isinstance(got.model.layers[0].mlp.down_proj, QuantLinear)
    assert got.model.layers[0].self_attn.qkv is not None  # fused at load
    with torch.no_grad():
        a, b = ref_model(_ids()), got(_ids())
        fp = full(_ids())
    assert (a - b).abs().max().item() <= 1e-4
    # and the quantization error itself is small but real
    err = (a - fp).abs().max().item()
    assert 0 < err < (0.05 if bits == 8 else 0.5)
    assert ref.bits == bits


def test_fused_projections_equal_unfused() -> None:
    m = _model(model_type="qwen2", attention_bias=True)
    with torch.no_grad():
        ref = m(_ids())
        fuse_projections(m)
        got = m(_ids())
    assert (ref - got).abs().max().item() <= 1e-5
    assert set(m.state_dict()) == set(_model(model_type="qwen2", attention_bias=True).state_dict())


@pytest.mark.parametrize("window", [None, 1])
def test_quantized_split_and_tp(tmp_path, window) -> None:
    full = _model()
    q = quantize_checkpoint(
        save_pretrained(full, tmp_path / "fp32"), tmp_path / "q", QuantConfig(bits=4, group=32)
    )
    ref = load_shard(q).model
    with torch.no_grad():
        want = ref(_ids())
    one = split_checkpoint(q, tmp_path / "s1", devices=1)
    win = WindowConfig(window=window) if window else None
    s = load_shard(one, window=win)
    with torch.no_grad():
        assert (s.model(_ids()) - want).abs().max().item() <= 1e-4
    s.close()
    two = split_checkpoint(q, tmp_path / "s2", devices=2)
    group = LoopbackGroup(2, timeout=30)
    comms = group.comms()
    x = ref.embed(_ids()).detach()

    def rank_fn(r: int):
        def body():
            sh = load_shard(two, r, 2, reduce=make_reduce(comms[r]), window=win)
            assert isinstance(sh.model.model.layers[0].mlp.down_proj, QuantLinear)
            with torch.no_grad():
                h = sh.model.forward_layers(x, cache=None, start=0)
                out = tp_head(sh.model, sh.plan, r, h, sh.reduce)
            sh.close()
            return out

        return body

    got = run_ranks([rank_fn(0), rank_fn(1)], timeout=60)[0]
    assert (got - want).abs().max().item() <= 1e-4


def test_in_memory_shard_keeps_packing() -> None:
    full = _model()
    quantize_model(full, QuantConfig(bits=8, group=32))
    plan = make_plan(full.config, 2, ffn_unit=32)
    m1 = shard(copy.deepcopy(full), plan, 1, 2, reduce=lambda t: t)
    down = m1.model.layers[0].mlp.down_proj
    assert isinstance(down, QuantLinear) and down.in_features == 128


def test_group_cutting_split_refused(tmp_path) -> None:
    # 4 KV heads of 32 over 3 devices: rank 1 holds o_proj columns [64, 96), half a group of 64.
    full = _model(num_key_value_heads=4)
    q = quantize_checkpoint(
        save_pretrained(full, tmp_path / "fp32"), tmp_path / "q", QuantConfig(bits=4, group=64)
    )
    with pytest.raises(ConfigError, match="group"):
        split_checkpoint(q, tmp_path / "s3", devices=3)
    with pytest.raises(ConfigError, match="multiple"):  # a width the group does not divide
        quantize_checkpoint(
            save_pretrained(_model(intermediate_size=96), tmp_path / "b"),
            tmp_path / "qb",
            QuantConfig(bits=4, group=64),
        )


def test_foreign_quantization_refused() -> None:
    cfg = ModelConfig.from_hf_dict({**BASE, "quantization_config": {"quant_method": "gptq"}})
    with pytest.raises(ConfigError, match="gptq"):
        read_layout(cfg)
