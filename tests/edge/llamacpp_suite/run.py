"""Run llama.cpp's own server test-suite (``tools/server/tests/unit`` of the llama-cpp-python
source release) against ``lowband edge run`` and tally it.

``python -m tests.edge.llamacpp_suite.run SDIST WORK`` extracts the suite and the chat templates
it uses from ``SDIST``, writes the small model, runs the files of :data:`FILES` (their fast tier,
``-m "not slow"``: the slow one downloads real models) through the shim
(``shim_conftest.py``) and prints the tally as JSON, last line.

A test *applies* when it ran (not skipped for a llama-server option lowband has no counterpart
for) and every URL path it asked for is one of the OpenAI endpoints both servers share
(:data:`SHARED`); the others ask for llama-server's own API (``/completion``, ``/slots``,
``/props``, ``/apply-template``, ``/infill``...)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
SUITE = "vendor/llama.cpp/tools/server/tests/"
TEMPLATES = "vendor/llama.cpp/models/templates/"
# the files about the endpoints both servers have (OpenAI's chat, completions, embeddings,
# tool calls, structured output; /health, /v1/models); the rest test llama-server's own
# features: infill, LoRA, reranking, slots, the router, MCP, the Anthropic/GCP/Responses APIs,
# speculative decoding, context shift, vision
FILES = (
    "test_basic.py",
    "test_chat_completion.py",
    "test_completion.py",
    "test_embedding.py",
    "test_tool_call.py",
    "test_ignore_eos.py",
    "test_security.py",
)
FILES = tuple(os.environ.get("LOWBAND_SUITE_FILES", " ".join(FILES)).split())
SHARED = {
    "/health",
    "/v1/models",
    "/models",
    "/v1/chat/completions",
    "/chat/completions",
    "/v1/completions",
    "/v1/embeddings",
}


def extract(sdist: Path, work: Path) -> Path:
    """The suite's folder (``.../tools/server/tests``) under ``work``, laid out as in llama.cpp's
    tree (the tests open ``../../../models/templates/*.jinja``), our shim as its conftest."""
    base = work / "llama.cpp"
    with tarfile.open(sdist, "r:gz") as tar:
        for m in tar:
            rel = m.name.split("/", 1)[-1]
            if not m.isfile() or not rel.startswith((SUITE, TEMPLATES)):
                continue
            out = base / rel[len("vendor/llama.cpp/") :]
            out.parent.mkdir(parents=True, exist_ok=True)
            src = tar.extractfile(m)
            assert src is not None
            out.write_bytes(src.read())
    tests = base / "tools/server/tests"
    shutil.copy(Path(__file__).with_name("shim_conftest.py"), tests / "conftest.py")
    return tests


def run(sdist: Path, work: Path, timeout: float = 3000) -> dict:
    """Each test's outcome, paths and message (the shim's report)."""
    from tests.edge.llamacpp_suite.model import write_model

    work.mkdir(parents=True, exist_ok=True)
    tests = extract(sdist, work)
    model = write_model(work / "model.gguf")
    report = work / "report.json"
    env = {
        **os.environ,
        "LOWBAND_SUITE": json.dumps(
            {"python": sys.executable, "repo": str(ROOT), "work": str(work), "model": str(model)}
        ),
        "LOWBAND_SUITE_REPORT": str(report),
    }
    env.pop("PORT", None)
    env.pop("DEBUG_EXTERNAL", None)
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist"]
    cmd += ["-p", "no:randomly", "-m", "not slow", "-o", "addopts=", "--timeout", "600"]
    cmd += [f"unit/{f}" for f in FILES]
    out = subprocess.run(cmd, cwd=tests, env=env, capture_output=True, text=True, timeout=timeout)
    (work / "pytest.log").write_text(out.stdout + out.stderr)
    if not report.exists():
        raise RuntimeError(f"the suite wrote no report:\n{(out.stdout + out.stderr)[-3000:]}")
    return json.loads(report.read_text())


def tally(report: dict) -> dict:
    """{"applies": {nodeid: outcome}, "not_applicable": {nodeid: why}, counts}."""
    applies: dict[str, dict] = {}
    na: dict[str, str] = {}
    for nodeid, r in sorted(report.items()):
        outcome = r.get("outcome")
        if outcome is None:
            continue
        own = [p for p in r.get("paths", []) if p not in SHARED]
        if outcome == "skipped":
            na[nodeid] = r.get("message", "skipped")
        elif own:
            na[nodeid] = "llama-server's own endpoint " + ", ".join(own)
        else:
            applies[nodeid] = {"outcome": outcome, "message": r.get("message", "")}
    passed = sum(1 for r in applies.values() if r["outcome"] == "passed")
    return {
        "passed": passed,
        "failed": len(applies) - passed,
        "not_applicable": len(na),
        "applies": applies,
        "not_applicable_why": na,
    }


if __name__ == "__main__":
    rep = run(Path(sys.argv[1]), Path(sys.argv[2]))
    t = tally(rep)
    (Path(sys.argv[2]) / "tally.json").write_text(json.dumps(t, indent=1))
    print(json.dumps({k: t[k] for k in ("passed", "failed", "not_applicable")}))
