"""LAN discovery of an edge master: mDNS / DNS-SD (``zeroconf``, the optional ``discover`` extra).

``lowband edge serve --discover`` advertises its coordinator as a ``_lowband-edge._tcp``
service on every non-loopback IPv4 interface; ``lowband edge worker --discover`` browses for it
and joins as if it had been given ``--master tcp://ADDR:PORT``.

Anyone on the LAN can advertise anything, so an answer is only a hint of *where* a master is.
A worker trusts it only through the master's CURVE public key, pinned with ``--master-key``:
it picks an advertisement carrying that key's fingerprint (:func:`select_master`) and then
connects with the pinned key as the CURVE server key, so an impostor repeating the fingerprint
fails the handshake (it lacks the secret). Without a pinned key, discovery needs
``--insecure``. The advertisement holds the cluster name (two clusters can share a LAN), the
protocol signature and the key's fingerprint (:func:`key_fingerprint`), not the key itself: a
client needs the master's public key to complete a CURVE handshake with it, so the LAN is not
handed it. Nothing about the authentication in force, and never a secret.

Multicast needs nothing special on a flat LAN or a Linux bridge (it floods multicast frames
to every port); it does not cross routers, and some Wi-Fi access points filter it (then give
``--master`` by hand, which always works).
"""

from __future__ import annotations

import hashlib
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
    fingerprint: str | None  # of the master's CURVE public key (key_fingerprint); None: none
    signature: str


def key_fingerprint(key: str) -> str:
    """What an advertisement says of the master's CURVE public key (Z85): the first 16 bytes of
    its SHA-256, in hex. Enough to recognise a pinned key, useless for a handshake."""
    return hashlib.sha256(key.encode()).hexdigest()[:32]


def select_master(
    found: list[Found], *, cluster: str | None, master_key: str | None, insecure: bool
) -> Found | None:
    """The advertisement to join, in arrival order: of ``cluster`` when given, carrying the
    fingerprint of ``master_key`` when pinned. Without a pin only ``insecure`` takes the first
    one; refusing is :func:`discover`'s job, before it listens. The fingerprint is compared, not
    trusted: the CURVE handshake with the pinned key as the server key is what proves the master
    holds its secret."""
    pinned = key_fingerprint(master_key) if master_key is not None else None
    for f in found:
        if cluster is not None and f.cluster != cluster:
            continue
        if pinned is not None:
            if f.fingerprint == pinned:
                return f
        elif insecure:
            return f
    return None


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
        key: str | None = None,
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
            properties={
                "cluster": cluster,
                "sig": signature,
                **({"fp": key_fingerprint(key)} if key is not None else {}),
            },
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


def discover(
    *,
    cluster: str | None = None,
    timeout: float = 30.0,
    master_key: str | None = None,
    insecure: bool = False,
) -> Found:
    """The first master advertised on the LAN (of ``cluster`` when given) within ``timeout``
    that :func:`select_master` accepts: one advertising ``master_key``, or with ``insecure``
    any. Without either, refused before listening: any host on the LAN could pose as the
    master."""
    if master_key is None and not insecure:
        raise ConfigError(
            "discover",
            "any host on the LAN can answer discovery: pin the master with --master-key "
            "(its CURVE public key, printed by 'edge serve' and 'lowband keygen'), give "
            "--master tcp://HOST:PORT, or pass --insecure on a network you trust",
        )
    zc = _zeroconf()
    found: list[Found] = []
    chosen: list[Found] = []
    event = threading.Event()
    z = zc.Zeroconf(interfaces=zc.InterfaceChoice.All, ip_version=zc.IPVersion.V4Only)

    def on_change(zeroconf, service_type, name, state_change) -> None:
        if state_change is not zc.ServiceStateChange.Added:
            return
        info = zeroconf.get_service_info(service_type, name, timeout=3000)
        if info is None or not info.parsed_addresses():
            return
        props = _decode(info.properties)
        found.append(
            Found(
                address=f"tcp://{_nearest(info.parsed_addresses())}:{info.port}",
                cluster=props.get("cluster", ""),
                fingerprint=props.get("fp") or None,
                signature=props.get("sig", ""),
            )
        )
        pick = select_master(found, cluster=cluster, master_key=master_key, insecure=insecure)
        if pick is not None and not chosen:
            chosen.append(pick)
            event.set()

    browser = zc.ServiceBrowser(z, SERVICE, handlers=[on_change])
    try:
        t = time.monotonic()
        if not event.wait(timeout):
            what = f"cluster {cluster!r}" if cluster else "any lowband master"
            if master_key is not None:
                what += f" with key {master_key}"
            raise ConfigError(
                "discover",
                f"found no {what} on the LAN within {timeout:.0f}s "
                "(is 'edge serve --discover' running on this network? multicast "
                "may be filtered: give --master tcp://HOST:PORT instead)",
            )
        logger.info("discovered %s in %.2f s", chosen[0], time.monotonic() - t)
        return chosen[0]
    finally:
        browser.cancel()
        z.close()
