"""A worker of a tensor-parallel cluster: holds one slot of the plan and serves the master's
control messages (``edge.cluster.protocol``) through the dispatch table :data:`HANDLERS`.

A malformed message (one that does not decode) never ends the worker: a broken ``assign``
is answered ``ready {ok: False}`` (the master waits for that answer), anything else is logged
and dropped. A slot that cannot be loaded (bad checkpoint, bad quantization) is answered the
same way, and the worker waits for the next assignment.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

import torch

from edge.cluster.protocol import (
    CTL,
    MASTER_ID_PREFIX,
    READY,
    STAGE,
    Assign,
    Batch,
    Bye,
    Copy,
    Drop,
    Echo,
    Forward,
    Msg,
    Ping,
    Profile,
    Ready,
    Regroup,
    Report,
    Reset,
    Shutdown,
    StageAssign,
    Staged,
    StageStep,
    Stats,
    Yield,
    decode,
    master_rank,
    stats_tag,
)
from edge.cluster.shard import (
    Tags,
    append_problem,
    load_slot,
    shard_logits,
    shard_rows_logits,
    wire_codec,
)
from edge.cluster.ship import FetchConfig, decline, receive
from edge.cluster.stage import LayerRange, Stage, load_stage
from edge.moe.serve import ExpertServeConfig
from edge.quant.formats import QuantError
from edge.shardio import LoadedShard, WindowConfig
from lowband.comm import Communicator
from lowband.errors import (
    CommClosed,
    ConfigError,
    LowbandError,
    PeerLost,
    ProtocolError,
    TransportTimeout,
)
from lowband.models.llama import KVCache, Span
from transport.starlink import StarSpoke

logger = logging.getLogger(__name__)

Tensors = list[torch.Tensor]  # what travels beside a message's meta


@dataclass(frozen=True, kw_only=True)
class WorkerConfig:
    """A worker device."""

    # The one model (directory, split dir or GGUF file) this worker serves: an assign naming
    # a path outside it is answered ``ok: False``. None only for ranks that are threads of the
    # master's own process (loopback): they load the master's path. A networked worker
    # (edge.launch.ServeWorkerConfig, ``lowband edge worker --model-dir``) must set it.
    model_dir: str | None = None
    join_timeout: float = 600.0
    master_host: str = "127.0.0.1"  # where the master's star link is (its --master host)
    # Where a model the master ships (assign.ship, edge.cluster.ship) is kept and verified;
    # None: this worker takes no shipment (it has --model-dir)
    cache_dir: str | None = None
    cache_budget_mb: float = 0.0  # refuse a shipped model larger than this; 0: no bound


@dataclass
class WorkerState:
    shard: LoadedShard | None = None
    link: StarSpoke | None = None
    silence_s: float | None = None  # from the master's assign message
    # One KV cache per sequence the master batches (the engine's cache ids; ``forward`` uses
    # 0), made on first use. Every rank runs the same batches, copies and drops, so each cache
    # holds the same positions as the master's of that id (MasterRunner.slot_length).
    caches: dict[int, KVCache] = field(default_factory=dict)
    tags: Tags = field(default_factory=Tags)
    forwards: int = 0
    on_link: bool = False  # the next command comes on the star link (see MasterRunner.forward)
    stage: Stage | None = None  # pipeline layout: this worker's layers (edge.cluster.pipeline)
    stage_key: tuple[str, StageAssign] | None = None  # what ``stage`` holds (_stage_key)

    def cache(self, i: int) -> KVCache:
        c = self.caches.get(i)
        if c is None and self.stage is not None:
            c = self.caches[i] = self.stage.new_cache()  # (only the stage's layers)
        if c is None:
            if self.shard is None:
                raise ConfigError("worker", "forward before assign")
            c = self.caches[i] = self.shard.model.new_cache()
        return c


def _regroup(comm: Communicator, cfg: WorkerConfig, *, rejoining: bool = False) -> None:
    """Join the next epoch. A quorum can itself fail while the group is changing (e.g. a peer
    lost notice arrives during it), so retry until ``join_timeout``. ``rejoining``: a quorum
    that fails naming this very peer means it cannot come back (a communicator that rejoins
    holds the quorum until it is registered again instead): give up at once."""
    deadline = time.monotonic() + cfg.join_timeout
    while True:
        try:
            comm.quorum(min_world=1, timeout=min(10.0, max(0.1, deadline - time.monotonic())))
            return
        except (PeerLost, TransportTimeout) as exc:
            if time.monotonic() >= deadline or (
                rejoining and isinstance(exc, PeerLost) and comm.membership.peer_id in exc.peers
            ):
                raise
            logger.info("worker: quorum not complete yet (%s); retrying", exc)


def _has_master(comm: Communicator) -> bool:
    return any(p.startswith(MASTER_ID_PREFIX) for p in comm.membership.peers)


def _regroup_with_master(comm: Communicator, cfg: WorkerConfig, *, rejoining: bool = False) -> None:
    """Regroup, then, if the master is not in the new group (it was the peer declared lost and
    is registering again), keep joining quorum rounds until it is: a worker without its master
    would wait on itself. Bounded by ``join_timeout``."""
    had_master = _has_master(comm)
    _regroup(comm, cfg, rejoining=rejoining)
    _regroup_until(
        comm,
        cfg,
        lambda: not had_master or _has_master(comm),
        "the master did not come back",
        rejoining=rejoining,
    )


def _regroup_until(
    comm: Communicator, cfg: WorkerConfig, ready, what: str, *, rejoining: bool = False
) -> None:
    """Join quorum rounds until ``ready()``; ``PeerLost`` ("``what`` within ...") after
    ``join_timeout``."""
    deadline = time.monotonic() + cfg.join_timeout
    while not ready():
        if time.monotonic() > deadline:
            raise PeerLost(f"{what} within {cfg.join_timeout:.0f}s")
        time.sleep(0.2)
        _regroup(comm, cfg, rejoining=rejoining)


def run_worker(comm: Communicator, cfg: WorkerConfig) -> int:
    """Serve the master until it says shutdown (returns 0) or disappears (raises PeerLost)."""
    comm.quorum(min_world=1, timeout=cfg.join_timeout)
    # Registered before the master (which may still be loading a big model): a group of this
    # worker alone would have it wait on itself, and the master's quorum for the whole
    # cluster would never see it again. Join quorum rounds until another peer is there (the
    # master by its id; in a loopback group of tests, rank 0).
    _regroup_until(
        comm,
        cfg,
        lambda: _has_master(comm) or len(comm.membership.peers) >= 2,
        "no master joined",
    )
    st = WorkerState()
    try:
        while True:
            src = master_rank(comm.membership.peers)
            # One receive per message, never re-posted after a timeout: the transport numbers
            # the uses of a tag, so an abandoned receive would shift every later match. A
            # timeout therefore ends the worker.
            wait = st.silence_s or cfg.join_timeout
            if st.on_link:  # (only ever set with a link)
                _next_on_link(comm, cfg, st, wait)
                continue
            try:
                tensors, meta = comm.recv(src, tag=CTL, timeout=wait)
            except TransportTimeout:
                raise PeerLost(
                    f"no word from the master for {wait:.0f}s: it is gone or stuck"
                ) from None
            except PeerLost as exc:
                # This worker was declared lost (it was paused) and is rejoining, or the master
                # was (and is rejoining): either way the group re-forms at the next quorum,
                # where the master re-assigns or regroups (bounded by join_timeout).
                _regroup_after(comm, cfg, st, exc, rejoining=True)
                logger.warning("worker: rejoined the group (epoch %d)", comm.membership.epoch)
                continue
            try:
                msg = _decode_or_answer(comm, meta)
                if msg is not None and not isinstance(msg, Shutdown):
                    _dispatch(comm, cfg, st, msg, tensors)
            except (PeerLost, TransportTimeout, ProtocolError) as exc:
                _failed_step(comm, cfg, st, exc)
                continue
            if isinstance(msg, Shutdown):  # (outside the try: a master gone meanwhile ends us)
                _dispatch(comm, cfg, st, msg, tensors)
                return 0
    finally:
        if st.stage is not None:
            st.stage.close()
        if st.shard is not None:
            st.shard.close()
        if st.link is not None:
            st.link.close()


def _decode_or_answer(comm: Communicator, meta: Any) -> Msg | None:
    """The message ``meta`` encodes, or None for one that does not decode: logged and dropped,
    except a broken ``assign``, which is answered ``ready {ok: False}`` (the master waits)."""
    try:
        return decode(meta)
    except ProtocolError as exc:
        logger.warning("worker: dropping a malformed control message: %s", exc)
        if isinstance(meta, dict) and meta.get("op") == Assign.OP:
            answer = Ready(ok=False, error=f"malformed assign message: {exc}")
            comm.send(master_rank(comm.membership.peers), [], answer.encode(), tag=READY)
        return None


def _dispatch(
    comm: Communicator, cfg: WorkerConfig, st: WorkerState, msg: Msg, tensors: Tensors
) -> None:
    """Run ``msg``'s handler. A forward that says so keeps the worker polling its star link."""
    handler = HANDLERS.get(msg.OP)
    if handler is None:  # an answer (ready, bye, report) sent the wrong way
        logger.warning("worker: ignoring a %r message, which workers do not handle", msg.OP)
        return
    handler(comm, cfg, st, msg, tensors)
    st.on_link = isinstance(msg, (Forward, Batch, StageStep)) and msg.link and st.link is not None


