"""Flower processes: a local federation (SuperLink + SuperNodes) and ``flwr run`` submission.

:class:`LocalFederation` runs a real deployment on loopback, the way it would run across sites:
``flower-superlink --insecure`` with an in-memory database, N ``flower-supernode`` processes
(each with ``partition-id=i``) and ``flwr run APP local --stream`` with ``FLWR_HOME`` in a
private directory. Every Flower process starts in its own process group, and the whole group is
killed at exit: a SuperNode's ``flower-superexec`` children outlive their parent otherwise.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Callable, Mapping, Sequence

from diloco.flower.app import toml_value, write_app
from diloco.flower.config import from_run_config
from lowband.errors import ConfigError, LowbandError, TransportTimeout
from lowband.proc import free_port

logger = logging.getLogger(__name__)

DEPLOYMENT = "local-deployment"  # the SuperLink connection's name in FLWR_HOME/config.toml

# A process starter: (argv, env additions, stdout) -> Popen. The default starts a new session
# (own process group); tests pass their own that also kills the group at teardown.
Starter = Callable[..., subprocess.Popen]


def _executable(name: str) -> str:
    """A Flower console script from this interpreter's environment, else from PATH."""
    local = Path(sys.executable).parent / name
    if local.exists():
        return str(local)
    found = shutil.which(name)
    if found is None:
        raise ConfigError("flower", f"{name} not found: pip install 'lowband[flower]'")
    return found


