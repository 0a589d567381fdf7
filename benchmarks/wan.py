"""All-reduce over named WAN profiles, lowband (K connections) vs Gloo, through the TUN emulator.

    python -m benchmarks.wan --json                                  # every profile
    python -m benchmarks.wan --profiles home --size-mb 16 --repeats 3 --json

Each profile (:data:`PROFILES`: ``lan``, ``continent``, ``intercontinental``, ``home``) is a full
mesh of ``sites`` network namespaces joined by the packet-level TUN emulator
(:mod:`transport.links.tun`): every direction of every pair has the profile's one-way delay
(RTT / 2), bottleneck rate and random loss, and kernel TCP (the namespace default, bbr here) runs
end to end over it. The root namespace joins as the host endpoint, where the lowband coordinators
run. Per profile:

1. **calibration** – TCP handshake RTT, one TCP flow's goodput against the configured rate, and
   the loss of paced UDP datagrams, measured between sites 1 and 0;
2. **all-reduce** of a ``size_mb`` fp32 tensor among the sites: lowband with each K in
   ``connections`` (one coordinator per K, ``same_host="off"``, ring at this size) and Gloo
   (``torch.distributed``, TCP store on site 0, ``GLOO_SOCKET_IFNAME`` = the site's TUN, its
   default algorithm, in place on a persistent buffer refilled untimed, as DDP uses it). The
   same worker processes run every arm; each iteration runs every arm once, in an order rotated
   by one per iteration, after an untimed barrier. An iteration's time is its slowest site's.
   Reported: seconds per all-reduce (median, min, max), the best K, lowband/Gloo speed ratio
   (Gloo seconds / lowband seconds: > 1 means lowband is faster) and link utilisation = IP bytes
   a site's TUN sent during the operation / seconds / the rate the link ran at.

Rate scaling: the forwarder is one Python process; on the 2-core machine these figures come from
it forwards a few hundred Mbit/s in all (every path together). A profile's rate is therefore
capped at ``max_rate_mbit`` per direction (default 50, so that a ring's ``sites`` concurrent
flows stay under the forwarder's ceiling); the output records the configured rate, the rate run
and a label such as "1 Gbit/s profile run at 50 Mbit/s". RTT and loss are never scaled.

What one TCP flow gets on such a path depends on the sites' kernel, and so does which K wins:
``--congestion`` sets every site's congestion control (bbr, the host's default here, is not
slowed by random loss, so one flow fills the link and K = 1 wins; cubic, the stock Linux
default, is loss-limited to a few Mbit/s per flow at 160 ms and 0.1 %, and K connections
multiply that), and ``--scale-tcp-buffers`` caps the TCP buffers at the stock kernel's times
rate run / configured rate, so that one flow's window covers the share of the BDP that it would
at the configured rate. Both apply to lowband and Gloo alike.

    python -m benchmarks.wan --profiles intercontinental --congestion cubic --timeout 1500 --json
    python -m benchmarks.wan --profiles intercontinental --scale-tcp-buffers --json

``--torchft PYTHON`` runs torchft's Streaming DiLoCo beside lowband's instead (``PYTHON`` imports
torchft: ``python -m venv /tmp/tftvenv && /tmp/tftvenv/bin/pip install -c constraints.txt torch
torchft``), both on the same model, batches, optimizers and steps, and reports wall clock, bytes
and the held-out loss of each arm's final global model:

    python -m benchmarks.wan --torchft /tmp/tftvenv/bin/python --diloco-steps 360 --json
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from lowband.errors import ConfigError

MiB = 1 << 20
GLOO_PORT = 29511


@dataclass(frozen=True, kw_only=True)
class Profile:
    """A WAN path as the issue names it (each direction of each pair of sites)."""

    rate_mbit: float
    """Bottleneck rate per direction, as configured on a real link."""
    rtt_ms: float
    """Round-trip propagation delay (each direction gets half)."""
    loss: float = 0.0
    """Random loss per packet, each direction."""


PROFILES: dict[str, Profile] = {
    "lan": Profile(rate_mbit=1000.0, rtt_ms=1.0),
    "continent": Profile(rate_mbit=1000.0, rtt_ms=40.0),
    "intercontinental": Profile(rate_mbit=1000.0, rtt_ms=160.0, loss=0.001),
    "home": Profile(rate_mbit=100.0, rtt_ms=30.0, loss=0.005),
}


TOPOLOGIES = {
    "access": "each site one access link at the rate (uplink and downlink) shared by its paths; "
    "the paths carry delay and loss",
    "mesh": "every direction of every pair its own bottleneck at the rate",
}


@dataclass(frozen=True, kw_only=True)
class WanBench:
    profiles: tuple[str, ...] = tuple(PROFILES)
    sites: int = 4
    size_mb: float = 16.0
    """Tensor size (fp32) of one all-reduce."""
    scale_size: bool = False
    """Run a profile whose rate is scaled down (``max_rate_mbit``) with the tensor scaled by the
    same factor: a scale model that keeps the configured profile's ratio of bytes to
    bandwidth-delay product, hence the share of the time that goes to round trips and
    queueing (64 MB at 1 Gbit/s and 160 ms becomes 3.2 MB at 50 Mbit/s). What does not scale:
    windows and queues hold fewer packets by the factor, so effects counted in packets (a first
    window's slow start, the packets one tail drop hits) weigh differently. Off: the tensor as
    given, at the rate run (round trips weigh less)."""
    connections: tuple[int, ...] = (1, 4, 16)
    """K values of lowband's transport, each its own arm."""
    algorithms: tuple[str, ...] = ("auto", "scatter")
    """lowband schedules, each with every K an arm: ``auto`` (what ``all_reduce`` picks; arm
    ``lowband_k<K>``), ``ring`` or ``scatter`` (arm ``lowband_k<K>_<algorithm>``)."""
    topology: str = "access"
    """``access``: each site has one access link at the profile's rate, up and down, that all
    its paths share (a site's internet line), and the paths carry the delay and loss;
    ``mesh``: every direction of every pair is its own bottleneck at that rate (dedicated
    circuits, where a site sending to n-1 peers at once has n-1 times the rate)."""
    gloo: bool = True
    repeats: int = 3
    """Timed iterations (every arm once each)."""
    warmup: int = 1
    """Untimed iterations first (connections set up, windows opened)."""
    max_rate_mbit: float = 50.0
    """Cap on each direction's rate (what the forwarder sustains for ``sites`` flows at once)."""
    chunk_kb: int = 256
    """lowband chunk size: small enough that a ring segment stripes over 16 connections."""
    calib_seconds: float = 3.0
    udp_count: int = 4000
    timeout: float = 600.0
    congestion: str = ""
    """Every site's default TCP congestion control (lowband and Gloo alike); empty: the
    namespace's default (the host's, bbr here). ``cubic`` is the stock Linux default."""
    scale_tcp_buffers: bool = False
    """Cap every site's TCP buffers (``tcp_wmem``/``tcp_rmem`` max) at the stock kernel's
    (4 MiB / 6 MiB) times rate run / configured rate: one flow's window then covers the same
    share of the path's BDP as a stock kernel's at the configured rate (a 1 Gbit/s, 160 ms path
    has a 20 MB BDP that a 4 MiB send buffer covers a fifth of). Off: the kernel's buffers."""
    net: int = 231
    seed: int = 1

    def __post_init__(self) -> None:
        unknown = set(self.profiles) - set(PROFILES)
        if not self.profiles or unknown:
            raise ConfigError("profiles", f"a non-empty subset of {list(PROFILES)}")
        if not 2 <= self.sites <= 16:
            raise ConfigError("sites", f"must be in [2, 16], got {self.sites}")
        if self.size_mb <= 0 or self.max_rate_mbit <= 0 or self.chunk_kb < 4:
            raise ConfigError("size_mb", "need size_mb > 0, max_rate_mbit > 0, chunk_kb >= 4")
        if not self.connections or not all(1 <= k <= 64 for k in self.connections):
            raise ConfigError("connections", "K values in [1, 64]")
        if self.repeats < 1 or self.warmup < 0:
            raise ConfigError("repeats", "need repeats >= 1 and warmup >= 0")
        if not self.algorithms or not set(self.algorithms) <= {"auto", "ring", "scatter"}:
            raise ConfigError("algorithms", "a non-empty subset of auto, ring, scatter")
        if self.topology not in ("access", "mesh"):
            raise ConfigError("topology", f"access or mesh, got {self.topology!r}")

    def nbytes(self, rate_run: float = 0.0, rate_configured: float = 0.0) -> int:
        """Bytes of the tensor on a profile run at ``rate_run`` of ``rate_configured``."""
        scale = rate_run / rate_configured if self.scale_size and rate_configured else 1.0
        return int(self.size_mb * scale * MiB) // 4 * 4

    @property
    def arms(self) -> list[str]:
        ks = [
            f"lowband_k{k}" + ("" if a == "auto" else f"_{a}")
            for a in dict.fromkeys(self.algorithms)
            for k in dict.fromkeys(self.connections)
        ]
        return ks + (["gloo"] if self.gloo else [])


def parse_arm(arm: str) -> tuple[int, str]:
    """``lowband_k4_ring`` → (4, "ring"); ``lowband_k4`` → (4, "auto")."""
    k, _, algorithm = arm.removeprefix("lowband_k").partition("_")
    return int(k), algorithm or "auto"


STOCK_TCP_WMEM_MAX = 4 * MiB
STOCK_TCP_RMEM_MAX = 6 * MiB


def tcp_buffer_sysctls(scale: float) -> tuple[tuple[str, str], ...]:
    """A site's tcp_wmem / tcp_rmem with the stock kernel's maxima times ``scale`` (<= 1)."""
    w, r = (max(4096, int(m * scale)) for m in (STOCK_TCP_WMEM_MAX, STOCK_TCP_RMEM_MAX))
    return (
        ("net.ipv4.tcp_wmem", f"4096 {min(16384, w)} {w}"),
        ("net.ipv4.tcp_rmem", f"4096 {min(131072, r)} {r}"),
    )


def run_rate(profile: Profile, max_rate_mbit: float) -> tuple[float, str]:
    """The rate a profile runs at here and the label that says so."""
    rate = min(profile.rate_mbit, max_rate_mbit)

    def mbit(r: float) -> str:
        return f"{r / 1000:g} Gbit/s" if r >= 1000 else f"{r:g} Mbit/s"

    if rate < profile.rate_mbit:
        return rate, f"{mbit(profile.rate_mbit)} profile run at {mbit(rate)}"
    return rate, f"{mbit(rate)} (as configured)"


def arm_order(arms: Sequence[str], iteration: int) -> list[str]:
    """Iteration ``i`` runs every arm once, starting with arm ``i mod n`` (every site agrees)."""
    s = iteration % len(arms)
    return list(arms[s:]) + list(arms[:s])


def _spread(xs: Sequence[float], nd: int = 4) -> dict[str, float]:
    return {
        "median": round(statistics.median(xs), nd),
        "min": round(min(xs), nd),
        "max": round(max(xs), nd),
    }


def summarize(
    ranks: Sequence[dict[str, Any]], arms: Sequence[str], rate_mbit: float
) -> dict[str, Any]:
    """Per arm: slowest-site seconds per iteration (median/min/max), bytes a site sent per
    operation and link utilisation; then the best K and the lowband/Gloo ratio."""
    out: dict[str, Any] = {}
    for arm in arms:
        iters = len(ranks[0]["rows"][arm])
        secs = [max(r["rows"][arm][i][0] for r in ranks) for i in range(iters)]
        sent = [statistics.mean(r["rows"][arm][i][1] for r in ranks) for i in range(iters)]
        util = [b * 8 / s / (rate_mbit * 1e6) for b, s in zip(sent, secs)]
        out[arm] = {
            "seconds": _spread(secs),
            "site_tx_bytes": int(statistics.median(sent)),
            "link_utilisation": _spread(util, 3),
            "all_seconds": [round(s, 4) for s in secs],
        }
    lows = [a for a in arms if a.startswith("lowband_k")]
    if lows:
        best = min(lows, key=lambda a: out[a]["seconds"]["median"])
        out["best_arm"] = best
        out["best_k"] = parse_arm(best)[0]
        if "gloo" in out:
            g = out["gloo"]["seconds"]["median"]
            out["ratio_vs_gloo"] = {  # Gloo seconds / lowband seconds: > 1, lowband faster
                a.removeprefix("lowband_"): round(g / out[a]["seconds"]["median"], 3) for a in lows
            }
            out["best_ratio_vs_gloo"] = out["ratio_vs_gloo"][best.removeprefix("lowband_")]
    return out


# ---- one profile ---------------------------------------------------------------------------------
def calibrate(bed: Any, cfg: WanBench) -> dict[str, Any]:
    from transport.links.tun.calibrate import measure_goodput, measure_rtt, measure_udp_loss

    return {
        "rtt_ms": measure_rtt(bed, count=10),
        "tcp_flow": measure_goodput(bed, cfg.calib_seconds, warmup=1.0),
        "udp": measure_udp_loss(bed, count=cfg.udp_count, pps=2000.0),
    }


def _spawn(
    bed: Any, cfg: WanBench, coords: dict[str, str], tmp: str, nbytes: int
) -> list[dict[str, Any]]:
    """One worker per site (its namespace); their JSON results. Killed on failure or timeout."""
    spec = {
        "sites": cfg.sites,
        "nbytes": nbytes,
        "arms": cfg.arms,
        "coords": coords,
        "chunk_bytes": cfg.chunk_kb * 1024,
        "iters": cfg.warmup + cfg.repeats,
        "warmup": cfg.warmup,
        "timeout": cfg.timeout,
        "gloo_init": f"tcp://{bed.addr(0)}:{GLOO_PORT}",
    }
    procs, outs = [], []
    for i in range(cfg.sites):
        out = os.path.join(tmp, f"site{i}.json")
        site = {**spec, "site": i, "addr": bed.addr(i), "tun": bed.tuns[i], "out": out}
        args = [sys.executable, "-m", "benchmarks.wan", "--worker", json.dumps(site)]
        env = {**os.environ, "GLOO_SOCKET_IFNAME": bed.tuns[i]}
        procs.append(bed.popen(i, args, start_new_session=True, env=env))
        outs.append(out)
    try:
        deadline = time.monotonic() + cfg.timeout
        for p in procs:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, 9)
                p.wait()
    bad = [p.returncode for p in procs if p.returncode != 0]
    if bad:
        raise RuntimeError(f"wan benchmark workers failed with exit codes {bad}")
    results = []
    for out in outs:
        with open(out) as f:
            results.append(json.load(f))
    return results


