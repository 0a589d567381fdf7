"""The TUN forwarder: one process that moves IP packets between the sites' TUN devices.

Started by :class:`transport.links.tun.testbed.TunTestbed` with the TUN file descriptors inherited
(``pass_fds``) and its description as JSON on the command line. Each packet read from site
``s``'s TUN goes to the site owning its destination address ``d``, through the
:class:`~transport.links.tun.shape.Path` ``(s, d)``, which says when it is due (or drops it);
due packets wait in one heap ordered by due time and are written into ``d``'s TUN then. With
access links (``"access"`` in the description) a packet first leaves ``s``'s uplink queue, then
takes the path, and on arrival (a first heap event) joins ``d``'s downlink queue, whose departure
(a second event) writes it.

Control is JSON lines on stdin, each answered by one JSON line on stdout, so the caller knows a
change is in force when the call returns: ``{"op": "set", "src": s, "dst": d, "path": {...}}``
and ``{"op": "stats"}``. End of stdin (the testbed closed it, or died) ends the forwarder, and
with it the TUN devices, whose only file descriptors it holds.

Single-threaded Python (epoll, ``os.read``/``os.write`` per packet): its ceiling is what
``python -m transport.links.tun --calibrate`` reports as ``ceiling``. It wakes for the next due
packet on a high-resolution timer and spins the last ``spin_us`` (:mod:`.timer`: the precision
of sub-millisecond paths, and the CPU it costs).
"""

from __future__ import annotations

import heapq
import json
import os
import random
import select
import sys
import time
from typing import Any

from transport.links.tun.shape import AccessConfig, Path, PathConfig, Queue
from transport.links.tun.timer import Deadline, poll_timeout

_MAX_PACKET = 65536
_BATCH = 64  # packets read from one TUN per wake-up before the others get their turn


