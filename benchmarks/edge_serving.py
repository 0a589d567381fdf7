"""lowband's OpenAI server vs llama.cpp's own ``llama-server`` under concurrent load, same GGUF
file, same cores, same run: ``python -m benchmarks.edge_serving --json`` (last line is JSON).

The file (``--model``, default ``llama32-1b``: random init at Llama-3.2-1B's shapes with the
llama-bpe tokenizer's metadata; ``--width`` ``q4_k_m`` (default) or ``q4_0``) comes from
:mod:`benchmarks.edge_vs_llamacpp`'s builders and cache; ``--gguf FILE`` takes any file instead.
``llama-server`` is built once from the ``vendor/llama.cpp`` of the llama-cpp-python 0.3.36
source release (:func:`build_llama_server`, cached under ``--cache``), or ``--llama-server PATH``.

Arms, each a child server process pinned to the same cores (``--threads`` T: cores 0..T-1):

* ``lowband``: ``lowband edge serve FILE --threads T --cores ... [--parallel N]``;
* ``llama-server``: ``llama-server -m FILE -t T -tb T -np N -c N*(longest prompt+max tokens+64)``;
* ``lowband-tp2`` (``--devices 1,2``): ``lowband edge run FILE --devices 2 --pin-cores``, one
  device per core on cores 0 and 1 (compared with the 1-device arm at the same levels).

The arms alternate (who goes first swapped every round), ``--repeats`` rounds, a fresh server
per arm and round. Every arm gets the identical request sequence: closed-loop clients (asyncio +
aiohttp) at each ``--concurrency`` level send streaming ``/v1/completions`` with prompts of
token ids, lengths log-uniform in [``--min-prompt``, ``--max-prompt``] (fresh random ids per
request, so no prefix is shared), ``max_tokens`` ``--max-tokens``, ``temperature`` 0,
``ignore_eos``. Per level: aggregate output tokens/s (completion tokens / the level's wall
time), the steady-state rate (token arrivals until the first client finds no request left),
TTFT and inter-token latency (gaps between streamed tokens) p50/p99, requests done; each a
median with min/max over the rounds.

``interference`` (chunked prefill): ``--interference-concurrency`` streams of 32-token prompts
decode; once each has streamed 8 tokens a ``--long-prompt``-token prompt arrives. Reported: the
p99 of the short streams' inter-token gaps that overlap the long request, their overall p99 and
largest gap, the long request's TTFT, and a single short stream's inter-token latency alone.

``roofline``: bytes of weights read per decode step (every tensor but the token embedding,
which is a lookup; a tied head reads the embedding, so it counts then), KV-cache bytes (f16) at
the level's mean context, FLOPs per step for a batch of the level's concurrency, and the cores'
measured read bandwidth (torch sum over 1 GiB) and fp32 / int8 matmul throughput (torch), giving
a tokens/s bound per level and the fraction of it each arm achieved.

``--lowband-only`` skips llama-server (and llama.cpp's quantizer: q4_0 then comes from gguf's
reference code): what the smoke test runs, so CI needs neither the peer nor a network.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import math
import os
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

from benchmarks.edge_vs_llamacpp import LLAMA_CPP_PYTHON, MODELS, download_sdist, make_files
from edge.formats.gguf_reader import open_reader
from lowband.proc import die_with_parent, free_port

LLAMA_SERVER_VERSION = LLAMA_CPP_PYTHON.split("==")[1]
CMAKE_FLAGS = (
    "-DLLAMA_CURL=OFF",
    "-DLLAMA_BUILD_SERVER=ON",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DBUILD_SHARED_LIBS=OFF",  # one self-contained binary that survives moving the build tree
    "-DGGML_NATIVE=ON",
    "-DGGML_OPENMP=OFF",
    "-DCMAKE_BUILD_TYPE=Release",
)
SHORT_PROMPT = 32  # the interference scenario's decoding streams
ARRIVE_AFTER = 8  # tokens every short stream has streamed before the long prompt arrives


# ---- llama-server ------------------------------------------------------------------------------
def _sdist(cache: Path, given: str | None) -> Path:
    """The llama-cpp-python source release: ``given``, one in ``cache``, or pip's download."""
    if given:
        return Path(given).expanduser()
    name = f"llama_cpp_python-{LLAMA_SERVER_VERSION}.tar.gz"
    if (cache / name).exists():
        return cache / name
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        download_sdist(Path(tmp)).rename(cache / name)
    return cache / name


