"""A thread-safe future that satisfies :class:`lowband.comm.Work`."""

from __future__ import annotations

import threading
from typing import Callable, Generic, TypeVar

from lowband.comm import OpStats
from lowband.errors import TransportTimeout

T = TypeVar("T")


class FutureWork(Generic[T]):
    """Completed exactly once, by ``set_result`` or ``set_error``; later calls are ignored."""

    def __init__(self, description: str, default_timeout: float) -> None:
        self._description = description
        self._default_timeout = default_timeout
        self._event = threading.Event()
        self._lock = threading.Lock()
        self._result: T | None = None
        self._error: BaseException | None = None
        self._stats = OpStats()
        self._callbacks: list[Callable[["FutureWork[T]"], None]] = []

    def set_result(self, result: T, stats: OpStats | None = None) -> bool:
        return self._finish(result, None, stats)

    def set_error(self, error: BaseException, stats: OpStats | None = None) -> bool:
        return self._finish(None, error, stats)

    def _finish(self, result: T | None, error: BaseException | None, stats: OpStats | None) -> bool:
        with self._lock:
            if self._event.is_set():
                return False
            self._result, self._error = result, error
            if stats is not None:
                self._stats = stats
            self._event.set()
            callbacks, self._callbacks = self._callbacks, []
        for cb in callbacks:
            cb(self)
        return True

    def add_done_callback(self, cb: Callable[["FutureWork[T]"], None]) -> None:
        """Run ``cb(work)`` once done (immediately, in this thread, if already done)."""
        with self._lock:
            if not self._event.is_set():
                self._callbacks.append(cb)
                return
        cb(self)

    def wait(self, timeout: float | None = None) -> T:
        limit = self._default_timeout if timeout is None else timeout
        if not self._event.wait(limit):
            raise TransportTimeout(
                f"{self._description} did not complete within {limit:.1f}s; a peer may be slow "
                "or partitioned (raise the timeout, or check the peers' logs)"
            )
        if self._error is not None:
            raise self._error
        return self._result  # type: ignore[return-value]

    def done(self) -> bool:
        return self._event.is_set()

    def exception(self) -> BaseException | None:
        """The error the operation ended with, or None (also None while pending)."""
        return self._error

    @property
    def stats(self) -> OpStats:
        return self._stats


def completed(result: T, description: str = "operation") -> FutureWork[T]:
    """An already-finished handle (for trivial cases such as a world of one)."""
    work: FutureWork[T] = FutureWork(description, 0.0)
    work.set_result(result)
    return work
