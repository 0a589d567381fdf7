"""Ours == transformers on random tiny checkpoints written by transformers itself."""

from __future__ import annotations

import pytest
import torch
import transformers

from lowband.models.config import ModelConfig
from lowband.models.llama import LlamaForCausalLM, init_weights
from lowband.models.weights import load_pretrained, save_pretrained

TINY = dict(
    vocab_size=97,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
)


def _hf_model(kind: str):
    torch.manual_seed(0)
    if kind == "llama":
        cfg = transformers.LlamaConfig(
            **TINY,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16,
            },
        )
        return transformers.LlamaForCausalLM(cfg)
    if kind == "llama_tied":
        return transformers.LlamaForCausalLM(
            transformers.LlamaConfig(**TINY, tie_word_embeddings=True)
        )
    if kind == "qwen2":
        return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**TINY))
    if kind == "mixtral":
        return transformers.MixtralForCausalLM(
            transformers.MixtralConfig(**TINY, num_local_experts=4, num_experts_per_tok=2)
        )
    raise AssertionError(kind)


@pytest.mark.parametrize("kind", ["llama", "llama_tied", "qwen2", "mixtral"])
def test_parity_with_transformers(kind: str, tmp_path) -> None:
    hf = _hf_model(kind).eval()
    with torch.no_grad():  # random init leaves biases at zero; make them matter
        for n, p in hf.named_parameters():
            if n.endswith("bias"):
                p.normal_(0, 0.1)
    hf.save_pretrained(tmp_path)
    ours = load_pretrained(tmp_path)
    ids = torch.randint(0, TINY["vocab_size"], (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(ids).logits
        got = ours(ids)
    assert got.shape == ref.shape
    assert (got - ref).abs().max().item() <= 1e-4


def test_cached_decode_equals_full_forward() -> None:
    cfg = ModelConfig(**TINY)
    model = LlamaForCausalLM(cfg).eval()
    init_weights(model, seed=3)
    ids = torch.randint(0, cfg.vocab_size, (1, 30), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        full = model(ids)
        cache = model.new_cache()
        parts = [model(ids[:, :11], cache=cache), model(ids[:, 11:20], cache=cache)]
        parts += [model(ids[:, t : t + 1], cache=cache) for t in range(20, 30)]
    inc = torch.cat(parts, dim=1)
    assert cache.length == 30
    assert (inc - full).abs().max().item() <= 1e-5


def test_save_load_roundtrip_dtypes(tmp_path) -> None:
    cfg = ModelConfig(**TINY, tie_word_embeddings=True)
    model = LlamaForCausalLM(cfg).eval()
    init_weights(model, seed=4)
    save_pretrained(model, tmp_path, dtype=torch.bfloat16)
    back = load_pretrained(tmp_path)
    assert back.model.embed_tokens.weight.dtype == torch.bfloat16
    assert back.lm_head.weight is back.model.embed_tokens.weight
    as32 = load_pretrained(tmp_path, dtype=torch.float32)
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        diff = (as32(ids) - model(ids)).abs().max().item()
    assert 0 < diff < 0.05  # bf16 rounding of the weights, nothing worse
