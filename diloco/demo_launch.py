"""``lowband demo``'s launcher: the docker-compose multi-site topology as local processes.

A coordinator (in this process) and N "sites", each a real ``lowband worker`` process, train the
same model on the same data and token budget twice: Streaming DiLoCo, then the DDP baseline
(gradients all-reduced in fp32 every step). Every site's traffic crosses the WAN-like link that
:mod:`transport.links.sites` builds (``netns``, ``emulator``, ``tun`` or ``none``). The result
is ``out_dir/summary.json``, ``out_dir/eval_vs_bytes.png``, and per run ``out_dir/{diloco,ddp}/``
with the sites' metrics, logs and checkpoints.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from diloco.config import DilocoConfig, TrainConfig, config_to_dict, shakespeare, with_overrides
from lowband.errors import ConfigError, LowbandError
from lowband.proc import die_with_parent
from transport.links.sites import LINKS, Network, open_network, resolve_link

logger = logging.getLogger(__name__)


class DemoFailed(LowbandError):
    """A site exited with an error or the run did not finish in time; the message has its log."""


def demo_train_config(sites: int) -> TrainConfig:
    """The default run: the bench-tuned ``shakespeare`` settings (NF4 + error feedback, α = 0.5,
    outer Nesterov lr 1.0) shortened to 300 steps so that both runs take ~2 minutes on two
    cores (50 Mbit/s, 40 ms, 3 sites); H = 30, P = 3 gives ten outer rounds per fragment in
    that budget."""
    base = shakespeare()
    return with_overrides(
        base, steps=300, inner_steps=30, eval_every=50, warmup_steps=30, workers=sites
    )


@dataclass(frozen=True, kw_only=True)
class DemoConfig:
    """One demo: ``sites`` workers, each behind a link of ``rate_mbit`` and ``delay_ms``."""

    train: TrainConfig
    """The Streaming DiLoCo run (``train.workers == sites``); DDP reuses it with ``mode = DDP``."""
    out_dir: Path
    sites: int = 3
    """M: site processes (workers) per run."""
    rate_mbit: float = 50.0
    """Link bandwidth of every site, Mbit/s, each direction."""
    delay_ms: float = 40.0
    """One-way delay, ms, added in front of every site (and of the coordinator): a byte from
    one site to another arrives ``delay_ms`` later, and its acknowledgement takes as long back."""
    link: str = "auto"
    """netns (root: namespaces + tbf), emulator (user-space relays), none, or auto."""
    ddp_inner_lr: float | None = None
    """Peak AdamW lr of the DDP baseline; None: the same as the DiLoCo inner lr."""
    threads: int = 1
    """torch intra-op threads per site process."""
    timeout: float = 1800.0
    """Seconds one run (all sites) may take before it is stopped."""
    net: int = 0
    """Second octet of the netns subnet 10.<net>.0.0/24; 0 picks a free one."""
    progress: bool = True
    """Print what is happening and site 1's progress bar (stderr)."""

    def __post_init__(self) -> None:
        if self.sites < 2:
            raise ConfigError("sites", f"a multi-site demo needs >= 2 sites, got {self.sites}")
        if self.sites > 32:
            raise ConfigError("sites", f"at most 32 sites on one machine, got {self.sites}")
        if not (self.rate_mbit > 0 and self.rate_mbit <= 10_000):
            raise ConfigError("rate_mbit", f"must be in (0, 10000] Mbit/s, got {self.rate_mbit}")
        if not 0 <= self.delay_ms <= 10_000:
            raise ConfigError("delay_ms", f"must be in [0, 10000] ms, got {self.delay_ms}")
        if self.link not in LINKS:
            raise ConfigError("link", f"one of {', '.join(LINKS)}, got {self.link!r}")
        if not isinstance(self.train.mode, DilocoConfig):
            raise ConfigError(
                "mode",
                "the demo runs Streaming DiLoCo and then DDP itself; "
                "give a DiLoCo configuration (leave --mode out)",
            )
        if self.train.workers != self.sites:
            raise ConfigError(
                "sites", f"train.workers={self.train.workers} must equal sites={self.sites}"
            )
        if self.ddp_inner_lr is not None and not self.ddp_inner_lr > 0:
            raise ConfigError("ddp_inner_lr", f"must be > 0, got {self.ddp_inner_lr}")
        if self.threads < 1:
            raise ConfigError("threads", f"must be >= 1, got {self.threads}")
        if not self.timeout > 0:
            raise ConfigError("timeout", f"must be > 0 seconds, got {self.timeout}")
        if self.net and not 1 <= self.net <= 254:
            raise ConfigError("net", f"must be in [1, 254] (or 0: pick one), got {self.net}")

    def ddp_train(self) -> TrainConfig:
        """The baseline: same model, data, seed, steps and workers; fp32 gradients every step."""
        return with_overrides(self.train, mode="ddp", inner_lr=self.ddp_inner_lr)


