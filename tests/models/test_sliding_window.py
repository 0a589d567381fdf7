"""Sliding-window attention (Mistral ``sliding_window``) == transformers past the window, for a
full prefill, a chunked prefill and token-by-token decode; unimplemented maths is refused."""

from __future__ import annotations

import pytest
import torch
import transformers

from lowband.errors import ConfigError
from lowband.models.config import ModelConfig
from lowband.models.weights import load_pretrained

pytestmark = pytest.mark.timeout(120)

TINY = dict(
    vocab_size=97,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
)
W = 5


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    torch.manual_seed(0)
    cfg = transformers.MistralConfig(**TINY, sliding_window=W)
    cfg._attn_implementation = "eager"  # the reference masks with the window explicitly
    hf = transformers.MistralForCausalLM(cfg).eval()
    d = tmp_path_factory.mktemp("mistral_sw")
    hf.save_pretrained(d)
    ours = load_pretrained(d)
    assert ours.config.sliding_window == W
    return hf, ours


def _ids(n: int) -> torch.Tensor:
    return torch.randint(0, 97, (1, n), generator=torch.Generator().manual_seed(3))


def test_prefill_longer_than_window(pair) -> None:
    hf, ours = pair
    ids = _ids(23)
    with torch.no_grad():
        ref, got = hf(ids).logits, ours(ids)
        full = ours.__class__(ModelConfig(**{**TINY, "model_type": "mistral"}))
        full.load_state_dict(ours.state_dict())
        unwindowed = full(ids)
    assert (got - ref).abs().max().item() <= 1e-4
    assert (unwindowed - ref).abs().max().item() > 1e-3  # the window really matters here


def test_chunked_prefill_and_decode(pair) -> None:
    hf, ours = pair
    ids = _ids(20)
    with torch.no_grad():
        ref = hf(ids).logits
        cache = ours.new_cache()
        parts = [ours(ids[:, :3], cache=cache), ours(ids[:, 3:11], cache=cache)]
        parts += [ours(ids[:, t : t + 1], cache=cache) for t in range(11, 20)]
    assert (torch.cat(parts, 1) - ref).abs().max().item() <= 1e-4


@pytest.mark.parametrize(
    "field,value",
    [
        ("hidden_act", "gelu"),
        ("mlp_bias", True),
        ("use_sliding_window", True),
        ("layer_types", ["full_attention", "sliding_attention"]),
    ],
)
def test_unimplemented_fields_refused(field, value) -> None:
    with pytest.raises(ConfigError, match=field):
        ModelConfig.from_hf_dict({**TINY, "model_type": "qwen2", field: value})


def test_qwen2_window_ignored_unless_enabled() -> None:
    cfg = ModelConfig.from_hf_dict(
        {**TINY, "model_type": "qwen2", "sliding_window": 8, "use_sliding_window": False}
    )
    assert cfg.sliding_window is None


def test_cache_stops_growing_past_the_window(pair) -> None:
    """A long decode with chunks in between: the cache drops keys older than the window instead
    of growing (capacity stays at its first allocation), the logits stay equal to transformers',
    and restarting below what the cache still holds is refused (0 always works)."""
    hf, ours = pair
    ids = _ids(120)
    with torch.no_grad():
        ref = hf(ids).logits
        cache = ours.new_cache()
        parts = [ours(ids[:, :3], cache=cache)]
        parts += [ours(ids[:, t : t + 1], cache=cache) for t in range(3, 70)]
        parts.append(ours(ids[:, 70:77], cache=cache))  # a chunk after keys were dropped
        parts += [ours(ids[:, t : t + 1], cache=cache) for t in range(77, 120)]
        assert cache.capacity() == 64 and cache.base > 0  # 120 positions in 64 slots
        assert (torch.cat(parts, 1) - ref).abs().max().item() <= 1e-4
        with pytest.raises(RuntimeError, match="dropped"):
            ours(ids[:, 50:51], cache=cache, start=50)
        again = ours(ids[:, :10], cache=cache, start=0)  # a fresh sequence reuses the cache
        assert (again - ref[:, :10]).abs().max().item() <= 1e-4 and cache.base == 0