def run_profile(cfg: WanBench, name: str) -> dict[str, Any]:
    from transport.coordinator import Coordinator, CoordinatorConfig
    from transport.links.tun.shape import AccessConfig, PathConfig
    from transport.links.tun.testbed import TunConfig, TunTestbed

    prof = PROFILES[name]
    rate, label = run_rate(prof, cfg.max_rate_mbit)
    nbytes = cfg.nbytes(rate, prof.rate_mbit)
    access = AccessConfig(rate_mbit=rate) if cfg.topology == "access" else None
    path = PathConfig(delay_ms=prof.rtt_ms / 2, rate_mbit=0.0 if access else rate, loss=prof.loss)
    tun = TunConfig(
        sites=cfg.sites,
        path=path,
        access=access,
        host=True,
        seed=cfg.seed,
        net=cfg.net,
        congestion=cfg.congestion,
        sysctls=tcp_buffer_sysctls(rate / prof.rate_mbit) if cfg.scale_tcp_buffers else (),
    )
    t0 = time.monotonic()
    with (
        TunTestbed(tun) as bed,
        contextlib.ExitStack() as stack,
        tempfile.TemporaryDirectory() as tmp,
    ):
        calib = calibrate(bed, cfg)
        stats = bed.stats()
        before, access_before = stats["paths"], stats["access_drops"]
        coords = {
            arm: stack.enter_context(
                Coordinator(CoordinatorConfig(bind=f"tcp://{bed.host}:0", heartbeat_interval=5.0))
            ).address
            for arm in cfg.arms
            if arm != "gloo"
        }
        ranks = _spawn(bed, cfg, coords, tmp, nbytes)
        stats = bed.stats()
        after, access_after = stats["paths"], stats["access_drops"]
    drops = {k: sum(after[p][k] - before[p][k] for p in after) for k in ("lost", "queue_drops")}
    drops["access_queue_drops"] = sum(
        access_after[i][d] - access_before[i][d] for i in access_after for d in ("up", "down")
    )
    allreduce = summarize(ranks, cfg.arms, rate)
    allreduce["forwarder_drops_all_paths"] = drops
    allreduce["algorithm"] = ranks[0]["algorithm"]
    calib["tcp_flow"]["goodput_vs_rate"] = round(calib["tcp_flow"]["goodput_mbit"] / rate, 3)
    return {
        "configured": {"rate_mbit": prof.rate_mbit, "rtt_ms": prof.rtt_ms, "loss": prof.loss},
        "rate_mbit_run": rate,
        "rate_label": label,
        "bytes": nbytes,
        "bytes_label": f"{cfg.nbytes() / MiB:g} MiB scaled by rate run / configured rate "
        "(a scale model: the same bytes per bandwidth-delay product)"
        if nbytes != cfg.nbytes()
        else f"{nbytes / MiB:g} MiB",
        "tcp_buffers": dict(tun.sysctls) or "the kernel's",
        "calibration": calib,
        "allreduce": allreduce,
        "profile_wall_s": round(time.monotonic() - t0, 1),
    }


