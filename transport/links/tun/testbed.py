"""A packet-level WAN emulator: sites in network namespaces joined through TUN devices.

The other testbeds cannot show a sender's TCP a real round trip: ``tc tbf`` between namespaces
(:mod:`transport.links.netns`) limits the rate with no propagation delay (this kernel has no
``netem``), and the user-space relay (:mod:`transport.links.emulator`) terminates TCP, so the
sender's kernel never sees the RTT, the window or the loss. Here each site is a namespace whose
only way out is a TUN device; a forwarder process in the root namespace
(:mod:`transport.links.tun.forward`) reads every IP packet a site sends and writes it into the
destination site's TUN when the path's model says (:mod:`transport.links.tun.shape`: one-way
delay, jitter, bottleneck rate and queue, random and Gilbert-Elliott loss, reordering, link
down). Kernel TCP (bbr or cubic) in the sites then runs end to end over that path.

Addressing: site ``i`` is 10.<net>.0.<i+1>/24 on its TUN ``<base>t<i>`` (point-to-point, no
ARP): the /24 route sends every other site's address through the TUN. Every ordered pair of
sites is its own path (a full mesh of independent links). With ``host=True`` the root namespace
joins as one more endpoint, index ``sites``, at 10.<net>.0.254 (like ``Testbed.host``: where a
coordinator runs), behind its own TUN and paths.

:class:`TunTestbed` has the shape of :class:`transport.links.netns.Testbed` (a context manager,
``ns``, ``addr(i)``, ``addrs``, ``host``, ``command``) plus ``run_in``/``popen`` and run-time
control (``set_path``, ``down``, ``up``, ``stats``). Requires root, iproute2 and
``/dev/net/tun``; ``python -m transport.links.tun --calibrate --json`` measures it
(:mod:`transport.links.tun.calibrate`).
"""

from __future__ import annotations

import fcntl
import itertools
import json
import os
import shutil
import struct
import subprocess
import sys
import threading
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Mapping, Sequence

from lowband.errors import ConfigError
from transport.links.tun.shape import AccessConfig, PathConfig

_TUNSETIFF = 0x400454CA
_IFF_TUN = 0x0001
_IFF_NO_PI = 0x1000
_instances = itertools.count()


@dataclass(frozen=True, kw_only=True)
class TunConfig:
    sites: int = 2
    """Number of namespaces (each with one TUN)."""
    path: PathConfig = field(default_factory=PathConfig)
    """Every direction of every pair of sites, unless ``paths`` says otherwise."""
    paths: Mapping[tuple[int, int], PathConfig] = field(default_factory=dict)
    """Per direction ``(src, dst)`` overrides of ``path``."""
    access: AccessConfig | None = None
    """Every endpoint's access link (uplink and downlink shared by all its paths); None: every
    direction of every pair is its own bottleneck (:mod:`transport.links.tun.shape`)."""
    mtu: int = 1500
    """The TUN devices' MTU (what a WAN path usually carries)."""
    congestion: str = ""
    """Default TCP congestion control of every site; only those the host allows
    (``net.ipv4.tcp_allowed_congestion_control``); empty: the namespace's default."""
    sysctls: tuple[tuple[str, str], ...] = ()
    """Further settings of every site's network namespace, as ``(name, value)`` pairs of
    namespace-scoped ``net.`` sysctls (e.g. ``("net.ipv4.tcp_wmem", "4096 16384 204800")``)."""
    seed: int | None = None
    """Seed of the loss/jitter/reordering draws; None: fresh each run."""
    net: int = 229
    """Second octet of the 10.<net>.0.0/24 site addresses."""
    name: str = ""
    """Name prefix of namespaces and TUNs (at most 8 alphanumerics); empty: unique per testbed."""
    host: bool = False
    """Also put the root namespace on the emulated network (index ``sites``, 10.<net>.0.254)."""
    spin_us: float = 300.0
    """The forwarder polls without sleeping for the last ``spin_us`` before each packet's due
    time (:mod:`transport.links.tun.timer`): the scheduler's wake-up latency no longer adds to
    the configured delay, at up to ``spin_us`` of CPU per distinct due time. 0: never spin."""
    timer: bool = True
    """Wake the forwarder with a high-resolution timer (``timerfd``); False: millisecond
    ``epoll`` timeouts only (the emulator before sub-millisecond paths, kept to compare)."""

    realtime: bool = False
    """Run the forwarder at real-time priority (``SCHED_FIFO``; root): the host's other load
    then delays its wake-ups less (the ends' own processes keep their priority)."""

    def __post_init__(self) -> None:
        if not 2 <= self.sites <= 200:
            raise ConfigError("sites", f"must be in [2, 200], got {self.sites}")
        if not 1 <= self.net <= 254:
            raise ConfigError("net", f"must be in [1, 254], got {self.net}")
        if not 576 <= self.mtu <= 65535:
            raise ConfigError("mtu", f"must be in [576, 65535], got {self.mtu}")
        if self.name and (len(self.name) > 8 or not self.name.isalnum()):
            raise ConfigError("name", "at most 8 alphanumeric characters")
        for key, _ in self.sysctls:
            if not key.startswith("net.") or not key.replace(".", "").replace("_", "").isalnum():
                raise ConfigError("sysctls", f"{key!r} is not a namespace-scoped net.* setting")
        if not 0.0 <= self.spin_us <= 2000.0:
            raise ConfigError("spin_us", f"must be in [0, 2000] µs, got {self.spin_us}")
        n = self.endpoints
        for s, d in self.paths:
            if not (0 <= s < n and 0 <= d < n and s != d):
                raise ConfigError("paths", f"({s}, {d}) is not a direction between two sites")

    @property
    def endpoints(self) -> int:
        """Sites, plus the root namespace when ``host``."""
        return self.sites + int(self.host)

    def path_of(self, src: int, dst: int) -> PathConfig:
        return self.paths.get((src, dst), self.path)


