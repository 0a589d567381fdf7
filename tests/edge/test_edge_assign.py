"""Issue 25: an edge worker serves only its own model, and an ``assign`` is checked before use.

A worker took any peer whose id starts with ``edge-master`` for the master and loaded whatever
``model_dir`` its ``assign`` named (``/etc``, ``../other-model``), with any slot, world or
weights. Now it serves only ``WorkerConfig.model_dir`` (``--model-dir``; required on the
network): an assign naming a path outside it, after ``..`` and links are resolved, is answered
``ok: False``, and an assign with a weight that is not finite and positive, a slot outside the
world or a nonsense timeout or port does not decode.
"""

from __future__ import annotations

import math
import shutil
import threading
from pathlib import Path

import pytest

from edge.cluster import ClusterConfig, WorkerConfig, run_worker
from edge.cluster.protocol import CTL, READY, Assign, Bye, Ready, Shutdown, decode
from edge.cluster.worker import served_path
from edge.launch import ServeWorkerConfig
from lowband.errors import ConfigError, ProtocolError
from lowband.models.llama import LlamaForCausalLM, init_weights
from lowband.models.weights import save_pretrained
from tests.conftest import tiny_llama
from transport.loopback import LoopbackGroup

pytestmark = [pytest.mark.security, pytest.mark.timeout(120)]
LOAD_S = 480.0  # the one real load may compile the C++ kernels on a fresh machine

CFG = tiny_llama(hidden_size=64, intermediate_size=128)


def _assign(model_dir: str, **over) -> dict:
    kw = dict(
        slot=1,
        world=2,
        weights=None,
        model_dir=model_dir,
        dtype=None,
        wire="fp32",
        algorithm="star",
        op_timeout=5.0,
        window=None,
        memory_budget_mb=None,
        experts=None,
        link_port=None,
        link_spin_us=0.0,
        link_secret=None,
        silence_s=50.0,
    )
    return {"op": "assign", **kw, **over}


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> tuple[Path, Path]:
    """(the worker's own model, another loadable model next to it)."""
    root = tmp_path_factory.mktemp("models")
    own, other = root / "own", root / "other"
    m = LlamaForCausalLM(CFG).eval()
    init_weights(m, std=0.2, seed=5)
    save_pretrained(m, own)
    shutil.copytree(own, other)
    return own, other


# ---- the path rule (pure) -----------------------------------------------------------------
def test_served_path_stays_inside_the_workers_model(models, tmp_path) -> None:
    own, other = models
    assert served_path(str(own), str(own)) == str(own.resolve())
    assert served_path(str(own / "."), str(own)) == str(own.resolve())
    assert served_path(str(own / "sub"), str(own)) == str((own / "sub").resolve())
    link = tmp_path / "link"
    link.symlink_to(own)
    assert served_path(str(link), str(own)) == str(own.resolve())  # the same model
    escape = own / "escape"
    escape.symlink_to(other)
    try:
        for bad in (other, own / ".." / "other", own.parent, Path("/etc"), escape, "relative"):
            with pytest.raises(ConfigError, match="serves only"):
                served_path(str(bad), str(own))
    finally:
        escape.unlink()
    assert served_path("/anything", None) == "/anything"  # a thread of the master's process


def test_a_networked_worker_needs_its_model_dir(models) -> None:
    with pytest.raises(ConfigError, match="model_dir"):
        ServeWorkerConfig(master="tcp://127.0.0.1:1")
    cfg = ServeWorkerConfig(master="tcp://127.0.0.1:1", worker=WorkerConfig(model_dir="m"))
    assert cfg.worker.model_dir == "m"


# ---- assign fields (decode) ------------------------------------------------------------------
@pytest.mark.parametrize(
    "over",
    [
        {"weights": [math.inf, 1.0]},
        {"weights": [math.nan, 1.0]},
        {"weights": [-1.0, 1.0]},
        {"weights": [0.0, 1.0]},
        {"weights": [1.0]},  # not one per device
        {"slot": -1},
        {"slot": 2},  # == world
        {"world": 0, "slot": 0},
        {"world": 10**9},
        {"op_timeout": math.inf},
        {"op_timeout": 0},
        {"silence_s": math.nan},
        {"silence_s": -1.0},
        {"link_spin_us": -5.0},
        {"link_port": 0},
        {"link_port": 70000},
        {"window": 0},
        {"memory_budget_mb": math.nan},
        {"model_dir": ""},
        {"model_dir": "/m\0/etc/passwd"},
        {"repack": "all"},
    ],
    ids=repr,
)
def test_an_assign_out_of_range_does_not_decode(over) -> None:
    with pytest.raises(ProtocolError, match="assign"):
        decode({**_assign("/m"), **over})


@pytest.mark.parametrize("bad", [math.inf, math.nan, 0.0, -1.0])
def test_the_master_refuses_weights_its_workers_would(bad) -> None:
    with pytest.raises(ConfigError, match="weights"):
        ClusterConfig(devices=2, weights=(1.0, bad))


def test_a_sane_assign_decodes() -> None:
    msg = decode(_assign("/m", weights=[1.0, 2.5], link_port=40123, window=2))
    assert isinstance(msg, Assign) and msg.weights == [1.0, 2.5] and msg.slot == 1
    assert msg.repack == "off"  # a master that predates the field sends none
    assert decode(_assign("/m", repack="auto")).repack == "auto"


# ---- a worker on the loopback group ------------------------------------------------------------
class _Worker:
    """``run_worker`` serving ``model_dir`` on rank 1 of a loopback pair; the test is rank 0."""

    def __init__(self, model_dir: Path) -> None:
        self.group = LoopbackGroup(2, timeout=60)
        self.master, comm = self.group.comms()
        self.error: BaseException | None = None
        self.result: object = None
        cfg = WorkerConfig(model_dir=str(model_dir), join_timeout=60)
        self.thread = threading.Thread(target=self._run, args=(comm, cfg), daemon=True)
        self.thread.start()
        self.master.quorum(min_world=2, timeout=60)

    def _run(self, comm, cfg) -> None:
        try:
            self.result = run_worker(comm, cfg)
        except BaseException as e:  # noqa: BLE001 - inspected by the test
            self.error = e

    def ask(self, meta: dict, timeout: float = 60) -> Ready:
        self.master.send(1, [], meta, tag=CTL)
        return Ready.decode(self.master.recv(1, tag=READY, timeout=timeout)[1])

    def shutdown(self) -> None:
        self.master.send(1, [], Shutdown().encode(), tag=CTL)
        Bye.decode(self.master.recv(1, tag=READY, timeout=60)[1])
        self.thread.join(60)
        assert not self.thread.is_alive() and self.error is None and self.result == 0


@pytest.mark.timeout(2 * LOAD_S)
def test_a_worker_loads_only_its_own_model(models) -> None:
    own, other = models
    w = _Worker(own)
    for path in (other, own / ".." / "other", own.parent, Path("/etc")):
        ready = w.ask(_assign(str(path)))
        assert not ready.ok and ready.slot is None and "serves only" in (ready.error or "")
    ready = w.ask(_assign(str(own), weights=[math.inf, 1.0]))
    assert not ready.ok and "weights" in (ready.error or "")
    assert w.ask(_assign(str(own)), timeout=LOAD_S) == Ready(ok=True, slot=1)
    w.shutdown()