def _next_on_link(comm: Communicator, cfg: WorkerConfig, st: WorkerState, wait: float) -> None:
    """Serve the master's next command from the star link: a forward or a batch (then keep
    polling the link) or "yield" (back to the communicator). A broken link or an ABORT is a failed
    forward: regroup, as in :func:`run_worker`; silence for ``wait`` ends the worker, as the
    communicator's does."""
    assert st.link is not None
    try:
        tensors, meta = st.link.next_command(wait)
    except TransportTimeout:  # (raised past the clause below: ends the worker)
        raise PeerLost(f"no word from the master for {wait:.0f}s: it is gone or stuck") from None
    except (PeerLost, ProtocolError) as exc:
        # like a failed receive from the communicator: this worker may be the one declared lost
        _failed_step(comm, cfg, st, exc, rejoining=True)
        return
    try:
        msg = decode(meta)
    except ProtocolError as exc:
        logger.warning("worker: dropping a malformed link command: %s", exc)
        msg = Yield()  # back to the communicator, as for any command but a forward
    if not isinstance(msg, (Forward, Batch, StageStep)):
        st.on_link = False
        return
    try:
        _dispatch(comm, cfg, st, msg, tensors)
    except (PeerLost, TransportTimeout, ProtocolError) as exc:
        _failed_step(comm, cfg, st, exc)


