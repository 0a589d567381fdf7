"""lowband: train and serve language models where the network is the bottleneck.

The distribution ships four packages:

* ``lowband``   – the shared kernel: typed errors, the communicator Protocols that algorithms
                  program against, wire codecs, and the ``lowband`` command line (composition root).
* ``transport`` – ZeroMQ WAN transport, coordinator, link emulator, in-process loopback communicator.
* ``diloco``    – Streaming DiLoCo trainer and DDP baseline.
* ``edge``      – Llama-family inference runtime with tensor parallelism and weight streaming.
"""

__version__ = "0.1.0"
