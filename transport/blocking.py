"""The blocking collectives of a communicator, written once over its async ones.

Both communicators (:mod:`transport.loopback`, :mod:`transport.zmq_comm`) implement the async
variants and ``_broadcast_async(tensors, meta, root, tag, timeout)``; a blocking call is the
async call waited on, and the one-tensor ``broadcast_async`` is written here once, so the two
cannot drift apart in argument handling or result unwrapping.
"""

from __future__ import annotations

from typing import Any, Mapping, Protocol, Sequence

import torch

from lowband.comm import Algorithm, Codec, Communicator, ReduceOp
from lowband.errors import ProtocolError
from transport.work import FutureWork


class _AsyncComm(Communicator, Protocol):
    """The self-type of :class:`BlockingCollectives`: a :class:`~lowband.comm.Communicator`
    (its async collectives are what the blocking ones wait on) plus two hooks of its own."""

    def _timeout(self, timeout: float | None) -> float: ...

    def _broadcast_async(
        self,
        tensors: Sequence[torch.Tensor] | None,
        meta: Mapping | None,
        root: int,
        tag: str | None,
        timeout: float | None,
    ) -> FutureWork: ...


class BlockingCollectives:
    """Mixin: ``all_reduce``, ``broadcast``, ``broadcast_message``, ``all_gather``.

    Its methods take ``self`` as :class:`_AsyncComm`, so mypy checks every class mixing it in
    for the async collectives and hooks they call, without the mixin repeating their signatures.
    """

    def all_reduce(
        self: _AsyncComm,
        tensor: torch.Tensor,
        op: ReduceOp = "sum",
        *,
        codec: Codec | None = None,
        algorithm: Algorithm = "auto",
        tag: str | None = None,
        timeout: float | None = None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return self.all_reduce_async(
            tensor, op, codec=codec, algorithm=algorithm, tag=tag, timeout=timeout, out=out
        ).wait()

    def broadcast(
        self: _AsyncComm,
        tensor: torch.Tensor | None,
        root: int = 0,
        *,
        tag: str | None = None,
        timeout: float | None = None,
    ) -> torch.Tensor:
        return self.broadcast_async(tensor, root, tag=tag, timeout=timeout).wait()

    def broadcast_message(
        self: _AsyncComm,
        tensors: Sequence[torch.Tensor] | None,
        meta: Mapping[str, Any] | None,
        root: int = 0,
        *,
        tag: str | None = None,
        timeout: float | None = None,
    ) -> tuple[list[torch.Tensor], dict[str, Any]]:
        if self.rank == root and tensors is None:
            tensors = []
        return self._broadcast_async(tensors, meta, root, tag, timeout).wait()

    def broadcast_async(
        self: _AsyncComm,
        tensor: torch.Tensor | None,
        root: int = 0,
        *,
        tag: str | None = None,
        timeout: float | None = None,
    ) -> FutureWork:
        """One tensor from ``root``: a one-tensor ``_broadcast_async`` whose result is unwrapped."""
        inner = self._broadcast_async(
            None if tensor is None else [tensor], None, root, tag, timeout
        )
        outer: FutureWork = FutureWork(f"broadcast on rank {self.rank}", self._timeout(timeout))

        def unwrap(w: FutureWork) -> None:
            err = w.exception()
            if err is not None:
                outer.set_error(err, w.stats)
                return
            tensors, _ = w.wait(0)
            if len(tensors) != 1:
                outer.set_error(
                    ProtocolError(f"broadcast carried {len(tensors)} tensors, expected 1")
                )
            else:
                outer.set_result(tensors[0], w.stats)

        inner.add_done_callback(unwrap)
        return outer

    def all_gather(
        self: _AsyncComm,
        tensor: torch.Tensor,
        *,
        tag: str | None = None,
        timeout: float | None = None,
    ) -> list[torch.Tensor]:
        return self.all_gather_async(tensor, tag=tag, timeout=timeout).wait()
