"""Today's small-model families == transformers: Llama 3.1 rope scaling (and its precomputed
per-frequency form), Qwen3, Gemma 3 text, Phi-3, SmolLM3, Mistral. Each reference is a random
tiny model written by transformers itself, loaded by our loader; decode through the KV cache,
the compiled step's refusals and tensor parallelism are checked on the same checkpoints."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
import transformers

from edge import fastpath
from edge.quant import kernel as qkernel
from edge.tp import make_plan, make_reduce, shard
from lowband.errors import ConfigError
from lowband.models.config import ModelConfig
from lowband.models.llama import (
    LlamaForCausalLM,
    fuse_projections,
    llama3_rope_freq_factors,
    rope_inv_freq,
    with_rope_freq_factors,
)
from lowband.models.weights import load_pretrained, save_pretrained
from tests.conftest import run_ranks, tp_head
from transport.loopback import LoopbackGroup

pytestmark = pytest.mark.timeout(180)

TINY = dict(
    vocab_size=97,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)
LLAMA3 = {
    "rope_type": "llama3",
    "factor": 4.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}
W = 5  # Gemma 3's sliding window: small so that 24-token prompts cross it


def _hf_config(kind: str):
    if kind == "llama3":
        return transformers.LlamaConfig(**TINY, rope_scaling=dict(LLAMA3))  # it adds keys
    if kind == "mistral":
        return transformers.MistralConfig(**TINY)
    if kind == "qwen3":  # head_dim 24 != hidden / heads = 16
        return transformers.Qwen3Config(**TINY, head_dim=24)
    if kind == "gemma3":
        return transformers.Gemma3TextConfig(
            **TINY,
            head_dim=16,
            query_pre_attn_scalar=24,  # != head_dim, so the scale matters
            sliding_window=W,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            rope_parameters={
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
                "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
            },
            final_logit_softcapping=3.0,
            pad_token_id=0,
            bos_token_id=2,
            eos_token_id=1,
        )
    if kind == "phi3":
        return transformers.Phi3Config(**TINY, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    if kind == "smollm3":  # layer 1 is NoPE
        return transformers.SmolLM3Config(
            **TINY, no_rope_layers=[1, 0, 1], pad_token_id=0, bos_token_id=1, eos_token_id=2
        )
    if kind == "qwen3_moe":  # raw top-k probabilities (Mixtral's renormalised ones are tested)
        return transformers.Qwen3MoeConfig(
            **TINY, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2
        )
    raise AssertionError(kind)


KINDS = ["llama3", "mistral", "qwen3", "gemma3", "phi3", "smollm3", "qwen3_moe"]


@pytest.fixture(scope="module")
def loader(tmp_path_factory):
    """kind -> (transformers model, our model loaded from its checkpoint), float32, cached."""
    made: dict[str, tuple] = {}

    def get(kind: str) -> tuple:
        if kind not in made:
            torch.manual_seed(0)
            cfg = _hf_config(kind)
            cfg._attn_implementation = "eager"  # explicit masks: the sliding-window reference
            hf = transformers.AutoModelForCausalLM.from_config(cfg).float().eval()
            with torch.no_grad():  # norms start at 1 (0 for Gemma's 1 + w): make them matter
                for n, p in hf.named_parameters():
                    if p.dim() == 1:
                        p.normal_(0, 0.3) if "norm" in n else p.normal_(0, 0.1)
                    elif any(k in n for k in ("q_proj", "k_proj", "qkv_proj")):
                        p.mul_(8)  # sharper attention: positions (rope, NoPE, windows) matter
            d = tmp_path_factory.mktemp(kind)
            hf.save_pretrained(d)
            made[kind] = (hf, load_pretrained(d))
        return made[kind]

    return get


@pytest.fixture(scope="module", params=KINDS)
def pair(request, loader):
    return (request.param, *loader(request.param))


def _ids(n: int, batch: int = 1) -> torch.Tensor:
    return torch.randint(
        0, TINY["vocab_size"], (batch, n), generator=torch.Generator().manual_seed(1)
    )


def _maxdiff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape
    return (a - b).abs().max().item()


def test_parity_with_transformers(pair) -> None:
    kind, hf, ours = pair
    ids = _ids(70, batch=2)  # past original_max_position_embeddings / factor and the window
    with torch.no_grad():
        ref, got = hf(ids).logits, ours(ids)
    assert _maxdiff(got, ref) <= 1e-4, kind


@pytest.mark.timeout(900)  # the first install may build the C++ extension (minutes on 2 cores)
def test_cached_decode_equals_transformers(pair) -> None:
    """Chunked prefill, then one token at a time through the KV cache, through the compiled
    step: every family has one (routed experts included)."""
    kind, hf, ours = pair
    m = copy.deepcopy(ours)
    fuse_projections(m)
    why = fastpath.install(m)
    if qkernel.available():
        assert why is None and fastpath.active(m), why
    ids = _ids(24)
    with torch.no_grad():
        ref = hf(ids).logits
        cache = m.new_cache()
        parts = [m(ids[:, :4], cache=cache), m(ids[:, 4:11], cache=cache)]
        parts += [m(ids[:, t : t + 1], cache=cache) for t in range(11, 24)]
    assert _maxdiff(torch.cat(parts, 1), ref) <= 1e-4, kind


def test_tensor_parallel_equals_unsharded(pair) -> None:
    """Per-head q/k norms are one (D,) weight shared by every head, so TP replicates them;
    sandwich norms, GeGLU and softcapping act on reduced / per-row values."""
    kind, _, ours = pair
    world = 2
    plan = make_plan(ours.config, world)
    comms = LoopbackGroup(world, timeout=30).comms()
    ids = _ids(12)
    x = ours.embed(ids).detach()
    with torch.no_grad():
        ref = ours(ids)

    def rank_fn(r: int):
        def body():
            reduce = make_reduce(comms[r])
            m = shard(copy.deepcopy(ours), plan, r, world, reduce)
            with torch.no_grad():
                return tp_head(m, plan, r, m.forward_layers(x, cache=None, start=0), reduce)

        return body

    got = run_ranks([rank_fn(r) for r in range(world)], timeout=60)[0]
    assert _maxdiff(got, ref) <= 1e-4, kind


def test_family_fields_are_read(pair) -> None:
    kind, _, ours = pair
    cfg = ours.config
    expect = {
        "llama3": {k: (cfg.rope_scaling or {}).get(k) for k in LLAMA3} == LLAMA3,
        "mistral": cfg.model_type == "mistral" and not cfg.qk_norm,
        "qwen3": cfg.qk_norm and cfg.dim_per_head == 24 and not cfg.attention_bias,
        "gemma3": cfg.sandwich_norms
        and cfg.layer_window(0) == W
        and cfg.layer_window(1) is None
        and cfg.cache_window is None
        and cfg.rope_local_theta == 1e4
        and cfg.tie_word_embeddings,
        "phi3": cfg.model_type == "phi3",
        "smollm3": cfg.no_rope_layers == (1, 0, 1) and cfg.layer_rope(1) is None,
        "qwen3_moe": cfg.is_moe
        and cfg.num_local_experts == 4
        and cfg.intermediate_size == 32
        and not cfg.norm_topk_prob
        and cfg.qk_norm,
    }
    assert expect[kind], cfg


@pytest.mark.parametrize(
    "kind,field,value",
    [
        ("qwen3", "qk_norm", False),
        ("gemma3", "rope_local_theta", None),
        ("gemma3", "final_logit_softcapping", None),
        ("gemma3", "query_pre_attn_scalar", None),
        ("gemma3", "layer_types", None),  # every layer sliding
        ("smollm3", "no_rope_layers", None),
        ("qwen3_moe", "norm_topk_prob", True),
    ],
)
def test_each_family_switch_matters(loader, kind, field, value) -> None:
    """The parity tests above could not pass with the switch ignored: flipping it moves the
    logits by several times their tolerance (1e-4)."""
    hf, ours = loader(kind)
    m = LlamaForCausalLM(dataclasses.replace(ours.config, **{field: value})).eval()
    m.load_state_dict(ours.state_dict(), strict=False)
    ids = _ids(70, batch=2)
    with torch.no_grad():
        assert _maxdiff(m(ids), hf(ids).logits) > 5e-4


def test_llama3_scaling_matters_and_factors_are_equivalent(tmp_path) -> None:
    """The precomputed factors (GGUF rope_freqs, llama.cpp's formula) give Llama 3.1's inverse
    frequencies, and a model built from them equals transformers; plain rope does not."""
    cfg = ModelConfig(**TINY, rope_scaling=LLAMA3)
    factors = llama3_rope_freq_factors(cfg)
    assert factors.shape == (cfg.dim_per_head // 2,)
    assert factors.min().item() == 1.0 and factors.max().item() == LLAMA3["factor"]
    via_factors = with_rope_freq_factors(cfg, factors)
    assert via_factors.rope_scaling is None
    assert torch.allclose(rope_inv_freq(via_factors), rope_inv_freq(cfg), rtol=1e-6, atol=0)
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(_hf_config("llama3")).eval()
    hf.save_pretrained(tmp_path)
    ours = load_pretrained(tmp_path)
    ids = _ids(70)
    with torch.no_grad():
        ref = hf(ids).logits
        outs = {}
        for name, c in (("factors", via_factors), ("plain", ModelConfig(**TINY))):
            m = LlamaForCausalLM(c).eval()
            m.load_state_dict(ours.state_dict())
            outs[name] = m(ids)
    assert _maxdiff(outs["factors"], ref) <= 1e-4
    assert _maxdiff(outs["plain"], ref) > 1e-3  # the scaling really matters at these positions
    with pytest.raises(ConfigError, match="rope_freq_factors"):
        ModelConfig(**TINY, rope_freq_factors=(1.0, 2.0))


@pytest.mark.parametrize(
    "kind,runtime_key",
    [
        ("phi3", "model.layers.0.self_attn.q_proj.weight"),
        ("qwen3_moe", "model.layers.0.block_sparse_moe.experts.1.w3.weight"),
        ("gemma3", "model.layers.0.pre_feedforward_layernorm.weight"),
        ("qwen3", "model.layers.0.self_attn.q_norm.weight"),
        ("smollm3", "model.layers.0.self_attn.q_proj.weight"),
    ],
)
def test_save_pretrained_writes_the_family_names(loader, kind, runtime_key, tmp_path) -> None:
    """What we save, transformers reads back as the same model: Phi-3's fused q/k/v and
    gate/up are split at load and fused again at save, Qwen3-MoE's experts take Mixtral's
    names at load and their own at save, and every family's config.json keeps its maths."""
    hf, ours = loader(kind)
    assert runtime_key in ours.state_dict()
    save_pretrained(ours, tmp_path)
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).float().eval()
    want, got = hf.state_dict(), back.state_dict()
    assert want.keys() == got.keys()
    assert all(torch.equal(want[k], got[k]) for k in want)  # bit for bit
    ids = _ids(16)
    with torch.no_grad():  # (back runs transformers' default attention kernel, hf eager)
        assert _maxdiff(back(ids).logits, hf(ids).logits) <= 1e-6


