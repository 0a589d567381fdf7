"""Networks a multi-site run can put its site processes on, from plain loopback to kernel TCP
through the TUN emulator: where the coordinator binds and how each site process is started.

* ``netns`` (root + iproute2): each site in its own network namespace on a bridge, its veth
  shaped by ``tc tbf`` at ``rate_mbit`` in both directions (:class:`transport.links.netns.Testbed`).
  This kernel has no ``netem``: ``delay_ms`` is added by a user-space relay
  (:class:`transport.links.emulator.LinkEmulator`, rate unlimited) in front of each site's data
  port and of the coordinator.
* ``emulator`` (no root needed): every site binds on 127.0.0.1 behind its own user-space relay
  of ``rate_mbit`` and ``delay_ms``; everything a site receives crosses its relay.
* ``tun`` (root + iproute2 + ``/dev/net/tun``): each site in its own namespace whose only way out
  is a TUN device; a forwarder applies ``delay_ms`` one way and ``rate_mbit`` per packet
  (:class:`transport.links.tun.TunTestbed`), so kernel TCP end to end sees the round trip.
* ``none``: plain loopback TCP, unshaped (a control run).

``auto`` picks ``netns`` when it can and ``emulator`` otherwise. The sites are told to switch
off the transport's same-host shortcuts (shared memory, Unix sockets): they would bypass the link.
"""

from __future__ import annotations

import contextlib
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from lowband.errors import ConfigError
from lowband.proc import free_port

LinkKind = Literal["auto", "netns", "emulator", "tun", "none"]
LINKS = ("auto", "netns", "emulator", "tun", "none")
DATA_PORT = 29700  # a site's data port inside its own namespace (nothing else listens there)
UNLIMITED_MBIT = 100_000.0  # the delay relay's rate in netns mode: tbf does the shaping


def resolve_link(kind: str) -> Literal["netns", "emulator", "tun", "none"]:
    """``auto`` → ``netns`` when namespaces can be made here, else ``emulator``. Asking for
    ``netns`` or ``tun`` where it cannot work is a ConfigError (before anything starts)."""
    from transport.links.netns import available
    from transport.links.tun.testbed import available as tun_available

    if kind == "auto":
        return "netns" if available() is None else "emulator"
    if kind == "netns" and (reason := available()) is not None:
        raise ConfigError("link", f"netns {reason}; use --link emulator")
    if kind == "tun" and (reason := tun_available()) is not None:
        raise ConfigError("link", f"tun {reason}; use --link emulator")
    if kind not in LINKS:
        raise ConfigError("link", f"one of {', '.join(LINKS)}, got {kind!r}")
    return kind  # type: ignore[return-value]  # checked against LINKS just above


@dataclass(frozen=True, kw_only=True)
class Site:
    """How to start site ``i`` of one run: a command prefix and the worker flags."""

    prefix: tuple[str, ...]  # e.g. ("ip", "netns", "exec", NS)
    coordinator: str  # the address this site dials
    flags: tuple[str, ...]  # --bind-host / --data-port / --advertise-* / --same-host


class Network(Protocol):
    kind: str

    def coordinator_bind(self) -> str: ...

    def sites(self, coordinator_port: int) -> contextlib.AbstractContextManager[list[Site]]:
        """Per run: the sites' launch plans; relays started here are stopped on exit."""
        ...

    def description(self) -> str: ...


class LoopbackNetwork:
    """``emulator`` (a relay per site and one for the coordinator) or ``none`` (plain TCP)."""

    def __init__(self, n: int, rate_mbit: float, delay_ms: float, *, shaped: bool) -> None:
        self.n, self.rate, self.delay, self.shaped = n, rate_mbit, delay_ms, shaped
        self.kind = "emulator" if shaped else "none"

    def coordinator_bind(self) -> str:
        return "tcp://127.0.0.1:0"

    def description(self) -> str:
        if not self.shaped:
            return "none: plain TCP on 127.0.0.1, unshaped"
        return (
            f"emulator: each site receives through its own user-space relay "
            f"(transport.links.emulator) of {self.rate:g} Mbit/s and {self.delay:g} ms one-way "
            "delay; the coordinator sits behind a relay with the same delay"
        )

    @contextlib.contextmanager
    def sites(self, coordinator_port: int) -> Iterator[list[Site]]:
        host = "127.0.0.1"
        if not self.shaped:
            yield [
                Site(
                    prefix=(),
                    coordinator=f"tcp://{host}:{coordinator_port}",
                    flags=("--bind-host", host, "--same-host", "off"),
                )
                for _ in range(self.n)
            ]
            return
        from transport.links.emulator import LinkConfig, LinkEmulator

        link = LinkConfig(rate_mbit=self.rate, delay_ms=self.delay)
        relays: list[LinkEmulator] = []
        try:
            coord = LinkEmulator((host, coordinator_port), link, listen_host=host).start()
            relays.append(coord)
            plans = []
            for _ in range(self.n):
                # The port is free now; the site binds it a few seconds later. Another process
                # taking it in between makes the site fail loudly at bind, not silently.
                port = free_port(host)
                relays.append(LinkEmulator((host, port), link, listen_host=host).start())
                plans.append(
                    Site(
                        prefix=(),
                        coordinator=coord.endpoint,
                        flags=(
                            "--bind-host",
                            host,
                            "--data-port",
                            str(port),
                            "--advertise-host",
                            host,
                            "--advertise-port",
                            str(relays[-1].port),
                            "--same-host",
                            "off",
                        ),
                    )
                )
            yield plans
        finally:
            for r in relays:
                r.stop()


