"""What lowband's algorithms need from a network, written down as Protocols.

``diloco`` and ``edge`` program against :class:`Communicator`; ``transport`` provides two
implementations (ZeroMQ over TCP, and an in-process loopback for tests and docs). Only
composition roots (the CLI, launchers, examples, tests) import both sides.

Contract shared by every implementation
---------------------------------------
* Collectives are matched across ranks by ``(epoch, tag)``. With ``tag=None`` the communicator
  numbers calls itself, so every rank must then issue its untagged collectives in the same order
  (as with NCCL/Gloo). Explicit tags let several collectives be in flight at once in any order.
* All ranks receive **bit-identical** results from ``all_reduce``: one owner computes each
  element's final value (and, with a codec, decodes its own encoding of it) and everyone else
  receives exactly that value. Algorithms rely on this for replica consistency.
* ``all_reduce`` never modifies its input; it returns a new tensor with the input's shape and
  dtype, unless the caller passes ``out=``: then the result is written into ``out`` (the input's
  shape and dtype, contiguous; it may be the input itself) and ``out`` is returned. ``out`` is
  written only once the operation succeeded: after a failure it still holds what it held, so a
  caller that passed its input can retry from it. Floating reductions accumulate in float32
  (float64 for float64 inputs).
* With a ``codec`` the wire carries ``codec.encode(x)``; the receiver decodes to float32,
  accumulates in float32 and re-encodes partial results where the algorithm forwards them.
  The transport never chooses to quantize by itself.
* Failures raise, never hang: a dead or departed participant raises :class:`PeerLost` in every
  survivor's pending and future calls of that epoch; a missed deadline raises
  :class:`TransportTimeout`. After ``PeerLost`` call :meth:`Communicator.quorum` to move to the
  next epoch and retry.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import (
    Any,
    Literal,
    Mapping,
    Protocol,
    Sequence,
    TypeVar,
    get_args,
    runtime_checkable,
)

import torch

ReduceOp = Literal["sum", "avg"]
"""Reduction applied element-wise. ``avg`` divides the float32 sum by the world size."""

Algorithm = Literal["auto", "ring", "scatter", "star"]
"""All-reduce schedule: ``ring`` (2(n-1) hops), ``scatter`` (direct reduce-scatter to segment
owners and all-gather from them: the ring's bytes in 2 hops, over n-1 peers at once), ``star``
(through rank 0, for small payloads); ``auto`` lets the communicator pick by size and world."""

ALGORITHMS: tuple[str, ...] = get_args(Algorithm)

T_co = TypeVar("T_co", covariant=True)


@dataclass(frozen=True)
class Encoded:
    """A codec's output: raw tensor frames (sent zero-copy) plus small msgpack-able metadata."""

    frames: tuple[torch.Tensor, ...]
    meta: Mapping[str, Any]

    @property
    def nbytes(self) -> int:
        return sum(f.numel() * f.element_size() for f in self.frames)


@runtime_checkable
class Codec(Protocol):
    """Encodes float tensors for the wire. Owned and chosen by the caller, never by the transport.

    ``decode(encode(x))`` returns a float32 tensor of ``x``'s shape. Codecs must be pure and
    deterministic: the same input gives the same bytes on every machine.
    """

    @property
    def name(self) -> str: ...

    def encode(self, tensor: torch.Tensor) -> Encoded: ...

    def decode(self, encoded: Encoded) -> torch.Tensor: ...


@dataclass(frozen=True)
class Membership:
    """One membership epoch as seen by one peer.

    ``peers[r]`` is the stable id of the peer holding rank ``r``. ``joined``/``left`` are relative
    to the previous epoch this peer took part in (both empty for the first epoch it sees).
    """

    epoch: int
    rank: int
    world_size: int
    peers: tuple[str, ...]
    joined: tuple[str, ...] = ()
    left: tuple[str, ...] = ()

    @property
    def peer_id(self) -> str:
        return self.peers[self.rank]


@dataclass(frozen=True)
class OpStats:
    """Bytes one rank put on / took off the wire for one operation (payload, excluding headers)."""

    bytes_sent: int = 0
    bytes_received: int = 0


@runtime_checkable
class Work(Protocol[T_co]):
    """Handle of an asynchronous operation."""

    def wait(self, timeout: float | None = None) -> T_co:
        """Block until done and return the result; re-raise the operation's error.

        ``timeout`` (seconds) bounds this wait only; ``None`` uses the communicator's default.
        """
        ...

    def done(self) -> bool:
        """True once the operation finished (successfully or not); never blocks."""
        ...

    @property
    def stats(self) -> OpStats:
        """Bytes moved by this rank for this operation; complete once ``done()``."""
        ...


@runtime_checkable
class Communicator(Protocol):
    """A group of ranks that can run collectives. See the module docstring for the contract."""

    @property
    def rank(self) -> int: ...

    @property
    def world_size(self) -> int: ...

    @property
    def membership(self) -> Membership: ...

    def quorum(self, *, min_world: int = 1, timeout: float | None = None) -> Membership:
        """Agree on membership with every live peer and admit registered newcomers.

        Blocks until every live member and every registered newcomer has called it and the group
        has at least ``min_world`` peers (the largest ``min_world`` any caller asked for); returns
        the (possibly new) epoch. Cheap when nothing changed. Founding members of a run call
        ``quorum(min_world=N)`` to wait for each other."""
        ...

    def all_reduce(
        self,
        tensor: torch.Tensor,
        op: ReduceOp = "sum",
        *,
        codec: Codec | None = None,
        algorithm: Algorithm = "auto",
        tag: str | None = None,
        timeout: float | None = None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor: ...

    def all_reduce_async(
        self,
        tensor: torch.Tensor,
        op: ReduceOp = "sum",
        *,
        codec: Codec | None = None,
        algorithm: Algorithm = "auto",
        tag: str | None = None,
        timeout: float | None = None,
        out: torch.Tensor | None = None,
    ) -> Work[torch.Tensor]:
        """``out``: where the result goes (see the module docstring); with ``out=tensor`` the
        input's buffer is reused for the sum, so a fragment sync holds one float32 buffer, not
        two. The caller must not touch ``tensor`` or ``out`` until the work is done."""
        ...

    def broadcast(
        self,
        tensor: torch.Tensor | None,
        root: int = 0,
        *,
        tag: str | None = None,
        timeout: float | None = None,
    ) -> torch.Tensor:
        """Root passes a tensor; other ranks pass ``None`` (or anything) and receive root's."""
        ...

    def broadcast_async(
        self,
        tensor: torch.Tensor | None,
        root: int = 0,
        *,
        tag: str | None = None,
        timeout: float | None = None,
    ) -> Work[torch.Tensor]: ...

    def broadcast_message(
        self,
        tensors: Sequence[torch.Tensor] | None,
        meta: Mapping[str, Any] | None,
        root: int = 0,
        *,
        tag: str | None = None,
        timeout: float | None = None,
    ) -> tuple[list[torch.Tensor], dict[str, Any]]:
        """Broadcast several tensors plus msgpack-able metadata (e.g. a named state dict)."""
        ...

    def all_gather(
        self,
        tensor: torch.Tensor,
        *,
        tag: str | None = None,
        timeout: float | None = None,
    ) -> list[torch.Tensor]:
        """Every rank's tensor, indexed by rank. Shapes and dtypes may differ between ranks."""
        ...

    def all_gather_async(
        self,
        tensor: torch.Tensor,
        *,
        tag: str | None = None,
        timeout: float | None = None,
    ) -> Work[list[torch.Tensor]]: ...

    def barrier(self, *, tag: str | None = None, timeout: float | None = None) -> None: ...

    def send(
        self,
        dst: int,
        tensors: Sequence[torch.Tensor],
        meta: Mapping[str, Any] | None = None,
        *,
        tag: str,
        timeout: float | None = None,
    ) -> None:
        """Point-to-point message to rank ``dst`` of the current epoch."""
        ...

    def recv(
        self,
        src: int,
        *,
        tag: str,
        timeout: float | None = None,
    ) -> tuple[list[torch.Tensor], dict[str, Any]]: ...

    def stats(self) -> OpStats:
        """Cumulative payload bytes sent/received by this rank since creation."""
        ...

    def close(self) -> None:
        """Leave the group gracefully; pending operations raise :class:`CommClosed`."""
        ...


def ring_bytes(payload_bytes: int, world_size: int) -> int:
    """Bytes each rank sends (and receives) in a ring all-reduce of ``payload_bytes``:
    reduce-scatter plus all-gather move 2(n-1)/n of the payload."""
    if world_size <= 1:
        return 0
    return (2 * (world_size - 1) * payload_bytes) // world_size
