"""A user-space WAN link emulator: a TCP relay with bandwidth, one-way delay and a window cap.

This kernel has no ``netem``, so WAN behaviour is emulated in user space. A :class:`LinkEmulator`
listens on one port and relays every accepted connection to a target address, shaping both
directions of the link:

* **bandwidth** – all connections through the relay share one token bucket per direction
  (bytes leave the link back to back at ``rate``), like a bottleneck router;
* **one-way delay** – every byte is delivered ``delay`` seconds after it left the link;
* **window cap** – each connection may have at most ``window_bytes`` unacknowledged bytes in
  flight; a byte is acknowledged one more ``delay`` after delivery (the ACK's trip back). A
  single flow is therefore capped at ``window / RTT``, as a real TCP flow is by its window on a
  long fat pipe, and K parallel connections carry up to K times more, up to the link rate.
  This is what makes ``ZmqConfig.connections`` measurable on one machine.

Put one in front of each peer's data port (:func:`front`) and let the peer advertise the relay's
port: everything that peer receives then crosses the emulated link.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
from dataclasses import dataclass
from typing import Any

from lowband.errors import ConfigError
from lowband.proc import free_port

logger = logging.getLogger(__name__)

_READ = 64 * 1024


@dataclass(frozen=True, kw_only=True)
class LinkConfig:
    """One emulated link (both directions get the same parameters)."""

    rate_mbit: float = 100.0
    """Bottleneck bandwidth in Mbit/s, shared by every connection through the relay."""
    delay_ms: float = 0.0
    """One-way propagation delay in milliseconds (RTT = 2 × delay)."""
    window_bytes: int = 4 << 20
    """Unacknowledged bytes one connection may have in flight (its TCP window)."""

    def __post_init__(self) -> None:
        if not 0.001 <= self.rate_mbit <= 100_000:
            raise ConfigError("rate_mbit", f"must be in [0.001, 100000], got {self.rate_mbit}")
        if not 0 <= self.delay_ms <= 10_000:
            raise ConfigError("delay_ms", f"must be in [0, 10000] ms, got {self.delay_ms}")
        if self.window_bytes < 1024:
            raise ConfigError("window_bytes", f"must be >= 1024, got {self.window_bytes}")

    @property
    def rate_bytes(self) -> float:
        return self.rate_mbit * 1e6 / 8

    @property
    def delay(self) -> float:
        return self.delay_ms / 1000

    def flow_cap_mbit(self) -> float:
        """Throughput bound of one connection: window / RTT (or the rate without delay)."""
        if self.delay_ms == 0:
            return self.rate_mbit
        return min(self.rate_mbit, self.window_bytes * 8 / (2 * self.delay) / 1e6)


class _Bucket:
    """Serialises bytes onto the link at ``rate``: returns when each burst has left it."""

    def __init__(self, rate: float) -> None:
        self.rate = rate
        self.free_at = 0.0

    def depart(self, now: float, n: int) -> float:
        self.free_at = max(now, self.free_at) + n / self.rate
        return self.free_at


class LinkEmulator:
    """Relays ``listen`` → ``target`` through an emulated link; runs its own event-loop thread."""

    def __init__(
        self,
        target: tuple[str, int],
        link: LinkConfig,
        *,
        listen_host: str = "127.0.0.1",
        listen_port: int = 0,
    ) -> None:
        self.target = target
        self.link = link
        self._listen = (listen_host, listen_port)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="lowband-emulator", daemon=True
        )
        self._server: asyncio.base_events.Server | None = None
        self._buckets = {"up": _Bucket(link.rate_bytes), "down": _Bucket(link.rate_bytes)}
        self._tasks: set[asyncio.Task] = set()
        self.port = 0
        self.bytes = {"up": 0, "down": 0}
        self.connections = 0

    @property
    def endpoint(self) -> str:
        return f"tcp://{self._listen[0]}:{self.port}"

    def start(self) -> "LinkEmulator":
        self._thread.start()
        fut = asyncio.run_coroutine_threadsafe(self._serve(), self._loop)
        self.port = fut.result(10)
        return self

    def stop(self) -> None:
        async def shutdown() -> None:
            if self._server is not None:
                self._server.close()
            tasks = list(self._tasks)
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        if self._thread.is_alive():
            asyncio.run_coroutine_threadsafe(shutdown(), self._loop).result(10)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)
        self._loop.close()

    def __enter__(self) -> "LinkEmulator":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ---- event loop side ----------------------------------------------------------------------
    async def _serve(self) -> int:
        self._server = await asyncio.start_server(self._accept, *self._listen)
        return self._server.sockets[0].getsockname()[1]

    async def _accept(self, c_reader: asyncio.StreamReader, c_writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        self.connections += 1
        try:
            u_reader, u_writer = await asyncio.open_connection(*self.target)
        except OSError as exc:  # the target is gone (typically: the peer closed)
            logger.debug("emulator: cannot reach %s:%d: %s", *self.target, exc)
            c_writer.close()
            self._tasks.discard(task)
            return
        try:
            await asyncio.gather(
                self._pump(c_reader, u_writer, "up"), self._pump(u_reader, c_writer, "down")
            )
        except (OSError, asyncio.CancelledError):
            pass
        finally:
            for w in (c_writer, u_writer):
                w.close()
            self._tasks.discard(task)

    async def _pump(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, direction: str
    ) -> None:
        """Read, stamp each burst with its delivery time, deliver in order; the window of
        unacknowledged bytes throttles reading, which back-pressures the sender's TCP."""
        loop = asyncio.get_running_loop()
        link = self.link
        bucket = self._buckets[direction]
        queue: asyncio.Queue[tuple[float, bytes] | None] = asyncio.Queue()
        credit = asyncio.Event()
        state = {"inflight": 0}

        def ack(n: int) -> None:
            state["inflight"] -= n
            credit.set()

        async def deliver() -> None:
            while (item := await queue.get()) is not None:
                at, data = item
                if (wait := at - loop.time()) > 0:
                    await asyncio.sleep(wait)
                self.bytes[direction] += len(data)  # counted before the peer can see them
                writer.write(data)
                await writer.drain()
            if writer.can_write_eof():
                try:
                    writer.write_eof()
                except OSError:
                    pass  # the other side is already gone

        sender = asyncio.create_task(deliver())
        try:
            while True:
                while state["inflight"] >= link.window_bytes:
                    credit.clear()
                    await credit.wait()
                data = await reader.read(min(_READ, link.window_bytes - state["inflight"]))
                if not data:
                    break
                arrive = bucket.depart(loop.time(), len(data)) + link.delay
                state["inflight"] += len(data)
                queue.put_nowait((arrive, data))
                loop.call_at(arrive + link.delay, ack, len(data))
        finally:
            queue.put_nowait(None)
            await sender


def front(port: int, link: LinkConfig, host: str = "127.0.0.1") -> LinkEmulator:
    """Start an emulator relaying to ``host:port`` (a peer's data port)."""
    return LinkEmulator((host, port), link, listen_host=host).start()


def emulated_config(base: Any, link: LinkConfig) -> tuple[Any, LinkEmulator]:
    """A copy of a :class:`~transport.zmq_comm.ZmqConfig` whose data port sits behind a fresh
    emulator; returns (config, emulator). The caller stops the emulator."""
    port = free_port(base.bind_host if base.bind_host not in ("0.0.0.0", "*") else "127.0.0.1")
    emu = front(port, link)
    # same_host="off": a same-host shortcut (shared memory, Unix sockets) would bypass the link.
    return dataclasses.replace(
        base, data_port=port, advertise_port=emu.port, advertise_host="127.0.0.1", same_host="off"
    ), emu
