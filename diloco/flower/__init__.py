"""Federated Streaming DiLoCo on Flower (flwr >= 1.20, Message API): one round = one outer step.

* :mod:`diloco.flower.strategy` — :class:`DiLoCoStrategy`, the server's outer optimizer;
* :mod:`diloco.flower.client` — the ClientApp (inner steps, codec-encoded pseudo-gradients);
* :mod:`diloco.flower.server` — the ServerApp (evaluation, metrics, checkpoints);
* :mod:`diloco.flower.records` — lowband tensors and codec frames as Flower records (no pickle);
* :mod:`diloco.flower.config` — Flower run config → :class:`FlowerConfig`;
* :mod:`diloco.flower.inprocess` — a Grid that runs the ClientApp in this process (tests);
* :mod:`diloco.flower.federation` — app directories and a local SuperLink + SuperNodes launcher.

Needs the ``flower`` extra (``pip install lowband[flower]``). Nothing is imported here so that
``import diloco`` never needs flwr.
"""