def test_config_json_round_trip(loader) -> None:
    """A family's config.json as we write it reads back as the same ModelConfig, also for a
    config built by hand (no transformers keys carried in ``extra``)."""
    for kind in KINDS:
        cfg = loader(kind)[1].config
        bare = ModelConfig(**{f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)[:-1]})
        for c in (cfg, bare):
            back = ModelConfig.from_hf_dict(c.to_hf_dict())
            # head_dim is written out even where the checkpoint left it implicit
            assert dataclasses.replace(back, head_dim=c.head_dim) == c, kind


@pytest.mark.parametrize(
    "d,field",
    [
        ({"model_type": "phi3", "rope_parameters": {"partial_rotary_factor": 0.5}}, "partial"),
        ({"model_type": "gemma3_text", "attn_logit_softcapping": 50.0}, "attn_logit"),
        ({"model_type": "gemma3_text", "use_bidirectional_attention": True}, "bidirectional"),
        ({"model_type": "smollm3", "use_sliding_window": True}, "use_sliding_window"),
        ({"model_type": "qwen3", "use_sliding_window": True}, "use_sliding_window"),
        ({"model_type": "qwen3", "hidden_act": "relu"}, "hidden_act"),
        ({"model_type": "phi3", "rope_scaling": {"rope_type": "longrope"}}, "rope_scaling"),
        ({"model_type": "smollm3", "no_rope_layers": [1, 0]}, "no_rope_layers"),
        ({"model_type": "qwen3_moe", "mlp_only_layers": [0]}, "mlp_only_layers"),
        ({"model_type": "qwen3_moe", "decoder_sparse_step": 2}, "decoder_sparse_step"),
        ({"model_type": "gemma2"}, "model_type"),
    ],
)
def test_unimplemented_family_fields_refused(d, field) -> None:
    with pytest.raises(ConfigError, match=field):
        ModelConfig.from_hf_dict({**TINY, **d})
