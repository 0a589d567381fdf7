"""End-to-end: the ``lowband coordinator`` and ``lowband keygen`` commands (tier 4)."""

from __future__ import annotations

import os
import signal
import subprocess

import pytest
import torch

from lowband.errors import AuthError
from tests.conftest import PY, run_ranks
from transport.auth import CurveKeys
from transport.launch import connect_all
from transport.zmq_comm import ZmqConfig, connect

pytestmark = pytest.mark.timeout(90)


def test_keygen_writes_a_loadable_keypair(tmp_path):
    out = subprocess.run(
        [PY, "-m", "cli", "keygen", "--out", str(tmp_path), "--name", "site"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    keys = CurveKeys.load(tmp_path / "site.key_secret")
    assert keys.secret is not None and keys.public.decode() in out.stdout
    assert CurveKeys.load(tmp_path / "site.key").public == keys.public
    assert (tmp_path / "site.key_secret").stat().st_mode & 0o077 == 0  # private


def _start(spawn, args):
    proc = spawn(
        [PY, "-m", "cli", "coordinator", "--bind", "tcp://127.0.0.1:0", *args],
        stdout=subprocess.PIPE,
        text=True,
    )
    line = proc.stdout.readline()
    assert "listening on" in line, line
    return proc, line.rsplit(" ", 1)[1].strip()


def test_coordinator_command_with_token_file_serves_a_group(spawn, tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text("cli-secret\n")
    token_file.chmod(0o600)  # a secret file others can read is refused
    proc, address = _start(spawn, ["--token-file", str(token_file), "--heartbeat", "0.5"])
    cfg = ZmqConfig(
        bind_host="127.0.0.1",
        connections=2,
        chunk_bytes=64 * 1024,
        timeout=20.0,
        token="cli-secret",
        register_timeout=10.0,
    )
    comms = connect_all(address, 2, cfg)
    try:
        outs = run_ranks([lambda c=c: c.all_reduce(torch.ones(1000) * (c.rank + 1)) for c in comms])
        assert all(torch.equal(o, torch.full((1000,), 3.0)) for o in outs)
        with pytest.raises(AuthError):
            connect(address, ZmqConfig(bind_host="127.0.0.1", token="nope", register_timeout=10.0))
    finally:
        for c in comms:
            c.close()
    os.killpg(proc.pid, signal.SIGTERM)
    assert proc.wait(timeout=20) == 0


def test_coordinator_command_with_curve_keys(spawn, tmp_path):
    subprocess.run(
        [PY, "-m", "cli", "keygen", "--out", str(tmp_path), "--name", "coord"],
        check=True,
        capture_output=True,
        timeout=60,
    )
    proc, address = _start(spawn, ["--curve-secret", str(tmp_path / "coord.key_secret")])
    server = CurveKeys.load(tmp_path / "coord.key")
    cfg = ZmqConfig(
        bind_host="127.0.0.1",
        connections=1,
        timeout=20.0,
        curve_server_key=server.public,
        register_timeout=10.0,
    )
    comms = connect_all(address, 2, cfg)
    try:
        outs = run_ranks([lambda c=c: c.all_gather(torch.tensor([c.rank])) for c in comms])
        assert all([t.item() for t in o] == [0, 1] for o in outs)
    finally:
        for c in comms:
            c.close()


def test_coordinator_command_rejects_a_public_key_file_as_secret(tmp_path):
    subprocess.run(
        [PY, "-m", "cli", "keygen", "--out", str(tmp_path)],
        check=True,
        capture_output=True,
        timeout=60,
    )
    out = subprocess.run(
        [
            PY,
            "-m",
            "cli",
            "coordinator",
            "--bind",
            "tcp://127.0.0.1:0",
            "--curve-secret",
            str(tmp_path / "lowband.key"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode != 0 and "secret" in out.stderr
