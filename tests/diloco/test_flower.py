"""Flower DiLoCo: codec glue, config, DiLoCoStrategy math and failure semantics (unit), and
multi-round federations through an in-process Grid, checked against the lowband trainer."""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import sys

import flwr  # noqa: F401 - required (the dev extra): a broken install fails, not skips
import pytest
import torch
from flwr.app import (
    ArrayRecord,
    ConfigRecord,
    Error,
    Message,
    MetricRecord,  # noqa: E402
    RecordDict,
)
from torch import nn

from diloco.flower.client import handle  # noqa: E402
from diloco.flower.config import (
    APP_CONFIG_DEFAULTS,
    FlowerConfig,
    from_run_config,  # noqa: E402
    node_config,
    sync_fragment,
)
from diloco.flower.inprocess import InProcessGrid, ensure_task_identity  # noqa: E402
from diloco.flower.records import (
    encoded_to_records,
    params_to_record,
    raw_array,  # noqa: E402
    raw_tensor,
    record_to_params,
    records_to_encoded,
)
from diloco.flower.server import run_server  # noqa: E402
from diloco.flower.strategy import (
    CONFIG,
    DELTA,
    GLOBAL,
    METRICS,
    REPLY,  # noqa: E402
    DiLoCoStrategy,
)
from diloco.metrics import read_jsonl  # noqa: E402
from diloco.task import lm_task  # noqa: E402
from lowband.codecs import codec_names, get_codec  # noqa: E402
from lowband.errors import ConfigError, ProtocolError  # noqa: E402


@pytest.fixture(autouse=True)
def _one_thread():
    # Several ClientApps share 2 busy cores here; one intra-op thread each is much faster.
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    ensure_task_identity()
    yield
    torch.set_num_threads(n)


def run_cfg(**kw) -> dict:
    """A small, fast run config (tiny model, short sequences)."""
    base = {
        "inner-steps": 4,
        "fragments": 1,
        "codec": "fp32",
        "seq-len": 32,
        "batch-size": 4,
        "num-server-rounds": 2,
        "warmup-steps": 0,
        "evaluate-every": 0,
        "min-available-nodes": 1,
    }
    base.update(kw)
    return base


# ---- codec glue ------------------------------------------------------------------------------
@pytest.mark.parametrize("name", codec_names())
def test_codec_frames_round_trip_through_records(name):
    codec = get_codec(name)
    x = torch.randn(1000) * 3
    enc = codec.encode(x)
    arrays, meta = encoded_to_records(enc)
    back = records_to_encoded(arrays, meta)
    assert torch.equal(codec.decode(back), codec.decode(enc))
    # lowband.raw carries exactly the codec's bytes: no numpy header
    assert sum(len(a.data) for a in arrays.values()) == enc.nbytes


def test_raw_arrays_reject_malformed_payloads():
    a = raw_array(torch.arange(6, dtype=torch.int8).reshape(2, 3))
    assert torch.equal(raw_tensor(a), torch.arange(6, dtype=torch.int8).reshape(2, 3))
    short = type(a)(dtype="int8", shape=(2, 3), stype="lowband.raw", data=a.data[:-1])
    with pytest.raises(ProtocolError, match="needs 6 bytes"):
        raw_tensor(short)
    with pytest.raises(ProtocolError, match="unsupported wire dtype"):
        raw_tensor(type(a)(dtype="object", shape=(1,), stype="lowband.raw", data=b"x"))
    with pytest.raises(ProtocolError, match="stype"):
        raw_tensor(type(a)(torch.zeros(2).numpy()))
    with pytest.raises(ProtocolError, match="msgpack"):
        records_to_encoded(ArrayRecord({"0": a}), b"\xc1")
    with pytest.raises(ProtocolError, match="shape"):
        record_to_params(params_to_record([("w", torch.zeros(2, 2))]), {"w": torch.Size([4])})