def run(cfg: WanBench) -> dict[str, Any]:
    from transport.links.tun.testbed import available

    if (reason := available()) is not None:
        raise SystemExit(f"wan benchmark unavailable: {reason}")
    return {
        "mode": "tun",
        "link": "REAL: kernel TCP between namespaces through the TUN forwarder",
        "topology": cfg.topology,
        "topology_is": TOPOLOGIES[cfg.topology],
        "sites": cfg.sites,
        "bytes": cfg.nbytes(),
        "scale_size": cfg.scale_size,
        "dtype": "float32",
        "connections": list(dict.fromkeys(cfg.connections)),
        "chunk_bytes": cfg.chunk_kb * 1024,
        "repeats": cfg.repeats,
        "warmup": cfg.warmup,
        "max_rate_mbit": cfg.max_rate_mbit,
        "congestion": cfg.congestion or "namespace default (the host's)",
        "order": "every arm once per iteration, order rotated by one per iteration",
        "gloo_mode": "TCP store on site 0, GLOO_SOCKET_IFNAME = site TUN, default algorithm, "
        "in place on a persistent buffer refilled untimed",
        "utilisation_is": "IP bytes a site's TUN sent during the operation / seconds / rate run",
        "ratio_is": "Gloo seconds / lowband seconds (> 1: lowband faster)",
        "profiles": {name: run_profile(cfg, name) for name in cfg.profiles},
    }


