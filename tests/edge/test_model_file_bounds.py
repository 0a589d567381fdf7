"""A model file's header is bounded by the file before anything is built (issue 25).

Before, a 2 MB GGUF claiming 2^20 layers of 2^20 values kept ``load_gguf`` busy for good
(building a million meta-device layers), a GGUF without ``token_embd`` raised StopIteration,
and a safetensors checkpoint whose config.json claimed 2^20 layers did the same in
``load_pretrained``. Each forged file below must be refused with a ConfigError naming the
field, quickly and without holding memory.
"""

from __future__ import annotations

import json
import time
import tracemalloc
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest

from edge.formats.gguf import load_gguf, write_gguf
from edge.formats.gguf_reader import open_reader
from lowband.errors import ConfigError
from lowband.models.config import ModelConfig
from lowband.models.llama import LlamaForCausalLM
from lowband.models.weights import load_pretrained, save_pretrained

pytestmark = [pytest.mark.security, pytest.mark.timeout(60)]

BIG = 1 << 20


def _model() -> LlamaForCausalLM:
    return LlamaForCausalLM(
        ModelConfig(
            vocab_size=64,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
        )
    )


@pytest.fixture(scope="module")
def good(tmp_path_factory) -> Path:
    return write_gguf(_model(), tmp_path_factory.mktemp("gguf") / "ok.gguf")


def _rewrite(
    src: Path,
    dst: Path,
    fields: dict[str, Any] | None = None,
    drop: tuple[str, ...] = (),
    pad: int = 0,
) -> Path:
    """A copy of ``src`` with some ``llama.*`` fields replaced and some tensors dropped."""
    fields = fields or {}
    r = open_reader(str(src))
    w = gguf.GGUFWriter(str(dst), "llama")
    for f in r.fields.values():
        if f.name.startswith("GGUF.") or f.name == "general.architecture":
            continue
        sub = f.types[-1] if len(f.types) > 1 else None
        w.add_key_value(f.name, fields.get(f.name, f.contents()), f.types[0], sub_type=sub)
    for t in r.tensors:
        if t.name not in drop:
            w.add_tensor(t.name, np.array(t.data), raw_dtype=t.tensor_type)
    if pad:  # file size of a realistic attack, so the bound is not just "the file is tiny"
        w.add_tensor("pad", np.zeros(pad // 4, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


@contextmanager
def _nothing_built() -> Iterator[None]:
    """Fail if a model is built before the refusal (before, a million meta-device layers kept
    the load busy for good), and if the refusal is not back within a hang deadline: 30 s, where
    it takes ~0.01 s and, with the header check removed, reading a million layers' tensor
    names alone took 54 s here before the build. Correct and broken are far apart."""

    def built(self: LlamaForCausalLM, config: ModelConfig, *a: Any, **k: Any) -> None:
        raise AssertionError(f"a {config.num_hidden_layers}-layer model was built first")

    t0 = time.monotonic()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(LlamaForCausalLM, "__init__", built)
        yield
    assert time.monotonic() - t0 < 30.0, "the refusal took as long as a hang"


def _refused(path: Path, match: str) -> None:
    tracemalloc.start()
    try:
        with _nothing_built(), pytest.raises(ConfigError, match=match):
            load_gguf(path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 64 << 20, f"{peak} bytes allocated refusing {path.name}"


def test_the_untouched_file_loads(good):
    assert load_gguf(good).config.num_hidden_layers == 2


def test_a_million_layers_of_a_million_values_is_refused_quickly(good, tmp_path):
    bad = _rewrite(
        good,
        tmp_path / "huge.gguf",
        {"llama.block_count": BIG, "llama.embedding_length": BIG},
        pad=2 << 20,
    )
    _refused(bad, "embedding_length")


def test_a_million_layers_is_refused_quickly(good, tmp_path):
    _refused(_rewrite(good, tmp_path / "layers.gguf", {"llama.block_count": BIG}), "block_count")


def test_one_layer_more_than_the_file_holds_names_the_missing_tensor(good, tmp_path):
    _refused(_rewrite(good, tmp_path / "l3.gguf", {"llama.block_count": 3}), r"blk\.2\.")


def test_a_missing_token_embedding_is_a_config_error(good, tmp_path):
    bad = _rewrite(good, tmp_path / "noembd.gguf", drop=("token_embd.weight",))
    _refused(bad, "token_embd")


@pytest.mark.parametrize(
    "field, value, match",
    [
        ("llama.feed_forward_length", 1 << 30, r"blk\.0\.ffn_gate"),
        ("llama.attention.head_count", 1 << 30, "head_count"),
        ("llama.attention.head_count_kv", 2, r"blk\.0\.attn_k"),
        ("llama.context_length", 1 << 31, "context_length"),
        ("llama.embedding_length", 0, "embedding_length"),
    ],
)
def test_header_widths_must_match_the_tensors(good, tmp_path, field, value, match):
    _refused(_rewrite(good, tmp_path / "w.gguf", {field: value}), match)


def test_a_truncated_file_is_a_config_error(good, tmp_path):
    data = good.read_bytes()
    bad = tmp_path / "cut.gguf"
    bad.write_bytes(data[: len(data) - 1000])
    _refused(bad, "GGUF|outside the file")


def test_garbage_after_the_magic_is_a_config_error(tmp_path):
    bad = tmp_path / "junk.gguf"
    bad.write_bytes(b"GGUF" + bytes(range(256)) * 8)
    _refused(bad, "GGUF")


# ---- safetensors checkpoints ------------------------------------------------------------------
def _checkpoint(tmp_path: Path, **over: Any) -> Path:
    d = save_pretrained(_model(), tmp_path / "ckpt")
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, **over}))
    return d


def test_a_safetensors_checkpoint_claiming_a_million_layers_is_refused(tmp_path):
    d = _checkpoint(tmp_path, num_hidden_layers=BIG)
    with _nothing_built(), pytest.raises(ConfigError, match="num_hidden_layers"):
        load_pretrained(d)


@pytest.mark.parametrize(
    "over, match",
    [
        ({"hidden_size": BIG}, "hidden_size"),
        ({"vocab_size": BIG}, "vocab_size"),
        ({"num_hidden_layers": 3}, r"model\.layers\.2\."),
    ],
)
def test_a_safetensors_config_must_match_its_tensors(tmp_path, over, match):
    d = _checkpoint(tmp_path, **over)
    with _nothing_built(), pytest.raises(ConfigError, match=match):
        load_pretrained(d)


def test_the_untouched_checkpoint_loads(tmp_path):
    assert load_pretrained(_checkpoint(tmp_path)).config.num_hidden_layers == 2
