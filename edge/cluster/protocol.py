"""The control protocol between the master and its workers: one frozen dataclass per message.

Every message travels as a msgpack meta dict (``encode``) whose ``"op"`` names its class in
:data:`MESSAGES`; :func:`decode` turns such a dict back into the message, checking that every
field is present (or has a default) and has its declared type (:mod:`lowband.schema`), and
raises :class:`lowband.errors.ProtocolError` naming the op and the field otherwise. Tensors travel
beside the meta, never in it.

Channels (tags of :meth:`lowband.comm.Communicator.send`)::

    edge.ctl     master -> worker: every message of TO_WORKER except ``yield``
    star link    master -> worker (``transport.starlink`` CMD): ``forward``, ``batch``,
                 ``stage`` and ``yield`` only; worker -> master: ``staged``
    edge.ready   worker -> master: ``ready`` (answer to ``assign``), ``bye`` (to ``shutdown``)
    edge.stats{n}  worker -> master: ``report`` (answer to ``stats`` n)
    edge.stage   worker -> master: ``staged`` (answer to ``stage``, pipeline layout)

``echo`` and ``profile`` are answered by :func:`edge.profile.answer` on ``edge.echo{n}`` /
``edge.profile{n}`` with its typed answers (``EchoReply``, ``ProfileReport``).

The ops and their fields (master -> worker down to ``stage``, then the workers' answers),
generated from the dataclasses below by :func:`describe` (a test keeps the two in step)::

    assign    slot: int, world: int, weights: list[float] | None, model_dir: str,
              dtype: str | None, wire: str, algorithm: str, op_timeout: float,
              window: int | None, memory_budget_mb: float | None, experts: dict | None,
              link_port: int | None, link_spin_us: float, link_secret: str | None,
              silence_s: float, repack: str = 'off', ship: bool = False
    forward   fid: int, start: int, epoch: int, top: int = 0, link: bool = False
              + tensors: the embedded tokens (1, T, H)
    batch     fid: int, epoch: int, caches: list[int], starts: list[int], lengths: list[int],
              rows: list[int], top: int = 0, link: bool = False
              + tensors: every item's embedded tokens, back to back (1, N, H)
    copy      epoch: int, src: int, dst: int, n: int
    drop      epoch: int, cache: int
    reset     sync: bool = False
    ping      n: int, epoch: int
    stats     n: int
    regroup   epoch: int
    shutdown  reason: str | None = None
    echo      n: int
    profile   n: int, dtype: str | None, model_dir: str, memory_mb: float | None = None
    yield
    stage_assign stage: int, lo: int, hi: int, layers: int, model_dir: str, dtype: str | None,
              op_timeout: float, silence_s: float, link_port: int | None = None,
              link_secret: str | None = None, link_spin_us: float = 0.0, repack: str = 'off',
              head_lo: int = 0, mapped: bool = False, whole_head: bool = False,
              ship: bool = False
    stage     fid: int, epoch: int, caches: list[int], starts: list[int], lengths: list[int],
              link: bool = False, top: int = 0, rows: list[int] | None = None,
              embed: bool = False
              + tensors: the hidden state in (1, N, H), N = sum(lengths); embed: ids (1, N)
    ready     ok: bool, slot: int | None = None, error: str | None = None
    bye
    report    report: dict | None
    staged    fid: int, floors: list[int] | None = None
              + tensors: hidden (1, N, H) [, values, ids (R, top)]; embed: values, ids | rows (R, H)
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar, Sequence, TypeVar

from lowband import schema
from lowband.errors import ProtocolError
from lowband.schema import Record

CTL = "edge.ctl"  # master -> worker control messages
READY = "edge.ready"  # worker -> master: ready / bye
STAGE = "edge.stage"  # worker -> master: staged (pipeline layout)
MASTER_ID_PREFIX = "edge-master"  # peer id prefix of the master on a real transport
MAX_WORLD = 4096  # devices of a plan: far beyond any cluster, small enough to bound every list
# KV-cache ids of the engine (``edge.engine.Work.slot``; not the plan's device slots) a batch
# may name: far beyond any --parallel, small enough to bound a worker's caches
MAX_SEQS = 4096


def master_rank(peers: Sequence[str]) -> int:
    """The master's rank: the peer whose id says so, else rank 0 (loopback groups)."""
    for r, p in enumerate(peers):
        if p.startswith(MASTER_ID_PREFIX):
            return r
    return 0


