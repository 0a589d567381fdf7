"""Liveness flags (--heartbeat, --dead-after, --unresponsive-after, --register-timeout) are
parsed into the config dataclasses the launchers use; bad combinations fail naming the field."""

from __future__ import annotations

import pytest

from cli import build_parser, main
from cli.edge import _serve_config
from cli.liveness import liveness
from lowband.errors import ConfigError
from transport.coordinator import CoordinatorConfig, Liveness

pytestmark = pytest.mark.timeout(60)

FLAGS = ["--heartbeat", "5", "--dead-after", "20", "--unresponsive-after", "120"]


def test_liveness_builds_the_coordinator_config():
    live = Liveness(heartbeat_interval=5, dead_after=20, unresponsive_after=120)
    cc = live.coordinator(bind="tcp://127.0.0.1:0", token="s")
    assert isinstance(cc, CoordinatorConfig)
    assert (cc.heartbeat_interval, cc.silence_limit, cc.unresponsive_after) == (5, 20, 120)
    assert cc.token == "s" and cc.bind == "tcp://127.0.0.1:0"
    assert Liveness(heartbeat_interval=3).coordinator().silence_limit == 6


@pytest.mark.parametrize(
    "kw, field",
    [
        (dict(heartbeat_interval=0), "heartbeat_interval"),
        (dict(heartbeat_interval=3, dead_after=0.5), "dead_after"),
        (dict(heartbeat_interval=10, unresponsive_after=15), "unresponsive_after"),
    ],
)
def test_liveness_refuses_deadlines_that_do_not_fit(kw, field):
    with pytest.raises(ConfigError) as e:
        Liveness(**kw)
    assert field in str(e.value)


@pytest.mark.parametrize(
    "argv, default",
    [
        (["coordinator", *FLAGS], 1.0),
        (["train", *FLAGS], 2.0),
        (["edge", "serve", "m", *FLAGS], 1.0),
        (["edge", "run", "m", *FLAGS], 1.0),
    ],
)
def test_every_launcher_parses_the_flags(argv, default):
    args = build_parser().parse_args(argv)
    assert liveness(args, default) == Liveness(
        heartbeat_interval=5, dead_after=20, unresponsive_after=120
    )
    plain = build_parser().parse_args([a for a in argv if a not in FLAGS])
    assert liveness(plain, default) == Liveness(heartbeat_interval=default)


def test_edge_serve_config_carries_the_deadlines(tmp_path):
    args = build_parser().parse_args(
        # --insecure: the default bind (every interface) without keys is refused since issue 25
        [
            "edge",
            "serve",
            str(tmp_path),
            "--workers",
            "1",
            "--heartbeat",
            "4",
            "--dead-after",
            "30",
            "--insecure",
            "--pooling",
            "last",
        ]
    )
    cfg = _serve_config(args, 2)
    assert cfg.liveness == Liveness(heartbeat_interval=4, dead_after=30)
    assert cfg.server.embeddings.pooling == "last"
    from edge.launch import _coordinator_config

    cc = _coordinator_config(cfg)
    assert (cc.heartbeat_interval, cc.silence_limit) == (4, 30)


@pytest.mark.parametrize(
    "argv",
    [
        ["worker", "--coordinator", "tcp://127.0.0.1:1"],
        ["edge", "worker", "--master", "tcp://127.0.0.1:1"],
    ],
)
def test_workers_take_a_register_timeout(argv):
    assert build_parser().parse_args(argv).register_timeout == 30.0
    assert build_parser().parse_args([*argv, "--register-timeout", "90"]).register_timeout == 90


def test_worker_register_timeout_reaches_its_config():
    from diloco.config import preset
    from diloco.launch import WorkerLaunch
    from edge.launch import ServeWorkerConfig, edge_transport
    from transport.config import ZmqConfig

    launch = WorkerLaunch(
        train=preset("tiny"), coordinator="tcp://h:1", transport=ZmqConfig(register_timeout=90)
    )
    assert launch.transport.register_timeout == 90
    for make in (
        lambda: WorkerLaunch(
            train=preset("tiny"),
            coordinator="tcp://h:1",
            transport=ZmqConfig(register_timeout=0),
        ),
        lambda: ServeWorkerConfig(
            master="tcp://h:1", transport=edge_transport(register_timeout=-1)
        ),
    ):
        with pytest.raises(ConfigError, match="register_timeout"):
            make()


@pytest.mark.parametrize(
    "argv",
    [
        ["train", "--heartbeat", "3", "--dead-after", "0.5", "--steps", "1"],
        ["edge", "run", ".", "--heartbeat", "10", "--unresponsive-after", "5"],
        ["edge", "worker", "--master", "tcp://127.0.0.1:1", "--register-timeout", "0"],
    ],
)
def test_bad_deadlines_exit_2_naming_the_field(argv, capsys, tmp_path):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert any(f in err for f in ("dead_after", "unresponsive_after", "register_timeout")), err
