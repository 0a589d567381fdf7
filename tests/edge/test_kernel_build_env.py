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


def test_missing_python_headers_or_compiler_are_named(tmp_path, monkeypatch):
    bare = tmp_path / "include"
    bare.mkdir()
    why = kernel.missing_build_tools(include_dir=str(bare))
    assert why is not None and "python3-dev" in why and "Python.h" in why
    (bare / "Python.h").write_text("")
    monkeypatch.setenv("PATH", str(tmp_path))  # no compiler anywhere
    why = kernel.missing_build_tools(include_dir=str(bare), cxx="c++")
    assert why is not None and "g++" in why
    cxx = tmp_path / "c++"
    cxx.write_text("#!/bin/sh\n")
    cxx.chmod(0o755)
    assert kernel.missing_build_tools(include_dir=str(bare), cxx="c++") is None


def test_a_machine_without_python_headers_gets_the_fallback_and_the_reason(tmp_path, monkeypatch):
    """No build is attempted (no compiler error dump): the loader says what to install."""
    saved = kernel.get_config()
    monkeypatch.setattr(kernel.sysconfig, "get_paths", lambda: {"include": str(tmp_path)})
    monkeypatch.setattr(kernel, "_built", {})  # as in a process that has loaded no kernel yet
    kernel.configure(build_root=tmp_path / "kernels")  # nothing built there
    try:
        assert kernel.load() is None
        reason = kernel.unavailable_reason()
        assert reason is not None and "python3-dev" in reason
        assert not list((tmp_path / "kernels").rglob("*.o"))  # no compiler ran
    finally:
        monkeypatch.undo()
        kernel.configure(build_root=saved.build_root)


def test_each_checkout_and_environment_builds_in_its_own_directory(tmp_path, monkeypatch):
    """Two checkouts (or venvs) on one machine do not share a build directory: each would
    rewrite the other's build command line and make it rebuild."""
    cfg = kernel.get_config()
    flags = kernel._flags(cfg)
    name, here = kernel._build_dir(cfg, flags)
    assert kernel._build_dir(cfg, flags) == (name, here)  # stable
    monkeypatch.setattr(kernel.sys, "prefix", str(tmp_path / "other-venv"))
    assert kernel._build_dir(cfg, flags)[1] != here
    monkeypatch.undo()
    copy = tmp_path / "csrc"
    shutil.copytree(kernel.CSRC, copy)
    monkeypatch.setattr(kernel, "CSRC", copy)  # the same sources in another checkout
    assert kernel._build_dir(cfg, flags)[1] != here
