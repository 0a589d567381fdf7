"""transport: moving tensors between peers over slow networks (a top-level package).

Implementations of :class:`lowband.comm.Communicator`:

* :mod:`transport.loopback` – ranks as threads in one process (tests, docs, algorithm work).
* :mod:`transport.zmq_comm` – ZeroMQ over TCP with K striped connections per peer pair
  (``connect``, ``ZmqConfig``), managed by :mod:`transport.coordinator`.

Inside the ZeroMQ communicator: :mod:`transport.wire` (message format); :mod:`transport.reactor`
(the ``Reactor``: the thread that owns every socket), composed of :mod:`transport.peerlinks`
(sockets, striping, heartbeats), :mod:`transport.routing` (operations, early messages, deadlines)
and :mod:`transport.members` (peer table, lost peers, quorum, rejoining); :mod:`transport.ops`,
:mod:`transport.allreduce`, :mod:`transport.messages` and :mod:`transport.shm` (collectives);
:mod:`transport.auth` (CURVE / token); :mod:`transport.buffers` (result pool).
:mod:`transport.starlink` is a latency-first star all-reduce for tensor-parallel decoding (edge).
Tools: :mod:`transport.links.emulator` (user-space WAN link), :mod:`transport.links.netns`
(tbf-shaped namespaces), :mod:`transport.links.model` (modelled link), :mod:`transport.launch`;
the benchmarks live in the checkout's ``benchmarks.transport``.

Importing this package is cheap; submodules are imported on demand.
"""
