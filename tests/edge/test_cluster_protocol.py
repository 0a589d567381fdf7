"""The cluster's control protocol: every message round-trips (as a dict and as msgpack bytes),
decoding refuses what is malformed with a ProtocolError, the ops the master sends are exactly
the ops the worker's dispatch table handles, and a worker survives malformed messages and a
checkpoint it cannot load."""

from __future__ import annotations

import ast
import dataclasses
import json
import textwrap
import threading
from pathlib import Path

import msgpack
import pytest

import edge.cluster.master
import edge.cluster.pipeline
import edge.profile
from edge.cluster import WorkerConfig, protocol, run_worker
from edge.cluster.protocol import (
    CTL,
    MESSAGES,
    READY,
    TO_MASTER,
    TO_WORKER,
    Assign,
    Bye,
    Forward,
    Msg,
    Ready,
    Report,
    Shutdown,
    Stats,
    decode,
    stats_tag,
)
from edge.cluster.worker import HANDLERS
from lowband.errors import ProtocolError
from lowband.models.llama import LlamaForCausalLM, init_weights
from lowband.models.weights import save_pretrained
from tests.conftest import tiny_llama
from transport.loopback import LoopbackGroup

pytestmark = pytest.mark.timeout(120)
LOAD_S = 480.0  # a worker's answer to assign, which loads a checkpoint


def _assign(**over) -> Assign:
    kw = dict(
        slot=1,
        world=2,
        weights=[1.0, 2.5],
        model_dir="/models/m",
        dtype="bfloat16",
        wire="int8",
        algorithm="star",
        op_timeout=5.0,
        window=2,
        memory_budget_mb=None,
        experts={"budget_mb": 64.0, "bits": [4, 8]},
        link_port=40123,
        link_spin_us=1000.0,
        link_secret="s3cret",
        silence_s=50.0,
    )
    return Assign(**{**kw, **over})


# One example (or more) of every message; a message added without an example fails below.
EXAMPLES: list[Msg] = [
    _assign(),
    _assign(window=None, memory_budget_mb=512.0),
    _assign(
        weights=None,
        dtype=None,
        window=None,
        memory_budget_mb=None,
        experts=None,
        link_port=None,
        link_secret=None,
    ),
    Forward(fid=7, start=12, epoch=3, top=8, link=True),
    Forward(fid=1, start=0, epoch=0),
    protocol.Batch(
        fid=8, epoch=3, caches=[0, 5], starts=[12, 0], lengths=[1, 7], rows=[0, 7], top=1, link=True
    ),
    protocol.Batch(fid=9, epoch=0, caches=[2], starts=[30], lengths=[4], rows=[]),
    protocol.Copy(epoch=3, src=5, dst=1, n=16),
    protocol.Drop(epoch=3, cache=5),
    protocol.Reset(sync=True),
    protocol.Reset(),
    protocol.Ping(n=4, epoch=2),
    Stats(n=9),
    protocol.Regroup(epoch=5),
    Shutdown(reason="left out by the planner: too slow"),
    Shutdown(),
    protocol.Echo(n=1001),
    protocol.Profile(n=1008, dtype=None, model_dir="/m", memory_mb=2048.0),
    protocol.Yield(),
    protocol.StageAssign(
        stage=1, lo=9, hi=18, layers=18, model_dir="/m", dtype=None, op_timeout=60.0, silence_s=50.0
    ),
    protocol.StageStep(fid=4, epoch=1, caches=[0, 3], starts=[0, 17], lengths=[5, 1]),
    protocol.Staged(fid=4),
    Ready(ok=True, slot=2),
    Ready(ok=False, error="bits must be one of (4, 8), got 3"),
    Bye(),
    Report(report={"hits": 3, "misses": 1}),
    Report(report=None),
    protocol.StageAssign(
        stage=1, lo=9, hi=18, layers=18, model_dir="/m", dtype=None, op_timeout=5.0, silence_s=40
    ),
    protocol.StageStep(fid=4, epoch=1, caches=[0, 3], starts=[7, 0], lengths=[1, 5]),
    protocol.Staged(fid=4),
]


def test_every_message_has_an_example() -> None:
    assert {m.OP for m in EXAMPLES} == set(MESSAGES)
    assert TO_WORKER | TO_MASTER == set(MESSAGES) and not TO_WORKER & TO_MASTER


@pytest.mark.parametrize("msg", EXAMPLES, ids=lambda m: m.OP)
def test_round_trip(msg: Msg) -> None:
    meta = msg.encode()
    assert meta["op"] == msg.OP
    assert decode(meta) == msg
    assert type(msg).decode(meta) == msg
    wire = msgpack.unpackb(msgpack.packb(meta), raw=False)
    assert decode(wire) == msg
    assert decode({**meta, "extra": [1, 2]}) == msg  # unknown keys are ignored


def test_docstring_is_the_dataclasses() -> None:
    table = textwrap.indent(protocol.describe(), "    ")
    assert table in protocol.__doc__
    for op in MESSAGES:
        assert f"\n    {op}" in f"\n{table}"


