"""A bit-nested MoE in the edge runtime: placement (pure), tensor parallelism with experts placed
across devices == one device, the sliding window over the backbone, and HTTP serving under an
expert budget (``lowband edge serve`` / ``lowband edge run --devices 2``)."""

from __future__ import annotations

import json
import subprocess
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch

from edge import fastpath
from edge.cluster import ClusterConfig, MasterRunner, WorkerConfig, run_worker
from edge.engine import Engine, LocalRunner
from edge.launch import check_model
from edge.moe.checkpoint import load_dense, quantize_nested_checkpoint
from edge.moe.quant import NestedQuantConfig
from edge.moe.serve import (
    ExpertServeConfig,
    load_nested_shard,
    manifest_sizes,
    merge_reports,
    place_experts,
    plan_ranks,
    rank_budgets,
)
from edge.sampling import SamplingParams
from edge.server import chat_prompt
from edge.shardio import WindowConfig
from edge.tp import make_reduce
from lowband.errors import ConfigError
from lowband.models.llama import LlamaForCausalLM, init_weights
from lowband.models.tokenizer import ByteTokenizer
from lowband.models.weights import save_pretrained
from lowband.proc import free_port
from tests.conftest import PY, run_ranks
from tests.edge.moe.test_nested import tiny_moe_config
from transport.loopback import LoopbackGroup

pytestmark = pytest.mark.timeout(120)

PROMPT = "ROMEO: But soft, what"
CHAT = [{"role": "user", "content": "Speak, friend"}]
N_TOK = 12


