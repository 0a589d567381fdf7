"""Opening GGUF files fast: :func:`open_reader` gives a ``gguf.GGUFReader`` that parses the
metadata in a fraction of the stock reader's time.

The stock reader slices its ``numpy.memmap`` for every value it parses, and each slice of a
memmap pays the subclass's bookkeeping (``__array_finalize__``): a Llama-3 vocabulary (128k
tokens, 280k merges) took 16 s to open on this project's 2-core VM, every time a model was
served, split or tokenized. This subclass parses from a plain ``ndarray`` view of the same
mapping and reads arrays of strings in one loop, building the same fields (the same parts,
indices and types; tests compare the two readers field by field). Tensor data still comes
from the memmap, as before.

Only a file in the host's byte order takes the fast path for string arrays; anything else goes
through the stock code. A string that runs past the end of the file is a ``ValueError`` (the
stock reader truncated it silently); :func:`edge.formats.bounds.open_gguf` turns that into a
``ConfigError``.

``open_reader(path, tokenizer=False)`` steps over the ``tokenizer.*`` arrays (tokens, merges,
scores, token types; still bounded by the file) instead of parsing them: they are missing from
its ``fields``. Loading weights (:func:`edge.formats.gguf.load_gguf`) never reads them, and
parsed they are Python objects, arrays per string: a Llama-3 vocabulary is ~160 MB of RSS
while the reader lives, and as the weights are built around it, ~100 MB of a loaded stage's
RSS after (measured on the Llama-3.2-1B-shaped file). The tokenizer reads its own reader.
"""

from __future__ import annotations

import struct
import sys
from pathlib import Path
from typing import Any, cast

_READER_CLASS: Any = None


def _reader_class() -> Any:
    global _READER_CLASS
    if _READER_CLASS is not None:
        return _READER_CLASS
    import gguf
    import numpy as np

    string, array = gguf.GGUFValueType.STRING, gguf.GGUFValueType.ARRAY
    u64 = struct.Struct("<Q")
    little = sys.byteorder == "little"

    class FastGGUFReader(gguf.GGUFReader):
        def __init__(self, path: str, *, skip: bytes | None = None) -> None:
            self._skip = skip  # arrays of fields whose name starts with it are stepped over
            super().__init__(path)

        def _build_fields(self, offs: int, count: int) -> int:
            if self._skip is None or not little or self.byte_order != "I":
                return super()._build_fields(offs, count)
            for _ in range(count):  # a field at a time: the stock code, or stepped over
                klen, key = self._get_str(offs)
                at = offs + int(klen.nbytes + key.nbytes)
                if int(self._get(at, np.uint32)[0]) == array and bytes(key).startswith(self._skip):
                    offs = at + 4 + self._array_size(at + 4)
                else:
                    offs = super()._build_fields(offs, 1)
            return offs

        def _array_size(self, orig_offs: int) -> int:
            """Bytes of the array at ``orig_offs`` (its item type onwards), nothing built."""
            itype = int(self._get(orig_offs, np.uint32)[0])
            n = int(self._get(orig_offs + 4, np.uint64)[0])
            scalar = cast(dict[int, Any], self.gguf_scalar_to_np).get(itype)
            size = self._flat().shape[0]
            offs = orig_offs + 12
            if scalar is not None:
                if n > (size - offs) // np.dtype(scalar).itemsize:
                    raise ValueError(f"array of {n} items at {orig_offs} runs past the file")
                return 12 + n * np.dtype(scalar).itemsize
            if itype != string:  # arrays of arrays: parsed, then dropped
                return cast(int, self._get_field_parts(orig_offs, array)[0])
            buf = memoryview(self._flat())
            unpack = u64.unpack_from
            for _ in range(n):
                if offs + 8 > size:
                    raise ValueError(f"string at {offs} runs past the end of the file")
                offs += 8 + unpack(buf, offs)[0]
            if offs > size:
                raise ValueError(f"string array at {orig_offs} runs past the file")
            return offs - orig_offs

        def _flat(self) -> Any:
            flat = self.__dict__.get("_plain")
            if flat is None or flat.base is not self.data:
                flat = self._plain = self.data.view(np.ndarray)
            return flat

        def _get(self, offset: int, dtype: Any, count: int = 1, override_order: Any = None) -> Any:
            count = int(count)
            dt = np.dtype(dtype)
            arr = self._flat()[offset : offset + dt.itemsize * count].view(dt)[:count]
            order = self.byte_order if override_order is None else override_order
            return arr.view(arr.dtype.newbyteorder(order))

        def _get_field_parts(self, orig_offs: int, raw_type: int) -> Any:
            if raw_type != array or not little or self.byte_order != "I":
                return super()._get_field_parts(orig_offs, raw_type)
            raw_itype = self._get(orig_offs, np.uint32)
            itype = int(raw_itype[0])
            scalar = cast(dict[int, Any], self.gguf_scalar_to_np).get(itype)  # IntEnum keys
            if itype != string and scalar is None:  # arrays of arrays: the stock code
                return super()._get_field_parts(orig_offs, raw_type)
            alen = self._get(orig_offs + 4, np.uint64)
            flat = self._flat()
            size = flat.shape[0]
            n = int(alen[0])
            offs = orig_offs + 12
            if scalar is not None:  # one view of the items, split into the stock reader's parts
                dt = np.dtype(scalar)
                if n > (size - offs) // dt.itemsize:
                    raise ValueError(f"array of {n} items at {orig_offs} runs past the file")
                items = flat[offs : offs + n * dt.itemsize].view(dt).reshape(n, 1)
                types = [gguf.GGUFValueType(raw_type)] + ([gguf.GGUFValueType(itype)] if n else [])
                return 12 + n * dt.itemsize, [raw_itype, alen, *items], list(range(2, n + 2)), types
            if n > (size - offs) // 8:  # every item has at least its 8-byte length
                raise ValueError(f"string array of {n} items at {orig_offs} runs past the file")
            parts: list[Any] = [raw_itype, alen]
            idxs: list[int] = []
            buf = memoryview(flat)
            unpack = u64.unpack_from
            q = np.dtype(np.uint64)
            for _ in range(n):
                if offs + 8 > size:
                    raise ValueError(f"string at {offs} runs past the end of the file")
                (slen,) = unpack(buf, offs)
                end = offs + 8 + slen
                if end > size:
                    raise ValueError(f"string of {slen} bytes at {offs} runs past the file")
                parts.append(flat[offs : offs + 8].view(q))
                parts.append(flat[offs + 8 : end])  # flat is uint8 (the memmap's dtype)
                idxs.append(len(parts) - 1)
                offs = end
            types = [gguf.GGUFValueType(raw_type)] + ([gguf.GGUFValueType(string)] if n else [])
            return offs - orig_offs, parts, idxs, types

    _READER_CLASS = FastGGUFReader
    return FastGGUFReader


def open_reader(path: str | Path, *, tokenizer: bool = True) -> Any:
    """A ``gguf.GGUFReader`` of ``path`` (the fast subclass); needs the ``gguf`` package.
    ``tokenizer=False``: without the ``tokenizer.*`` arrays (see the module docstring)."""
    return _reader_class()(str(path), skip=None if tokenizer else b"tokenizer.")
