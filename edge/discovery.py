"""LAN discovery of an edge master: mDNS / DNS-SD (``zeroconf``, the optional ``discover`` extra).

``lowband edge serve --discover`` advertises its coordinator as a ``_lowband-edge._tcp``
service on every non-loopback IPv4 interface; ``lowband edge worker --discover`` browses for it
and joins as if it had been given ``--master tcp://ADDR:PORT``. Discovery only says *where*
the master is: joining still goes through the coordinator's authentication, so a master
started with ``--token`` (or CURVE keys) stays closed to a device that lacks them. The
advertisement carries no secret, only whether one is required (``auth``), the protocol
signature, and the cluster name (``--cluster``), which lets two clusters share a LAN.

Multicast needs nothing special on a flat LAN or a Linux bridge (it floods multicast frames
to every port); it does not cross routers, and some Wi-Fi access points filter it (then give
``--master`` by hand, which always works).
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from dataclasses import dataclass

from lowband.errors import ConfigError

logger = logging.getLogger(__name__)

SERVICE = "_lowband-edge._tcp.local."


@dataclass(frozen=True)
class Found:
    """One advertised master."""

    address: str  # tcp://IP:PORT of its coordinator
    cluster: str
    auth: str  # "token", "curve" or "none"
    signature: str


def _zeroconf():
    try:
        import zeroconf
    except ImportError:
        raise ConfigError(
            "discover",
            "LAN discovery needs the 'discover' extra: "
            "pip install 'lowband[discover]' (or give --master)",
        ) from None
    return zeroconf


def local_ipv4() -> list[str]:
    """This host's non-loopback IPv4 addresses (those a LAN peer could reach)."""
    import ifaddr  # a dependency of zeroconf

    out = []
    for adapter in ifaddr.get_adapters():
        for ip in adapter.ips:
            if isinstance(ip.ip, str) and not ip.ip.startswith("127."):
                out.append(ip.ip)
    return out


class Advertisement:
    """A registered service; ``close()`` (or leaving the ``with``) withdraws it."""

    def __init__(
        self,
        address: str,
        *,
        cluster: str = "lowband",
        auth: str = "none",
        signature: str = "",
        hosts: list[str] | None = None,
    ) -> None:
        zc = _zeroconf()
        if not address.startswith("tcp://"):
            raise ConfigError("address", f"must look like tcp://HOST:PORT, got {address!r}")
        host, port = address[len("tcp://") :].rsplit(":", 1)
        ips = hosts or ([host] if host not in ("0.0.0.0", "*", "") else local_ipv4())
        self.hosts = ips
        if not ips:
            raise ConfigError("discover", "no non-loopback IPv4 address to advertise")
        # One instance per master: the cluster name plus the host name keeps them unique.
        instance = f"{cluster}-{socket.gethostname()}-{port}"[:60]
        self.info = zc.ServiceInfo(
            SERVICE,
            f"{instance}.{SERVICE}",
            port=int(port),
            addresses=[socket.inet_aton(ip) for ip in ips],
            properties={"cluster": cluster, "auth": auth, "sig": signature},
            server=f"{instance}.local.",
        )
        self.zc = zc.Zeroconf(interfaces=zc.InterfaceChoice.All, ip_version=zc.IPVersion.V4Only)
        self.zc.register_service(self.info)
        logger.info("advertising %s on %s as %s", address, ips, instance)

    def close(self) -> None:
        try:
            self.zc.unregister_service(self.info)
        finally:
            self.zc.close()

    def __enter__(self) -> "Advertisement":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _decode(props: dict) -> dict[str, str]:
    return {
        (k.decode() if isinstance(k, bytes) else k): (
            v.decode() if isinstance(v, bytes) else v or ""
        )
        for k, v in props.items()
    }


def _nearest(addrs: list[str]) -> str:
    """The advertised address sharing the longest prefix with one of ours: a master on several
    networks advertises all of them, and the one on our subnet is the one we can reach."""
    ours = [int.from_bytes(socket.inet_aton(a), "big") for a in local_ipv4()]

    def common(a: str) -> int:
        x = int.from_bytes(socket.inet_aton(a), "big")
        return max((32 - (x ^ o).bit_length() for o in ours), default=0)

    v4 = [a for a in addrs if a.count(".") == 3]
    return max(v4, key=common) if v4 else addrs[0]


def discover(*, cluster: str | None = None, timeout: float = 30.0) -> Found:
    """The first master advertised on the LAN (of ``cluster`` when given) within ``timeout``."""
    zc = _zeroconf()
    found: list[Found] = []
    event = threading.Event()
    z = zc.Zeroconf(interfaces=zc.InterfaceChoice.All, ip_version=zc.IPVersion.V4Only)

    def on_change(zeroconf, service_type, name, state_change) -> None:
        if state_change is not zc.ServiceStateChange.Added:
            return
        info = zeroconf.get_service_info(service_type, name, timeout=3000)
        if info is None or not info.parsed_addresses():
            return
        props = _decode(info.properties)
        if cluster is not None and props.get("cluster") != cluster:
            return
        found.append(
            Found(
                address=f"tcp://{_nearest(info.parsed_addresses())}:{info.port}",
                cluster=props.get("cluster", ""),
                auth=props.get("auth", "none"),
                signature=props.get("sig", ""),
            )
        )
        event.set()

    browser = zc.ServiceBrowser(z, SERVICE, handlers=[on_change])
    try:
        t = time.monotonic()
        if not event.wait(timeout):
            what = f"cluster {cluster!r}" if cluster else "any lowband master"
            raise ConfigError(
                "discover",
                f"found no {what} on the LAN within {timeout:.0f}s "
                "(is 'edge serve --discover' running on this network? multicast "
                "may be filtered: give --master tcp://HOST:PORT instead)",
            )
        logger.info("discovered %s in %.2f s", found[0], time.monotonic() - t)
        return found[0]
    finally:
        browser.cancel()
        z.close()
