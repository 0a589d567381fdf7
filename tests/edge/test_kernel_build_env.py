"""The C++ kernels build on a fresh machine: ninja comes with the ``edge`` extra, not the OS."""

from __future__ import annotations

import os
import shutil

import pytest

from edge.quant import kernel


def test_the_ninja_wheel_is_put_on_path_when_the_os_has_none(tmp_path, monkeypatch):
    pytest.importorskip("ninja", reason="the edge extra's ninja wheel (a broken install)")
    monkeypatch.setenv("PATH", str(tmp_path))  # an empty PATH: no system ninja, venv not active
    assert shutil.which("ninja") is None
    kernel._ninja_on_path()
    found = shutil.which("ninja")
    assert found is not None and os.access(found, os.X_OK)
    assert os.environ["PATH"].endswith(str(tmp_path))  # prepended, the rest kept


def test_a_ninja_already_on_path_is_left_first(tmp_path, monkeypatch):
    fake = tmp_path / "ninja"
    fake.write_text("#!/bin/sh\necho 1.11.1\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    kernel._ninja_on_path()
    assert os.environ["PATH"] == str(tmp_path)