# ---- configuration ---------------------------------------------------------------------------
def test_run_config_maps_onto_train_config():
    cfg = from_run_config(
        run_cfg(
            **{
                "inner-steps": 6,
                "fragments": 3,
                "num-server-rounds": 5,
                "alpha": 0.5,
                "codec": "nf4",
                "outer-lr": 0.5,
            }
        )
    )
    m = cfg.mode
    assert (m.inner_steps, m.n_fragments, m.tau, m.alpha, m.codec) == (6, 3, 0, 0.5, "nf4")
    assert m.outer.nesterov and m.outer.lr == 0.5 and m.outer.momentum == 0.9
    assert cfg.steps_per_round == 2 and cfg.train.steps == 10  # R·H/P
    assert from_run_config(APP_CONFIG_DEFAULTS).federation.rounds == 3
    with pytest.raises(ConfigError, match="unknown keys"):
        from_run_config({"num-rounds": 3})
    with pytest.raises(ConfigError, match="inner-steps"):
        from_run_config({"inner-steps": 2.5})
    with pytest.raises(ConfigError, match="must divide"):
        from_run_config({"inner-steps": 5, "fragments": 2})
    with pytest.raises(ConfigError, match="steps"):
        FlowerConfig(train=cfg.train, federation=from_run_config(run_cfg()).federation)
    assert [sync_fragment(r, 3) for r in range(1, 8)] == [0, 1, 2, 0, 1, 2, 0]
    assert node_config({"partition-id": 3}, 99).slot == 3
    assert node_config({}, 99).slot == 99
    with pytest.raises(ConfigError, match="data-kind"):
        node_config({"data-path": "/x"}, 1)


