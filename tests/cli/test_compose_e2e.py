"""The docker-compose demo for real: ``scripts/compose_demo.sh`` installs/starts an engine when
there is none, builds the image, runs three shaped sites (DiLoCo, then DDP) and the report,
checks it and tears everything down. Slow the first time on a machine (Debian packages, a
debootstrap base, the wheels: cached in ~/.cache/lowband/compose; the image build), a few
minutes after that.

No ``--rmi``: the engine keeps lowband:latest and its layers between runs. That still tests the
tree as it is: Docker keys each layer on its instruction and the files it copies, so an edited
pyproject.toml/constraints.txt reinstalls the dependencies and edited code reinstalls the
package; only unchanged layers are reused. Where the engine has no cache (a fresh machine, after
``docker system prune``) the same test is the from-scratch build, and it prints how many build
steps came from the cache."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import uuid
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "compose_demo.sh"
TIMEOUT_S = 1500  # a fresh machine: apt, debootstrap, the build, the run


def dockerds() -> set[int]:
    out = subprocess.run(
        ["ps", "-eo", "pid=,comm="], capture_output=True, text=True, timeout=30
    ).stdout
    return {
        int(pid)
        for pid, comm in (line.split(None, 1) for line in out.splitlines())
        if comm.strip() == "dockerd"
    }


def engine_answers() -> bool:
    docker = shutil.which("docker")
    return (
        docker is not None
        and subprocess.run([docker, "info"], capture_output=True, timeout=60).returncode == 0
    )


def debian_packages_available() -> bool:
    if shutil.which("dockerd") and shutil.which("docker-compose"):
        return True
    if shutil.which("apt-cache") is None:
        return False
    out = subprocess.run(
        ["apt-cache", "policy", "docker.io", "docker-compose"],
        capture_output=True,
        text=True,
        timeout=60,
    ).stdout
    return out.count("Candidate:") == 2 and "Candidate: (none)" not in out


def forward_policy() -> str:
    """The host's iptables FORWARD policy (dockerd sets DROP and leaves it so when it stops).

    A machine without the iptables command (a fresh one, before the script installs docker.io,
    which brings it) has no rules set through it: its FORWARD chain keeps the kernel's default
    policy, ACCEPT, which is what ``iptables -S`` reads once the command is installed."""
    if shutil.which("iptables") is None:
        return "ACCEPT"
    out = subprocess.run(
        ["iptables", "-S", "FORWARD"], capture_output=True, text=True, timeout=60
    ).stdout
    return next((l.split()[2] for l in out.splitlines() if l.startswith("-P ")), "ACCEPT")


@pytest.mark.slow
@pytest.mark.timeout(TIMEOUT_S + 180)
def test_compose_demo_runs_checks_and_tears_down(tmp_path):
    if not engine_answers():
        if os.geteuid() != 0:
            pytest.skip("needs root (no Docker engine answers; installing/starting one needs root)")
        if not debian_packages_available():
            pytest.skip("Debian packages unavailable (docker.io, docker-compose)")
    before = dockerds()
    policy = forward_policy()
    project = f"lbtest{uuid.uuid4().hex[:8]}"
    out = tmp_path / "runs"
    # Tiny: 60 steps per run; the image stays cached for the next run (module docstring)
    proc = subprocess.Popen(
        [
            "bash",
            str(SCRIPT),
            "--steps",
            "60",
            "--out",
            str(out),
            "--project",
            project,
            "--timeout",
            "900",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    leftover: set[int] = set()
    try:
        log, _ = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGTERM)  # the script's trap tears down
        try:
            log, _ = proc.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            log, _ = proc.communicate()
        pytest.fail(
            f"compose_demo.sh did not finish in {TIMEOUT_S} s; its log ends:\n{log[-6000:]}"
        )
    finally:
        # whatever happened, no dockerd of this test's making is left running (by pid)
        leftover = dockerds() - before
        for pid in leftover:
            subprocess.run(["kill", "-TERM", str(pid)], timeout=30)
    assert proc.returncode == 0, log[-6000:]
    assert not leftover, f"the script left dockerd {leftover} running"
    if not before:  # it started its own dockerd: the host's firewall is as it found it
        assert forward_policy() == policy

    # its result line, followed only by teardown messages
    (line,) = [l for l in log.splitlines() if l.startswith("compose_demo: {")] or [None]
    assert line is not None, log[-3000:]
    result = json.loads(line.removeprefix("compose_demo: "))
    cached = sum(" CACHED" in l for l in log.splitlines())  # BuildKit's plain progress
    print(
        f"compose e2e ({cached} cached build steps): "
        f"build {result['build_s']} s, run {result['run_s']} s"
    )
    report = result["report"]
    ddp, diloco = report["runs"]["DDP"], report["runs"]["Streaming DiLoCo"]
    for run in (ddp, diloco):
        assert run["workers"] == 3 and run["steps"] == 60 and run["consistent"]
        assert run["steps_per_s"] > 0 and run["final_eval"] > 0
    assert report["bytes_ratio"] > 10  # DDP ships every gradient, DiLoCo a fragment per H steps
    assert (out / "report.json").exists() and (out / "eval_vs_bytes.png").stat().st_size > 0
    assert sorted(p.name for p in (out / "diloco").glob("metrics-*.jsonl")) == [
        f"metrics-workersite-{i}.jsonl" for i in (1, 2, 3)
    ]

    # torn down: a pre-existing engine has none of its containers left
    if before:
        left = subprocess.run(
            ["docker", "ps", "-aq", "--filter", f"label=com.docker.compose.project={project}"],
            capture_output=True,
            text=True,
            timeout=60,
        ).stdout.split()
        assert left == [], f"containers left behind: {left}"
    assert not list((REPO / "docker" / "wheels").glob("*.whl")), "wheels left in the context"
