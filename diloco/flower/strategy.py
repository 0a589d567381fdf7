"""DiLoCoStrategy: a Flower Strategy where one round is one DiLoCo outer step of one fragment.

Round r (from 1) syncs fragment p = (r − 1) mod P (P = 1: the whole model, plain DiLoCo):

1. ``configure_train`` sends every sampled node the global fragments it does not hold yet
   (normally only the one updated last round: 1/P of the model down) and the version vector.
2. Each ClientApp merges what it received into its local copy, runs H/P inner steps and replies
   with its pseudo-gradient Δ_m = θ_g[p] − θ_m[p], encoded by a lowband codec (int8/fp4/nf4 …),
   plus ``num-examples``, its loss and byte counts.
3. ``aggregate_train`` decodes to float32, averages by examples, Δ̄ = Σ_m n_m·Δ_m / Σ_m n_m, and
   applies the outer optimizer, θ_g[p] ← OuterOpt(θ_g[p], grad = Δ̄) — SGD Nesterov (lr 0.7,
   μ 0.9) by default, one optimizer per fragment whose momentum lives across rounds (FedAvgM
   has momentum but no Nesterov).

Versions and failures
---------------------
The server numbers each fragment's global value by the round that last changed it (0: initial).
It remembers, per node, the versions that node reported holding in its last reply, and sends
exactly the fragments whose version differs (a new node gets the full model). A client checks
that after applying a message it holds the server's whole version vector; if not (its SuperNode
restarted, a reply got lost) it answers ``stale`` with what it holds, and the next round fills
the gap. Δ_m is accepted only if computed against the current θ_g[p].

A round aggregates the valid replies if there are at least ``min_train_replies`` of them (and,
with ``accept_failures=False``, no failures); otherwise it is skipped: θ_g, the outer momentum
and the versions stay as they were, so a bad round can never corrupt the state. Error replies,
replies that never came (Flower's round timeout; a late reply is dropped by Flower), malformed
or non-finite payloads and stale clients all count as failures.
"""

from __future__ import annotations

import math
import random
import time
from logging import INFO, WARNING
from pathlib import Path
from typing import Any, Iterable

import torch
from flwr.app import (
    Array,
    ArrayRecord,
    ConfigRecord,
    Message,
    MessageType,
    MetricRecord,
    MetricRecordValues,
    RecordDict,
)
from flwr.common.logger import log as flwr_log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy
from flwr.serverapp.strategy.strategy_utils import sample_nodes
from torch import nn

from diloco.checkpoint import export_model, optimizer_state, save_state
from diloco.common import hash_state, optimizer_tensors
from diloco.flower.config import FlowerConfig, sync_fragment
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
    metric_float,
    params_to_record,
    payload_bytes,
    record_to_params,
    records_to_encoded,
    summary_key,
)
from diloco.fragments import plan_fragments
from diloco.metrics import MetricsLog
from diloco.outer import FragmentSync
from lowband.codecs import get_codec
from lowband.errors import ProtocolError

# Record keys shared with diloco.flower.client.


class _Stale(Exception):
    """A client did not hold the global state its Δ would have to be computed against."""


