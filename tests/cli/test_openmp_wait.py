"""The edge commands set libgomp's wait policy before torch loads it (a server's decode steps run
on the engine's thread, the model was loaded on the main one: without spinning, every parallel
region of a step paid a futex wake-up; 2.4x slower single-stream decode at 2 threads here)."""

from __future__ import annotations

import subprocess
import sys

import cli


def test_edge_gets_the_wait_policy_when_nothing_set_it() -> None:
    assert cli.openmp_wait("edge", {}, torch_loaded=False) == cli.OPENMP_WAIT
    assert cli.OPENMP_WAIT == {"OMP_WAIT_POLICY": "ACTIVE", "GOMP_SPINCOUNT": "2000000"}


def test_the_users_choice_other_commands_and_a_loaded_torch_are_left_alone() -> None:
    assert cli.openmp_wait("edge", {"GOMP_SPINCOUNT": "300000"}, torch_loaded=False) == {}
    assert cli.openmp_wait("edge", {"OMP_WAIT_POLICY": "PASSIVE"}, torch_loaded=False) == {}
    assert cli.openmp_wait("train", {}, torch_loaded=False) == {}
    assert cli.openmp_wait(None, {}, torch_loaded=False) == {}
    assert cli.openmp_wait("edge", {}, torch_loaded=True) == {}  # libgomp already read them


def test_a_fresh_lowband_edge_sets_them_before_torch_loads() -> None:
    """In a fresh interpreter: parsing the command line imports no torch (else the variables
    would come too late), and ``lowband edge ...`` leaves them set for its command and its
    children (the workers an ``edge run`` starts)."""
    script = (
        "import os, sys, cli\n"
        "cli.build_parser()\n"
        "print('torch' in sys.modules)\n"
        "try:\n"
        "    cli.main(['edge', 'serve', '/nonexistent/model.gguf', '--port', '0'])\n"
        "except BaseException:\n"
        "    pass\n"
        "print(os.environ.get('OMP_WAIT_POLICY'), os.environ.get('GOMP_SPINCOUNT'))\n"
    )
    env = {"PATH": "/usr/bin:/bin"}
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env
    )
    lines = out.stdout.split("\n")
    assert lines[0] == "False", out.stdout + out.stderr
    assert "ACTIVE 2000000" in lines, out.stdout + out.stderr