def build_llama_server(cache_dir: Path, sdist: str | None = None, jobs: int = 2) -> Path:
    """``llama-server`` from the ``vendor/llama.cpp`` of the llama-cpp-python source release,
    built once into ``cache_dir/llama-server-VERSION/bin`` (about 9 minutes on 2 cores) and
    reused after. The build log is ``build.log`` beside it."""
    cache_dir = Path(cache_dir).expanduser()
    root = cache_dir / f"llama-server-{LLAMA_SERVER_VERSION}"
    binary = root / "bin" / "llama-server"
    if binary.exists():
        return binary
    src = root / "src"
    if not (src / "CMakeLists.txt").exists():
        prefix = f"llama_cpp_python-{LLAMA_SERVER_VERSION}/vendor/llama.cpp/"
        part = root / "src.part"
        shutil.rmtree(part, ignore_errors=True)
        with tarfile.open(_sdist(cache_dir, sdist), "r:gz") as tar:
            members = []
            for m in tar.getmembers():
                rel = m.name[len(prefix) :]
                # the top-level models/ holds tokenizer vocabularies, not needed to build
                if m.name.startswith(prefix) and rel and not rel.startswith("models/"):
                    m.name = rel
                    members.append(m)
            tar.extractall(part, members=members, filter="data")
        shutil.rmtree(src, ignore_errors=True)
        part.rename(src)
    build = root / "build"
    gen = ["-G", "Ninja"] if shutil.which("ninja") else []
    with open(root / "build.log", "ab") as log:
        for cmd in (
            ["cmake", "-S", str(src), "-B", str(build), *gen, *CMAKE_FLAGS],
            ["cmake", "--build", str(build), "--target", "llama-server", f"-j{jobs}"],
        ):
            log.write(f"$ {' '.join(cmd)}\n".encode())
            log.flush()
            done = subprocess.run(["nice", "-n", "10", *cmd], stdout=log, stderr=log)
            if done.returncode != 0:
                raise RuntimeError(f"{' '.join(cmd)} failed; see {root / 'build.log'}")
    binary.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy2(build / "bin" / "llama-server", binary.with_suffix(".part"))
    binary.with_suffix(".part").rename(binary)
    return binary


# ---- servers -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Arm:
    """One server configuration: how to start it and on which cores."""

    name: str
    argv: list[str]  # "{port}" is replaced by the port
    cores: tuple[int, ...]
    threads: int  # threads over all its processes (the roofline's cores)