class NetnsNetwork:
    """Sites in namespaces on a bridge (:class:`transport.links.netns.Testbed`, tbf on both veth
    ends); ``delay_ms`` added by relays in this (the root) namespace, on the bridge."""

    kind = "netns"

    def __init__(self, bed: Any, rate_mbit: float, delay_ms: float) -> None:
        self.bed, self.rate, self.delay = bed, rate_mbit, delay_ms

    def coordinator_bind(self) -> str:
        return f"tcp://{self.bed.host}:0"

    def description(self) -> str:
        text = (
            f"netns: each site in its own network namespace, veth shaped by tc tbf at "
            f"{self.rate:g} Mbit/s both directions (kernel TCP)"
        )
        if self.delay:
            text += (
                f"; {self.delay:g} ms one-way delay added by user-space relays "
                "(no netem in this kernel)"
            )
        return text

    @contextlib.contextmanager
    def sites(self, coordinator_port: int) -> Iterator[list[Site]]:
        bed, host = self.bed, self.bed.host
        prefixes = [("ip", "netns", "exec", ns) for ns in bed.ns]
        if not self.delay:
            yield [
                Site(
                    prefix=prefixes[i],
                    coordinator=f"tcp://{host}:{coordinator_port}",
                    # --insecure: the testbed's namespaces and bridge exist only on this host
                    flags=("--bind-host", bed.addr(i), "--same-host", "off", "--insecure"),
                )
                for i in range(len(bed.ns))
            ]
            return
        from transport.links.emulator import LinkConfig, LinkEmulator

        link = LinkConfig(rate_mbit=UNLIMITED_MBIT, delay_ms=self.delay)
        relays: list[LinkEmulator] = []
        try:
            coord = LinkEmulator((host, coordinator_port), link, listen_host=host).start()
            relays.append(coord)
            plans = []
            for i in range(len(bed.ns)):
                # Peers dial the relay on the bridge; it forwards into site i's namespace, so
                # the bytes still cross the sender's and site i's shaped veths.
                relays.append(
                    LinkEmulator((bed.addr(i), DATA_PORT), link, listen_host=host).start()
                )
                plans.append(
                    Site(
                        prefix=prefixes[i],
                        coordinator=coord.endpoint,
                        flags=(
                            "--bind-host",
                            bed.addr(i),
                            "--data-port",
                            str(DATA_PORT),
                            "--advertise-host",
                            host,
                            "--advertise-port",
                            str(relays[-1].port),
                            "--same-host",
                            "off",
                            "--insecure",  # the testbed exists only on this host
                        ),
                    )
                )
            yield plans
        finally:
            for r in relays:
                r.stop()


class TunNetwork:
    """Sites in namespaces joined through TUN devices (:class:`transport.links.tun.TunTestbed`):
    every packet between two endpoints waits ``delay_ms`` and queues behind ``rate_mbit`` in
    the forwarder, so no relay is needed for the delay and kernel TCP sees the real RTT."""

    kind = "tun"

    def __init__(self, bed: Any, rate_mbit: float, delay_ms: float) -> None:
        self.bed, self.rate, self.delay = bed, rate_mbit, delay_ms

    def coordinator_bind(self) -> str:
        return f"tcp://{self.bed.host}:0"

    def description(self) -> str:
        return (
            f"tun: each site in its own network namespace behind a TUN device; every packet "
            f"between two endpoints is delayed {self.delay:g} ms one way and paced at "
            f"{self.rate:g} Mbit/s per direction by a user-space forwarder (kernel TCP end to "
            "end sees the round trip)"
        )

    @contextlib.contextmanager
    def sites(self, coordinator_port: int) -> Iterator[list[Site]]:
        bed = self.bed
        yield [
            Site(
                prefix=("ip", "netns", "exec", ns),
                coordinator=f"tcp://{bed.host}:{coordinator_port}",
                # --insecure: the emulated network exists only inside this host
                flags=("--bind-host", bed.addr(i), "--same-host", "off", "--insecure"),
            )
            for i, ns in enumerate(bed.ns)
        ]


def free_net() -> int:
    """A 10.<net>.0.0/24 no interface of this namespace uses (two demos can run at once)."""
    used = subprocess.run(
        ["ip", "-o", "-4", "addr"], capture_output=True, text=True, check=False
    ).stdout
    for net in range(190, 250):
        if f" 10.{net}." not in used:
            return net
    raise ConfigError("net", "no free 10.x.0.0/24 subnet between 10.190 and 10.249")


@contextlib.contextmanager
def open_network(
    kind: str, *, sites: int, rate_mbit: float, delay_ms: float, net: int = 0
) -> Iterator[Network]:
    """The network ``sites`` site processes run on (``kind`` as :func:`resolve_link` gives);
    namespaces, TUN devices and relays made here are gone when the block exits."""
    if kind == "netns":
        from transport.links.netns import NetnsConfig, Testbed

        with Testbed(
            NetnsConfig(sites=sites, rate_mbit=rate_mbit, net=net or free_net(), queue_ms=100.0)
        ) as bed:
            yield NetnsNetwork(bed, rate_mbit, delay_ms)
    elif kind == "tun":
        from transport.links.tun.shape import PathConfig
        from transport.links.tun.testbed import TunConfig, TunTestbed

        path = PathConfig(delay_ms=delay_ms, rate_mbit=rate_mbit)
        with TunTestbed(TunConfig(sites=sites, path=path, net=net or free_net(), host=True)) as tun:
            yield TunNetwork(tun, rate_mbit, delay_ms)
    else:
        yield LoopbackNetwork(sites, rate_mbit, delay_ms, shaped=kind == "emulator")
