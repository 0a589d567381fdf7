"""Calibration of the TUN WAN emulator: what kernel TCP and UDP in the sites actually measure.

Each ``measure_*`` runs :mod:`transport.links.tun.probe` ends in two sites of a running
:class:`~transport.links.tun.testbed.TunTestbed` (receiver in site 0, sender in site 1) and returns
figures; :func:`calibrate` runs them on the reference links and ``python -m transport.links.tun
--calibrate --json`` prints the result as one JSON line last. Tests assert on these figures.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from dataclasses import replace
from typing import Any, Sequence

from transport.links.tun.shape import GilbertElliott, PathConfig
from transport.links.tun.testbed import TunConfig, TunTestbed

_PROBE = [sys.executable, "-m", "transport.links.tun.probe"]


def _start(bed: TunTestbed, site: int, args: list[str]) -> subprocess.Popen[str]:
    """A probe server, returned once it listens."""
    proc = bed.popen(site, [*_PROBE, *args], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    if not json.loads(proc.stdout.readline() or "{}").get("ready"):
        proc.kill()
        proc.wait()
        raise RuntimeError(f"probe {args[0]} did not start in site {site}")
    return proc


def _finish(proc: subprocess.Popen[str], timeout: float) -> dict[str, Any]:
    try:
        out, _ = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    if proc.returncode != 0 or not out.strip():
        raise RuntimeError(f"probe failed (exit code {proc.returncode})")
    result: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
    return result


def _client(bed: TunTestbed, site: int, args: list[str], timeout: float) -> dict[str, Any]:
    return _finish(bed.popen(site, [*_PROBE, *args], stdout=subprocess.PIPE, text=True), timeout)


def measure_rtt(
    bed: TunTestbed,
    count: int = 20,
    port: int = 5301,
    *,
    src: int = 1,
    dst: int = 0,
    realtime: bool = False,
) -> dict[str, Any]:
    """Site ``src`` connects ``count`` times to site ``dst``: TCP handshake round trips.

    ``realtime`` runs the connecting end at real-time priority (``chrt``; root), so that the
    host's other load does not delay its wake-up when the SYN-ACK is back: the figure is then
    the path's, not the scheduler's."""
    host = bed.addr(dst)
    sink = _start(
        bed, dst, ["tcp-sink", "--bind", host, "--port", str(port), "--conns", str(count)]
    )
    try:
        args = ["connect-rtt", "--host", host, "--port", str(port), "--count", str(count)]
        chrt = ["chrt", "-f", "10"] if realtime else []
        proc = bed.popen(src, [*chrt, *_PROBE, *args], stdout=subprocess.PIPE, text=True)
        rtt = _finish(proc, 60)["rtt_s"]
    finally:
        _finish(sink, 10)
    ms = [r * 1e3 for r in rtt]
    return {
        "median_ms": round(statistics.median(ms), 3),
        "min_ms": round(min(ms), 3),
        "max_ms": round(max(ms), 3),
    }


LADDER_MS = (0.2, 0.3, 0.5, 1.0, 2.0, 4.0, 10.0)
"""Round trips from a switched LAN (0.2 ms) to a far Wi-Fi path (10 ms)."""


def rtt_tolerance_ms(rtt_ms: float) -> float:
    """How far a measured RTT may be from the configured one: 10 % + 50 µs (issue 39)."""
    return 0.1 * rtt_ms + 0.05


def set_rtt(bed: TunTestbed, rtt_ms: float, *, src: int = 1, dst: int = 0) -> None:
    """Both directions between ``src`` and ``dst``: half of ``rtt_ms`` each, nothing else."""
    for a, b in ((src, dst), (dst, src)):
        bed.set_path(a, b, PathConfig(delay_ms=rtt_ms / 2))


def rtt_ladder(
    bed: TunTestbed,
    rtts_ms: Sequence[float] = LADDER_MS,
    *,
    repeats: int = 5,
    count: int = 20,
    port: int = 5320,
) -> list[dict[str, Any]]:
    """Configured vs measured RTT (TCP connects site 1 → site 0) at each of ``rtts_ms``: each
    rung ``repeats`` times, in an order rotated by one per repeat; per rung the median, min and
    max of the repeats' medians, the error of the median and whether it is within
    :func:`rtt_tolerance_ms`. Leaves the path at the last rung measured."""
    medians: dict[float, list[float]] = {r: [] for r in rtts_ms}
    order = list(rtts_ms)
    for i in range(repeats):
        for rtt in order[i % len(order) :] + order[: i % len(order)]:
            set_rtt(bed, rtt)
            medians[rtt].append(measure_rtt(bed, count=count, port=port)["median_ms"])
    rows = []
    for rtt, got in medians.items():
        med = statistics.median(got)
        rows.append(
            {
                "configured_rtt_ms": rtt,
                "measured_rtt_ms": {"median": round(med, 3), "min": min(got), "max": max(got)},
                "error_ms": round(med - rtt, 3),
                "within_tolerance": abs(med - rtt) <= rtt_tolerance_ms(rtt),
            }
        )
    return rows


def _flow(
    bed: TunTestbed,
    seconds: float,
    *,
    rcvbuf: int,
    sndbuf: int,
    port: int,
    cc: str = "",
    during: Any = None,
) -> tuple[dict[str, Any], dict[str, Any]]:
    sink = _start(
        bed, 0, ["tcp-sink", "--bind", bed.addr(0), "--port", str(port), "--rcvbuf", str(rcvbuf)]
    )
    try:
        src = bed.popen(
            1,
            [
                *_PROBE,
                "tcp-source",
                "--host",
                bed.addr(0),
                "--port",
                str(port),
                "--seconds",
                str(seconds),
                "--sndbuf",
                str(sndbuf),
                *(["--cc", cc] if cc else []),
            ],
            stdout=subprocess.PIPE,
            text=True,
        )
        extra = during() if during is not None else {}
        sent = _finish(src, seconds + 60)
    finally:
        conn = _finish(sink, 60)["conns"][0]
    return {**conn, "sent": sent["bytes"]}, extra


def measure_goodput(
    bed: TunTestbed,
    seconds: float = 4.0,
    *,
    rcvbuf: int = 0,
    sndbuf: int = 0,
    warmup: float = 1.0,
    port: int = 5302,
    cc: str = "",
) -> dict[str, Any]:
    """One TCP flow site 1 → site 0 for ``seconds`` (congestion control ``cc``, empty: the
    namespace's default): goodput over the whole flow and after the first ``warmup`` seconds
    (start-up excluded), and how many packets the bottleneck queue dropped."""
    warmup = min(warmup, seconds / 4)  # a short flow keeps most of its length
    before = bed.stats()["paths"]["1->0"]["queue_drops"]
    conn, _ = _flow(bed, seconds, rcvbuf=rcvbuf, sndbuf=sndbuf, port=port, cc=cc)
    drops = bed.stats()["paths"]["1->0"]["queue_drops"] - before
    first, last = conn["first"], conn["last"]
    late = sum(v for k, v in conn["buckets"].items() if int(k) * 0.05 >= first + warmup)
    late_start = (int((first + warmup) / 0.05) + 1) * 0.05
    return {
        "bytes": conn["bytes"],
        "goodput_mbit": round(conn["bytes"] * 8 / (last - first) / 1e6, 2),
        "steady_goodput_mbit": round(late * 8 / (last - late_start) / 1e6, 2),
        "rcvbuf": rcvbuf,
        "sndbuf": sndbuf,
        "cc": cc or "default",
        "queue_drops": drops,
    }


def measure_udp_loss(
    bed: TunTestbed, count: int = 4000, pps: float = 2000.0, port: int = 5303
) -> dict[str, Any]:
    """``count`` paced datagrams site 1 → site 0: the fraction that did not arrive, the mean
    length of a run of lost ones, and how many arrived after a later one."""
    before = bed.stats()["paths"]["1->0"]
    host, p, n = bed.addr(0), str(port), str(count)
    sink = _start(bed, 0, ["udp-sink", "--bind", host, "--port", p, "--count", n])
    try:
        args = ["udp-source", "--host", host, "--port", p, "--count", n, "--pps", str(pps)]
        _client(bed, 1, args, 120)
    finally:
        got = _finish(sink, 30)
    after = bed.stats()["paths"]["1->0"]
    runs = got["loss_runs"]
    return {
        "sent": count,
        "received": got["received"],
        "loss": round(1 - got["received"] / count, 5),
        "mean_loss_run": round(sum(runs) / len(runs), 3) if runs else 0.0,
        "reordered": got["reordered"],
        "forwarder_lost": after["lost"] - before["lost"],
        "forwarder_reordered": after["reordered"] - before["reordered"],
        "queue_drops": after["queue_drops"] - before["queue_drops"],
    }


def measure_outage(
    bed: TunTestbed, *, at: float = 1.5, down_s: float = 1.0, seconds: float = 5.0, port: int = 5304
) -> dict[str, Any]:
    """A TCP flow site 1 → site 0 during which the link goes down for ``down_s``: what passed
    while it was down (forwarder count and receiver bytes) and when data flowed again."""
    marks: dict[str, Any] = {}

    def cut() -> dict[str, Any]:
        time.sleep(at)  # the flow's own pace: nothing to await, the cut is at a time into it
        bed.down()
        marks["down"] = time.monotonic()
        marks["before"] = bed.stats()["paths"]
        time.sleep(down_s)
        marks["during"] = bed.stats()["paths"]
        marks["up"] = time.monotonic()
        bed.up()
        return marks

    conn, m = _flow(bed, seconds, rcvbuf=0, sndbuf=0, port=port, during=cut)
    delivered = sum(m["during"][k]["delivered"] - m["before"][k]["delivered"] for k in m["before"])
    b = {int(k) * 0.05: v for k, v in conn["buckets"].items()}
    inside = sum(v for t, v in b.items() if t >= m["down"] + 0.05 and t + 0.05 <= m["up"])
    after = sorted(t for t in b if t >= m["up"])
    return {
        "down_s": round(m["up"] - m["down"], 3),
        "packets_forwarded_while_down": delivered,
        "bytes_received_while_down": inside,
        "bytes_received_after_up": sum(b[t] for t in after),
        "resumed_after_s": round(after[0] - m["up"], 3) if after else None,
    }


def calibrate(*, seconds: float = 4.0, seed: int | None = 1) -> dict[str, Any]:
    """The reference figures: 20 ms each way at 50 Mbit/s (RTT, goodput with default and with
    small buffers and with cubic, a 1 s outage), 1 % random loss, Gilbert-Elliott loss with
    reordering, and the forwarder's own ceiling."""
    wan = PathConfig(delay_ms=20.0, rate_mbit=50.0)
    out: dict[str, Any] = {
        "configured": {"one_way_delay_ms": 20.0, "rate_mbit": 50.0, "loss": 0.01}
    }
    with TunTestbed(TunConfig(path=wan, seed=seed)) as bed:
        out["rtt"] = measure_rtt(bed)
        out["goodput_default_buffers"] = measure_goodput(bed, seconds)
        out["goodput_rcvbuf_32k"] = measure_goodput(bed, seconds, rcvbuf=32 << 10, port=5305)
        out["goodput_cubic"] = measure_goodput(bed, seconds, cc="cubic", port=5307)
        out["outage"] = measure_outage(bed)
    with TunTestbed(TunConfig(path=replace(wan, loss=0.01), seed=seed)) as bed:
        out["udp_loss"] = measure_udp_loss(bed)
    ge = GilbertElliott(p=0.01, r=0.25)
    bursty = replace(wan, burst=ge, reorder=0.05, reorder_ms=3.0)
    with TunTestbed(TunConfig(path=bursty, seed=seed)) as bed:
        out["bursty_loss"] = measure_udp_loss(bed, count=6000, pps=3000)
        out["bursty_loss"]["configured"] = {
            "mean_loss": round(ge.mean_loss, 5),
            "mean_loss_run": 1 / ge.r,
            "reorder": 0.05,
        }
    # The forwarder's own limit (no rate configured, MTU 1500): with no delay and at 40 ms RTT.
    with TunTestbed(TunConfig(path=PathConfig(), seed=seed)) as bed:
        out["ceiling"] = measure_goodput(bed, seconds)
        out["ceiling"]["rtt"] = measure_rtt(bed, port=5306)
    with TunTestbed(TunConfig(path=PathConfig(delay_ms=20.0), seed=seed)) as bed:
        out["ceiling_rtt40"] = measure_goodput(bed, seconds)
    out["bdp_bytes"] = int(50e6 / 8 * 0.040)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m transport.links.tun")
    p.add_argument("--calibrate", action="store_true", required=True, help="measure the emulator")
    p.add_argument("--seconds", type=float, default=4.0, help="length of each TCP flow")
    p.add_argument("--json", action="store_true", help="only the JSON line")
    args = p.parse_args(argv)
    result = calibrate(seconds=args.seconds)
    if not args.json:
        for k, v in result.items():
            print(f"{k}: {v}")
    print(json.dumps(result))
    return 0