def _default_starter(
    args: list[str], *, env: Mapping[str, str], stdout: IO[bytes] | int, stderr: IO[bytes] | int
) -> subprocess.Popen:
    # PYTHONUNBUFFERED: the logs fill while the run is going, not when a process exits.
    return subprocess.Popen(
        args,
        env={**os.environ, "PYTHONUNBUFFERED": "1", **env},
        stdout=stdout,
        stderr=stderr,
        start_new_session=True,
    )


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _signal_pid(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def tagged_pids(key: str, value: str) -> list[int]:
    """Live processes whose environment holds ``key=value`` (Linux ``/proc``; else none).

    Environment variables are inherited, so this finds every descendant of a process started
    with a unique value, even after it was re-parented or moved to another process group.
    """
    needle = f"{key}={value}".encode()
    proc = Path("/proc")
    found = []
    for d in proc.iterdir() if proc.is_dir() else ():
        if not d.name.isdigit() or int(d.name) == os.getpid():
            continue
        try:
            environ = (d / "environ").read_bytes()  # empty for zombies: they are not counted
        except OSError:
            continue
        if needle in environ.split(b"\0"):
            found.append(int(d.name))
    return found


def _group_alive(pgid: int) -> bool:
    """Whether any process (zombies awaiting their reaper included) is left in the group."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class FlowerRunFailed(LowbandError):
    """``flwr run`` exited with an error or the run did not finish in time."""


def _flwr_env(flwr_home: Path) -> dict[str, str]:
    # Flower's connection config and app cache stay in our directory, never in ~/.flwr.
    return {"FLWR_HOME": str(flwr_home), "PATH": _path_with_own_bin()}


def _path_with_own_bin(path: str | None = None) -> str:
    """PATH with this interpreter's scripts directory first.

    A SuperLink or SuperNode starts ``flower-superexec`` (and that the app processes) by a PATH
    lookup, so ``/venv/bin/lowband flower local`` from a shell whose venv is not activated found
    no ``flower-superexec``. The directory is ``sys.executable``'s own (not resolved: a venv's
    python is a symlink to the base interpreter, whose directory holds no Flower scripts)."""
    own = str(Path(sys.executable).parent)
    rest = [
        d
        for d in (os.environ.get("PATH", "") if path is None else path).split(os.pathsep)
        if d and d != own
    ]
    return os.pathsep.join([own, *rest])


def write_flwr_home(home: Path, address: str, *, root_certificates: str | None = None) -> Path:
    """A FLWR_HOME whose config.toml names one SuperLink (``DEPLOYMENT``) at ``address``."""
    home.mkdir(parents=True, exist_ok=True)
    tls = (
        f"root-certificates = {toml_value(root_certificates)}\n"
        if root_certificates
        else "insecure = true\n"
    )
    (home / "config.toml").write_text(
        f'[superlink]\ndefault = "{DEPLOYMENT}"\n\n[superlink.{DEPLOYMENT}]\n'
        f"address = {toml_value(address)}\n{tls}"
    )
    return home


def flwr_run(
    app_dir: Path,
    flwr_home: Path,
    run_config: Mapping[str, Any] | None,
    workdir: Path,
    *,
    starter: Starter | None = None,
    timeout: float = 600.0,
    echo: IO[str] | None = None,
    track: list[subprocess.Popen] | None = None,
) -> str:
    """``flwr run APP DEPLOYMENT --stream`` until the run ends; returns its output.

    ``--stream`` keeps ``flwr run`` attached until the ServerApp finishes, so its exit is the
    run's end. Raises :class:`FlowerRunFailed` if it fails or exceeds ``timeout`` seconds (its
    process group is killed then; the run itself may go on on the SuperLink).
    """
    args = [_executable("flwr"), "run", str(app_dir), DEPLOYMENT, "--stream"]
    if run_config:
        override = workdir / "run-config.toml"
        override.write_text("".join(f"{k} = {toml_value(v)}\n" for k, v in run_config.items()))
        args += ["--run-config", str(override)]
    out_path = workdir / "flwr-run.log"
    with out_path.open("wb") as out:
        proc = (starter or _default_starter)(
            args, env=_flwr_env(flwr_home), stdout=out, stderr=subprocess.STDOUT
        )
        if track is not None:
            track.append(proc)
        try:
            rc = _wait(proc, timeout, out_path, echo)
        finally:
            if proc.poll() is None:
                _signal_group(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
    text = out_path.read_text(errors="replace")
    if rc != 0:
        raise FlowerRunFailed(f"flwr run exited with {rc}; last output:\n{text[-3000:]}")
    return text


def _wait(proc: subprocess.Popen, timeout: float, out_path: Path, echo: IO[str] | None) -> int:
    deadline = time.monotonic() + timeout
    pos = 0
    while True:
        try:
            rc = proc.wait(timeout=0.5)
        except subprocess.TimeoutExpired:
            rc = None
        if echo is not None:
            with out_path.open("rb") as f:
                f.seek(pos)
                chunk = f.read()
            pos += len(chunk)
            echo.write(chunk.decode(errors="replace"))
            echo.flush()
        if rc is not None:
            return rc
        if time.monotonic() > deadline:
            raise FlowerRunFailed(
                f"the Flower run did not finish within {timeout}s:\n"
                + out_path.read_text(errors="replace")[-3000:]
            )


class LocalFederation:
    """SuperLink + ``n_nodes`` SuperNodes on 127.0.0.1 (use as a context manager)."""

    def __init__(
        self,
        n_nodes: int,
        *,
        workdir: Path | None = None,
        node_configs: Sequence[Mapping[str, Any]] | None = None,
        starter: Starter | None = None,
        start_timeout: float = 60.0,
    ) -> None:
        if n_nodes < 1:
            raise ConfigError("supernodes", f"must be >= 1, got {n_nodes}")
        if node_configs is not None and len(node_configs) != n_nodes:
            raise ConfigError("node_configs", f"{len(node_configs)} configs for {n_nodes} nodes")
        self.n_nodes = n_nodes
        self.node_configs = [dict(c) for c in (node_configs or [{}] * n_nodes)]
        self.starter = starter or _default_starter
        self.start_timeout = start_timeout
        self._tmp = None if workdir else tempfile.TemporaryDirectory(prefix="lowband-flower-")
        self.workdir = Path(workdir or self._tmp.name)  # type: ignore[union-attr]
        self.flwr_home = self.workdir / "flwr-home"
        self.port = 0
        self.procs: list[subprocess.Popen] = []
        self._logs: list[IO[bytes]] = []

    # ---- lifecycle -----------------------------------------------------------------------------
    def __enter__(self) -> "LocalFederation":
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        write_flwr_home(self.flwr_home, f"127.0.0.1:{self.port}")
        self._start(
            "superlink",
            [
                _executable("flower-superlink"),
                "--insecure",
                "--database",
                ":flwr-in-memory:",
                "--host",
                "127.0.0.1",
                "--port",
                str(self.port),
                "--disable-runtime-dependency-installation",
            ],
        )
        self._wait_port(self.port)
        for i, extra in enumerate(self.node_configs):
            cfg = {"partition-id": i, "num-partitions": self.n_nodes, **extra}
            self._start(
                f"supernode-{i}",
                [
                    _executable("flower-supernode"),
                    "--insecure",
                    "--superlink",
                    f"127.0.0.1:{self.port}",
                    "--port",
                    str(free_port()),
                    "--node-config",
                    " ".join(f"{k}={toml_value(v)}" for k, v in cfg.items()),
                ],
            )

    def stop(self) -> None:
        """Kill every Flower process (SIGTERM, then SIGKILL) and close the logs.

        Each process we started leads its own group, which reaches the superexec children that
        stay in it. Flower's superexec starts the ServerApp/ClientApp processes in groups of
        their own, so on Linux every process that inherited this federation's FLWR_HOME is
        signalled as well. Returns once none is left (bounded by a few seconds per signal).
        """
        marker = ("FLWR_HOME", str(self.flwr_home))
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for p in self.procs:
                _signal_group(p.pid, sig)
            for pid in tagged_pids(*marker):
                _signal_pid(pid, sig)
            deadline = time.monotonic() + 5.0
            for p in self.procs:
                try:
                    p.wait(timeout=max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    pass
            while time.monotonic() < deadline and (
                any(_group_alive(p.pid) for p in self.procs) or tagged_pids(*marker)
            ):
                time.sleep(0.05)
        self.procs.clear()
        for f in self._logs:
            f.close()
        self._logs.clear()
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    # ---- running an app ------------------------------------------------------------------------
    def run(
        self,
        app_dir: Path,
        run_config: Mapping[str, Any] | None = None,
        *,
        timeout: float = 600.0,
        echo: IO[str] | None = None,
    ) -> str:
        """``flwr run APP --stream`` against this federation; see :func:`flwr_run`."""
        return flwr_run(
            app_dir,
            self.flwr_home,
            run_config,
            self.workdir,
            starter=self.starter,
            timeout=timeout,
            echo=echo,
            track=self.procs,
        )

    def logs(self) -> dict[str, str]:
        """Each Flower process's output so far (for error reports)."""
        return {p.name: p.read_text(errors="replace") for p in sorted(self.workdir.glob("*.log"))}

    # ---- helpers -------------------------------------------------------------------------------
    def _start(self, name: str, args: list[str]) -> subprocess.Popen:
        log = (self.workdir / f"{name}.log").open("wb")
        self._logs.append(log)
        proc = self.starter(
            args, env=_flwr_env(self.flwr_home), stdout=log, stderr=subprocess.STDOUT
        )
        self.procs.append(proc)
        logger.info("started %s (pid %d): %s", name, proc.pid, " ".join(args))
        return proc

    def _wait_port(self, port: int) -> None:
        deadline = time.monotonic() + self.start_timeout
        while time.monotonic() < deadline:
            if self.procs[0].poll() is not None:
                raise FlowerRunFailed(
                    "flower-superlink exited at start:\n"
                    + self.logs().get("superlink.log", "")[-3000:]
                )
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=1.0):
                    return
            except OSError:
                time.sleep(0.1)
        raise TransportTimeout(
            f"flower-superlink did not listen on port {port} within {self.start_timeout}s"
        )


