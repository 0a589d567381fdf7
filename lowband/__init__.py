"""lowband: train and serve language models where the network is the bottleneck.

The distribution ships five packages, each a layer (ARCHITECTURE.md):

* ``lowband``   – the core: typed errors, the Communicator Protocol that algorithms program
                  against, wire codecs, process helpers; ``lowband.models`` (the Llama family,
                  shared by training and inference).
* ``transport`` – ZeroMQ WAN transport, coordinator, slow-link testbeds, in-process loopback group.
* ``diloco``    – Streaming DiLoCo trainer and DDP baseline.
* ``edge``      – Llama-family inference runtime with tensor parallelism and weight streaming.
* ``cli``       – the ``lowband`` command line, on top of all of them.
"""

from pathlib import Path

__version__ = "0.1.0"

SAMPLE_TEXT = Path(__file__).resolve().parent / "data" / "shakespeare_sample.txt"
"""The ~1 MB public-domain Shakespeare sample shipped with the package (see data/README.md)."""
