"""Transport benchmarks. Each mode prints one JSON line, the last line of its output.

    python -m transport.bench allreduce --world 4 --size-mb 64 --connections 4 --vs-gloo --json
    python -m transport.bench emulator --size-mb 8 --bandwidth-mbit 200 --delay-ms 50 --window-kb 256
    python -m transport.bench netns --size-mb 50 --rate-mbit 100          # needs root + iproute2

``allreduce`` runs ``world`` separate processes on this machine (real TCP on 127.0.0.1) and, with
``--vs-gloo``, the same all-reduce with torch.distributed's Gloo backend in the same run, so the
ratio is meaningful on a shared, noisy machine. Timing per iteration: a barrier, then the
all-reduce; the iteration's time is the slowest rank's; the reported time is the median over
iterations. algbw = bytes / seconds; busbw = algbw · 2(n-1)/n (the nccl-tests convention: the
bytes each rank must move, so it is comparable across world sizes).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from typing import Any, Sequence

from lowband.errors import ConfigError

MiB = 1 << 20


@dataclass(frozen=True, kw_only=True)
class AllReduceBench:
    world: int = 4
    size_mb: float = 64.0
    connections: int = 4
    chunk_mb: float = 4.0
    algorithm: str = "auto"
    codec: str = "none"
    iters: int = 5
    warmup: int = 2
    vs_gloo: bool = False
    threads: int = 1
    """torch intra-op threads per rank, for lowband and Gloo alike (ranks share the cores)."""
    transport: str = "tcp"
    """tcp: TCP over 127.0.0.1 like Gloo; ipc: lowband's same-host Unix-socket path."""
    socket_buffer_kb: int = 0
    timeout: float = 120.0

    def __post_init__(self) -> None:
        if not 1 <= self.world <= 64:
            raise ConfigError("world", f"must be in [1, 64], got {self.world}")
        if self.size_mb <= 0 or self.chunk_mb <= 0:
            raise ConfigError("size_mb", "sizes must be > 0")
        if self.iters < 1 or self.warmup < 0:
            raise ConfigError("iters", "need iters >= 1 and warmup >= 0")
        if self.transport not in ("tcp", "ipc"):
            raise ConfigError("transport", f"tcp or ipc, got {self.transport!r}")
        if self.algorithm not in ("auto", "ring", "star"):
            raise ConfigError("algorithm", f"unknown algorithm {self.algorithm!r}")

    @property
    def nbytes(self) -> int:
        return int(self.size_mb * MiB) // 4 * 4


def _bandwidths(nbytes: int, seconds: float, world: int) -> tuple[float, float]:
    algbw = nbytes / seconds / 1e9
    return algbw, algbw * 2 * (world - 1) / world if world > 1 else algbw


# ---- worker processes ---------------------------------------------------------------------------
def _cpu_seconds() -> float:
    import resource
    ru = resource.getrusage(resource.RUSAGE_SELF)  # all threads, ZeroMQ's I/O threads included
    return ru.ru_utime + ru.ru_stime


def _time_iterations(run, barrier, gather_max, iters: int, warmup: int) -> tuple[list[float], float]:
    """Per-iteration times (slowest rank) and this rank's CPU seconds per iteration."""
    times = []
    cpu = 0.0
    for i in range(warmup + iters):
        barrier()
        c0 = _cpu_seconds()
        t0 = time.perf_counter()
        run()
        dt = time.perf_counter() - t0
        if i >= warmup:
            cpu += _cpu_seconds() - c0
            times.append(gather_max(dt))
    return times, cpu / iters


