"""Real rate limiting: network namespaces on a bridge, each veth shaped with ``tc tbf``.

Unlike the user-space emulator, this shapes real kernel TCP traffic (this kernel has ``tbf`` and
``htb`` but no ``netem``). :class:`Testbed` is the one namespace testbed of the project: it
creates ``sites`` namespaces ``<name>n<i>`` with addresses 10.<net>.0.<i+1>, each joined to a
bridge (the host side, 10.<net>.0.254) by a veth pair whose two ends both carry a token-bucket
filter of ``rate_mbit`` (the site's download and upload), and removes everything on exit. The
multi-site demo, the WAN benchmark and :func:`measure_transfer` (a lowband point-to-point
transfer between sites 1 and 0, each side a separate process) all use it. Requires root and
iproute2.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterator, Sequence

from lowband.errors import ConfigError

if TYPE_CHECKING:
    from transport.zmq_comm import ZmqCommunicator, ZmqConfig


@dataclass(frozen=True, kw_only=True)
class NetnsConfig:
    sites: int = 2
    """Number of namespaces on the bridge."""
    rate_mbit: float = 100.0
    """tbf rate on each veth end (so each site's upload and download)."""
    burst_bytes: int = 0
    """tbf bucket size; 0 picks 2 ms worth of the rate (at least 32 KiB)."""
    queue_ms: float = 50.0
    """tbf ``latency``: how long a packet may wait in the shaper's queue."""
    net: int = 231
    """Second octet of the 10.x.0.0/24 subnet used for the testbed."""
    name: str = ""
    """Namespace name prefix; empty: ``lb<pid>``."""

    def __post_init__(self) -> None:
        if not 0.05 <= self.rate_mbit <= 100_000:
            raise ConfigError("rate_mbit", f"must be in [0.05, 100000], got {self.rate_mbit}")
        if not 1 <= self.net <= 254:
            raise ConfigError("net", f"must be in [1, 254], got {self.net}")
        if not 1 <= self.sites <= 200:
            raise ConfigError("sites", f"must be in [1, 200], got {self.sites}")
        if self.name and (len(self.name) > 8 or not self.name.isalnum()):
            raise ConfigError("name", "at most 8 alphanumeric characters")

    @property
    def burst(self) -> int:
        return self.burst_bytes or max(32 * 1024, int(self.rate_mbit * 1e6 / 8 * 0.002))


def available() -> str | None:
    """None if namespaces can be made here, else the reason they cannot."""
    if os.geteuid() != 0:
        return "needs root"
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "needs iproute2 (ip, tc)"
    return None


def _run(*args: str) -> None:
    proc = subprocess.run(args, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} failed: {proc.stderr.strip()}")


class Testbed:
    """Context manager owning the namespaces, the bridge, the veth pairs and their qdiscs."""

    __test__ = False  # a testbed, not a pytest test class

    def __init__(self, config: NetnsConfig) -> None:
        self.config = config
        base = config.name or f"lb{os.getpid() % 100000}"
        self.bridge = f"{base}br"
        self.ns = [f"{base}n{i}" for i in range(config.sites)]
        self.host = f"10.{config.net}.0.254"
        self._up = False

    def addr(self, i: int) -> str:
        return f"10.{self.config.net}.0.{i + 1}"

    @property
    def addrs(self) -> list[str]:
        return [self.addr(i) for i in range(len(self.ns))]

    def _shape(self, dev: str, ns: str | None) -> None:
        cfg = self.config
        _run(
            *(["ip", "netns", "exec", ns] if ns else []),
            "tc",
            "qdisc",
            "add",
            "dev",
            dev,
            "root",
            "tbf",
            "rate",
            f"{cfg.rate_mbit}mbit",
            "burst",
            str(cfg.burst),
            "latency",
            f"{cfg.queue_ms}ms",
        )

    def __enter__(self) -> "Testbed":
        reason = available()
        if reason:
            raise ConfigError("netns", f"network namespaces unavailable: {reason}")
        try:
            self._up = True
            _run("ip", "link", "add", self.bridge, "type", "bridge")
            _run("ip", "addr", "add", f"{self.host}/24", "dev", self.bridge)
            _run("ip", "link", "set", self.bridge, "up")
            self._forward(add=True)
            for i, ns in enumerate(self.ns):
                outer, inner = f"{ns}o", f"{ns}i"
                _run("ip", "netns", "add", ns)
                _run("ip", "link", "add", outer, "type", "veth", "peer", "name", inner)
                _run("ip", "link", "set", inner, "netns", ns)
                _run("ip", "link", "set", outer, "master", self.bridge)
                _run("ip", "link", "set", outer, "up")
                _run("ip", "-n", ns, "addr", "add", f"{self.addr(i)}/24", "dev", inner)
                _run("ip", "-n", ns, "link", "set", inner, "up")
                _run("ip", "-n", ns, "link", "set", "lo", "up")
                self._shape(outer, None)  # towards the site: its download
                self._shape(inner, ns)  # from the site: its upload
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        if not self._up:
            return
        for ns in self.ns:  # deleting a namespace deletes its veth pair too
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True)
        self._forward(add=False)
        self._up = False

    def _forward(self, *, add: bool) -> None:
        """Let traffic between the sites cross the bridge even under a host firewall.

        With ``br_netfilter`` loaded (Docker loads it), bridged packets traverse iptables'
        FORWARD chain, and Docker sets that chain's policy to DROP, so sites on our bridge
        could not reach each other once a Docker engine had run on the host (its rules outlive
        it). One ACCEPT rule scoped to this bridge, removed on exit, leaves every other rule
        alone; without iptables there is nothing to do."""
        if shutil.which("iptables") is None:
            return
        rule = ["FORWARD", "-i", self.bridge, "-o", self.bridge, "-j", "ACCEPT"]
        if add:
            subprocess.run(["iptables", "-I", *rule], capture_output=True)
        else:
            while subprocess.run(["iptables", "-D", *rule], capture_output=True).returncode == 0:
                pass

    def command(self, site: int, args: Sequence[str]) -> list[str]:
        """``args`` to be run inside site ``site``'s namespace."""
        return ["ip", "netns", "exec", self.ns[site], *args]


