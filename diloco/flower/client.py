"""The ClientApp side: one Flower round = merge the global update, H/P inner steps, reply Δ.

State between rounds
--------------------
Every ClientApp run is a fresh process, but Streaming DiLoCo needs a worker's local model, its
inner AdamW state, its copy of θ_g and its error-feedback residuals to survive from one round to
the next. They live in Flower's ``Context.state`` (a RecordDict the SuperNode keeps per run and
hands to each ClientApp run of that run): the run's data stays on the node, nothing is written
to disk, and a second run on the same node starts clean. What the SuperNode keeps is lost when
it restarts; the client then holds no versions, says so (``stale``), and the server sends it the
full model the next round — the node rejoins without corrupting anything.

A node's copy of θ_g is versioned per fragment (see :mod:`diloco.flower.strategy`); ``-1`` means
never received. The inner-step counter (data order and learning-rate schedule) is a pure
function of the round, ``(r − 1)·H/P``, so a rejoining node draws the same batches as if it had
never left.
"""

from __future__ import annotations

import copy
import json
import logging

import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from diloco.checkpoint import load_optimizer_state, optimizer_state
from diloco.common import InnerLoop, run_signature
from diloco.config import TrainConfig
from diloco.flower.config import FlowerConfig, for_node, from_run_config, node_config, sync_fragment
from diloco.flower.records import (
    BASE_VERSION,
    BYTES_DOWN,
    BYTES_UP,
    BYTES_UP_FP32,
    CODEC,
    CODEC_META,
    CONFIG,
    DELTA,
    EVAL_LOSS,
    FRAGMENT,
    GLOBAL,
    LOCAL_EVAL_LOSS,
    METRICS,
    NUM_EXAMPLES,
    REPLY,
    SENT_FRAGMENTS,
    SENT_VERSIONS,
    SERVER_ROUND,
    STATUS,
    STATUS_OK,
    STATUS_STALE,
    TRAIN_LOSS,
    VALID,
    VERSIONS,
    config_ints,
    encoded_to_records,
    params_to_record,
    payload_bytes,
    record_to_params,
)
from diloco.fragments import plan_fragments
from diloco.outer import FragmentSync
from diloco.task import Task, lm_task
from lowband.codecs import get_codec
from lowband.errors import ProtocolError

logger = logging.getLogger(__name__)

# Keys of this client's memory in Context.state.
S_LOCAL, S_GLOBAL, S_INNER, S_RESIDUAL, S_META = (
    "lowband.local",
    "lowband.global",
    "lowband.inner",
    "lowband.residual",
    "lowband.meta",
)


