"""The next inner step's batch, drawn and staged while the current step runs.

A batch is a pure function of (slot, step) (``diloco.data.train_batch``), so it can be made
ahead of time. On CUDA the next batch is cut and page-locked on a helper thread while the
device runs this step, and the host→device copy is asynchronous (``non_blocking`` from pinned
memory): the host never waits for the device to hand the model its input. Torch's caching host
allocator keeps a pinned block alive until the copy that reads it has run, so each batch may
have its own pinned tensor (no buffer is overwritten under a copy in flight).

CPU twin: the same calls; the batch is made inline unless ``threaded`` (tests use the thread
on the CPU to check the hand-over).
"""

from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable

import torch

logger = logging.getLogger(__name__)

MakeBatch = Callable[[int, int], Any]  # (slot, step) -> a host tensor


class BatchPrefetcher:
    """``get(slot, step)`` returns that batch on ``device`` and starts making ``(slot, step+1)``.

    A request for another key than the one prepared (a resume moved the step, or another slot)
    drops the prepared batch and makes the asked one: the result is always ``make(slot, step)``.
    """

    def __init__(self, make: MakeBatch, device: torch.device, threaded: bool | None = None) -> None:
        self.make = make
        self.device = device
        self.pin = device.type == "cuda"
        self.threaded = self.pin if threaded is None else threaded
        self._pool: ThreadPoolExecutor | None = None
        self._next: tuple[tuple[int, int], Future[Any]] | None = None

    def get(self, slot: int, step: int) -> Any:
        batch = self._take((slot, step))
        if self.threaded:
            self._next = ((slot, step + 1), self._submit(slot, step + 1))
        if isinstance(batch, torch.Tensor) and batch.device != self.device:
            return batch.to(self.device, non_blocking=self.pin)
        return batch

    def _take(self, key: tuple[int, int]) -> Any:
        nxt, self._next = self._next, None
        if nxt is not None and nxt[0] == key:
            return nxt[1].result()
        if nxt is not None:
            nxt[1].cancel()
        return self._host(*key)

    def _submit(self, slot: int, step: int) -> Future[Any]:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lowband-batch")
        return self._pool.submit(self._host, slot, step)

    def _host(self, slot: int, step: int) -> Any:
        batch = self.make(slot, step)
        if self.pin and isinstance(batch, torch.Tensor) and batch.device.type == "cpu":
            batch = batch.pin_memory()
        return batch

    def close(self) -> None:
        """Stop the helper thread (the prepared batch, if any, is dropped)."""
        self._next = None
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
