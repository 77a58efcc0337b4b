"""The walls of the house (docs/architecture.md): every import of ``src/miserver`` read from the source, those under
``TYPE_CHECKING`` and inside functions included, checked against the floors of the architecture page.

- no two modules import each other, directly or round a longer circle;
- a room imports only rooms on lower floors (two rooms on one floor never import each other);
- the pure rooms import no web framework, ORM or torch where the page says so.

The floors are read from the table of ``docs/architecture.md`` itself, so the page and the code cannot drift apart.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src"
ARCHITECTURE = ROOT / "docs" / "architecture.md"

#: third-party packages each room must not import (the walls of DESIGN §2)
FORBIDDEN: dict[str, tuple[str, ...]] = {
    "miserver.protocol": ("fastapi", "starlette", "sqlalchemy", "torch", "transformers", "httpx"),
    "miserver.engines": ("fastapi", "starlette", "sqlalchemy"),
    "miserver.store": ("fastapi", "starlette", "torch", "transformers"),
    "miserver.scheduling": ("fastapi", "starlette", "sqlalchemy", "torch", "transformers", "httpx"),
    "miserver.batches": ("fastapi", "starlette", "torch", "transformers"),
    "miserver.services.batch_api": ("fastapi", "starlette", "torch", "transformers"),
    "miserver.services.inference": ("fastapi", "starlette", "sqlalchemy"),
}


@dataclass(frozen=True)
class Import:
    """``importer`` imports ``target`` (a module of miServer, or a top-level third-party package) at ``line``."""

    importer: str
    target: str
    line: int


def module_name(path: Path, src: Path = SRC) -> str:
    parts = list(path.relative_to(src).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def source_modules(src: Path = SRC) -> dict[str, Path]:
    """Every module of miServer under ``src`` (Alembic's migrations are history, not rooms)."""
    return {module_name(p, src): p for p in sorted(src.rglob("*.py")) if "migrations" not in p.parts}


def imports_of(name: str, path: Path, known: Iterable[str]) -> list[Import]:
    """Every import statement of the module, wherever it stands (module level, ``TYPE_CHECKING``, functions).

    ``from a import b`` names the module ``a.b`` when that is a module of miServer, else ``a``; third-party imports
    are reported by their top-level package.
    """
    modules = set(known)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: list[Import] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                target = alias.name if alias.name in modules else alias.name.split(".")[0]
                found.append(Import(name, target, node.lineno))
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            if base.split(".")[0] != "miserver":
                found.append(Import(name, base.split(".")[0], node.lineno))
                continue
            for alias in node.names:
                target = f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                found.append(Import(name, target, node.lineno))
    return [i for i in found if i.target != name]


def cycles(graph: Mapping[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0

    def visit(v: str) -> None:
        nonlocal counter
        index[v] = low[v] = counter
        counter += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def read_floors(text: str) -> dict[str, int]:
    """The rooms of the architecture page's floor table: rows ``| <floor> | `room`, `room` | ... |``."""
    floors: dict[str, int] = {}
    for line in text.splitlines():
        m = re.match(r"\|\s*(\d+)\s*\|([^|]*)\|", line)
        if m is None:
            continue
        for room in re.findall(r"`([a-z_.]+)`", m.group(2)):
            floors["miserver" if room == "miserver" else f"miserver.{room}"] = int(m.group(1))
    return floors


def room_of(module: str, floors: Mapping[str, int]) -> str | None:
    """The longest room name that is ``module`` or a package above it."""
    best = None
    for room in floors:
        if (module == room or module.startswith(room + ".")) and (best is None or len(room) > len(best)):
            best = room
    return best


def wall_breaks(edges: Iterable[Import], floors: Mapping[str, int]) -> list[str]:
    """Each import of a miServer module that does not go to a lower floor (or stay in its own room)."""
    broken = []
    for e in edges:
        if not e.target.startswith("miserver"):
            continue
        here, there = room_of(e.importer, floors), room_of(e.target, floors)
        if here is None or there is None or here == there:
            continue
        if floors[there] >= floors[here]:
            broken.append(
                f"{e.importer}:{e.line} imports {e.target} ({here} floor {floors[here]} -> {there} "
                f"floor {floors[there]})"
            )
    return broken


def _all_imports() -> list[Import]:
    modules = source_modules()
    return [i for name, path in modules.items() for i in imports_of(name, path, modules)]


def test_no_module_is_in_an_import_circle() -> None:
    graph: dict[str, set[str]] = {}
    for e in _all_imports():
        if e.target.startswith("miserver"):
            graph.setdefault(e.importer, set()).add(e.target)
    assert cycles(graph) == []


def test_every_module_has_a_room_on_the_architecture_page() -> None:
    floors = read_floors(ARCHITECTURE.read_text())
    homeless = [m for m in source_modules() if room_of(m, floors) is None]
    assert floors, "docs/architecture.md has no floor table"
    assert homeless == []


def test_no_import_runs_to_a_higher_floor_or_across_one() -> None:
    assert wall_breaks(_all_imports(), read_floors(ARCHITECTURE.read_text())) == []


def test_the_pure_rooms_import_no_framework() -> None:
    broken = [
        f"{e.importer}:{e.line} imports {e.target}"
        for e in _all_imports()
        for room, banned in FORBIDDEN.items()
        if (e.importer == room or e.importer.startswith(room + ".")) and e.target in banned
    ]
    assert broken == []


# -- the checker itself: it sees what it must see --------------------------------------------------------------------


def _tree(tmp_path: Path, files: dict[str, str]) -> dict[str, Path]:
    for rel, text in files.items():
        p = tmp_path / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    return source_modules(tmp_path)


def test_the_checker_counts_imports_under_type_checking_and_inside_functions(tmp_path: Path) -> None:
    modules = _tree(
        tmp_path,
        {
            "miserver/__init__.py": "",
            "miserver/store/__init__.py": "",
            "miserver/store/rows.py": (
                "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..batches import runner\n"
            ),
            "miserver/batches/__init__.py": "",
            "miserver/batches/runner.py": "def f():\n    from miserver.store import rows\n",
        },
    )
    edges = [i for n, p in modules.items() for i in imports_of(n, p, modules)]
    graph: dict[str, set[str]] = {}
    for e in edges:
        graph.setdefault(e.importer, set()).add(e.target)
    assert cycles(graph) == [["miserver.batches.runner", "miserver.store.rows"]]
    floors = {"miserver.store": 3, "miserver.batches": 8}
    assert [b.split(" ")[0] for b in wall_breaks(edges, floors)] == ["miserver.store.rows:3"]


def test_the_checker_refuses_two_rooms_of_one_floor_importing_each_other(tmp_path: Path) -> None:
    modules = _tree(
        tmp_path,
        {
            "miserver/__init__.py": "",
            "miserver/api/__init__.py": "",
            "miserver/api/files.py": "from ..events import notify\n",
            "miserver/events.py": "notify = 1\n",
        },
    )
    edges = [i for n, p in modules.items() for i in imports_of(n, p, modules)]
    assert len(wall_breaks(edges, {"miserver.api": 9, "miserver.events": 9})) == 1
    assert wall_breaks(edges, {"miserver.api": 9, "miserver.events": 8}) == []