def _failed_step(
    comm: Communicator,
    cfg: WorkerConfig,
    st: WorkerState,
    exc: Exception,
    *,
    rejoining: bool = False,
) -> None:
    """A step failed or the link broke. A tensor-parallel slot regroups at once (its master
    does too, :func:`_regroup_after`). A pipeline stage drops its link and caches, keeps its
    layers and goes back to the communicator, where the master that re-forms the pipeline
    says ``regroup`` and assigns the stage again (``edge.cluster.pipeline``); a master that is
    gone shows there as a lost peer (then :func:`run_worker` regroups and waits for it)."""
    if st.stage is None or st.shard is not None:  # (a slot assigned since a stage)
        _regroup_after(comm, cfg, st, exc, rejoining=rejoining)
        return
    logger.warning("worker: stage step failed (%s); waiting for the master to re-form", exc)
    st.on_link = False
    if st.link is not None:
        st.link.close()
    st.link = None
    st.caches.clear()


def _regroup_after(
    comm: Communicator,
    cfg: WorkerConfig,
    st: WorkerState,
    exc: Exception,
    *,
    rejoining: bool = False,
) -> None:
    """A forward failed (a peer died, or the master aborted): form the next epoch with whoever
    is left, the master included (it may itself be the one that was lost and is rejoining)."""
    st.on_link = False
    logger.warning("worker: %s; regrouping", exc)
    _regroup_with_master(comm, cfg, rejoining=rejoining)
    st.caches.clear()


