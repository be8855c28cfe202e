"""The package's layers, read from its imports: compression (pure) -> collectives (transport) ->
strategies (Lightning adapters) -> launch / callbacks -> workload / cli. An import from a lower layer
into a higher one fails this test, and so does an import cycle between any two modules (imports under
``TYPE_CHECKING`` and inside functions count: they are dependencies too). The pure and transport
layers import in a process where Lightning cannot be imported."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import ROOT, child_env

PACKAGE = ROOT / "lightning_dist"
LAYER = {
    "checks": 0,
    "warn": 0,
    "compat": 0,
    "fork_safety": 0,
    "import_hook": 0,
    "preflight": 0,
    "compression": 1,
    "algorithms": 1,
    "state": 1,
    "collectives": 2,
    "elastic": 2,
    "wire": 2,
    "layout": 2,
    "sync": 2,
    "testing": 3,
    "strategies": 3,
    "launch": 4,
    "callbacks": 4,
    "cluster": 4,
    "install_horovod": 4,
    "workload": 5,
    "cli": 6,
}
"""Each top-level module or subpackage of lightning_dist and its layer: imports go to lower layers
(or within the same one)."""
KNOWN_CYCLES: list[list[str]] = []
"""Import cycles that exist today, each as its sorted modules; a cycle that is gone must leave the list."""


def _target(node: ast.ImportFrom | ast.Import) -> list[str]:
    """The lightning_dist parts ``node`` imports: ``from lightning_dist import collectives`` is
    ``collectives``; the package root alone is ``__root__``."""
    names: list[str] = []
    if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "lightning_dist":
        parts = (node.module or "").split(".")
        if len(parts) > 1:
            names.append(parts[1])
        else:
            names += [a.name if a.name in LAYER else "__root__" for a in node.names]
    elif isinstance(node, ast.Import):
        for alias in node.names:
            parts = alias.name.split(".")
            if parts[0] == "lightning_dist":
                names.append(parts[1] if len(parts) > 1 else "__root__")
    return names


def import_pairs() -> dict[tuple[str, str], list[str]]:
    """(importer part, imported part) -> the files with such an import, for every import between parts."""
    pairs: dict[tuple[str, str], list[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE)
        if rel.parts == ("__init__.py",):
            continue  # the package root is the facade over every layer
        importer = rel.parts[0].removesuffix(".py")
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for imported in _target(node):
                    if imported != importer:
                        pairs.setdefault((importer, imported), []).append(str(rel))
    return pairs


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def module_graph() -> dict[str, set[str]]:
    """Each module of lightning_dist -> the modules of lightning_dist it imports, anywhere in its
    file. ``from lightning_dist.x import y`` is module ``lightning_dist.x.y`` where that is a module,
    else ``lightning_dist.x``."""
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                deps |= {a.name for a in node.names if a.name.split(".")[0] == "lightning_dist"}
            elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "lightning_dist":
                for alias in node.names:
                    full = f"{node.module}.{alias.name}"
                    deps.add(full if full in modules else str(node.module))
        graph[name] = deps - {name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = stack[stack.index(v) :]
            del stack[stack.index(v) :]
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def test_every_part_of_the_package_has_a_layer() -> None:
    parts = {p.stem if p.is_file() else p.name for p in PACKAGE.iterdir() if not p.name.startswith("__")}
    parts = {p for p in parts if (PACKAGE / p).is_dir() or (PACKAGE / f"{p}.py").exists()} - {"py"}
    assert parts <= set(LAYER), f"give these a layer in tests/test_layering.py: {sorted(parts - set(LAYER))}"


def test_no_upward_import() -> None:
    upward = {
        pair: files
        for pair, files in import_pairs().items()
        if pair[1] != "__root__" and LAYER[pair[1]] > LAYER[pair[0]]
    }
    assert upward == {}, f"imports into a higher layer: {upward}"


def test_no_import_cycle() -> None:
    found = cycles(module_graph())
    assert [c for c in found if c not in KNOWN_CYCLES] == [], "import cycles between these modules"
    assert [c for c in KNOWN_CYCLES if c not in found] == [], (
        "a known cycle is gone: remove it from KNOWN_CYCLES"
    )


def test_the_cycle_finder_finds_a_cycle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"e"}}
    assert cycles(graph) == [["a", "b", "c"]]
    assert cycles({**graph, "d": {"b"}}) == [["a", "b", "c", "d"]]


def test_the_pure_and_transport_layers_do_not_import_the_package_root() -> None:
    """compression and collectives must not import ``lightning_dist`` itself; higher layers may, and
    ``from lightning_dist import collectives``-style imports name a lower part."""
    pairs = import_pairs()
    for low in ("compression", "collectives", "checks", "warn", "fork_safety"):
        assert (low, "__root__") not in pairs, pairs.get((low, "__root__"))


BLOCK_LIGHTNING = """
import importlib.abc, sys