class Forwarder:
    def __init__(
        self,
        fds: list[int],
        addrs: list[str],
        paths: dict[tuple[int, int], Path],
        access: AccessConfig | None = None,
        *,
        spin_s: float = 0.0,
        timer: bool = True,
    ):
        self.fds = fds
        self.spin_s = spin_s
        self.timer = timer
        self.site_of = {bytes(int(o) for o in a.split(".")): i for i, a in enumerate(addrs)}
        self.paths = paths
        self.access = access
        self.uplinks = [Queue() for _ in fds]
        self.downlinks = [Queue() for _ in fds]
        # (due, seq, dst, path, packet, arrived): arrived False = due at dst's downlink queue
        self.heap: list[tuple[float, int, int, Path, bytes, bool]] = []
        self.seq = 0
        self.other = 0  # packets that are not IPv4 or not addressed to a site (dropped)
        self.write_errors = 0  # due packets the destination TUN refused (dropped)
        self.late = [0, 0.0, 0.0]  # delivered packets: count, sum and max of (write - due) s
        self._ctl = b""

    def run(self, ctl_in: int, ctl_out: int) -> None:
        ep = select.epoll()
        src_of = {}
        for i, fd in enumerate(self.fds):
            os.set_blocking(fd, False)
            ep.register(fd, select.EPOLLIN)
            src_of[fd] = i
        os.set_blocking(ctl_in, False)
        ep.register(ctl_in, select.EPOLLIN)
        deadline = Deadline() if self.timer else None
        timer_fd = None if deadline is None else deadline.fd
        if deadline is not None and timer_fd is not None:
            ep.register(timer_fd, select.EPOLLIN)
        self._reply(ctl_out, {"ready": True, "timerfd": timer_fd is not None})
        heap, spin = self.heap, self.spin_s
        try:
            while True:
                due = heap[0][0] if heap else None
                timeout = poll_timeout(due, time.monotonic(), spin, timer=timer_fd is not None)
                if deadline is not None and timeout is None and due is not None:
                    deadline.arm(due - spin)
                for fd, _ in ep.poll(timeout):
                    if fd == ctl_in:
                        if not self._control(ctl_in, ctl_out):
                            return
                    elif fd == timer_fd and deadline is not None:
                        deadline.fired()
                    else:
                        self._read(fd, src_of[fd])
                self._deliver(time.monotonic())
        finally:
            if deadline is not None:
                deadline.close()
            ep.close()

    def _deliver(self, now: float) -> None:
        """Every heap event due by ``now``: a packet reaching its destination's downlink queue
        is queued there; a packet that is through is written into the destination's TUN."""
        heap = self.heap
        while heap and heap[0][0] <= now:
            due, _, dst, path, pkt, arrived = heapq.heappop(heap)
            if not arrived:
                self._push(self._through(self.downlinks[dst], due, pkt), dst, path, pkt)
                continue
            if path.deliverable():
                try:
                    os.write(self.fds[dst], pkt)
                except OSError:  # e.g. the site's TUN set down: lost there, as on a wire
                    self.write_errors += 1
                    continue
                path.stats.delivered += 1
                path.stats.delivered_bytes += len(pkt)
                late = now - due
                self.late[0] += 1
                self.late[1] += late
                self.late[2] = max(self.late[2], late)

    def _read(self, fd: int, src: int, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        for _ in range(_BATCH):
            try:
                pkt = os.read(fd, _MAX_PACKET)
            except BlockingIOError:
                return
            dst = self.site_of.get(pkt[16:20]) if pkt and pkt[0] >> 4 == 4 else None
            if dst is None or dst == src:
                self.other += 1  # IPv6 autoconfiguration chatter, or no such site
                continue
            path = self.paths[(src, dst)]
            sent = self._through(self.uplinks[src], now, pkt)
            due = None if sent is None else path.admit(sent, len(pkt))
            self._push(due, dst, path, pkt, arrived=self.access is None)

    def _through(self, queue: Queue, now: float, pkt: bytes) -> float | None:
        """When ``pkt`` has left an access queue (``now`` without access links), or None."""
        a = self.access
        return now if a is None else queue.depart(now, len(pkt), a.rate_mbit, a.queue_ms)

    def _push(
        self, due: float | None, dst: int, path: Path, pkt: bytes, arrived: bool = True
    ) -> None:
        if due is not None:
            heapq.heappush(self.heap, (due, self.seq, dst, path, pkt, arrived))
            self.seq += 1

    def _control(self, ctl_in: int, ctl_out: int) -> bool:
        chunk = os.read(ctl_in, 65536)
        if not chunk:
            return False
        self._ctl += chunk
        while b"\n" in self._ctl:
            line, self._ctl = self._ctl.split(b"\n", 1)
            msg = json.loads(line)
            if msg["op"] == "set":
                keys = list(self.paths)
                if msg.get("src") is not None:
                    keys = [(int(msg["src"]), int(msg["dst"]))]
                for key in keys:
                    self.paths[key].config = PathConfig.from_dict(msg["path"])
                self._reply(ctl_out, {"ok": True})
            elif msg["op"] == "stats":
                self._reply(ctl_out, self.stats())
            else:
                self._reply(ctl_out, {"error": f"unknown op {msg['op']!r}"})
        return True

    def stats(self) -> dict[str, Any]:
        return {
            "paths": {f"{s}->{d}": vars(p.stats) for (s, d), p in self.paths.items()},
            "other": self.other,
            "write_errors": self.write_errors,
            "queued": len(self.heap),
            "late_us": {  # how long after its due time the forwarder began writing a packet
                "mean": round(self.late[1] / max(1, self.late[0]) * 1e6, 1),
                "max": round(self.late[2] * 1e6, 1),
            },
            "access_drops": {
                str(i): {"up": u.drops, "down": d.drops}
                for i, (u, d) in enumerate(zip(self.uplinks, self.downlinks))
            },
        }

    @staticmethod
    def _reply(fd: int, msg: dict[str, Any]) -> None:
        os.write(fd, (json.dumps(msg) + "\n").encode())


def main(argv: list[str]) -> int:
    spec = json.loads(argv[0])
    seed = spec.get("seed")
    paths = {}
    for k, cfg in spec["paths"].items():
        s, d = (int(x) for x in k.split("->"))
        rng = random.Random(None if seed is None else seed * 1000 + s * 100 + d)
        paths[(s, d)] = Path(PathConfig.from_dict(cfg), rng=rng)
    access = AccessConfig(**spec["access"]) if spec.get("access") else None
    timing = {"spin_s": spec.get("spin_us", 0.0) / 1e6, "timer": spec.get("timer", True)}
    if spec.get("realtime"):
        # SCHED_FIFO: wake-ups are not queued behind the host's other work. The kernel's RT
        # throttling (sched_rt_runtime_us) still leaves the rest of the host its share.
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(10))
    Forwarder(spec["fds"], spec["addrs"], paths, access, **timing).run(
        sys.stdin.fileno(), sys.stdout.fileno()
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