# ---- one call: app + federation + run + summary (``lowband flower local``) ---------------------
@dataclass(frozen=True, kw_only=True)
class LocalRunConfig:
    """A local federation run: N SuperNodes, the app's run-config overrides, where results go."""

    supernodes: int = 2
    run_config: Mapping[str, Any] = field(default_factory=dict)  # overrides of the app defaults
    out_dir: str = "flower-run"  # the ServerApp writes metrics.jsonl, summary.json, checkpoint/
    app_dir: str | None = None  # None: write the built-in app to a temporary directory
    node_configs: tuple[Mapping[str, Any], ...] = ()  # extra --node-config per SuperNode
    timeout: float = 3600.0  # seconds for the whole run
    workdir: str | None = None  # logs, FLWR_HOME, run config (None: a temporary directory)

    def __post_init__(self) -> None:
        if self.supernodes < 1:
            raise ConfigError("supernodes", f"must be >= 1, got {self.supernodes}")
        if self.node_configs and len(self.node_configs) != self.supernodes:
            raise ConfigError(
                "node_configs", f"{len(self.node_configs)} for {self.supernodes} nodes"
            )
        if not self.timeout > 0:
            raise ConfigError("timeout", f"must be > 0, got {self.timeout}")
        if self.app_dir is not None and not (Path(self.app_dir) / "pyproject.toml").exists():
            raise ConfigError(
                "app", f"{self.app_dir} has no pyproject.toml (lowband flower new DIR)"
            )
        from_run_config(self.effective_run_config())  # every value checked before any process

    def effective_run_config(self) -> dict[str, Any]:
        # Wait for every local SuperNode before round 1; the server writes under an absolute
        # out-dir because its working directory is Flower's, not ours.
        rc = {"min-available-nodes": self.supernodes, **self.run_config}
        rc["out-dir"] = str(Path(self.out_dir).resolve())
        return rc


