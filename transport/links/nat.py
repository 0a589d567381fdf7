"""Sites behind NAT: network namespaces, some behind a MASQUERADE router with no way in.

:class:`NatTestbed` builds, and removes on exit, a switch namespace holding a bridge (nothing is
added to the host's network or firewall), ``public`` site namespaces on it (10.<net>.0.1, .2, ...)
and ``nat`` sites, each alone on a private network 10.<net+1+i>.0.0/24 behind its own router
namespace. A router has a public address on the bridge (10.<net>.0.101 + i), forwards, rewrites
what leaves to its public address (iptables MASQUERADE) and admits from the public side only the
replies to connections its site opened. Public sites have no route to the private networks, so a
NAT site can dial every public site but nobody can dial it: the situation of a site behind a home
router or a carrier-grade NAT. Every rule lives inside a namespace and goes with it. ``rate_mbit``
(0: none) puts a ``tbf`` on both ends of every site's link, as :mod:`transport.links.netns` does.

:func:`run_group` starts one process per site (each ``python -m transport.links.nat _peer`` in
its namespace; the first public site also runs the coordinator), has them all-reduce, and
returns what each reported: result hash, times, route and the coordinator's relay counters.
Requires root, iproute2 and iptables.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any, Sequence

from lowband.errors import ConfigError


@dataclass(frozen=True, kw_only=True)
class NatConfig:
    public: int = 2
    """Sites that can be dialled (the first runs the coordinator)."""
    nat: int = 1
    """Sites behind their own MASQUERADE router."""
    net: int = 180
    """Second octet of the public 10.x.0.0/24; NAT site i uses 10.<net+1+i>.0.0/24."""
    rate_mbit: float = 0.0
    """tbf rate on every site's link, both directions; 0: not shaped."""
    name: str = ""
    """Namespace name prefix (at most 8 alphanumerics); empty: ``ln<pid>``."""

    def __post_init__(self) -> None:
        if not 1 <= self.public <= 50 or not 0 <= self.nat <= 20:
            raise ConfigError("public/nat", "need 1 <= public <= 50 and 0 <= nat <= 20")
        if not 1 <= self.net <= 254 - 1 - self.nat:
            raise ConfigError("net", f"must be in [1, {253 - self.nat}], got {self.net}")
        if self.rate_mbit and not 0.05 <= self.rate_mbit <= 100_000:
            raise ConfigError("rate_mbit", f"0 or in [0.05, 100000], got {self.rate_mbit}")
        if self.name and (len(self.name) > 8 or not self.name.isalnum()):
            raise ConfigError("name", "at most 8 alphanumeric characters")


def available() -> str | None:
    """None if the NAT testbed can be built here, else why not."""
    if os.geteuid() != 0:
        return "needs root"
    for tool in ("ip", "iptables"):
        if shutil.which(tool) is None:
            return f"needs {tool}"
    return None


def _run(*args: str) -> None:
    proc = subprocess.run(args, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} failed: {proc.stderr.strip()}")