class ServerProcess:
    """A server child in its own session, pinned to ``arm.cores``; stopped on exit whatever
    happened (SIGTERM to its group, then SIGKILL)."""

    def __init__(self, arm: Arm, log: Path, startup_timeout: float) -> None:
        self.arm, self.log, self.startup_timeout = arm, log, startup_timeout
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None
        self.startup_s = 0.0

    def __enter__(self) -> ServerProcess:
        cores = set(self.arm.cores)

        def pre() -> None:
            os.sched_setaffinity(0, cores)
            die_with_parent()

        argv = [a.replace("{port}", str(self.port)) for a in self.arm.argv]
        t0 = time.perf_counter()
        with open(self.log, "ab") as log:
            log.write(f"$ {' '.join(argv)}\n".encode())
            log.flush()
            self.proc = subprocess.Popen(
                argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=pre
            )
        try:
            self._wait_healthy()
        except BaseException:
            self.__exit__(None, None, None)
            raise
        self.startup_s = time.perf_counter() - t0
        return self

    def _wait_healthy(self) -> None:
        assert self.proc is not None
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                tail = self.log.read_text(errors="replace")[-3000:]
                raise RuntimeError(f"{self.arm.name} exited ({self.proc.returncode}):\n{tail}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"{self.arm.name} not healthy after {self.startup_timeout} s")

    def __exit__(self, *exc: object) -> None:
        p = self.proc
        if p is None or p.poll() is not None:
            return
        for sig, wait in ((signal.SIGTERM, 20.0), (signal.SIGKILL, 10.0)):
            try:
                os.killpg(p.pid, sig)
            except ProcessLookupError:
                return
            try:
                p.wait(timeout=wait)
                return
            except subprocess.TimeoutExpired:
                continue


# ---- load --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Request:
    prompt: list[int]
    max_tokens: int


@dataclass
class Outcome:
    """One streamed completion as the client saw it (perf_counter seconds)."""

    sent: float
    arrivals: list[float] = field(default_factory=list)  # one per streamed token
    tokens: int = 0  # completion tokens (the server's usage when it sent one)
    done: float = 0.0
    error: str | None = None

    def ttft(self) -> float | None:
        return self.arrivals[0] - self.sent if self.arrivals else None

    def gaps(self) -> list[tuple[float, float]]:
        return list(zip(self.arrivals, self.arrivals[1:]))


def requests(n: int, vocab: int, lo: int, hi: int, max_tokens: int, seed: int) -> list[Request]:
    """``n`` requests with prompt lengths log-uniform in [lo, hi] and fresh random ids (below
    the special tokens of real vocabularies): the same list for every server."""
    rng = np.random.default_rng(seed)
    lens = np.exp(rng.uniform(math.log(lo), math.log(hi), n)).round().astype(int)
    top = min(vocab, 100_000)
    return [Request([int(x) for x in rng.integers(3, top, int(k))], max_tokens) for k in lens]


async def stream_one(
    session: Any, url: str, req: Request, on_token: Callable[[int], None] | None = None
) -> Outcome:
    """One streaming ``/v1/completions``; a chunk carrying text, or a chunk before the final
    one, is a token arrival; the count is the server's ``usage`` when it sends it."""
    body = {
        "prompt": req.prompt,
        "max_tokens": req.max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
    }
    out = Outcome(sent=time.perf_counter())
    try:
        async with session.post(url + "/v1/completions", json=body) as r:
            if r.status != 200:
                out.error = f"HTTP {r.status}: {(await r.text())[:300]}"
                return out
            usage = None
            async for raw in r.content:
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                ev = json.loads(data)
                if "error" in ev:
                    out.error = str(ev["error"])[:300]
                    break
                usage = ev.get("usage") or usage
                for ch in ev.get("choices") or []:
                    if ch.get("text") or ch.get("finish_reason") is None:
                        out.arrivals.append(time.perf_counter())
                        if on_token is not None:
                            on_token(len(out.arrivals))
            out.tokens = int(usage["completion_tokens"]) if usage else len(out.arrivals)
    except (OSError, asyncio.TimeoutError, ValueError) as exc:
        out.error = f"{type(exc).__name__}: {exc}"[:300]
    out.done = time.perf_counter()
    return out


def _session(timeout: float) -> Any:
    import aiohttp

    # A fresh connection per request, for every arm: llama-server closes a kept-alive connection
    # after a streamed response, and the client's next request on it then fails ("Can not write
    # request body") -- a run with 2 requests per client lost a third of llama-server's requests.
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0, force_close=True),
        timeout=aiohttp.ClientTimeout(total=timeout),
    )


async def closed_loop(url: str, reqs: list[Request], clients: int, timeout: float) -> dict:
    """``clients`` clients each send the next request of ``reqs`` when their last finishes."""
    outcomes: list[Outcome | None] = [None] * len(reqs)
    nxt, idle = 0, None

    async def client(session: Any) -> None:
        nonlocal nxt, idle
        while nxt < len(reqs):
            k, nxt = nxt, nxt + 1
            outcomes[k] = await stream_one(session, url, reqs[k])
        idle = idle or time.perf_counter()  # from here on fewer clients are busy

    async with _session(timeout) as session:
        t0 = time.perf_counter()
        await asyncio.gather(*(client(session) for _ in range(clients)))
        t1 = time.perf_counter()
    done = [o for o in outcomes if o is not None]
    ok = [o for o in done if o.error is None]
    tokens = sum(o.tokens for o in ok)
    steady_end = idle or t1
    steady = sum(t <= steady_end for o in ok for t in o.arrivals)
    ttft = [o.ttft() for o in ok if o.arrivals]
    itl = [b - a for o in ok for a, b in o.gaps()]
    return {
        "tokens_per_s": tokens / (t1 - t0),
        "steady_tokens_per_s": steady / max(steady_end - t0, 1e-9),
        "ttft_ms_p50": _pct(ttft, 50),
        "ttft_ms_p99": _pct(ttft, 99),
        "itl_ms_p50": _pct(itl, 50),
        "itl_ms_p99": _pct(itl, 99),
        "requests_done": len(ok),
        "completion_tokens": tokens,
        "wall_s": t1 - t0,
        "errors": [o.error for o in done if o.error][:3],
    }