# ---- the handlers: one per op the master sends ---------------------------------------------------
def _forward(
    comm: Communicator, cfg: WorkerConfig, st: WorkerState, msg: Forward, tensors: Tensors
) -> None:
    if msg.epoch != comm.membership.epoch:
        return  # sent before a regroup this worker already went through: stale
    if st.shard is None:
        raise ConfigError("worker", "forward before assign")
    if len(tensors) != 1:
        raise ProtocolError(f"a forward carries one tensor, got {len(tensors)}")
    st.tags.start(msg.fid)
    with torch.inference_mode():
        h = st.shard.model.forward_layers(tensors[0], cache=st.cache(0), start=msg.start)
        shard_logits(st.shard, h, msg.top)
    st.forwards += 1


def _ragged_spans(
    st: WorkerState, msg: Batch | StageStep, tensors: Tensors, hidden: int, what: str
) -> list[Span]:
    """The cache spans of a ragged pass (a tensor-parallel batch or a pipeline stage step:
    ``what``), after checking that it carries one (1, sum(lengths), hidden) tensor and that each
    item appends where its cache ends."""
    if len(tensors) != 1 or tuple(tensors[0].shape) != (1, sum(msg.lengths), hidden):
        shapes = [tuple(t.shape) for t in tensors]
        raise ProtocolError(f"a {what} of {sum(msg.lengths)} tokens carries tensors {shapes}")
    item = what.split()[0]  # "batch item", "stage item"
    for c, start in zip(msg.caches, msg.starts):
        why = append_problem(st.caches.get(c), start)
        if why is not None:  # the master checked its own copy: we are out of step with it
            raise ProtocolError(f"{item} item on cache {c} {why}")
    return [Span(st.cache(c), s, n) for c, s, n in zip(msg.caches, msg.starts, msg.lengths)]


def _batch(
    comm: Communicator, cfg: WorkerConfig, st: WorkerState, msg: Batch, tensors: Tensors
) -> None:
    """Continuous batching: one ragged pass over every item's cache (two all-reduces per
    layer for the whole batch), then the wanted rows through the head in one exchange."""
    if msg.epoch != comm.membership.epoch:
        return  # sent before a regroup this worker already went through: stale
    if st.shard is None:
        raise ConfigError("worker", "batch before assign")
    spans = _ragged_spans(st, msg, tensors, st.shard.model.config.hidden_size, "batch")
    st.tags.start(msg.fid)
    with torch.inference_mode():
        h = st.shard.model.forward_ragged(tensors[0], spans)
        if msg.rows:
            shard_rows_logits(st.shard, h[0, msg.rows], msg.top)
    st.forwards += 1


def _copy(comm: Communicator, cfg: WorkerConfig, st: WorkerState, msg: Copy, _: Tensors) -> None:
    if msg.epoch != comm.membership.epoch:
        return  # stale: the regroup since dropped every cache anyway
    src = st.caches.get(msg.src)
    try:
        if src is None:
            raise RuntimeError("the source cache is empty")
        st.cache(msg.dst).copy_prefix(src, msg.n)
    except RuntimeError as exc:  # the master's copy succeeded: we are out of step with it
        st.caches.pop(msg.dst, None)
        raise ProtocolError(f"copy of {msg.n} positions from cache {msg.src}: {exc}") from None


def _drop(comm: Communicator, cfg: WorkerConfig, st: WorkerState, msg: Drop, _: Tensors) -> None:
    if msg.epoch == comm.membership.epoch:  # (a stale one: the regroup dropped it already)
        st.caches.pop(msg.cache, None)


def _assign(
    comm: Communicator, cfg: WorkerConfig, st: WorkerState, msg: Assign, _: Tensors
) -> None:
    """Load the slot and answer ``ready``; a slot that cannot be loaded is answered
    ``ok: False`` with the reason (the master reports it), and this worker waits on."""
    master = master_rank(comm.membership.peers)
    try:
        _load_assigned(comm, cfg, st, msg)
    except (TransportTimeout, ProtocolError, CommClosed):
        raise  # the network, not the slot: regroup (run_worker) or end
    except (LowbandError, QuantError, OSError, RuntimeError) as exc:
        logger.warning("worker: cannot load slot %d: %s", msg.slot, exc)
        comm.send(master, [], Ready(ok=False, error=str(exc)).encode(), tag=READY)
        return
    comm.send(master, [], Ready(ok=True, slot=msg.slot).encode(), tag=READY)