def stats_tag(n: int) -> str:
    """Tag of the answer to ``stats`` n: fresh per request, so a late answer matches no other."""
    return f"edge.stats{n}"


M = TypeVar("M", bound="Msg")


@dataclass(frozen=True, kw_only=True)
class Msg(Record):
    """Base of every control message; ``OP`` is its name on the wire (its ``"op"`` key)."""

    OP: ClassVar[str] = ""

    def __init_subclass__(cls, **kw: Any) -> None:
        super().__init_subclass__(**kw)
        cls.NAME = cls.OP

    def encode(self) -> dict[str, Any]:
        """The msgpack meta dict: ``op`` and every field (lists, never tuples)."""
        return {"op": self.OP, **self.to_wire()}

    @classmethod
    def decode(cls: type[M], meta: dict) -> M:
        """``meta`` as this message; :class:`ProtocolError` when it is another or malformed."""
        msg = decode(meta)
        if not isinstance(msg, cls):
            raise ProtocolError(f"expected a {cls.OP!r} message, got {msg.OP!r}")
        return msg


MESSAGES: dict[str, type[Msg]] = {}  # op -> message class
TO_WORKER: set[str] = set()  # ops the master sends (edge.ctl or the star link)
TO_MASTER: set[str] = set()  # ops the workers answer with


def _to_worker(cls: type[M]) -> type[M]:
    MESSAGES[cls.OP] = cls
    TO_WORKER.add(cls.OP)
    return cls


def _to_master(cls: type[M]) -> type[M]:
    MESSAGES[cls.OP] = cls
    TO_MASTER.add(cls.OP)
    return cls


@_to_worker
@dataclass(frozen=True, kw_only=True)
class Assign(Msg):
    """Load slot ``slot`` of a ``world``-device plan and answer ``ready``."""

    OP: ClassVar[str] = "assign"
    slot: int
    world: int  # N: devices of the plan
    weights: list[float] | None  # relative device capacities (uneven split)
    model_dir: str  # must be the worker's own --model-dir or inside it (worker.served_path)
    dtype: str | None
    wire: str  # activation encoding of the all-reduces (edge.cluster.shard.WIRE_CODECS)
    algorithm: str  # all-reduce schedule
    op_timeout: float  # seconds
    window: int | None  # sliding window (layer blocks resident)
    memory_budget_mb: float | None
    experts: dict | None  # edge.moe.serve.ExpertServeConfig.to_dict of a nested MoE
    link_port: int | None  # the master's star link; None: all-reduce over the communicator
    link_spin_us: float
    link_secret: str | None
    silence_s: float  # this much silence from the master means it is gone
    # the slice's K-quant weights also in the batch GEMM's layout: auto / on / off
    # (edge.shardio.LoadedShard.repack); a master that predates it sends none: off
    repack: str = "off"
    # the master streams the model (edge.cluster.ship) right after this message: the worker
    # loads it from its cache directory, not from model_dir
    ship: bool = False

    def __post_init__(self) -> None:
        # A worker acts on these numbers (sizes a split, sleeps, dials a port): refuse what
        # no master sends, so a forged or corrupted assign is answered, never half carried out.
        def bad(name: str, why: str) -> ProtocolError:
            return ProtocolError(
                f"'assign' message: field {name!r} {why}, got {getattr(self, name)!r:.80}"
            )

        if not 1 <= self.world <= MAX_WORLD:
            raise bad("world", f"must be in [1, {MAX_WORLD}]")
        if not 0 <= self.slot < self.world:
            raise bad("slot", f"must be in [0, world = {self.world})")
        if self.weights is not None and (
            len(self.weights) != self.world
            or not all(math.isfinite(w) and w > 0 for w in self.weights)
        ):
            raise bad("weights", f"must be {self.world} finite numbers > 0")
        if not self.model_dir or "\0" in self.model_dir:
            raise bad("model_dir", "must be a non-empty path without NUL")
        for name, low in (("op_timeout", False), ("silence_s", True), ("link_spin_us", True)):
            v = getattr(self, name)
            if not (math.isfinite(v) and (v >= 0 if low else v > 0)):
                raise bad(name, "must be a finite number " + (">= 0" if low else "> 0"))
        if self.window is not None and self.window < 1:
            raise bad("window", "must be >= 1")
        if self.memory_budget_mb is not None and not (
            math.isfinite(self.memory_budget_mb) and self.memory_budget_mb > 0
        ):
            raise bad("memory_budget_mb", "must be a finite number > 0")
        if self.link_port is not None and not 1 <= self.link_port <= 65535:
            raise bad("link_port", "must be a TCP port")
        if self.repack not in ("auto", "on", "off"):
            raise bad("repack", "must be auto, on or off")


