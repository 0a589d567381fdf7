"""``lowband keygen`` (issue 25): the secret key is created 0600 from the first byte (O_CREAT |
O_EXCL with the mode, never written 0644 and chmod-ed after) and an existing key is never
overwritten."""

from __future__ import annotations

import os
import subprocess

import pytest

from lowband.errors import ConfigError
from tests.conftest import PY
from transport import auth
from transport.auth import CurveKeys, keygen

pytestmark = [pytest.mark.security, pytest.mark.timeout(60)]


def test_secret_key_is_created_exclusive_with_mode_0600(tmp_path, monkeypatch) -> None:
    calls: list[tuple[str, int, int]] = []
    real_open = os.open

    def spy(path, flags, mode=0o777, *a, **kw):
        calls.append((os.fspath(path), flags, mode))
        return real_open(path, flags, mode, *a, **kw)

    monkeypatch.setattr(auth.os, "open", spy)
    old = os.umask(0)  # the mode must not rely on the umask
    try:
        public, secret = keygen(tmp_path, "site")
    finally:
        os.umask(old)
    opened = {p: (flags, mode) for p, flags, mode in calls}
    flags, mode = opened[str(secret)]
    assert flags & os.O_EXCL and flags & os.O_CREAT and mode == 0o600
    assert secret.stat().st_mode & 0o777 == 0o600
    assert public.stat().st_mode & 0o777 == 0o644
    keys = CurveKeys.load(secret)
    assert keys.secret is not None and CurveKeys.load(public).public == keys.public
    assert CurveKeys.load(public).secret is None


def test_keygen_refuses_to_overwrite_either_file(tmp_path) -> None:
    public, secret = keygen(tmp_path, "k")
    before = secret.read_bytes(), public.read_bytes()
    with pytest.raises(ConfigError, match="refusing to overwrite"):
        keygen(tmp_path, "k")
    assert (secret.read_bytes(), public.read_bytes()) == before
    public.unlink()  # only the secret left: still refused, the secret stays as it was
    with pytest.raises(ConfigError, match="refusing to overwrite"):
        keygen(tmp_path, "k")
    assert secret.read_bytes() == before[0] and not public.exists()


def test_keygen_command_refuses_an_existing_key(tmp_path) -> None:
    cmd = [PY, "-m", "cli", "keygen", "--out", str(tmp_path), "--name", "c"]
    first = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert first.returncode == 0, first.stderr
    secret = (tmp_path / "c.key_secret").read_bytes()
    again = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert again.returncode == 2 and "refusing to overwrite" in again.stderr
    assert (tmp_path / "c.key_secret").read_bytes() == secret
    assert (tmp_path / "c.key_secret").stat().st_mode & 0o777 == 0o600