def served_path(assigned: str, own: str | None) -> str:
    """The path an ``assign`` naming ``assigned`` loads on a worker serving ``own``.

    Both are made absolute and normalised (``..`` and symbolic links resolved) before the
    check, so neither ``own/../secret`` nor a link out of ``own`` passes: the result is ``own``
    itself or a path inside it, else a :class:`ConfigError` naming both.
    """
    if own is None:
        return assigned  # a thread of the master's own process (see WorkerConfig.model_dir)
    allowed, target = Path(own).resolve(), Path(assigned).resolve()
    if target != allowed and allowed not in target.parents:
        raise ConfigError(
            "model_dir",
            f"the master asked for {assigned!r}, but this worker serves only {own!r} "
            "(its --model-dir): give the master and its workers the same model path",
        )
    return str(target)


def assigned_model(comm: Communicator, cfg: WorkerConfig, assigned: str, ship: bool) -> str:
    """The path an assignment loads: the master's shipment, fetched into ``cache_dir`` where it
    ships one, else ``assigned`` checked by :func:`served_path`."""
    if not ship:
        return served_path(assigned, cfg.model_dir)
    master = master_rank(comm.membership.peers)
    if cfg.cache_dir is None:
        decline(comm, master, timeout=cfg.join_timeout)
        raise ConfigError(
            "cache_dir",
            "the master ships the model (--ship): start this worker with --cache-dir DIR",
        )
    fc = FetchConfig(cache_dir=Path(cfg.cache_dir), budget_mb=cfg.cache_budget_mb)
    report = receive(comm, master, fc, timeout=cfg.join_timeout)
    logger.info("worker: model %s (%d bytes fetched)", report.model, report.fetched_bytes)
    return str(report.model)


def _load_assigned(comm: Communicator, cfg: WorkerConfig, st: WorkerState, msg: Assign) -> None:
    # before anything is closed or dialled
    model_dir = assigned_model(comm, cfg, msg.model_dir, msg.ship)
    if st.shard is not None:
        st.shard.close()
        st.shard = None
    win = None
    if msg.window is not None or msg.memory_budget_mb is not None:
        win = WindowConfig(window=msg.window, memory_budget_mb=msg.memory_budget_mb)
    if st.link is not None:
        st.link.close()
        st.link = None
    st.link = _spoke(cfg, msg, msg.slot)
    st.shard = load_slot(
        model_dir,
        msg.slot,
        msg.world,
        msg.weights,
        msg.dtype,
        st.link or comm,
        wire_codec(msg.wire),
        msg.algorithm,
        msg.op_timeout,
        win,
        st.tags,
        ExpertServeConfig.from_dict(msg.experts) if msg.experts else None,
        msg.repack,  # (a worker's own free memory decides "auto")
    )
    st.caches.clear()  # (shaped for the slice this worker held before)
    st.silence_s = msg.silence_s or cfg.join_timeout


def _reset(comm: Communicator, cfg: WorkerConfig, st: WorkerState, msg: Reset, _: Tensors) -> None:
    st.caches.clear()
    if msg.sync and st.link is not None:
        st.link.resync(timeout=30.0)


def _ping(comm: Communicator, cfg: WorkerConfig, st: WorkerState, msg: Ping, _: Tensors) -> None:
    if msg.epoch != comm.membership.epoch:
        return  # sent before a regroup this worker already went through: stale
    comm.barrier(tag=f"ping{msg.n}", timeout=30.0)


def _stats(comm: Communicator, cfg: WorkerConfig, st: WorkerState, msg: Stats, _: Tensors) -> None:
    report = st.shard.store_report() if st.shard is not None else None
    comm.send(
        master_rank(comm.membership.peers), [], Report(report=report).encode(), tag=stats_tag(msg.n)
    )


