"""The documentation stays true to the repository: generated pages current, links resolving,
README short and in step with CI, figures traceable to a result file, no change-log prose."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
PAGES = [README, ROOT / "ARCHITECTURE.md", *DOCS]

# Words that narrate history; git keeps history, the docs say what is true now.
HISTORY = (
    "previous stop",
    "this stop",
    "withdrawn",
    "before issue",
    "now fixed",
)


def _bench_docs():
    spec = importlib.util.spec_from_file_location("bench_docs", ROOT / "scripts" / "bench_docs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_benchmarks_page_is_current(capsys):
    assert _bench_docs().main(["--check"]) == 0, capsys.readouterr().err


def test_bench_docs_check_fails_on_a_stale_page(tmp_path, monkeypatch):
    module = _bench_docs()
    stale = tmp_path / "benchmarks.md"
    stale.write_text("# stale\n", encoding="utf-8")
    monkeypatch.setattr(module, "OUTPUT", stale)
    monkeypatch.setattr(module, "ROOT", tmp_path)
    assert module.main(["--check"]) == 1


def test_every_result_file_has_the_required_keys():
    module = _bench_docs()
    results = module.load()
    assert len(results) >= 5
    for stem, data in results:
        assert re.fullmatch(r"[0-9a-f]{40}", data["commit"]), stem
        assert re.fullmatch(r"\d{4}-\d\d-\d\dT", data["date"][:11]), stem
        assert data["result"], stem


def test_readme_is_short():
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 250, f"README.md has {len(lines)} lines; move detail to docs/"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_no_history_words(page):
    text = page.read_text(encoding="utf-8").lower()
    found = [w for w in HISTORY if w in text]
    assert not found, f"{page.name} narrates history: {found}"


LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


@pytest.mark.parametrize("page", [README, *DOCS], ids=lambda p: p.relative_to(ROOT).as_posix())
def test_relative_links_resolve(page):
    broken = []
    for target in LINK.findall(page.read_text(encoding="utf-8")):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue  # external URL or an anchor in the same page
        path = target.split("#", 1)[0]
        if not (page.parent / path).exists():
            broken.append(target)
    assert not broken, f"{page.name} links to missing files: {broken}"


def _ci_commands() -> tuple[str, str]:
    lines = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    setup = lines[lines.index("# --- setup command (README) ---") + 1]
    after_test = lines[lines.index("# --- test command (README) ---") + 1 :]
    test = next(line for line in after_test if line.startswith("python -m pytest"))
    return setup, test


def _readme_code_lines() -> list[str]:
    text = README.read_text(encoding="utf-8")
    blocks = re.findall(r"```(?:bash)?\n(.*?)```", text, flags=re.S)
    return [line.split("  #")[0].strip() for block in blocks for line in block.splitlines()]


def test_readme_setup_and_test_commands_are_the_ci_ones():
    setup, test = _ci_commands()
    assert setup == 'python -m pip install -c constraints.txt -e ".[dev]"'
    assert test == "python -m pytest -q -n 2"
    code = _readme_code_lines()
    assert setup in code
    assert test in code


def _numbers(value) -> list[float]:
    if isinstance(value, bool):
        return []
    if isinstance(value, (int, float)):
        return [float(value)]
    if isinstance(value, dict):
        return [n for v in value.values() for n in _numbers(v)]
    if isinstance(value, list):
        return [n for v in value for n in _numbers(v)]
    return []


def test_readme_figures_come_from_result_files():
    known = set()
    for path in (ROOT / "benchmarks" / "results").glob("*.json"):
        known.update(_numbers(json.loads(path.read_text(encoding="utf-8"))["result"]))
    text = README.read_text(encoding="utf-8")
    table = text.split("## Measured", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in table.splitlines() if line.startswith("| ") and "---" not in line]
    figures = [row.split("|")[2] for row in rows[1:]]  # the "figure" column, header skipped
    assert figures, "README has no results table under ## Measured"
    missing = []
    for cell in figures:
        for number in re.findall(r"\d+(?:\.\d+)?", cell):
            if float(number) not in known:
                missing.append(number)
    assert not missing, f"README figures not in benchmarks/results/*.json: {missing}"


def _protocol_tables() -> dict[str, str]:
    from edge.cluster import protocol
    from transport import control

    return {"transport.control": control.describe(), "edge.cluster.protocol": protocol.describe()}


@pytest.mark.parametrize("module", ["transport.control", "edge.cluster.protocol"])
def test_architecture_protocol_tables_are_the_codes(module):
    """ARCHITECTURE.md's message tables are generated from the message classes: a message or
    field added in code and not in the doc (or the other way round) fails here."""
    text = (ROOT / "ARCHITECTURE.md").read_text(encoding="utf-8")
    table = "\n".join(("    " + line).rstrip() for line in _protocol_tables()[module].splitlines())
    assert table in text, f"update ARCHITECTURE.md's table of {module} to:\n{table}"
