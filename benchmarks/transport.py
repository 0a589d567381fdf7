"""Transport benchmarks. Each mode prints one JSON line, the last line of its output.

    python -m benchmarks.transport allreduce --world 4 --size-mb 64 --connections 4 --vs-gloo --json
    python -m benchmarks.transport netns --size-mb 25 --rate-mbit 100        # needs root + iproute2

``allreduce`` starts ``world`` processes on this machine. Each joins a lowband group with the
requested ``--transport``: ``auto`` (the default, and the library's: shared memory when every
rank is on this host, as here), or forced ``tcp`` (127.0.0.1, like Gloo), ``ipc`` (Unix sockets)
or ``shm``. ``transport`` in the output is the path that actually ran. Unless that is TCP, every
rank also joins a second, TCP-only lowband group, and the same run reports it as ``tcp_*``.
With ``--vs-gloo`` each rank also joins a torch.distributed Gloo group over TCP on 127.0.0.1;
``ratio_vs_gloo`` is then always lowband's TCP against Gloo's TCP (sockets against sockets, the
path a WAN uses), and ``same_host_ratio_vs_gloo`` the shared-memory path against Gloo's TCP, a
separate row because Gloo has no shared-memory transport (not like for like). Gloo runs in place
on a persistent buffer; refilling it with the input happens before the barrier, untimed.
Iterations rotate through the groups (barrier, then the timed all-reduce), so a load spike on
this shared machine hits all alike. An iteration's time is its slowest rank's; reported times
are medians.
algbw = bytes / seconds; busbw = algbw · 2(n-1)/n (the nccl-tests convention). CPU seconds per
operation (all threads of all ranks, ZeroMQ's I/O threads included) are reported as well: on a
busy machine they show efficiency better than wall time.

``netns`` moves ``size_mb`` between two network namespaces joined by a veth pair shaped with
``tc tbf`` (kernel TCP) for each K in ``--connections``, rounds interleaved, and reports goodput
medians with min/max. This kernel has no netem, so that link has no propagation delay.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from lowband.comm import ALGORITHMS
from lowband.errors import ConfigError
from lowband.proc import free_port

MiB = 1 << 20
TRANSPORTS = ("auto", "tcp", "ipc", "shm")
_SAME_HOST = {"auto": "auto", "tcp": "off", "ipc": "ipc", "shm": "shm"}


# ---- allreduce -----------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class AllReduceBench:
    world: int = 4
    size_mb: float = 64.0
    connections: int = 4
    chunk_mb: float = 4.0
    algorithm: str = "auto"
    codec: str = "none"
    iters: int = 7
    warmup: int = 2
    vs_gloo: bool = False
    threads: int = 1
    """torch intra-op threads per rank, for lowband and Gloo alike (the ranks share the cores)."""
    transport: str = "auto"
    """auto: the library default (ZmqConfig.same_host="auto"); tcp: TCP over 127.0.0.1 like
    Gloo; ipc / shm: the other same-host settings. Unless tcp, TCP is measured as well."""
    socket_buffer_kb: int = 0
    gc_freeze: bool = False
    """Call gc.freeze() in each rank after start-up (applies to the Gloo runs in the same
    processes too): full collections then skip torch's ~10^5 import-time objects."""
    timeout: float = 120.0

    def __post_init__(self) -> None:
        if not 1 <= self.world <= 64:
            raise ConfigError("world", f"must be in [1, 64], got {self.world}")
        if self.size_mb <= 0 or self.chunk_mb <= 0:
            raise ConfigError("size_mb", "sizes must be > 0")
        if self.iters < 1 or self.warmup < 0:
            raise ConfigError("iters", "need iters >= 1 and warmup >= 0")
        if self.transport not in TRANSPORTS:
            raise ConfigError(
                "transport", f"one of {', '.join(TRANSPORTS)}, got {self.transport!r}"
            )
        if self.algorithm not in ALGORITHMS:
            raise ConfigError("algorithm", f"unknown algorithm {self.algorithm!r}")

    @property
    def nbytes(self) -> int:
        return int(self.size_mb * MiB) // 4 * 4


def bus_bandwidth(nbytes: int, seconds: float, world: int) -> tuple[float, float]:
    """(algbw, busbw) in GB/s."""
    algbw = nbytes / seconds / 1e9
    return algbw, (algbw * 2 * (world - 1) / world if world > 1 else algbw)


def _cpu_seconds() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)  # every thread of this process
    return ru.ru_utime + ru.ru_stime


