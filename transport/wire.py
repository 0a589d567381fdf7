"""lowband wire format: a fixed little-endian header, msgpack metadata, raw tensor frames.

Every message is one ZeroMQ multipart message::

    frame 0   header (24 bytes, see ``HEADER``) followed by ``meta_len`` bytes of msgpack
    frame 1…  raw payload buffers (tensor bytes, sent zero-copy), ``n_frames`` of them

Header fields, in order (``<4sHBBIIQ``)::

    magic        4s  b"LBND"
    version      u16 PROTOCOL_VERSION; a peer speaking another version is refused
    type         u8  MsgType
    flags        u8  reserved, must be 0
    meta_len     u32 bytes of msgpack that follow the header in frame 0
    n_frames     u32 number of payload frames after frame 0
    payload_len  u64 sum of the payload frames' lengths

The header makes a message checkable before any metadata is parsed: truncated frames, wrong
magic or version, inconsistent lengths and oversize payloads are rejected with a
:class:`~lowband.errors.ProtocolError` that says which field is wrong. Metadata is decoded with
msgpack only (never pickle) under size limits and must be a map; ``field`` helpers below check
each key's type so a message of the wrong shape is an error, not a crash deeper down.

Tensors travel as their raw bytes (native little-endian layout of a contiguous tensor) with a
``{"d": dtype name, "s": shape}`` descriptor in the metadata.
"""

from __future__ import annotations

import enum
import struct
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Sequence

import msgpack
import torch
import zmq

from lowband.errors import ProtocolError, VersionMismatch

MAGIC = b"LBND"
PROTOCOL_VERSION = 1
HEADER = struct.Struct("<4sHBBIIQ")
HEADER_SIZE = HEADER.size  # 24

DEFAULT_MAX_META_BYTES = 4 * 1024 * 1024
MAX_PAYLOAD_FRAMES = 4096
"""Payload frames in one message. Senders split a message's tensors into parts that stay within
it (:mod:`transport.messages`); receivers refuse a longer message part by part
(:func:`recv_bounded`), before holding its frames."""
"""Metadata larger than this is refused (a named state dict of thousands of tensors fits)."""


class MsgType(enum.IntEnum):
    """Message types. Control (peer <-> coordinator) below 16, data plane (peer <-> peer) above."""

    REGISTER = 1
    REGISTERED = 2
    REFUSED = 3
    HEARTBEAT = 4
    HEARTBEAT_ACK = 5
    QUORUM = 6
    QUORUM_CANCEL = 7
    MEMBERSHIP = 8
    PEER_LOST = 9
    LEAVE = 10
    SUSPECT = 11
    RELAY = 12  # envelope of a data message carried by the coordinator's relay (transport.relay)
    CHUNK = 16  # one chunk of a reduction (all_reduce)
    MSG = 17  # a logical message: descriptor, plus its bytes when it fits one frame set
    MSG_PART = 18  # a later chunk of a logical message, placed by (message id, tensor, offset)
    ABORT = 19  # the sender found the operation cannot succeed (ranks disagree): fail it
    BYE = 20  # last message on one connection of a peer that is leaving gracefully


_TYPES = frozenset(int(t) for t in MsgType)

# ---- dtypes -------------------------------------------------------------------------------------
_DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, name)
    for name in (
        "float32",
        "float64",
        "float16",
        "bfloat16",
        "int8",
        "uint8",
        "int16",
        "int32",
        "int64",
        "bool",
        "complex64",
        "complex128",
        "uint16",
        "uint32",
        "uint64",
        "float8_e4m3fn",
        "float8_e5m2",
    )
    if hasattr(torch, name)
}
_NAMES: dict[torch.dtype, str] = {v: k for k, v in _DTYPES.items()}


def dtype_name(dtype: torch.dtype) -> str:
    try:
        return _NAMES[dtype]
    except KeyError:
        raise ProtocolError(f"dtype {dtype} cannot be sent; supported: {sorted(_DTYPES)}") from None


def dtype_from_name(name: object) -> torch.dtype:
    if not isinstance(name, str) or name not in _DTYPES:
        raise ProtocolError(f"unknown dtype {name!r} in message; supported: {sorted(_DTYPES)}")
    return _DTYPES[name]


def describe(t: torch.Tensor) -> dict[str, Any]:
    """The descriptor that travels in metadata for a tensor frame."""
    return {"d": dtype_name(t.dtype), "s": list(t.shape)}