def available() -> str | None:
    """None if the TUN testbed can be made here, else the reason it cannot."""
    if os.geteuid() != 0:
        return "needs root"
    if shutil.which("ip") is None:
        return "needs iproute2 (ip)"
    if not os.path.exists("/dev/net/tun"):
        return "needs /dev/net/tun"
    return None


def _run(*args: str) -> None:
    proc = subprocess.run(args, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} failed: {proc.stderr.strip()}")


def _open_tun(name: str) -> int:
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_CLOEXEC)
    try:
        fcntl.ioctl(fd, _TUNSETIFF, struct.pack("16sH", name.encode(), _IFF_TUN | _IFF_NO_PI))
    except OSError:
        os.close(fd)
        raise
    return fd


class TunTestbed:
    """Context manager owning the namespaces, the TUN devices and the forwarder process."""

    __test__ = False  # a testbed, not a pytest test class

    def __init__(self, config: TunConfig) -> None:
        self.config = config
        base = config.name or f"lt{os.getpid() % 100000}{next(_instances) % 100}"
        self.ns = [f"{base}s{i}" for i in range(config.sites)]
        self.tuns = [f"{base}t{i}" for i in range(config.sites)]
        self.host_tun = f"{base}th"
        self.host = f"10.{config.net}.0.254" if config.host else None
        """The root namespace's address on the emulated network (``host=True``), else None."""
        self._paths = {
            (s, d): config.path_of(s, d)
            for s in range(config.endpoints)
            for d in range(config.endpoints)
            if s != d
        }
        self._fwd: subprocess.Popen[bytes] | None = None
        self._lock = threading.Lock()
        self._up = False

    def addr(self, i: int) -> str:
        """Site ``i``'s address; ``i == sites`` is the host's (``host=True``)."""
        if i == self.config.sites and self.host is not None:
            return self.host
        return f"10.{self.config.net}.0.{i + 1}"

    @property
    def addrs(self) -> list[str]:
        return [self.addr(i) for i in range(len(self.ns))]

    # ---- setup and teardown ----------------------------------------------------------------
    def __enter__(self) -> "TunTestbed":
        reason = available()
        if reason:
            raise ConfigError("tun", f"TUN testbed unavailable: {reason}")
        fds: list[int] = []
        self._up = True
        try:
            for i, (ns, tun) in enumerate(zip(self.ns, self.tuns)):
                _run("ip", "netns", "add", ns)
                _run("ip", "-n", ns, "link", "set", "lo", "up")
                if self.config.congestion:
                    self._set_congestion(i)
                for key, value in self.config.sysctls:
                    self._sysctl(i, key, value)
                fds.append(_open_tun(tun))
                _run("ip", "link", "set", tun, "netns", ns)
                _run("ip", "-n", ns, "addr", "add", f"{self.addr(i)}/24", "dev", tun)
                _run("ip", "-n", ns, "link", "set", tun, "mtu", str(self.config.mtu), "up")
            if self.host is not None:
                fds.append(_open_tun(self.host_tun))
                _run("ip", "addr", "add", f"{self.host}/24", "dev", self.host_tun)
                _run("ip", "link", "set", self.host_tun, "mtu", str(self.config.mtu), "up")
            self._start_forwarder(fds)
        except BaseException:
            self.__exit__()
            raise
        finally:
            for fd in fds:  # the forwarder holds its own copies; the TUNs live as long as it
                os.close(fd)
        return self

    def _sysctl(self, site: int, key: str, value: str) -> None:
        cmd = ["sysctl", "-q", "-w", f"{key}={value}"]
        proc = self.run_in(site, cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise ConfigError("sysctls", f"{key}={value!r} in site {site}: {proc.stderr.strip()}")

    def _set_congestion(self, site: int) -> None:
        cc = self.config.congestion
        setting = f"net.ipv4.tcp_congestion_control={cc}"
        proc = self.run_in(site, ["sysctl", "-q", "-w", setting], capture_output=True, text=True)
        if proc.returncode != 0:
            # A namespace may only default to what the host lists in
            # net.ipv4.tcp_allowed_congestion_control (cubic is not, here); a root process
            # can still pick any available algorithm for its own socket.
            raise ConfigError(
                "congestion",
                f"{cc!r} cannot be a namespace's default ({proc.stderr.strip()}); it must be in "
                "the host's net.ipv4.tcp_allowed_congestion_control, or set it per socket "
                "(setsockopt TCP_CONGESTION, as the calibration probe's --cc does)",
            )

    def _start_forwarder(self, fds: list[int]) -> None:
        spec = {
            "fds": fds,
            "addrs": [self.addr(i) for i in range(self.config.endpoints)],
            "seed": self.config.seed,
            "paths": {f"{s}->{d}": p.to_dict() for (s, d), p in self._paths.items()},
            "access": None if self.config.access is None else asdict(self.config.access),
            "spin_us": self.config.spin_us,
            "timer": self.config.timer,
            "realtime": self.config.realtime,
        }
        self._fwd = subprocess.Popen(
            [sys.executable, "-m", "transport.links.tun.forward", json.dumps(spec)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            pass_fds=fds,
            start_new_session=True,
        )
        if not self._read_reply().get("ready"):
            raise RuntimeError("TUN forwarder did not start")

    def __exit__(self, *exc: object) -> None:
        if not self._up:
            return
        fwd, self._fwd = self._fwd, None
        if fwd is not None:
            assert fwd.stdin is not None and fwd.stdout is not None
            fwd.stdin.close()  # end of its control input ends it
            try:
                fwd.wait(timeout=5)
            except subprocess.TimeoutExpired:
                fwd.kill()
                fwd.wait()
            fwd.stdout.close()
        for ns in self.ns:  # deleting a namespace deletes the TUN in it
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        if self.host is not None:  # gone with the forwarder's fds already; make sure
            subprocess.run(["ip", "link", "del", self.host_tun], capture_output=True)
        self._up = False

    # ---- running things in the sites -------------------------------------------------------
    def command(self, site: int, args: Sequence[str]) -> list[str]:
        """``args`` to be run inside site ``site``'s namespace (the host: as they are)."""
        if site == self.config.sites and self.host is not None:
            return list(args)
        return ["ip", "netns", "exec", self.ns[site], *args]

    def run_in(self, site: int, args: Sequence[str], **kwargs: Any) -> subprocess.CompletedProcess:
        """:func:`subprocess.run` of ``args`` inside site ``site``."""
        return subprocess.run(self.command(site, args), **kwargs)

    def popen(self, site: int, args: Sequence[str], **kwargs: Any) -> subprocess.Popen:
        """:class:`subprocess.Popen` of ``args`` inside site ``site``."""
        return subprocess.Popen(self.command(site, args), **kwargs)

    # ---- changing the paths during a run ---------------------------------------------------
    def path(self, src: int, dst: int) -> PathConfig:
        return self._paths[(src, dst)]

    def set_path(self, src: int, dst: int, config: PathConfig) -> None:
        """Replace direction ``src → dst``; in force when this returns. Queues and loss state
        carry over (a rate change does not drop what is in flight)."""
        self._paths[(src, dst)] = config
        self._call({"op": "set", "src": src, "dst": dst, "path": config.to_dict()})

    def down(self, pairs: Sequence[tuple[int, int]] | None = None) -> None:
        """Cut the link (both directions of every pair unless ``pairs`` names directions):
        nothing passes, packets in flight included, until :meth:`up`."""
        for s, d in pairs if pairs is not None else list(self._paths):
            self.set_path(s, d, replace(self._paths[(s, d)], down=True))

    def up(self, pairs: Sequence[tuple[int, int]] | None = None) -> None:
        for s, d in pairs if pairs is not None else list(self._paths):
            self.set_path(s, d, replace(self._paths[(s, d)], down=False))

    def stats(self) -> dict[str, Any]:
        """Forwarder counters per direction ``"s->d"``: received, delivered, delivered_bytes,
        lost, queue_drops, down_drops, reordered; and each endpoint's access-link tail drops
        (``access_drops``)."""
        return self._call({"op": "stats"})

    def forwarder_cpu_s(self) -> float:
        """CPU seconds (user + system) the forwarder process has used so far (Linux ``/proc``):
        what the emulator itself costs, spinning included."""
        if self._fwd is None:
            raise RuntimeError("the TUN testbed is not running")
        with open(f"/proc/{self._fwd.pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def _call(self, msg: dict[str, Any]) -> dict[str, Any]:
        with self._lock:
            fwd = self._fwd
            if fwd is None or fwd.stdin is None:
                raise RuntimeError("the TUN testbed is not running")
            fwd.stdin.write((json.dumps(msg) + "\n").encode())
            fwd.stdin.flush()
            reply = self._read_reply()
        if "error" in reply:
            raise RuntimeError(f"TUN forwarder: {reply['error']}")
        return reply

    def _read_reply(self) -> dict[str, Any]:
        assert self._fwd is not None and self._fwd.stdout is not None
        line = self._fwd.stdout.readline()
        if not line:
            raise RuntimeError(f"TUN forwarder exited (code {self._fwd.poll()})")
        reply: dict[str, Any] = json.loads(line)
        return reply
