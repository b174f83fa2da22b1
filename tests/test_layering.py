"""The package order the README states, checked on every first-party import.

    contract, proto → bbr → igw_envoy → picker → globalrouter → igw;  simulator and bench beside

A package may import only the packages listed for it below (its own modules
always). Every import counts, including ones inside functions and under
TYPE_CHECKING: a lazy import is still a dependency a reader must know about.
A new top-level package fails the test until it is given a place here.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# Where each first-party package's source lives (igw_envoy sits in envoy/ because
# xds-protos owns the importable name `envoy`).
SOURCES = {
    "contract": ROOT / "contract",
    "proto": ROOT / "proto",
    "bbr": ROOT / "bbr",
    "igw_envoy": ROOT / "envoy" / "igw_envoy",
    "picker": ROOT / "picker",
    "globalrouter": ROOT / "globalrouter",
    "igw": ROOT / "igw",
    "simulator": ROOT / "simulator",
    "bench": ROOT / "bench",
}

ALLOWED: dict[str, frozenset[str]] = {
    "contract": frozenset(),
    "proto": frozenset(),
    "bbr": frozenset({"contract"}),
    "igw_envoy": frozenset({"contract", "bbr"}),
    "picker": frozenset({"contract", "proto", "bbr", "igw_envoy"}),
    # Tier 2 (the global router): the picker framework one level up, on its transport.
    "globalrouter": frozenset({"contract", "bbr", "picker"}),
    "igw": frozenset({"contract", "proto", "bbr", "igw_envoy", "picker", "globalrouter"}),
    # A stand-in model server: it shares the contract and nothing of the gateway.
    "simulator": frozenset({"contract"}),
    # The benchmarks drive everything; nothing imports them (`igw bench` runs
    # bench.cli by module name).
    "bench": frozenset(
        {"contract", "proto", "bbr", "igw_envoy", "picker", "globalrouter", "igw", "simulator"}
    ),
}


def imported_modules(tree: ast.AST) -> Iterator[tuple[int, str]]:
    """(line, absolute module name) of every import statement in a module."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node.lineno, node.module


def package_edges(sources: dict[str, Path]) -> dict[tuple[str, str], list[str]]:
    """(importer, imported) package pairs, each with the `file:line` sites."""
    edges: dict[tuple[str, str], list[str]] = {}
    for package, folder in sources.items():
        for path in sorted(folder.rglob("*.py")):
            tree = ast.parse(path.read_text(), filename=str(path))
            for line, module in imported_modules(tree):
                top = module.split(".")[0]
                if top in sources and top != package:
                    site = f"{path.relative_to(folder.parent)}:{line} imports {module}"
                    edges.setdefault((package, top), []).append(site)
    return edges


def violations(
    edges: dict[tuple[str, str], list[str]], allowed: dict[str, frozenset[str]]
) -> list[str]:
    return [
        site
        for (src, dst), sites in sorted(edges.items())
        if dst not in allowed[src]
        for site in sites
    ]


def cycles(graph: dict[str, frozenset[str]]) -> list[list[str]]:
    """Every cycle found by a depth-first walk (empty for a DAG)."""
    found: list[list[str]] = []
    state: dict[str, int] = {}

    def walk(node: str, trail: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                found.append([*trail[trail.index(nxt):], nxt])
            elif nxt not in state:
                walk(nxt, [*trail, nxt])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            walk(node, [node])
    return found


def test_every_first_party_package_has_a_place() -> None:
    on_disk = {p.parent.name for p in ROOT.glob("*/__init__.py")}
    on_disk |= {p.parent.name for p in (ROOT / "envoy").glob("*/__init__.py")}
    on_disk -= {"tests"}
    assert on_disk == set(SOURCES), "place the new package in SOURCES and ALLOWED"
    assert set(ALLOWED) == set(SOURCES)


def test_the_allowed_order_has_no_cycle() -> None:
    assert cycles(ALLOWED) == []


def test_no_import_goes_up_the_layers() -> None:
    bad = violations(package_edges(SOURCES), ALLOWED)
    assert bad == [], "upward imports:\n" + "\n".join(bad)


def test_the_packages_import_each_other_without_a_cycle() -> None:
    graph: dict[str, frozenset[str]] = {}
    for src, dst in package_edges(SOURCES):
        graph[src] = graph.get(src, frozenset()) | {dst}
    assert cycles(graph) == []


def test_the_checker_catches_an_upward_import(tmp_path: Path) -> None:
    for name, body in {"low": "import high.thing\n", "high": "from low import x\n"}.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text("")
        (tmp_path / name / "mod.py").write_text(f"def f():\n    {body}")
    sources = {"low": tmp_path / "low", "high": tmp_path / "high"}
    edges = package_edges(sources)
    allowed = {"low": frozenset(), "high": frozenset({"low"})}
    assert violations(edges, allowed) == ["low/mod.py:2 imports high.thing"]
    graph = {src: frozenset({dst}) for src, dst in edges}
    assert cycles(graph) == [["high", "low", "high"]]


@pytest.mark.parametrize("package", ["contract", "proto"])
def test_the_bottom_layer_imports_no_first_party_package(package: str) -> None:
    assert not any(src == package for src, _ in package_edges(SOURCES))