# ---- one run: a coordinator and the site processes -----------------------------------------
def _say(cfg: DemoConfig, text: str) -> None:
    if cfg.progress:
        print(f"[lowband demo] {text}", file=sys.stderr, flush=True)


def _stop(procs: Sequence[subprocess.Popen]) -> None:
    """SIGTERM each site's process group, SIGKILL what is left after a grace period."""
    for p in procs:
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGTERM)
    deadline = time.monotonic() + 5.0
    for p in procs:
        try:
            p.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def run_sites(
    cfg: DemoConfig, net: Network, train: TrainConfig, run_dir: Path, label: str
) -> float:
    """Train ``train`` with one process per site; returns the seconds from launch to the last
    exit. Raises :class:`DemoFailed` with the failing site's log."""
    from transport.coordinator import Coordinator, CoordinatorConfig

    run_dir.mkdir(parents=True, exist_ok=True)
    config_file = run_dir / "config.json"
    config_file.write_text(json.dumps(config_to_dict(train), indent=2))
    procs: list[subprocess.Popen] = []
    t0 = time.monotonic()
    # A slow interval: on a narrow shaped link heartbeats queue behind bulk gradient traffic.
    with (
        Coordinator(
            CoordinatorConfig(bind=net.coordinator_bind(), heartbeat_interval=5.0)
        ) as coord,
        net.sites(int(coord.address.rsplit(":", 1)[1])) as sites,
    ):
        try:
            for i, site in enumerate(sites):
                args = [
                    *site.prefix,
                    sys.executable,
                    "-m",
                    "cli",
                    "worker",
                    "--coordinator",
                    site.coordinator,
                    "--config",
                    str(config_file),
                    "--id",
                    f"site-{i + 1}",
                    "--out",
                    str(run_dir),
                    "--threads",
                    str(cfg.threads),
                    *site.flags,
                ]
                show = cfg.progress and i == 0
                if show:
                    args.append("--progress")
                with (run_dir / f"site-{i + 1}.log").open("w") as log:
                    # Own session: the site and anything it starts die together (killpg).
                    procs.append(
                        subprocess.Popen(
                            args,
                            stdout=log,
                            stderr=None if show else subprocess.STDOUT,
                            start_new_session=True,
                            preexec_fn=die_with_parent,
                        )
                    )
            (run_dir / "sites.json").write_text(
                json.dumps({"coordinator": coord.address, "pids": [p.pid for p in procs]})
            )
            _say(cfg, f"{label}: {len(procs)} sites started")
            _wait(procs, run_dir, t0 + cfg.timeout)
        finally:
            _stop(procs)
    return time.monotonic() - t0


def _wait(procs: Sequence[subprocess.Popen], run_dir: Path, deadline: float) -> None:
    """Until every site exited; the first failure (or the deadline) ends the run."""
    while True:
        codes = [p.poll() for p in procs]
        bad = [i for i, c in enumerate(codes) if c not in (None, 0)]
        if bad:
            i = bad[0]
            tail = (run_dir / f"site-{i + 1}.log").read_text(errors="replace")[-3000:]
            raise DemoFailed(f"site-{i + 1} exited with code {codes[i]}; its log ends:\n{tail}")
        if all(c == 0 for c in codes):
            return
        if time.monotonic() > deadline:
            raise DemoFailed(f"the run in {run_dir} did not finish in time (raise --timeout)")
        time.sleep(0.2)