@_to_worker
@dataclass(frozen=True, kw_only=True)
class Forward(Msg):
    """Run this slot's layers on the tensor sent along (embedded tokens (1, T, H))."""

    OP: ClassVar[str] = "forward"
    TENSORS: ClassVar[str] = "the embedded tokens (1, T, H)"
    fid: int  # forward id: all-reduces are tagged f{fid}.{k}
    start: int  # position of the first token in the KV cache
    epoch: int  # membership epoch it was sent in (a stale one is dropped)
    top: int = 0  # candidates per rank of the vocabulary-parallel head (edge.tp.gather_logits)
    link: bool = False  # keep polling the star link for the next command


@_to_worker
@dataclass(frozen=True, kw_only=True)
class Batch(Msg):
    """Continuous batching: run this slot's layers once over several sequences. Item i appends
    ``lengths[i]`` tokens at positions ``starts[i]..`` to KV cache ``caches[i]``; the tensor
    holds every item's embedded tokens back to back (1, N, H), N = sum(lengths). Then the
    final hidden rows ``rows`` (indices into N, ascending) go through the vocabulary-parallel
    head together (edge.cluster.shard.shard_rows_logits)."""

    OP: ClassVar[str] = "batch"
    TENSORS: ClassVar[str] = "every item's embedded tokens, back to back (1, N, H)"
    fid: int  # forward id: all-reduces are tagged f{fid}.{k}
    epoch: int  # membership epoch it was sent in (a stale one is dropped)
    caches: list[int]  # the engine's KV-cache ids, distinct (not the plan's device slots)
    starts: list[int]  # position of each item's first token in its cache
    lengths: list[int]  # tokens of each item (>= 1)
    rows: list[int]  # hidden rows whose logits the master wants
    top: int = 0  # candidates per rank and row (edge.tp.gather_logits)
    link: bool = False  # keep polling the star link for the next command

    def __post_init__(self) -> None:
        # Bounds before a worker allocates anything for these numbers (see Assign).
        def bad(name: str, why: str) -> ProtocolError:
            return ProtocolError(
                f"'batch' message: field {name!r} {why}, got {getattr(self, name)!r:.80}"
            )

        n = len(self.caches)
        if not 1 <= n <= MAX_SEQS:
            raise bad("caches", f"must name 1 to {MAX_SEQS} caches")
        if len(set(self.caches)) != n or not all(0 <= c < MAX_SEQS for c in self.caches):
            raise bad("caches", f"must be distinct ids in [0, {MAX_SEQS})")
        if len(self.starts) != n or any(s < 0 for s in self.starts):
            raise bad("starts", f"must be {n} positions >= 0")
        if len(self.lengths) != n or any(t < 1 for t in self.lengths):
            raise bad("lengths", f"must be {n} lengths >= 1")
        total = sum(self.lengths)
        if any(not 0 <= r < total for r in self.rows) or any(
            a >= b for a, b in zip(self.rows, self.rows[1:])
        ):
            raise bad("rows", f"must ascend strictly within [0, {total})")
        if self.top < 0:
            raise bad("top", "must be >= 0")


