"""Shipping a worker its weights over an emulated Wi-Fi path (root: the TUN emulator).

    python -m benchmarks.ship_wan --size-mb 32 --repeats 5 --json

Two TUN sites (:mod:`transport.links.tun`): the master in site 0 serves a ``size_mb`` file with
:func:`edge.cluster.ship.offer`, the worker in site 1 fetches it into an empty cache with
:func:`edge.cluster.ship.receive` (wants of ``chunk_mb``, four in flight, SHA-256 checked) over
the lowband transport (ZMQ, one connection). After a warm-up round, arms alternating per repeat
(order rotated):

- ``ship_<chunk>``: a fresh fetch with each chunk size;
- ``bulk``: the same bytes as one ``send`` of a uint8 tensor (what the link and transport give
  without chunking, hashing or writing: the peer to beat);
- ``cached``: a fetch whose files are all in the cache (no bytes move).

Reported: seconds (median, min, max) and goodput in Mbit/s; the path's RTT measured by TCP
connects on the same testbed. The path defaults to the issue's ``wifi`` profile (4 ms RTT,
1 ms jitter, 0.5 % loss, 100 Mbit/s each way).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from lowband.errors import ConfigError


@dataclass(frozen=True, kw_only=True)
class ShipBench:
    size_mb: float = 32.0
    repeats: int = 5
    chunks_mb: tuple[float, ...] = (1.0, 4.0)
    """Want sizes of the ship arms (at most 4 MiB: edge.cluster.ship.MAX_CHUNK)."""
    rtt_ms: float = 4.0
    jitter_ms: float = 1.0
    loss: float = 0.005
    rate_mbit: float = 100.0
    timeout: float = 120.0

    def __post_init__(self) -> None:
        if not 0 < self.size_mb <= 4096 or self.repeats < 1 or not self.chunks_mb:
            raise ConfigError("bench", "need 0 < size_mb <= 4096, repeats >= 1, some chunks")
        if any(not 0 < c <= 4.0 for c in self.chunks_mb):
            raise ConfigError("chunks_mb", "each in (0, 4] MiB")

    @property
    def arms(self) -> list[str]:
        return [f"ship_{c:g}mb" for c in self.chunks_mb] + ["bulk", "cached"]


def _peer(args: argparse.Namespace) -> int:
    """One side, inside its namespace: the master (site 0, also the coordinator) or the worker."""
    import torch

    from edge.cluster.ship import FetchConfig, ShipServer, offer, receive
    from transport.links.netns import peer_session
    from transport.zmq_comm import ZmqConfig

    cfg = ShipBench(**json.loads(args.cfg))
    zc = ZmqConfig(bind_host=args.bind, connections=1, timeout=cfg.timeout)
    zc = ZmqConfig(
        bind_host=args.bind,
        connections=1,
        timeout=cfg.timeout,
        max_message_bytes=max(zc.max_message_bytes, int(cfg.size_mb * (1 << 20)) + (1 << 20)),
    )
    times: dict[str, list[float]] = {a: [] for a in cfg.arms}
    with peer_session(args.coord, args.bind, zc, "ship", serve=args.role == "master") as comm:
        comm.quorum(min_world=2, timeout=cfg.timeout)
        other = 1 - comm.rank
        server = ShipServer({"model.bin": Path(args.file)}) if args.role == "master" else None
        blob = (
            torch.frombuffer(bytearray(Path(args.file).read_bytes()), dtype=torch.uint8)
            if (args.role == "master")
            else None
        )
        arms = cfg.arms
        for rep in range(-1, cfg.repeats):  # -1: a warm-up round (fills the cached arm's cache)
            for arm in arms[rep % len(arms) :] + arms[: rep % len(arms)]:
                cache = Path(args.cache) / arm
                if args.role == "worker" and arm != "cached":
                    shutil.rmtree(cache, ignore_errors=True)
                comm.barrier(timeout=cfg.timeout)
                t0 = time.perf_counter()
                if arm == "bulk":
                    if blob is not None:
                        comm.send(other, [blob], tag="bulk", timeout=cfg.timeout)
                    else:
                        comm.recv(other, tag="bulk", timeout=cfg.timeout)
                elif server is not None:
                    offer(comm, other, server, timeout=cfg.timeout)
                else:
                    chunk = cfg.chunks_mb[0] if arm == "cached" else float(arm[5:-2])
                    fc = FetchConfig(cache_dir=cache, chunk_bytes=int(chunk * (1 << 20)))
                    receive(comm, other, fc, timeout=cfg.timeout)
                if args.role == "worker" and rep >= 0:
                    times[arm].append(time.perf_counter() - t0)
        comm.barrier(timeout=cfg.timeout)
        if args.role == "worker":
            print(json.dumps({"times": times}), flush=True)
    return 0


def run(cfg: ShipBench) -> dict[str, Any]:
    from dataclasses import asdict

    from benchmarks.diloco_wan import spread
    from transport.links.tun.calibrate import measure_rtt
    from transport.links.tun.shape import PathConfig
    from transport.links.tun.testbed import TunConfig, TunTestbed, available

    if (reason := available()) is not None:
        raise SystemExit(f"ship benchmark unavailable: {reason}")
    path = PathConfig(
        delay_ms=cfg.rtt_ms / 2,
        jitter_ms=cfg.jitter_ms / 2,
        loss=cfg.loss,
        rate_mbit=cfg.rate_mbit,
    )
    work = Path(tempfile.mkdtemp(prefix="lowband-ship-"))
    try:
        model = work / "model.bin"
        model.write_bytes(os.urandom(int(cfg.size_mb * (1 << 20))))
        with TunTestbed(TunConfig(path=path)) as bed:
            rtt = measure_rtt(bed, count=20, realtime=True)
            port = 29500 + os.getpid() % 400
            common = ["--coord", f"tcp://{bed.addr(0)}:{port}", "--file", str(model)]
            common += ["--cache", str(work / "cache"), "--cfg", json.dumps(asdict(cfg))]
            me = [sys.executable, "-m", "benchmarks.ship_wan", "_peer"]
            procs = [
                bed.popen(
                    i,
                    [*me, role, "--bind", bed.addr(i), *common],
                    stdout=subprocess.PIPE,
                    text=True,
                    start_new_session=True,
                )
                for i, role in ((0, "master"), (1, "worker"))
            ]
            budget = cfg.timeout * len(cfg.arms) * cfg.repeats
            try:
                out, _ = procs[1].communicate(timeout=budget)
                procs[0].wait(timeout=60)
            finally:
                for p in procs:
                    if p.poll() is None:
                        os.killpg(p.pid, 9)
                        p.wait()
            if procs[1].returncode != 0 or not out.strip():
                raise RuntimeError(f"the worker failed (exit code {procs[1].returncode})")
            times = json.loads(out.strip().splitlines()[-1])["times"]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    bits = cfg.size_mb * (1 << 20) * 8
    arms: dict[str, Any] = {}
    for arm, ts in times.items():
        arms[arm] = {"seconds": spread(ts, 4)}
        if arm != "cached":
            arms[arm]["goodput_mbit"] = spread([bits / t / 1e6 for t in ts], 2)
    bulk = arms["bulk"]["seconds"]["median"]
    for arm in arms:
        if arm.startswith("ship_"):
            arms[arm]["vs_bulk"] = round(bulk / arms[arm]["seconds"]["median"], 3)
    return {
        "link": "REAL: lowband ZMQ transport between two namespaces through the TUN forwarder",
        "configured": {
            "rtt_ms": cfg.rtt_ms,
            "jitter_ms": cfg.jitter_ms,
            "loss": cfg.loss,
            "rate_mbit": cfg.rate_mbit,
        },
        "measured_rtt_ms": rtt,
        "bytes": int(cfg.size_mb * (1 << 20)),
        "repeats": cfg.repeats,
        "order": "arms rotated by one per repeat",
        "arms": arms,
    }


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["_peer"]:
        p = argparse.ArgumentParser(prog="python -m benchmarks.ship_wan _peer")
        p.add_argument("role", choices=["master", "worker"])
        for flag in ("--bind", "--coord", "--file", "--cache", "--cfg"):
            p.add_argument(flag, required=True)
        return _peer(p.parse_args(argv[1:]))
    p = argparse.ArgumentParser(prog="python -m benchmarks.ship_wan")
    p.add_argument("--size-mb", type=float, default=32.0)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--chunk-mb", type=float, nargs="+", default=[1.0, 4.0])
    p.add_argument("--rtt-ms", type=float, default=4.0)
    p.add_argument("--jitter-ms", type=float, default=1.0)
    p.add_argument("--loss", type=float, default=0.005)
    p.add_argument("--rate-mbit", type=float, default=100.0)
    p.add_argument("--timeout", type=float, default=120.0, help="seconds per transfer")
    p.add_argument("--json", action="store_true", help="only the JSON line")
    args = p.parse_args(argv)
    try:
        cfg = ShipBench(
            size_mb=args.size_mb,
            repeats=args.repeats,
            chunks_mb=tuple(args.chunk_mb),
            rtt_ms=args.rtt_ms,
            jitter_ms=args.jitter_ms,
            loss=args.loss,
            rate_mbit=args.rate_mbit,
            timeout=args.timeout,
        )
    except ConfigError as e:
        p.error(str(e))
    result = run(cfg)
    if not args.json:
        for arm, r in result["arms"].items():
            mbit = r.get("goodput_mbit", {}).get("median")
            print(f"{arm}: {r['seconds']['median']} s, {mbit} Mbit/s")
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
