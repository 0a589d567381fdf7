"""Secure by default (issue 25): the one decision of who may listen where without authentication
(``transport.auth.check_exposure``), unit-tested over every host class x auth mode x flag."""

from __future__ import annotations

import itertools

import pytest

from lowband.errors import ConfigError
from transport.auth import check_exposure, endpoint_host, is_loopback

pytestmark = [pytest.mark.security, pytest.mark.timeout(30)]

LOOPBACK = ["127.0.0.1", "127.8.9.10", "127.255.255.254", "::1", "[::1]", "localhost", "LOCALHOST"]
EXPOSED = ["0.0.0.0", "", "*", "::", "[::]", "10.0.0.5", "192.168.1.2", "8.8.8.8", "fe80::1"]
NAMES = ["master.lan", "example.com", "localhost.evil.com", "127.0.0.1.nip.io"]


@pytest.mark.parametrize("host", LOOPBACK)
def test_loopback_hosts(host: str) -> None:
    assert is_loopback(host)


@pytest.mark.parametrize("host", EXPOSED + NAMES)
def test_wildcards_addresses_and_names_are_not_loopback(host: str) -> None:
    assert not is_loopback(host)


@pytest.mark.parametrize(
    ("host", "auth", "insecure"),
    itertools.product([*LOOPBACK, None], ["none", "token", "curve"], [False, True]),
)
def test_loopback_and_local_endpoints_are_always_allowed(host, auth, insecure) -> None:
    check_exposure(host, auth, insecure)  # zero-config: train, edge run, demo, tests


@pytest.mark.parametrize(("host", "insecure"), itertools.product(EXPOSED + NAMES, [False, True]))
def test_curve_is_allowed_anywhere(host: str, insecure: bool) -> None:
    check_exposure(host, "curve", insecure)


@pytest.mark.parametrize("host", EXPOSED + NAMES)
def test_no_auth_beyond_loopback_is_refused_with_keygen_advice(host: str) -> None:
    with pytest.raises(ConfigError, match="without authentication") as err:
        check_exposure(host, "none", False)
    assert "lowband keygen" in str(err.value) and "--insecure" in str(err.value)


@pytest.mark.parametrize("host", EXPOSED + NAMES)
def test_plain_token_beyond_loopback_is_refused(host: str) -> None:
    with pytest.raises(ConfigError, match="clear text") as err:
        check_exposure(host, "token", False)
    assert "lowband keygen" in str(err.value)


@pytest.mark.parametrize(("host", "auth"), itertools.product(EXPOSED + NAMES, ["none", "token"]))
def test_insecure_allows_the_rest(host: str, auth: str) -> None:
    check_exposure(host, auth, True)


def test_unknown_mode_is_refused() -> None:
    with pytest.raises(ConfigError, match="auth"):
        check_exposure("127.0.0.1", "plain", True)


@pytest.mark.parametrize(
    ("endpoint", "host"),
    [
        ("tcp://0.0.0.0:29500", "0.0.0.0"),
        ("tcp://127.0.0.1:0", "127.0.0.1"),
        ("tcp://[::1]:5", "[::1]"),
        ("tcp://*:5", "*"),
        ("tcp://master.lan:29500", "master.lan"),
        ("ipc:///tmp/x", None),
        ("inproc://x", None),
    ],
)
def test_endpoint_host(endpoint: str, host: str | None) -> None:
    assert endpoint_host(endpoint) == host


def test_endpoint_host_refuses_garbage() -> None:
    with pytest.raises(ConfigError):
        endpoint_host("0.0.0.0:29500")