# ---- the summary ----------------------------------------------------------------------------
def load_run(run_dir: Path, steps: int, process_wall_s: float, sites: int) -> dict[str, Any]:
    """What the sites wrote: the ``final`` record of each and the evaluating site's curve."""
    from diloco.metrics import RunSummary, read_jsonl

    finals, evals, waits = [], [], []
    by_site: dict[str, dict[str, Any]] = {}
    for path in sorted(run_dir.glob("metrics-*.jsonl")):
        records = read_jsonl(path)
        done = [r for r in records if r["event"] == "final"]
        finals += done
        if done:  # metrics-worker<id>.jsonl, <id> the --id run_sites gave (make_worker's name)
            by_site[path.stem.removeprefix("metrics-worker")] = done[-1]
        evals += [r for r in records if r["event"] == "eval"]
        syncs = [r["wait_s"] for r in records if r["event"] == "sync"]
        if syncs:  # DiLoCo only: time blocked waiting for fragment results
            waits.append(sum(syncs))
    if len(finals) == 0:
        raise DemoFailed(f"no site of {run_dir} wrote a final record")
    losses = [f["final_eval"] for f in finals if f.get("final_eval") is not None]
    wall = max(f["wall_s"] for f in finals)  # training time, after the group formed
    n = len(finals)
    expected = [f"site-{i + 1}" for i in range(sites)]  # the ids run_sites gives
    run = RunSummary.from_finals(expected, by_site, steps=steps)
    return {
        "sites_finished": n,
        "final_eval": losses[0] if losses else None,
        "bytes_per_worker": sum(f["bytes_sent"] for f in finals) / n,
        "bytes_received_per_worker": sum(f["bytes_received"] for f in finals) / n,
        "peak_sync_bytes": max(f["peak_sync_bytes"] for f in finals),
        "steps": steps,
        "wall_s": round(wall, 2),
        "process_wall_s": round(process_wall_s, 2),
        "steps_per_s": round(steps / wall, 3) if wall > 0 else None,
        "sync_s": round(sum(f["sync_s"] for f in finals) / n, 2),
        "compute_s": round(sum(f["compute_s"] for f in finals) / n, 2),
        # sync_s of DiLoCo also holds encode/decode, outer steps and audits; this is the part
        # spent waiting for fragment results (what the overlap τ is meant to hide)
        "fragment_wait_s": round(sum(waits) / len(waits), 2) if waits else None,
        "tokens_per_s": round(sum(f["tokens"] for f in finals) / wall, 1) if wall > 0 else None,
        **run.to_dict(),
        "curve": [
            [e["step"], round(e["loss"], 4), e["bytes_sent"]]
            for e in sorted(evals, key=lambda r: r["step"])
        ],
    }


def summary_table(summary: dict[str, Any]) -> str:
    """The comparison as aligned text (what the CLI prints)."""

    def fmt(v: Any, spec: str) -> str:
        return "-" if v is None else format(v, spec)

    rows = [
        (
            f"{'run':<17} {'eval loss':>9} {'MiB sent/worker':>15} {'wall s':>7} "
            f"{'steps/s':>8} {'sync s':>7}"
        )
    ]
    for name, key in (("DDP", "ddp"), ("Streaming DiLoCo", "diloco")):
        r = summary[key]
        rows.append(
            f"{name:<17} {fmt(r['final_eval'], '.4f'):>9} "
            f"{r['bytes_per_worker'] / 2**20:>15.3f} {r['wall_s']:>7.1f} "
            f"{fmt(r['steps_per_s'], '.2f'):>8} {r['sync_s']:>7.1f}"
        )
    rows.append(
        f"initial eval loss {summary['initial_eval']:.4f}; "
        f"bytes ratio DDP/DiLoCo {fmt(summary['bytes_ratio'], '.1f')}x; "
        f"DiLoCo steps/s {fmt(summary['speedup'], '.2f')}x DDP's; "
        f"loss gap {fmt(summary['loss_gap'] and 100 * summary['loss_gap'], '+.2f')}%"
    )
    wait = summary["diloco"].get("fragment_wait_s")
    if wait is not None:
        rows.append(
            f"DiLoCo waited {wait:.1f} s per worker for fragment results; the rest of "
            "its sync s is encoding, decoding, outer steps and state audits"
        )
    rows.append(f"link: {summary['link']['description']}")
    return "\n".join(rows)