async def interference(url: str, shorts: list[Request], long: Request, timeout: float) -> dict:
    """Short streams decoding while a long prompt arrives (see the module docstring). The long
    prompt is sent once every short stream has streamed ``ARRIVE_AFTER`` tokens, or as soon as
    one of them finishes (a server that runs one request at a time never has them all going)."""
    single_req, shorts = shorts[0], shorts[1:]
    async with _session(timeout) as session:
        single = await stream_one(session, url, single_req)
        ready = asyncio.Event()
        reached = [0]

        def on_token(n: int) -> None:
            if n == ARRIVE_AFTER:
                reached[0] += 1
                if reached[0] == len(shorts):
                    ready.set()

        tasks = [asyncio.ensure_future(stream_one(session, url, r, on_token)) for r in shorts]
        waiter = asyncio.ensure_future(ready.wait())
        await asyncio.wait([waiter, *tasks], return_when=asyncio.FIRST_COMPLETED)
        waiter.cancel()
        trigger = "all_streaming" if ready.is_set() else "first_short_finished"
        long_out = await stream_one(session, url, long)
        outs = await asyncio.gather(*tasks)
    errors = [o.error for o in [single, long_out, *outs] if o.error]
    if errors:
        return {"error": errors[0]}
    lo, hi = long_out.sent, long_out.done
    gaps = [b - a for o in outs for a, b in o.gaps()]
    during = [b - a for o in outs for a, b in o.gaps() if b >= lo and a <= hi]
    single_itl = [b - a for a, b in single.gaps()]
    return {
        "trigger": trigger,
        "single_itl_ms_p50": _pct(single_itl, 50),
        "single_itl_ms_p99": _pct(single_itl, 99),
        "itl_ms_p99_during_long": _pct(during, 99),
        "itl_ms_p99": _pct(gaps, 99),
        "itl_ms_max": _pct(gaps, 100),
        "long_ttft_ms": _pct([long_out.ttft()] if long_out.arrivals else [], 50),
        "p99_during_long_vs_single_p50": _pct(during, 99) / max(_pct(single_itl, 50), 1e-9),
    }


def _pct(xs: list, q: float) -> float:
    """The q-th percentile of seconds, in milliseconds (NaN when empty)."""
    return 1e3 * float(np.percentile(xs, q)) if xs else float("nan")


# ---- the machine and the roofline --------------------------------------------------------------
def role_machine(threads: int) -> dict:
    """Read bandwidth and matmul throughput of the cores this process is pinned to."""
    import torch

    torch.set_num_threads(threads)

    def best(fn: Callable[[], object], n: int) -> float:
        fn()
        ts = []
        for _ in range(n):
            t = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t)
        return min(ts)

    x = torch.ones(2**28, dtype=torch.float32)  # 1 GiB, read once per sum
    bw = x.numel() * 4 / best(lambda: x.sum(), 7)
    n = 2048
    a, b = torch.randn(n, n), torch.randn(n, n)
    fp32 = 2 * n**3 / best(lambda: torch.mm(a, b), 5)
    out: dict[str, Any] = {
        "threads": threads,
        "read_gb_per_s": round(bw / 1e9, 2),
        "fp32_gflop_per_s": round(fp32 / 1e9, 1),
    }
    try:
        ai = torch.randint(-128, 127, (n, n), dtype=torch.int8)
        bi = torch.randint(-128, 127, (n, n), dtype=torch.int8)
        out["int8_gop_per_s"] = round(2 * n**3 / best(lambda: torch._int_mm(ai, bi), 3) / 1e9, 1)
        out["int8_note"] = "torch._int_mm: what torch reaches, a lower bound on the cores' peak"
    except (RuntimeError, AttributeError) as exc:
        out["int8_gop_per_s"] = None
        out["int8_note"] = f"torch._int_mm unavailable here: {exc}"[:200]
    return out


