"""Measuring ends run inside the sites: TCP sink/source, TCP connect RTT, UDP sink/source.

``python -m transport.links.tun.probe MODE ...``; servers print ``{"ready": true}`` once they
listen (the caller starts the client only then), and every mode prints one JSON line last.
Times are ``time.monotonic()`` values: one clock for every namespace on the host, so the caller
can line a receiver's arrivals up with the moments it cut the link.
"""

from __future__ import annotations

import argparse
import json
import socket
import struct
import sys
import time
from typing import Any, Sequence

_BUCKET_S = 0.05  # arrival histogram resolution of the TCP sink
_END = 0xFFFFFFFF  # UDP sequence number that ends a run


def _print(obj: dict[str, Any]) -> None:
    print(json.dumps(obj), flush=True)


def tcp_sink(args: argparse.Namespace) -> None:
    """Accept ``conns`` connections one after the other; per connection the bytes read, the
    first and last arrival times and an arrival histogram."""
    srv = socket.socket()
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if args.rcvbuf:  # before listen: the accepted socket inherits it and its window scale
        srv.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, args.rcvbuf)
    srv.bind((args.bind, args.port))
    srv.listen(64)
    _print({"ready": True})
    out = []
    for _ in range(args.conns):
        conn, _ = srv.accept()
        n, first, last = 0, 0.0, 0.0
        buckets: dict[int, int] = {}
        buf = bytearray(1 << 20)
        while True:
            k = conn.recv_into(buf)
            if not k:
                break
            last = time.monotonic()
            first = first or last
            n += k
            b = int(last / _BUCKET_S)
            buckets[b] = buckets.get(b, 0) + k
        conn.close()
        out.append({"bytes": n, "first": first, "last": last, "buckets": buckets})
    _print({"conns": out, "bucket_s": _BUCKET_S})


def tcp_source(args: argparse.Namespace) -> None:
    """Send for ``seconds`` as fast as TCP lets us, then close."""
    s = socket.socket()
    if args.sndbuf:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, args.sndbuf)
    if args.cc:  # per socket: any available algorithm, even one a namespace may not default to
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, args.cc.encode())
    s.connect((args.host, args.port))
    chunk = b"\0" * (64 << 10)
    n, t0 = 0, time.monotonic()
    while time.monotonic() - t0 < args.seconds:
        n += s.send(chunk)
    s.close()
    _print({"bytes": n, "start": t0})


def connect_rtt(args: argparse.Namespace) -> None:
    """``count`` TCP connects; each ``connect()`` returns when the SYN-ACK is back: one RTT."""
    rtts = []
    for _ in range(args.count):
        s = socket.socket()
        t0 = time.perf_counter()
        s.connect((args.host, args.port))
        rtts.append(time.perf_counter() - t0)
        s.close()
    _print({"rtt_s": rtts})


def udp_sink(args: argparse.Namespace) -> None:
    """Until ``linger`` s after the end marker (or ``idle`` s of silence): distinct sequence
    numbers received, arrivals that came after a higher number (reordered), and the runs of
    missing numbers below ``count`` (loss bursts)."""
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
    s.bind((args.bind, args.port))
    s.settimeout(args.idle)
    _print({"ready": True})
    seen: set[int] = set()
    top, reordered = -1, 0
    while True:
        try:
            data = s.recv(65536)
        except socket.timeout:
            break
        (seq,) = struct.unpack_from("!I", data)
        if seq == _END:  # datagrams held back (reordering) may still come after it
            s.settimeout(args.linger)
            continue
        reordered += seq < top
        top = max(top, seq)
        seen.add(seq)
    runs, run = [], 0
    for i in range(args.count or top + 1):
        if i in seen:
            if run:
                runs.append(run)
            run = 0
        else:
            run += 1
    if run:
        runs.append(run)
    _print({"received": len(seen), "reordered": reordered, "loss_runs": runs})


def udp_source(args: argparse.Namespace) -> None:
    """``count`` datagrams of ``size`` bytes, paced at ``pps`` (no burst overflows a queue on
    the way: what is missing was lost on the link), then end markers."""
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    pad = b"\0" * max(0, args.size - 4)
    t0 = time.monotonic()
    for i in range(args.count):
        delay = t0 + i / args.pps - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        s.sendto(struct.pack("!I", i) + pad, (args.host, args.port))
    for _ in range(20):  # some may be lost too; one is enough
        s.sendto(struct.pack("!I", _END), (args.host, args.port))
        time.sleep(0.005)
    _print({"sent": args.count})


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m transport.links.tun.probe")
    sub = p.add_subparsers(dest="mode", required=True)
    m = sub.add_parser("tcp-sink")
    m.add_argument("--bind", required=True)
    m.add_argument("--port", type=int, required=True)
    m.add_argument("--conns", type=int, default=1)
    m.add_argument("--rcvbuf", type=int, default=0)
    m.set_defaults(run=tcp_sink)
    m = sub.add_parser("tcp-source")
    m.add_argument("--host", required=True)
    m.add_argument("--port", type=int, required=True)
    m.add_argument("--seconds", type=float, required=True)
    m.add_argument("--sndbuf", type=int, default=0)
    m.add_argument("--cc", default="", help="TCP congestion control of this socket")
    m.set_defaults(run=tcp_source)
    m = sub.add_parser("connect-rtt")
    m.add_argument("--host", required=True)
    m.add_argument("--port", type=int, required=True)
    m.add_argument("--count", type=int, default=20)
    m.set_defaults(run=connect_rtt)
    m = sub.add_parser("udp-sink")
    m.add_argument("--bind", required=True)
    m.add_argument("--port", type=int, required=True)
    m.add_argument("--idle", type=float, default=3.0)
    m.add_argument("--linger", type=float, default=0.3)
    m.add_argument("--count", type=int, default=0, help="datagrams sent (0: up to the last seen)")
    m.set_defaults(run=udp_sink)
    m = sub.add_parser("udp-source")
    m.add_argument("--host", required=True)
    m.add_argument("--port", type=int, required=True)
    m.add_argument("--count", type=int, required=True)
    m.add_argument("--size", type=int, default=200)
    m.add_argument("--pps", type=float, default=2000.0)
    m.set_defaults(run=udp_source)
    args = p.parse_args(argv)
    args.run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
