"""Heterogeneous 2-device split: ``python -m benchmarks.edge_hetero --json`` (last line JSON).

Two simulated devices of unequal speed on this machine: the master pinned to core 0, the worker
pinned to core 1 and throttled to ``--quota`` of that core by a cgroup-v1 CPU quota (a short
period so the throttling is smooth at decode time scales; with no writable cgroup, a busy
process co-running on core 1 halves it instead). Each run is a fresh 2-process cluster over the
real transport decoding ``--tokens`` greedy tokens; configurations alternate within every
repeat so the shared machine's noise hits all of them alike:

* ``auto``: ``ClusterConfig(auto_split=True)``: both devices profile themselves (under their
  throttle), ``edge.planner`` picks the weights;
* ``even``: weights 1:1;
* ``hand w``: weights w:1 for each w of ``--hand`` (the best of them is the "best hand-picked").

Reported: ms/token median (min, max) over the repeats of each run's median, the weights the
planner chose and its prediction.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path

from benchmarks.edge import PRESETS, _decode, _pin
from benchmarks.stats import spread
from lowband.proc import die_with_parent, free_port

CGROUP = Path("/sys/fs/cgroup/cpu")


@contextmanager
def throttle(quota: float, period_us: int = 10000):
    """Yield ``add(pid)`` putting a process under ``quota`` of one core, and a description."""
    group = CGROUP / f"lowband-hetero-{os.getpid()}"
    period_us = max(period_us, int(1000 / quota) + 1)  # the kernel's smallest quota is 1 ms
    try:
        group.mkdir()
        (group / "cpu.cfs_period_us").write_text(str(period_us))
        (group / "cpu.cfs_quota_us").write_text(str(int(quota * period_us)))
    except OSError as exc:
        if group.exists():
            group.rmdir()
        print(
            f"edge_hetero: no cgroup CPU quota ({exc}); co-running a busy process instead",
            file=sys.stderr,
        )
        hog = subprocess.Popen(
            [sys.executable, "-c", "import os\nos.sched_setaffinity(0, {1})\nwhile True: pass"],
            start_new_session=True,
        )
        try:
            yield (lambda pid: None), "a busy process co-running on core 1 (about half of it)"
        finally:
            os.killpg(hog.pid, signal.SIGKILL)
            hog.wait(timeout=10)
        return
    try:
        yield (
            (lambda pid: (group / "cgroup.procs").write_text(str(pid))),
            f"cgroup v1 cpu quota {quota:.0%} of core 1 (period {period_us} us)",
        )
    finally:
        for pid in (group / "cgroup.procs").read_text().split():
            try:  # a worker still alive goes back to the root group, so rmdir can succeed
                (CGROUP / "cgroup.procs").write_text(pid)
            except OSError:
                pass
        group.rmdir()


def role_master(a) -> dict:
    from edge.cluster import MASTER_ID_PREFIX, ClusterConfig, MasterRunner
    from edge.launch import SIGNATURE, _zmq_config
    from transport.coordinator import Coordinator, CoordinatorConfig
    from transport.zmq_comm import connect

    _pin(0)
    coord = Coordinator(CoordinatorConfig(bind=a.bind)).start()
    comm = connect(
        coord.address,
        _zmq_config(None, 120.0, bind_host="127.0.0.1"),
        signature=SIGNATURE,
        peer_id=f"{MASTER_ID_PREFIX}-bench",
    )
    weights = None if a.weights in ("auto", "even", "one") else (float(a.weights), 1.0)
    runner = MasterRunner(
        comm,
        a.model,
        ClusterConfig(
            devices=1 if a.weights == "one" else 2,
            weights=weights,
            auto_split=a.weights == "auto",
            op_timeout=120.0,
            join_timeout=300.0,
            heartbeat_s=3600.0,
        ),
    )
    try:
        prompt = list(range(1, a.prompt_len + 1))
        runner.forward(prompt, 0)  # warm the connections
        runner.reset()
        res = _decode(runner, prompt, a.tokens, a.warmup)
        out = {
            "decode_ms_per_token": res["decode_ms_per_token"],
            "devices": runner.devices,
            "weights": list(runner.weights) if runner.weights else [1.0] * runner.devices,
        }
        if runner.split is not None:
            out["predicted_ms"] = runner.split.predicted_ms
            out["explanation"] = runner.split.explain()
        return out
    finally:
        runner.close()
        comm.close()
        coord.stop()


def _run(model: str, weights: str, a, add) -> dict:
    bind = f"tcp://127.0.0.1:{free_port()}"
    worker = (
        None
        if weights == "one"
        else subprocess.Popen(
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
                str(1 % (os.cpu_count() or 1)),
                "--op-timeout",
                "120",
                "--model-dir",
                str(model),
            ],
            start_new_session=True,
            stdout=subprocess.DEVNULL,
            preexec_fn=die_with_parent,
        )
    )
    try:
        if worker is not None:
            add(worker.pid)
        out = subprocess.run(
            [
                sys.executable,
                "-m",
                "benchmarks.edge_hetero",
                "--role",
                "master",
                "--bind",
                bind,
                "--model",
                model,
                "--weights",
                weights,
                "--tokens",
                str(a.tokens),
                "--warmup",
                str(a.warmup),
                "--prompt-len",
                str(a.prompt_len),
            ],
            capture_output=True,
            text=True,
            timeout=a.timeout,
        )
        if out.returncode != 0:
            raise RuntimeError(f"master ({weights}) failed:\n{out.stderr[-3000:]}")
        return json.loads(out.stdout.strip().splitlines()[-1])
    finally:
        if worker is not None:
            try:
                worker.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(worker.pid, signal.SIGKILL)
                worker.wait(timeout=10)


def main_bench(a) -> dict:
    import torch

    from lowband.models.config import ModelConfig
    from lowband.models.llama import LlamaForCausalLM, init_weights
    from lowband.models.weights import save_pretrained

    cfg = dict(PRESETS[a.preset])
    with tempfile.TemporaryDirectory(prefix="lowband-hetero-") as tmp:
        model = LlamaForCausalLM(ModelConfig(**cfg)).eval()
        init_weights(model, std=0.02, seed=0)
        save_pretrained(model, tmp)
        del model
        torch.set_num_threads(1)
        # "one": the master alone, the hand-picked choice of not using the slow device at all
        configs = ["auto", "even", *[str(w) for w in a.hand], *(["one"] if a.one else [])]
        times: dict[str, list[float]] = {c: [] for c in configs}
        auto_runs = []
        with throttle(a.quota, a.period_us) as (add, how):
            for rep in range(a.repeats):
                order = configs if rep % 2 == 0 else configs[::-1]  # alternate the order too
                for c in order:
                    r = _run(tmp, c, a, add)
                    times[c].append(r["decode_ms_per_token"])
                    if c == "auto":
                        auto_runs.append(r)
                    print(
                        f"rep {rep} {c}: {r['decode_ms_per_token']:.1f} ms/token "
                        f"weights {r['weights']}",
                        file=sys.stderr,
                        flush=True,
                    )
    ms = {c: spread(v) for c, v in times.items()}
    hand = {c: ms[c] for c in configs[2:]}  # hand-picked: w:1 splits and the master alone
    best = min(hand, key=lambda c: hand[c]["median"]) if hand else "even"
    auto_med = ms["auto"]["median"]
    return {
        "bench": "edge_hetero",
        "preset": a.preset,
        "throttle": how,
        "tokens": a.tokens,
        "repeats": a.repeats,
        "ms_per_token": {
            ("master alone" if c == "one" else "hand " + c if c in hand else c): v
            for c, v in ms.items()
        },
        "best_hand": "master alone" if best == "one" else f"{best}:1",
        "auto_over_best_hand": round(auto_med / ms[best]["median"], 3),
        "even_over_auto": round(ms["even"]["median"] / auto_med, 3),
        "auto_weights": [r["weights"] for r in auto_runs],
        "auto_predicted_ms": [r.get("predicted_ms") for r in auto_runs],
        "auto_explanation": auto_runs[-1].get("explanation") if auto_runs else None,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--role", default="bench", choices=["bench", "master"])
    p.add_argument("--json", action="store_true", help="print the result as one JSON line")
    p.add_argument("--preset", default="small", choices=sorted(PRESETS))
    p.add_argument("--quota", type=float, default=0.5, help="the slow device's share of a core")
    p.add_argument(
        "--hand",
        type=float,
        nargs="*",
        default=[1.5, 2.0, 3.0],
        help="hand-picked weights w (split w:1 between master and worker)",
    )
    p.add_argument(
        "--period-us",
        type=int,
        default=10000,
        help="cgroup CPU quota period: shorter spreads the throttling more finely "
        "(raised so that the quota is at least 1 ms)",
    )
    p.add_argument(
        "--no-one", dest="one", action="store_false", help="leave out the master-alone baseline"
    )
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--tokens", type=int, default=24)
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--bind")
    p.add_argument("--model")
    p.add_argument("--weights")
    a = p.parse_args(argv)
    # SIGTERM (timeout, Ctrl-C from a wrapper) unwinds, so the cgroup is removed and the worker
    # stopped by the finally blocks.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(1))
    res = role_master(a) if a.role == "master" else main_bench(a)
    print(json.dumps(res) if a.json or a.role != "bench" else json.dumps(res, indent=1), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
