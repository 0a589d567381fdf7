"""The library's own defaults listen on loopback (issue 25): a program that builds a config
without naming an interface exposes nothing beyond this machine. The command line names its
interfaces itself (and checks them with ``check_exposure``): see tests/cli/test_cli_auth.py."""

from __future__ import annotations

import ipaddress

import psutil
import pytest

from transport.auth import endpoint_host, is_loopback

pytestmark = [pytest.mark.security, pytest.mark.timeout(90)]


def _default_transport(cls: type) -> object:
    """The transport a launch config gets when none is given (its ``transport`` field)."""
    return cls.__dataclass_fields__["transport"].default_factory()


def test_every_config_default_is_loopback() -> None:
    from diloco.launch import WorkerLaunch
    from diloco.site_launch import SiteLaunch
    from edge.cluster.master import ClusterConfig
    from edge.launch import ServeMasterConfig, ServeWorkerConfig
    from transport.config import ZmqConfig
    from transport.coordinator import CoordinatorConfig

    hosts = {
        "ZmqConfig.bind_host": ZmqConfig().bind_host,
        "CoordinatorConfig.bind": endpoint_host(CoordinatorConfig().bind),
        "ClusterConfig.link_host": ClusterConfig(devices=2).link_host,
        "ServeMasterConfig.bind": endpoint_host(
            ServeMasterConfig.__dataclass_fields__["bind"].default
        ),
        "ServeWorkerConfig.bind_host": _default_transport(ServeWorkerConfig).bind_host,
        "WorkerLaunch.bind_host": _default_transport(WorkerLaunch).bind_host,
        "SiteLaunch.bind_host": _default_transport(SiteLaunch).bind_host,
    }
    exposed = {k: v for k, v in hosts.items() if v is None or not is_loopback(v)}
    assert not exposed, exposed


def _listening(pid: int) -> set[tuple[str, int]]:
    return {
        (c.laddr.ip, c.laddr.port)
        for c in psutil.Process(pid).net_connections(kind="inet")
        if c.status == psutil.CONN_LISTEN
    }


def test_a_peer_with_the_default_config_listens_only_on_loopback() -> None:
    """``connect(address)`` with no config: its data socket is on 127.0.0.1, not every
    interface (before: ``0.0.0.0``)."""
    import os

    from transport.coordinator import Coordinator, CoordinatorConfig
    from transport.zmq_comm import connect

    before = _listening(os.getpid())
    with Coordinator(CoordinatorConfig(bind="tcp://127.0.0.1:0")) as coord:
        comm = connect(coord.address)
        try:
            opened = _listening(os.getpid()) - before
            assert opened, "no listening socket found"
            wide = [x for x in opened if not ipaddress.ip_address(x[0]).is_loopback]
            assert not wide, f"listening beyond loopback: {wide}"
        finally:
            comm.close()