def parse_descriptor(desc: object, max_bytes: int) -> tuple[torch.dtype, tuple[int, ...], int]:
    """Validate a ``{"d", "s"}`` descriptor; returns (dtype, shape, nbytes)."""
    if not isinstance(desc, dict):
        raise ProtocolError(f"tensor descriptor must be a map, got {type(desc).__name__}")
    dtype = dtype_from_name(desc.get("d"))
    shape = desc.get("s")
    if (
        not isinstance(shape, list)
        or len(shape) > 32
        or not all(isinstance(s, int) and not isinstance(s, bool) and 0 <= s < 2**48 for s in shape)
    ):
        raise ProtocolError(
            f"tensor shape must be a list of <= 32 non-negative ints, got {shape!r}"
        )
    numel = 1
    for s in shape:
        numel *= s
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    if nbytes > max_bytes:
        raise ProtocolError(f"tensor of {nbytes} bytes exceeds the limit of {max_bytes} bytes")
    return dtype, tuple(shape), nbytes


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """A zero-copy byte view of a contiguous tensor (copies only if ``t`` is not contiguous)."""
    flat = t.detach().contiguous().reshape(-1)
    if flat.numel() == 0:
        return memoryview(b"")
    return memoryview(flat.view(torch.uint8).numpy())  # type: ignore[arg-type]


def tensor_from(buf: memoryview | bytes, dtype: torch.dtype, shape: Sequence[int]) -> torch.Tensor:
    """A tensor viewing ``buf`` (no copy). The caller keeps ``buf`` alive while it is used."""
    if len(buf) == 0:
        return torch.empty(tuple(shape), dtype=dtype)
    data: memoryview | bytes | bytearray = buf
    if memoryview(buf).readonly:  # bytes (tests, control messages): torch wants writable memory
        data = bytearray(buf)
    return torch.frombuffer(data, dtype=torch.uint8).view(dtype).reshape(tuple(shape))


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


# ---- messages -----------------------------------------------------------------------------------
META_EXPANSION = 80
"""At most this many bytes of Python objects per byte of msgpack metadata once decoded (an
empty map, one byte, becomes a 64-byte dict plus the 8-byte reference to it; measured: 73)."""
MESSAGE_OVERHEAD = 1024
"""Bytes counted for every message kept, whatever its size: a flood of empty messages counts."""


@dataclass
class Message:
    type: MsgType
    meta: dict[str, Any]
    payload: list[memoryview]
    frames: list[Any]  # the raw zmq frames; hold them to keep ``payload`` views valid

    @property
    def held_bytes(self) -> int:
        """A bound on the memory this message holds while it is kept: its payload, its
        decoded metadata (``META_EXPANSION`` per metadata byte) and a fixed overhead."""
        meta_len = len(_buffer(self.frames[0])) - HEADER_SIZE if self.frames else 0
        payload = sum(len(p) for p in self.payload)
        return MESSAGE_OVERHEAD + META_EXPANSION * max(0, meta_len) + payload


def pack(mtype: MsgType, meta: Mapping[str, Any], payload: Sequence[Any] = ()) -> list[Any]:
    """Frames for one message. ``payload`` items are buffers and are not copied."""
    body = msgpack.packb(dict(meta), use_bin_type=True)
    sizes = [memoryview(p).nbytes for p in payload]
    head = HEADER.pack(MAGIC, PROTOCOL_VERSION, int(mtype), 0, len(body), len(payload), sum(sizes))
    return [head + body, *payload]


def recv_bounded(sock: zmq.Socket, *, copy: bool, max_frames: int) -> list[Any] | None:
    """One multipart message from ``sock`` (non-blocking; raises ``zmq.Again`` when there is
    none), read frame by frame. A message of more than ``max_frames`` frames is read to its end
    and dropped without keeping its frames (None): ``recv_multipart`` would first hold them all,
    and a peer's million empty frames cost hundreds of MiB and seconds before any check."""
    first = sock.recv(zmq.NOBLOCK, copy=copy)
    frames: list[Any] | None = [first]
    more = sock.getsockopt(zmq.RCVMORE)
    while more:  # ZeroMQ delivers a message's parts together: the rest is already here
        part = sock.recv(zmq.NOBLOCK, copy=copy)
        more = sock.getsockopt(zmq.RCVMORE)
        if frames is not None:
            frames.append(part)
            if len(frames) > max_frames:
                frames = None
    return frames


