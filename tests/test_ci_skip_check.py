"""``.ci/check_skips.py``: CI fails on a skip outside ``.ci/allowed-skips`` (and when the conftest
hook wrote no record at all), and the allow-list only names root / Linux-only tests."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.timeout(60)


def _check(tmp_path: Path, skips: list[dict] | None) -> subprocess.CompletedProcess:
    path = tmp_path / "skips.jsonl"
    if skips is not None:
        path.write_text("".join(json.dumps(s) + "\n" for s in skips))
    return subprocess.run(
        [
            sys.executable,
            str(REPO / ".ci" / "check_skips.py"),
            str(path),
            str(REPO / ".ci" / "allowed-skips"),
        ],
        capture_output=True,
        text=True,
    )


def test_allowed_skips_pass_and_others_fail(tmp_path):
    netns = {"nodeid": "tests/transport/test_netns.py::test_a", "reason": "netns: needs root"}
    assert _check(tmp_path, []).returncode == 0
    assert _check(tmp_path, [netns]).returncode == 0
    module = "tests/models/test_transformers_parity.py"
    broken = {"nodeid": module, "reason": "could not import 'x'"}
    r = _check(tmp_path, [netns, broken])
    assert r.returncode == 1 and module in r.stdout
    assert _check(tmp_path, None).returncode == 1  # no record: the hook did not run


def test_the_conftest_hook_records_a_module_level_skip(tmp_path):
    (tmp_path / "test_gone.py").write_text(
        "import pytest\npytest.importorskip('no_such_module_lowband')\ndef test_a():\n    pass\n"
    )
    (tmp_path / "conftest.py").write_text((REPO / "tests" / "conftest.py").read_text())
    out = tmp_path / "skips.jsonl"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            str(tmp_path / "test_gone.py"),
        ],
        cwd=tmp_path,
        capture_output=True,
        env={**os.environ, "LOWBAND_SKIPS_FILE": str(out)},
        timeout=50,
    )
    rec = [json.loads(x) for x in out.read_text().splitlines()]
    assert len(rec) == 1 and "no_such_module_lowband" in rec[0]["reason"]
