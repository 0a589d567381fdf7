"""The web chat at ``GET /``: served self-contained, and driven in a real headless Chromium over
the DevTools protocol (aiohttp websocket): model and status shown, a reply streams in, Stop
aborts a generation. A screenshot is kept under tests/artifacts/ (ignored by git)."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import aiohttp
import pytest

from edge.engine import Engine, LocalRunner
from edge.server import ServerConfig, start
from lowband.models.llama import LlamaForCausalLM, init_weights
from lowband.models.tokenizer import ByteTokenizer
from tests.conftest import tiny_llama

pytestmark = pytest.mark.timeout(180)

CFG = tiny_llama(max_position_embeddings=1024)
ARTIFACTS = Path(__file__).resolve().parents[1] / "artifacts"


class _SlowRunner:
    """A LocalRunner that takes ``delay`` per forward, so a reply streams for a while (the
    tiny model would finish 256 tokens before the browser could click Stop)."""

    def __init__(self, inner: LocalRunner, delay: float) -> None:
        self.inner, self.delay = inner, delay

    def forward(self, ids, start, top=0):
        time.sleep(self.delay)
        return self.inner.forward(ids, start)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def _engine(delay: float = 0.0) -> Engine:
    m = LlamaForCausalLM(CFG).eval()
    init_weights(m, std=0.3, seed=1)
    runner = LocalRunner(m)
    return Engine(
        _SlowRunner(runner, delay) if delay else runner, ByteTokenizer(), model_name="tiny"
    )


def test_page_is_served_and_self_contained() -> None:
    async def body() -> None:
        server, port = await start(_engine(), ServerConfig(host="127.0.0.1", port=0))
        try:
            async with aiohttp.ClientSession() as s:
                r = await s.get(f"http://127.0.0.1:{port}/")
                assert r.status == 200 and r.headers["Content-Type"].startswith("text/html")
                html = await r.text()
        finally:
            await server.cleanup()
        for el in ('id="prompt"', 'id="send"', 'id="stop"', 'id="messages"', 'id="status"'):
            assert el in html
        assert "/v1/chat/completions" in html and "/health" in html and "stream: true" in html
        # no external assets: no script/link/img pointing anywhere but this server
        assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", html)
        assert "<script src" not in html and "@import" not in html

    asyncio.run(asyncio.wait_for(body(), 60))


def _chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path:
            return path
    return None


class _Cdp:
    """The few DevTools protocol calls the test needs, over one page websocket."""

    def __init__(self, ws: aiohttp.ClientWebSocketResponse) -> None:
        self.ws, self.n = ws, 0

    async def call(self, method: str, **params) -> dict:
        self.n += 1
        await self.ws.send_json({"id": self.n, "method": method, "params": params})
        while True:  # skip events until our answer
            msg = json.loads((await self.ws.receive(timeout=30)).data)
            if msg.get("id") == self.n:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                return msg["result"]

    async def js(self, expr: str):
        r = await self.call(
            "Runtime.evaluate", expression=expr, returnByValue=True, awaitPromise=True
        )
        if "exceptionDetails" in r:
            raise RuntimeError(f"{expr}: {r['exceptionDetails']}")
        return r["result"].get("value")

    async def until(self, expr: str, timeout: float = 30.0):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            v = await self.js(expr)
            if v:
                return v
            await asyncio.sleep(0.05)
        raise TimeoutError(f"still false after {timeout}s: {expr}")


async def _open_browser(exe: str, profile: Path) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen(
        [
            exe,
            "--headless=new",
            "--no-sandbox",
            "--disable-gpu",
            "--no-first-run",
            "--disable-dev-shm-usage",
            "--remote-debugging-port=0",
            f"--user-data-dir={profile}",
            "--window-size=900,640",
            "about:blank",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    port_file = profile / "DevToolsActivePort"
    deadline = time.monotonic() + 60
    while not (port_file.exists() and port_file.read_text().strip()):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"chromium did not start (exit {proc.poll()})")
        await asyncio.sleep(0.1)
    return proc, port_file.read_text().split()[0]


def test_chat_in_a_real_browser(tmp_path) -> None:
    exe = _chromium()
    if exe is None:
        pytest.skip("chromium not installed (apt-get install chromium)")

    async def body() -> Path:
        engine = _engine(delay=0.01)
        server, port = await start(engine, ServerConfig(host="127.0.0.1", port=0))
        proc, dt_port = await _open_browser(exe, tmp_path / "profile")
        try:
            async with aiohttp.ClientSession() as s:
                targets = await (await s.get(f"http://127.0.0.1:{dt_port}/json/list")).json()
                page = next(t for t in targets if t["type"] == "page")
                async with s.ws_connect(page["webSocketDebuggerUrl"], max_msg_size=0) as ws:
                    cdp = _Cdp(ws)
                    await cdp.call("Page.enable")
                    await cdp.call("Page.navigate", url=f"http://127.0.0.1:{port}/")
                    await cdp.until(
                        "document.getElementById('status')?.textContent.startsWith('ready')"
                    )
                    assert (
                        await cdp.js("document.getElementById('model').textContent")
                        == "model: tiny"
                    )
                    assert (
                        await cdp.js("document.getElementById('status').textContent")
                        == "ready, 1 device(s)"
                    )

                    # 1. a reply streams in: the assistant bubble grows over several reads
                    await cdp.js(
                        "document.getElementById('prompt').value = 'Hello there';"
                        "document.getElementById('form').requestSubmit(); true"
                    )
                    lengths = set()
                    deadline = time.monotonic() + 60
                    while time.monotonic() < deadline:
                        st = await cdp.js(
                            "({n: document.querySelector('.assistant')?.textContent.length"
                            " || 0, busy: document.getElementById('send').disabled})"
                        )
                        lengths.add(st["n"])
                        if not st["busy"] and st["n"] > 0:
                            break
                        await asyncio.sleep(0.03)
                    assert len([n for n in lengths if n > 0]) >= 3, lengths  # streamed, not at once
                    assert await cdp.js("document.querySelectorAll('.user').length") == 1
                    first_done = engine.metrics.snapshot()["completion_tokens_total"]
                    assert first_done == 256  # the page asks for max_tokens 256

                    # 2. Stop aborts the next reply part-way
                    await cdp.js(
                        "document.getElementById('prompt').value = 'And again';"
                        "document.getElementById('form').requestSubmit(); true"
                    )
                    await cdp.until(
                        "(document.querySelectorAll('.assistant')[1]?.textContent.length || 0) > 5"
                    )
                    await cdp.js("document.getElementById('stop').click(); true")
                    await cdp.until("!document.getElementById('send').disabled", timeout=10)
                    assert (
                        await cdp.js("document.querySelectorAll('.assistant')[1].dataset.stopped")
                        == "1"
                    )
                    shot = await cdp.call("Page.captureScreenshot", format="png")
            # the server stops generating at the next token once the client is gone
            deadline = time.monotonic() + 10
            while engine.metrics.snapshot()["requests_running"] and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            await asyncio.sleep(0.5)
            second = engine.metrics.snapshot()["completion_tokens_total"] - first_done
            assert 0 < second < 200, second
            png = tmp_path / "chat_page.png"
            png.write_bytes(base64.b64decode(shot["data"]))
            return png
        finally:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
            await server.cleanup()

    png = asyncio.run(asyncio.wait_for(body(), 150))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000
    ARTIFACTS.mkdir(exist_ok=True)
    kept = ARTIFACTS / png.name
    shutil.copy(png, kept)
    print(f"chat page screenshot: {kept}")