def _required(msg: Msg) -> list[str]:
    return [f.name for f in dataclasses.fields(msg) if f.default is dataclasses.MISSING]


@pytest.mark.parametrize("msg", [m for m in EXAMPLES if _required(m)], ids=lambda m: m.OP)
def test_decode_refuses_a_missing_field(msg: Msg) -> None:
    meta = msg.encode()
    for name in _required(msg):
        broken = {k: v for k, v in meta.items() if k != name}
        with pytest.raises(ProtocolError, match=f"without its field '{name}'"):
            decode(broken)


def test_defaults_fill_optional_fields() -> None:
    assert decode({"op": "reset"}) == protocol.Reset(sync=False)
    assert decode({"op": "shutdown"}) == Shutdown(reason=None)
    assert decode({"op": "forward", "fid": 1, "start": 0, "epoch": 0}).top == 0


@pytest.mark.parametrize(
    "meta,field",
    [
        ({**_assign().encode(), "slot": "1"}, "slot"),
        ({**_assign().encode(), "slot": True}, "slot"),  # a bool is not an int
        ({**_assign().encode(), "weights": [1.0, "x"]}, "weights"),
        ({**_assign().encode(), "weights": 2.0}, "weights"),
        ({**_assign().encode(), "model_dir": None}, "model_dir"),
        ({**_assign().encode(), "experts": [1]}, "experts"),
        ({**_assign().encode(), "op_timeout": "5"}, "op_timeout"),
        ({"op": "forward", "fid": 1.5, "start": 0, "epoch": 0}, "fid"),
        ({"op": "forward", "fid": 1, "start": 0, "epoch": 0, "link": 1}, "link"),
        ({"op": "ping", "n": "3", "epoch": 0}, "n"),
        ({"op": "ready", "ok": 1}, "ok"),
        ({"op": "report", "report": "none"}, "report"),
    ],
)
def test_decode_refuses_a_wrong_type(meta: dict, field: str) -> None:
    with pytest.raises(ProtocolError, match=f"'{field}"):
        decode(meta)


def test_decode_converts_an_int_to_float() -> None:
    msg = decode({**_assign().encode(), "op_timeout": 5, "weights": [1, 2]})
    assert isinstance(msg, Assign)
    assert msg.op_timeout == 5.0 and type(msg.op_timeout) is float
    assert msg.weights == [1.0, 2.0] and all(type(w) is float for w in msg.weights)


_BATCH = protocol.Batch(fid=1, epoch=0, caches=[0, 1], starts=[3, 0], lengths=[1, 2], rows=[0])


@pytest.mark.parametrize(
    "meta,field",
    [
        ({**_BATCH.encode(), "caches": []}, "caches"),
        ({**_BATCH.encode(), "caches": [1, 1]}, "caches"),  # one cache appended to twice
        ({**_BATCH.encode(), "caches": [0, protocol.MAX_SEQS]}, "caches"),
        ({**_BATCH.encode(), "starts": [3]}, "starts"),
        ({**_BATCH.encode(), "starts": [3, -1]}, "starts"),
        ({**_BATCH.encode(), "lengths": [1, 0]}, "lengths"),
        ({**_BATCH.encode(), "rows": [3]}, "rows"),  # past the 3 tokens
        ({**_BATCH.encode(), "rows": [1, 0]}, "rows"),
        ({**_BATCH.encode(), "top": -1}, "top"),
        ({"op": "copy", "epoch": 0, "src": 1, "dst": 1, "n": 4}, "copy"),
        ({"op": "copy", "epoch": 0, "src": -1, "dst": 1, "n": 4}, "src"),
        ({"op": "drop", "epoch": 0, "cache": protocol.MAX_SEQS}, "cache"),
    ],
)
def test_decode_refuses_impossible_batch_numbers(meta: dict, field: str) -> None:
    """A worker allocates caches for these ids and positions: refused before it does."""
    with pytest.raises(ProtocolError, match=field):
        decode(meta)


@pytest.mark.parametrize("meta", [{"op": "launch"}, {"op": 3}, {"slot": 1}, [1, 2], None])
def test_decode_refuses_an_unknown_op(meta) -> None:
    with pytest.raises(ProtocolError):
        decode(meta)


def test_decode_as_a_given_type() -> None:
    with pytest.raises(ProtocolError, match="expected a 'ready' message, got 'bye'"):
        Ready.decode(Bye().encode())


def _ops_sent(path: str) -> set[str]:
    """Ops a module sends: message classes it constructs and ``{"op": ...}`` dicts it writes."""
    tree = ast.parse(Path(path).read_text())
    names = {cls.__name__: op for op, cls in MESSAGES.items()}
    ops = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            fn = node.func
            name = fn.id if isinstance(fn, ast.Name) else getattr(fn, "attr", None)
            if name in names and names[name] in TO_WORKER:
                ops.add(names[name])
        elif isinstance(node, ast.Dict):
            for k, v in zip(node.keys, node.values):
                if isinstance(k, ast.Constant) and k.value == "op":
                    assert isinstance(v, ast.Constant), ast.unparse(node)
                    ops.add(v.value)
    return ops