# ---- the strategy on constructed replies ----------------------------------------------------
class Toy(nn.Module):
    """Two numbered blocks and a head: P = 2 puts block 0 and block 1 in different fragments."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList([nn.Linear(3, 2), nn.Linear(3, 2)])
        self.head = nn.Linear(2, 1)


class FakeGrid:
    def __init__(self, nodes):
        self.nodes = list(nodes)

    def get_node_ids(self):
        return self.nodes


def toy_strategy(*, fragments=1, codec="fp32", **fed) -> DiLoCoStrategy:
    rc = run_cfg(
        **{
            "fragments": fragments,
            "inner-steps": 2 * fragments,
            "codec": codec,
            "num-server-rounds": 4,
        },
        **fed,
    )
    return DiLoCoStrategy(Toy(), from_run_config(rc))


def reply(
    instr: Message,
    delta: torch.Tensor,
    n: int,
    *,
    codec="fp32",
    status="ok",
    fragment=None,
    base=None,
    versions=None,
) -> Message:
    """The reply a ClientApp would send for ``instr`` with pseudo-gradient ``delta``."""
    cfg = instr.content.config_records[CONFIG]
    p = int(cfg["fragment"]) if fragment is None else fragment
    held = list(cfg["versions"]) if versions is None else versions
    arrays, meta = encoded_to_records(get_codec(codec).encode(delta))
    rec = ConfigRecord(
        {
            "status": status,
            "versions": held,
            "fragment": p,
            "base-version": held[p] if base is None else base,
            "codec": codec,
            "codec-meta": meta,
            "valid": True,
        }
    )
    metrics = MetricRecord(
        {
            "num-examples": n,
            "train-loss": 1.0,
            "bytes-up": len(meta),
            "bytes-up-fp32": 4 * delta.numel(),
        }
    )
    return Message(RecordDict({REPLY: rec, METRICS: metrics, DELTA: arrays}), reply_to=instr)


def flat(params) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in params])


def test_aggregate_is_nesterov_on_the_example_weighted_mean_and_keeps_momentum():
    s = toy_strategy()
    theta = flat(s.model.parameters()).clone()
    n = theta.numel()
    lr, mu = 0.7, 0.9
    buf = None
    torch.manual_seed(1)
    for r in (1, 2):  # two rounds: the momentum buffer must carry over
        msgs = list(s.configure_train(r, s.global_record(), ConfigRecord(), FakeGrid([5, 6, 7])))
        deltas = [torch.randn(n) for _ in msgs]
        weights = [10, 30, 60]
        arrays, metrics = s.aggregate_train(
            r, [reply(m, d, w) for m, d, w in zip(msgs, deltas, weights)]
        )
        g = sum(w * d for w, d in zip(weights, deltas)) / sum(weights)
        buf = g.clone() if buf is None else mu * buf + g  # torch SGD, dampening 0
        theta = theta - lr * (g + mu * buf)  # Nesterov
        assert torch.allclose(flat(s.model.parameters()), theta, atol=1e-5)
        assert torch.allclose(flat(record_to_params(arrays).values()), theta, atol=1e-5)
        assert metrics["replies"] == 3 and metrics["applied"] == 1 and s.versions == [r]


def test_failed_stale_and_malformed_replies_are_left_out():
    s = toy_strategy(**{"min-train-replies": 2})
    n = sum(p.numel() for p in s.model.parameters())
    msgs = list(s.configure_train(1, s.global_record(), ConfigRecord(), FakeGrid([1, 2, 3, 4, 5])))
    d = torch.randn(n)
    replies = [
        reply(msgs[0], d, 10),
        reply(msgs[1], d, 10),
        Message(Error(code=2, reason="ClientApp raised"), reply_to=msgs[2]),
        reply(msgs[3], d, 10, status="stale", versions=[-1]),
        reply(msgs[4], torch.randn(n + 1), 10),  # wrong size: ProtocolError, not a crash
    ]
    ref = toy_strategy()  # the same round with only the two good replies
    good = list(ref.configure_train(1, ref.global_record(), ConfigRecord(), FakeGrid([1, 2])))
    ref.aggregate_train(1, [reply(m, d, 10) for m in good])
    arrays, metrics = s.aggregate_train(1, replies)
    assert arrays is not None and metrics["replies"] == 2 and metrics["failures"] == 3
    assert metrics["stale"] == 1 and s.known[4] == [-1]  # the stale node gets everything next
    assert torch.equal(flat(s.model.parameters()), flat(ref.model.parameters()))


@pytest.mark.parametrize("accept_failures", [True, False])
def test_a_skipped_round_leaves_the_state_untouched(accept_failures):
    s = toy_strategy(
        **{"min-train-replies": 2 if accept_failures else 1, "accept-failures": accept_failures}
    )
    n = sum(p.numel() for p in s.model.parameters())
    grid = FakeGrid([1, 2])
    msgs = list(s.configure_train(1, s.global_record(), ConfigRecord(), grid))
    s.aggregate_train(1, [reply(m, torch.randn(n), 5) for m in msgs])  # builds momentum
    before = (
        flat(s.model.parameters()).clone(),
        copy.deepcopy(s.fragments[0].outer_opt.state_dict()),
        list(s.versions),
    )
    msgs = list(s.configure_train(2, s.global_record(), ConfigRecord(), grid))
    arrays, metrics = s.aggregate_train(
        2, [reply(msgs[0], torch.randn(n), 5), Message(Error(code=2, reason="x"), reply_to=msgs[1])]
    )
    assert arrays is None and metrics["applied"] == 0 and metrics["replies"] == 1
    assert torch.equal(flat(s.model.parameters()), before[0])
    buf = s.fragments[0].outer_opt.state_dict()["state"][0]["momentum_buffer"]
    assert torch.equal(buf, before[1]["state"][0]["momentum_buffer"])
    assert s.versions == before[2]


def test_fragments_rotate_and_only_changed_fragments_go_down():
    s = toy_strategy(fragments=2)
    names = [list(f.names) for f in s.fragments]
    assert names[0][0].startswith("layers.0") and names[1][0].startswith("layers.1")
    grid = FakeGrid([1, 2])
    msgs = list(s.configure_train(1, s.global_record(), ConfigRecord(), grid))
    assert sorted(msgs[0].content.array_records[GLOBAL]) == sorted(dict(s.model.named_parameters()))
    frag1 = flat(s.fragments[1].global_).clone()
    s.aggregate_train(1, [reply(m, torch.ones(s.fragments[0].numel), 1) for m in msgs])
    assert torch.equal(flat(s.fragments[1].global_), frag1)  # round 1 touched fragment 0 only
    assert s.versions == [1, 0]
    msgs = list(s.configure_train(2, s.global_record(), ConfigRecord(), grid))
    cfg = msgs[0].content.config_records[CONFIG]
    assert cfg["fragment"] == 1 and list(cfg["sent-fragments"]) == [0]
    assert sorted(msgs[0].content.array_records[GLOBAL]) == sorted(names[0])
    frag0 = flat(s.fragments[0].global_).clone()
    s.aggregate_train(2, [reply(m, torch.ones(s.fragments[1].numel), 1) for m in msgs])
    assert torch.equal(flat(s.fragments[0].global_), frag0) and s.versions == [1, 2]
    # a reply computed against an old version of the fragment is refused
    msgs = list(s.configure_train(3, s.global_record(), ConfigRecord(), grid))
    _, metrics = s.aggregate_train(3, [reply(msgs[0], torch.ones(s.fragments[0].numel), 1, base=0)])
    assert metrics["applied"] == 0 and metrics["failures"] == 2  # refused + node 2 silent


def test_checkpoint_is_hf_format_plus_outer_state(tmp_path):
    from diloco.checkpoint import load_state
    from lowband.models.weights import load_pretrained

    grid = InProcessGrid(handle, run_cfg(), {1: {"partition-id": 0}})
    cfg = from_run_config(run_cfg(**{"out-dir": str(tmp_path)}))
    summary = run_server(grid, cfg)
    model = load_pretrained(tmp_path / "checkpoint")
    assert math.isclose(lm_task(cfg.train).evaluate(model), summary["final_eval"], rel_tol=1e-6)
    tensors, meta = load_state(tmp_path / "checkpoint" / "outer")
    assert meta["round"] == 2 and meta["versions"] == [2]
    assert any(k.endswith("momentum_buffer") for k in tensors)
    # RunSummary: the one final state of a Flower run is the server's
    assert summary["consistent"] is True and summary["missing"] == {} and summary["differ"] == []
    assert isinstance(summary["state_hash"], int)
    assert (
        json.loads((tmp_path / "summary.json").read_text())["state_hash"] == summary["state_hash"]
    )


# ---- whole federations in this process -------------------------------------------------------
def federation(rc: dict, nodes: int = 2) -> tuple[InProcessGrid, FlowerConfig]:
    grid = InProcessGrid(handle, rc, {10 + i: {"partition-id": i} for i in range(nodes)})
    return grid, from_run_config(rc)


def test_streaming_fragments_with_int8_reduce_both_directions():
    rc = run_cfg(
        **{
            "fragments": 2,
            "inner-steps": 8,
            "codec": "int8",
            "num-server-rounds": 4,
            "evaluate-every": 2,
        }
    )
    grid, cfg = federation(rc)
    s = run_server(grid, cfg)
    assert s["rounds_applied"] == 4 and s["failures"] == 0
    assert s["final_eval"] < s["initial_eval"] - 0.5
    # int8 with one fp32 scale per 256 values: 8.125 bits instead of 32
    assert s["uplink_reduction"] == pytest.approx(32 / 8.125, rel=0.02)
    # round 1 sends the whole model; later rounds one fragment (the evaluate rounds deliver
    # it early, and the next train message then carries nothing)
    train_down = [
        len(m.content.array_records[GLOBAL])
        for m in grid.sent
        if m.metadata.message_type == "train"
    ]
    n_params = len(list(lm_task(cfg.train).build_model().parameters()))
    assert train_down[:2] == [n_params, n_params]
    assert 0 < max(train_down[2:]) < n_params


def test_a_node_that_loses_its_state_rejoins_and_one_that_crashes_is_tolerated(tmp_path):
    rc = run_cfg(
        **{
            "num-server-rounds": 3,
            "codec": "nf4",
            "inner-steps": 4,
            "fragments": 2,
            "out-dir": str(tmp_path),
        }
    )
    grid, cfg = federation(rc, nodes=3)
    inner = grid.handler

    def flaky(msg, ctx):
        if ctx.node_id == 12:  # a misconfigured site: its ClientApp raises every round
            raise RuntimeError("disk full")
        if ctx.node_id == 11 and msg.content.config_records[CONFIG]["server-round"] == 2:
            ctx.state = RecordDict()  # its SuperNode restarted: Context.state is gone
        return inner(msg, ctx)

    grid.handler = flaky
    s = run_server(grid, cfg)
    rounds = [r for r in read_jsonl(tmp_path / "metrics.jsonl") if r["event"] == "round"]
    assert [(r["replies"], r["failures"], r["stale"]) for r in rounds] == [
        (2, 1, 0),
        (1, 2, 1),
        (2, 1, 0),
    ]  # node 12 always fails; node 11 is stale once, then back
    assert s["rounds_applied"] == 3 and s["final_eval"] < s["initial_eval"]
    # the rejoining node got the fragment it lacked, not the whole model
    to_11 = [m for m in grid.sent if m.metadata.dst_node_id == 11]
    assert list(to_11[2].content.config_records[CONFIG]["sent-fragments"]) == [1]


def test_flower_rounds_equal_the_lowband_trainer(tmp_path):
    """fp32 wire, P = 2, α = 0.5: R Flower rounds == the loopback trainer's T = R·H/P steps."""
    from diloco.launch import make_worker
    from lowband.models.weights import load_pretrained
    from tests.conftest import run_ranks
    from transport.loopback import LoopbackGroup

    rc = run_cfg(
        **{
            "fragments": 2,
            "inner-steps": 4,
            "alpha": 0.5,
            "num-server-rounds": 4,
            "evaluate-every": 1,
            "out-dir": str(tmp_path),
        }
    )
    grid, cfg = federation(rc)
    s = run_server(grid, cfg)
    flower_theta = flat(
        p for _, p in sorted(load_pretrained(tmp_path / "checkpoint").named_parameters())
    )

    train = dataclasses.replace(cfg.train, workers=2)
    task = lm_task(train)
    group = LoopbackGroup(2, timeout=60.0)
    workers = [make_worker(train, c, task, worker_id=str(r)) for r, c in enumerate(group.comms())]
    run_ranks([w.run for w in workers], timeout=120)
    trainer_theta = flat(p for _, p in sorted(workers[0].global_model.named_parameters()))
    assert s["rounds_applied"] == 4
    assert torch.allclose(flower_theta, trainer_theta, atol=1e-6), (
        (flower_theta - trainer_theta).abs().max()
    )


