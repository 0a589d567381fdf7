"""mDNS discovery cannot be hijacked by another host of the LAN (issue 25): a worker joins only a
master advertising the pinned CURVE key, discovery without a pin needs ``--insecure``, and the
advertisement tells an attacker nothing about the authentication in force, and not the key a
CURVE client needs (only its fingerprint)."""

from __future__ import annotations

import os

import pytest
import zmq

from edge.discovery import Advertisement, Found, discover, key_fingerprint, select_master
from lowband.errors import ConfigError

pytestmark = [pytest.mark.security, pytest.mark.timeout(120)]

A, B = (zmq.curve_keypair()[0].decode() for _ in range(2))


def _found(port: int, key: str | None, cluster: str = "c") -> Found:
    fp = key_fingerprint(key) if key is not None else None
    return Found(
        address=f"tcp://10.0.0.{port}:{port}", cluster=cluster, fingerprint=fp, signature="s"
    )


def test_select_master_takes_only_the_pinned_key() -> None:
    impostor, real = _found(1, A), _found(2, B)
    assert select_master([impostor, real], cluster="c", master_key=B, insecure=False) == real
    assert select_master([impostor, real], cluster="c", master_key=B, insecure=True) == real
    assert select_master([impostor], cluster="c", master_key=B, insecure=True) is None
    assert select_master([_found(3, None)], cluster="c", master_key=B, insecure=True) is None


def test_select_master_filters_the_cluster_and_needs_insecure_without_a_pin() -> None:
    other, mine = _found(1, B, cluster="other"), _found(2, B)
    assert select_master([other, mine], cluster="c", master_key=B, insecure=False) == mine
    assert select_master([other, mine], cluster="c", master_key=None, insecure=False) is None
    assert select_master([other, mine], cluster="c", master_key=None, insecure=True) == mine
    assert select_master([other, mine], cluster=None, master_key=None, insecure=True) == other


def test_discover_without_a_pin_is_refused_before_listening() -> None:
    with pytest.raises(ConfigError, match="--master-key"):
        discover(cluster="x", timeout=0.1)


def test_two_advertisements_the_worker_joins_the_pinned_one() -> None:
    cluster = f"pin{os.getpid()}"
    with (
        Advertisement("tcp://0.0.0.0:23461", cluster=cluster, key=A, signature="sig") as fake,
        Advertisement("tcp://0.0.0.0:23462", cluster=cluster, key=B, signature="sig"),
    ):
        props = {k.decode(): v for k, v in fake.info.properties.items()}
        fp = key_fingerprint(A).encode()
        assert props == {"cluster": cluster.encode(), "sig": b"sig", "fp": fp}
        # the LAN learns nothing that completes a CURVE handshake with the master: not its key
        assert not any(A.encode() in v or A[:20].encode() in v for v in props.values())
        found = discover(cluster=cluster, timeout=20, master_key=B)
        assert found.address.endswith(":23462") and found.fingerprint == key_fingerprint(B)
        found = discover(cluster=cluster, timeout=20, master_key=A)
        assert found.address.endswith(":23461") and found.fingerprint == fp.decode()
        with pytest.raises(ConfigError, match="found no cluster"):
            discover(cluster=cluster, timeout=3, master_key="x" * 40)
