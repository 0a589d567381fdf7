"""llama.cpp's own server test-suite (``tools/server/tests/unit`` of the llama-cpp-python source
release the tokenizer tests fetch) run against ``lowband edge run`` through a fixture of our own
(``tests/edge/llamacpp_suite``: its ``ServerProcess`` starts lowband on a small GGUF instead of
llama-server).

The tally is held in ``llamacpp_suite/expected.json``: every test that applies (it asks only for
the OpenAI endpoints both servers share, and needs no llama-server option lowband lacks) is
listed as passing, or as failing with the reason (or, for the few whose outcome depends on
what the small random model samples, as model-dependent); the test fails when one listed as passing
fails, one listed as failing passes (update the file), or the set of tests that apply changes.
Skipped, saying so, where the source release cannot be had (no registry, no cached copy: set
``LOWBAND_LLAMACPP_SDIST`` to a downloaded ``llama_cpp_python-0.3.36.tar.gz``)."""

from __future__ import annotations

import fnmatch
import json
import os
import subprocess
from pathlib import Path

import pytest

from benchmarks.edge_vs_llamacpp import LLAMA_CPP_PYTHON, download_sdist
from tests.edge.llamacpp_suite import run as suite

pytestmark = [pytest.mark.slow, pytest.mark.timeout(3600)]
EXPECTED = Path(suite.__file__).with_name("expected.json")


@pytest.fixture(scope="session")
def llamacpp_sdist(request: pytest.FixtureRequest) -> Path:
    """The llama-cpp-python source release: ``$LOWBAND_LLAMACPP_SDIST``, a copy cached in
    pytest's cache, or downloaded there (``pip download``); skipped when none can be had."""
    given = os.environ.get("LOWBAND_LLAMACPP_SDIST")
    if given:
        return Path(given)
    name = "lowband-" + LLAMA_CPP_PYTHON.replace("==", "-") + "-sdist"
    cache = getattr(request.config, "cache", None)
    root = Path(cache.mkdir(name)) if cache is not None else Path(".pytest_cache") / name
    root.mkdir(parents=True, exist_ok=True)
    found = sorted(root.glob("llama_cpp_python-*.tar.gz"))
    if found:
        return found[0]
    try:
        return download_sdist(root)
    except (RuntimeError, subprocess.TimeoutExpired) as exc:
        pytest.skip(f"llama.cpp's server test-suite needs {LLAMA_CPP_PYTHON}'s sdist: {exc}")


def reason_for(nodeid: str, failed: dict[str, str]) -> str | None:
    for pattern, why in failed.items():
        if fnmatch.fnmatchcase(nodeid, pattern):
            return why
    return None


def test_llamacpp_server_suite_tally(llamacpp_sdist: Path, tmp_path: Path) -> None:
    expected = json.loads(EXPECTED.read_text())
    tally = suite.tally(suite.run(llamacpp_sdist, tmp_path / "suite"))
    (tmp_path / "tally.json").write_text(json.dumps(tally, indent=1))
    print(json.dumps({k: tally[k] for k in ("passed", "failed", "not_applicable")}))
    applies = tally["applies"]
    passing, failing = set(expected["passed"]), expected["failed"]
    problems = []
    for nodeid, r in applies.items():
        if reason_for(nodeid, expected["model_dependent"]) is not None:
            continue  # its outcome depends on what the random model samples
        why = reason_for(nodeid, failing)  # the list of passing ones comes first
        if nodeid in passing:
            if r["outcome"] != "passed":
                problems.append(f"{nodeid} failed: {r['message']}")
        elif why is None:
            problems.append(f"{nodeid} is new ({r['outcome']}: {r['message']})")
        elif r["outcome"] == "passed":
            problems.append(f"{nodeid} passes now; move it to 'passed' in {EXPECTED.name}")
    gone = passing - set(applies)
    problems += [
        f"{nodeid} no longer applies: {tally['not_applicable_why'].get(nodeid)}"
        for nodeid in sorted(gone)
    ]
    assert not problems, "\n".join(problems)
