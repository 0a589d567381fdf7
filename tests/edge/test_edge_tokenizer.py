"""HF tokenizer.json checkpoints: loaded, used by the engine, decoded back."""

from __future__ import annotations

import tokenizers

from edge.engine import Engine, LocalRunner
from edge.sampling import SamplingParams
from lowband.models.config import ModelConfig
from lowband.models.llama import LlamaForCausalLM, init_weights
from lowband.models.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer


def test_hf_tokenizer_json_roundtrip_and_generation(tmp_path) -> None:
    words = ["<eos>", "hello", "world", "the", "cat", "sat", "on", "mat", "[UNK]"]
    tok = tokenizers.Tokenizer(
        tokenizers.models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]")
    )
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.decoder = tokenizers.decoders.WordPiece()
    tok.save(str(tmp_path / "tokenizer.json"))
    loaded = load_tokenizer(tmp_path, eos_token_id=0)
    assert isinstance(loaded, HFTokenizer) and loaded.vocab_size == len(words)
    assert loaded.encode("the cat sat") == [3, 4, 5]
    assert loaded.decode([1, 2]) == "hello world"
    m = LlamaForCausalLM(
        ModelConfig(
            vocab_size=len(words),
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
        )
    ).eval()
    init_weights(m, std=0.5, seed=2)
    eng = Engine(LocalRunner(m), loaded, model_name="w")
    text, reason, n = eng.complete("the cat", SamplingParams(max_tokens=5))
    assert reason in ("stop", "length") and n <= 5
    assert all(w in words for w in text.split())


def test_byte_tokenizer_marker(tmp_path) -> None:
    ByteTokenizer().save(tmp_path)
    t = load_tokenizer(tmp_path)
    assert isinstance(t, ByteTokenizer)
    assert t.decode(t.encode("héllo")) == "héllo"