def measure_machine(cores: tuple[int, ...], timeout: float) -> dict:
    """:func:`role_machine` in a child pinned to ``cores`` (one thread per core)."""
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks.edge_serving", "--role", "machine"]
        + ["--threads", str(len(cores))],
        capture_output=True,
        text=True,
        timeout=timeout,
        preexec_fn=lambda: os.sched_setaffinity(0, set(cores)),
    )
    if out.returncode != 0:
        raise RuntimeError(f"machine measurement failed:\n{out.stderr[-2000:]}")
    return {"cores": list(cores), **json.loads(out.stdout.strip().splitlines()[-1])}


def model_costs(file: Path) -> dict:
    """Bytes and FLOPs a decode step costs, from the GGUF file's tensors and shapes."""
    r = open_reader(str(file))
    arch = str(r.fields["general.architecture"].contents())

    def meta(key: str) -> int:
        return int(r.fields[f"{arch}.{key}"].contents())

    names = {t.name: t for t in r.tensors}
    tied = "output.weight" not in names
    embd = names["token_embd.weight"]
    weight_bytes = sum(int(t.n_bytes) for t in r.tensors)
    matmul = sum(int(t.n_elements) for t in r.tensors if len(t.shape) == 2)
    if not tied:  # the embedding is a lookup; only a tied head reads all of it
        weight_bytes -= int(embd.n_bytes)
        matmul -= int(embd.n_elements)
    layers, heads = meta("block_count"), meta("attention.head_count")
    hidden = meta("embedding_length")
    head_dim = hidden // heads
    kv_heads = meta("attention.head_count_kv")
    return {
        "weight_bytes_per_step": weight_bytes,
        "tied_head": tied,
        "matmul_params": matmul,
        "flops_per_token_matmul": 2 * matmul,
        "attention_flops_per_token_per_context": 4 * layers * heads * head_dim,
        "kv_bytes_per_context_token_f16": 2 * layers * 2 * kv_heads * head_dim,
    }


def roofline(costs: dict, machine: dict, batch: int, context: float) -> dict:
    """Tokens/s bound of a decode step over ``batch`` sequences of ``context`` tokens each."""
    step_bytes = (
        costs["weight_bytes_per_step"] + batch * context * (costs["kv_bytes_per_context_token_f16"])
    )
    step_flops = batch * (
        costs["flops_per_token_matmul"] + context * costs["attention_flops_per_token_per_context"]
    )
    peak = max(machine["fp32_gflop_per_s"], machine.get("int8_gop_per_s") or 0.0) * 1e9
    t_mem = step_bytes / (machine["read_gb_per_s"] * 1e9)
    t_flops = step_flops / peak
    return {
        "batch": batch,
        "mean_context": round(context, 1),
        "bytes_per_step": int(step_bytes),
        "flops_per_step": int(step_flops),
        "memory_bound_tokens_per_s": round(batch / t_mem, 2),
        "compute_bound_tokens_per_s": round(batch / t_flops, 2),
        "bound_tokens_per_s": round(batch / max(t_mem, t_flops), 2),
        "bound_by": "memory" if t_mem >= t_flops else "compute",
    }


# ---- orchestration -----------------------------------------------------------------------------
def _lowband_flags() -> dict[str, bool]:
    """Which of the serving flags this checkout's CLI has (``--parallel`` is new)."""
    flags = {}
    for cmd in ("serve", "run"):
        out = subprocess.run(
            [sys.executable, "-m", "cli", "edge", cmd, "--help"],
            capture_output=True,
            text=True,
            timeout=120,
        )
        flags[cmd] = "--parallel" in out.stdout
    return flags


# ``lowband edge ...`` with the C++ kernels built under a private root: the default root is
# shared by every checkout on the machine, and a build there by another one holds up the start.
_LOWBAND = (
    "import sys; from edge.quant import kernel; kernel.configure(build_root=sys.argv[1]); "
    "from cli import main; sys.exit(main(sys.argv[2:]))"
)


