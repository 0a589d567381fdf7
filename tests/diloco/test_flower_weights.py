"""Issue 25: a Flower client cannot poison the global model through its reply's weight or frames.

The strategy averages Δ by ``num-examples``: one client reporting inf, NaN, a negative or an
absurd count turned θ_g into NaN (inf/inf) or owned the mean. Such a reply, and one whose codec
frames hold non-finite values, now fails like a crashed client: the round goes on with the
others and the reason is logged.
"""

from __future__ import annotations

import logging
import math

import pytest
import torch
from flwr.app import ConfigRecord, Message, MetricRecord, RecordDict

from diloco.flower.inprocess import ensure_task_identity
from diloco.flower.records import encoded_to_records
from diloco.flower.strategy import DELTA, METRICS, REPLY
from lowband.codecs import get_codec
from lowband.errors import ConfigError
from tests.diloco.test_flower import FakeGrid, flat, reply, toy_strategy

pytestmark = [pytest.mark.security, pytest.mark.timeout(60)]


@pytest.fixture(autouse=True)
def _task_identity():
    ensure_task_identity()  # Flower Messages need a run id outside a ServerApp


BAD_WEIGHTS = [math.inf, -math.inf, math.nan, -5, 0, 2.0**41, 1e308, 10**400, [1, 2]]


def _round(s, bad_reply, codec="fp32"):
    """Round 1 with three nodes: two honest replies and ``bad_reply(instruction)``."""
    torch.manual_seed(3)
    n = sum(p.numel() for p in s.model.parameters())
    msgs = list(s.configure_train(1, s.global_record(), ConfigRecord(), FakeGrid([1, 2, 3])))
    d1, d2 = torch.randn(n), torch.randn(n)
    good = [reply(msgs[0], d1, 10, codec=codec), reply(msgs[1], d2, 30, codec=codec)]
    return s.aggregate_train(1, [*good, bad_reply(msgs[2])])


def _reference():
    s = toy_strategy()
    torch.manual_seed(3)
    n = sum(p.numel() for p in s.model.parameters())
    msgs = list(s.configure_train(1, s.global_record(), ConfigRecord(), FakeGrid([1, 2])))
    d1, d2 = torch.randn(n), torch.randn(n)
    s.aggregate_train(1, [reply(msgs[0], d1, 10), reply(msgs[1], d2, 30)])
    return flat(s.model.parameters())


def _with_weight(msg, weight):
    metrics = msg.content.metric_records[METRICS]
    msg.content.metric_records[METRICS] = MetricRecord({**dict(metrics), "num-examples": weight})
    return msg


@pytest.mark.parametrize("weight", BAD_WEIGHTS, ids=repr)
def test_a_bad_num_examples_refuses_only_that_client(weight, caplog):
    s = toy_strategy()
    n = sum(p.numel() for p in s.model.parameters())
    with caplog.at_level(logging.WARNING):
        arrays, metrics = _round(s, lambda m: _with_weight(reply(m, torch.ones(n), 1), weight))
    assert arrays is not None and metrics["applied"] == 1
    assert metrics["replies"] == 2 and metrics["failures"] == 1
    theta = flat(s.model.parameters())
    assert bool(torch.isfinite(theta).all())
    assert torch.equal(theta, _reference())  # the bad client contributed nothing
    assert "num-examples" in caplog.text and "node 3" in caplog.text


def test_the_weight_cap_is_a_config_bound():
    s = toy_strategy()
    assert s.fed.max_num_examples == 2.0**40
    n = sum(p.numel() for p in s.model.parameters())
    _, metrics = _round(s, lambda m: _with_weight(reply(m, torch.ones(n), 1), 2**40))
    assert metrics["replies"] == 3  # the cap itself is allowed
    with pytest.raises(ConfigError, match="max-num-examples"):
        type(s.fed)(rounds=1, max_num_examples=math.inf)


@pytest.mark.parametrize("poison", [math.inf, math.nan])
def test_non_finite_codec_frames_are_refused(poison, caplog):
    s = toy_strategy(codec="int8")
    n = sum(p.numel() for p in s.model.parameters())

    def bad(m):
        msg = reply(m, torch.ones(n), 10, codec="int8")
        enc = get_codec("int8").encode(torch.ones(n))
        frames = list(enc.frames)
        frames[1] = torch.full_like(frames[1], poison)  # the float32 block scales
        arrays, meta = encoded_to_records(type(enc)(frames=tuple(frames), meta=enc.meta))
        msg.content.array_records[DELTA] = arrays
        msg.content.config_records[REPLY]["codec-meta"] = meta
        return msg

    with caplog.at_level(logging.WARNING):
        arrays, metrics = _round(s, bad, codec="int8")
    assert arrays is not None and metrics["replies"] == 2 and metrics["failures"] == 1
    assert bool(torch.isfinite(flat(s.model.parameters())).all())
    assert "non-finite" in caplog.text


@pytest.mark.parametrize("weight", [math.inf, math.nan, -1])
def test_a_bad_evaluation_weight_is_left_out(weight):
    s = toy_strategy(**{"evaluate-every": 1})
    msgs = list(s.configure_evaluate(1, s.global_record(), ConfigRecord(), FakeGrid([1, 2])))

    def ev(m, n, loss):
        rec = ConfigRecord({"status": "ok", "versions": [0]})
        metrics = MetricRecord({"num-examples": n, "eval-loss": loss, "local-eval-loss": loss})
        return Message(RecordDict({REPLY: rec, METRICS: metrics}), reply_to=m)

    out = s.aggregate_evaluate(1, [ev(msgs[0], 10, 2.0), ev(msgs[1], weight, 5.0)])
    assert out is not None and out["replies"] == 1 and out["eval-loss"] == 2.0
    out = s.aggregate_evaluate(1, [ev(msgs[0], 10, 2.0), ev(msgs[1], 10, math.inf)])
    assert out is not None and out["replies"] == 1 and out["eval-loss"] == 2.0