# ---- the measured transfer -----------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class TransferConfig:
    size_mb: float = 25.0
    connections: int = 4
    chunk_mb: float = 1.0
    repeats: int = 3
    timeout: float = 120.0

    def __post_init__(self) -> None:
        if self.size_mb <= 0 or self.repeats < 1 or not 1 <= self.connections <= 64:
            raise ConfigError("transfer", "need size_mb > 0, repeats >= 1, 1 <= connections <= 64")


def measure_transfer(link: Testbed, cfg: TransferConfig) -> dict[str, Any]:
    """Send ``size_mb`` from site 1 to site 0 ``repeats`` times; goodput of the best run."""
    port = 29000 + os.getpid() % 1000
    coord = f"tcp://{link.addrs[0]}:{port}"
    common = [
        "--coord",
        coord,
        "--size-mb",
        str(cfg.size_mb),
        "--connections",
        str(cfg.connections),
        "--chunk-mb",
        str(cfg.chunk_mb),
        "--repeats",
        str(cfg.repeats),
        "--timeout",
        str(cfg.timeout),
    ]
    me = [sys.executable, "-m", "transport.links.netns"]
    recv = subprocess.Popen(
        link.command(0, [*me, "_peer", "recv", "--bind", link.addrs[0], *common]),
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    send = subprocess.Popen(
        link.command(1, [*me, "_peer", "send", "--bind", link.addrs[1], *common]),
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, _ = recv.communicate(timeout=cfg.timeout + 60)
        send.wait(timeout=30)
    finally:
        for p in (recv, send):
            if p.poll() is None:
                os.killpg(p.pid, 9)
                p.wait()
    if recv.returncode != 0 or not out.strip():
        raise RuntimeError(
            f"namespace transfer failed (exit codes {recv.returncode}, {send.returncode})"
        )
    times = json.loads(out.strip().splitlines()[-1])["times"]
    nbytes = int(cfg.size_mb * (1 << 20))
    best = min(times)
    goodput = nbytes * 8 / best / 1e6
    return {
        "mode": "netns",
        "rate_mbit": link.config.rate_mbit,
        "bytes": nbytes,
        "connections": cfg.connections,
        "seconds": round(best, 4),
        "seconds_all": [round(t, 4) for t in times],
        "goodput_mbit": round(goodput, 2),
        "utilisation": round(goodput / link.config.rate_mbit, 4),
    }


@contextlib.contextmanager
def peer_session(
    coordinator: str, bind: str, cfg: ZmqConfig, signature: str, *, serve: bool
) -> Iterator[ZmqCommunicator]:
    """One side of a two-peer run, inside its namespace (this module's transfer, the ship
    benchmark): with ``serve``, this side also runs the coordinator at ``coordinator`` (bound on
    every interface of the namespace, ``bind`` being its own address); the communicator joins it,
    retrying for 30 s (the other side's coordinator may not be up yet). Both close on exit."""
    from transport.coordinator import Coordinator, CoordinatorConfig
    from transport.zmq_comm import connect

    coord = None
    if serve:
        bind_all = coordinator.replace(bind, "0.0.0.0")
        coord = Coordinator(CoordinatorConfig(bind=bind_all)).start()
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                comm = connect(coordinator, cfg, signature=signature)
                break
            except Exception:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        try:
            yield comm
        finally:
            comm.close()
    finally:
        if coord is not None:
            coord.stop()


def _peer(args: argparse.Namespace) -> int:
    """One side of the transfer, inside its namespace. The receiver also runs the coordinator."""
    import torch

    from transport.zmq_comm import ZmqConfig

    chunk = int(args.chunk_mb * (1 << 20))
    cfg = ZmqConfig(
        bind_host=args.bind,
        connections=args.connections,
        chunk_bytes=chunk,
        timeout=args.timeout,
        max_message_bytes=max(64 << 20, chunk + (1 << 20)),
    )
    with peer_session(args.coord, args.bind, cfg, "netns", serve=args.role == "recv") as comm:
        comm.quorum(min_world=2, timeout=args.timeout)
        x = torch.zeros(int(args.size_mb * (1 << 20)) // 4)
        times = []
        other = 1 - comm.rank  # ranks follow registration order, not the role: either may be 0
        for _ in range(args.repeats):
            comm.barrier(timeout=args.timeout)
            t0 = time.perf_counter()
            if args.role == "send":
                comm.send(other, [x], tag="bulk", timeout=args.timeout)
            else:
                comm.recv(other, tag="bulk", timeout=args.timeout)
                times.append(time.perf_counter() - t0)
        comm.barrier(timeout=args.timeout)
        if args.role == "recv":
            print(json.dumps({"times": times}), flush=True)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m transport.links.netns")
    sub = p.add_subparsers(dest="cmd", required=True)
    w = sub.add_parser("_peer")
    w.add_argument("role", choices=["send", "recv"])
    w.add_argument("--bind", required=True)
    w.add_argument("--coord", required=True)
    w.add_argument("--size-mb", type=float, required=True)
    w.add_argument("--connections", type=int, required=True)
    w.add_argument("--chunk-mb", type=float, required=True)
    w.add_argument("--repeats", type=int, required=True)
    w.add_argument("--timeout", type=float, required=True)
    args = p.parse_args(argv)
    return _peer(args)


if __name__ == "__main__":
    sys.exit(main())
