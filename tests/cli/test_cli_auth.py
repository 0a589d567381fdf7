"""Secure by default on the command line (issue 25): every networked command refuses to listen on
or dial beyond loopback without CURVE unless ``--insecure`` says so, loopback stays zero-config,
secrets need not be on argv, and CURVE is on by default when the key directory holds keys."""

from __future__ import annotations

import os
import subprocess

import pytest
import torch

from cli import build_parser
from cli.auth import resolve_auth
from lowband.errors import ConfigError
from tests.conftest import PY, run_ranks, tiny_llama
from transport.auth import CurveKeys, keygen
from transport.launch import connect_all
from transport.zmq_comm import ZmqConfig

pytestmark = [pytest.mark.security, pytest.mark.timeout(90)]


@pytest.fixture
def env(tmp_path) -> dict[str, str]:
    """A clean environment: an empty key directory, no token."""
    home = tmp_path / "home"
    home.mkdir()
    out = {k: v for k, v in os.environ.items() if k not in ("LOWBAND_TOKEN", "XDG_CONFIG_HOME")}
    out.update(HOME=str(home), XDG_CONFIG_HOME=str(home / ".config"), PYTHONUNBUFFERED="1")
    return out


def _lowband(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [PY, "-m", "cli", *args], capture_output=True, text=True, timeout=60, env=env
    )


# ---- refusals: nothing listens, nothing connects ----------------------------------------------


@pytest.mark.parametrize(
    "argv",
    [
        ["coordinator", "--bind", "tcp://0.0.0.0:0"],
        ["coordinator", "--bind", "tcp://192.0.2.1:29500"],
        ["worker", "--coordinator", "tcp://192.0.2.1:29500", "--preset", "tiny"],
        ["worker", "--coordinator", "tcp://127.0.0.1:1", "--bind-host", "0.0.0.0"],
        ["edge", "worker", "--master", "tcp://192.0.2.1:29500"],
        ["edge", "serve", "MODEL", "--workers", "1"],  # default bind tcp://0.0.0.0:29500
        ["edge", "run", "MODEL", "--bind", "tcp://0.0.0.0:0"],
    ],
)
def test_open_setups_are_refused_with_keygen_advice(argv, env, tmp_path) -> None:
    argv = [str(tmp_path) if a == "MODEL" else a for a in argv]
    out = _lowband(argv, env)
    assert out.returncode == 2, (out.stdout, out.stderr)
    assert "without authentication" in out.stderr and "lowband keygen" in out.stderr
    assert "listening" not in out.stdout


@pytest.mark.parametrize(
    "argv",
    [
        ["coordinator", "--bind", "tcp://0.0.0.0:0"],
        ["worker", "--coordinator", "tcp://192.0.2.1:29500", "--preset", "tiny"],
        ["edge", "worker", "--master", "tcp://192.0.2.1:29500"],
    ],
)
def test_a_plain_token_beyond_loopback_is_refused(argv, env, tmp_path) -> None:
    (tmp_path / "tok").write_text("s3cret\n")
    (tmp_path / "tok").chmod(0o600)
    out = _lowband([*argv, "--token-file", str(tmp_path / "tok")], env)
    assert out.returncode == 2 and "clear text" in out.stderr, out.stderr
    assert "s3cret" not in out.stderr + out.stdout


def test_discovery_without_a_pinned_key_is_refused(env) -> None:
    out = _lowband(["edge", "worker", "--discover", "x", "--discover-timeout", "1"], env)
    assert out.returncode == 2 and "--master-key" in out.stderr, out.stderr


# ---- what runs -------------------------------------------------------------------------------


