"""Start a local coordinator and N ZeroMQ peers in one process (tests, examples, docs).

Real sockets on 127.0.0.1, one thread per rank for the quorum; the communicators are then used
from whatever threads the caller likes. For separate processes, see :mod:`benchmarks.transport`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from typing import Iterator

from transport.coordinator import Coordinator, CoordinatorConfig
from transport.zmq_comm import ZmqCommunicator, ZmqConfig, connect


def connect_all(
    address: str, n: int, config: ZmqConfig, *, signature: str = "", timeout: float = 30.0
) -> list[ZmqCommunicator]:
    """Connect ``n`` peers and complete their first quorum together; returned in rank order."""
    comms: list[ZmqCommunicator | None] = [None] * n
    errors: list[BaseException] = []

    def one(i: int) -> None:
        try:
            c = connect(address, config, signature=signature, meta={"index": i})
            comms[i] = c
            c.quorum(min_world=n, timeout=timeout)
        except BaseException as exc:  # noqa: BLE001 - re-raised below after cleanup
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout + 5)
    made = [c for c in comms if c is not None]
    if errors or len(made) != n or any(t.is_alive() for t in threads):
        for c in made:
            c.close()
        if errors:
            raise errors[0]
        raise TimeoutError(f"peers did not form a group of {n} within {timeout}s")
    return sorted(made, key=lambda c: c.rank)


@contextlib.contextmanager
def local_group(
    n: int, config: ZmqConfig | None = None, coordinator: CoordinatorConfig | None = None
) -> Iterator[tuple[Coordinator, list[ZmqCommunicator]]]:
    """A coordinator on a free port plus ``n`` peers on 127.0.0.1; everything closed on exit."""
    cfg = config or ZmqConfig(bind_host="127.0.0.1")
    if cfg.bind_host in ("0.0.0.0", "*"):
        cfg = dataclasses.replace(cfg, bind_host="127.0.0.1")
    coord_cfg = coordinator or CoordinatorConfig(bind="tcp://127.0.0.1:0", heartbeat_interval=0.5)
    with Coordinator(coord_cfg) as coord:
        comms = connect_all(coord.address, n, cfg)
        try:
            yield coord, comms
        finally:
            for c in comms:
                c.close()
