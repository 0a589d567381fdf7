"""lowband's GGUF reader (a faster ``gguf.GGUFReader``) builds the same fields and tensors as
the stock reader, on llama.cpp's own vocabulary files and on a file with every value type, and
refuses an array or string that runs past the end of the file before allocating anything."""

from __future__ import annotations

import struct
from pathlib import Path

import gguf
import numpy as np
import pytest

from edge.formats.gguf_reader import open_reader


def assert_same(path: Path) -> None:
    fast, stock = open_reader(path), gguf.GGUFReader(str(path))
    assert type(fast) is not gguf.GGUFReader and isinstance(fast, gguf.GGUFReader)
    assert list(fast.fields) == list(stock.fields)
    for name, a in fast.fields.items():
        b = stock.fields[name]
        assert (a.offset, a.data, a.types) == (b.offset, b.data, b.types), name
        assert len(a.parts) == len(b.parts), name
        for x, y in zip(a.parts, b.parts):
            assert (x.dtype, x.shape, x.tobytes()) == (y.dtype, y.shape, y.tobytes()), name
        assert repr(a.contents()) == repr(b.contents()), name
    assert fast.data_offset == stock.data_offset and fast.alignment == stock.alignment
    assert [t.name for t in fast.tensors] == [t.name for t in stock.tensors]
    for x, y in zip(fast.tensors, stock.tensors):
        assert (x.tensor_type, x.data_offset, x.n_bytes) == (
            y.tensor_type,
            y.data_offset,
            y.n_bytes,
        )
        assert np.array_equal(x.data, y.data)


@pytest.mark.parametrize("name", ["llama-spm", "bert-bge"])  # small: the stock reader is slow
def test_same_fields_as_the_stock_reader_on_llamacpp_vocab_files(
    llamacpp_vocab_dir: Path, name: str
) -> None:
    assert_same(llamacpp_vocab_dir / f"ggml-vocab-{name}.gguf")


def _every_type(path: Path) -> Path:
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_uint8("t.u8", 7)
    w.add_int8("t.i8", -7)
    w.add_uint16("t.u16", 700)
    w.add_int16("t.i16", -700)
    w.add_uint32("t.u32", 70000)
    w.add_int32("t.i32", -70000)
    w.add_float32("t.f32", 0.25)
    w.add_uint64("t.u64", 1 << 40)
    w.add_int64("t.i64", -(1 << 40))
    w.add_float64("t.f64", 1e-300)
    w.add_bool("t.bool", True)
    w.add_string("t.str", "héllo")
    w.add_string("t.empty", "")
    w.add_array("t.strs", ["a", "", "ßü", "x" * 300])
    w.add_array("t.ints", [1, -2, 3])
    w.add_array("t.floats", [0.5, -1.5])
    w.add_array("t.bools", [True, False, True])
    w.add_array("t.none", [])
    w.add_array("t.nested", [[1, 2], [3]])
    return _with_a_tensor(w, path)


def _with_a_tensor(w: gguf.GGUFWriter, path: Path) -> Path:
    """Add one small tensor after the fields and write the file."""
    w.add_tensor("w", np.arange(12, dtype=np.float32).reshape(3, 4))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_same_fields_as_the_stock_reader_for_every_value_type(tmp_path: Path) -> None:
    assert_same(_every_type(tmp_path / "all.gguf"))


def _tokenizer_file(path: Path) -> Path:
    """Arrays under ``tokenizer.`` of every kind beside scalars there and an array elsewhere."""
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_array("t.strs", ["kept", "too"])
    w.add_array("tokenizer.ggml.tokens", ["a", "", "ßü", "x" * 300])
    w.add_array("tokenizer.ggml.scores", [0.5, -1.5, 0.0, 2.0])
    w.add_array("tokenizer.ggml.token_type", [1, 1, 3, 1])
    w.add_array("tokenizer.ggml.merges", ["a b", "ß ü"])
    w.add_array("tokenizer.nested", [[1, 2], [3]])
    w.add_uint32("tokenizer.ggml.bos_token_id", 1)
    w.add_string("tokenizer.chat_template", "{{ messages }}")
    w.add_uint32("t.after", 9)
    return _with_a_tensor(w, path)


def test_without_the_tokenizer_the_same_fields_less_its_arrays(tmp_path: Path) -> None:
    path = _tokenizer_file(tmp_path / "tok.gguf")
    full, lean = open_reader(path), open_reader(path, tokenizer=False)
    arrays = {"tokens", "scores", "token_type", "merges"}
    dropped = {f"tokenizer.ggml.{n}" for n in arrays} | {"tokenizer.nested"}
    assert dropped <= set(full.fields)
    assert list(lean.fields) == [n for n in full.fields if n not in dropped]
    for name, a in lean.fields.items():  # the scalars under tokenizer. stay
        b = full.fields[name]
        assert (a.offset, a.data, a.types) == (b.offset, b.data, b.types), name
        assert [x.tobytes() for x in a.parts] == [y.tobytes() for y in b.parts], name
    assert lean.fields["tokenizer.chat_template"].contents() == "{{ messages }}"
    assert lean.data_offset == full.data_offset
    assert [(t.name, t.data_offset) for t in lean.tensors] == [
        (t.name, t.data_offset) for t in full.tensors
    ]
    assert np.array_equal(lean.tensors[0].data, full.tensors[0].data)


def _kv_file(path: Path, items: int, payload: bytes, key: bytes = b"t.strs") -> Path:
    """A header with one key whose string array claims ``items`` items over ``payload``."""
    head = struct.pack("<IIQQ", gguf.GGUF_MAGIC, 3, 0, 1)
    kv = struct.pack("<Q", len(key)) + key + struct.pack("<IIQ", 9, 8, items)  # ARRAY of STRING
    path.write_bytes(head + kv + payload)
    return path


@pytest.mark.parametrize("tokenizer", [True, False])
def test_a_string_array_past_the_end_is_refused(tmp_path: Path, tokenizer: bool) -> None:
    # tokenizer=False: an array under tokenizer. is stepped over, and bounded as it goes
    key = b"t.strs" if tokenizer else b"tokenizer.ggml.tokens"
    with pytest.raises(ValueError, match="past"):  # 2^60 items: refused before any allocation
        open_reader(_kv_file(tmp_path / "huge.gguf", 1 << 60, b"", key), tokenizer=tokenizer)
    one = struct.pack("<Q", 1 << 40) + b"abc"  # one string claiming a terabyte
    with pytest.raises(ValueError, match="past"):
        open_reader(_kv_file(tmp_path / "long.gguf", 1, one, key), tokenizer=tokenizer)
    cut = struct.pack("<Q", 1) + b"a" + b"\0\0"  # the second item's length is cut off
    with pytest.raises(ValueError, match="past"):
        open_reader(_kv_file(tmp_path / "cut.gguf", 2, cut, key), tokenizer=tokenizer)
