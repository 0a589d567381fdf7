"""Federated Streaming DiLoCo on Flower (Message API; tested with flwr 1.41): one round = one
outer step of one fragment.

* :mod:`diloco.flower.strategy` — :class:`DiLoCoStrategy`, the server's outer optimizer;
* :mod:`diloco.flower.client` — the ClientApp (inner steps, codec-encoded pseudo-gradients);
* :mod:`diloco.flower.server` — the ServerApp (evaluation, metrics, checkpoints);
* :mod:`diloco.flower.records` — lowband tensors and codec frames as Flower records (no pickle);
* :mod:`diloco.flower.config` — Flower run config → :class:`FlowerConfig`;
* :mod:`diloco.flower.app` — the app directory ``flwr run`` submits (``lowband flower new``);
* :mod:`diloco.flower.federation` — a local SuperLink + SuperNodes launcher, ``flwr run``;
* :mod:`diloco.flower.inprocess` — a Grid that runs the ClientApp in this process (tests);
* :mod:`benchmarks.flower` — FedAvg vs DiLoCo, codecs and fragments, measured.

Needs the ``flower`` extra (``pip install lowband[flower]``). Nothing is imported here so that
``import diloco`` never needs flwr.
"""