def _profile(
    comm: Communicator, cfg: WorkerConfig, st: WorkerState, msg: Echo | Profile, _: Tensors
) -> None:
    """``echo`` and ``profile``: the automatic split (edge.profile)."""
    from edge.profile import answer

    model_dir = cfg.model_dir or (msg.model_dir if isinstance(msg, Profile) else None)
    answer(comm, master_rank(comm.membership.peers), msg.encode(), model_dir)


def _regroup_op(
    comm: Communicator, cfg: WorkerConfig, st: WorkerState, msg: Regroup, _: Tensors
) -> None:
    if msg.epoch >= comm.membership.epoch:  # ignore a stale request
        _regroup(comm, cfg)
        st.caches.clear()


def _shutdown(
    comm: Communicator, cfg: WorkerConfig, st: WorkerState, msg: Shutdown, _: Tensors
) -> None:
    if msg.reason:
        print(f"lowband edge worker: {msg.reason}", flush=True)
    comm.send(master_rank(comm.membership.peers), [], Bye().encode(), tag=READY)


def _yield(comm: Communicator, cfg: WorkerConfig, st: WorkerState, msg: Yield, _: Tensors) -> None:
    st.on_link = False  # (normally seen on the link itself, see _next_on_link)


def _spoke(cfg: WorkerConfig, msg: Assign | StageAssign, slot: int) -> StarSpoke | None:
    """The star link to the master as slot ``slot`` that an assignment names (None without)."""
    if msg.link_port is None:
        return None
    secret, spin_s = msg.link_secret or "", msg.link_spin_us * 1e-6
    return StarSpoke(
        cfg.master_host, msg.link_port, slot, msg.op_timeout, secret=secret, spin_s=spin_s
    )


def _stage_key(msg: StageAssign, model_dir: str) -> tuple[str, StageAssign]:
    """What a loaded stage is (its file and assignment, the link's port and secret aside):
    an assignment with the same key, as a re-formed pipeline sends, keeps the stage."""
    return model_dir, replace(msg, link_port=None, link_secret=None)


def _kept_stage(st: WorkerState, msg: StageAssign, model_dir: str) -> Stage | None:
    """Close the link, drop the caches and return the loaded stage where ``msg`` assigns it
    again (:func:`_stage_key`); else close it too (the new one is loaded after: the peak
    memory of one stage) and return None."""
    if st.link is not None:
        st.link.close()
    st.link = None
    st.caches.clear()
    if st.stage is not None and st.stage_key == _stage_key(msg, model_dir):
        logger.info("worker: stage %d assigned again: keeping its layers", msg.stage)
        return st.stage
    for held in (st.stage, st.shard):
        if held is not None:
            held.close()
    st.stage = st.shard = st.stage_key = None
    return None


def _stage_assign(
    comm: Communicator, cfg: WorkerConfig, st: WorkerState, msg: StageAssign, _: Tensors
) -> None:
    """Pipeline and replica layouts: load the assigned layers (a shipped model first, when
    the master ships it) and answer ``ready`` (as ``_assign``)."""
    master = master_rank(comm.membership.peers)
    try:
        model_dir = assigned_model(comm, cfg, msg.model_dir, msg.ship)
        kept = _kept_stage(st, msg, model_dir)
        st.stage = kept or load_stage(
            model_dir,
            LayerRange(msg.lo, msg.hi, msg.layers),
            msg.dtype,
            msg.repack,
            head_lo=msg.head_lo,
            window=WindowConfig(window=msg.hi - msg.lo) if msg.mapped else None,
            whole_head=msg.whole_head,
        )
        st.stage_key = _stage_key(msg, model_dir)
        st.link = _spoke(cfg, msg, msg.stage)
    except (TransportTimeout, ProtocolError, CommClosed):
        raise  # the network, not the stage: regroup (run_worker) or end
    except (LowbandError, QuantError, OSError, RuntimeError) as exc:
        logger.warning("worker: cannot load stage %d: %s", msg.stage, exc)
        comm.send(master, [], Ready(ok=False, error=str(exc)).encode(), tag=READY)
        return
    st.silence_s = msg.silence_s
    comm.send(master, [], Ready(ok=True, slot=msg.stage).encode(), tag=READY)


