"""Configuration of a Flower DiLoCo run, and its translation from Flower's run config.

A Flower app is configured by flat ``key = value`` pairs (``[tool.flwr.app.config]`` in the app's
pyproject, overridden by ``flwr run --run-config``). :func:`from_run_config` turns them into one
frozen :class:`FlowerConfig` — the same pure function on the ServerApp and every ClientApp, so
both sides agree on H, P, the codec and the model without shipping Python objects.

One Flower round is one outer step of one fragment: round r (counted from 1) syncs fragment
``(r − 1) mod P`` after every client ran H/P inner steps, which is the lowband trainer's schedule
with τ = 0 (``diloco.schedule``). A run of R rounds therefore trains R·H/P inner steps per client.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Mapping, cast

from diloco.config import DataConfig, DilocoConfig, OptimizerConfig, TrainConfig, preset
from lowband.errors import ConfigError

# The app's run config: every key a Flower app directory must declare (Flower only accepts
# overrides of keys its pyproject declares), with its default and what it means.
# ``lowband flower new`` writes exactly these into [tool.flwr.app.config].
APP_CONFIG: dict[str, tuple[Any, str]] = {
    "preset": ("tiny", "diloco.config preset: model shape, data, inner optimizer"),
    "num-server-rounds": (3, "R: Flower rounds = fragment outer steps"),
    "inner-steps": (20, "H: inner steps between two syncs of the same fragment"),
    "fragments": (1, "P: fragments (round r syncs fragment (r-1) mod P)"),
    "alpha": (0.0, "α: θ_local ← α·θ_local + (1−α)·θ_global on receipt"),
    "codec": ("int8", "uplink codec of the pseudo-gradient (lowband.codecs name)"),
    "error-feedback": (False, "carry each fragment's quantization residual on the client"),
    "inner-lr": (3e-3, "AdamW peak learning rate"),
    "warmup-steps": (10, "inner-lr linear warmup (then cosine decay)"),
    "outer-lr": (0.7, "Nesterov outer learning rate"),
    "outer-momentum": (0.9, "Nesterov outer momentum"),
    "seq-len": (64, "T: tokens per sequence"),
    "batch-size": (8, "B: sequences per inner step"),
    "data-kind": ("embedded", "embedded | text | tokens (a node may override: node config)"),
    "data-path": ("", "file or directory for text/tokens"),
    "seed": (0, "model initialisation and data order"),
    "min-available-nodes": (2, "wait for this many connected SuperNodes before a round"),
    "min-train-replies": (1, "aggregate a round only with at least this many valid replies"),
    "fraction-train": (1.0, "share of connected nodes sampled per round"),
    "accept-failures": (True, "false: any failed reply skips the round"),
    "evaluate-every": (
        0,
        "federated evaluation every N rounds (0: never; the server "
        "evaluates θ_g every round anyway)",
    ),
    "round-timeout": (600.0, "seconds the server waits for replies of one round"),
    "out-dir": ("", "server: metrics.jsonl, summary.json, checkpoint/ (empty: none)"),
    "checkpoint-every": (0, "rounds between checkpoints (0: only after the last round)"),
    "threads": (0, "torch threads per ServerApp/ClientApp process (0: torch's)"),
}
APP_CONFIG_DEFAULTS: dict[str, Any] = {k: v for k, (v, _) in APP_CONFIG.items()}


@dataclass(frozen=True, kw_only=True)
class FederationConfig:
    """How the server runs rounds: sampling, failure tolerance, evaluation, checkpoints."""

    rounds: int  # R
    min_available_nodes: int = 2
    min_train_replies: int = 1
    fraction_train: float = 1.0
    accept_failures: bool = True
    evaluate_every: int = 0
    round_timeout: float = 600.0
    checkpoint_every: int = 0
    # The largest ``num-examples`` a client may report. Replies are averaged by it, so one
    # client claiming inf (or 1e308) would own or overflow the mean: a larger weight refuses
    # that client's reply for the round.
    max_num_examples: float = 2.0**40

    def __post_init__(self) -> None:
        if self.rounds < 1:
            raise ConfigError("num-server-rounds", f"must be >= 1, got {self.rounds}")
        if self.min_available_nodes < 1:
            raise ConfigError(
                "min-available-nodes", f"must be >= 1, got {self.min_available_nodes}"
            )
        if self.min_train_replies < 1:
            raise ConfigError("min-train-replies", f"must be >= 1, got {self.min_train_replies}")
        if not 0.0 < self.fraction_train <= 1.0:
            raise ConfigError("fraction-train", f"must be in (0, 1], got {self.fraction_train}")
        if self.evaluate_every < 0:
            raise ConfigError("evaluate-every", f"must be >= 0, got {self.evaluate_every}")
        if not self.round_timeout > 0:
            raise ConfigError("round-timeout", f"must be > 0 seconds, got {self.round_timeout}")
        if self.checkpoint_every < 0:
            raise ConfigError("checkpoint-every", f"must be >= 0, got {self.checkpoint_every}")
        if not (math.isfinite(self.max_num_examples) and self.max_num_examples >= 1):
            raise ConfigError(
                "max-num-examples", f"must be a finite number >= 1, got {self.max_num_examples}"
            )


@dataclass(frozen=True, kw_only=True)
class FlowerConfig:
    """A Flower DiLoCo run: the training recipe plus the federation's round policy.

    ``train.mode`` must be a :class:`DilocoConfig` with τ = 0 (a Flower round is synchronous:
    nothing trains while the server aggregates) and ``train.steps`` must equal R·H/P.
    """

    train: TrainConfig
    federation: FederationConfig
    out_dir: str | None = None  # server side: metrics.jsonl and checkpoint/
    threads: int = 0  # torch intra-op threads per app process (0: leave torch's default)

    def __post_init__(self) -> None:
        if self.threads < 0:
            raise ConfigError("threads", f"must be >= 0, got {self.threads}")
        mode = self.train.mode
        if not isinstance(mode, DilocoConfig):
            raise ConfigError("mode", "Flower rounds are DiLoCo outer steps; DDP is not supported")
        if mode.tau != 0:
            raise ConfigError("tau", "Flower rounds are synchronous: τ must be 0")
        want = self.federation.rounds * mode.stride
        if self.train.steps != want:
            raise ConfigError("steps", f"steps must be rounds·H/P = {want}, got {self.train.steps}")

    @property
    def mode(self) -> DilocoConfig:
        return cast(DilocoConfig, self.train.mode)  # checked in __post_init__

    @property
    def steps_per_round(self) -> int:
        """H/P: inner steps every client runs in one round."""
        return self.mode.stride


def sync_fragment(server_round: int, n_fragments: int) -> int:
    """The fragment round ``server_round`` (from 1) syncs. Pure; same as diloco.schedule."""
    if server_round < 1:
        raise ConfigError("server-round", f"rounds count from 1, got {server_round}")
    return (server_round - 1) % n_fragments


def _typed(key: str, value: Any, like: Any) -> Any:
    """Coerce a run-config value to the type of its default (TOML ints may stand for floats)."""
    if isinstance(like, bool):
        if not isinstance(value, bool):
            raise ConfigError(key, f"must be true or false, got {value!r}")
        return value
    if isinstance(like, int):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(key, f"must be an integer, got {value!r}")
        return value
    if isinstance(like, float):
        if (
            isinstance(value, bool)
            or not isinstance(value, (int, float))
            or not math.isfinite(value)
        ):
            raise ConfigError(key, f"must be a number, got {value!r}")
        return float(value)
    if not isinstance(value, str):
        raise ConfigError(key, f"must be a string, got {value!r}")
    return value


def _data(kind: str, path: str, base: DataConfig) -> DataConfig:
    return dataclasses.replace(base, kind=kind, path=path or None)  # type: ignore[arg-type]


def from_run_config(run_config: Mapping[str, Any]) -> FlowerConfig:
    """Parse Flower's run config (defaults: :data:`APP_CONFIG_DEFAULTS`). Pure.

    Unknown keys raise :class:`ConfigError` so that a typo never silently trains the default.
    """
    unknown = sorted(set(run_config) - set(APP_CONFIG_DEFAULTS))
    if unknown:
        raise ConfigError(
            "run-config", f"unknown keys {unknown}; known: {sorted(APP_CONFIG_DEFAULTS)}"
        )
    c = {k: _typed(k, run_config.get(k, d), d) for k, d in APP_CONFIG_DEFAULTS.items()}
    base = preset(c["preset"])
    mode = DilocoConfig(
        inner_steps=c["inner-steps"],
        n_fragments=c["fragments"],
        tau=0,
        alpha=c["alpha"],
        fragment_strategy="strided",
        codec=c["codec"],
        error_feedback=c["error-feedback"],
        outer=OptimizerConfig(
            name="sgd",
            lr=c["outer-lr"],
            momentum=c["outer-momentum"],
            nesterov=c["outer-momentum"] > 0,
        ),
    )
    federation = FederationConfig(
        rounds=c["num-server-rounds"],
        min_available_nodes=c["min-available-nodes"],
        min_train_replies=c["min-train-replies"],
        fraction_train=c["fraction-train"],
        accept_failures=c["accept-failures"],
        evaluate_every=c["evaluate-every"],
        round_timeout=c["round-timeout"],
        checkpoint_every=c["checkpoint-every"],
    )
    data = _data(
        c["data-kind"],
        c["data-path"],
        dataclasses.replace(base.data, seq_len=c["seq-len"], batch_size=c["batch-size"]),
    )
    model = base.model
    if model is None:  # every preset in diloco.config.PRESETS names its model shape
        raise ConfigError("preset", f"preset {c['preset']!r} names no model shape")
    if model.max_position_embeddings < data.seq_len:
        model = dataclasses.replace(model, max_position_embeddings=data.seq_len)
    train = dataclasses.replace(
        base,
        model=model,
        data=data,
        mode=mode,
        workers=1,
        seed=c["seed"],
        inner=dataclasses.replace(base.inner, lr=c["inner-lr"]),
        lr_schedule=dataclasses.replace(base.lr_schedule, warmup_steps=c["warmup-steps"]),
        steps=federation.rounds * mode.stride,
    )
    return FlowerConfig(
        train=train, federation=federation, out_dir=c["out-dir"] or None, threads=c["threads"]
    )


@dataclass(frozen=True, kw_only=True)
class NodeConfig:
    """What a SuperNode's ``--node-config`` may set: its data slot and, optionally, its own data."""

    slot: int  # the data stream this node draws batches from (``partition-id``)
    data_kind: str | None = None
    data_path: str | None = None
    extra: Mapping[str, Any] = field(default_factory=dict, compare=False)


def node_config(values: Mapping[str, Any], node_id: int) -> NodeConfig:
    """``partition-id`` (default: the node id), ``data-kind``/``data-path`` (default: the run's)."""
    slot = values.get("partition-id", node_id)
    if isinstance(slot, bool) or not isinstance(slot, int) or slot < 0:
        raise ConfigError("partition-id", f"must be an integer >= 0, got {slot!r}")
    kind = values.get("data-kind")
    path = values.get("data-path")
    if path is not None and kind is None:
        raise ConfigError(
            "data-kind", "a node that sets data-path must set data-kind (text|tokens)"
        )
    known = {"partition-id", "num-partitions", "data-kind", "data-path"}
    return NodeConfig(
        slot=slot,
        data_kind=None if kind is None else str(kind),
        data_path=None if path is None else str(path),
        extra={k: v for k, v in values.items() if k not in known},
    )


def for_node(cfg: FlowerConfig, node: NodeConfig) -> TrainConfig:
    """The run's TrainConfig with the node's own data source, if it has one."""
    if node.data_kind is None:
        return cfg.train
    return dataclasses.replace(
        cfg.train, data=_data(node.data_kind, node.data_path or "", cfg.train.data)
    )