@_to_worker
@dataclass(frozen=True, kw_only=True)
class Copy(Msg):
    """Make KV cache ``dst`` hold positions 0..n-1 of cache ``src`` (a shared prompt prefix)."""

    OP: ClassVar[str] = "copy"
    epoch: int  # membership epoch it was sent in (a stale one is dropped)
    src: int
    dst: int
    n: int

    def __post_init__(self) -> None:
        for name in ("src", "dst"):
            if not 0 <= getattr(self, name) < MAX_SEQS:
                raise ProtocolError(
                    f"'copy' message: field {name!r} must be in [0, {MAX_SEQS}), "
                    f"got {getattr(self, name)!r}"
                )
        if self.src == self.dst or self.n < 0:
            raise ProtocolError(
                f"'copy' message: needs two caches and n >= 0, got {self.src} -> {self.dst}, "
                f"n {self.n}"
            )


@_to_worker
@dataclass(frozen=True, kw_only=True)
class Drop(Msg):
    """Free KV cache ``cache`` (the next batch naming it starts it empty)."""

    OP: ClassVar[str] = "drop"
    epoch: int  # membership epoch it was sent in (a stale one is dropped)
    cache: int

    def __post_init__(self) -> None:
        if not 0 <= self.cache < MAX_SEQS:
            raise ProtocolError(
                f"'drop' message: field 'cache' must be in [0, {MAX_SEQS}), got {self.cache!r}"
            )


@_to_worker
@dataclass(frozen=True, kw_only=True)
class Reset(Msg):
    """Drop every KV cache."""

    OP: ClassVar[str] = "reset"
    sync: bool = False  # also restart the star link's sequence (after a regroup)


@_to_worker
@dataclass(frozen=True, kw_only=True)
class Ping(Msg):
    """Idle health check: followed by a barrier tagged ``ping{n}``."""

    OP: ClassVar[str] = "ping"
    n: int
    epoch: int


@_to_worker
@dataclass(frozen=True, kw_only=True)
class Stats(Msg):
    """Answer the expert store's report on :func:`stats_tag` (n)."""

    OP: ClassVar[str] = "stats"
    n: int


@_to_worker
@dataclass(frozen=True, kw_only=True)
class Regroup(Msg):
    """Call quorum to form the next epoch (ignored when ``epoch`` is older than ours)."""

    OP: ClassVar[str] = "regroup"
    epoch: int


@_to_worker
@dataclass(frozen=True, kw_only=True)
class Shutdown(Msg):
    """Leave: answer ``bye`` and return."""

    OP: ClassVar[str] = "shutdown"
    reason: str | None = None  # printed by the worker (e.g. left out by the planner)


@_to_worker
@dataclass(frozen=True, kw_only=True)
class Echo(Msg):
    """Round-trip probe of the automatic split (edge.profile), answered on ``edge.echo{n}``."""

    OP: ClassVar[str] = "echo"
    n: int


@_to_worker
@dataclass(frozen=True, kw_only=True)
class Profile(Msg):
    """Profile this device (edge.profile), answered on ``edge.profile{n}``."""

    OP: ClassVar[str] = "profile"
    n: int
    dtype: str | None
    model_dir: str
    memory_mb: float | None = None


@_to_worker
@dataclass(frozen=True, kw_only=True)
class Yield(Msg):
    """(star link only) Go back to the communicator for the next command."""

    OP: ClassVar[str] = "yield"