def make_arms(file: Path, a, flags: dict[str, bool], llama_server: Path | None) -> list[Arm]:
    cores = tuple(range(a.threads))
    par = ["--parallel", str(a.parallel)]
    extra = shlex.split(a.lowband_args)
    lb = [sys.executable, "-c", _LOWBAND, a.kernels, "edge"] if a.kernels else []
    lb = lb or [sys.executable, "-m", "cli", "edge"]
    arms = []
    if 1 in a.devices:
        argv = [*lb, "serve", str(file), "--port", "{port}", "--threads", str(a.threads)]
        argv += ["--cores", ",".join(map(str, cores)), "--max-queue", "256"]
        argv += par if flags["serve"] else []
        arms.append(Arm("lowband", argv + extra, cores, a.threads))
    if llama_server is not None:
        ctx = a.parallel * (max(a.max_prompt, a.long_prompt) + a.max_tokens + 64)
        argv = [str(llama_server), "-m", str(file), "-t", str(a.threads), "-tb", str(a.threads)]
        argv += ["-np", str(a.parallel), "-c", str(ctx), "--host", "127.0.0.1"]
        argv += ["--port", "{port}", "--no-webui"]
        arms.append(Arm("llama-server", argv, cores, a.threads))
    if 2 in a.devices:  # (its worker processes use the default kernels root)
        argv = [*lb, "run", str(file), "--devices", "2", "--pin-cores", "--port", "{port}"]
        argv += ["--max-queue", "256"]
        argv += par if flags["run"] else []
        arms.append(Arm("lowband-tp2", argv + extra, (0, 1), 2))
    return arms


def _stats(xs: list[float], nd: int = 2) -> dict:
    xs = [x for x in xs if not math.isnan(x)]
    if not xs:
        return {"median": None, "min": None, "max": None}
    return {
        "median": round(statistics.median(xs), nd),
        "min": round(min(xs), nd),
        "max": round(max(xs), nd),
    }


def run_arm(arm: Arm, workload: dict, log: Path, a) -> dict:
    """One round of one arm: a fresh server, a warm-up request, every level, interference."""
    with ServerProcess(arm, log, a.startup_timeout) as srv:
        warm = workload["warmup"]

        async def go() -> dict:
            async with _session(a.request_timeout) as s:
                w = await stream_one(s, srv.url, warm)
                if w.error:
                    raise RuntimeError(f"{arm.name} warm-up failed: {w.error}")
            res: dict = {"startup_s": round(srv.startup_s, 1), "levels": {}}
            for c, reqs in workload["levels"].items():
                res["levels"][c] = await closed_loop(srv.url, reqs, c, a.request_timeout)
            if workload["interference"] is not None:
                shorts, long = workload["interference"]
                res["interference"] = await interference(srv.url, shorts, long, a.request_timeout)
            return res

        return asyncio.run(go())


LEVEL_KEYS = (
    "tokens_per_s",
    "steady_tokens_per_s",
    "ttft_ms_p50",
    "ttft_ms_p99",
    "itl_ms_p50",
    "itl_ms_p99",
)


def summarize(rounds: list[dict], workload: dict, costs: dict, machine: dict) -> dict:
    """Medians (min/max) over rounds per level, against the roofline of these cores."""
    out: dict = {"startup_s": _stats([r["startup_s"] for r in rounds], 1), "levels": {}}
    for c, reqs in workload["levels"].items():
        rs = [r["levels"][c] for r in rounds]
        lvl: dict[str, Any] = {k: _stats([r[k] for r in rs]) for k in LEVEL_KEYS}
        lvl["requests_done"] = _stats([r["requests_done"] for r in rs], 0)
        lvl["requests_sent"] = len(reqs)
        lvl["completion_tokens"] = _stats([r["completion_tokens"] for r in rs], 0)
        errors = [e for r in rs for e in r["errors"]]
        if errors:
            lvl["errors"] = errors[:3]
        # mean tokens in a sequence's cache over its decode: its prompt and half its output
        context = statistics.mean(len(q.prompt) + q.max_tokens / 2 for q in reqs)
        roof = roofline(costs, machine, c, context)
        lvl["roofline"] = roof
        med = lvl["tokens_per_s"]["median"]
        steady = lvl["steady_tokens_per_s"]["median"]
        bound = roof["bound_tokens_per_s"]
        lvl["fraction_of_roofline"] = round(med / bound, 3) if med else None
        lvl["steady_fraction_of_roofline"] = round(steady / bound, 3) if steady else None
        out["levels"][f"c{c}"] = lvl
    inter = [r["interference"] for r in rounds if "interference" in r]
    if inter:
        good = [x for x in inter if "error" not in x]
        keys = [k for k in (good[0] if good else {}) if k != "trigger"]
        out["interference"] = {k: _stats([x[k] for x in good]) for k in keys}
        out["interference"]["triggers"] = sorted({x["trigger"] for x in good})
        if len(good) < len(inter):
            out["interference"]["errors"] = [x["error"] for x in inter if "error" in x][:3]
    return out