class NatTestbed:
    """Context manager owning the namespaces of the NAT testbed; see the module docstring."""

    __test__ = False

    def __init__(self, config: NatConfig) -> None:
        self.config = config
        base = config.name or f"ln{os.getpid() % 100000}"
        self.base = base
        self.switch = f"{base}sw"
        self.public = [f"{base}p{i}" for i in range(config.public)]
        self.nat = [f"{base}n{i}" for i in range(config.nat)]
        self.routers = [f"{base}r{i}" for i in range(config.nat)]
        self._made: list[str] = []

    # ---- addresses -------------------------------------------------------------------------------
    def public_addr(self, i: int) -> str:
        return f"10.{self.config.net}.0.{i + 1}"

    def router_addr(self, i: int) -> str:
        """Router i's public address: what the NAT site's connections come from."""
        return f"10.{self.config.net}.0.{101 + i}"

    def nat_addr(self, i: int) -> str:
        return f"10.{self.config.net + 1 + i}.0.2"

    @property
    def namespaces(self) -> list[str]:
        return [self.switch, *self.public, *self.routers, *self.nat]

    def command(self, ns: str, args: Sequence[str]) -> list[str]:
        return ["ip", "netns", "exec", ns, *args]

    # ---- building --------------------------------------------------------------------------------
    def _ns(self, name: str) -> None:
        _run("ip", "netns", "add", name)
        self._made.append(name)
        _run("ip", "-n", name, "link", "set", "lo", "up")

    def _shape(self, ns: str, dev: str) -> None:
        rate = self.config.rate_mbit
        if not rate:
            return
        burst = max(32 * 1024, int(rate * 1e6 / 8 * 0.002))
        _run(
            "ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "tbf",
            "rate", f"{rate}mbit", "burst", str(burst), "latency", "50ms",
        )  # fmt: skip

    def _plug(self, ns: str, dev: str, addr: str) -> None:
        """A veth from the switch's bridge into ``ns`` as ``dev`` with ``addr``/24."""
        outer = f"{dev}o"
        _run("ip", "link", "add", outer, "netns", self.switch, "type", "veth", "peer", "name", dev,
             "netns", ns)  # fmt: skip
        _run("ip", "-n", self.switch, "link", "set", outer, "master", "br0")
        _run("ip", "-n", self.switch, "link", "set", outer, "up")
        _run("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
        _run("ip", "-n", ns, "link", "set", dev, "up")
        self._shape(self.switch, outer)
        self._shape(ns, dev)

    def __enter__(self) -> "NatTestbed":
        reason = available()
        if reason:
            raise ConfigError("netns", f"the NAT testbed is unavailable: {reason}")
        b = self.base
        try:
            self._ns(self.switch)
            _run("ip", "-n", self.switch, "link", "add", "br0", "type", "bridge")
            _run("ip", "-n", self.switch, "link", "set", "br0", "up")
            for i, ns in enumerate(self.public):
                self._ns(ns)
                self._plug(ns, f"{b}p{i}", self.public_addr(i))
            for i, (router, site) in enumerate(zip(self.routers, self.nat)):
                self._ns(router)
                self._ns(site)
                wan = f"{b}r{i}"
                self._plug(router, wan, self.router_addr(i))
                lan, inner = f"{b}l{i}", f"{b}n{i}"
                _run("ip", "link", "add", lan, "netns", router, "type", "veth", "peer", "name",
                     inner, "netns", site)  # fmt: skip
                private = f"10.{self.config.net + 1 + i}.0"
                _run("ip", "-n", router, "addr", "add", f"{private}.1/24", "dev", lan)
                _run("ip", "-n", router, "link", "set", lan, "up")
                _run("ip", "-n", site, "addr", "add", f"{self.nat_addr(i)}/24", "dev", inner)
                _run("ip", "-n", site, "link", "set", inner, "up")
                _run("ip", "-n", site, "route", "add", "default", "via", f"{private}.1")
                self._shape(site, inner)
                ipt = ["ip", "netns", "exec", router, "iptables"]
                _run("ip", "netns", "exec", router, "sysctl", "-qw", "net.ipv4.ip_forward=1")
                _run(*ipt, "-t", "nat", "-A", "POSTROUTING", "-o", wan, "-j", "MASQUERADE")
                # From the public side only the replies to what the site opened: no way in.
                _run(*ipt, "-A", "FORWARD", "-i", wan, "-o", lan, "-m", "conntrack",
                     "--ctstate", "ESTABLISHED,RELATED", "-j", "ACCEPT")  # fmt: skip
                _run(*ipt, "-A", "FORWARD", "-i", wan, "-o", lan, "-j", "DROP")
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        # Deleting a namespace deletes its veth ends, bridge and iptables rules with it.
        for ns in reversed(self._made):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        self._made = []


def namespaces_left(prefix: str) -> list[str]:
    """Namespaces whose name starts with ``prefix`` (a test checks none outlive a testbed)."""
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in out.splitlines() if line.startswith(prefix)]


# ---- a group on the testbed ----------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class GroupConfig:
    size_mb: float = 8.0
    """All-reduce payload per peer (float32)."""
    repeats: int = 3
    """Timed all-reduces (after one untimed warm-up)."""
    connections: int = 4
    relay: str = "auto"
    """Every peer's ``ZmqConfig.relay``."""
    curve: bool = True
    """CURVE on every socket (the coordinator's keypair made per run)."""
    timeout: float = 60.0