def _lowband_worker(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from lowband.codecs import get_codec
    from transport.zmq_comm import ZmqConfig, connect

    torch.set_num_threads(args.threads)
    cfg = ZmqConfig(connections=args.connections, chunk_bytes=int(args.chunk_mb * MiB),
                    timeout=args.timeout, bind_host="127.0.0.1",
                    same_host_ipc=args.transport == "ipc",
                    socket_buffer_bytes=args.socket_buffer_kb * 1024,
                    max_message_bytes=max(64 * MiB, int(args.chunk_mb * MiB) + MiB))
    comm = connect(args.coord, cfg, signature="bench")
    try:
        comm.quorum(min_world=args.world, timeout=args.timeout)
        x = torch.randn(args.nbytes // 4)
        codec = None if args.codec == "none" else get_codec(args.codec)
        algo = comm.choose_algorithm(x, codec, args.algorithm)

        def gather_max(dt: float) -> float:
            return max(t.item() for t in comm.all_gather(torch.tensor([dt], dtype=torch.float64)))

        before = comm.stats()
        times, cpu = _time_iterations(
            lambda: comm.all_reduce(x, "sum", codec=codec, algorithm=args.algorithm),
            comm.barrier, gather_max, args.iters, args.warmup)
        after = comm.stats()
        return {"rank": comm.rank, "times": times, "cpu": cpu, "algorithm": algo,
                "bytes_sent": after.bytes_sent - before.bytes_sent}
    finally:
        comm.close()


def _gloo_worker(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", init_method=args.coord, rank=args.rank, world_size=args.world)
    try:
        x = torch.randn(args.nbytes // 4)

        def run() -> None:
            y = x.clone()  # all_reduce is in place; lowband returns a new tensor, so both allocate
            dist.all_reduce(y)

        def gather_max(dt: float) -> float:
            t = torch.tensor([dt], dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            return t.item()

        times, cpu = _time_iterations(run, dist.barrier, gather_max, args.iters, args.warmup)
        return {"rank": args.rank, "times": times, "cpu": cpu}
    finally:
        dist.destroy_process_group()


def _spawn(kind: str, cfg: AllReduceBench, coord: str) -> list[dict[str, Any]]:
    procs = []
    common = ["--world", str(cfg.world), "--nbytes", str(cfg.nbytes), "--iters", str(cfg.iters),
              "--warmup", str(cfg.warmup), "--threads", str(cfg.threads), "--coord", coord,
              "--connections", str(cfg.connections), "--chunk-mb", str(cfg.chunk_mb),
              "--algorithm", cfg.algorithm, "--codec", cfg.codec, "--timeout", str(cfg.timeout),
              "--transport", cfg.transport, "--socket-buffer-kb", str(cfg.socket_buffer_kb)]
    with tempfile.TemporaryDirectory() as tmp:
        outs = []
        for rank in range(cfg.world):
            path = os.path.join(tmp, f"{kind}-{rank}.json")
            outs.append(path)
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "transport.bench", "_worker", kind, "--rank", str(rank),
                 "--out", path, *common], start_new_session=True))
        try:
            for p in procs:
                p.wait(timeout=cfg.timeout * 3)
        finally:
            for p in procs:
                if p.poll() is None:
                    os.killpg(p.pid, 9)
                    p.wait()
        bad = [p.returncode for p in procs if p.returncode != 0]
        if bad:
            raise RuntimeError(f"{kind} benchmark workers failed with exit codes {bad}")
        results = []
        for path in outs:
            with open(path) as f:
                results.append(json.load(f))
    return results


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def allreduce(cfg: AllReduceBench) -> dict[str, Any]:
    from transport.coordinator import Coordinator, CoordinatorConfig

    with Coordinator(CoordinatorConfig(bind="tcp://127.0.0.1:0", heartbeat_interval=2.0)) as coord:
        ours = _spawn("lowband", cfg, coord.address)
    seconds = statistics.median(max(r["times"][i] for r in ours) for i in range(cfg.iters))
    algbw, busbw = _bandwidths(cfg.nbytes, seconds, cfg.world)
    result: dict[str, Any] = {
        "mode": "allreduce", "transport": cfg.transport, "world": cfg.world, "bytes": cfg.nbytes,
        "dtype": "float32", "connections": cfg.connections, "chunk_bytes": int(cfg.chunk_mb * MiB),
        "algorithm": ours[0]["algorithm"], "codec": cfg.codec, "iters": cfg.iters,
        "threads_per_rank": cfg.threads, "seconds": round(seconds, 5),
        "algbw_GBps": round(algbw, 4), "busbw_GBps": round(busbw, 4),
        "bytes_sent_per_rank": ours[0]["bytes_sent"] // (cfg.iters + cfg.warmup),
        "cpu_seconds_per_op": round(sum(r["cpu"] for r in ours), 4),
    }
    if cfg.vs_gloo:
        gloo = _spawn("gloo", cfg, f"tcp://127.0.0.1:{_free_port()}")
        gsec = statistics.median(max(r["times"][i] for r in gloo) for i in range(cfg.iters))
        galg, gbus = _bandwidths(cfg.nbytes, gsec, cfg.world)
        result.update({"gloo_seconds": round(gsec, 5), "gloo_algbw_GBps": round(galg, 4),
                       "gloo_busbw_GBps": round(gbus, 4), "ratio_vs_gloo": round(busbw / gbus, 3),
                       "gloo_cpu_seconds_per_op": round(sum(r["cpu"] for r in gloo), 4)})
    return result


# ---- command line ---------------------------------------------------------------------------------
def add_allreduce_arguments(p: argparse.ArgumentParser) -> None:
    d = AllReduceBench()
    p.add_argument("--world", type=int, default=d.world, help="ranks (processes)")
    p.add_argument("--size-mb", type=float, default=d.size_mb, help="float32 payload, MiB")
    p.add_argument("--connections", type=int, default=d.connections, help="K connections per pair")
    p.add_argument("--chunk-mb", type=float, default=d.chunk_mb, help="chunk size, MiB")
    p.add_argument("--algorithm", default=d.algorithm, choices=["auto", "ring", "star"])
    p.add_argument("--codec", default=d.codec, help="none, or a codec name (int8, fp4, ...)")
    p.add_argument("--iters", type=int, default=d.iters)
    p.add_argument("--warmup", type=int, default=d.warmup)
    p.add_argument("--threads", type=int, default=d.threads, help="torch threads per rank")
    p.add_argument("--transport", default=d.transport, choices=["tcp", "ipc"],
                   help="tcp (as Gloo) or ipc (lowband's same-host Unix-socket path)")
    p.add_argument("--socket-buffer-kb", type=int, default=d.socket_buffer_kb,
                   help="SO_SNDBUF/SO_RCVBUF in KiB (0: kernel auto-tuning)")
    p.add_argument("--vs-gloo", action="store_true", help="also measure torch.distributed Gloo")
    p.add_argument("--json", action="store_true", help="print only the JSON line")


def allreduce_config(args: argparse.Namespace) -> AllReduceBench:
    return AllReduceBench(world=args.world, size_mb=args.size_mb, connections=args.connections,
                          chunk_mb=args.chunk_mb, algorithm=args.algorithm, codec=args.codec,
                          iters=args.iters, warmup=args.warmup, vs_gloo=args.vs_gloo,
                          threads=args.threads, transport=args.transport,
                          socket_buffer_kb=args.socket_buffer_kb)


def print_result(result: dict[str, Any], json_only: bool) -> None:
    if not json_only:
        for k, v in result.items():
            print(f"{k:>24}: {v}")
    print(json.dumps(result), flush=True)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m transport.bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="mode", required=True)
    add_allreduce_arguments(sub.add_parser("allreduce", help="all-reduce vs Gloo"))
    w = sub.add_parser("_worker", help=argparse.SUPPRESS)
    w.add_argument("kind", choices=["lowband", "gloo"])
    for name, typ in (("--rank", int), ("--world", int), ("--nbytes", int), ("--iters", int),
                      ("--warmup", int), ("--threads", int), ("--connections", int),
                      ("--chunk-mb", float), ("--timeout", float), ("--socket-buffer-kb", int)):
        w.add_argument(name, type=typ, required=True)
    for name in ("--coord", "--out", "--algorithm", "--codec", "--transport"):
        w.add_argument(name, required=True)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.mode == "_worker":
        fn = _lowband_worker if args.kind == "lowband" else _gloo_worker
        result = fn(args)
        with open(args.out, "w") as f:
            json.dump(result, f)
        return 0
    if args.mode == "allreduce":
        print_result(allreduce(allreduce_config(args)), args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
