"""The user-space WAN link emulator (tier 3: real sockets on 127.0.0.1)."""

from __future__ import annotations

import socket
import threading
import time

import pytest
import torch

from lowband.errors import ConfigError
from tests.conftest import run_ranks
from transport.coordinator import Coordinator, CoordinatorConfig
from transport.links.emulator import LinkConfig, LinkEmulator, emulated_config
from transport.zmq_comm import ZmqConfig, connect

pytestmark = pytest.mark.timeout(90)


def test_link_config_validation_and_flow_cap():
    with pytest.raises(ConfigError, match="rate_mbit"):
        LinkConfig(rate_mbit=0)
    with pytest.raises(ConfigError, match="window_bytes"):
        LinkConfig(window_bytes=10)
    link = LinkConfig(rate_mbit=1000, delay_ms=50, window_bytes=256 * 1024)
    assert link.flow_cap_mbit() == pytest.approx(256 * 1024 * 8 / 0.1 / 1e6)
    assert LinkConfig(rate_mbit=10, delay_ms=50, window_bytes=1 << 30).flow_cap_mbit() == 10


class _Sink:
    """A TCP server that counts (or echoes) what it receives."""

    def __init__(self, echo: bool) -> None:
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        self.echo = echo
        self.received = bytearray()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.server.accept()
            except OSError:
                return
            threading.Thread(target=self._conn, args=(conn,), daemon=True).start()

    def _conn(self, conn: socket.socket) -> None:
        with conn:
            while data := conn.recv(65536):
                if self.echo:
                    conn.sendall(data)
                else:
                    self.received += data

    def close(self) -> None:
        self.server.close()


def test_relay_delivers_every_byte_in_order_and_applies_the_delay():
    sink = _Sink(echo=True)
    link = LinkConfig(rate_mbit=200, delay_ms=30, window_bytes=64 * 1024)
    payload = bytes(range(256)) * 2000  # 512 KB, larger than the window
    try:
        with LinkEmulator(("127.0.0.1", sink.port), link) as emu:
            with socket.create_connection(("127.0.0.1", emu.port)) as s:
                t0 = time.perf_counter()
                s.sendall(b"x")
                assert s.recv(1) == b"x"
                rtt = time.perf_counter() - t0
                got = bytearray()
                sender = threading.Thread(target=s.sendall, args=(payload,))
                sender.start()
                while len(got) < len(payload):
                    chunk = s.recv(65536)
                    assert chunk
                    got += chunk
                sender.join(30)
            assert bytes(got) == payload
            assert rtt >= 2 * link.delay  # a round trip crosses the link twice
            assert emu.bytes["up"] == emu.bytes["down"] == len(payload) + 1
    finally:
        sink.close()


def _transfer_seconds(k: int, link: LinkConfig, nbytes: int) -> float:
    sink = _Sink(echo=False)
    data = b"\0" * (nbytes // k)
    try:
        with LinkEmulator(("127.0.0.1", sink.port), link) as emu:
            socks = [socket.create_connection(("127.0.0.1", emu.port)) for _ in range(k)]
            t0 = time.perf_counter()
            threads = [threading.Thread(target=s.sendall, args=(data,)) for s in socks]
            for t in threads:
                t.start()
            for t in threads:
                t.join(60)
            while len(sink.received) < len(data) * k and time.perf_counter() - t0 < 60:
                time.sleep(0.005)
            elapsed = time.perf_counter() - t0
            for s in socks:
                s.close()
        assert len(sink.received) == len(data) * k
        return elapsed
    finally:
        sink.close()


def test_window_caps_one_flow_and_parallel_connections_add_up():
    # One flow: 64 KiB per 40 ms round trip = 1.6 MB/s; the link allows 80 Mbit/s = 10 MB/s.
    link = LinkConfig(rate_mbit=80, delay_ms=20, window_bytes=64 * 1024)
    one = _transfer_seconds(1, link, 1 << 20)
    four = _transfer_seconds(4, link, 1 << 20)
    assert one >= (1 << 20) / (64 * 1024) * 2 * link.delay * 0.9  # the window bound holds
    assert one / four > 2.0  # four windows in flight: close to 4x, never below 2x


def test_zmq_peers_behind_emulators_reduce_correctly():
    link = LinkConfig(rate_mbit=400, delay_ms=5, window_bytes=256 * 1024)
    base = ZmqConfig(bind_host="127.0.0.1", connections=2, chunk_bytes=64 * 1024, timeout=30.0)
    made = [emulated_config(base, link) for _ in range(2)]
    comms = []
    try:
        with Coordinator(CoordinatorConfig(bind="tcp://127.0.0.1:0")) as coord:
            comms = [connect(coord.address, cfg) for cfg, _ in made]
            assert all(f":{emu.port}" in c.address for c, (_, emu) in zip(comms, made))
            run_ranks([lambda c=c: c.quorum(min_world=2) for c in comms])
            xs = [torch.randn(100_000) for _ in comms]
            outs = run_ranks(
                [lambda c=c: c.all_reduce(xs[c.rank], algorithm="ring") for c in comms]
            )
            assert all(torch.allclose(o, xs[0] + xs[1]) for o in outs)
            assert all(emu.bytes["up"] > 200_000 for _, emu in made)  # it really went through
    finally:
        for c in comms:
            c.close()
        for _, emu in made:
            emu.stop()