def run_local(
    cfg: LocalRunConfig, *, starter: Starter | None = None, echo: IO[str] | None = None
) -> dict[str, Any]:
    """Write the app (unless given), start the federation, run it, tear it down; the summary."""
    rc = cfg.effective_run_config()
    out = Path(rc["out-dir"])
    out.mkdir(parents=True, exist_ok=True)
    stale = out / "summary.json"
    if stale.exists():
        stale.unlink()  # never report a previous run's result as this one's
    with tempfile.TemporaryDirectory(prefix="lowband-flower-app-") as tmp:
        app = Path(cfg.app_dir) if cfg.app_dir else write_app(Path(tmp) / "app")
        with LocalFederation(
            cfg.supernodes,
            node_configs=cfg.node_configs or None,
            starter=starter,
            workdir=Path(cfg.workdir) if cfg.workdir else None,
        ) as fed:
            try:
                fed.run(app, rc, timeout=cfg.timeout, echo=echo)
            except FlowerRunFailed:
                for name, text in fed.logs().items():
                    logger.error("%s (last lines):\n%s", name, text[-2000:])
                raise
    if not stale.exists():
        raise FlowerRunFailed(f"the run ended without writing {stale}; see the output above")
    return json.loads(stale.read_text())


@dataclass(frozen=True, kw_only=True)
class SubmitConfig:
    """Submit the app to a running SuperLink (``lowband flower run``): Flower's ``flwr run``
    without hand-writing a FLWR_HOME config."""

    superlink: str  # HOST:PORT of the SuperLink's API
    run_config: Mapping[str, Any] = field(default_factory=dict)
    app_dir: str | None = None  # None: the built-in app
    root_certificates: str | None = None  # CA bundle for a TLS SuperLink; None: no TLS
    timeout: float = 24 * 3600.0
    insecure: bool = False  # allow a SuperLink beyond loopback without TLS (a trusted network)

    def __post_init__(self) -> None:
        from lowband.proc import is_loopback

        host, sep, port = self.superlink.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ConfigError("superlink", f"expected HOST:PORT, got {self.superlink!r}")
        if self.root_certificates is None and not self.insecure and not is_loopback(host):
            # Without TLS the app (code every SuperNode runs) and the model cross the network
            # in clear, and whoever answers at HOST:PORT gets them.
            raise ConfigError(
                "superlink",
                f"{self.superlink} is not loopback and no --root-certificates was given: "
                "without TLS the app and the model travel in clear to whoever answers there. "
                "Pass the CA of a TLS SuperLink (--root-certificates CA.pem), or --insecure "
                "on a network you trust",
            )
        if not self.timeout > 0:
            raise ConfigError("timeout", f"must be > 0, got {self.timeout}")
        if self.app_dir is not None and not (Path(self.app_dir) / "pyproject.toml").exists():
            raise ConfigError(
                "app", f"{self.app_dir} has no pyproject.toml (lowband flower new DIR)"
            )
        from_run_config(self.run_config)


def submit(
    cfg: SubmitConfig, *, starter: Starter | None = None, echo: IO[str] | None = None
) -> str:
    """Run the app on ``cfg.superlink`` until it finishes; returns ``flwr run``'s output."""
    with tempfile.TemporaryDirectory(prefix="lowband-flower-") as tmp:
        work = Path(tmp)
        app = Path(cfg.app_dir) if cfg.app_dir else write_app(work / "app")
        home = write_flwr_home(
            work / "flwr-home", cfg.superlink, root_certificates=cfg.root_certificates
        )
        return flwr_run(
            app, home, cfg.run_config, work, starter=starter, timeout=cfg.timeout, echo=echo
        )


def summary_table(out_dir: Path) -> str:
    """Per-round table (fragment, replies, failures, losses, bytes) from ``metrics.jsonl``."""
    rounds: dict[int, dict[str, Any]] = {}
    evals: dict[int, dict[str, Any]] = {}
    eval_down: dict[int, int] = {}  # federated evaluation messages also carry θ_g fragments
    for line in (out_dir / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if rec["event"] == "round":
            rounds[rec["round"]] = rec
        elif rec["event"] == "eval":
            evals[rec["round"]] = rec
        elif rec["event"] == "fed_eval":
            eval_down[rec["round"]] = rec["bytes_down"]

    def num(x: Any) -> float:
        return float("nan") if x is None else float(x)

    lines = [
        f"{'round':>5} {'frag':>4} {'ok':>3} {'fail':>4} {'train':>7} {'eval':>7} "
        f"{'up KiB':>9} {'fp32 KiB':>9} {'down KiB':>9}",
        f"{0:>5} {'':>21} {num(evals.get(0, {}).get('loss')):>7.3f}",
    ]
    for r in sorted(rounds):
        rec = rounds[r]
        down = rec["bytes_down"] + eval_down.get(r, 0)
        lines.append(
            f"{r:>5} {rec['fragment']:>4} {rec['replies']:>3} {rec['failures']:>4} "
            f"{num(rec['train_loss']):>7.3f} {num(evals.get(r, {}).get('loss')):>7.3f} "
            f"{rec['bytes_up'] / 1024:>9.1f} {rec['bytes_up_fp32'] / 1024:>9.1f} "
            f"{down / 1024:>9.1f}"
        )
    return "\n".join(lines)