def run_group(
    bed: NatTestbed, cfg: GroupConfig, port: int, sites: Sequence[str] | None = None
) -> list[dict[str, Any]]:
    """One process per site (namespace names; default every site of ``bed``, public ones
    first), each in its namespace; the first must be public (it runs the coordinator). Returns
    their JSON reports in that order (the first adds the coordinator's ``relay`` counters)."""
    from transport.auth import CurveKeys

    keys = CurveKeys.generate() if cfg.curve else None
    coord = f"tcp://{bed.public_addr(0)}:{port}"
    where = {ns: bed.public_addr(i) for i, ns in enumerate(bed.public)}
    where.update({ns: bed.nat_addr(i) for i, ns in enumerate(bed.nat)})
    chosen = list(sites) if sites is not None else [*bed.public, *bed.nat]
    if not chosen or chosen[0] not in bed.public or any(ns not in where for ns in chosen):
        raise ConfigError("sites", "names of the testbed's sites, a public one first")
    site_addrs = [(ns, where[ns]) for ns in chosen]
    procs = []
    env = dict(os.environ)
    if keys is not None:
        assert keys.secret is not None
        env["LOWBAND_NAT_CURVE"] = f"{keys.public.decode()} {keys.secret.decode()}"
    try:
        for i, (ns, addr) in enumerate(site_addrs):
            args = [
                sys.executable, "-m", "transport.links.nat", "_peer",
                "--coord", coord, "--bind", addr, "--world", str(len(site_addrs)),
                "--size-mb", str(cfg.size_mb), "--repeats", str(cfg.repeats),
                "--connections", str(cfg.connections), "--relay", cfg.relay,
                "--timeout", str(cfg.timeout), "--id", f"s{i}",
            ]  # fmt: skip
            if i == 0:
                args.append("--run-coordinator")
            procs.append(
                subprocess.Popen(
                    bed.command(ns, args),
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                    env=env,
                    start_new_session=True,
                )
            )
            if i == 0:
                time.sleep(0.5)  # the coordinator first (the others retry anyway)
        reports = []
        for p in procs:
            out, err = p.communicate(timeout=cfg.timeout + 60)
            lines = [line for line in out.splitlines() if line.startswith("{")]
            if p.returncode != 0 or not lines:
                raise RuntimeError(f"a site failed (exit {p.returncode}):\n{err[-3000:]}")
            reports.append({**json.loads(lines[-1]), "log": err[-20000:]})
        return reports
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, 9)
                p.wait()


def _peer(args: argparse.Namespace) -> int:
    """One site of :func:`run_group`, inside its namespace."""
    import logging

    import torch

    from transport.auth import CurveKeys
    from transport.coordinator import Coordinator, CoordinatorConfig
    from transport.zmq_comm import ZmqConfig, connect

    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    keys = None
    if os.environ.get("LOWBAND_NAT_CURVE"):
        pub, sec = os.environ["LOWBAND_NAT_CURVE"].split(" ")
        keys = CurveKeys(public=pub.encode(), secret=sec.encode())
    coord = None
    if args.run_coordinator:
        host_port = args.coord[len("tcp://") :]
        coord = Coordinator(
            CoordinatorConfig(bind=f"tcp://{host_port}", curve=keys, heartbeat_interval=2.0)
        ).start()
    cfg = ZmqConfig(
        bind_host=args.bind,
        connections=args.connections,
        timeout=args.timeout,
        same_host="off",
        relay=args.relay,
        curve_server_key=keys.public if keys else None,
    )
    deadline = time.monotonic() + 30
    while True:
        try:
            comm = connect(args.coord, cfg, signature="nat", peer_id=args.id)
            break
        except Exception:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.3)
    report: dict[str, Any] = {"id": args.id}
    try:
        m = comm.quorum(min_world=args.world, timeout=args.timeout)
        # how this site's links go, read before anyone leaves (a peer gone is no link)
        report.update(route=comm.route(torch.zeros(1 << 20)), relayed_peers=comm.relayed_peers)
        if coord is not None:
            # registered peers only: read while the whole group is in (a site may leave after
            # the last barrier before this process reads it again)
            report["unreachable"] = list(coord.unreachable)
        n = int(args.size_mb * (1 << 20)) // 4
        gen = torch.Generator().manual_seed(1234 + m.rank)
        x = torch.randn(n, generator=gen)
        comm.all_reduce(x.clone(), "sum", timeout=args.timeout)  # warm-up
        times = []
        out = x
        for _ in range(args.repeats):
            comm.barrier(timeout=args.timeout)
            t0 = time.perf_counter()
            out = comm.all_reduce(x.clone(), "sum", timeout=args.timeout)
            times.append(time.perf_counter() - t0)
        comm.barrier(timeout=args.timeout)
        report.update(
            rank=m.rank,
            hash=hashlib.sha256(out.numpy().tobytes()).hexdigest()[:16],
            times=times,
            bad_messages=comm.bad_messages,
        )
        if coord is not None:
            report["relay"] = coord.relay_stats()
            report["coordinator"] = dict(coord.counters)
    finally:
        comm.close()
        if coord is not None:
            time.sleep(0.5)  # let the others leave first
            coord.stop()
    print(json.dumps(report), flush=True)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m transport.links.nat")
    sub = p.add_subparsers(dest="cmd", required=True)
    w = sub.add_parser("_peer")
    w.add_argument("--coord", required=True)
    w.add_argument("--bind", required=True)
    w.add_argument("--id", required=True)
    w.add_argument("--world", type=int, required=True)
    w.add_argument("--size-mb", type=float, required=True)
    w.add_argument("--repeats", type=int, required=True)
    w.add_argument("--connections", type=int, required=True)
    w.add_argument("--relay", choices=["auto", "always", "off"], required=True)
    w.add_argument("--timeout", type=float, required=True)
    w.add_argument("--run-coordinator", action="store_true")
    return _peer(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