def _compare(diloco: dict[str, Any], ddp: dict[str, Any]) -> dict[str, Any]:
    def ratio(a: float | None, b: float | None) -> float | None:
        return a / b if a is not None and b else None

    gap = None
    if diloco["final_eval"] is not None and ddp["final_eval"]:
        gap = (diloco["final_eval"] - ddp["final_eval"]) / ddp["final_eval"]
    return {
        "bytes_ratio": ratio(ddp["bytes_per_worker"], diloco["bytes_per_worker"]),
        "speedup": ratio(diloco["steps_per_s"], ddp["steps_per_s"]),
        "loss_gap": gap,
    }


def _plot(summary: dict[str, Any], path: Path) -> Path:
    from diloco.metrics import plot_runs

    mode = summary["config"]
    runs = {
        name: [
            {"event": "eval", "step": s, "loss": l, "bytes_sent": b}
            for s, l, b in summary[key]["curve"]
        ]
        for name, key in (
            ("DDP (fp32 gradients)", "ddp"),
            (f"Streaming DiLoCo ({mode['codec']}, H={mode['H']}, P={mode['P']})", "diloco"),
        )
    }
    return plot_runs(
        runs,
        path,
        title=f"{summary['sites']} sites, "
        f"{summary['link']['kind']} link {summary['rate_mbit']:g} Mbit/s, "
        f"{summary['delay_ms']:g} ms",
    )


def main(cfg: DemoConfig) -> dict[str, Any]:
    """Run both trainings and write ``summary.json`` + ``eval_vs_bytes.png``; returns the
    summary. Every process, relay and namespace started here is gone when this returns or
    raises (Ctrl-C included)."""
    from diloco.task import lm_task

    kind = resolve_link(cfg.link)
    task = lm_task(cfg.train)  # a missing corpus fails here, before anything starts
    initial = task.evaluate(task.build_model())  # θ_0: identical for both runs (same seed)
    cfg.out_dir.mkdir(parents=True, exist_ok=True)
    mode: DilocoConfig = cfg.train.mode  # type: ignore[assignment]  # DemoConfig checked it
    summary: dict[str, Any] = {
        "sites": cfg.sites,
        "rate_mbit": cfg.rate_mbit,
        "delay_ms": cfg.delay_ms,
        "initial_eval": initial,
        "config": {
            "steps": cfg.train.steps,
            "H": mode.inner_steps,
            "P": mode.n_fragments,
            "tau": mode.tau,
            "alpha": mode.alpha,
            "codec": mode.codec,
            "error_feedback": mode.error_feedback,
            "tokens_per_worker": cfg.train.steps * cfg.train.tokens_per_step(),
            "parameters": sum(p.numel() for p in task.build_model().parameters()),
        },
    }
    with open_network(
        kind, sites=cfg.sites, rate_mbit=cfg.rate_mbit, delay_ms=cfg.delay_ms, net=cfg.net
    ) as net:
        summary["link"] = {
            "kind": net.kind,
            "requested": cfg.link,
            "description": net.description(),
        }
        _say(cfg, f"link: {net.description()}")
        for key, label, train in (
            ("diloco", "Streaming DiLoCo", cfg.train),
            ("ddp", "DDP baseline", cfg.ddp_train()),
        ):
            _say(cfg, f"{label}: {cfg.sites} sites x {train.steps} steps")
            took = run_sites(cfg, net, train, cfg.out_dir / key, label)
            summary[key] = load_run(cfg.out_dir / key, train.steps, took, cfg.sites)
            _say(cfg, f"{label}: done in {took:.1f} s, eval loss {summary[key]['final_eval']:.4f}")
    summary.update(_compare(summary["diloco"], summary["ddp"]))
    summary["plot"] = str(_plot(summary, cfg.out_dir / "eval_vs_bytes.png"))
    summary["finite"] = all(
        math.isfinite(summary[k]["final_eval"] or math.nan) for k in ("diloco", "ddp")
    )
    (cfg.out_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary
