"""The package's layers, read from its imports: compression (pure) -> collectives (transport) ->
strategies (Lightning adapters) -> launch / callbacks -> workload / cli. An import from a lower layer
into a higher one fails this test, except the ones listed in KNOWN_UPWARD (debts the redesign removes),
so no new one can creep in; and a known debt that is paid must leave the list."""

from __future__ import annotations

import ast

from helpers import ROOT

PACKAGE = ROOT / "lightning_dist"
LAYER = {
    "checks": 0,
    "warn": 0,
    "compat": 0,
    "compression": 1,
    "collectives": 2,
    "elastic": 2,
    "testing": 3,
    "strategies": 3,
    "launch": 4,
    "callbacks": 4,
    "install_horovod": 4,
    "workload": 5,
    "cli": 6,
}
"""Each top-level module or subpackage of lightning_dist and its layer: imports go to lower layers
(or within the same one)."""
KNOWN_UPWARD = {
    # fork_check, slurm_check, torchelastic: launch checks a strategy runs; with launch.slurm resolving
    # registered strategy names, strategies <-> launch is also an import cycle
    ("strategies", "launch"),
}
"""Upward imports that exist today (issue 23, item 5): each pair (importer, imported)."""


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


def test_every_part_of_the_package_has_a_layer() -> None:
    parts = {p.stem if p.is_file() else p.name for p in PACKAGE.iterdir() if not p.name.startswith("__")}
    parts = {p for p in parts if (PACKAGE / p).is_dir() or (PACKAGE / f"{p}.py").exists()} - {"py"}
    assert parts <= set(LAYER), f"give these a layer in tests/test_layering.py: {sorted(parts - set(LAYER))}"


def test_no_new_upward_import() -> None:
    upward = {
        pair: files
        for pair, files in import_pairs().items()
        if pair[1] != "__root__" and LAYER[pair[1]] > LAYER[pair[0]] and pair not in KNOWN_UPWARD
    }
    assert upward == {}, f"imports into a higher layer: {upward}"
    assert set(import_pairs()) >= KNOWN_UPWARD, "a known upward import is gone: remove it from KNOWN_UPWARD"


def test_the_pure_and_transport_layers_do_not_import_the_package_root() -> None:
    """compression and collectives must not import ``lightning_dist`` itself (which loads Lightning and
    every strategy); higher layers still do, through ``from lightning_dist import collectives``-style
    imports that name a lower part."""
    pairs = import_pairs()
    for low in ("compression", "collectives", "checks", "warn"):
        assert (low, "__root__") not in pairs, pairs.get((low, "__root__"))


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
