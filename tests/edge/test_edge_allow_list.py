"""An edge master can admit only its own workers' keys (issue 25: no open group on a network).

Under CURVE alone the master's coordinator admitted any client that had its public key, which
``edge serve`` prints and workers are given, so anyone holding it could register as a device.
``lowband edge serve --curve-authorized KEYS`` (as ``lowband coordinator`` has) admits only the
listed worker keys, and the master's own key, with which the master registers.
"""

from __future__ import annotations

import pytest

from cli import build_parser
from cli.edge import _serve_config
from edge.launch import _coordinator_config
from lowband.errors import AuthError, ConfigError
from transport.auth import CurveKeys, keygen
from transport.coordinator import Coordinator
from transport.zmq_comm import ZmqConfig, connect

pytestmark = [pytest.mark.security, pytest.mark.timeout(120)]

BASE = dict(bind_host="127.0.0.1", connections=1, timeout=10.0, register_timeout=5.0)


def _master(tmp_path, *extra: str):
    (tmp_path / "model").mkdir(exist_ok=True)
    _, secret = keygen(tmp_path, "master")
    argv = ["edge", "serve", str(tmp_path / "model"), "--workers", "1"]
    argv += ["--bind", "tcp://127.0.0.1:0", "--curve-key", str(secret), *extra]
    return _serve_config(build_parser().parse_args(argv), 2), CurveKeys.load(secret)


def _joins(coord: Coordinator, server: bytes, keys: CurveKeys | None, peer_id: str | None = None):
    """Connect as a peer: it must then be a member (``connect`` raises AuthError if refused)."""
    cfg = ZmqConfig(**BASE, curve_server_key=server, curve=keys)
    comm = connect(coord.address, cfg, peer_id=peer_id)
    try:
        assert comm.peer_id in coord.alive, (comm.peer_id, coord.alive)
    finally:
        comm.close()


def test_only_listed_workers_and_the_master_register(tmp_path) -> None:
    workers = tmp_path / "workers"
    workers.mkdir()
    _, w_secret = keygen(workers, "device-1")
    cfg, master = _master(tmp_path, "--curve-authorized", str(workers))
    with Coordinator(_coordinator_config(cfg)) as coord:
        with pytest.raises(AuthError):  # has the master's public key, not a listed key
            _joins(coord, master.public, CurveKeys.generate())
        with pytest.raises(AuthError):  # a fresh keypair, as a worker without --curve-key
            _joins(coord, master.public, None)
        assert coord.alive == ()
        _joins(coord, master.public, CurveKeys.load(w_secret))
        _joins(coord, master.public, master, peer_id="edge-master-0")


def test_without_a_list_anyone_with_the_public_key_registers(tmp_path) -> None:
    """What the list closes (and what docs/security.md says CURVE alone allows)."""
    cfg, master = _master(tmp_path)
    with Coordinator(_coordinator_config(cfg)) as coord:
        _joins(coord, master.public, CurveKeys.generate())


def test_a_list_needs_the_masters_keypair(tmp_path) -> None:
    workers = tmp_path / "w"
    workers.mkdir()
    keygen(workers, "device-1")
    (tmp_path / "model").mkdir()
    argv = ["edge", "serve", str(tmp_path / "model"), "--workers", "1"]
    argv += ["--bind", "tcp://127.0.0.1:0", "--curve-authorized", str(workers)]
    env = {"HOME": str(tmp_path / "home")}  # no default key directory
    with pytest.MonkeyPatch.context() as mp:
        for k, v in env.items():
            mp.setenv(k, v)
        mp.delenv("XDG_CONFIG_HOME", raising=False)
        with pytest.raises(ConfigError, match="curve-key"):
            _serve_config(build_parser().parse_args(argv), 2)
    with pytest.raises(ConfigError, match="no \\*.key files"):
        _master(tmp_path, "--curve-authorized", str(tmp_path / "model"))
