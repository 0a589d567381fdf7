"""A packet-level WAN emulator: sites in network namespaces joined through TUN devices.

:mod:`.testbed` builds it (:class:`~transport.links.tun.testbed.TunTestbed`), :mod:`.forward` is
the forwarder process, :mod:`.shape` its per-direction packet model, :mod:`.probe` and
:mod:`.calibrate` measure it (``python -m transport.links.tun --calibrate --json``).
"""
