"""Codec glue: lowband tensors and codec output as Flower records, and back. No pickle.

Two encodings of a tensor as a Flower :class:`~flwr.app.Array`:

* full-precision parameters use Flower's own ``numpy.ndarray`` form (``np.save`` without
  pickle), so ``ArrayRecord.to_torch_state_dict()`` works on anything the strategy returns;
* codec frames (int8 codes, packed 4-bit nibbles, float32 scales, bf16 …) use ``lowband.raw``:
  the tensor's little-endian bytes as they are, its torch dtype name and shape. No header, so
  the bytes counted are the bytes a codec produced, and bfloat16 (which numpy lacks) travels too.

A codec's small metadata (shape, block size, code book) goes into a ConfigRecord as msgpack.
Decoding validates sizes and dtypes and raises :class:`ProtocolError` on anything malformed, so
a bad reply is counted as a failed client, never turned into a wrong average.
"""

from __future__ import annotations

import math
from typing import Iterable, Mapping

import msgpack
import numpy as np
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, MetricRecord

from lowband.comm import Encoded
from lowband.errors import ProtocolError

RAW_STYPE = "lowband.raw"

# ---- record names and keys: the one spelling of every name both sides use ----------------------
# Records of a message's RecordDict
GLOBAL = "global"  # server -> client: θ_g of the fragments sent (ArrayRecord)
CONFIG = "config"  # server -> client: the round's instruction (ConfigRecord)
DELTA = "delta"  # client -> server: the encoded Δ (ArrayRecord, codec frames)
REPLY = "lowband"  # client -> server: status, versions, codec (ConfigRecord)
METRICS = "metrics"  # client -> server: counts, losses, bytes (MetricRecord)

# CONFIG keys
SERVER_ROUND = "server-round"
FRAGMENT = "fragment"  # also a REPLY key: the fragment p the Δ belongs to
VERSIONS = "versions"  # also a REPLY key: the versions the client holds
SENT_FRAGMENTS = "sent-fragments"
SENT_VERSIONS = "sent-versions"

# REPLY keys
STATUS = "status"  # STATUS_OK or STATUS_STALE
STATUS_OK, STATUS_STALE = "ok", "stale"
BASE_VERSION = "base-version"
CODEC = "codec"
CODEC_META = "codec-meta"
VALID = "valid"

# METRICS keys (also the strategy's per-round record, ``DiLoCoStrategy.history``)
NUM_EXAMPLES = "num-examples"
TRAIN_LOSS = "train-loss"
EVAL_LOSS = "eval-loss"
LOCAL_EVAL_LOSS = "local-eval-loss"
BYTES_UP = "bytes-up"
BYTES_UP_FP32 = "bytes-up-fp32"
BYTES_DOWN = "bytes-down"


def summary_key(key: str) -> str:
    """A record key as the run's log and summary spell it (Python names: ``bytes_up``)."""
    return key.replace("-", "_")


# Wire dtypes a codec may emit (lowband.codecs): name -> torch dtype.
_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "int16": torch.int16,
    "int32": torch.int32,
    "int64": torch.int64,
}


def raw_array(t: torch.Tensor) -> Array:
    """A tensor's raw bytes as an Array (``lowband.raw``)."""
    name = str(t.dtype).removeprefix("torch.")
    if name not in _DTYPES:
        raise ProtocolError(f"dtype {t.dtype} cannot go on the wire (one of {sorted(_DTYPES)})")
    flat = t.detach().contiguous().reshape(-1)
    data = flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""
    return Array(dtype=name, shape=tuple(int(s) for s in t.shape), stype=RAW_STYPE, data=data)


def raw_tensor(a: Array) -> torch.Tensor:
    """Inverse of :func:`raw_array`; checks stype, dtype and size."""
    if a.stype != RAW_STYPE:
        raise ProtocolError(f"expected a {RAW_STYPE} array, got stype {a.stype!r}")
    dtype = _DTYPES.get(a.dtype)
    if dtype is None:
        raise ProtocolError(f"unsupported wire dtype {a.dtype!r}")
    shape = tuple(int(s) for s in a.shape)
    if any(s < 0 for s in shape):
        raise ProtocolError(f"negative dimension in shape {shape}")
    itemsize = torch.empty(0, dtype=dtype).element_size()
    if len(a.data) != math.prod(shape) * itemsize:
        raise ProtocolError(
            f"array of shape {shape} and dtype {a.dtype} needs "
            f"{math.prod(shape) * itemsize} bytes, got {len(a.data)}"
        )
    if not a.data:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(bytearray(a.data), dtype=torch.uint8).view(dtype).reshape(shape)


