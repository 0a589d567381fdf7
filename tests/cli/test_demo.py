"""``lowband demo``: validation before anything starts, and real runs through the CLI (user-space
link emulator; tbf-shaped network namespaces when root), including cleanup after Ctrl-C."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from diloco.config import DDPConfig, DilocoConfig
from diloco.demo_launch import DemoConfig, demo_train_config, summary_table
from lowband.errors import ConfigError
from tests.conftest import PY
from transport.links.sites import resolve_link

# A small run: 2 sites, 24 steps of 4 x 32 tokens, two fragments, evals at 12 and 24.
TINY = [
    "--sites",
    "2",
    "--steps",
    "24",
    "-H",
    "8",
    "-P",
    "2",
    "--tau",
    "1",
    "--eval-every",
    "12",
    "--batch-size",
    "4",
    "--seq-len",
    "32",
    "--warmup-steps",
    "4",
    "--rate-mbit",
    "50",
    "--delay-ms",
    "10",
]


def _netns_reason() -> str | None:
    from transport.links.netns import available

    return available()


# ---- validation (pure) -----------------------------------------------------------------------
@pytest.mark.parametrize(
    "field,kwargs",
    [
        ("sites", {"sites": 1}),
        ("rate_mbit", {"rate_mbit": 0.0}),
        ("rate_mbit", {"rate_mbit": -5.0}),
        ("delay_ms", {"delay_ms": -1.0}),
        ("link", {"link": "wifi"}),
        ("threads", {"threads": 0}),
    ],
)
def test_config_errors_name_the_field(tmp_path, field, kwargs):
    sites = kwargs.get("sites", 3)
    with pytest.raises(ConfigError) as err:
        DemoConfig(train=demo_train_config(max(sites, 1)), out_dir=tmp_path, **kwargs)
    assert err.value.field == field


def test_config_refuses_ddp_mode_and_mismatched_workers(tmp_path):
    from diloco.config import with_overrides

    with pytest.raises(ConfigError) as err:
        DemoConfig(train=with_overrides(demo_train_config(3), mode="ddp"), out_dir=tmp_path)
    assert err.value.field == "mode"
    with pytest.raises(ConfigError) as err:
        DemoConfig(train=demo_train_config(2), sites=3, out_dir=tmp_path)
    assert err.value.field == "sites"


def test_ddp_baseline_has_the_same_budget(tmp_path):
    cfg = DemoConfig(train=demo_train_config(3), out_dir=tmp_path, ddp_inner_lr=1e-3)
    ddp = cfg.ddp_train()
    assert isinstance(cfg.train.mode, DilocoConfig) and isinstance(ddp.mode, DDPConfig)
    assert ddp.mode.codec == "fp32"
    for name in ("model", "data", "steps", "workers", "seed", "lr_schedule"):
        assert getattr(ddp, name) == getattr(cfg.train, name), name
    assert ddp.inner.lr == 1e-3 and cfg.train.inner.lr != 1e-3


def test_link_resolution(monkeypatch):
    import transport.links.netns

    monkeypatch.setattr(transport.links.netns, "available", lambda: "needs root")
    assert resolve_link("auto") == "emulator"
    with pytest.raises(ConfigError) as err:
        resolve_link("netns")
    assert err.value.field == "link" and "needs root" in str(err.value)
    monkeypatch.setattr(transport.links.netns, "available", lambda: None)
    assert resolve_link("auto") == "netns"
    assert resolve_link("none") == "none"


def test_cli_rejects_bad_input_before_starting(tmp_path, capsys):
    from cli import main

    for args, field in (
        (["--sites", "1"], "sites"),
        (["--rate-mbit", "0"], "rate_mbit"),
        (["--delay-ms", "-3"], "delay_ms"),
        (["--mode", "ddp"], "mode"),
    ):
        out = tmp_path / field
        assert main(["demo", "--out", str(out), "--quiet", *args]) == 2
        assert f"{field}:" in capsys.readouterr().err
        assert not out.exists()  # nothing was started or written
    # a corpus that does not exist: refused before any network or process is set up
    out = tmp_path / "nodata"
    assert (
        main(
            [
                "demo",
                "--out",
                str(out),
                "--quiet",
                "--link",
                "none",
                "--data",
                str(tmp_path / "missing.txt"),
            ]
        )
        == 2
    )
    assert "missing.txt" in capsys.readouterr().err
    assert not out.exists()


def test_summary_table_lists_both_runs():
    run = {
        "final_eval": 3.0,
        "bytes_per_worker": 2**20,
        "wall_s": 2.0,
        "steps_per_s": 5.0,
        "sync_s": 1.0,
    }
    text = summary_table(
        {
            "ddp": dict(run, bytes_per_worker=100 * 2**20),
            "diloco": run,
            "initial_eval": 5.5,
            "bytes_ratio": 100.0,
            "speedup": 1.0,
            "loss_gap": 0.0,
            "link": {"description": "none: plain TCP"},
        }
    )
    assert "DDP" in text and "Streaming DiLoCo" in text and "100.0x" in text
    assert "100.000" in text and "1.000" in text and "none: plain TCP" in text


# ---- real runs through the CLI -----------------------------------------------------------------
def _check_summary(out: Path, link: str) -> dict:
    s = json.loads((out / "summary.json").read_text())
    assert s["link"]["kind"] == link and s["sites"] == 2
    initial = s["initial_eval"]
    assert 5.0 < initial < 6.0  # ≈ ln 256 for an untrained byte model
    for key in ("diloco", "ddp"):
        r = s[key]
        assert r["sites_finished"] == 2 and r["consistent"], r
        assert math.isfinite(r["final_eval"]) and r["final_eval"] < initial - 0.5, r
        assert r["steps"] == 24 and r["steps_per_s"] > 0 and r["bytes_per_worker"] > 0
        # the step-0 evaluation (the model before training, little sent yet) starts the curve
        assert [c[0] for c in r["curve"]] == [0, 12, 24]
        assert r["curve"][0][2] < r["curve"][1][2] and r["curve"][0][1] > r["curve"][-1][1]
    assert s["diloco"]["fragment_wait_s"] >= 0 and s["ddp"]["fragment_wait_s"] is None
    assert s["diloco"]["bytes_per_worker"] < s["ddp"]["bytes_per_worker"]
    # DDP sends fp32 gradients every step; DiLoCo NF4 fragments every H/P steps
    assert s["bytes_ratio"] > 10
    assert (out / "eval_vs_bytes.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    return s


def _run_demo(spawn, out: Path, link: str, *extra: str, timeout: float = 150) -> tuple[str, int]:
    """Run the tiny demo over ``link``; its output (asserting exit 0) and its pid."""
    p = spawn(
        [
            PY,
            "-m",
            "cli",
            "demo",
            *TINY,
            "--link",
            link,
            *extra,
            "--out",
            str(out),
            "--quiet",
            "--json",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    stdout, _ = p.communicate(timeout=timeout)
    assert p.returncode == 0, stdout[-3000:]
    return stdout, p.pid


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_demo_runs_with_the_emulator(spawn, tmp_path):
    stdout, _ = _run_demo(spawn, tmp_path / "out", "emulator")
    s = _check_summary(tmp_path / "out", "emulator")
    assert "Streaming DiLoCo" in stdout and json.loads(stdout.strip().splitlines()[-1]) == s
    assert "10 ms one-way" in s["link"]["description"]


@pytest.mark.slow
@pytest.mark.netns
@pytest.mark.timeout(180)
@pytest.mark.skipif(_netns_reason() is not None, reason=f"netns: {_netns_reason()}")
def test_demo_runs_in_shaped_namespaces(spawn, tmp_path):
    _, pid = _run_demo(spawn, tmp_path / "out", "netns")
    s = _check_summary(tmp_path / "out", "netns")
    assert "tc tbf at 50 Mbit/s" in s["link"]["description"]
    assert _namespaces(pid) == []


def _tun_reason() -> str | None:
    from transport.links.tun.testbed import available

    return available()


@pytest.mark.slow
@pytest.mark.netns
@pytest.mark.timeout(240)
@pytest.mark.skipif(_tun_reason() is not None, reason=f"tun: {_tun_reason()}")
def test_demo_runs_over_the_tun_emulator(spawn, tmp_path):
    extra = ("--delay-ms", "10", "--rate-mbit", "20")
    _, pid = _run_demo(spawn, tmp_path / "out", "tun", *extra, timeout=210)
    s = _check_summary(tmp_path / "out", "tun")
    assert "delayed 10 ms one way and paced at 20 Mbit/s" in s["link"]["description"]
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not [n for n in names.split() if n.startswith(f"lt{pid % 100000}")]


def _namespaces(pid: int) -> list[str]:
    names = subprocess.run(
        ["ip", "netns", "list"], capture_output=True, text=True, check=False
    ).stdout
    return [line.split()[0] for line in names.splitlines() if line.startswith(f"lb{pid % 100000}n")]


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False
    return "State:\tZ" not in state


def _ctrl_c_reaches_child() -> None:
    # A shell starts background jobs with SIGINT ignored and children inherit that; the demo
    # must see the Ctrl-C this test sends however the suite itself was started.
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_ctrl_c_leaves_no_site_or_namespace_behind(spawn, tmp_path):
    link = "netns" if _netns_reason() is None else "emulator"
    out = tmp_path / "out"
    p = spawn(
        [
            PY,
            "-m",
            "cli",
            "demo",
            *TINY,
            "--steps",
            "4000",
            "--link",
            link,
            "--out",
            str(out),
            "--quiet",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        preexec_fn=_ctrl_c_reaches_child,
        env={"PYTHONFAULTHANDLER": "1"},
    )
    sites = out / "diloco" / "sites.json"
    deadline = time.monotonic() + 60
    while not sites.exists():  # the sites are up once the demo wrote their pids
        assert p.poll() is None and time.monotonic() < deadline, p.stdout.read()[-3000:]
        time.sleep(0.1)
    pids = json.loads(sites.read_text())["pids"]
    assert len(pids) == 2 and all(_alive(pid) for pid in pids)
    if link == "netns":
        assert len(_namespaces(p.pid)) == 2
    os.kill(p.pid, signal.SIGINT)
    try:
        p.communicate(timeout=60)
    except subprocess.TimeoutExpired:  # say where it hangs: faulthandler dumps every thread
        os.kill(p.pid, signal.SIGABRT)
        pytest.fail(
            "the demo did not exit within 60 s of Ctrl-C:\n" + p.communicate(timeout=20)[0][-6000:]
        )
    assert p.returncode != 0
    assert not any(_alive(pid) for pid in pids)
    assert _namespaces(p.pid) == []
    assert not (out / "summary.json").exists()
