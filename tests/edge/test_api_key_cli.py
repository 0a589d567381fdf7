"""The HTTP API key on the command line (issue 25): ``--api-key-file FILE`` or ``LOWBAND_API_KEY``
on ``lowband edge serve|run``, ``--api-key`` on argv refused since ``ps`` shows it; secret files
(API key and token) that other users may read are refused, and the key is never printed."""

from __future__ import annotations

import json
import os
import signal
import time
import urllib.error
import urllib.request

import pytest

from cli import build_parser
from cli.auth import MAX_SECRET_BYTES, read_secret_file, resolve_api_key, resolve_auth
from lowband.errors import ConfigError
from tests.conftest import PY, tiny_llama

pytestmark = [pytest.mark.security, pytest.mark.timeout(180)]

KEY = "sk-test-0123456789abcdef"


def _args(argv: list[str]):
    return build_parser().parse_args(argv)


def _secret_file(path, text: str, mode: int = 0o600):
    path.write_text(text)
    path.chmod(mode)
    return path


@pytest.mark.parametrize("mode", [0o640, 0o604, 0o644, 0o620, 0o602])
def test_a_secret_file_other_users_can_reach_is_refused(tmp_path, mode) -> None:
    f = _secret_file(tmp_path / "key", KEY, mode)
    with pytest.raises(ConfigError, match="chmod 600") as err:
        read_secret_file(str(f), "api-key-file")
    assert KEY not in str(err.value)


def test_secret_file_bounds(tmp_path) -> None:
    assert read_secret_file(str(_secret_file(tmp_path / "ok", f"  {KEY}\n")), "x") == KEY
    assert read_secret_file(str(_secret_file(tmp_path / "ro", KEY, 0o400)), "x") == KEY
    with pytest.raises(ConfigError, match="empty"):
        read_secret_file(str(_secret_file(tmp_path / "e", " \n")), "x")
    with pytest.raises(ConfigError, match="not a secret"):
        read_secret_file(str(_secret_file(tmp_path / "big", "k" * (MAX_SECRET_BYTES + 1))), "x")
    (tmp_path / "bin").write_bytes(b"\xff\xfe")
    (tmp_path / "bin").chmod(0o600)
    with pytest.raises(ConfigError, match="UTF-8"):
        read_secret_file(str(tmp_path / "bin"), "x")
    with pytest.raises(ConfigError, match="cannot read"):
        read_secret_file(str(tmp_path / "missing"), "x")


def test_a_secret_from_a_pipe_is_read(tmp_path) -> None:
    """``--api-key-file <(pass show key)``: a pipe has no file mode to check."""
    r, w = os.pipe()
    os.write(w, KEY.encode() + b"\n")
    os.close(w)
    try:
        assert read_secret_file(f"/proc/self/fd/{r}", "api-key-file") == KEY
    finally:
        os.close(r)


@pytest.mark.parametrize("command", [["serve", "M"], ["run", "M"]])
def test_api_key_from_file_env_and_argv(tmp_path, capsys, command) -> None:
    argv = ["edge", *[str(tmp_path) if a == "M" else a for a in command]]
    f = _secret_file(tmp_path / "key", KEY + "\n")
    assert resolve_api_key(_args([*argv, "--api-key-file", str(f)]), {}) == KEY
    assert resolve_api_key(_args(argv), {"LOWBAND_API_KEY": KEY}) == KEY
    assert resolve_api_key(_args(argv), {}) is None
    assert capsys.readouterr().err == ""
    # a key on argv is refused (ps shows it), alone or with a file, without echoing it
    for extra in ([], ["--api-key-file", str(f)]):
        with pytest.raises(ConfigError, match="--api-key-file FILE, or set LOWBAND_API_KEY") as e:
            resolve_api_key(_args([*argv, "--api-key", KEY, *extra]), {"LOWBAND_API_KEY": KEY})
        assert KEY not in str(e.value)
    with pytest.raises(ConfigError, match="chmod 600"):
        resolve_api_key(_args([*argv, "--api-key-file", str(f.chmod(0o644) or f)]), {})


def test_the_key_reaches_the_server_config_and_is_not_in_its_repr(tmp_path, monkeypatch) -> None:
    from cli.edge import _serve_config

    monkeypatch.setenv("LOWBAND_API_KEY", KEY)
    cfg = _serve_config(_args(["edge", "run", str(tmp_path), "--devices", "1"]), 1)
    assert cfg.server.api_key == KEY
    assert KEY not in repr(cfg)
    monkeypatch.delenv("LOWBAND_API_KEY")
    cfg = _serve_config(_args(["edge", "run", str(tmp_path), "--devices", "1"]), 1)
    assert cfg.server.api_key is None


def test_a_world_readable_token_file_is_refused(tmp_path) -> None:
    f = _secret_file(tmp_path / "tok", "s3cret\n", 0o644)
    argv = ["coordinator", "--bind", "tcp://127.0.0.1:0", "--token-file", str(f)]
    with pytest.raises(ConfigError, match="chmod 600") as err:
        resolve_auth(_args(argv), {}, client=False, server=True)
    assert "s3cret" not in str(err.value)
    f.chmod(0o600)
    assert resolve_auth(_args(argv), {}, client=False, server=True).token == "s3cret"


def _get(port: int, path: str, key: str | None) -> tuple[int, bytes]:
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}")
    if key is not None:
        req.add_header("Authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(req, timeout=5) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def test_edge_run_with_an_api_key_file_requires_the_key(tmp_path, spawn) -> None:
    """End to end: the served API answers 401 without the key and 200 with it; the key is on no
    command line and in no output."""
    import psutil

    from lowband.models.llama import LlamaForCausalLM, init_weights
    from lowband.models.tokenizer import ByteTokenizer
    from lowband.models.weights import save_pretrained
    from lowband.proc import free_port

    model_dir = tmp_path / "model"
    m = LlamaForCausalLM(tiny_llama(num_hidden_layers=1)).eval()
    init_weights(m, std=0.2, seed=3)
    save_pretrained(m, model_dir)
    ByteTokenizer().save(model_dir)
    keyfile = _secret_file(tmp_path / "api.key", KEY + "\n")
    port = free_port()
    out, err = open(tmp_path / "out", "w+b"), open(tmp_path / "err", "w+b")
    argv = ["edge", "run", str(model_dir), "--devices", "2", "--port", str(port)]
    master = spawn([PY, "-m", "cli", *argv, "--api-key-file", str(keyfile)], stdout=out, stderr=err)
    try:
        deadline = time.monotonic() + 120
        while True:
            assert master.poll() is None, (tmp_path / "err").read_text()
            assert time.monotonic() < deadline, "edge run did not become healthy"
            try:
                status, body = _get(port, "/health", None)
                if status == 200 and json.loads(body).get("healthy"):
                    break
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.3)
        assert _get(port, "/v1/models", None)[0] == 401
        assert _get(port, "/v1/models", "wrong-key")[0] == 401
        status, body = _get(port, "/v1/models", KEY)
        assert status == 200 and json.loads(body)["data"], body
        procs = [psutil.Process(master.pid), *psutil.Process(master.pid).children(recursive=True)]
        assert len(procs) >= 2
        for p in procs:
            assert KEY not in " ".join(p.cmdline())
    finally:
        master.send_signal(signal.SIGTERM)
        assert master.wait(timeout=30) == 0
    printed = (tmp_path / "out").read_text() + (tmp_path / "err").read_text()
    assert "WARNING" not in printed and KEY not in printed, printed