# ---- Streaming DiLoCo vs DDP on one profile ------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class DilocoWan:
    """``benchmarks.diloco_wan``'s runs (``lowband worker`` per site, same model and settings as
    ``benchmarks.diloco``'s ``BenchConfig``) on a TUN profile instead of tbf links."""

    profile: str = "intercontinental"
    workers: int = 3
    steps: int = 120
    """Inner steps of DiLoCo and steps of DDP alike: the same tokens for both."""
    repeats: int = 3
    max_rate_mbit: float = 50.0
    timeout: float = 900.0
    net: int = 232
    seed: int = 1

    def __post_init__(self) -> None:
        if self.profile not in PROFILES:
            raise ConfigError("profile", f"one of {list(PROFILES)}")
        if not 2 <= self.workers <= 16 or self.steps < 1 or self.repeats < 1:
            raise ConfigError("workers", "need 2..16 workers, steps >= 1, repeats >= 1")


def diloco_vs_ddp(d: DilocoWan) -> dict[str, Any]:
    from pathlib import Path

    from benchmarks.diloco import BenchConfig
    from benchmarks.diloco_wan import _run, run_order
    from benchmarks.diloco_wan import summarize as summarize_runs
    from diloco.config import DDPConfig
    from transport.links.tun.shape import PathConfig
    from transport.links.tun.testbed import TunConfig, TunTestbed, available

    if (reason := available()) is not None:
        raise SystemExit(f"wan benchmark unavailable: {reason}")
    prof = PROFILES[d.profile]
    rate, label = run_rate(prof, d.max_rate_mbit)
    b = BenchConfig(workers=d.workers)
    configs = {
        "ddp": b.train_config(DDPConfig(), d.steps),
        "streaming_overlap": b.train_config(b.diloco_mode(), d.steps),
    }
    path = PathConfig(delay_ms=prof.rtt_ms / 2, rate_mbit=rate, loss=prof.loss)
    tun = TunConfig(sites=d.workers, path=path, host=True, seed=d.seed, net=d.net)
    runs: dict[str, list[dict[str, Any]]] = {v: [{}] * d.repeats for v in configs}
    with tempfile.TemporaryDirectory(prefix="wandiloco") as tmp, TunTestbed(tun) as bed:
        link: Any = bed  # _run reads ns, host and addr(i): the netns Testbed's shape
        for r, name in run_order(tuple(configs), d.repeats):
            cfg = dataclasses.replace(
                configs[name], eval_every=0, audit_every=0, sync_timeout=300.0
            )
            runs[name][r] = _run(link, cfg, Path(tmp) / f"{name}-{r}", d.timeout)
            print(f"repeat {r} {name}: {json.dumps(runs[name][r])}", file=sys.stderr, flush=True)
    return {
        "mode": "diloco",
        "link": "REAL: lowband workers in TUN-emulated sites (kernel TCP, full mesh)",
        "profile": d.profile,
        "configured": {"rate_mbit": prof.rate_mbit, "rtt_ms": prof.rtt_ms, "loss": prof.loss},
        "rate_mbit_run": rate,
        "rate_label": label,
        "workers": d.workers,
        "steps": d.steps,
        "H": b.inner_steps,
        "P": b.n_fragments,
        "tau": b.tau,
        "codec": b.codec,
        "model": {
            "hidden": b.hidden,
            "layers": b.layers,
            "seq_len": b.seq_len,
            "batch": b.batch_size,
        },
        "repeats": d.repeats,
        "order": "interleaved, rotated by one per repeat",
        **summarize_runs(runs),
        "raw": runs,
    }


