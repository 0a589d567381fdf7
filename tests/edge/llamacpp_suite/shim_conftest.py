"""Copied as ``conftest.py`` over llama.cpp's own ``tools/server/tests/conftest.py`` when its
server test-suite runs against ``lowband edge run`` (``tests/edge/test_llamacpp_server_suite.py``).

llama.cpp's ``utils.ServerProcess.start`` launches ``llama-server`` with the options a test set;
here it launches ``lowband edge run`` on the small model of ``tests.edge.llamacpp_suite.model``
instead, translated option by option:

- ``chat_template_file``: the model file is written again carrying that template (llama-server
  takes the file; lowband reads the GGUF's own template);
- ``n_slots`` -> ``--parallel``, ``pooling`` (mean/last/cls) -> ``--pooling``, ``api_key`` ->
  ``--api-key-file``, ``model_alias`` -> ``--name``;
- options that only size or tune llama-server (``n_ctx``, ``n_batch``, ``fa``, ``jinja``...) or
  that name its download (``model_hf_repo``...) change nothing here;
- any other option a test sets (a built-in template by name, LoRA, draft models, slots saved to
  disk, CORS, media, reasoning_format as a server flag...) has no counterpart: the test is
  skipped saying which (``needs llama-server option``), so it counts as not applicable.

A server is started once per distinct command line and kept for the session (llama-server
starts in a second; lowband in tens of seconds here), so ``stop`` only forgets it. Every URL path
a test asks for (through ``utils`` or the ``openai`` client) is recorded beside its outcome in
the JSON file ``$LOWBAND_SUITE_REPORT``.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
import types
from pathlib import Path

sys.modules.setdefault("wget", types.ModuleType("wget"))  # utils imports it for downloads only

import httpx  # noqa: E402
import pytest  # noqa: E402
import requests  # noqa: E402
import utils  # noqa: E402

CFG = json.loads(os.environ["LOWBAND_SUITE"])  # python, repo, work, model
REPORT: dict[str, dict] = {}
_current: list[str | None] = [None]
_servers: dict[tuple, tuple[subprocess.Popen, int]] = {}

# options of ServerProcess that have an equivalent here, or change nothing here
TRANSLATED = {"model_file", "chat_template_file", "n_slots", "pooling", "api_key", "model_alias"}
NO_EFFECT = {
    "debug", "server_port", "server_host", "model_hf_repo", "model_hf_file", "temperature", "seed",
    "offline", "model_tags", "model_url", "n_threads", "n_gpu_layer", "n_batch", "n_ubatch",
    "n_ctx", "n_predict", "n_prompts", "cache_prompt", "ctk", "ctv", "fa",
    "server_continuous_batching", "server_embeddings", "server_metrics", "kv_unified",
    "swa_full", "server_slots", "jinja", "no_ui", "log_path", "process", "external_server",
    "server_path", "cache_ram", "no_cache_idle_slots", "ready",
}  # fmt: skip
NEUTRAL = {"server_slots": False, "no_ui": None}
ALLOWED_POOLING = {"mean", "last", "cls"}


def _record(path: str) -> None:
    if _current[0] is not None:
        paths = REPORT.setdefault(_current[0], {}).setdefault("paths", [])
        if path not in paths:
            paths.append(path)


_make_request = utils.ServerProcess.make_request
_make_stream_request = utils.ServerProcess.make_stream_request


def make_request(self, method, path, *a, **kw):
    _record(path.split("?")[0])
    return _make_request(self, method, path, *a, **kw)


def make_stream_request(self, method, path, *a, **kw):
    _record(path.split("?")[0])
    return _make_stream_request(self, method, path, *a, **kw)


_send = httpx.Client.send


def send(self, request, *a, **kw):  # the openai client
    _record(request.url.path)
    return _send(self, request, *a, **kw)


httpx.Client.send = send  # type: ignore[method-assign]


def _unsupported(server: utils.ServerProcess) -> list[str]:
    """The options this test set that lowband cannot honour."""
    base = utils.ServerProcess()
    out = []
    for name in dir(server):
        if name.startswith("_") or callable(getattr(server, name)):
            continue
        value = getattr(server, name)
        if name in NO_EFFECT or name in TRANSLATED:
            continue
        if value == getattr(base, name, None) or value in (None, False, 0):
            continue
        out.append(f"{name}={value!r}")
    if server.pooling is not None and server.pooling not in ALLOWED_POOLING:
        out.append(f"pooling={server.pooling!r}")
    if server.server_slots:
        out.append("server_slots=True")
    if server.no_ui:
        out.append("no_ui=True")
    return out


def _model_for(server: utils.ServerProcess) -> Path:
    tpl = server.chat_template_file
    if not tpl:
        return Path(CFG["model"])
    src = Path(tpl)
    if not src.exists():
        pytest.fail(f"chat_template_file {tpl} does not exist")
    out = Path(CFG["work"]) / f"model-{src.stem}.gguf"
    if not out.exists():
        subprocess.run(
            [CFG["python"], "-m", "tests.edge.llamacpp_suite.model", str(out), str(src.resolve())],
            cwd=CFG["repo"],
            check=True,
            capture_output=True,
        )
    return out


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(self, timeout_seconds: int = 600) -> None:
    missing = _unsupported(self)
    if missing:
        pytest.skip("needs llama-server option " + ", ".join(missing))
    model = _model_for(self)
    args = [str(model), "--devices", "1", "--threads", "1", "--host", "127.0.0.1"]
    if self.n_slots:
        args += ["--parallel", str(self.n_slots)]
    if self.pooling:
        args += ["--pooling", self.pooling]
    if self.model_alias:
        args += ["--name", self.model_alias]
    if self.api_key:
        # one file per key: the file's path is part of the command line a server is kept by
        key = (
            Path(CFG["work"]) / f"api-key-{hashlib.sha256(self.api_key.encode()).hexdigest()[:12]}"
        )
        key.write_text(self.api_key)
        key.chmod(0o600)
        args += ["--api-key-file", str(key)]
    key_ = tuple(args)
    if key_ not in _servers or _servers[key_][0].poll() is not None:
        port = _free_port()
        log = open(Path(CFG["work"]) / f"server-{len(_servers)}.log", "w")  # noqa: SIM115
        proc = subprocess.Popen(
            [CFG["python"], "-m", "cli", "edge", "run", *args, "--port", str(port)],
            cwd=CFG["repo"],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        _servers[key_] = (proc, port)
        t0 = time.monotonic()
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"lowband edge run exited with {proc.returncode}")
            try:
                if requests.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except requests.RequestException:
                pass
            if time.monotonic() - t0 > timeout_seconds:
                raise TimeoutError("lowband edge run did not answer /health")
            time.sleep(0.25)
    self.server_port = _servers[key_][1]
    self.server_host = "127.0.0.1"
    self.ready = True


def stop(self) -> None:
    utils.server_instances.discard(self)


utils.ServerProcess.start = start  # type: ignore[method-assign]
utils.ServerProcess.stop = stop  # type: ignore[method-assign]
utils.ServerProcess.make_request = make_request  # type: ignore[method-assign]
utils.ServerProcess.make_stream_request = make_stream_request  # type: ignore[method-assign]
utils.ServerPreset.load_all = staticmethod(lambda: None)  # type: ignore[method-assign]


def pytest_runtest_setup(item: pytest.Item) -> None:
    _current[0] = item.nodeid


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    entry = REPORT.setdefault(report.nodeid, {})
    if report.when == "call" or (report.when == "setup" and not report.passed):
        entry["outcome"] = report.outcome
        if report.skipped and isinstance(report.longrepr, tuple):
            entry["message"] = report.longrepr[2]
        elif report.failed:
            crash = getattr(report.longrepr, "reprcrash", None)
            entry["message"] = (crash.message if crash else str(report.longrepr))[:300]


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    for proc, _ in _servers.values():
        proc.terminate()
    for proc, _ in _servers.values():
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    Path(os.environ["LOWBAND_SUITE_REPORT"]).write_text(json.dumps(REPORT, indent=1))
