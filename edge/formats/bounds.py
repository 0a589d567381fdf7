"""A GGUF file's header checked against the file itself before anything is built (issue 25).

A GGUF header is a list of claims: ``{arch}.block_count`` layers of ``embedding_length``
values, tensors at offsets of so many bytes. Built on trust, a 2 MB file claiming 2^20 layers
of 2^20 values keeps the loader busy for good (a million meta-device layers, names for each),
and a file missing ``token_embd`` failed with a ``StopIteration``. Here every claim is bounded
by something the file holds: each tensor's data lies inside the file; the layer count is at
most the tensor count and every layer's tensors are there; the widths equal the shapes of the
tensors that carry them. A violation is a :class:`ConfigError` naming the field or tensor.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from edge.formats.gguf_reader import open_reader
from lowband.errors import ConfigError

MAX_CONTEXT = 1 << 24  # context_length: positions a KV cache or rope table may be sized for

# Per-layer matrices and vectors every supported architecture has, with their GGUF shape
# (innermost first: (K, N) for an N x K matrix) in terms of the header's widths.
_LAYER_SHAPES = {
    "attn_norm.weight": ("hidden",),
    "ffn_norm.weight": ("hidden",),
    "attn_q.weight": ("hidden", "q"),
    "attn_k.weight": ("hidden", "kv"),
    "attn_v.weight": ("hidden", "kv"),
    "attn_output.weight": ("q", "hidden"),
    "ffn_gate.weight": ("hidden", "ff"),
    "ffn_up.weight": ("hidden", "ff"),
    "ffn_down.weight": ("ff", "hidden"),
}
# Phi-3: q/k/v may come fused (rows q | k | v), gate/up always do (rows gate | up).
_FUSED_QKV = {"attn_qkv.weight": ("hidden", "qkv")}
_PHI3_FFN = {"ffn_up.weight": ("hidden", "ff2"), "ffn_down.weight": ("ff", "hidden")}
# Qwen3-MoE: a router and each projection's experts stacked in one 3-D tensor.
_MOE_FFN = {
    "ffn_gate_inp.weight": ("hidden", "experts"),
    "ffn_gate_exps.weight": ("hidden", "ffe", "experts"),
    "ffn_up_exps.weight": ("hidden", "ffe", "experts"),
    "ffn_down_exps.weight": ("ffe", "hidden", "experts"),
}


def _layer_shapes(arch: str, shapes: dict[str, tuple[int, ...]]) -> dict[str, tuple[str, ...]]:
    """The per-layer tensors architecture ``arch`` must have, with their shapes' widths."""
    out = dict(_LAYER_SHAPES)
    if arch == "phi3":
        for g in ("ffn_gate.weight", "ffn_up.weight", "ffn_down.weight"):
            del out[g]
        out.update(_PHI3_FFN)
        if "blk.0.attn_qkv.weight" in shapes:
            for g in ("attn_q.weight", "attn_k.weight", "attn_v.weight"):
                del out[g]
            out.update(_FUSED_QKV)
    elif arch == "qwen3moe":
        for g in ("ffn_gate.weight", "ffn_up.weight", "ffn_down.weight"):
            del out[g]
        out.update(_MOE_FFN)
    return out


def open_gguf(path: str | Path, *, tokenizer: bool = True) -> Any:
    """``open_reader(path)`` with its header checked (:func:`check_gguf`); a file the
    reader cannot parse is a ConfigError too, not whatever the parser tripped on.
    ``tokenizer=False``: the reader steps over the ``tokenizer.*`` arrays (loading weights)."""
    try:
        reader = open_reader(str(path), tokenizer=tokenizer)
        # The reader decodes strings lazily: a metadata string that is not UTF-8 fails inside
        # the check (UnicodeDecodeError, a ValueError), so the check is inside the try too.
        check_gguf(reader, os.path.getsize(path))
    except ConfigError:
        raise
    except (ValueError, KeyError, IndexError, TypeError, ArithmeticError) as exc:
        raise ConfigError("model", f"{path} is not a readable GGUF file: {exc}") from None
    return reader