class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("lightning", "pytorch_lightning"):
            raise ModuleNotFoundError(f"No module named {name!r} (blocked by the test)", name=name)
        return None

sys.meta_path.insert(0, Block())
try:
    import lightning
except ModuleNotFoundError:
    pass
else:
    raise SystemExit("the block does not work")
"""


@pytest.mark.slow
def test_the_pure_and_transport_layers_import_without_lightning() -> None:
    """``import lightning_dist.compression`` (and collectives, elastic, the emulated cluster) in a
    process where Lightning cannot be imported: the package root and these layers never load it, and
    asking for a strategy there names what is missing."""
    code = BLOCK_LIGHTNING + (
        "import lightning_dist, lightning_dist.compression, lightning_dist.collectives\n"
        "import lightning_dist.elastic, lightning_dist.checks, lightning_dist.cluster\n"
        "from lightning_dist.compression import PowerSGD\n"
        "from lightning_dist.collectives import Communicator, SingleProcessBackend\n"
        "import torch\n"
        "t = Communicator(SingleProcessBackend()).all_reduce(torch.ones(3), 'avg')\n"
        "assert t.tolist() == [1.0, 1.0, 1.0], t\n"
        "loaded = sorted(m for m in sys.modules if m.split('.')[0] in ('lightning', 'pytorch_lightning'))\n"
        "assert not loaded, loaded\n"
        "print(sorted(m for m in sys.modules if m.startswith('lightning_dist.strategies.')))\n"
        "try:\n"
        "    lightning_dist.DDP\n"
        "except ModuleNotFoundError as err:\n"
        "    print(err.name)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=child_env(), cwd=ROOT
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    loaded, missing = proc.stdout.splitlines()
    assert loaded == str(
        [
            "lightning_dist.strategies.names",
            "lightning_dist.strategies.options",
            "lightning_dist.strategies.registry",
        ]
    ), f"only the name and option tables of the strategies load without Lightning: {loaded}"
    assert missing == "lightning", "lightning_dist.DDP names the missing package"


def _collectives_imports() -> dict[str, set[str]]:
    """Module of ``lightning_dist.collectives`` -> the modules of that package it imports (type-only
    imports included: they are cycles to a reader all the same)."""
    package = PACKAGE / "collectives"
    modules = {p.stem for p in package.glob("*.py")}
    graph: dict[str, set[str]] = {}
    for path in sorted(package.glob("*.py")):
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                parts = node.module.split(".")
                if parts[:2] == ["lightning_dist", "collectives"]:
                    if len(parts) > 2:
                        found.add(parts[2])
                    else:
                        found |= {a.name for a in node.names if a.name in modules}
        graph[path.stem] = found - {path.stem}
    return graph


def test_no_import_cycle_inside_collectives() -> None:
    """Adasum and the exchange driver take the backend (or the async calls) they need and hand their
    byte counts back: nothing below the communicator imports it, and no module of the transport layer
    reaches itself through others (``__init__``, the facade, is left out)."""
    graph = {m: deps - {"__init__"} for m, deps in _collectives_imports().items() if m != "__init__"}
    for low in ("adasum", "exchanges", "backend", "completer", "futures", "timeouts", "accounting"):
        assert "communicator" not in graph[low], f"{low} imports the communicator"

    def reaches(start: str) -> set[str]:
        seen: set[str] = set()
        todo = list(graph[start])
        while todo:
            m = todo.pop()
            if m not in seen and m in graph:
                seen.add(m)
                todo += graph[m]
        return seen

    cycles = sorted(m for m in graph if m in reaches(m))
    assert cycles == [], f"modules of collectives that import themselves through others: {cycles}"