def _timed(
    run: Callable[[], Any], barrier: Callable[[], Any], prepare: Callable[[], Any] | None = None
) -> tuple[float, float]:
    if prepare is not None:  # untimed: e.g. refilling an in-place buffer
        prepare()
    barrier()
    c0, t0 = _cpu_seconds(), time.perf_counter()
    run()
    return time.perf_counter() - t0, _cpu_seconds() - c0


def _allreduce_worker(args: argparse.Namespace) -> dict[str, Any]:
    import gc

    import torch
    import torch.distributed as dist

    from lowband.codecs import get_codec
    from transport.zmq_comm import ZmqConfig, connect

    torch.set_num_threads(args.threads)
    chunk = int(args.chunk_mb * MiB)

    def join(coord: str, same_host: str):
        cfg = ZmqConfig(
            connections=args.connections,
            chunk_bytes=chunk,
            timeout=args.timeout,
            bind_host="127.0.0.1",
            same_host=same_host,
            socket_buffer_bytes=args.socket_buffer_kb * 1024,
            max_message_bytes=max(64 * MiB, chunk + MiB),
        )
        return connect(coord, cfg, signature="bench")

    comms = {"lowband": join(args.coord, _SAME_HOST[args.transport])}
    if args.tcp_coord:
        comms["tcp"] = join(args.tcp_coord, "off")
    gloo = bool(args.gloo)
    try:
        for comm in comms.values():
            m = comm.quorum(min_world=args.world, timeout=args.timeout)
        if gloo:
            dist.init_process_group(
                "gloo", init_method=args.gloo, rank=m.rank, world_size=args.world
            )
        x = torch.randn(args.nbytes // 4)
        codec = None if args.codec == "none" else get_codec(args.codec)
        y = torch.empty_like(x)

        def refill() -> None:
            # Gloo at its best: in place on a persistent buffer (as DDP does), refilled with the
            # input before each run, outside the timed region (the refill is not Gloo's cost).
            # lowband returns a new tensor (from its result pool), inside its timing.
            y.copy_(x)

        runs: dict[str, tuple[Callable[[], Any], Callable[[], Any], Callable[[], Any] | None]] = {
            name: (
                (lambda c=c: c.all_reduce(x, "sum", codec=codec, algorithm=args.algorithm)),
                c.barrier,
                None,
            )
            for name, c in comms.items()
        }
        if gloo:
            runs["gloo"] = (lambda: dist.all_reduce(y), dist.barrier, refill)
        if args.gc_freeze:
            gc.freeze()  # move start-up objects (torch's) out of the collector's way
        gc_time = [0.0, 0.0]

        def gc_clock(phase: str, info: dict) -> None:
            if phase == "start":
                gc_time[1] = time.perf_counter()
            else:
                gc_time[0] += time.perf_counter() - gc_time[1]

        gc.callbacks.append(gc_clock)
        rows: dict[str, list[tuple[float, float]]] = {name: [] for name in runs}
        sent0 = comms["lowband"].stats().bytes_sent
        names = list(runs)
        for i in range(args.warmup + args.iters):
            # the peers alternate: each iteration starts with the next one (every rank agrees)
            for name in names[i % len(names) :] + names[: i % len(names)]:
                run, barrier, prepare = runs[name]
                row = _timed(run, barrier, prepare)
                if i >= args.warmup:
                    rows[name].append(row)
            if i == 0:
                sent = comms["lowband"].stats().bytes_sent - sent0  # one all-reduce (+ barrier)
            if i == args.warmup - 1:
                gc_time[0] = 0.0
        gc.callbacks.remove(gc_clock)
        return {
            "rank": m.rank,
            "rows": rows,
            "bytes_sent": sent,
            "gc_seconds": gc_time[0],
            "algorithm": {
                n: c.choose_algorithm(x, codec, args.algorithm) for n, c in comms.items()
            },
            "route": {n: c.route(x, codec, args.algorithm) for n, c in comms.items()},
        }
    finally:
        if gloo and dist.is_initialized():
            dist.destroy_process_group()
        for comm in comms.values():
            comm.close()


def _spawn_workers(mode: str, world: int, extra: list[str], timeout: float) -> list[dict[str, Any]]:
    """Run ``world`` worker processes (own process groups, killed on failure); their JSON."""
    with tempfile.TemporaryDirectory() as tmp:
        outs = [os.path.join(tmp, f"{mode}-{i}.json") for i in range(world)]
        procs = [
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "benchmarks.transport",
                    "_worker",
                    mode,
                    "--out",
                    out,
                    *extra,
                ],
                start_new_session=True,
            )
            for out in outs
        ]
        try:
            for p in procs:
                p.wait(timeout=timeout)
        finally:
            for p in procs:
                if p.poll() is None:
                    os.killpg(p.pid, 9)
                    p.wait()
        bad = [p.returncode for p in procs if p.returncode != 0]
        if bad:
            raise RuntimeError(f"{mode} benchmark workers failed with exit codes {bad}")
        results = []
        for out in outs:
            with open(out) as f:
                results.append(json.load(f))
    return results


