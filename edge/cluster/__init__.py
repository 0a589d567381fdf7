"""A tensor-parallel cluster over a :class:`lowband.comm.Communicator`: master and workers.

The master (rank 0 of the first epoch) holds slot 0 of the plan (which includes embedding,
final norm and LM head), tokenises, samples and serves HTTP. Workers hold slots 1..N-1 and
only run decoder layers. Per forward pass the master sends the embedded tokens to every
worker (star, ``send``/``recv`` on the ``edge.ctl`` tag) and all ranks run their layers with
two all-reduces per layer (the ``reduce`` hooks installed by ``edge.tp.shard``).

Continuous batching (``edge.engine``): every rank keeps one KV cache per sequence of the
engine. A step of many sequences is one ``batch`` message (each sequence's cache, start and
length, and the rows whose logits the master wants), one ragged pass per rank with the same
two all-reduces per layer carrying the whole batch, and one exchange of the vocabulary-parallel
head for all wanted rows. ``copy`` and ``drop`` keep the caches the same on every rank; a
regroup drops them all (the engine then recomputes).

Slots are not comm ranks: a sum does not care who contributes what, so after a failure the
survivors keep their slots and a returning worker is assigned the missing one.

Modules, split by the state they own::

    protocol  the control messages (one dataclass per op), their tags, who the master is
    shard     what both sides do with their slice: load it, tag and encode its all-reduces,
              compute the logits of the vocabulary-parallel head
    master    ClusterConfig and MasterRunner (slot 0, the engine's runner)
    worker    WorkerConfig, run_worker and its dispatch table of handlers
    stage     the pipeline layout's stage: a contiguous range of layers and their caches
    pipeline  PipelineRunner: the master (stage 0) of a pipeline, micro-batches in flight
    layout    pure schedules of the pipeline: stage ranges, micro-batches
    choose    start_runner: the layout --layout asks for (auto: measured, edge.planner)

Failure handling: a dead worker makes the master's all-reduce raise ``PeerLost`` (or a
deadline raise ``TransportTimeout``); the request fails with :class:`ClusterUnavailable`, the
master marks itself unhealthy and a recovery thread asks survivors to regroup and calls
``quorum(min_world=N)`` until the group is whole again (a restarted worker joins it), then
assigns the missing slot. All-reduces are tagged ``f{fid}.{k}`` so a half-finished forward of
an old epoch can never be matched with a new one.
"""

from edge.cluster.master import ClusterConfig, MasterRunner
from edge.cluster.protocol import CTL, MASTER_ID_PREFIX, READY, master_rank
from edge.cluster.shard import WIRE_CODECS, check_experts, shard_logits, wire_codec
from edge.cluster.worker import WorkerConfig, WorkerState, run_worker

__all__ = [
    "CTL",
    "MASTER_ID_PREFIX",
    "READY",
    "WIRE_CODECS",
    "ClusterConfig",
    "MasterRunner",
    "WorkerConfig",
    "WorkerState",
    "check_experts",
    "master_rank",
    "run_worker",
    "shard_logits",
    "wire_codec",
]