def _coordinator(spawn, args: list[str], env: dict[str, str]):
    proc = spawn(
        [PY, "-m", "cli", "coordinator", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={k: env[k] for k in ("HOME", "XDG_CONFIG_HOME")},  # spawn adds them to os.environ
    )
    line = proc.stdout.readline()
    assert "listening on" in line, (line, proc.stderr.read() if proc.poll() is not None else "")
    return proc, line.rsplit(" ", 1)[1].strip(), proc.stdout.readline().strip()


def test_insecure_coordinator_warns_and_says_so(spawn, env) -> None:
    proc, address, status = _coordinator(spawn, ["--bind", "tcp://0.0.0.0:0", "--insecure"], env)
    assert status == "auth: none, insecure: true"
    proc.terminate()
    assert proc.wait(timeout=20) == 0
    assert "WARNING" in proc.stderr.read()


def test_loopback_coordinator_stays_zero_config(spawn, env) -> None:
    proc, address, status = _coordinator(spawn, ["--bind", "tcp://127.0.0.1:0"], env)
    assert status == "auth: none" and address.startswith("tcp://127.0.0.1:")
    proc.terminate()
    assert proc.wait(timeout=20) == 0
    assert "WARNING" not in proc.stderr.read()


def test_curve_is_the_default_when_the_key_directory_has_keys(spawn, env) -> None:
    keydir = os.path.join(env["XDG_CONFIG_HOME"], "lowband")
    public, _ = keygen(keydir, "lowband")
    proc, address, status = _coordinator(spawn, ["--bind", "tcp://0.0.0.0:0"], env)
    assert status == "auth: curve"
    key = CurveKeys.load(public).public
    cfg = ZmqConfig(
        bind_host="127.0.0.1",
        connections=1,
        timeout=20.0,
        curve_server_key=key,
        register_timeout=10.0,
    )
    comms = connect_all(address.replace("0.0.0.0", "127.0.0.1"), 2, cfg)
    try:
        outs = run_ranks([lambda c=c: c.all_reduce(torch.ones(4) * (c.rank + 1)) for c in comms])
        assert all(torch.equal(o, torch.full((4,), 3.0)) for o in outs)
    finally:
        for c in comms:
            c.close()
    proc.terminate()
    assert proc.wait(timeout=20) == 0


# ---- resolving credentials (the CLI's only reader of the environment) ------------------------


def _args(argv: list[str]):
    return build_parser().parse_args(argv)


def test_token_from_file_env_and_argv(tmp_path, capsys) -> None:
    (tmp_path / "t").write_text("from-file\n")
    (tmp_path / "t").chmod(0o600)
    coord = ["coordinator", "--bind", "tcp://127.0.0.1:0"]
    a = resolve_auth(
        _args([*coord, "--token-file", str(tmp_path / "t")]), {}, client=False, server=True
    )
    assert (a.token, a.mode) == ("from-file", "token")
    a = resolve_auth(_args(coord), {"LOWBAND_TOKEN": "from-env"}, client=False, server=True)
    assert (a.token, a.mode) == ("from-env", "token")
    assert "WARNING" not in capsys.readouterr().err
    # a token on argv is refused, alone or with a file or the environment, without echoing it
    for extra in ([], ["--token-file", str(tmp_path / "t")]):
        with pytest.raises(ConfigError, match="--token-file FILE, or set LOWBAND_TOKEN") as err:
            resolve_auth(
                _args([*coord, "--token", "on-argv", *extra]),
                {"LOWBAND_TOKEN": "from-env"},
                client=False,
                server=True,
            )
        assert "on-argv" not in str(err.value)


@pytest.mark.parametrize(
    "argv",
    [
        ["coordinator", "--bind", "tcp://127.0.0.1:0"],
        ["worker", "--coordinator", "tcp://127.0.0.1:1", "--preset", "tiny"],
        ["edge", "worker", "--master", "tcp://127.0.0.1:1", "--model-dir", "MODEL"],
        ["edge", "serve", "MODEL", "--workers", "1", "--bind", "tcp://127.0.0.1:0"],
        ["edge", "run", "MODEL", "--devices", "1"],
    ],
)
def test_a_token_on_the_command_line_is_refused(argv, env, tmp_path) -> None:
    """Even on loopback, where no token is needed: a secret on argv is readable by every user
    of the machine (issue 25: secrets from a file or the environment, never argv)."""
    argv = [str(tmp_path) if a == "MODEL" else a for a in argv]
    out = _lowband([*argv, "--token", "argv-s3cret"], env)
    assert out.returncode == 2, (out.stdout, out.stderr)
    assert "--token-file" in out.stderr and "LOWBAND_TOKEN" in out.stderr
    assert "argv-s3cret" not in out.stdout + out.stderr
    assert "listening" not in out.stdout
    helped = _lowband([*argv[: 2 if argv[0] == "edge" else 1], "--help"], env)
    assert helped.returncode == 0 and "--token-file" in helped.stdout
    assert "--token " not in helped.stdout  # not offered


def test_curve_flags_of_a_worker(tmp_path) -> None:
    public, secret = keygen(tmp_path, "coord")
    key = CurveKeys.load(public).public
    w = ["worker", "--coordinator", "tcp://10.0.0.1:29500"]
    for given in (str(public), key.decode()):  # a key file or the 40 characters
        # "=": a Z85 key may begin with "-", which argparse would take for an option
        a = resolve_auth(_args([*w, f"--curve-server-key={given}"]), {}, client=True, server=False)
        assert (a.mode, a.server_key, a.curve) == ("curve", key, None)
    mine, my_secret = keygen(tmp_path, "me")
    a = resolve_auth(
        _args([*w, "--curve-server-key", str(public), "--curve-key", str(my_secret)]),
        {},
        client=True,
        server=False,
    )
    assert a.curve == CurveKeys.load(my_secret)
    with pytest.raises(ConfigError, match="no secret key"):
        resolve_auth(_args([*w, "--curve-key", str(mine)]), {}, client=True, server=False)
    # default key directory on a peer: coordinator.key is the coordinator's public key
    d = tmp_path / "cfg" / "lowband"
    d.mkdir(parents=True)
    (d / "coordinator.key").write_bytes(public.read_bytes())
    a = resolve_auth(
        _args(w), {"XDG_CONFIG_HOME": str(tmp_path / "cfg")}, client=True, server=False
    )
    assert (a.mode, a.server_key) == ("curve", key)


def test_worker_data_socket_follows_the_coordinator() -> None:
    from cli.train import _worker_auth

    args = _args(["worker", "--coordinator", "tcp://127.0.0.1:5"])
    assert _worker_auth(args, [args.coordinator])[1] == "127.0.0.1"
    args = _args(["worker", "--coordinator", "tcp://10.0.0.1:5", "--insecure"])
    assert _worker_auth(args, [args.coordinator])[1] == "0.0.0.0"


def test_edge_run_puts_every_socket_of_the_master_on_loopback(tmp_path) -> None:
    from cli.edge import _serve_config
    from edge.launch import listen_host

    cfg = _serve_config(_args(["edge", "run", str(tmp_path), "--devices", "2"]), 2)
    assert cfg.bind.startswith("tcp://127.0.0.1:")
    assert listen_host(cfg.bind) == "127.0.0.1" == cfg.cluster.link_host
    assert cfg.server.insecure is False and cfg.server.host == "127.0.0.1"


def test_edge_serve_insecure_is_reported(tmp_path) -> None:
    from cli.edge import _serve_config

    argv = ["edge", "serve", str(tmp_path), "--workers", "1", "--insecure"]
    cfg = _serve_config(_args(argv), 2)
    assert cfg.server.insecure is True and cfg.cluster.link_host == "0.0.0.0"
    public, secret = keygen(tmp_path, "m")
    cfg = _serve_config(_args([*argv[:-1], "--curve-key", str(secret)]), 2)
    assert cfg.server.insecure is False and cfg.curve == CurveKeys.load(secret)


def test_health_shows_insecure() -> None:
    import asyncio

    import aiohttp

    from edge.engine import Engine, LocalRunner
    from edge.server import ServerConfig, start
    from lowband.models.llama import LlamaForCausalLM
    from lowband.models.tokenizer import ByteTokenizer

    model = LlamaForCausalLM(tiny_llama(num_hidden_layers=1)).eval()

    async def health(insecure: bool) -> dict:
        engine = Engine(LocalRunner(model), ByteTokenizer(), model_name="t")
        runner, port = await start(
            engine, ServerConfig(host="127.0.0.1", port=0, insecure=insecure)
        )
        try:
            async with aiohttp.ClientSession(f"http://127.0.0.1:{port}") as s:
                return await (await s.get("/health")).json()
        finally:
            await runner.cleanup()

    assert asyncio.run(asyncio.wait_for(health(True), 60))["insecure"] is True
    assert asyncio.run(asyncio.wait_for(health(False), 60))["insecure"] is False