# ---- app directory and the `lowband flower` command line ------------------------------------
def test_example_app_is_the_generated_app_and_flower_accepts_it(tmp_path):
    from pathlib import Path

    from flwr.common.config import validate_config

    tomllib = __import__("tomllib" if sys.version_info >= (3, 11) else "tomli")

    from cli import main
    from diloco.flower.app import write_app

    example = Path(__file__).resolve().parents[2] / "examples" / "flower_diloco"
    gen = write_app(tmp_path / "app")
    files = sorted(p.relative_to(gen) for p in gen.rglob("*") if p.is_file())
    assert files == sorted(
        p.relative_to(example)
        for p in example.rglob("*")
        if p.is_file() and p.suffix in (".py", ".toml")
    )
    for f in files:  # the example must be regenerated when the defaults change
        assert (example / f).read_text() == (gen / f).read_text(), f
    config = tomllib.loads((gen / "pyproject.toml").read_text())
    ok, errors, _ = validate_config(config, check_module=False)
    assert ok, errors
    assert config["tool"]["flwr"]["app"]["config"] == APP_CONFIG_DEFAULTS

    assert (
        main(["flower", "new", str(tmp_path / "nf4"), "--set", "codec=nf4", "--set", "alpha=0.5"])
        == 0
    )
    cfg = tomllib.loads((tmp_path / "nf4" / "pyproject.toml").read_text())["tool"]["flwr"]
    assert cfg["app"]["config"]["codec"] == "nf4" and cfg["app"]["config"]["alpha"] == 0.5
    assert main(["flower", "new", str(tmp_path / "bad"), "--set", "codec=int3"]) == 2


