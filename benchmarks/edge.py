"""Edge runtime benchmark: ``python -m benchmarks.edge --json`` (last line of output is JSON).

Builds a random-init Llama-family model here (default ~360M parameters, fp32, vocab 256) and
measures, in one run so the noisy shared machine affects both sides alike:

* ``parity_max_abs``     ours vs transformers on the same checkpoint (prefill logits);
* ``tp_parity_max_abs``  2-device TP over the real ZeroMQ transport vs one device;
* ``decode_ms_per_token`` for 1 and 2 devices, each device process pinned to its own core with
  one torch thread (the stand-in for separate boards), ``tp_speedup``, ``ttft_ms``,
  ``bytes_per_token_wire`` (master's payload bytes in+out per decoded token);
* ``window``: sliding window of W layer blocks vs fully resident: peak RSS (ru_maxrss of the
  device process, which includes the ~200 MB of torch itself), warm decode latency and decode
  latency with the weight files dropped from the page cache before every token, and
  (``window.paced``) with every block read paced to microSD / eMMC / NVMe speeds (100 / 300 /
  2000 MB/s, ``StorageDevice`` as in ``benchmarks.moe``): the warm figure assumes the weights sit
  in the page cache, which a device whose model does not fit in memory cannot count on.

Each measurement runs in its own child process (``--role``), so peak RSS is per device.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from lowband.errors import PeerLost as PeerLostError
from lowband.proc import free_port

PRESETS = {
    # ~360M params, 1.45 GB fp32: big enough that torch's own ~200 MB RSS does not dominate.
    "default": dict(
        vocab_size=256,
        hidden_size=1024,
        intermediate_size=2816,
        num_hidden_layers=32,
        num_attention_heads=16,
        num_key_value_heads=4,
        max_position_embeddings=1024,
    ),
    # the minimum: >= 50M params
    "small": dict(
        vocab_size=256,
        hidden_size=512,
        intermediate_size=1408,
        num_hidden_layers=16,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=1024,
    ),
    "tiny": dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    ),
}


def _peak_rss_mb() -> float:
    """This process's RSS high-water mark. VmHWM, not ru_maxrss: ru_maxrss survives execve, so
    a child would inherit the parent's peak (which built the whole model)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024.0
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def _pin(core: int) -> None:
    """One core, one torch thread: a simulated device (same settings as ``edge worker``)."""
    from edge.launch import DeviceConfig

    DeviceConfig(threads=1, cores=(core % (os.cpu_count() or 1),)).apply()


def _decode(runner, prompt: list[int], tokens: int, warmup: int, cold=None) -> dict:
    """Greedy decode; per-token latency after ``warmup`` tokens. ``cold()`` runs before each
    timed token (outside the timer)."""
    t0 = time.perf_counter()
    logits = runner.forward(prompt, 0)
    ttft = time.perf_counter() - t0
    first = logits.tolist()
    pos, out, times = len(prompt), [], []
    tok = int(torch.argmax(logits))
    for i in range(warmup + tokens):
        out.append(tok)
        if cold is not None and i >= warmup:
            cold()
        t = time.perf_counter()
        logits = runner.forward([tok], pos, 1)  # greedy: the sampler needs the best logit only
        if i >= warmup:
            times.append(time.perf_counter() - t)
        pos += 1
        tok = int(torch.argmax(logits))
    return {
        "ttft_ms": 1e3 * ttft,
        "decode_ms_per_token": 1e3 * statistics.median(times),
        "decode_ms_min": 1e3 * min(times),
        "tokens": out,
        "prefill_logits": first,
    }


def _profile(runner, prompt: list[int], steps: int = 4) -> dict:
    """Where one decode step's time goes: matmuls, other aten ops, and the rest (Python)."""
    from torch.profiler import ProfilerActivity, profile

    runner.forward(prompt, 0)
    pos, tok = len(prompt), 1
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t = time.perf_counter()
        for _ in range(steps):
            runner.forward([tok], pos, 1)
            pos += 1
        wall = time.perf_counter() - t
    mm = other = 0.0
    for ev in prof.key_averages():
        if not ev.key.startswith("aten::"):
            continue
        if ev.key in ("aten::mm", "aten::addmm", "aten::bmm", "aten::matmul_out", "aten::mv"):
            mm += ev.self_cpu_time_total
        else:
            other += ev.self_cpu_time_total
    wall_us = wall * 1e6
    return {
        "matmul_frac": mm / wall_us,
        "other_ops_frac": other / wall_us,
        "python_and_dispatch_frac": max(0.0, 1 - (mm + other) / wall_us),
        "profiled_ms_per_token": wall * 1e3 / steps,
    }