def allreduce(cfg: AllReduceBench) -> dict[str, Any]:
    import contextlib

    from transport.coordinator import Coordinator, CoordinatorConfig

    def coordinator() -> Coordinator:
        return Coordinator(CoordinatorConfig(bind="tcp://127.0.0.1:0", heartbeat_interval=2.0))

    extra = [
        "--world",
        str(cfg.world),
        "--nbytes",
        str(cfg.nbytes),
        "--iters",
        str(cfg.iters),
        "--warmup",
        str(cfg.warmup),
        "--threads",
        str(cfg.threads),
        "--connections",
        str(cfg.connections),
        "--chunk-mb",
        str(cfg.chunk_mb),
        "--algorithm",
        cfg.algorithm,
        "--codec",
        cfg.codec,
        "--timeout",
        str(cfg.timeout),
        "--transport",
        cfg.transport,
        "--socket-buffer-kb",
        str(cfg.socket_buffer_kb),
        "--gloo",
        f"tcp://127.0.0.1:{free_port()}" if cfg.vs_gloo else "",
        "--gc-freeze",
        str(int(cfg.gc_freeze)),
    ]
    with contextlib.ExitStack() as stack:
        coord = stack.enter_context(coordinator())
        tcp_coord = stack.enter_context(coordinator()) if cfg.transport != "tcp" else None
        extra += ["--tcp-coord", tcp_coord.address if tcp_coord else ""]
        ranks = _spawn_workers(
            "allreduce", cfg.world, ["--coord", coord.address, *extra], cfg.timeout * 4
        )

    def summary(kind: str) -> tuple[float, float, float]:
        """Median seconds (slowest rank), median CPU seconds (all ranks), busbw GB/s."""
        per_iter = [max(r["rows"][kind][i][0] for r in ranks) for i in range(cfg.iters)]
        cpu = [sum(r["rows"][kind][i][1] for r in ranks) for i in range(cfg.iters)]
        seconds = statistics.median(per_iter)
        return seconds, statistics.median(cpu), bus_bandwidth(cfg.nbytes, seconds, cfg.world)[1]

    def per_iter_ratio(kind: str) -> float:
        return statistics.median(
            max(r["rows"]["gloo"][i][0] for r in ranks) / max(r["rows"][kind][i][0] for r in ranks)
            for i in range(cfg.iters)
        )

    seconds, cpu, busbw = summary("lowband")
    algbw = bus_bandwidth(cfg.nbytes, seconds, cfg.world)[0]
    kinds = ["lowband"] + (["tcp"] if tcp_coord else []) + (["gloo"] if cfg.vs_gloo else [])
    result: dict[str, Any] = {
        "mode": "allreduce",
        "transport": ranks[0]["route"]["lowband"],
        "transport_requested": cfg.transport,
        "world": cfg.world,
        "bytes": cfg.nbytes,
        "dtype": "float32",
        "connections": cfg.connections,
        "chunk_bytes": int(cfg.chunk_mb * MiB),
        "algorithm": ranks[0]["algorithm"]["lowband"],
        "codec": cfg.codec,
        "iters": cfg.iters,
        "threads_per_rank": cfg.threads,
        "seconds": round(seconds, 5),
        "algbw_GBps": round(algbw, 4),
        "busbw_GBps": round(busbw, 4),
        "bytes_sent_per_rank": ranks[0]["bytes_sent"],
        "cpu_seconds_per_op": round(cpu, 4),
        "gc_freeze": cfg.gc_freeze,
        "gc_seconds_per_iter_all_ranks": round(
            sum(r["gc_seconds"] for r in ranks) / (cfg.iters * len(kinds)), 4
        ),
    }
    if tcp_coord:
        tsec, tcpu, tbus = summary("tcp")
        result.update(
            {
                "tcp_transport": ranks[0]["route"]["tcp"],
                "tcp_algorithm": ranks[0]["algorithm"]["tcp"],
                "tcp_seconds": round(tsec, 5),
                "tcp_algbw_GBps": round(bus_bandwidth(cfg.nbytes, tsec, cfg.world)[0], 4),
                "tcp_busbw_GBps": round(tbus, 4),
                "tcp_cpu_seconds_per_op": round(tcpu, 4),
            }
        )
    if cfg.vs_gloo:
        gsec, gcpu, gbus = summary("gloo")
        result.update(
            {
                "gloo_seconds": round(gsec, 5),
                "gloo_algbw_GBps": round(bus_bandwidth(cfg.nbytes, gsec, cfg.world)[0], 4),
                "gloo_busbw_GBps": round(gbus, 4),
                "gloo_cpu_seconds_per_op": round(gcpu, 4),
                "gloo_mode": "in place on a persistent buffer (refilled untimed, then all_reduce)",
            }
        )
        # The headline is like for like: lowband's TCP (the WAN path) against Gloo's TCP. The
        # same-host shortcut (shared memory) is its own, labelled row: Gloo has no shared-memory
        # transport, so that ratio compares different mechanisms.
        tcp_kind = "tcp" if tcp_coord else "lowband"
        tcp_bus = result["tcp_busbw_GBps"] if tcp_coord else busbw
        result.update(
            {
                "ratio_vs_gloo": round(tcp_bus / gbus, 3),
                "ratio_vs_gloo_per_iter_median": round(per_iter_ratio(tcp_kind), 3),
                "ratio_vs_gloo_is": "lowband TCP vs Gloo TCP (127.0.0.1), busbw",
            }
        )
        if tcp_coord:
            result.update(
                {
                    "same_host_ratio_vs_gloo": round(busbw / gbus, 3),
                    "same_host_ratio_vs_gloo_per_iter_median": round(per_iter_ratio("lowband"), 3),
                    "same_host_ratio_vs_gloo_is": f"lowband {result['transport']} vs Gloo TCP: not "
                    "like for like (Gloo has no shared-memory transport)",
                }
            )
    return result