class DilocoClient:
    """One node's Streaming DiLoCo worker, rebuilt for each message from ``Context.state``."""

    def __init__(
        self,
        cfg: FlowerConfig,
        task: Task,
        slot: int,
        state: RecordDict,
        *,
        train: TrainConfig | None = None,
    ) -> None:
        self.cfg, self.mode, self.task, self.slot = cfg, cfg.mode, task, slot
        self.train_cfg = train or cfg.train  # the run's recipe with this node's data source
        self.model = task.build_model()
        self.global_model = copy.deepcopy(self.model)  # this node's copy of θ_g
        self.inner = InnerLoop(self.train_cfg, task, self.model)
        self.signature = run_signature(self.train_cfg, self.model).hex()
        local = dict(self.model.named_parameters())
        glob = dict(self.global_model.named_parameters())
        self.shapes = {n: t.shape for n, t in glob.items()}
        codec = None if self.mode.codec == "fp32" else get_codec(self.mode.codec)
        plan = plan_fragments(
            list(local.items()), self.mode.n_fragments, self.mode.fragment_strategy
        )
        # FragmentSync gives the client Δ (with error feedback) and the α-merge. Its outer
        # optimizer is never stepped here (the server owns the outer step); SGD state is lazy.
        self.fragments = [
            FragmentSync(
                p,
                names,
                [local[n] for n in names],
                [glob[n] for n in names],
                self.mode.outer.build([glob[n] for n in names]),
                codec,
                self.mode.error_feedback,
            )
            for p, names in enumerate(plan.names)
        ]
        self.versions = [-1] * self.mode.n_fragments
        self.state = state
        self._load()

    # ---- the two message handlers --------------------------------------------------------------
    def train(self, msg: Message) -> Message:
        config = msg.content.config_records[CONFIG]
        server_round = int(config[SERVER_ROUND])  # type: ignore[arg-type]
        p = sync_fragment(server_round, self.mode.n_fragments)
        if int(config[FRAGMENT]) != p:  # type: ignore[arg-type]
            raise ProtocolError(
                f"round {server_round} must sync fragment {p}, the server "
                f"asked for {config[FRAGMENT]!s}: different P on the two sides?"
            )
        down, current = self._apply(msg)
        if not current:
            return self._reply(msg, STATUS_STALE, MetricRecord({NUM_EXAMPLES: 0, BYTES_DOWN: down}))
        self.inner.step = (server_round - 1) * self.mode.stride
        losses = [self.inner.run_step(self.slot) for _ in range(self.mode.stride)]
        x, valid = self.fragments[p].contribution()
        enc = get_codec(self.mode.codec).encode(x)
        arrays, meta = encoded_to_records(enc)
        reply = ConfigRecord(
            {
                FRAGMENT: p,
                BASE_VERSION: self.versions[p],
                CODEC: self.mode.codec,
                CODEC_META: meta,
                VALID: valid,
            }
        )
        metrics = MetricRecord(
            {
                NUM_EXAMPLES: self.mode.stride * self.train_cfg.data.batch_size,
                TRAIN_LOSS: float(torch.stack(losses).float().mean()),
                BYTES_UP: payload_bytes(arrays),
                BYTES_UP_FP32: 4 * x.numel(),
                BYTES_DOWN: down,
            }
        )
        self._save()
        return self._reply(msg, STATUS_OK, metrics, extra=reply, delta=arrays)

    def evaluate(self, msg: Message) -> Message:
        """Apply the pending global update (as the next train round would), then report the
        held-out loss of θ_g and of this node's local model on this node's data."""
        down, current = self._apply(msg)
        if not current:
            return self._reply(msg, STATUS_STALE, MetricRecord({NUM_EXAMPLES: 0, BYTES_DOWN: down}))
        d = self.train_cfg.data
        metrics = MetricRecord(
            {
                NUM_EXAMPLES: d.eval_batches * d.batch_size,
                EVAL_LOSS: self.task.evaluate(self.global_model),
                LOCAL_EVAL_LOSS: self.task.evaluate(self.model),
                BYTES_DOWN: down,
            }
        )
        self._save()
        return self._reply(msg, STATUS_OK, metrics)

    # ---- helpers -------------------------------------------------------------------------------
    @torch.no_grad()
    def _apply(self, msg: Message) -> tuple[int, bool]:
        """Merge the fragments the server sent; (bytes received, holds the server's θ_g)."""
        config = msg.content.config_records[CONFIG]
        sent = config_ints(config, SENT_FRAGMENTS)
        sent_versions = config_ints(config, SENT_VERSIONS)
        record = msg.content.array_records.get(GLOBAL, ArrayRecord())
        params = record_to_params(record, self.shapes) if sent else {}
        for p, v in zip(sent, sent_versions, strict=True):
            if not 0 <= p < len(self.fragments):
                raise ProtocolError(f"fragment {p} out of range (P={len(self.fragments)})")
            frag = self.fragments[p]
            if self.versions[p] == v:
                continue  # already merged (e.g. delivered by an evaluate message)
            try:
                for name, g in zip(frag.names, frag.global_):
                    g.copy_(params[name])
            except KeyError as exc:
                raise ProtocolError(f"fragment {p} sent without parameter {exc}") from None
            if self.versions[p] < 0:  # first time this node sees fragment p: start from θ_g
                for g, m in zip(frag.global_, frag.local):
                    m.copy_(g)
                    self.inner.opt.state.pop(m, None)
                frag.residual = None
            else:  # θ_local ← α·θ_local + (1−α)·θ_g; a poisoned tensor restarts its moments
                for param in frag.merge(self.mode.alpha):
                    self.inner.opt.state.pop(param, None)
            self.versions[p] = v
        current = self.versions == config_ints(config, VERSIONS)
        if not current:
            logger.warning(
                "this node holds global versions %s, the server is at %s: replying "
                "stale so that the server sends the rest",
                self.versions,
                config_ints(config, VERSIONS),
            )
            self._save()
        return payload_bytes(record), current

    def _reply(
        self,
        msg: Message,
        status: str,
        metrics: MetricRecord,
        *,
        extra: ConfigRecord | None = None,
        delta: ArrayRecord | None = None,
    ) -> Message:
        reply = ConfigRecord({STATUS: status, VERSIONS: list(self.versions)})
        if extra is not None:
            reply.update(extra)
        content = RecordDict({REPLY: reply, METRICS: metrics})
        if delta is not None:
            content[DELTA] = delta
        return Message(content, reply_to=msg)

    def _load(self) -> None:
        meta_rec = self.state.config_records.get(S_META)
        if meta_rec is None:
            return
        if meta_rec.get("signature") != self.signature:
            logger.warning("node state belongs to another model/config; starting fresh")
            return
        versions = config_ints(meta_rec, "versions")
        if len(versions) != len(self.fragments):
            return
        with torch.no_grad():
            for key, model in ((S_LOCAL, self.model), (S_GLOBAL, self.global_model)):
                params = record_to_params(self.state.array_records[key], self.shapes)
                for name, t in model.named_parameters():
                    t.copy_(params[name])
        inner = {
            k: torch.from_numpy(a.numpy().copy())
            for k, a in self.state.array_records[S_INNER].items()
        }
        load_optimizer_state(self.inner.opt, "inner", inner, json.loads(str(meta_rec["inner"])))
        residuals = self.state.array_records.get(S_RESIDUAL, ArrayRecord())
        for f in self.fragments:
            if str(f.index) in residuals:
                f.residual = torch.from_numpy(residuals[str(f.index)].numpy().copy())
        self.versions = versions

    def _save(self) -> None:
        tensors, inner_meta = optimizer_state(self.inner.opt, "inner")
        self.state[S_LOCAL] = params_to_record(self.model.named_parameters())
        self.state[S_GLOBAL] = params_to_record(self.global_model.named_parameters())
        self.state[S_INNER] = params_to_record(tensors.items())
        self.state[S_RESIDUAL] = params_to_record(
            (str(f.index), f.residual) for f in self.fragments if f.residual is not None
        )
        self.state[S_META] = ConfigRecord(
            {
                "signature": self.signature,
                "versions": list(self.versions),
                "inner": json.dumps(inner_meta),
            }
        )


def client_for(context: Context, task: Task | None = None) -> DilocoClient:
    """Parse the run and node config of ``context`` and rebuild this node's worker."""
    cfg = from_run_config(context.run_config)
    if cfg.threads:  # this ClientApp run is its own process: the setting is ours to make
        torch.set_num_threads(cfg.threads)
    node = node_config(context.node_config, context.node_id)
    train = for_node(cfg, node)
    return DilocoClient(cfg, task or lm_task(train), node.slot, context.state, train=train)


def make_client_app() -> ClientApp:
    """The ClientApp: ``train`` and ``evaluate`` handlers over :class:`DilocoClient`."""
    app = ClientApp()

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        return client_for(context).train(msg)

    @app.evaluate()
    def evaluate(msg: Message, context: Context) -> Message:
        return client_for(context).evaluate(msg)

    return app


def handle(msg: Message, context: Context) -> Message:
    """Route a message by type (``train``/``evaluate``) — the ClientApp as a plain function."""
    client = client_for(context)
    kind = msg.metadata.message_type.split(".", 1)[0]
    if kind == "train":
        return client.train(msg)
    if kind == "evaluate":
        return client.evaluate(msg)
    raise ProtocolError(f"this ClientApp handles train and evaluate, not {kind!r}")
