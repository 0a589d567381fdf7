"""lowband.transport: moving tensors between peers over slow networks.

Implementations of :class:`lowband.comm.Communicator`:

* :mod:`transport.loopback` – ranks as threads in one process (tests, docs, algorithm work).
* :mod:`transport.zmq_comm` – ZeroMQ over TCP with K striped connections per peer pair.

Importing this package is cheap; submodules are imported on demand.
"""
