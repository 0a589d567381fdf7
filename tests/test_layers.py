"""The import graph follows the layers: imports only go down, and there are no cycles.

The layer order is declared once, in ``LAYERS`` below (ARCHITECTURE.md explains it). The graph
is read with ``ast`` from every module of the installed packages, counting every import: at
module level, inside functions, and under ``if TYPE_CHECKING`` (a type-only cycle is still a
cycle a reader has to untangle).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("lowband", "transport", "diloco", "edge", "cli")

# Lowest first. A module may import from its own layer and from lower ones. Layers that share a
# rank (diloco and edge) are siblings: neither may import the other. The most specific prefix wins.
LAYERS: dict[str, int] = {
    "lowband": 0,  # core: Communicator Protocol, codecs, errors, process helpers, the model family
    "transport": 1,  # ZeroMQ transport, loopback, coordinator, slow-link testbeds
    "diloco": 2,  # the Streaming DiLoCo trainer
    "edge": 2,  # the inference runtime
    "cli": 3,  # the command line (composition root)
}
# Launchers (composition roots inside a package) may be imported only from the command line.
LAUNCHERS = ("diloco.launch", "diloco.site_launch", "diloco.demo_launch", "edge.launch")
NEVER_IMPORTED = ("benchmarks", "examples", "tests")
# The algorithms (diloco, edge) reach the network through lowband.comm.Communicator; only the
# launchers import transport. The one exception, for latency (ARCHITECTURE.md, "The network is
# injected"): the tensor-parallel star link, which the edge cluster and the compiled decode
# step drive themselves.
NETWORK_EXCEPTIONS: dict[str, tuple[str, ...]] = {
    "transport.starlink": (
        "edge.cluster.master",
        "edge.cluster.pipeline",
        "edge.cluster.replica",
        "edge.cluster.shard",
        "edge.cluster.worker",
        "edge.fastpath",
    ),
}


def layer_of(module: str) -> tuple[str, int]:
    best = max((p for p in LAYERS if module == p or module.startswith(p + ".")), key=len)
    return best, LAYERS[best]


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(path: Path, module: str) -> set[str]:
    """Every project module named by an import in ``path`` (absolute or relative)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    pkg = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = pkg.split(".")[: len(pkg.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            out.add(base)
            out.update(f"{base}.{a.name}" for a in node.names)  # `from pkg import module`
    return out


def import_graph(root: Path = REPO, packages: tuple[str, ...] = PACKAGES) -> dict[str, set[str]]:
    files = {module_name(p, root): p for pkg in packages for p in (root / pkg).rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for mod, path in files.items():
        graph[mod] = {m for m in imports_of(path, mod) if m in files and m != mod}
    return graph


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    bad = []
    for mod, deps in sorted(graph.items()):
        name, rank = layer_of(mod)
        for dep in sorted(deps):
            if dep.split(".")[0] in NEVER_IMPORTED:
                bad.append(f"{mod} imports {dep} ({dep.split('.')[0]} is never imported)")
                continue
            dname, drank = layer_of(dep)
            if drank > rank or (drank == rank and dname.split(".")[0] != name.split(".")[0]):
                bad.append(f"{mod} [{name}] imports {dep} [{dname}]")
            if dep in LAUNCHERS and rank < LAYERS["cli"] and mod not in LAUNCHERS:
                bad.append(f"{mod} imports the launcher {dep}")
    return bad


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def _without_package_inits(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    # A package's __init__ re-exporting its children is not a cycle a reader must untangle:
    # drop edges from a package to its own submodules.
    return {m: {d for d in deps if not d.startswith(m + ".")} for m, deps in graph.items()}


def test_no_upward_imports() -> None:
    assert upward_imports(import_graph()) == []


def transport_imports_of_algorithms(graph: dict[str, set[str]]) -> list[str]:
    """Imports of ``transport`` by library modules of diloco and edge that the exception list
    does not name."""
    bad = []
    for mod, deps in sorted(graph.items()):
        if mod.split(".")[0] not in ("diloco", "edge") or mod in LAUNCHERS:
            continue
        for dep in sorted(d for d in deps if d.split(".")[0] == "transport"):
            if dep == "transport":
                continue  # ``from transport import x`` is counted as transport.x as well
            if mod not in NETWORK_EXCEPTIONS.get(dep, ()):
                bad.append(f"{mod} imports {dep}")
    return bad


def test_algorithms_import_transport_only_through_the_named_exception() -> None:
    assert transport_imports_of_algorithms(import_graph()) == []
    planted = {
        "diloco.outer": {"transport.wire"},
        "diloco.launch": {"transport.zmq_comm"},
        "edge.cluster.master": {"transport.starlink"},
        "edge.engine": {"transport.starlink"},
    }
    assert transport_imports_of_algorithms(planted) == [
        "diloco.outer imports transport.wire",
        "edge.engine imports transport.starlink",
    ]


def test_no_import_cycles() -> None:
    assert cycles(_without_package_inits(import_graph())) == []


def test_installed_packages_never_import_benchmarks() -> None:
    graph = {m: set() for m in import_graph()}
    for pkg in PACKAGES:
        for p in (REPO / pkg).rglob("*.py"):
            mod = module_name(p, REPO)
            graph[mod] = {d for d in imports_of(p, mod) if d.split(".")[0] in NEVER_IMPORTED}
    assert {m: d for m, d in graph.items() if d} == {}


def _plant(tmp: Path, files: dict[str, str]) -> dict[str, set[str]]:
    for rel, text in files.items():
        p = tmp / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    return import_graph(tmp, ("lowband", "transport", "diloco", "edge"))


def test_a_planted_upward_import_is_caught(tmp_path: Path) -> None:
    graph = _plant(
        tmp_path,
        {
            "lowband/__init__.py": "",
            "lowband/errors.py": "",
            "lowband/codecs.py": "from diloco.outer import step\n",  # core -> trainer: upward
            "transport/__init__.py": "",
            "transport/wire.py": "from lowband import errors\n",
            "diloco/__init__.py": "",
            "diloco/outer.py": "import edge.model\n",  # sibling
            "edge/__init__.py": "",
            "edge/model.py": "from ..lowband import errors\n",
        },
    )
    bad = upward_imports(graph)
    assert any(b.startswith("lowband.codecs [lowband] imports diloco.outer") for b in bad), bad
    assert any(b.startswith("diloco.outer [diloco] imports edge.model") for b in bad), bad
    assert not any(b.startswith("transport.wire") for b in bad)


def test_a_planted_cycle_and_launcher_import_are_caught(tmp_path: Path) -> None:
    graph = _plant(
        tmp_path,
        {
            "lowband/__init__.py": "",
            "transport/__init__.py": "",
            "transport/a.py": "from transport.b import x\n",
            "transport/b.py": (
                "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from . import a\n"
            ),
            "diloco/__init__.py": "",
            "diloco/launch.py": "",
            "diloco/client.py": "from diloco.launch import f\n",
            "edge/__init__.py": "",
        },
    )
    assert cycles(graph) == [["transport.a", "transport.b"]]
    assert "diloco.client imports the launcher diloco.launch" in upward_imports(graph)


@pytest.mark.parametrize(
    "module,layer",
    [
        ("lowband.codecs", "lowband"),
        ("lowband.models.llama", "lowband"),
        ("cli.edge", "cli"),
        ("edge.moe.store", "edge"),
    ],
)
def test_layer_of(module: str, layer: str) -> None:
    assert layer_of(module)[0] == layer


def test_every_package_is_one_layer() -> None:
    # A package that spans layers (a sub-package ranked apart from its parent) puts the bottom
    # room's folder on top of the house: every rank is given to a whole top-level package.
    assert all("." not in name for name in LAYERS), LAYERS
    assert set(LAYERS) == set(PACKAGES)