def _ratios(arms: dict, num: str, den: str) -> dict:
    """tokens/s of ``num`` over ``den`` per level; None where either arm lost a request (the
    two did not do the same work) or has no figure."""
    if num not in arms or den not in arms:
        return {}
    out = {}
    for c, lvl in arms[num]["levels"].items():
        other = arms[den]["levels"][c]
        x, y = lvl["tokens_per_s"]["median"], other["tokens_per_s"]["median"]
        ok = x and y and "errors" not in lvl and "errors" not in other
        out[c] = round(x / y, 3) if ok else None
    return out


def workload_for(vocab: int, a) -> dict:
    levels = {
        c: requests(
            c * a.requests_per_client,
            vocab,
            a.min_prompt,
            a.max_prompt,
            a.max_tokens,
            a.seed + 1000 * c,
        )
        for c in a.concurrency
    }
    inter = None
    if a.interference_concurrency > 0:
        # the first is the stream timed alone, the others decode while the long prompt arrives
        n = a.interference_concurrency + 1
        shorts = requests(n, vocab, SHORT_PROMPT, SHORT_PROMPT, a.max_tokens, a.seed + 7)
        long = requests(1, vocab, a.long_prompt, a.long_prompt, 8, a.seed + 8)[0]
        inter = (shorts, long)
    warmup = requests(1, vocab, SHORT_PROMPT, SHORT_PROMPT, 4, a.seed + 9)[0]
    return {"levels": levels, "interference": inter, "warmup": warmup}


def _vocab(file: Path) -> int:
    r = open_reader(str(file))
    return len(r.fields["tokenizer.ggml.tokens"].data)