# ---- netns ---------------------------------------------------------------------------------------
def netns(size_mb: float, rate_mbit: float, connections: list[int], repeats: int) -> dict[str, Any]:
    """Kernel TCP through tbf for each K in ``connections``: ``repeats`` rounds, each K once per
    round in an order rotated by one per round; goodput median (min/max) per K.

    This kernel has no netem, so the veth link has no propagation delay (RTT ~0.1 ms): a TCP
    window never binds here, and this measures what K costs or gains on a rate-limited link, not
    the long-fat-pipe effect (``benchmarks.tun_wan`` measures that, over a real RTT)."""
    from transport.links.netns import (
        NetnsConfig,
        Testbed,
        TransferConfig,
        available,
        measure_transfer,
    )

    reason = available()
    if reason:
        raise SystemExit(f"netns benchmark unavailable: {reason}")
    ks = list(dict.fromkeys(connections))
    runs: dict[int, list[dict[str, Any]]] = {k: [] for k in ks}
    with Testbed(NetnsConfig(rate_mbit=rate_mbit)) as link:
        for r in range(repeats):
            for k in ks[r % len(ks) :] + ks[: r % len(ks)]:
                runs[k].append(
                    measure_transfer(
                        link, TransferConfig(size_mb=size_mb, connections=k, repeats=1)
                    )
                )
    rows = []
    for k in ks:
        g = [x["goodput_mbit"] for x in runs[k]]
        rows.append(
            {
                "connections": k,
                "goodput_mbit": {
                    "median": round(statistics.median(g), 2),
                    "min": min(g),
                    "max": max(g),
                },
                "utilisation_median": round(statistics.median(g) / rate_mbit, 4),
                "all": g,
            }
        )
    return {
        "mode": "netns",
        "link": f"REAL: kernel TCP, veth between namespaces shaped by tc "
        f"tbf {rate_mbit:g} Mbit/s, no added delay (no netem)",
        "rate_mbit": rate_mbit,
        "bytes": runs[ks[0]][0]["bytes"],
        "repeats": repeats,
        "order": "each K once per round, rotated by one per round",
        "results": rows,
        "median_ratio_last_vs_first_k": round(
            rows[-1]["goodput_mbit"]["median"] / rows[0]["goodput_mbit"]["median"], 3
        ),
    }


# ---- command line --------------------------------------------------------------------------------
def _print(result: dict[str, Any], json_only: bool) -> None:
    if not json_only:
        for k, v in result.items():
            print(f"{k:>30}: {v}")
    print(json.dumps(result), flush=True)