def encoded_to_records(enc: Encoded) -> tuple[ArrayRecord, bytes]:
    """Codec output -> (frames as an ArrayRecord keyed "0", "1", …, msgpack metadata)."""
    arrays = ArrayRecord({str(i): raw_array(f) for i, f in enumerate(enc.frames)})
    return arrays, msgpack.packb(dict(enc.meta), use_bin_type=True)


def records_to_encoded(arrays: ArrayRecord, meta: bytes) -> Encoded:
    """Inverse of :func:`encoded_to_records`."""
    try:
        frames = tuple(raw_tensor(arrays[str(i)]) for i in range(len(arrays)))
    except KeyError as exc:
        raise ProtocolError(
            f"codec frames must be keyed 0..{len(arrays) - 1}: missing {exc}"
        ) from None
    for i, f in enumerate(frames):
        # A float frame (values, scales, a code book) holding inf/NaN would decode into a
        # non-finite Δ, or a finite one by luck (0·inf is caught, 1/inf is not): refuse it here.
        if f.is_floating_point() and not bool(torch.isfinite(f).all()):
            raise ProtocolError(f"codec frame {i} holds non-finite values")
    try:
        decoded_meta = msgpack.unpackb(meta, raw=False)
    except (ValueError, msgpack.ExtraData) as exc:
        raise ProtocolError(f"codec metadata is not valid msgpack: {exc}") from None
    if not isinstance(decoded_meta, dict):
        raise ProtocolError("codec metadata must be a map")
    return Encoded(frames=frames, meta=decoded_meta)


def params_to_record(named: Iterable[tuple[str, torch.Tensor]]) -> ArrayRecord:
    """Full-precision named tensors as Flower numpy Arrays (interoperable with Flower tools)."""
    return ArrayRecord({n: Array(t.detach().cpu().contiguous().numpy()) for n, t in named})


def record_to_params(
    record: ArrayRecord, expected: Mapping[str, torch.Size] | None = None
) -> dict[str, torch.Tensor]:
    """Flower numpy Arrays -> float32 tensors; with ``expected``, names and shapes must match."""
    out: dict[str, torch.Tensor] = {}
    for name, a in record.items():
        if a.stype != "numpy.ndarray":
            raise ProtocolError(f"parameter {name!r}: expected a numpy array, got {a.stype!r}")
        if expected is not None:
            if name not in expected:
                raise ProtocolError(f"unexpected parameter {name!r}")
            if tuple(a.shape) != tuple(expected[name]):
                raise ProtocolError(
                    f"parameter {name!r} has shape {tuple(a.shape)}, "
                    f"expected {tuple(expected[name])}"
                )
        out[name] = torch.from_numpy(np.array(a.numpy(), dtype=np.float32, copy=True))
    return out


def payload_bytes(record: ArrayRecord) -> int:
    """Bytes of array data in a record (what Flower chunks and ships, minus framing)."""
    return sum(len(a.data) for a in record.values())


def config_ints(config: ConfigRecord, key: str) -> list[int]:
    """A list-of-int field of a ConfigRecord (an empty list may come back as any list type)."""
    value = config.get(key)
    if isinstance(value, list):
        ints = [v for v in value if isinstance(v, int) and not isinstance(v, bool)]
        if len(ints) == len(value):
            return ints
    raise ProtocolError(f"config field {key!r} must be a list of integers, got {value!r}")


def metric_float(record: MetricRecord, key: str) -> float:
    """A number field of a MetricRecord as a float: KeyError if absent, TypeError if a list
    (what ``float(record[key])`` raises)."""
    value = record[key]
    if isinstance(value, list):
        raise TypeError(f"metric {key!r} must be a number, got a list")
    return float(value)
