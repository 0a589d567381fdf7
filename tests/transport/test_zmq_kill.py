"""kill -9 of a peer process in the middle of collectives (tier 3, a real child process).

Every peer runs on this host with the default ``same_host="auto"``, so these all-reduces take
the shared-memory path: a survivor may be reading the dead peer's slab when it dies. (The
socket paths under SIGKILL are in test_zmq_peerlost.py.)"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time

import pytest
import torch

from lowband.errors import PeerLost
from tests.conftest import PY
from transport.coordinator import Coordinator, CoordinatorConfig
from transport.zmq_comm import ZmqConfig, connect

pytestmark = pytest.mark.timeout(90)

CHILD = """
import sys, torch
from transport.zmq_comm import ZmqConfig, connect
comm = connect(sys.argv[1], ZmqConfig(bind_host="127.0.0.1", connections=2, chunk_bytes=64 * 1024,
                                      timeout=30.0), signature="kill-test")
comm.quorum(min_world=3, timeout=30)
print("READY", flush=True)
while True:
    comm.all_reduce(torch.ones(200_000), tag="loop")
"""


def test_kill_9_raises_peer_lost_on_survivors_then_they_continue(spawn):
    interval = 0.5
    cfg = ZmqConfig(bind_host="127.0.0.1", connections=2, chunk_bytes=64 * 1024, timeout=30.0)
    with Coordinator(
        CoordinatorConfig(bind="tcp://127.0.0.1:0", heartbeat_interval=interval)
    ) as coord:
        child = spawn([PY, "-c", CHILD, coord.address], stdout=subprocess.PIPE)
        survivors = [connect(coord.address, cfg, signature="kill-test") for _ in range(2)]
        try:
            ms = []
            threads = [
                threading.Thread(target=lambda c=c: ms.append(c.quorum(min_world=3, timeout=30)))
                for c in survivors
            ]
            for t in threads:
                t.start()
            for t in threads:
                t.join(40)
            assert len(ms) == 2 and all(m.world_size == 3 for m in ms)
            assert child.stdout.readline().strip() == b"READY"

            killed_at: list[float] = []
            results: dict[int, tuple] = {}

            def body(i: int) -> None:
                c = survivors[i]
                rounds = 0
                while True:
                    try:
                        out = c.all_reduce(torch.ones(200_000), tag="loop", timeout=20)
                        assert torch.equal(out, torch.full((200_000,), 3.0))
                        rounds += 1
                    except PeerLost as e:
                        lost_at, exc = time.monotonic(), e
                        break
                m = c.quorum(timeout=20)
                after = c.all_reduce(torch.full((10,), float(m.rank + 1)), tag="after", timeout=20)
                results[i] = (rounds, lost_at, exc, m, after)

            runners = [threading.Thread(target=body, args=(i,)) for i in range(2)]
            for t in runners:
                t.start()
            time.sleep(1.0)  # let a few collectives complete with all three peers
            os.kill(child.pid, signal.SIGKILL)
            killed_at.append(time.monotonic())
            for t in runners:
                t.join(60)
            assert len(results) == 2, "a survivor hung"
            assert survivors[0].choose_algorithm(torch.ones(200_000)) == "shm"
            for rounds, lost_at, exc, m, after in results.values():
                assert rounds >= 1
                assert lost_at - killed_at[0] < 2 * interval + 2.0  # ~2 intervals, plus slack
                assert isinstance(exc, PeerLost)
                assert (m.epoch, m.world_size) == (1, 2) and len(m.left) == 1
                assert torch.equal(after, torch.full((10,), 3.0))
            assert coord.counters["lost"] == 1
        finally:
            for c in survivors:
                c.close()
