"""Distributed decode over the links phones and Pis have: one device vs TP-2 vs pipeline-2 vs
replica-2 (the whole model on both devices, the streams spread over them) vs the planner's
default (``--layout auto``) vs the planner told to plan for the benchmark's concurrent streams
(``auto-busy``: ``--plan-streams``), on the TUN emulator (root).

    python -m benchmarks.edge_wan --json                       # the real Gemma 3 270M Q4_K_M
    python -m benchmarks.edge_wan --tiny --json                # smoke run (a tiny random model)

Two namespaces joined by :mod:`transport.links.tun` (kernel TCP sees the configured round trip,
jitter, loss and a 100 Mbit/s bottleneck each way). The master (``lowband edge serve``) runs in
site 0 pinned to core 0, its worker (``lowband edge worker``) in site 1 pinned to core 1, one
thread each: a device per namespace. Per profile every arm's processes are started (one after
the other, each waiting for /health, so the auto arm measures an idle machine), then the arms
are measured alternately, ``repeats`` rounds:

* single-stream ms/token: one streamed greedy completion of ``tokens`` tokens (``ignore_eos``);
  ms/token = (last chunk - first chunk) / (chunks - 1), first-token latency beside it;
* aggregate tokens/s with ``streams`` concurrent completions (TP skipped on links of 4 ms and
  more: its step pays 2 round trips per layer, minutes per run; said in the record).

The client runs inside site 0 and talks to the master over that namespace's loopback. Idle arms
keep their heartbeat (a ping every 2 s) while another is measured. The link's round trip is
measured (TCP handshakes) and recorded per profile.

The emulator shares the machine's two cores with the devices it joins: every record carries the
forwarder's CPU (seconds per second) during each arm's streams, and the master's time per step
(``master_cycle``: its stage, the head, the link, waiting for the other stage; the replica's
rows per device and its own groups' time, ``edge.cluster.replica.ReplicaTimes``; see
``edge.cluster.pipeline.CycleTimes``). The forwarder spins before a packet's due time only on
paths under 2 ms RTT (``--spin-us``): there the scheduler's wake-up latency would show in the
round trip; on Wi-Fi paths it is lost in the jitter, and the spin (0.19 s of CPU per second at
8 streams over ``wifi``, measured) was taken from the emulated devices.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from lowband.proc import free_port

PROFILES: dict[str, dict[str, float]] = {
    # configured round trip, jitter (each way, RTT/20: RTT/10 peak to peak), loss per packet
    "ethernet": {"rtt_ms": 0.3, "jitter_ms": 0.0, "loss": 0.0},
    "wifi": {"rtt_ms": 4.0, "jitter_ms": 0.2, "loss": 0.005},
    "wifi-far": {"rtt_ms": 10.0, "jitter_ms": 0.5, "loss": 0.005},
}
# auto-busy: the planner told to plan for the benchmark's concurrent streams (--plan-streams);
# window: one device within the memory budget (--budget-frac), the sliding window streaming
# its layers from storage paced at --paced-mbps; replica-2: the replica layout with 2 groups
# per device in flight (--replica-lanes 2; replica: the default, 1)
ARMS = ("single", "tp", "pipeline", "replica", "replica-2", "auto", "auto-busy", "window")
DEFAULT_ARMS = ("single", "tp", "pipeline", "replica", "auto", "auto-busy")
BUDGET_ARMS = ("single", "window", "pipeline")  # the default arms of a --budget-frac run
PROMPT = "The history of the bicycle begins in"


@dataclass(frozen=True, kw_only=True)
class Bench:
    model: str
    profiles: tuple[str, ...] = ("wifi",)
    repeats: int = 5
    tokens: int = 64
    streams: int = 8
    rate_mbit: float = 100.0
    startup_s: float = 240.0
    micro_batches: int = 3
    # the pipeline arm's --weights (relative speeds of the master and the worker: the master
    # also embeds, samples and serves HTTP, so it may be given fewer layers); None: even split
    weights: str | None = None
    arms: tuple[str, ...] = DEFAULT_ARMS  # which arms run (``single``, the baseline, always does)
    # the forwarder's spin before each packet's due time (µs; transport.links.tun.timer), or
    # None: 300 on sub-2 ms paths, where the scheduler's wake-up latency would show in the
    # round trip, 0 on the others, where it is lost in the jitter and the spin would take CPU
    # from the emulated devices (two cores: every µs the forwarder spins is the master's or
    # the worker's)
    spin_us: float | None = None
    # the model that fits no single device: every device's memory budget this fraction of the
    # file's weight bytes (MB passed as --memory-budget-mb to the window arm, the one device
    # streaming its layers, and to the pipeline arm, each stage sized to hold its layers)
    budget_frac: float | None = None
    paced_mbps: float = 40.0  # the window arm's storage (MB/s, 1e6 bytes: microSD class)
    paced_tokens: int = 3  # tokens per completion of the window arm (seconds per token)
    paced_stream_rounds: int = 1  # rounds in which the window arm also runs the streams

    def __post_init__(self) -> None:
        if self.budget_frac is not None and not 0 < self.budget_frac <= 1:
            raise ValueError(f"budget_frac must be in (0, 1], got {self.budget_frac}")
        if self.paced_mbps <= 0 or self.paced_tokens < 2:
            raise ValueError("paced_mbps must be > 0 and paced_tokens >= 2")


# ---- the client (runs inside site 0) ------------------------------------------------------------
def _post(port: int, body: dict, timeout: float = 600.0):
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    return urllib.request.urlopen(req, timeout=timeout)


def client_single(port: int, tokens: int) -> dict:
    body = {"model": "m", "prompt": PROMPT, "max_tokens": tokens, "temperature": 0}
    body.update(ignore_eos=True, stream=True)
    t0 = time.perf_counter()
    stamps = []
    with _post(port, body) as resp:
        for line in resp:
            if line.startswith(b"data: ") and not line.startswith(b"data: [DONE]"):
                if json.loads(line[6:]).get("choices"):
                    stamps.append(time.perf_counter())
    if len(stamps) < 2:
        raise RuntimeError(f"only {len(stamps)} chunks streamed")
    return {
        "ms_per_token": 1e3 * (stamps[-1] - stamps[0]) / (len(stamps) - 1),
        "first_token_ms": 1e3 * (stamps[0] - t0),
        "chunks": len(stamps),
    }


def client_streams(
    port: int, tokens: int, streams: int, prompt_of: Callable[[int], str] | None = None
) -> dict:
    """``streams`` concurrent greedy completions of ``tokens`` tokens each (stream i's prompt
    ``prompt_of(i)``, by default the benchmark's prompt numbered i); aggregate tokens/s over the
    wall time, and the errors of streams that failed."""
    got: list[int] = []
    errors: list[str] = []

    def one(i: int) -> None:
        prompt = prompt_of(i) if prompt_of is not None else f"{PROMPT} {i}"
        body = {"model": "m", "prompt": prompt, "max_tokens": tokens, "temperature": 0}
        body["ignore_eos"] = True
        try:
            with _post(port, body) as resp:
                got.append(json.loads(resp.read())["usage"]["completion_tokens"])
        except Exception as exc:  # noqa: BLE001 - reported, the run goes on
            errors.append(repr(exc))

    t0 = time.perf_counter()
    threads = [threading.Thread(target=one, args=(i,)) for i in range(streams)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    return {"tokens_per_s": sum(got) / wall, "tokens": sum(got), "errors": errors}


# ---- orchestration ------------------------------------------------------------------------------
def _lowband(*args: str) -> list[str]:
    return [sys.executable, "-m", "cli", "edge", *args]


def weight_mb(model: str) -> float:
    """MB (2^20) of a GGUF file's tensors: the figure the budget is a fraction of."""
    from edge.formats.gguf_window import stage_sizes

    layers, embed, head, tied = stage_sizes(model)
    return (sum(layers) + embed + (0 if tied else head)) / 2**20


def budget_mb(cfg: Bench) -> float | None:
    return None if cfg.budget_frac is None else round(cfg.budget_frac * weight_mb(cfg.model), 1)


def paced_serve(mbps: float, argv: Sequence[str]) -> int:
    """``lowband edge serve`` whose sliding window reads its blocks as if from a storage
    device of ``mbps`` MB/s: every block load costs max(its real time, bytes / rate), one load
    at a time (``edge.moe.store.StorageDevice``, as ``benchmarks.edge_window_gguf
    --paced-mbps``): the page cache of this machine must not make a phone's microSD free."""
    from cli import main as cli_main
    from edge.moe.store import StorageDevice
    from edge.window import MappedSpans

    dev = StorageDevice(mbps * 1e6)
    plain = MappedSpans.populate

    def populate(self: MappedSpans) -> None:
        dev.read(lambda: plain(self), self.size)

    MappedSpans.populate = populate  # type: ignore[method-assign]
    return cli_main(list(argv))


def rss_mb(pid: int) -> dict[str, float] | None:
    """A process's memory now (VmRSS, its anonymous and file-backed parts) and its peak."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    keys = {"VmRSS": "rss", "VmHWM": "peak", "RssAnon": "anon", "RssFile": "file"}
    out = {}
    for line in text.splitlines():
        k = line.split(":")[0]
        if k in keys:
            out[keys[k]] = round(int(line.split()[1]) / 1024, 1)
    return out


class Arm:
    def __init__(self, name: str, bed: Any, cfg: Bench, log_dir: Path) -> None:
        self.name, self.bed, self.cfg = name, bed, cfg
        self.port, cport = free_port(), free_port()
        self.procs: list[subprocess.Popen] = []
        self.log = log_dir / f"{name}.log"
        self.plan: dict | None = None
        self.tokens = cfg.paced_tokens if name == "window" else cfg.tokens
        common = ["--threads", "1", "--port", str(self.port), "--host", "127.0.0.1", "--name", "m"]
        budget = budget_mb(cfg)
        if budget is not None and name != "single":  # single: one device that holds it all
            common += ["--memory-budget-mb", str(budget)]
        if name == "single":
            self.master = _lowband("serve", cfg.model, *common, "--cores", "0")
            self.worker = None
        elif name == "window":
            if budget is None:
                raise ValueError("the window arm needs --budget-frac")
            paced = [
                sys.executable,
                "-m",
                "benchmarks.edge_wan",
                "--paced-serve",
                str(cfg.paced_mbps),
            ]
            self.master = [*paced, "edge", "serve", cfg.model, *common, "--cores", "0"]
            self.worker = None
        else:
            bind = f"tcp://{bed.addr(0)}:{cport}"
            layout = {"tp": "tp", "pipeline": "pipeline", "replica": "replica"}.get(name, "auto")
            layout = "replica" if name.startswith("replica") else layout
            self.master = _lowband(
                "serve", cfg.model, *common, "--cores", "0", "--workers", "1", "--bind", bind,
                "--layout", layout, "--micro-batches", str(cfg.micro_batches), "--insecure",
            )  # fmt: skip
            if name == "pipeline" and cfg.weights:
                self.master += ["--weights", cfg.weights]
            if name == "auto-busy":
                self.master += ["--plan-streams", str(cfg.streams)]
            if name == "replica-2":
                self.master += ["--replica-lanes", "2"]
            self.worker = _lowband(
                "worker", "--master", bind, "--model-dir", cfg.model, "--threads", "1",
                "--cores", "1", "--insecure",
            )  # fmt: skip

    def start(self) -> None:
        env = {**os.environ, "LOWBAND_TOKEN": "edge-wan-bench"}
        out = self.log.open("ab")
        kw: dict[str, Any] = dict(stdout=out, stderr=subprocess.STDOUT, env=env)
        self.procs.append(self.bed.popen(0, self.master, start_new_session=True, **kw))
        if self.worker is not None:
            self.procs.append(self.bed.popen(1, self.worker, start_new_session=True, **kw))
        deadline = time.monotonic() + self.cfg.startup_s
        while time.monotonic() < deadline:
            h = self.health()
            if h is not None and h.get("status", "ok") == "ok":
                self.plan = h.get("cluster", h).get("plan") if isinstance(h, dict) else None
                self.health_doc = h
                return
            if any(p.poll() is not None for p in self.procs):
                break
            time.sleep(0.5)
        raise RuntimeError(f"arm {self.name} did not start: see {self.log}")

    def health(self) -> dict | None:
        code = f"import urllib.request;print(urllib.request.urlopen('http://127.0.0.1:{self.port}/health',timeout=5).read().decode())"  # noqa: E501
        try:
            r = self.bed.run_in(0, [sys.executable, "-c", code], capture_output=True, timeout=30)
        except subprocess.TimeoutExpired:  # a loaded machine: asked again until startup_s
            return None
        if r.returncode != 0:
            return None
        try:
            return json.loads(r.stdout)
        except json.JSONDecodeError:
            return None

    def client(self, mode: str) -> dict:
        args = [sys.executable, "-m", "benchmarks.edge_wan", "--client", mode]
        args += ["--port", str(self.port), "--tokens", str(self.tokens)]
        args += ["--streams", str(self.cfg.streams)]
        r = self.bed.run_in(0, args, capture_output=True, text=True, timeout=900)
        if r.returncode != 0:
            return {"error": (r.stderr or r.stdout)[-400:]}
        return json.loads(r.stdout.strip().splitlines()[-1])

    def memory(self) -> list[dict | None]:
        """Each process's memory (the master first), read before it is stopped."""
        return [rss_mb(p.pid) for p in self.procs]

    def stop(self) -> None:
        for p in self.procs:
            try:
                os.killpg(p.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        for p in self.procs:
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(timeout=5)


def _spread(xs: list[float]) -> dict | None:
    if not xs:
        return None
    return {
        "median": round(statistics.median(xs), 2),
        "min": round(min(xs), 2),
        "max": round(max(xs), 2),
        "n": len(xs),
    }


def run_profile(bed: Any, cfg: Bench, name: str, log_dir: Path) -> dict:
    from transport.links.tun.calibrate import measure_rtt
    from transport.links.tun.shape import PathConfig

    p = PROFILES[name]
    path = PathConfig(
        delay_ms=p["rtt_ms"] / 2, jitter_ms=p["jitter_ms"], loss=p["loss"], rate_mbit=cfg.rate_mbit
    )
    for src, dst in ((0, 1), (1, 0)):
        bed.set_path(src, dst, path)
    rtt = measure_rtt(bed, count=10)
    # faithful: the measured round trip within 10 % + 50 µs of the configured one (issue 39)
    tolerance = round(0.1 * p["rtt_ms"] + 0.05, 3)
    rtt["within_tolerance"] = abs(rtt["median_ms"] - p["rtt_ms"]) <= tolerance
    rtt["tolerance_ms"] = tolerance
    skip_tp_streams = p["rtt_ms"] >= 4.0
    names = tuple(a for a in ARMS if a == "single" or a in cfg.arms)
    arms = {a: Arm(a, bed, cfg, log_dir) for a in names}
    single: dict[str, list[float]] = {a: [] for a in names}
    ttft: dict[str, list[float]] = {a: [] for a in names}
    agg: dict[str, list[float]] = {a: [] for a in names}
    errors: dict[str, list[str]] = {a: [] for a in names}
    fwd_cpu: dict[str, list[float]] = {a: [] for a in names}  # forwarder CPU s / wall s
    cycles: dict[str, Any] = {}
    memory: dict[str, Any] = {}
    chosen = None
    try:
        for a in arms.values():
            a.start()
        n = len(names)
        for r in range(cfg.repeats):
            order = list(names[r % n :] + names[: r % n])
            for a in order:
                out = arms[a].client("single")
                if "error" in out:
                    errors[a].append(out["error"])
                else:
                    single[a].append(out["ms_per_token"])
                    ttft[a].append(out["first_token_ms"])
            for a in order:
                if a == "tp" and skip_tp_streams:
                    continue
                if a == "window" and r >= cfg.paced_stream_rounds:
                    continue
                c0, t0 = bed.forwarder_cpu_s(), time.perf_counter()
                out = arms[a].client("streams")
                fwd_cpu[a].append((bed.forwarder_cpu_s() - c0) / (time.perf_counter() - t0))
                if "error" in out or out.get("errors"):
                    errors[a].append(str(out.get("error") or out["errors"][:2]))
                if "tokens_per_s" in out:
                    agg[a].append(out["tokens_per_s"])
        chosen = arms["auto"].health_doc if "auto" in arms else None
        busy = arms["auto-busy"].health_doc if "auto-busy" in arms else None
        for a, arm in arms.items():  # where the master's time went, over the whole run
            h = arm.health()
            cyc = (h or {}).get("cluster", h or {}).get("cycle") if isinstance(h, dict) else None
            if cyc is not None:
                cycles[a] = cyc
            memory[a] = arm.memory()
    finally:
        for a in arms.values():
            a.stop()
    med = {a: statistics.median(v) for a, v in single.items() if v}
    amed = {a: statistics.median(v) for a, v in agg.items() if v}
    return {
        "profile": name,
        "configured": p,
        "measured_rtt": rtt,
        "ms_per_token": {a: _spread(v) for a, v in single.items()},
        "first_token_ms": {a: _spread(v) for a, v in ttft.items()},
        "aggregate_tokens_per_s": {a: _spread(v) for a, v in agg.items()},
        "speed_vs_one_device": {
            a: round(med["single"] / med[a], 3) for a in med if "single" in med and med[a]
        },
        "aggregate_vs_one_device": {
            a: round(amed[a] / amed["single"], 3) for a in amed if amed.get("single")
        },
        "auto_health": chosen,
        "auto_busy_health": busy,
        "master_cycle": cycles,
        "forwarder_spin_us": bed.config.spin_us,
        "forwarder_cpu_during_streams": {a: _spread(v) for a, v in fwd_cpu.items() if v},
        "tp_streams_skipped": skip_tp_streams,
        "memory_mb": memory,  # per arm, each process (master first): now and peak
        "errors": {a: e[:3] for a, e in errors.items() if e},
    }


def _tiny_model(d: Path) -> str:
    from lowband.models.config import ModelConfig
    from lowband.models.llama import LlamaForCausalLM, init_weights
    from lowband.models.tokenizer import ByteTokenizer
    from lowband.models.weights import save_pretrained

    cfg = ModelConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
    )
    m = LlamaForCausalLM(cfg).eval()
    init_weights(m, std=0.2, seed=1)
    save_pretrained(m, d)
    ByteTokenizer().save(d)
    return str(d)


def run(cfg: Bench) -> dict:
    from transport.links.tun.shape import PathConfig
    from transport.links.tun.testbed import TunConfig, TunTestbed, available

    if (why := available()) is not None:
        raise SystemExit(f"edge_wan needs the TUN emulator: {why}")
    log_dir = Path(tempfile.mkdtemp(prefix="edge_wan_"))
    profiles = []
    for name in cfg.profiles:  # a testbed per profile: its forwarder's spin (Bench.spin_us)
        spin = cfg.spin_us
        if spin is None:
            spin = 300.0 if PROFILES[name]["rtt_ms"] < 2.0 else 0.0
        tc = TunConfig(path=PathConfig(rate_mbit=cfg.rate_mbit), spin_us=spin)
        with TunTestbed(tc) as bed:
            profiles.append(run_profile(bed, cfg, name, log_dir))
    budget = budget_mb(cfg)
    extra: dict[str, Any] = {}
    if budget is not None:
        extra = {"weight_mb": round(weight_mb(cfg.model), 1), "budget_frac": cfg.budget_frac,
                 "memory_budget_mb": budget, "paced_mbps": cfg.paced_mbps,
                 "paced_tokens": cfg.paced_tokens,
                 "paced_stream_rounds": cfg.paced_stream_rounds}  # fmt: skip
    return {"model": cfg.model, "tokens": cfg.tokens, "streams": cfg.streams, **extra,
            "repeats": cfg.repeats, "micro_batches": cfg.micro_batches,
            "pipeline_weights": cfg.weights, "logs": str(log_dir),
            "profiles": profiles}  # fmt: skip


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["--paced-serve"]:  # the window arm's server (paced_serve)
        return paced_serve(float(args[1]), args[2:])
    ap = argparse.ArgumentParser(prog="python -m benchmarks.edge_wan")
    ap.add_argument("--model", help="GGUF file or model dir (default: the real Gemma 3 270M)")
    ap.add_argument("--profiles", nargs="+", default=["wifi"], choices=sorted(PROFILES))
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--micro-batches", type=int, default=3)
    ap.add_argument("--weights", help="the pipeline arm's --weights, e.g. 1,1.25 (default: even)")
    ap.add_argument(
        "--arms",
        nargs="+",
        choices=ARMS,
        help="arms to run (single, the baseline, always runs; default: all but window, or "
        "single window pipeline with --budget-frac)",
    )
    ap.add_argument(
        "--budget-frac",
        type=float,
        help="the model that fits no device: each device's memory budget this fraction of "
        "the GGUF file's weights (e.g. 0.6)",
    )
    ap.add_argument("--paced-mbps", type=float, default=40.0, help="the window arm's storage")
    ap.add_argument("--paced-tokens", type=int, default=3, help="the window arm's tokens")
    ap.add_argument(
        "--paced-stream-rounds",
        type=int,
        default=1,
        help="rounds in which the window arm also runs the concurrent streams",
    )
    ap.add_argument(
        "--spin-us",
        type=float,
        help="the TUN forwarder's spin (default: 300 below 2 ms RTT, else 0)",
    )
    ap.add_argument("--tiny", action="store_true", help="smoke run: a tiny random model")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--client", choices=["single", "streams"], help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, help=argparse.SUPPRESS)
    a = ap.parse_args(args)
    if a.client:
        if a.client == "single":
            out = client_single(a.port, a.tokens)
        else:
            out = client_streams(a.port, a.tokens, a.streams)
        print(json.dumps(out))
        return 0
    if a.tiny:
        model = _tiny_model(Path(tempfile.mkdtemp(prefix="edge_wan_tiny_")))
        if a.budget_frac:  # the budget is a fraction of a GGUF file's weights
            from edge.formats.gguf import export_gguf

            model = str(export_gguf(model, Path(model) / "tiny.gguf"))
    elif a.model:
        model = a.model
    else:
        from benchmarks.real_models import gemma3_270m

        model = str(gemma3_270m())
    cfg = Bench(
        model=model,
        profiles=tuple(a.profiles),
        repeats=a.repeats,
        tokens=a.tokens,
        streams=a.streams,
        micro_batches=a.micro_batches,
        weights=a.weights,
        arms=tuple(a.arms or (BUDGET_ARMS if a.budget_frac else DEFAULT_ARMS)),
        spin_us=a.spin_us,
        budget_frac=a.budget_frac,
        paced_mbps=a.paced_mbps,
        paced_tokens=a.paced_tokens,
        paced_stream_rounds=a.paced_stream_rounds,
    )
    t = time.time()
    out = run(cfg)
    out["seconds"] = round(time.time() - t, 1)
    print(json.dumps(out) if a.json else json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