def _run_allreduce(args: argparse.Namespace) -> int:
    cfg = AllReduceBench(
        world=args.world,
        size_mb=args.size_mb,
        connections=args.connections,
        chunk_mb=args.chunk_mb,
        algorithm=args.algorithm,
        codec=args.codec,
        iters=args.iters,
        warmup=args.warmup,
        vs_gloo=args.vs_gloo,
        threads=args.threads,
        transport=args.transport,
        socket_buffer_kb=args.socket_buffer_kb,
        gc_freeze=args.gc_freeze,
    )
    _print(allreduce(cfg), args.json)
    return 0


def _run_netns(args: argparse.Namespace) -> int:
    _print(netns(args.size_mb, args.rate_mbit, args.connections, args.repeats), args.json)
    return 0


def add_modes(sub: argparse._SubParsersAction) -> None:
    """The benchmark modes, of ``python -m benchmarks.transport``."""
    d = AllReduceBench()
    p = sub.add_parser("allreduce", help="all-reduce across local processes, optionally vs Gloo")
    p.add_argument("--world", type=int, default=d.world, help="ranks (processes)")
    p.add_argument("--size-mb", type=float, default=d.size_mb, help="float32 payload, MiB")
    p.add_argument("--connections", type=int, default=d.connections, help="K connections per pair")
    p.add_argument("--chunk-mb", type=float, default=d.chunk_mb, help="chunk size, MiB")
    p.add_argument("--algorithm", default=d.algorithm, choices=list(ALGORITHMS))
    p.add_argument("--codec", default=d.codec, help="none, or a codec name (int8, fp4, ...)")
    p.add_argument("--iters", type=int, default=d.iters)
    p.add_argument("--warmup", type=int, default=d.warmup)
    p.add_argument("--threads", type=int, default=d.threads, help="torch threads per rank")
    p.add_argument(
        "--transport",
        default=d.transport,
        choices=list(TRANSPORTS),
        help="auto (default: what the library does, shared memory for an all-local "
        "group; TCP is then measured too), or force tcp (as Gloo), ipc (Unix "
        "sockets) or shm",
    )
    p.add_argument(
        "--socket-buffer-kb",
        type=int,
        default=d.socket_buffer_kb,
        help="SO_SNDBUF/SO_RCVBUF in KiB (0: kernel auto-tuning)",
    )
    p.add_argument("--vs-gloo", action="store_true", help="also measure torch.distributed Gloo")
    p.add_argument(
        "--gc-freeze",
        action="store_true",
        help="gc.freeze() in every rank after start-up (Gloo runs there too)",
    )
    p.add_argument("--json", action="store_true", help="print only the JSON line")
    p.set_defaults(run=_run_allreduce)

    p = sub.add_parser("netns", help="goodput on a tbf-shaped veth link between namespaces (root)")
    p.add_argument("--size-mb", type=float, default=25.0)
    p.add_argument("--rate-mbit", type=float, default=100.0)
    p.add_argument(
        "--connections",
        type=int,
        nargs="+",
        default=[1, 4],
        help="K values, each measured once per round",
    )
    p.add_argument("--repeats", type=int, default=5, help="rounds")
    p.add_argument("--json", action="store_true")
    p.set_defaults(run=_run_netns)


def _worker_parser(sub: argparse._SubParsersAction) -> None:
    w = sub.add_parser("_worker", help=argparse.SUPPRESS)
    w.add_argument("kind", choices=["allreduce"])
    w.add_argument("--out", required=True)
    w.add_argument("--coord", required=True)
    w.add_argument("--gloo", default="")
    w.add_argument("--tcp-coord", default="")
    w.add_argument("--gc-freeze", type=int, default=0)
    for name, typ in (
        ("--world", int),
        ("--nbytes", int),
        ("--iters", int),
        ("--warmup", int),
        ("--threads", int),
        ("--connections", int),
        ("--chunk-mb", float),
        ("--timeout", float),
        ("--socket-buffer-kb", int),
    ):
        w.add_argument(name, type=typ, required=True)
    for name in ("--algorithm", "--codec", "--transport"):
        w.add_argument(name, required=True)

    def run(args: argparse.Namespace) -> int:
        result = _allreduce_worker(args)
        with open(args.out, "w") as f:
            json.dump(result, f)
        return 0

    w.set_defaults(run=run)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.transport",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="mode", required=True)
    add_modes(sub)
    _worker_parser(sub)
    args = parser.parse_args(argv)
    return int(args.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
