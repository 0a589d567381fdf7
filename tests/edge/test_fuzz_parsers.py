"""Bounded fuzzing of the edge parsers a stranger's bytes reach (issue 25): the control messages
a worker decodes and the GGUF reader. The shared settings, strategies and the contract (one
typed error per parser) are in tests/fuzzing.py; the transport's wire formats are fuzzed in
tests/transport/test_fuzz_wire.py.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import gguf
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from edge.cluster.protocol import MESSAGES, Msg, decode
from edge.formats.gguf import load_gguf
from lowband.errors import ConfigError, ProtocolError
from tests.fuzzing import FUZZ, VALUES

pytestmark = [pytest.mark.security, pytest.mark.timeout(60)]


# ---- edge control messages: the meta map of every master -> worker message -----------------
@st.composite
def control_metas(draw) -> object:
    if draw(st.integers(0, 4)) == 0:
        return draw(VALUES)  # not even a map, or a map without an op
    cls = draw(st.sampled_from(sorted(MESSAGES.values(), key=lambda c: c.OP)))
    meta: dict = {"op": cls.OP}
    for f in dataclasses.fields(cls):
        if draw(st.integers(0, 5)):  # usually present
            meta[f.name] = draw(
                VALUES | st.integers(-5, 5) | st.lists(st.floats(allow_subnormal=False), max_size=3)
            )
    return meta


@FUZZ
@given(control_metas())
def test_control_decode_raises_only_protocol_errors(meta) -> None:
    try:
        msg = decode(meta)
    except ProtocolError:
        return
    assert isinstance(msg, Msg) and decode(msg.encode()) == msg


# ---- the GGUF reader on truncated and mutated files --------------------------------------------
def _tiny_gguf(path: Path) -> bytes:
    """A one-layer Llama GGUF (hidden 8, 2 heads, vocab 16), written by gguf.GGUFWriter."""
    hidden, ff, vocab, heads = 8, 16, 16, 2
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_context_length(32)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(ff)
    w.add_head_count(heads)
    w.add_head_count_kv(heads)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    rng = np.random.default_rng(0)

    def t(name: str, *shape: int) -> None:  # numpy shape (N, K): GGUF (K, N)
        w.add_tensor(name, rng.standard_normal(shape).astype(np.float32))

    t("token_embd.weight", vocab, hidden)
    t("output_norm.weight", hidden)
    for name, shape in {
        "attn_norm.weight": (hidden,),
        "ffn_norm.weight": (hidden,),
        "attn_q.weight": (hidden, hidden),
        "attn_k.weight": (hidden, hidden),
        "attn_v.weight": (hidden, hidden),
        "attn_output.weight": (hidden, hidden),
        "ffn_gate.weight": (ff, hidden),
        "ffn_up.weight": (ff, hidden),
        "ffn_down.weight": (hidden, ff),
    }.items():
        t(f"blk.0.{name}", *shape)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path.read_bytes()


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> tuple[Path, bytes]:
    d = tmp_path_factory.mktemp("fuzz-gguf")
    data = _tiny_gguf(d / "tiny.gguf")
    load_gguf(d / "tiny.gguf")  # the unmutated file loads: the mutations below start valid
    return d, data


@settings(FUZZ, max_examples=200)
@given(st.data())
def test_gguf_reader_raises_only_config_errors(tiny_gguf, data) -> None:
    d, good = tiny_gguf
    buf = bytearray(good)
    header_end = min(len(buf), 2048)  # where the header and metadata live: mutate there mostly
    for _ in range(data.draw(st.integers(0, 4))):
        hi = header_end if data.draw(st.integers(0, 3)) else len(buf)
        i = data.draw(st.integers(0, hi - 1))
        buf[i] = data.draw(st.sampled_from([0, 0xFF, 0x7F, 0x80, 1]) | st.integers(0, 255))
    if data.draw(st.booleans()):
        buf = buf[: data.draw(st.integers(0, len(buf)))]
    path = d / "mutated.gguf"
    path.write_bytes(bytes(buf))
    try:
        load_gguf(path)
    except ConfigError:
        pass


def test_a_metadata_string_that_is_not_utf8_is_a_config_error(tiny_gguf) -> None:
    """Found by the fuzzer above: the reader decodes strings lazily, so a bad byte in the
    architecture's name surfaced as a UnicodeDecodeError from the header check."""
    d, good = tiny_gguf
    at = good.index(b"llama", good.index(b"general.architecture"))
    buf = bytearray(good)
    buf[at] = 0xFF
    path = d / "bad-utf8.gguf"
    path.write_bytes(bytes(buf))
    with pytest.raises(ConfigError, match="not a readable GGUF"):
        load_gguf(path)
    from edge.source import resolve_model  # what `lowband edge run FILE.gguf` opens first

    with pytest.raises(ConfigError, match="not a readable GGUF"):
        resolve_model(path)