def test_the_master_sends_what_the_worker_handles() -> None:
    master = _ops_sent(edge.cluster.master.__file__) | _ops_sent(edge.cluster.pipeline.__file__)
    profile = _ops_sent(edge.profile.__file__)  # the automatic split's echo and profile
    pipeline = _ops_sent(edge.cluster.pipeline.__file__)  # the pipeline layout's stages
    assert profile == {"echo", "profile"}
    assert pipeline >= {"stage_assign", "stage"}
    assert master | profile | pipeline == set(HANDLERS) == TO_WORKER


# ---- a worker driven by a hand-written master ----
CFG = tiny_llama(hidden_size=64, intermediate_size=128)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("ck")
    m = LlamaForCausalLM(CFG).eval()
    init_weights(m, std=0.2, seed=5)
    save_pretrained(m, d)
    return d


@pytest.fixture
def bad_bits(ckpt, tmp_path) -> Path:
    """A lowband-quantized checkpoint whose config says 3 bits (only 4 and 8 exist)."""
    d = tmp_path / "q3"
    d.mkdir()
    for f in ckpt.iterdir():
        (d / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((d / "config.json").read_text())
    cfg["quantization_config"] = {
        "quant_method": "lowband",
        "bits": 3,
        "group": 32,
        "modules": ["model.layers.0.self_attn.q_proj", "model.layers.1.mlp.up_proj"],
    }
    (d / "config.json").write_text(json.dumps(cfg))
    return d


def _loadable(model_dir: Path) -> dict:
    """An assign of slot 1 of 2 of ``model_dir`` a worker can carry out on its own."""
    return _assign(
        model_dir=str(model_dir),
        dtype=None,
        wire="fp32",
        window=None,
        link_port=None,
        link_secret=None,
        experts=None,
    ).encode()


class _Worker:
    """``run_worker`` on rank 1 of a loopback pair; the test plays the master on rank 0."""

    def __init__(self) -> None:
        self.group = LoopbackGroup(2, timeout=60)
        self.master, comm = self.group.comms()
        self.result: object = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, args=(comm,), daemon=True)
        self.thread.start()
        self.master.quorum(min_world=2, timeout=60)

    def _run(self, comm) -> None:
        try:
            self.result = run_worker(comm, WorkerConfig(join_timeout=60))
        except BaseException as e:  # noqa: BLE001 - inspected by the test
            self.error = e

    def send(self, meta: dict) -> None:
        self.master.send(1, [], meta, tag=CTL)

    def ready(self) -> Ready:
        # generous: the first load on a fresh machine compiles the C++ kernels (minutes)
        return Ready.decode(self.master.recv(1, tag=READY, timeout=LOAD_S)[1])

    def alive(self, n: int) -> None:
        """The worker still answers, in order: a ``stats`` request gets its report."""
        self.send(Stats(n=n).encode())
        assert Report.decode(self.master.recv(1, tag=stats_tag(n), timeout=60)[1]).report is None

    def shutdown(self) -> None:
        self.send(Shutdown().encode())
        Bye.decode(self.master.recv(1, tag=READY, timeout=60)[1])
        self.thread.join(60)
        assert not self.thread.is_alive() and self.error is None and self.result == 0


@pytest.mark.timeout(2 * LOAD_S)
def test_malformed_messages_do_not_kill_the_worker(ckpt) -> None:
    w = _Worker()
    # a broken assign is answered (the master waits for it), naming the field
    w.send({"op": "assign", "slot": 1})
    ready = w.ready()
    assert not ready.ok and "malformed" in ready.error and "'world'" in ready.error
    w.send({**_assign().encode(), "slot": "one"})
    ready = w.ready()
    assert not ready.ok and "'slot'" in ready.error
    # anything else malformed is dropped
    w.send({"op": "ping", "n": "x", "epoch": 0})
    w.send({"op": "forward"})
    w.send({"op": "launch-missiles"})
    w.send({"no": "op"})
    w.alive(1)
    # and a good assign after all that still loads
    w.send(_loadable(ckpt))
    assert w.ready() == Ready(ok=True, slot=1)
    w.alive(2)
    w.shutdown()


@pytest.mark.timeout(2 * LOAD_S)
def test_an_unloadable_checkpoint_is_answered_not_fatal(ckpt, bad_bits, tmp_path) -> None:
    w = _Worker()
    w.send(_loadable(bad_bits))
    ready = w.ready()
    assert not ready.ok and ready.slot is None and "bits" in ready.error and "3" in ready.error
    w.send(_loadable(tmp_path / "missing"))
    ready = w.ready()
    assert not ready.ok and ready.error
    w.alive(1)
    w.send(_loadable(ckpt))
    assert w.ready() == Ready(ok=True, slot=1)
    w.shutdown()