@_to_worker
@dataclass(frozen=True, kw_only=True)
class StageAssign(Msg):
    """Pipeline layout: load decoder layers ``lo..hi-1`` of ``layers`` as stage ``stage`` and
    answer ``ready`` (edge.cluster.stage, edge.cluster.pipeline)."""

    OP: ClassVar[str] = "stage_assign"
    stage: int  # 1..S-1 (the master is stage 0)
    lo: int
    hi: int
    layers: int  # L of the model, checked against the file the worker loads
    model_dir: str  # as in assign: the worker's own --model-dir or inside it
    dtype: str | None
    op_timeout: float  # seconds
    silence_s: float  # this much silence from the master means it is gone
    # the master's star link (transport.starlink): steps and their answers travel there, on
    # the compute threads; None: over the communicator
    link_port: int | None = None
    link_secret: str | None = None
    link_spin_us: float = 0.0
    # as assign's: the stage's K-quant weights also in the batch GEMM's layout; a master that
    # predates it sends none: off
    repack: str = "off"
    # > 0: this (last) stage also holds the LM head's vocabulary rows head_lo..V-1 (the
    # master the rest) and answers a step with ``top`` > 0 with its best logits there
    head_lo: int = 0
    # True: the stage's layers mapped from the GGUF file, only its own range ever read, and
    # the embedding rows it does not hold given back (the master's memory budget sized the
    # range: edge.cluster.layout.budget_ranges); False: the model loaded whole, then cut
    mapped: bool = False
    # True (the replica layout, edge.cluster.replica): this stage holds every layer, the
    # embedding and the WHOLE LM head (head_lo 0 then names no rows) and answers steps sent
    # with ``embed`` (token ids in, the best logits or final hidden rows out)
    whole_head: bool = False
    # as assign's: the master streams the model (edge.cluster.ship) right after this message
    ship: bool = False

    def __post_init__(self) -> None:
        if self.link_port is not None and not 1 <= self.link_port <= 65535:
            raise ProtocolError("'stage_assign' message: link_port must be a TCP port")
        if self.whole_head and (self.lo != 0 or self.hi != self.layers or self.head_lo):
            raise ProtocolError(
                "'stage_assign' message: whole_head needs every layer [0, layers) and head_lo 0"
            )
        if not 0 <= self.head_lo < 1 << 24:
            raise ProtocolError("'stage_assign' message: head_lo must be in [0, 2^24)")
        if self.repack not in ("auto", "on", "off"):
            raise ProtocolError("'stage_assign' message: repack must be auto, on or off")
        if not (math.isfinite(self.link_spin_us) and 0 <= self.link_spin_us <= 1e6):
            raise ProtocolError("'stage_assign' message: link_spin_us must be in [0, 1e6]")
        if not 1 <= self.stage < MAX_WORLD:
            raise ProtocolError(f"'stage_assign' message: stage must be in [1, {MAX_WORLD})")
        if not 0 <= self.lo < self.hi <= self.layers <= 1 << 16:
            raise ProtocolError(
                f"'stage_assign' message: needs 0 <= lo < hi <= layers <= 65536, got "
                f"[{self.lo}, {self.hi}) of {self.layers}"
            )
        if not self.model_dir or "\0" in self.model_dir:
            raise ProtocolError("'stage_assign' message: model_dir must be a path without NUL")
        for name in ("op_timeout", "silence_s"):
            v = getattr(self, name)
            if not (math.isfinite(v) and v > 0):
                raise ProtocolError(f"'stage_assign' message: {name} must be finite and > 0")


@_to_worker
@dataclass(frozen=True, kw_only=True)
class StageStep(Msg):
    """Pipeline layout: run this stage's layers over a group of sequences (item i appends
    ``lengths[i]`` positions at ``starts[i]`` to cache ``caches[i]``) and send the hidden
    state back on :data:`STAGE` with a ``staged`` message of the same ``fid``."""

    OP: ClassVar[str] = "stage"
    TENSORS: ClassVar[str] = "the hidden state in (1, N, H), N = sum(lengths); embed: ids (1, N)"
    fid: int  # step id, echoed by staged
    epoch: int  # membership epoch it was sent in (a stale one is dropped)
    caches: list[int]
    starts: list[int]
    lengths: list[int]
    link: bool = False  # answer on the star link and keep polling it for the next step
    # a stage holding head rows (stage_assign's head_lo): the ``top`` best logits of each of
    # these hidden rows go back too (top 0 or no rows: none)
    top: int = 0
    rows: list[int] | None = None
    # True (replica layout, a stage of whole_head): the tensor is the token ids (1, N) float32,
    # embedded there; the answer carries no hidden state of every token, only for each of
    # ``rows`` the best ``top`` logits (values, ids (R, top)), or with top 0 its final hidden
    # row (R, H) for the master's own head; nothing when no row is asked
    embed: bool = False

    def __post_init__(self) -> None:
        n = len(self.caches)
        if not 1 <= n <= MAX_SEQS or len(set(self.caches)) != n:
            raise ProtocolError(f"'stage' message: caches must be 1 to {MAX_SEQS} distinct ids")
        if not all(0 <= c < MAX_SEQS for c in self.caches):
            raise ProtocolError(f"'stage' message: cache ids must be in [0, {MAX_SEQS})")
        if len(self.starts) != n or any(s < 0 for s in self.starts):
            raise ProtocolError(f"'stage' message: starts must be {n} positions >= 0")
        if len(self.lengths) != n or any(t < 1 for t in self.lengths):
            raise ProtocolError(f"'stage' message: lengths must be {n} lengths >= 1")
        if not 0 <= self.top < 1 << 24:
            raise ProtocolError("'stage' message: top must be in [0, 2^24)")
        N = sum(self.lengths)
        if self.rows is not None and not all(0 <= r < N for r in self.rows):
            raise ProtocolError(f"'stage' message: rows must be in [0, {N})")


@_to_master
@dataclass(frozen=True, kw_only=True)
class Ready(Msg):
    """Answer to ``assign``: loaded (``ok``) or why not (``error``)."""

    OP: ClassVar[str] = "ready"
    ok: bool
    slot: int | None = None
    error: str | None = None


@_to_master
@dataclass(frozen=True, kw_only=True)
class Bye(Msg):
    """Answer to ``shutdown``."""

    OP: ClassVar[str] = "bye"


@_to_master
@dataclass(frozen=True, kw_only=True)
class Report(Msg):
    """Answer to ``stats``: the expert store's report (None for a dense model)."""

    OP: ClassVar[str] = "report"
    report: dict | None


@_to_master
@dataclass(frozen=True, kw_only=True)
class Staged(Msg):
    """Answer to ``stage`` (on :data:`STAGE`): the hidden state leaving the stage."""

    OP: ClassVar[str] = "staged"
    # with a step's top > 0 on a stage holding head rows: then the values and token ids
    # (float32) of each asked row's best logits there
    TENSORS: ClassVar[str] = (
        "hidden (1, N, H) [, values, ids (R, top)]; embed: values, ids | rows (R, H)"
    )
    fid: int
    # an ``embed`` step (replica layout): each cache's restart floor after it
    # (KVCache.restart_floor), so the master refuses what the stage would
    floors: list[int] | None = None


# ---- decoding ------------------------------------------------------------------------------------
def decode(meta: dict) -> Msg:
    """The message ``meta`` encodes (see the module docstring); unknown extra keys are ignored."""
    if not isinstance(meta, dict):
        raise ProtocolError(f"a control message must be a dict, got {type(meta).__name__}")
    op = meta.get("op")
    if not isinstance(op, str) or (cls := MESSAGES.get(op)) is None:
        raise ProtocolError(f"unknown control op {op!r}; one of {sorted(MESSAGES)}")
    return cls.from_wire(meta)


def describe() -> str:
    """The op table of the module docstring, generated from the dataclasses."""
    return schema.describe(MESSAGES)