@pytest.fixture(scope="module")
def nested(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random-init Mixtral (3 layers x 8 experts; sharp routers, so routing changes from token
    to token as in a trained model) converted to bit-nested planes."""
    root = tmp_path_factory.mktemp("moe_http")
    model = LlamaForCausalLM(
        tiny_moe_config(num_local_experts=8, num_hidden_layers=3, max_position_embeddings=256)
    )
    init_weights(model, std=0.1, seed=17)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.block_sparse_moe.gate.weight.mul_(20)
    src = save_pretrained(model, root / "src")
    ByteTokenizer().save(src)
    return quantize_nested_checkpoint(src, root / "nested", NestedQuantConfig(group_size=32))


def int8_mb(nested: Path) -> float:
    return sum(s[8] for s in manifest_sizes(nested).values()) / 1e6


def lru8(nested: Path, frac: float) -> ExpertServeConfig:
    """Every expert at 8 bits, LRU, within ``frac`` of the int8 size: deterministic values
    (prefetch and eviction change what is resident, never what is computed)."""
    return ExpertServeConfig(budget_mb=frac * int8_mb(nested), policy="lru", lru_bits=8)


@pytest.fixture(scope="module")
def reference(nested: Path) -> dict[str, str]:
    """Greedy text of the dense int8 model (what moe-generate serves at 8 bits)."""
    eng = Engine(LocalRunner(load_dense(nested, 8)), ByteTokenizer(), model_name="ref")
    p = SamplingParams(max_tokens=N_TOK, temperature=0.0)
    return {"completion": eng.complete(PROMPT, p)[0], "chat": eng.complete(chat_prompt(CHAT), p)[0]}


# ---- pure ------------------------------------------------------------------------------------
def test_place_experts_balanced_and_complete() -> None:
    for L, E, world, w in [
        (3, 8, 2, None),
        (3, 8, 3, None),
        (4, 8, 3, (2, 1, 1)),
        (2, 4, 5, None),
        (1, 3, 4, (1, 1, 1, 1)),
        (32, 8, 4, (1, 2, 3, 4)),
    ]:
        p = place_experts(L, E, world, w)
        flat = [k for keys in p.values() for k in keys]
        assert sorted(flat) == [(i, e) for i in range(L) for e in range(E)]  # each exactly once
        weights = w or (1,) * world
        for r, keys in p.items():
            share = L * E * weights[r] / sum(weights)
            assert abs(len(keys) - share) < 1 + 1e-9, (L, E, world, w, r, len(keys))
    # equal weights: a layer's experts are spread as evenly as possible over the ranks
    p = place_experts(3, 8, 3)
    for layer in range(3):
        per_rank = [sum(k[0] == layer for k in p[r]) for r in range(3)]
        assert max(per_rank) - min(per_rank) <= 1
    assert p == place_experts(3, 8, 3)  # deterministic: every rank computes the same answer
    assert place_experts(2, 4, 1) == {0: [(i, e) for i in range(2) for e in range(4)]}
    with pytest.raises(ConfigError):
        place_experts(2, 4, 2, (1, 0))
    with pytest.raises(ConfigError):
        place_experts(2, 4, 0)


def test_rank_budgets_and_merge_reports() -> None:
    placement = {0: [(0, 0), (0, 1)], 1: [(0, 2)], 2: []}
    sizes = {(0, 0): 100, (0, 1): 100, (0, 2): 200}
    assert rank_budgets(placement, sizes, 1000) == {0: 500, 1: 500, 2: 0}
    a = {"hits": 3, "misses": 1, "stall_s": 0.5, "bytes_read": 10, "calls_by_bits": {"8": 4}}
    b = {"hits": 1, "misses": 3, "stall_s": 0.25, "bytes_read": 5, "calls_by_bits": {"2": 4}}
    m = merge_reports([a, b])
    assert (m["hits"], m["misses"], m["bytes_read"], m["devices_reporting"]) == (4, 4, 15, 2)
    assert m["hit_rate"] == 0.5 and m["stall_s"] == 0.75 and m["mean_bits_per_call"] == 5.0


def test_budget_and_directory_checks(nested: Path, tmp_path: Path) -> None:
    sizes = manifest_sizes(nested)
    two_bit = max(s[2] for s in sizes.values()) / 1e6
    with pytest.raises(ConfigError, match="cannot hold one expert"):
        plan_ranks(nested, 1, None, ExpertServeConfig(budget_mb=two_bit * 0.9))
    plan_ranks(nested, 1, None, ExpertServeConfig(budget_mb=two_bit * 1.01))
    # over 3 devices each share must hold its largest expert: the message says how much is needed
    with pytest.raises(ConfigError, match="at least") as exc:
        plan_ranks(nested, 3, None, ExpertServeConfig(budget_mb=two_bit * 2))
    need = float(str(exc.value).rsplit(" ", 1)[1])
    plan_ranks(nested, 3, None, ExpertServeConfig(budget_mb=need * 1.001))
    with pytest.raises(ConfigError, match="expert-budget-mb"):
        check_model(str(nested), ClusterConfig(devices=1))
    with pytest.raises(ConfigError, match="not a bit-nested"):
        check_model(str(nested / "..") + "/src", ClusterConfig(devices=1, experts=lru8(nested, 1)))
    with pytest.raises(ConfigError, match="window"):
        check_model(str(nested), ClusterConfig(devices=2, window=1, experts=lru8(nested, 1)))


# ---- tensor parallel == one device ------------------------------------------------------------
@pytest.mark.parametrize("world,weights", [(2, None), (3, (2.0, 1.0, 1.0))])
def test_tp_placed_experts_match_one_device(nested: Path, world: int, weights) -> None:
    cfg = lru8(nested, 1.0)  # every expert resident at 8 bits on every rank
    ids = torch.tensor([list(b"Now is the winter of our discontent")])
    one = load_nested_shard(nested, experts=cfg)
    assert fastpath.active(one.model)  # the store's experts called back from the compiled step
    try:
        with torch.no_grad():
            kv = one.model.new_cache()
            want = [one.model(ids[:, :-3], cache=kv)]
            want += [
                one.model(ids[:, t : t + 1], cache=kv)
                for t in range(ids.shape[1] - 3, ids.shape[1])
            ]
        want = torch.cat(want, 1)
        x = one.model.embed(ids).detach()  # what the master sends every worker
    finally:
        one.close()
    group = LoopbackGroup(world, timeout=30)
    comms = group.comms()

    def rank_fn(r: int):
        def body():
            sh = load_nested_shard(
                nested, r, world, experts=cfg, weights=weights, reduce=make_reduce(comms[r])
            )
            try:
                assert fastpath.active(sh.model)
                kv, outs = sh.model.new_cache(), []
                T = ids.shape[1]
                with torch.no_grad():
                    for a, b in [(0, T - 3)] + [(t, t + 1) for t in range(T - 3, T)]:
                        h = sh.model.forward_layers(x[:, a:b], cache=kv, start=a)
                        if r == 0:
                            outs.append(sh.model.head(h))
                return (torch.cat(outs, 1) if outs else None), sh.store.keys, sh.store.report()
            finally:
                sh.close()

        return body

    res = run_ranks([rank_fn(r) for r in range(world)], timeout=60)
    got = res[0][0]
    assert (got - want).abs().max().item() <= 1e-4
    held = [set(keys) for _, keys, _ in res]
    assert set().union(*held) == set(manifest_sizes(nested)) and sum(map(len, held)) == 24
    assert all(rep["calls_by_bits"].keys() <= {"8"} for _, _, rep in res)
    if weights:  # the heavier device holds more experts
        assert len(held[0]) > len(held[1])


@pytest.mark.parametrize("policy", ["lru", "hebf"])
def test_engine_cluster_two_devices_under_budget(
    nested: Path, reference: dict, policy: str
) -> None:
    cfg = (
        lru8(nested, 0.4) if policy == "lru" else ExpertServeConfig(budget_mb=0.4 * int8_mb(nested))
    )
    group = LoopbackGroup(2, timeout=20)
    comms = group.comms()
    worker = run_ranks_async(lambda: run_worker(comms[1], WorkerConfig(join_timeout=20)))
    runner = MasterRunner(
        comms[0],
        nested,
        ClusterConfig(devices=2, op_timeout=10.0, join_timeout=20, heartbeat_s=0.5, experts=cfg),
    )
    try:
        eng = Engine(runner, ByteTokenizer(), model_name="m")
        text, _, n = eng.complete(PROMPT, SamplingParams(max_tokens=N_TOK))
        rep = runner.store_report()
    finally:
        runner.close()
        worker.join(10)
    assert n == N_TOK
    if policy == "lru":  # 8 bits everywhere: exactly the int8 model
        assert text == reference["completion"] and rep["mean_bits_per_call"] == 8.0
        assert rep["misses"] > 0  # 40% of int8 cannot keep every expert: LRU reloads
    else:  # HEBF keeps every expert, cold ones narrow, to fit 40% of int8
        assert 2.0 <= rep["mean_bits_per_call"] < 8.0
    assert rep["devices_reporting"] == 2
    assert rep["peak_bytes"] <= rep["budget_bytes"] <= cfg.budget_mb * 1e6
    assert worker.error is None


class run_ranks_async:  # noqa: N801 - reads like a function at the call site
    """Run ``fn`` in a daemon thread; ``error`` holds what it raised."""

    def __init__(self, fn) -> None:
        self.error: BaseException | None = None

        def body() -> None:
            try:
                fn()
            except BaseException as exc:  # noqa: BLE001 - asserted by the test
                self.error = exc

        self.thread = threading.Thread(target=body, daemon=True)
        self.thread.start()

    def join(self, timeout: float) -> None:
        self.thread.join(timeout)


# ---- sliding window over the backbone -----------------------------------------------------------
def test_mapped_region_is_one_layer(nested: Path) -> None:
    from edge.window import MappedFile, MappedRegion

    f = MappedFile(nested / "model.safetensors")
    layer1 = [k for k in f.tensors if k.startswith("model.layers.1.")]
    reg = MappedRegion(f, layer1)
    for name, t in f.tensors.items():  # no tensor of another layer starts inside the span
        off = t.data_ptr() - f.addr
        inside = reg.offset <= off < reg.offset + reg.size
        if name.startswith("model.layers.1."):
            assert inside
    assert reg.size % 4096 == 0 or reg.offset + reg.size == f.size
    torch.testing.assert_close(reg.tensors[layer1[0]], f.tensors[layer1[0]])
    # tensors of two layers with a third in between are refused, not silently over-mapped
    with pytest.raises(ConfigError, match="contiguous"):
        MappedRegion(
            f, [k for k in f.tensors if k.startswith(("model.layers.0.", "model.layers.2."))]
        )


def test_window_streams_backbone_same_greedy(nested: Path, reference: dict) -> None:
    sh = load_nested_shard(nested, experts=lru8(nested, 0.4), window=WindowConfig(window=1))
    try:
        eng = Engine(LocalRunner(sh.model), ByteTokenizer(), model_name="m")
        text, _, _ = eng.complete(PROMPT, SamplingParams(max_tokens=N_TOK))
        assert sh.scheduler is not None and sh.scheduler.window == 1
        assert len(sh.scheduler.resident()) <= 1
        # the regions cover each layer's backbone bytes and nothing of another layer
        sizes = [f.size for f in sh.scheduler.files]
        assert len(sizes) == 3 and all(s > 0 for s in sizes)
    finally:
        sh.close()
    assert text == reference["completion"]


# ---- HTTP ------------------------------------------------------------------------------------
def _http(port: int, path: str, body: dict | None = None, timeout: float = 60):
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}",
        data=None if body is None else json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            raw = r.read()
            return r.status, (raw if body and body.get("stream") else json.loads(raw))
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _wait_ready(port: int, proc, timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, "the server exited"
        try:
            if _http(port, "/health", timeout=5)[0] == 200:
                return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(0.2)
    raise AssertionError("the server never became healthy")


def _check_api(port: int, reference: dict, devices: int, budget_mb: float) -> None:
    status, out = _http(
        port, "/v1/completions", {"prompt": PROMPT, "max_tokens": N_TOK, "temperature": 0}
    )
    assert status == 200, out
    assert out["choices"][0]["text"] == reference["completion"]
    status, raw = _http(
        port,
        "/v1/chat/completions",
        {"messages": CHAT, "max_tokens": N_TOK, "temperature": 0, "stream": True},
    )
    assert status == 200
    events = [line[6:] for line in raw.decode().split("\n\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    text = "".join(json.loads(e)["choices"][0]["delta"].get("content") or "" for e in events[:-1])
    assert text == reference["chat"]
    status, m = _http(port, "/metrics")
    store = m["expert_store"]
    assert store["devices_reporting"] == devices
    assert 0.0 <= store["hit_rate"] <= 1.0 and store["misses"] > 0
    assert store["mean_bits_per_call"] == 8.0 and store["bytes_read"] > 0
    assert store["stall_s"] >= 0.0
    assert store["peak_bytes"] <= budget_mb * 1e6


def _serve_lru(spawn, nested: Path, *command: str) -> tuple[int, float]:
    """``lowband edge COMMAND NESTED`` (serve, or run with its devices) with an int8 LRU expert
    store of 0.4 of the experts' int8 bytes, on one thread, once it answers: (port, budget MB)."""
    budget_mb, port = lru8(nested, 0.4).budget_mb, free_port()
    args = [PY, "-m", "cli", "edge", command[0], str(nested), *command[1:], "--port", str(port)]
    args += ["--expert-budget-mb", f"{budget_mb:.6f}", "--expert-policy", "lru", "--threads", "1"]
    _wait_ready(port, spawn(args))
    return port, budget_mb


def test_http_serve_under_budget(nested: Path, reference: dict, spawn) -> None:
    port, budget_mb = _serve_lru(spawn, nested, "serve")
    _check_api(port, reference, 1, budget_mb)
    # a budget below one expert's narrowest width is refused before serving
    sizes = manifest_sizes(nested)
    tiny = 0.5 * min(s[2] for s in sizes.values()) / 1e6
    bad = spawn(
        [
            PY,
            "-m",
            "cli",
            "edge",
            "serve",
            str(nested),
            "--port",
            str(free_port()),
            "--expert-budget-mb",
            f"{tiny:.6f}",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    out, err = bad.communicate(timeout=60)
    assert bad.returncode == 2, err
    assert "cannot hold one expert at 2 bits" in err and "serving" not in out


def test_http_run_two_devices_under_budget(nested: Path, reference: dict, spawn) -> None:
    port, budget_mb = _serve_lru(spawn, nested, "run", "--devices", "2")
    _check_api(port, reference, 2, budget_mb)


def test_serve_bench_local_case_smoke(nested: Path) -> None:
    """``python -m benchmarks.moe_serve`` runs this per case in a subprocess; here in-process."""
    from benchmarks.moe_serve import run_local

    threads = torch.get_num_threads()
    try:
        res = run_local(nested, 0.4 * int8_mb(nested), "hebf", 1, tokens=4, threads=1)
    finally:
        torch.set_num_threads(threads)
    assert res["tokens"] == 4 and res["tokens_per_s"] > 0
    assert 2.0 <= res["mean_bits"] < 8.0 and res["peak_rss_mb"] >= res["model_rss_mb"]


def test_replan_onto_survivor_replaces_experts(nested: Path, reference: dict) -> None:
    """A 3-device nested cluster loses a worker; with replan_after_s the master re-places every
    expert over the 2 devices left (each re-opens its new share) and serves the same text."""
    cfg = lru8(nested, 1.0)
    group = LoopbackGroup(3, timeout=20)
    comms = group.comms()
    workers = [
        run_ranks_async(lambda c=c: run_worker(c, WorkerConfig(join_timeout=20))) for c in comms[1:]
    ]
    runner = MasterRunner(
        comms[0],
        nested,
        ClusterConfig(
            devices=3,
            op_timeout=5.0,
            join_timeout=20,
            heartbeat_s=0.3,
            replan_after_s=0.2,
            experts=cfg,
        ),
    )
    eng = Engine(runner, ByteTokenizer(), model_name="m")
    p = SamplingParams(max_tokens=N_TOK)
    try:
        assert eng.complete(PROMPT, p)[0] == reference["completion"]
        assert len(runner.shard.store.keys) == 8  # 24 experts / 3 devices
        group.kill(2)
        deadline = time.monotonic() + 20
        while runner.health()["healthy"] and time.monotonic() < deadline:
            time.sleep(0.05)
        while not runner.health()["healthy"] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert runner.health()["devices"] == 2
        assert len(runner.shard.store.keys) == 12  # re-placed over 2 devices
        assert eng.complete(PROMPT, p)[0] == reference["completion"]
        assert runner.store_report()["devices_reporting"] == 2
    finally:
        runner.close()
        for w in workers:
            w.join(10)