# ---- torchft's Streaming DiLoCo on the same profile (the algorithm-level peer) ---------------
LIGHTHOUSE_PORT = 29512


def torchft_diloco(d: DilocoWan, python: str) -> dict[str, Any]:
    """torchft's Streaming DiLoCo against lowband's on one TUN testbed, runs interleaved.

    torchft: Lighthouse on the host endpoint, one replica group of one rank per site,
    ProcessGroupGloo over the site's TUN, the same model, batches, H, P, tau, alpha and steps as
    lowband's ``streaming_overlap`` run (``--diloco``); ``python`` is an interpreter that imports
    torchft (a separate environment: a benchmark-only dependency). Both arms: wall clock of the
    slowest site and the IP bytes a site's TUN sent during the run (headers, ACKs and control
    traffic included, so the two are counted alike)."""
    from pathlib import Path

    from benchmarks.diloco import BenchConfig
    from benchmarks.diloco_wan import _run
    from transport.links.tun.shape import PathConfig
    from transport.links.tun.testbed import TunConfig, TunTestbed

    prof = PROFILES[d.profile]
    rate, label = run_rate(prof, d.max_rate_mbit)
    path = PathConfig(delay_ms=prof.rtt_ms / 2, rate_mbit=rate, loss=prof.loss)
    tun = TunConfig(sites=d.workers, path=path, host=True, seed=d.seed, net=d.net)
    b = BenchConfig(workers=d.workers)
    lowband_cfg = dataclasses.replace(
        b.train_config(b.diloco_mode(), d.steps), eval_every=0, audit_every=0, sync_timeout=300.0
    )
    runs: dict[str, list[dict[str, Any]]] = {"lowband": [], "torchft": []}
    with TunTestbed(tun) as bed, tempfile.TemporaryDirectory(prefix="wantorchft") as tmp:

        def tx() -> int:
            cat = [f"/sys/class/net/{t}/statistics/tx_bytes" for t in bed.tuns]
            return sum(
                int(bed.run_in(i, ["cat", c], capture_output=True, text=True).stdout)
                for i, c in enumerate(cat)
            )

        serve = (
            "import sys; from torchft.coordination import LighthouseServer; "
            f"s = LighthouseServer(bind='0.0.0.0:{LIGHTHOUSE_PORT}', min_replicas={d.workers}); "
            "print('ready', flush=True); sys.stdin.read(); s.shutdown()"
        )
        lh = subprocess.Popen(
            [python, "-c", serve], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        lighthouse = f"http://{bed.host}:{LIGHTHOUSE_PORT}"
        try:
            assert lh.stdout is not None and lh.stdin is not None
            if lh.stdout.readline().strip() != "ready":
                raise RuntimeError("torchft Lighthouse did not start")
            for r in range(d.repeats):
                for arm in ("lowband", "torchft")[r % 2 :] + ("lowband", "torchft")[: r % 2]:
                    tx0 = tx()
                    if arm == "torchft":
                        row = _torchft_run(bed, d, python, lighthouse, tmp, r)
                    else:
                        link: Any = bed  # _run reads ns, host and addr(i), as --diloco
                        work = Path(tmp) / f"lowband-{r}"
                        out = _run(link, lowband_cfg, work, d.timeout)
                        row = {
                            "wall_s": out["wall_s"],
                            "outer_steps": None,
                            "eval_loss": _lowband_final_eval(work, d.workers),
                        }
                    row["site_tx_bytes"] = (tx() - tx0) // d.workers
                    runs[arm].append(row)
                    print(f"repeat {r} {arm}: {json.dumps(row)}", file=sys.stderr, flush=True)
        finally:
            if lh.stdin is not None:
                lh.stdin.close()
            try:
                lh.wait(timeout=10)
            except subprocess.TimeoutExpired:
                lh.kill()
                lh.wait()
    summary = summarize_torchft(runs)
    return {
        "mode": "torchft_vs_lowband_diloco",
        "link": "REAL: worker processes in TUN-emulated sites (kernel TCP, full mesh)",
        "profile": d.profile,
        "configured": {"rate_mbit": prof.rate_mbit, "rtt_ms": prof.rtt_ms, "loss": prof.loss},
        "rate_mbit_run": rate,
        "rate_label": label,
        "workers": d.workers,
        "steps": d.steps,
        "tokens_per_worker": d.steps * b.batch_size * b.seq_len,
        "H": b.inner_steps,
        "P": b.n_fragments,
        "tau": b.tau,
        "alpha": b.alpha,
        "inner": "AdamW lr 6e-3 betas (0.9, 0.95) wd 0.1, linear warm-up then cosine: both arms",
        "lowband_codec": b.codec,
        "torchft_codec": "none (fp32 pseudo-gradients; its should_quantize is Triton GPU kernels)",
        "eval": f"mean cross-entropy over {b.eval_batches} held-out batches (the {b.eval_split} "
        "split), the same for both arms; lowband: the global model after the final drain "
        "(rank 0); torchft: site 0's global parameters (each fragment's last outer step), and "
        "its local model beside it",
        "repeats": d.repeats,
        **summary,
        "torchft_outer_steps": runs["torchft"][0]["outer_steps"],
        "raw": runs,
    }


def summarize_torchft(runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Per arm wall, bytes and eval loss (median, min, max over repeats); the paired wall ratio
    and whether the issue's goal holds: lowband's wall <= 0.8x torchft's at an equal or lower
    eval loss (medians; the must: <= 1.0x)."""
    out: dict[str, Any] = {}
    for arm, rows in runs.items():
        out[arm] = {
            "wall_s": _spread([x["wall_s"] for x in rows], 3),
            "site_tx_bytes": _spread([x["site_tx_bytes"] for x in rows], 0),
        }
        for key in ("eval_loss", "eval_loss_local", "init_eval_loss"):
            vals = [x[key] for x in rows if x.get(key) is not None]
            if vals:
                out[arm][key] = _spread(vals, 4)
    pairs = list(zip(runs["lowband"], runs["torchft"]))
    out["wall_ratio_torchft_over_lowband"] = _spread(
        [t["wall_s"] / lo["wall_s"] for lo, t in pairs], 3
    )
    ratio = statistics.median(lo["wall_s"] / t["wall_s"] for lo, t in pairs)
    out["wall_ratio_lowband_over_torchft"] = round(ratio, 3)
    if "eval_loss" in out["lowband"] and "eval_loss" in out["torchft"]:
        lo_loss = out["lowband"]["eval_loss"]["median"]
        tf_loss = out["torchft"]["eval_loss"]["median"]
        out["eval_loss_gap"] = round((lo_loss - tf_loss) / tf_loss, 4)  # < 0: lowband lower
        out["goal_wall_le_0.8x_at_le_loss"] = bool(ratio <= 0.8 and lo_loss <= tf_loss)
        out["must_wall_le_1.0x_at_le_loss"] = bool(ratio <= 1.0 and lo_loss <= tf_loss)
    return out


def _lowband_final_eval(work: Any, workers: int) -> float | None:
    """The held-out loss rank 0 took of the final global model (each worker's last stdout line
    is its summary; only rank 0 evaluates)."""
    for i in range(workers):
        final = json.loads((work / f"out{i}.txt").read_text().strip().splitlines()[-1])
        if final.get("final_eval") is not None:
            return float(final["final_eval"])
    return None


def _torchft_run(
    bed: Any, d: DilocoWan, python: str, lighthouse: str, tmp: str, r: int
) -> dict[str, Any]:
    procs, outs = [], []
    for i in range(d.workers):
        out = os.path.join(tmp, f"tft-{r}-{i}.json")
        spec = {
            "site": i,
            "addr": bed.addr(i),
            "tun": bed.tuns[i],
            "out": out,
            "lighthouse": lighthouse,
            "workers": d.workers,
            "steps": d.steps,
        }
        env = {**os.environ, "GLOO_SOCKET_IFNAME": bed.tuns[i]}
        args = [python, "-m", "benchmarks.wan", "--torchft-worker", json.dumps(spec)]
        procs.append(bed.popen(i, args, start_new_session=True, env=env))
        outs.append(out)
    try:
        for p in procs:
            p.wait(timeout=d.timeout)
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, 9)
                p.wait()
    if any(p.returncode for p in procs):
        raise RuntimeError(f"torchft workers failed: {[p.returncode for p in procs]}")
    res = []
    for out in outs:
        with open(out) as f:
            res.append(json.load(f))
    return {
        "wall_s": round(max(x["wall_s"] for x in res), 3),
        "outer_steps": res[0]["outer_steps"],
        **{k: res[0][k] for k in ("eval_loss", "eval_loss_local", "init_eval_loss")},
    }


def torchft_worker(spec: dict[str, Any]) -> dict[str, Any]:
    """One torchft replica group (one rank) in its site: the --diloco model and batches."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    from torchft.local_sgd import DiLoCo
    from torchft.manager import Manager
    from torchft.process_group import ProcessGroupGloo

    from benchmarks.diloco import BenchConfig
    from diloco.task import lm_task

    torch.set_num_threads(1)
    b = BenchConfig(workers=spec["workers"])
    # lowband's run config: the same task, inner optimizer and learning-rate schedule
    cfg = b.train_config(b.diloco_mode(), spec["steps"])
    task = lm_task(cfg)
    model: Any = task.build_model()  # lowband's LlamaForCausalLM (HF names)
    opt = cfg.inner
    inner = torch.optim.AdamW(
        model.parameters(),
        lr=opt.lr,
        betas=opt.betas,
        eps=opt.eps,
        weight_decay=opt.weight_decay,
    )
    # P fragments as in lowband's run: embedding + first layer, the middle, the rest
    mods = [model.model.embed_tokens, *model.model.layers, model.model.norm]
    if model.lm_head.weight is not model.model.embed_tokens.weight:  # tied: synced once
        mods.append(model.lm_head)
    k = -(-len(mods) // b.n_fragments)
    frags = [torch.nn.ModuleList(mods[j : j + k]) for j in range(0, len(mods), k)]
    outer = [
        torch.optim.SGD(f.parameters(), lr=b.outer_lr, momentum=b.outer_momentum, nesterov=True)
        for f in frags
    ]
    store = dist.TCPStore(spec["addr"], 0, is_master=True, wait_for_workers=False)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timedelta(seconds=120)),
        min_replica_size=spec["workers"],
        use_async_quorum=False,
        # Every site builds the same model from the same seed, as in lowband's runs; a step-0
        # sync would fetch it over torchft's HTTP checkpoint server, which advertises
        # socket.gethostname(): the machine's name, not the site's TUN address.
        init_sync=False,
        load_state_dict=lambda sd: model.load_state_dict(sd["model"]),
        state_dict=lambda: {"model": model.state_dict()},
        replica_id=f"site{spec['site']}",
        store_addr=spec["addr"],
        store_port=store.port,
        rank=0,
        world_size=1,
        lighthouse_addr=spec["lighthouse"],
        hostname=spec["addr"],
        port=19530,
        timeout=timedelta(seconds=120),
        quorum_timeout=timedelta(seconds=120),
        connect_timeout=timedelta(seconds=60),
    )
    tx0, t0 = _tx_bytes(spec["tun"]), time.perf_counter()
    with DiLoCo(
        manager,
        list(frags),
        inner,
        outer,
        sync_every=b.inner_steps,
        backup_device=torch.device("cpu"),
        pin_memory=False,
        fragment_sync_delay=b.tau,
        fragment_update_alpha=b.alpha,
    ) as diloco:
        for step in range(spec["steps"]):
            for group in inner.param_groups:
                group["lr"] = opt.lr * cfg.lr_schedule.factor(step, spec["steps"])
            loss = task.loss(model, task.train_batch(spec["site"], step))
            inner.zero_grad()
            loss.backward()
            inner.step()
        wall = time.perf_counter() - t0
        out: dict[str, Any] = {
            "wall_s": wall,
            "tx_bytes": _tx_bytes(spec["tun"]) - tx0,
            "outer_steps": manager.current_step(),
            "eval_loss": None,
            "eval_loss_local": None,
            "init_eval_loss": None,
        }
        if spec["site"] == 0:  # untimed, as lowband's final evaluation
            out["eval_loss_local"] = task.evaluate(model)
            local = {k: v.clone() for k, v in model.state_dict().items()}
            # torchft keeps each fragment's global parameters (after its last outer step) as
            # the backup it computes pseudo-gradients against: load those to evaluate them.
            diloco._restore_parameters()
            out["eval_loss"] = task.evaluate(model)
            model.load_state_dict(local)
            out["init_eval_loss"] = task.evaluate(task.build_model())
    manager.shutdown()
    return out


# ---- the worker (one per site, inside its namespace) -----------------------------------------
def _tx_bytes(tun: str) -> int:
    with open(f"/sys/class/net/{tun}/statistics/tx_bytes") as f:
        return int(f.read())


def worker(spec: dict[str, Any]) -> dict[str, Any]:
    import datetime

    import torch
    import torch.distributed as dist

    from transport.config import ZmqConfig
    from transport.zmq_comm import connect

    torch.set_num_threads(1)
    n, tun = spec["sites"], spec["tun"]
    comms = {
        arm: connect(
            coord,
            ZmqConfig(
                connections=parse_arm(arm)[0],
                chunk_bytes=spec["chunk_bytes"],
                timeout=spec["timeout"],
                bind_host=spec["addr"],
                same_host="off",
                max_message_bytes=max(64 * MiB, spec["chunk_bytes"] + MiB),
            ),
            signature="wan-bench",
        )
        for arm, coord in spec["coords"].items()
    }
    gloo = "gloo" in spec["arms"]
    try:
        for comm in comms.values():
            comm.quorum(min_world=n, timeout=spec["timeout"])
        if gloo:
            dist.init_process_group(
                "gloo",
                init_method=spec["gloo_init"],
                rank=spec["site"],
                world_size=n,
                timeout=datetime.timedelta(seconds=spec["timeout"]),
            )
        x = torch.randn(spec["nbytes"] // 4)
        y = torch.empty_like(x)
        ops: dict[str, tuple[Callable[[], Any], Callable[[], Any]]] = {
            arm: (functools.partial(c.all_reduce, x, "sum", algorithm=parse_arm(arm)[1]), c.barrier)
            for arm, c in comms.items()
        }
        if gloo:
            ops["gloo"] = (lambda: dist.all_reduce(y), dist.barrier)
        rows: dict[str, list[tuple[float, int]]] = {arm: [] for arm in spec["arms"]}
        for i in range(spec["iters"]):
            for arm in arm_order(spec["arms"], i):
                op, barrier = ops[arm]
                y.copy_(x)  # Gloo's in-place buffer; untimed for every arm alike
                barrier()
                b0, t0 = _tx_bytes(tun), time.perf_counter()
                op()
                dt, sent = time.perf_counter() - t0, _tx_bytes(tun) - b0
                if i >= spec["warmup"]:
                    rows[arm].append((dt, sent))
        for _, barrier in ops.values():
            # Every site has its last result before any leaves (Gloo's group included).
            barrier()
        return {
            "site": spec["site"],
            "rows": rows,
            "algorithm": {
                arm: c.choose_algorithm(x, None, parse_arm(arm)[1]) for arm, c in comms.items()
            },
        }
    finally:
        if gloo and dist.is_initialized():
            dist.destroy_process_group()
        for comm in comms.values():
            comm.close()


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.wan", description=__doc__.split("\n")[0])
    p.add_argument("--profiles", nargs="+", default=list(PROFILES), choices=list(PROFILES))
    p.add_argument("--sites", type=int, default=4)
    p.add_argument("--size-mb", type=float, default=16.0)
    p.add_argument(
        "--scale-size",
        action="store_true",
        help="scale the tensor with the rate (a scale model of the configured profile)",
    )
    p.add_argument("--connections", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument(
        "--algorithms",
        nargs="+",
        default=["auto", "scatter"],
        help="lowband schedules: auto (ring, unless ZmqConfig says otherwise), ring, scatter",
    )
    p.add_argument("--topology", default="access", choices=list(TOPOLOGIES))
    p.add_argument("--no-gloo", action="store_true")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--max-rate-mbit", type=float, default=50.0)
    p.add_argument("--chunk-kb", type=int, default=256)
    p.add_argument("--calib-seconds", type=float, default=3.0)
    p.add_argument("--udp-count", type=int, default=4000)
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--congestion", default="", help="sites' TCP congestion control (bbr, cubic)")
    p.add_argument(
        "--scale-tcp-buffers",
        action="store_true",
        help="stock kernel TCP buffer maxima scaled by rate run / configured rate",
    )
    p.add_argument("--json", action="store_true", help="only the JSON line")
    p.add_argument("--diloco", action="store_true", help="Streaming DiLoCo vs DDP instead")
    p.add_argument("--diloco-profile", default="intercontinental", choices=list(PROFILES))
    p.add_argument("--diloco-workers", type=int, default=3)
    p.add_argument("--diloco-steps", type=int, default=120)
    p.add_argument("--torchft", metavar="PYTHON", help="torchft's DiLoCo instead, run by PYTHON")
    p.add_argument("--torchft-worker", help=argparse.SUPPRESS)
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.diloco:
        d = DilocoWan(
            profile=args.diloco_profile,
            workers=args.diloco_workers,
            steps=args.diloco_steps,
            repeats=args.repeats,
            max_rate_mbit=args.max_rate_mbit,
        )
        print(json.dumps(diloco_vs_ddp(d)), flush=True)
        return 0
    if args.torchft:
        d = DilocoWan(
            profile=args.diloco_profile,
            workers=args.diloco_workers,
            steps=args.diloco_steps,
            repeats=args.repeats,
            max_rate_mbit=args.max_rate_mbit,
            net=233,
        )
        print(json.dumps(torchft_diloco(d, args.torchft)), flush=True)
        return 0
    if args.torchft_worker:
        spec = json.loads(args.torchft_worker)
        result = torchft_worker(spec)
        with open(spec["out"], "w") as f:
            json.dump(result, f)
        return 0
    if args.worker:
        spec = json.loads(args.worker)
        result = worker(spec)
        with open(spec["out"], "w") as f:
            json.dump(result, f)
        return 0
    cfg = WanBench(
        profiles=tuple(args.profiles),
        sites=args.sites,
        size_mb=args.size_mb,
        scale_size=args.scale_size,
        connections=tuple(args.connections),
        algorithms=tuple(args.algorithms),
        topology=args.topology,
        gloo=not args.no_gloo,
        repeats=args.repeats,
        warmup=args.warmup,
        max_rate_mbit=args.max_rate_mbit,
        chunk_kb=args.chunk_kb,
        calib_seconds=args.calib_seconds,
        udp_count=args.udp_count,
        timeout=args.timeout,
        congestion=args.congestion,
        scale_tcp_buffers=args.scale_tcp_buffers,
    )
    result = run(cfg)
    if not args.json:
        for k, v in result.items():
            print(f"{k:>16}: {v}")
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