def _stage_step(
    comm: Communicator, cfg: WorkerConfig, st: WorkerState, msg: StageStep, tensors: Tensors
) -> None:
    """Pipeline layout: this stage's layers over one group; the hidden state goes back."""
    if msg.epoch != comm.membership.epoch:
        return  # sent before a regroup this worker already went through: stale
    if st.stage is None:
        raise ProtocolError("a stage step before stage_assign")
    if msg.embed:
        _replica_step(comm, st, st.stage, msg, tensors)
        return
    spans = _ragged_spans(st, msg, tensors, st.stage.model.config.hidden_size, "stage step")
    h = st.stage.run(tensors[0], spans)
    out = [h]
    if msg.top > 0 and msg.rows and st.stage.head is not None:  # its rows of a split head
        out.extend(st.stage.top_logits(h[0, msg.rows], msg.top))
    answer = Staged(fid=msg.fid).encode()
    if msg.link and st.link is not None:
        st.link.reply(answer, out, timeout=st.silence_s)
    else:
        comm.send(master_rank(comm.membership.peers), out, answer, tag=STAGE)
    st.forwards += 1


def _replica_step(
    comm: Communicator, st: WorkerState, stage: Stage, msg: StageStep, tensors: Tensors
) -> None:
    """Replica layout: the token ids through the embedding, every layer and the whole head;
    the answer: the best ``top`` logits of each asked row (or its final hidden state when
    every logit is wanted: the master's head), and every cache's restart floor."""
    N = sum(msg.lengths)
    if not stage.whole_head:
        raise ProtocolError("a replica step to a stage without the whole head")
    if len(tensors) != 1 or tuple(tensors[0].shape) != (1, N):
        shapes = [tuple(t.shape) for t in tensors]
        raise ProtocolError(f"a replica step of {N} tokens carries tensors {shapes}")
    ids = tensors[0].long()  # (float32 on the link: exact below 2^24)
    V = stage.model.config.vocab_size
    if (
        not torch.equal(ids.to(tensors[0].dtype), tensors[0])
        or not (0 <= ids).all()
        or (ids >= V).any()
    ):
        raise ProtocolError(f"a replica step names token ids outside [0, {V})")
    for c, start in zip(msg.caches, msg.starts):
        why = append_problem(st.caches.get(c), start)
        if why is not None:  # the master checked its record of the cache: out of step
            raise ProtocolError(f"replica item on cache {c} {why}")
    spans = [Span(st.cache(c), s, n) for c, s, n in zip(msg.caches, msg.starts, msg.lengths)]
    with torch.inference_mode():
        h = stage.run(stage.model.embed(ids), spans)
    rows = msg.rows or []
    out: Tensors = []
    if rows and msg.top > 0:
        out.extend(stage.top_logits(h[0, rows], msg.top))
    elif rows:
        out.append(h[0, rows].contiguous())
    floors = [st.caches[c].restart_floor() for c in msg.caches]
    answer = Staged(fid=msg.fid, floors=floors).encode()
    if msg.link and st.link is not None:
        st.link.reply(answer, out, timeout=st.silence_s)
    else:
        comm.send(master_rank(comm.membership.peers), out, answer, tag=STAGE)
    st.forwards += 1


Handler = Callable[[Communicator, WorkerConfig, WorkerState, Any, Tensors], None]

# op -> handler; a test checks that these are exactly the ops the master sends
HANDLERS: dict[str, Handler] = {
    Assign.OP: _assign,
    Forward.OP: _forward,
    Batch.OP: _batch,
    Copy.OP: _copy,
    Drop.OP: _drop,
    Reset.OP: _reset,
    Ping.OP: _ping,
    Stats.OP: _stats,
    Regroup.OP: _regroup_op,
    Shutdown.OP: _shutdown,
    Echo.OP: _profile,
    Profile.OP: _profile,
    Yield.OP: _yield,
    StageAssign.OP: _stage_assign,
    StageStep.OP: _stage_step,
}