def _buffer(frame: Any) -> memoryview:
    if isinstance(frame, (bytes, bytearray, memoryview)):
        return memoryview(frame)
    return frame.buffer  # zmq.Frame


def unpack(
    frames: Sequence[Any], *, max_payload_bytes: int, max_meta_bytes: int = DEFAULT_MAX_META_BYTES
) -> Message:
    """Parse and check one received multipart message. Raises ProtocolError (or VersionMismatch)."""
    if not frames:
        raise ProtocolError("empty message")
    first = _buffer(frames[0])
    if len(first) < HEADER_SIZE:
        if bytes(first[:4]) != MAGIC[: min(4, len(first))]:
            raise ProtocolError("not a lowband message (bad magic)")
        raise ProtocolError(f"truncated header: {len(first)} of {HEADER_SIZE} bytes")
    magic, version, mtype, flags, meta_len, n_frames, payload_len = HEADER.unpack_from(first)
    if magic != MAGIC:
        raise ProtocolError(f"not a lowband message (magic {bytes(magic)!r}, expected {MAGIC!r})")
    if version != PROTOCOL_VERSION:
        raise VersionMismatch(
            f"peer speaks lowband wire protocol v{version}, this build speaks v{PROTOCOL_VERSION}: "
            "install the same lowband version on every machine"
        )
    if mtype not in _TYPES:
        raise ProtocolError(f"unknown message type {mtype}")
    if flags != 0:
        raise ProtocolError(f"reserved flags set: {flags:#x}")
    if meta_len > max_meta_bytes:
        raise ProtocolError(f"metadata of {meta_len} bytes exceeds the limit of {max_meta_bytes}")
    if len(first) != HEADER_SIZE + meta_len:
        raise ProtocolError(
            f"header says {meta_len} metadata bytes, frame carries {len(first) - HEADER_SIZE}"
        )
    if n_frames > MAX_PAYLOAD_FRAMES:
        raise ProtocolError(f"{n_frames} payload frames exceed the limit of {MAX_PAYLOAD_FRAMES}")
    if n_frames != len(frames) - 1:
        raise ProtocolError(f"header says {n_frames} payload frames, message has {len(frames) - 1}")
    if payload_len > max_payload_bytes:
        raise ProtocolError(
            f"payload of {payload_len} bytes exceeds the limit of {max_payload_bytes} bytes"
        )
    payload = [_buffer(f) for f in frames[1:]]
    got = sum(len(p) for p in payload)
    if got != payload_len:
        raise ProtocolError(f"header says {payload_len} payload bytes, frames carry {got}")
    try:
        meta = msgpack.unpackb(first[HEADER_SIZE:], raw=False, strict_map_key=True)
    except (
        ValueError,
        TypeError,
        msgpack.ExtraData,
        msgpack.FormatError,
        msgpack.StackError,
    ) as exc:
        raise ProtocolError(f"metadata is not valid msgpack: {exc}") from None
    if not isinstance(meta, dict):
        raise ProtocolError(f"metadata must be a map, got {type(meta).__name__}")
    return Message(MsgType(mtype), meta, payload, list(frames))


# ---- typed access to metadata fields ----------------------------------------------------------
def field(meta: Mapping[str, Any], key: str, kind: type | tuple[type, ...]) -> Any:
    """``meta[key]`` checked against ``kind``; a missing or mistyped field is a ProtocolError."""
    if key not in meta:
        raise ProtocolError(f"message is missing field {key!r}")
    value = meta[key]
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if isinstance(value, bool) and bool not in kinds:
        raise ProtocolError(f"field {key!r} must be {_names(kinds)}, got bool")
    if not isinstance(value, kinds):
        raise ProtocolError(f"field {key!r} must be {_names(kinds)}, got {type(value).__name__}")
    return value


def int_field(meta: Mapping[str, Any], key: str, lo: int = 0, hi: int = 2**62) -> int:
    value = field(meta, key, int)
    if not lo <= value <= hi:
        raise ProtocolError(f"field {key!r}={value} is outside [{lo}, {hi}]")
    return value


def str_list(meta: Mapping[str, Any], key: str) -> list[str]:
    value = field(meta, key, list)
    if not all(isinstance(v, str) for v in value):
        raise ProtocolError(f"field {key!r} must be a list of strings")
    return value


def _names(kinds: Iterable[type]) -> str:
    return " or ".join(k.__name__ for k in kinds)