def _int(reader: Any, key: str, default: int | None = None, hi: int | None = None) -> int:
    f = reader.fields.get(key)
    if f is None:
        if default is None:
            raise ConfigError(key, "the GGUF file lacks this field")
        return default
    v = f.contents()
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ConfigError(key, f"must be a positive integer, got {v!r}")
    if hi is not None and v > hi:
        raise ConfigError(key, f"{v} is more than {hi}")
    return v


def _extents(reader: Any, size: int) -> dict[str, tuple[int, ...]]:
    """Every tensor's GGUF shape, once its data is known to lie inside the file."""
    shapes: dict[str, tuple[int, ...]] = {}
    for t in reader.tensors:
        start, n = int(t.data_offset), int(t.n_bytes)
        if start < 0 or n < 0 or start + n > size:
            raise ConfigError(
                t.name, f"its data [{start}, {start + n}) lies outside the file ({size} bytes)"
            )
        shapes[t.name] = tuple(int(d) for d in t.shape)
    return shapes


def check_gguf(reader: Any, size: int) -> None:
    """Bound ``reader``'s header by the file of ``size`` bytes (see the module docstring)."""
    shapes = _extents(reader, size)
    arch_f = reader.fields.get("general.architecture")
    arch = None if arch_f is None else arch_f.contents()
    if not isinstance(arch, str):
        raise ConfigError("general.architecture", f"must be a string, got {arch!r}")
    pre = arch + "."
    embd = shapes.get("token_embd.weight")
    if embd is None or len(embd) != 2:
        raise ConfigError("token_embd.weight", "the GGUF file has no 2-D token embedding")
    hidden = _int(reader, pre + "embedding_length")
    if embd[0] != hidden:
        raise ConfigError(
            pre + "embedding_length", f"{hidden}, but token_embd.weight is {embd} (K, N)"
        )
    layers = _int(reader, pre + "block_count")
    if layers > len(shapes):
        raise ConfigError(
            pre + "block_count", f"{layers} layers, but the file holds {len(shapes)} tensors"
        )
    heads = _int(reader, pre + "attention.head_count", hi=hidden)
    kv = _int(reader, pre + "attention.head_count_kv", heads, hi=heads)
    head_dim = _int(reader, pre + "attention.key_length", max(1, hidden // heads))
    _int(reader, pre + "context_length", 2048, hi=MAX_CONTEXT)
    ff = _int(reader, pre + "feed_forward_length")
    widths = {
        "hidden": hidden,
        "q": heads * head_dim,
        "kv": kv * head_dim,
        "qkv": (heads + 2 * kv) * head_dim,
        "ff": ff,
        "ff2": 2 * ff,
    }
    per_layer = _layer_shapes(arch, shapes)
    if "experts" in {d for dims in per_layer.values() for d in dims}:
        # bounded by the stacked tensors' shapes below, which lie inside the file
        widths["experts"] = _int(reader, pre + "expert_count")
        widths["ffe"] = _int(reader, pre + "expert_feed_forward_length", ff)
    for i in range(layers):
        for g, dims in per_layer.items():
            name, want = f"blk.{i}.{g}", tuple(widths[d] for d in dims)
            got = shapes.get(name)
            if got is None:
                raise ConfigError(name, f"missing ({pre}block_count says {layers} layers)")
            if got != want:
                raise ConfigError(name, f"shape {got} (K, N), the header implies {want}")
    for name in ("output_norm.weight", "output.weight"):
        want = (hidden,) if name == "output_norm.weight" else embd
        if name in shapes and shapes[name] != want:
            raise ConfigError(name, f"shape {shapes[name]} (K, N), expected {want}")


__all__ = ["MAX_CONTEXT", "check_gguf", "open_gguf"]