def test_flower_cli_parses_into_validated_configs(capsys):
    from cli import build_parser, main
    from cli.flower import local_config, submit_config

    args = build_parser().parse_args(
        [
            "flower",
            "local",
            "--supernodes",
            "3",
            "--rounds",
            "2",
            "-P",
            "2",
            "-H",
            "8",
            "--codec",
            "fp4",
            "--set",
            "alpha=0.25",
            "--set",
            "error-feedback=true",
        ]
    )
    cfg = local_config(args)
    rc = cfg.effective_run_config()
    assert cfg.supernodes == 3 and rc["min-available-nodes"] == 3
    assert (rc["num-server-rounds"], rc["fragments"], rc["inner-steps"], rc["codec"]) == (
        2,
        2,
        8,
        "fp4",
    )
    assert rc["alpha"] == 0.25 and rc["error-feedback"] is True
    assert from_run_config(rc).mode.error_feedback
    sub = submit_config(
        build_parser().parse_args(
            [
                "flower",
                "run",
                "--superlink",
                "superlink:9093",
                "--out",
                "/runs/flower",
                "--insecure",
            ]
        )
    )
    assert sub.superlink == "superlink:9093" and sub.run_config["out-dir"] == "/runs/flower"
    assert main(["flower", "local", "--rounds", "0"]) == 2
    assert "num-server-rounds" in capsys.readouterr().err
    assert main(["flower", "run", "--superlink", "no-port"]) == 2
    assert main(["flower", "keys"]) == 0
    out = capsys.readouterr().out
    assert all(k in out for k in APP_CONFIG_DEFAULTS)