# ---- roles (each runs in its own process) ---------------------------------------------------
# Storage classes the window's block reads are paced to (MB/s, sequential read), as
# benchmarks.moe paces expert reads: this machine's page cache would make any storage look free.
STORAGE = {"microSD": 100.0, "eMMC": 300.0, "NVMe": 2000.0}


def _paced(runner, prompt: list[int], sched, a) -> dict[str, float]:
    """Decode latency with every block load paced to each storage class: a load costs at least
    block bytes / rate (``edge.moe.store.StorageDevice``, one device serialising the reads), in
    the window's own loader thread, so prefetch still overlaps it with compute."""
    from edge.moe.store import StorageDevice

    out = {}
    plain = [f.populate for f in sched.files]
    try:
        for name in a.storage:
            dev = StorageDevice(STORAGE[name] * 1e6)
            for f, populate in zip(sched.files, plain):
                f.populate = lambda f=f, populate=populate, dev=dev: dev.read(populate, f.size)
            runner.reset()
            out[name] = _decode(runner, prompt, max(2, a.tokens // 4), 1)["decode_ms_per_token"]
    finally:
        for f, populate in zip(sched.files, plain):
            f.populate = populate
    return out


def role_single(a) -> dict:
    from edge.engine import LocalRunner
    from edge.shardio import WindowConfig, load_shard

    _pin(a.core)
    loader = (a.loader_core,) if a.loader_core is not None else None
    win = WindowConfig(window=a.win, loader_cores=loader) if a.win else None
    shard = load_shard(a.model, window=win)
    runner = LocalRunner(shard.model)
    prompt = list(range(1, a.prompt_len + 1))
    res = _decode(runner, prompt, a.tokens, a.warmup)
    if a.win and shard.scheduler is not None:
        sched = shard.scheduler
        res["window_blocks"] = sched.window
        runner.reset()
        cold = _decode(runner, prompt, max(2, a.tokens // 4), 1, cold=sched.drop_page_cache)
        res["cold_decode_ms_per_token"] = cold["decode_ms_per_token"]
        res["paced_decode_ms_per_token"] = _paced(runner, prompt, sched, a)
    elif a.profile:
        runner.reset()
        res["profile"] = _profile(runner, prompt)
    res["peak_rss_mb"] = _peak_rss_mb()
    shard.close()
    return res


def role_master(a) -> dict:
    from edge.cluster import MASTER_ID_PREFIX, ClusterConfig, MasterRunner
    from edge.launch import SIGNATURE, _zmq_config
    from transport.coordinator import Coordinator, CoordinatorConfig
    from transport.zmq_comm import connect

    _pin(a.core)
    coord = Coordinator(CoordinatorConfig(bind=a.bind)).start()
    comm = connect(
        coord.address,
        _zmq_config(None, 120.0, bind_host="127.0.0.1"),
        signature=SIGNATURE,
        peer_id=f"{MASTER_ID_PREFIX}-bench",
    )
    runner = MasterRunner(
        comm,
        a.model,
        ClusterConfig(
            devices=a.devices,
            wire=a.wire,
            link_spin_us=a.link_spin_us,
            op_timeout=120.0,
            join_timeout=300.0,
            heartbeat_s=3600.0,
        ),
    )
    spent = [0.0]
    for layer in runner.model.model.layers:  # time the all-reduces on the master
        for mod in (layer.self_attn, layer.ffn):
            inner = mod.reduce

            def timed(x, inner=inner):
                t = time.perf_counter()
                y = inner(x)
                spent[0] += time.perf_counter() - t
                return y

            mod.reduce = timed
    prompt = list(range(1, a.prompt_len + 1))
    runner.forward(prompt, 0)  # warm the connections
    runner.reset()
    b0 = runner.wire_bytes()
    res = _decode(runner, prompt, a.tokens, a.warmup)
    n_fwd = 1 + a.warmup + a.tokens
    res["bytes_per_token_wire"] = (runner.wire_bytes() - b0 - _prefill_bytes(runner, a)) / (
        n_fwd - 1
    )
    native = runner.hub.native_seconds if runner.hub is not None else 0.0
    if native > 0:
        # The compiled decode step drives the link itself (the Python hooks above then only see
        # the prefill): time inside its all-reduces, per decoded token.
        res["allreduce_ms_per_token"] = 1e3 * native / (a.warmup + a.tokens)
        res["allreduce_native"] = True
    else:
        res["allreduce_ms_per_token"] = 1e3 * spent[0] / n_fwd
    res["peak_rss_mb"] = _peak_rss_mb()
    runner.close()
    comm.close()
    coord.stop()
    return res


def role_shard(a) -> dict:
    """One TP slice computing alone (all-reduce replaced by identity): the per-device compute
    time a board of its own would see, free of the other simulated device's memory traffic."""
    from edge.engine import LocalRunner
    from edge.shardio import load_shard

    _pin(a.core)
    shard = load_shard(a.model, a.rank, a.devices, reduce=lambda x: x)
    m = shard.model
    times = []
    if a.rank == 0:
        runner = LocalRunner(m)
        res = _decode(runner, list(range(1, a.prompt_len + 1)), a.tokens, a.warmup)
    else:
        cache = m.new_cache()
        h = torch.randn(1, a.prompt_len, m.config.hidden_size)
        with torch.inference_mode():
            m.forward_layers(h, cache=cache, start=0)
            rows = shard.plan.vocab_rows(a.rank, m.config.vocab_size)
            for i in range(a.warmup + a.tokens):
                t = time.perf_counter()
                out = m.forward_layers(h[:, :1], cache=cache, start=a.prompt_len + i)
                if rows[1] > rows[0]:  # its rows of a vocabulary-parallel head
                    m.head(out[:, -1])
                if i >= a.warmup:
                    times.append(time.perf_counter() - t)
        res = {"decode_ms_per_token": 1e3 * statistics.median(times)}
    shard.close()
    return {"decode_ms_per_token": res["decode_ms_per_token"], "peak_rss_mb": _peak_rss_mb()}


def role_link(a) -> dict:
    """Star all-reduce latency of one activation vector (1, 1, H) between two pinned processes."""
    from transport.starlink import StarHub, StarSpoke

    _pin(a.core)
    x = torch.randn(1, 1, a.hidden)
    if a.rank == 0:
        hub = StarHub("127.0.0.1", a.port, spin_s=a.link_spin_us * 1e-6)
        hub.secret = a.secret  # both ends were given it on the command line
        hub.accept(1, timeout=60)
        net = hub
    else:
        net = None
        deadline = time.monotonic() + 60
        while net is None:
            try:
                net = StarSpoke(
                    "127.0.0.1",
                    a.port,
                    1,
                    timeout=10,
                    secret=a.secret,
                    spin_s=a.link_spin_us * 1e-6,
                )
            except PeerLostError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
    times = []
    for i in range(200 + a.link_iters):
        t = time.perf_counter()
        net.all_reduce(x, timeout=30)
        if i >= 200:
            times.append(time.perf_counter() - t)
    net.close()
    times.sort()
    return {"median_us": 1e6 * times[len(times) // 2], "p90_us": 1e6 * times[int(0.9 * len(times))]}


def _link_latency(a, hidden: int) -> dict:
    port = free_port()
    common = [
        "--role",
        "link",
        "--port",
        str(port),
        "--hidden",
        str(hidden),
        "--link-spin-us",
        str(a.link_spin_us),
        "--secret",
        os.urandom(8).hex(),
    ]
    spoke = subprocess.Popen(
        [sys.executable, "-m", "benchmarks.edge", *common, "--rank", "1", "--core", "1"],
        start_new_session=True,
        stdout=subprocess.DEVNULL,
    )
    try:
        return _run_role([*common, "--rank", "0", "--core", "0"], a.timeout)
    finally:
        try:
            spoke.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(spoke.pid, signal.SIGKILL)
            spoke.wait(timeout=10)


def _decompose(a, split2: Path, cfg: dict, common: list[str], single: dict) -> dict:
    """Per-device compute of each half alone (as on separate boards), both halves at once on
    cores 0 and 1 without any network (the slowdown is this machine's shared memory
    bandwidth, not the runtime), the link's all-reduce latency, and the projection
    max(compute alone) + 2L x latency."""
    shard_args = ["--role", "shard", "--model", str(split2), "--devices", "2", *common]
    alone = [
        min(
            (
                _run_role([*shard_args, "--rank", str(r), "--core", "0"], a.timeout)
                for _ in range(2)
            ),
            key=lambda x: x["decode_ms_per_token"],
        )
        for r in range(2)
    ]
    together = _concurrent([[*shard_args, "--rank", str(r), "--core", str(r)] for r in range(2)], a)
    lat = _link_latency(a, cfg["hidden_size"])
    projected = (
        max(r["decode_ms_per_token"] for r in alone)
        + 2 * cfg["num_hidden_layers"] * lat["median_us"] / 1e3
    )
    return {
        "slice_alone_ms": [round(r["decode_ms_per_token"], 2) for r in alone],
        "slices_concurrent_ms": [round(r["decode_ms_per_token"], 2) for r in together],
        "link_allreduce_us": {k: round(v, 1) for k, v in lat.items()},
        "projected_2dev_ms": round(projected, 2),
        "projected_tp_speedup": round(single["decode_ms_per_token"] / projected, 3),
    }


def _concurrent(role_args: list[list[str]], a) -> list[dict]:
    """Run several roles at the same time (e.g. both TP slices, no communication) to measure
    how much the simulated devices slow each other down through shared memory bandwidth."""
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "benchmarks.edge", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            start_new_session=True,
        )
        for args in role_args
    ]
    try:
        outs = [p.communicate(timeout=a.timeout)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(timeout=10)
    return [json.loads(o.strip().splitlines()[-1]) for o in outs]


def _prefill_bytes(runner, a) -> int:
    """Payload the prefill put on the master's wire (T positions instead of 1)."""
    cfg = runner.config
    per_pos = (a.devices - 1) * 4 * cfg.hidden_size * (1 + 4 * cfg.num_hidden_layers)
    if a.wire != "fp32":
        return 0  # not exact for compressed encodings; then the figure includes the prefill
    return per_pos * a.prompt_len


def _run_role(args: list[str], timeout: float) -> dict:
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks.edge", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if out.returncode != 0:
        raise RuntimeError(f"role {args[:2]} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _run_tp(model: str, a, devices: int = 2) -> dict:
    bind = f"tcp://127.0.0.1:{free_port()}"
    common = [
        "--model",
        model,
        "--tokens",
        str(a.tokens),
        "--warmup",
        str(a.warmup),
        "--prompt-len",
        str(a.prompt_len),
    ]
    workers = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "cli",
                "edge",
                "worker",
                "--master",
                bind,
                "--threads",
                "1",
                "--cores",
                str(i % (os.cpu_count() or 1)),
                "--op-timeout",
                "120",
                "--model-dir",
                str(model),
            ],
            start_new_session=True,
            stdout=subprocess.DEVNULL,
        )
        for i in range(1, devices)
    ]
    try:
        return _run_role(
            [
                "--role",
                "master",
                "--bind",
                bind,
                "--devices",
                str(devices),
                "--core",
                "0",
                "--wire",
                a.wire,
                "--link-spin-us",
                str(a.link_spin_us),
                *common,
            ],
            a.timeout,
        )
    finally:
        for w in workers:
            try:
                w.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(w.pid, signal.SIGKILL)
                w.wait(timeout=10)


def _parity(model_dir: Path, cfg: dict) -> float:
    from transformers import LlamaForCausalLM as HFLlama

    from lowband.models.weights import load_pretrained

    ids = torch.arange(1, 33).remainder(cfg["vocab_size"])[None]
    with torch.no_grad():
        hf = HFLlama.from_pretrained(model_dir, dtype=torch.float32).eval()
        ref = hf(ids).logits
        del hf
        ours = load_pretrained(model_dir)
        got = ours(ids)
    return float((got - ref).abs().max())


def _med(runs: list[dict]) -> float:
    return statistics.median(r["decode_ms_per_token"] for r in runs)


def main_bench(a) -> dict:
    from edge.shardio import split_checkpoint
    from lowband.models.config import ModelConfig
    from lowband.models.llama import LlamaForCausalLM, init_weights
    from lowband.models.weights import save_pretrained

    cfg = PRESETS[a.preset]
    work = Path(tempfile.mkdtemp(prefix="lowband-edge-bench-", dir=a.workdir))
    t_start = time.perf_counter()
    model = LlamaForCausalLM(ModelConfig(**cfg)).eval()
    init_weights(model, std=0.02, seed=0)
    n_params = sum(p.numel() for p in model.parameters())
    ckpt = save_pretrained(model, work / "ckpt")
    del model
    parity = _parity(ckpt, cfg) if not a.skip_parity else None
    split1 = split_checkpoint(ckpt, work / "split1", devices=1)
    split2 = split_checkpoint(ckpt, work / "split2", devices=2)  # each device reads its slice
    load_before = os.getloadavg()[0]
    common = [
        "--tokens",
        str(a.tokens),
        "--warmup",
        str(a.warmup),
        "--prompt-len",
        str(a.prompt_len),
    ]
    # 1 and 2 devices alternate so drifting background load hits both alike.
    singles, tps, wins = [], [], []
    for _ in range(a.repeats):  # 1 device, 2 devices, window, interleaved
        singles.append(
            _run_role(
                [
                    "--role",
                    "single",
                    "--model",
                    str(split1),
                    "--core",
                    "0",
                    *(["--profile"] if not singles else []),
                    *common,
                ],
                a.timeout,
            )
        )
        tps.append(_run_tp(str(split2), a))
        wins.append(
            _run_role(
                [
                    "--role",
                    "single",
                    "--model",
                    str(split1),
                    "--core",
                    "0",
                    "--win",
                    str(a.window),
                    "--storage",
                    *a.storage,
                    *common,
                ],
                a.timeout,
            )
        )
    n_layers = cfg["num_hidden_layers"]
    # Decomposition: each TP slice computing alone, and the link's all-reduce latency.
    single = min(singles, key=lambda r: r["decode_ms_per_token"])
    decomposition = None if a.no_decomposition else _decompose(a, split2, cfg, common, single)
    tp = min(tps, key=lambda r: r["decode_ms_per_token"])
    tp_parity = max(abs(x - y) for x, y in zip(single["prefill_logits"], tp["prefill_logits"]))
    win = min(wins, key=lambda r: r["decode_ms_per_token"])
    same_tokens = win["tokens"] == single["tokens"] and tp["tokens"] == single["tokens"]
    result = {
        "bench": "edge",
        "preset": a.preset,
        "params": n_params,
        "model_mb": round(n_params * 4 / 2**20, 1),
        "layers": n_layers,
        "parity_max_abs": parity,
        "tp_parity_max_abs": tp_parity,
        "same_greedy_tokens": same_tokens,
        # medians of the interleaved repeats (the headline), the best runs beside them
        "decode_ms_per_token": {"1": round(_med(singles), 2), "2": round(_med(tps), 2)},
        "decode_ms_per_token_best": {
            "1": round(single["decode_ms_per_token"], 2),
            "2": round(tp["decode_ms_per_token"], 2),
        },
        "decode_ms_per_token_all_runs": {
            "1": [round(r["decode_ms_per_token"], 2) for r in singles],
            "2": [round(r["decode_ms_per_token"], 2) for r in tps],
        },
        "tp_speedup": round(_med(singles) / _med(tps), 3),
        "tp_speedup_best": round(single["decode_ms_per_token"] / tp["decode_ms_per_token"], 3),
        "ttft_ms": {"1": round(single["ttft_ms"], 1), "2": round(tp["ttft_ms"], 1)},
        "prompt_len": a.prompt_len,
        "bytes_per_token_wire": tp["bytes_per_token_wire"],
        "wire": a.wire,
        "link_spin_us": a.link_spin_us,
        "allreduce_ms_per_token": round(tp["allreduce_ms_per_token"], 2),
        "tp_decomposition": decomposition,
        "profile_1dev": singles[0].get("profile"),
        "window": {
            "blocks": win.get("window_blocks"),
            "of": n_layers,
            "peak_rss_mb": round(win["peak_rss_mb"], 1),
            "decode_ms_per_token": round(_med(wins), 2),
            "cold_decode_ms_per_token": round(win["cold_decode_ms_per_token"], 2),
            "rss_ratio": round(win["peak_rss_mb"] / single["peak_rss_mb"], 3),
            "latency_ratio": round(_med(wins) / _med(singles), 3),
            "cold_latency_ratio": round(
                win["cold_decode_ms_per_token"] / single["decode_ms_per_token"], 3
            ),
            # warm page cache but every block read paced to a storage class (MB/s)
            "paced": {
                name: {
                    "mb_per_s": STORAGE[name],
                    "decode_ms_per_token": round(ms, 2),
                    "latency_ratio": round(ms / single["decode_ms_per_token"], 3),
                }
                for name, ms in win["paced_decode_ms_per_token"].items()
            },
            "decode_ms_per_token_all_runs": [round(r["decode_ms_per_token"], 2) for r in wins],
        },
        "full": {"peak_rss_mb": round(single["peak_rss_mb"], 1)},
        "tp_master_peak_rss_mb": round(tp["peak_rss_mb"], 1),
        "bench_seconds": round(time.perf_counter() - t_start, 1),
        "loadavg_1m": [round(load_before, 2), round(os.getloadavg()[0], 2)],
        "cpus": os.cpu_count(),
    }
    if not a.keep:
        import shutil

        shutil.rmtree(work, ignore_errors=True)
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.edge", description=__doc__.split("\n")[0]
    )
    p.add_argument("--json", action="store_true", help="print only the JSON result line")
    p.add_argument("--preset", choices=sorted(PRESETS), default="default")
    p.add_argument("--tokens", type=int, default=16, help="timed decode tokens per run")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument(
        "--repeats",
        type=int,
        default=5,
        help="interleaved rounds of 1-device, 2-device and window runs (medians "
        "reported, the best runs beside them)",
    )
    p.add_argument("--window", type=int, default=2, help="W: layer blocks resident")
    p.add_argument(
        "--storage",
        nargs="*",
        default=list(STORAGE),
        choices=list(STORAGE),
        help="storage classes the window's block reads are also paced to",
    )
    p.add_argument("--wire", default="fp32", choices=["fp32", "fp16", "bf16", "int8"])
    p.add_argument(
        "--link-spin-us",
        type=float,
        default=1000.0,
        help="poll the TP link this long before sleeping (0: sleep at once)",
    )
    p.add_argument("--skip-parity", action="store_true")
    p.add_argument(
        "--no-decomposition",
        action="store_true",
        help="skip the TP decomposition runs (slices alone/concurrent, link latency)",
    )
    p.add_argument("--keep", action="store_true", help="keep the generated checkpoint")
    p.add_argument("--workdir", default=None, help="where to write the checkpoint (a real disk)")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per child process")
    # internal: one measurement in this process
    p.add_argument("--role", choices=["single", "master", "shard", "link"], help=argparse.SUPPRESS)
    p.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--hidden", type=int, default=1024, help=argparse.SUPPRESS)
    p.add_argument("--link-iters", type=int, default=1000, help=argparse.SUPPRESS)
    p.add_argument("--secret", default="", help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    p.add_argument("--core", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--bind", help=argparse.SUPPRESS)
    p.add_argument("--devices", type=int, default=2, help=argparse.SUPPRESS)
    p.add_argument("--profile", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--win", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--loader-core", type=int, default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.role == "single":
        print(json.dumps(role_single(a)))
        return 0
    if a.role == "master":
        print(json.dumps(role_master(a)))
        return 0
    if a.role == "shard":
        print(json.dumps(role_shard(a)))
        return 0
    if a.role == "link":
        print(json.dumps(role_link(a)))
        return 0
    res = main_bench(a)
    if not a.json:
        print(json.dumps(res, indent=2))
    print(json.dumps(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