class DiLoCoStrategy(Strategy):
    """Streaming DiLoCo outer optimization as a Flower :class:`Strategy` (Message API).

    ``model`` holds θ_g: the strategy updates its parameters in place. ``log`` receives one
    ``round`` record per round and one ``fed_eval`` record per federated evaluation;
    ``checkpoint_dir`` gets an HF-format model plus the outer-optimizer state.
    """

    def __init__(
        self,
        model: nn.Module,
        cfg: FlowerConfig,
        *,
        log: MetricsLog | None = None,
        checkpoint_dir: Path | None = None,
        byte_tokenizer: bool = True,
    ) -> None:
        self.model, self.cfg, self.mode, self.fed = model, cfg, cfg.mode, cfg.federation
        self.log = log or MetricsLog(None)
        self.checkpoint_dir, self.byte_tokenizer = checkpoint_dir, byte_tokenizer
        named = dict(model.named_parameters())
        plan = plan_fragments(
            list(named.items()), self.mode.n_fragments, self.mode.fragment_strategy
        )
        # The server holds only θ_g; FragmentSync's local side is never used here (no
        # contribution, no merge), so it points at θ_g as well.
        self.fragments = [
            FragmentSync(
                p,
                names,
                [named[n] for n in names],
                [named[n] for n in names],
                self.mode.outer.build([named[n] for n in names]),
                None,
                False,
            )
            for p, names in enumerate(plan.names)
        ]
        self.shapes = {n: t.shape for n, t in named.items()}
        self.versions = [0] * self.mode.n_fragments
        self.known: dict[int, list[int]] = {}  # node id -> versions it reported holding
        self.history: list[dict[str, Any]] = []  # the metrics of every round
        self.totals = {summary_key(k): 0 for k in (BYTES_UP, BYTES_UP_FP32, BYTES_DOWN)}
        self._initialized = False
        self._arrays: dict[str, tuple[int, Array]] = {}  # name -> (version, serialized)
        self._down: dict[tuple[str, int], int] = {}  # (message type, round) -> bytes sent
        self._expected: dict[int, set[int]] = {}  # round -> nodes asked to train
        self._t0 = time.perf_counter()

    # ---- Flower Strategy API -------------------------------------------------------------------
    def summary(self) -> None:
        m, f = self.mode, self.fed
        flwr_log(
            INFO,
            "DiLoCoStrategy: H=%d P=%d (%d inner steps per round) alpha=%s "
            "codec=%s error_feedback=%s outer=%s lr=%s momentum=%s nesterov=%s",
            m.inner_steps,
            m.n_fragments,
            m.stride,
            m.alpha,
            m.codec,
            m.error_feedback,
            m.outer.name,
            m.outer.lr,
            m.outer.momentum,
            m.outer.nesterov,
        )
        flwr_log(
            INFO,
            "  rounds=%d min_available_nodes=%d min_train_replies=%d "
            "fraction_train=%s accept_failures=%s evaluate_every=%d",
            f.rounds,
            f.min_available_nodes,
            f.min_train_replies,
            f.fraction_train,
            f.accept_failures,
            f.evaluate_every,
        )

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        if not self._initialized:
            self.load_arrays(arrays)
        nodes = self._sample(grid, server_round)
        self._expected[server_round] = set(nodes)
        return [self._instruction(n, server_round, config, MessageType.TRAIN) for n in nodes]

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        p = sync_fragment(server_round, self.mode.n_fragments)
        valid: list[tuple[float, torch.Tensor, MetricRecord]] = []
        failures: list[str] = []
        stale = 0
        replies = list(replies)
        # A node that was asked and did not answer within the round's timeout failed too.
        missing = self._expected.pop(server_round, set()) - {
            m.metadata.src_node_id for m in replies
        }
        failures += [f"node {n}: no reply within the round timeout" for n in sorted(missing)]
        for msg in replies:
            if msg.has_error():
                failures.append(f"node {msg.metadata.src_node_id}: {msg.error.reason}")
                continue
            try:
                valid.append(self._read_train_reply(msg, p))
            except _Stale:
                stale += 1
                failures.append(f"node {msg.metadata.src_node_id}: stale")
            except ProtocolError as exc:
                failures.append(f"node {msg.metadata.src_node_id}: {exc}")
        for reason in failures:
            flwr_log(WARNING, "round %d: failed reply from %s", server_round, reason)
        applied = len(valid) >= self.fed.min_train_replies and (
            self.fed.accept_failures or not failures
        )
        update_norm = 0.0
        if applied:
            update_norm = self._outer_step(p, valid, server_round)
        else:
            flwr_log(
                WARNING,
                "round %d skipped: %d valid replies (need %d), %d failures%s",
                server_round,
                len(valid),
                self.fed.min_train_replies,
                len(failures),
                "" if self.fed.accept_failures else " (accept_failures is off)",
            )
        rec = self._round_record(server_round, p, valid, len(failures), stale, applied, update_norm)
        every = self.fed.checkpoint_every  # the final checkpoint is the ServerApp's
        if applied and self.checkpoint_dir is not None and every and server_round % every == 0:
            self.save_checkpoint(self.checkpoint_dir / f"round-{server_round:04d}", server_round)
        metrics = MetricRecord({k: v for k, v in rec.items() if v is not None})
        return (self.global_record() if applied else None), metrics

    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        every = self.fed.evaluate_every
        if every == 0 or (server_round % every and server_round != self.fed.rounds):
            return []
        nodes = self._sample(grid, server_round)
        return [self._instruction(n, server_round, config, MessageType.EVALUATE) for n in nodes]

    def aggregate_evaluate(
        self, server_round: int, replies: Iterable[Message]
    ) -> MetricRecord | None:
        weights: list[float] = []
        values: dict[str, list[float]] = {EVAL_LOSS: [], LOCAL_EVAL_LOSS: []}
        for msg in replies:
            if msg.has_error():
                flwr_log(
                    WARNING,
                    "round %d: evaluation failed on node %d: %s",
                    server_round,
                    msg.metadata.src_node_id,
                    msg.error.reason,
                )
                continue
            try:
                status = self._read_status(msg)
                metrics = msg.content.metric_records[METRICS]
                n = self._num_examples(metrics, allow_zero=True)
                row = {k: metric_float(metrics, k) for k in values}
                if not all(math.isfinite(v) for v in row.values()):
                    raise ProtocolError(f"non-finite evaluation loss {row}")
            except (KeyError, TypeError, ValueError, ProtocolError) as exc:
                flwr_log(
                    WARNING,
                    "round %d: bad evaluation reply from node %d: %s",
                    server_round,
                    msg.metadata.src_node_id,
                    exc,
                )
                continue
            if status != STATUS_OK or n <= 0:
                continue
            weights.append(n)
            for k, v in row.items():
                values[k].append(v)
        sent = self._down.get((MessageType.EVALUATE, server_round), 0)
        self.totals[summary_key(BYTES_DOWN)] += sent
        if not weights:
            return None
        total = sum(weights)
        out: dict[str, MetricRecordValues] = {
            k: sum(w * v for w, v in zip(weights, vs)) / total for k, vs in values.items()
        }
        out[NUM_EXAMPLES] = int(total)
        out["replies"] = len(weights)
        out[BYTES_DOWN] = sent
        self.log.log("fed_eval", round=server_round, **{summary_key(k): v for k, v in out.items()})
        return MetricRecord(out)

    # ---- state ---------------------------------------------------------------------------------
    @torch.no_grad()
    def load_arrays(self, arrays: ArrayRecord) -> None:
        """Set θ_g from a full ArrayRecord (Flower's ``initial_arrays``). Versions restart at 0."""
        params = record_to_params(arrays, self.shapes)
        missing = set(self.shapes) - set(params)
        if missing:
            raise ProtocolError(
                f"initial arrays lack {len(missing)} parameters, e.g. {sorted(missing)[:3]}"
            )
        for name, p in self.model.named_parameters():
            p.copy_(params[name])
        self._arrays.clear()
        self._initialized = True

    def state_hash(self) -> int:
        """Digest of θ_g, every fragment's outer optimizer state and version: the state the run
        ends in (``diloco.metrics.RunSummary``), comparable with a rerun's."""
        tensors: list[torch.Tensor] = list(self.model.parameters())
        for f in self.fragments:
            tensors += optimizer_tensors(f.outer_opt)
        return hash_state(tensors, *self.versions)

    def global_record(self) -> ArrayRecord:
        """θ_g as a Flower ArrayRecord (numpy arrays, HF parameter names)."""
        return params_to_record(self.model.named_parameters())

    def save_checkpoint(self, directory: Path, server_round: int) -> Path:
        """HF-format model (config.json + model.safetensors) and ``outer.safetensors/.json``."""
        export_model(self.model, directory, byte_tokenizer=self.byte_tokenizer)
        tensors: dict[str, torch.Tensor] = {}
        outer_meta = []
        for f in self.fragments:
            t, meta = optimizer_state(f.outer_opt, f"outer{f.index}")
            tensors.update(t)
            outer_meta.append(meta)
        meta = {
            "format": 1,
            "round": server_round,
            "versions": list(self.versions),
            "fragments": [list(f.names) for f in self.fragments],
            "outer": outer_meta,
        }
        save_state(directory / "outer", (tensors, meta))
        flwr_log(INFO, "round %d: checkpoint written to %s", server_round, directory)
        return directory

    # ---- helpers -------------------------------------------------------------------------------
    def _sample(self, grid: Grid, server_round: int) -> list[int]:
        # Flower's helper blocks until enough nodes are connected; the sample itself is seeded
        # so that a rerun with the same nodes picks the same ones.
        _, all_nodes = sample_nodes(
            grid, self.fed.min_available_nodes, self.fed.min_available_nodes
        )
        k = max(1, min(len(all_nodes), round(len(all_nodes) * self.fed.fraction_train)))
        rng = random.Random(self.cfg.train.seed * 1_000_003 + server_round)
        return sorted(rng.sample(sorted(all_nodes), k))

    def _array(self, fragment: int, name: str, param: torch.Tensor) -> Array:
        version = self.versions[fragment]
        cached = self._arrays.get(name)
        if cached is None or cached[0] != version:
            cached = (version, Array(param.detach().cpu().numpy()))
            self._arrays[name] = cached
        return cached[1]

    def _instruction(
        self, node: int, server_round: int, config: ConfigRecord, message_type: str
    ) -> Message:
        held = self.known.get(node)
        need = [
            q for q in range(len(self.fragments)) if held is None or held[q] != self.versions[q]
        ]
        arrays = ArrayRecord(
            {
                n: self._array(q, n, t)
                for q in need
                for n, t in zip(self.fragments[q].names, self.fragments[q].global_)
            }
        )
        key = (message_type, server_round)
        self._down[key] = self._down.get(key, 0) + payload_bytes(arrays)
        cfg = ConfigRecord(dict(config))
        cfg.update(
            {
                SERVER_ROUND: server_round,
                FRAGMENT: sync_fragment(server_round, self.mode.n_fragments),
                VERSIONS: list(self.versions),
                SENT_FRAGMENTS: need,
                SENT_VERSIONS: [self.versions[q] for q in need],
            }
        )
        return Message(
            RecordDict({GLOBAL: arrays, CONFIG: cfg}),
            dst_node_id=node,
            message_type=message_type,
            group_id=str(server_round),
        )

    def _read_status(self, msg: Message) -> str:
        """Record what the node holds (always) and return its status."""
        reply = msg.content.config_records[REPLY]
        held = config_ints(reply, VERSIONS)
        if len(held) != len(self.fragments):
            raise ProtocolError(
                f"version vector of length {len(held)}, expected {len(self.fragments)}"
            )
        self.known[msg.metadata.src_node_id] = held
        status = reply.get(STATUS)
        if status not in (STATUS_OK, STATUS_STALE):
            raise ProtocolError(f"unknown reply status {status!r}")
        return str(status)

    def _num_examples(self, metrics: MetricRecord, *, allow_zero: bool) -> float:
        """A reply's ``num-examples``: the weight of its Δ (or loss) in the round's mean.

        A finite number in [0, max_num_examples] (> 0 for training): inf, NaN, a negative or an
        absurd count would let one client turn the mean into NaN or own it outright.
        """
        value = metrics[NUM_EXAMPLES]
        if isinstance(value, (bool, list)):
            raise ProtocolError(f"num-examples must be a number, got {value!r}")
        try:
            n = float(value)
        except OverflowError:  # an int beyond float's range
            n = math.inf
        cap = self.fed.max_num_examples
        if not (math.isfinite(n) and (n >= 0 if allow_zero else n > 0) and n <= cap):
            raise ProtocolError(
                f"num-examples must be a finite number in {'[' if allow_zero else '('}0, "
                f"{cap:g}], got {value!r}"
            )
        return n

    def _read_train_reply(self, msg: Message, p: int) -> tuple[float, torch.Tensor, MetricRecord]:
        """(weight, decoded Δ, metrics) of one reply; raises _Stale or ProtocolError."""
        try:
            if self._read_status(msg) == STATUS_STALE:
                raise _Stale()
            reply = msg.content.config_records[REPLY]
            metrics = msg.content.metric_records[METRICS]
            arrays = msg.content.array_records[DELTA]
            weight = self._num_examples(metrics, allow_zero=False)
            fragment, base = int(reply[FRAGMENT]), int(reply[BASE_VERSION])  # type: ignore[arg-type]
            codec, meta, ok = str(reply[CODEC]), reply[CODEC_META], bool(reply[VALID])
        except (KeyError, TypeError, ValueError) as exc:
            raise ProtocolError(f"malformed train reply: {exc!r}") from None
        if fragment != p or base != self.versions[p]:
            raise ProtocolError(
                f"Δ of fragment {fragment} v{base}; this round needs fragment "
                f"{p} v{self.versions[p]}"
            )
        if codec != self.mode.codec or not isinstance(meta, bytes):
            raise ProtocolError(f"Δ encoded with {codec!r}; the run uses {self.mode.codec!r}")
        if not ok:
            raise ProtocolError("the client's pseudo-gradient was not finite")
        delta = get_codec(codec).decode(records_to_encoded(arrays, meta)).reshape(-1)
        if delta.numel() != self.fragments[p].numel or not bool(torch.isfinite(delta).all()):
            raise ProtocolError(
                f"Δ has {delta.numel()} values (expected "
                f"{self.fragments[p].numel}) or is not finite"
            )
        return weight, delta.to(torch.float32), metrics

    def _outer_step(
        self, p: int, valid: list[tuple[float, torch.Tensor, MetricRecord]], server_round: int
    ) -> float:
        """Δ̄ = Σ n_m·Δ_m / Σ n_m in float32, then the fragment's outer optimizer step."""
        total = sum(w for w, _, _ in valid)
        avg = torch.zeros(self.fragments[p].numel, dtype=torch.float32)
        for w, delta, _ in valid:
            avg.add_(delta, alpha=w / total)
        self.fragments[p].outer_step(avg)
        self.versions[p] = server_round
        return float(avg.norm())

    def _round_record(
        self,
        server_round: int,
        p: int,
        valid: list[tuple[float, torch.Tensor, MetricRecord]],
        failures: int,
        stale: int,
        applied: bool,
        update_norm: float,
    ) -> dict[str, Any]:
        def total(key: str) -> float:
            return sum(metric_float(m, key) if key in m else 0.0 for _, _, m in valid)

        weights = sum(w for w, _, _ in valid)
        up, up32 = int(total(BYTES_UP)), int(total(BYTES_UP_FP32))
        down = self._down.get((MessageType.TRAIN, server_round), 0)
        self.totals[summary_key(BYTES_UP)] += up
        self.totals[summary_key(BYTES_UP_FP32)] += up32
        self.totals[summary_key(BYTES_DOWN)] += down
        loss = (
            sum(w * metric_float(m, TRAIN_LOSS) for w, _, m in valid) / weights if weights else None
        )  # no valid reply: no loss (MetricRecord leaves it out)
        rec: dict[str, Any] = {
            "round": server_round,
            FRAGMENT: p,
            "step": server_round * self.mode.stride,
            "replies": len(valid),
            "failures": failures,
            "stale": stale,
            "applied": int(applied),
            TRAIN_LOSS: loss,
            NUM_EXAMPLES: int(weights),
            BYTES_UP: up,
            BYTES_UP_FP32: up32,
            BYTES_DOWN: down,
            "update-norm": update_norm,
            "wall-s": round(time.perf_counter() - self._t0, 3),
        }
        self.history.append(rec)
        self.log.log("round", **{summary_key(k): v for k, v in rec.items()})
        return rec