def test_bench_smoke(capsys):
    import benchmarks.flower as bench

    assert (
        bench.main(
            [
                "--rounds",
                "1",
                "--inner-steps",
                "2",
                "--warmup",
                "0",
                "--variants",
                "diloco-fp32,diloco-int8,streaming-p2-int8",
            ]
        )
        == 0
    )
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    r = {x["variant"]: x for x in out["results"]}
    assert r["diloco-int8"]["bytes_up"] * 3.9 < r["diloco-fp32"]["bytes_up"]
    assert r["diloco-int8"]["uplink_reduction_measured"] == pytest.approx(
        r["diloco-fp32"]["bytes_up"] / r["diloco-int8"]["bytes_up"], rel=1e-3
    )
    # streaming: the same steps and about the same bytes, half of them per round
    assert r["streaming-p2-int8"]["steps"] == r["diloco-int8"]["steps"] == 2
    assert r["streaming-p2-int8"]["peak_round_up"] < 0.6 * r["diloco-int8"]["peak_round_up"]


def test_a_lost_reply_is_a_timeout_and_the_node_catches_up(tmp_path):
    """Node 11 trains in round 1 but its reply never arrives (a round timeout): the round
    aggregates node 10 alone, and round 2 re-sends node 11 everything it may lack."""
    rc = run_cfg(
        **{"fragments": 2, "inner-steps": 4, "num-server-rounds": 3, "out-dir": str(tmp_path)}
    )
    grid, cfg = federation(rc)
    inner = grid.handler

    def lossy(msg, ctx):
        grid.silent = {11} if msg.content.config_records[CONFIG]["server-round"] == 1 else set()
        return inner(msg, ctx)

    grid.handler = lossy
    s = run_server(grid, cfg)
    rounds = [r for r in read_jsonl(tmp_path / "metrics.jsonl") if r["event"] == "round"]
    assert [(r["replies"], r["failures"]) for r in rounds] == [(1, 1), (2, 0), (2, 0)]
    to_11 = [m.content.config_records[CONFIG] for m in grid.sent if m.metadata.dst_node_id == 11]
    assert [list(c["sent-fragments"]) for c in to_11] == [[0, 1], [0, 1], [1]]
    assert s["rounds_applied"] == 3
