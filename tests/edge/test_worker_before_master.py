"""A worker that registers before its master (the master still loading a big model, or
tokenizing a 128k vocabulary) must wait for it, not settle into a group of one and then sit
in a receive from itself while the master waits for a quorum."""

from __future__ import annotations

import time

from edge.cluster import MASTER_ID_PREFIX, ClusterConfig, MasterRunner, WorkerConfig, run_worker
from edge.engine import Engine
from edge.launch import SIGNATURE, _zmq_config
from edge.sampling import SamplingParams
from lowband.models.tokenizer import ByteTokenizer
from tests.edge.test_edge_cluster import _local_engine, _Thread, ckpt  # noqa: F401 - fixture
from transport.coordinator import Coordinator, CoordinatorConfig
from transport.zmq_comm import connect


def test_a_worker_started_before_its_master_waits_for_it(ckpt) -> None:  # noqa: F811
    want = _local_engine(ckpt).complete("Hello", SamplingParams(max_tokens=6))[0]
    cfg = _zmq_config(None, 10.0, bind_host="127.0.0.1")
    with Coordinator(CoordinatorConfig(bind="tcp://127.0.0.1:0")) as coord:
        wcomm = connect(coord.address, cfg, signature=SIGNATURE, peer_id="edge-worker-1")
        worker = _Thread(lambda: run_worker(wcomm, WorkerConfig(join_timeout=30)))
        worker.start()
        runner = None
        try:
            time.sleep(2.0)  # the worker's first quorum has completed, alone
            mcomm = connect(
                coord.address, cfg, signature=SIGNATURE, peer_id=f"{MASTER_ID_PREFIX}-test"
            )
            runner = MasterRunner(
                mcomm, ckpt, ClusterConfig(devices=2, join_timeout=30, op_timeout=10.0)
            )
            eng = Engine(runner, ByteTokenizer(), model_name="m")
            assert eng.complete("Hello", SamplingParams(max_tokens=6))[0] == want
            eng.close()
        finally:
            if runner is not None:
                runner.close()
            worker.join(timeout=30)
            wcomm.close()
            if runner is not None:
                runner.comm.close()
        assert not worker.is_alive() and worker.error is None, worker.error