def bench(file: Path, a) -> dict:
    llama_server = None
    if not a.lowband_only:
        llama_server = Path(a.llama_server) if a.llama_server else build_llama_server(a.cache)
    flags = _lowband_flags()
    arms = make_arms(file, a, flags, llama_server)
    workload = workload_for(_vocab(file), a)
    costs = model_costs(file)
    machines = {
        cores: measure_machine(cores, a.request_timeout) for cores in {arm.cores for arm in arms}
    }
    work = Path(tempfile.mkdtemp(prefix="lowband-edge-serving-", dir=a.workdir))
    rounds: dict[str, list[dict]] = {arm.name: [] for arm in arms}
    failed: dict[str, str] = {}  # an arm that failed a round is reported, not retried
    try:
        for i in range(a.repeats):  # alternate, swapping who goes first each round
            for arm in arms if i % 2 == 0 else arms[::-1]:
                if arm.name in failed:
                    continue
                try:
                    rounds[arm.name].append(run_arm(arm, workload, work / f"{arm.name}.log", a))
                except (RuntimeError, TimeoutError, OSError) as exc:
                    failed[arm.name] = f"round {i}: {exc}"[:2000]
                if a.keep_logs:  # what a run cut short has measured so far
                    (work / "rounds.json").write_text(json.dumps(rounds))
    finally:
        if a.keep_logs:
            print(f"server logs kept in {work}", file=sys.stderr)
        else:
            shutil.rmtree(work, ignore_errors=True)
    res_arms = {
        arm.name: {
            "argv": [x.replace(str(Path.home()), "~") for x in arm.argv],
            "cores": list(arm.cores),
            **({"error": failed[arm.name]} if arm.name in failed else {}),
            **summarize(rounds[arm.name], workload, costs, machines[arm.cores]),
        }
        for arm in arms
    }
    return {
        "lowband_cli_has_parallel": flags,
        "llama_server": None
        if llama_server is None
        else {"binary": str(llama_server), "source": LLAMA_CPP_PYTHON, "cmake": list(CMAKE_FLAGS)},
        "machine": {",".join(map(str, k)): v for k, v in machines.items()},
        "costs": costs,
        "arms": res_arms,
        "lowband_vs_llama_server": _ratios(res_arms, "lowband", "llama-server"),
        "tp2_vs_1_device": _ratios(res_arms, "lowband-tp2", "lowband"),
    }


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.edge_serving", description=__doc__.split("\n")[0]
    )
    p.add_argument("--json", action="store_true", help="print only the JSON result line")
    p.add_argument("--model", default="llama32-1b", help=f"of {sorted(MODELS)}")
    p.add_argument("--width", default="q4_k_m", choices=["q4_k_m", "q4_0", "q8_0"])
    p.add_argument("--gguf", help="serve this GGUF file instead of --model/--width")
    p.add_argument("--lowband-only", action="store_true", help="no llama-server (smoke test)")
    p.add_argument("--llama-server", help="an existing llama-server binary (else built once)")
    p.add_argument("--sdist", help="the llama-cpp-python source release (else pip download)")
    p.add_argument("--concurrency", default="1,4,8,16", help="closed-loop client counts")
    p.add_argument("--requests-per-client", type=int, default=2)
    p.add_argument("--min-prompt", type=int, default=32)
    p.add_argument("--max-prompt", type=int, default=2048)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--interference-concurrency", type=int, default=8, help="0: skip it")
    p.add_argument("--long-prompt", type=int, default=2048, help="the prompt that arrives")
    p.add_argument("--parallel", type=int, default=16, help="server slots (-np, --parallel)")
    p.add_argument("--threads", type=int, default=1, help="cores 0..T-1, T threads")
    p.add_argument(
        "--lowband-args",
        default="",
        help="more arguments for the lowband servers, e.g. '--decode-stall 3 --prefill-chunk 512'",
    )
    p.add_argument("--devices", default="1,2", help="lowband arms: 1 device, 2 (TP) or both")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cache", default="~/.cache/lowband/bench")
    p.add_argument("--workdir", default=None)
    p.add_argument(
        "--keep-logs",
        action="store_true",
        help="keep the servers' logs and each round's figures (rounds.json) in the work dir",
    )
    p.add_argument(
        "--kernels",
        default=None,
        help="C++ kernels' build root for the 1-device lowband server (default "
        "~/.cache/lowband/bench/kernels-<checkout>; '' = the library's default)",
    )
    p.add_argument("--startup-timeout", type=float, default=1200.0)
    p.add_argument("--request-timeout", type=float, default=3600.0)
    p.add_argument("--role", choices=["machine"], help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.role == "machine":
        print(json.dumps(role_machine(a.threads)))
        return 0
    a.concurrency, a.devices = _ints(a.concurrency), _ints(a.devices)
    a.cache = Path(a.cache).expanduser()
    if a.kernels is None:  # per checkout, as benchmarks.edge_vs_llamacpp's
        tag = hashlib.sha256(str(Path(__file__).resolve().parent.parent).encode()).hexdigest()
        a.kernels = str(a.cache / f"kernels-{tag[:12]}")
    if not set(a.devices) <= {1, 2} or not a.devices:
        p.error("--devices takes 1, 2 or 1,2")
    if not 1 <= a.min_prompt <= a.max_prompt or min(a.concurrency, default=0) < 1:
        p.error("need 1 <= --min-prompt <= --max-prompt and concurrency levels >= 1")
    if max(a.concurrency) > a.parallel:
        p.error("--parallel must cover the highest --concurrency")
    t0, load0 = time.perf_counter(), os.getloadavg()[0]
    if a.gguf:
        file, name = Path(a.gguf), Path(a.gguf).name
    else:
        ns = argparse.Namespace(lowband_only=a.lowband_only, cache=str(a.cache), seed=a.seed)
        file, name = make_files(a.model, [a.width], ns)[a.width], a.model
    result = {
        "bench": "edge_serving",
        "model": name,
        "width": None if a.gguf else a.width,
        "file_mb": round(file.stat().st_size / 2**20, 1),
        "concurrency": a.concurrency,
        "requests_per_client": a.requests_per_client,
        "prompt_tokens": [a.min_prompt, a.max_prompt],
        "max_tokens": a.max_tokens,
        "parallel": a.parallel,
        "threads": a.threads,
        "repeats": a.repeats,
        **bench(file, a),
        "bench_seconds": round(time.perf_counter() - t0, 1),
        "loadavg_1m": [round(load0, 2), round(os.getloadavg()[0], 2)],
        "cpus": os.cpu_count(),
    }
    if not a.json:
        print(json.dumps(result, indent=2))
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
