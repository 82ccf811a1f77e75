"""The import graph: no circle anywhere, and every arrow points down (docs/design.md, "The
rooms of the advisor").

The graph is read with :mod:`ast` from the sources (nothing is imported).  Every import
counts: at module level, inside a function, and under ``TYPE_CHECKING`` (a type-only import
of a module that imports you back is still a circle for a reader; pass a ``Protocol``).
``from pkg import name`` is an arrow to ``pkg.name`` when that is a module, else to ``pkg``.
A parent package's ``__init__`` run by an import is not an arrow (as in import-linter).

The layers, lowest first; a module may import its own layer's unit or a lower layer, never a
higher one or a sibling unit of the same layer:

* packages: ``event_plane`` < ``storage_backends`` < ``kvbm_runtime``, ``advisor`` < ``api``
  < ``kvadvisor``;
* the advisor's rooms: ``index`` < ``ingest``, ``policy`` < ``moves`` < ``settings`` <
  ``ops`` < ``embedded``, ``cluster`` < the package face (``advisor/__init__.py``,
  ``advisor/__main__.py``).
"""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

#: Packages from the ground up; units on one layer may not import each other.
PACKAGE_LAYERS: Sequence[Sequence[str]] = (
    ("event_plane",),
    ("storage_backends",),
    ("kvbm_runtime", "advisor"),
    ("api",),
    ("kvadvisor",),
)

#: The advisor's rooms from the ground up (a top-level module is a room of its own).
ADVISOR_LAYERS: Sequence[Sequence[str]] = (
    ("advisor.index",),
    ("advisor.ingest", "advisor.policy"),
    ("advisor.moves",),
    ("advisor.settings",),
    ("advisor.ops",),
    ("advisor.embedded", "advisor.cluster"),
    ("advisor", "advisor.__main__"),
)
#: Units of ADVISOR_LAYERS that are the one module named, not what lies under it.
ADVISOR_EXACT = frozenset({"advisor"})


@dataclass(frozen=True)
class Arrow:
    """One import: ``src`` imports ``dst`` at ``line`` of ``path``."""

    src: str
    dst: str
    path: Path
    line: int


def modules(root: Path, packages: Iterable[str]) -> dict[str, Path]:
    """Every module of ``packages`` under ``root``: dotted name -> source path (``.py``, and
    ``.pyx`` for the compiled cores, whose imports count too)."""
    found: dict[str, Path] = {}
    for pkg in packages:
        for path in sorted((root / pkg).rglob("*")):
            if path.suffix not in (".py", ".pyx") or "__pycache__" in path.parts:
                continue
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def _imports(tree: ast.AST, name: str, is_pkg: bool) -> Iterable[tuple[str, list[str], int]]:
    """(base, names, line) for each import in ``tree``; relative bases resolved against ``name``."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, [], node.lineno
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                here = name.split(".") if is_pkg else name.split(".")[:-1]
                here = here[: len(here) - (node.level - 1)]
                base = ".".join([*here, base] if base else here)
            yield base, [a.name for a in node.names], node.lineno


def _cimports(text: str) -> Iterable[tuple[str, list[str], int]]:
    """The Python imports of a ``.pyx`` file (``import x`` / ``from x import y`` lines only)."""
    for i, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if line.startswith("import ") and " cimport" not in line:
            for part in line[len("import "):].split(","):
                yield part.split(" as ")[0].strip(), [], i
        elif line.startswith("from ") and " import " in line and " cimport " not in line:
            base, names = line[len("from "):].split(" import ", 1)
            yield base.strip(), [n.split(" as ")[0].strip(" ()") for n in names.split(",")], i


def import_graph(root: Path, packages: Iterable[str]) -> list[Arrow]:
    """Every arrow between modules of ``packages`` (imports of other code are left out)."""
    mods = modules(root, packages)
    arrows: list[Arrow] = []

    def resolve(dotted: str) -> str | None:
        while dotted and dotted not in mods:
            dotted = dotted.rpartition(".")[0]
        return dotted or None

    for name, path in mods.items():
        text = path.read_text()
        is_pkg = path.stem == "__init__"
        found = _cimports(text) if path.suffix == ".pyx" else _imports(ast.parse(text, str(path)), name, is_pkg)
        for base, names, line in found:
            targets = [f"{base}.{n}" for n in names if f"{base}.{n}" in mods] if names else []
            if names and len(targets) < len(names):
                targets.append(base)
            for dst in (targets or [base]):
                hit = resolve(dst)
                if hit is not None and hit != name:
                    arrows.append(Arrow(name, hit, path, line))
    return arrows


def circles(arrows: Sequence[Arrow]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    succ: dict[str, set[str]] = {}
    for a in arrows:
        succ.setdefault(a.src, set()).add(a.dst)
        succ.setdefault(a.dst, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = 0
    for start in sorted(succ):
        if start in index:
            continue
        work = [(start, iter(sorted(succ[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on.add(start)
        while work:
            v, it = work[-1]
            for w in it:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(succ[w]))))
                    break
                if w in on:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
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
    return out


def _unit(module: str, layers: Sequence[Sequence[str]], exact: frozenset[str] = frozenset()) -> tuple[int, str] | None:
    """(layer, unit) of the longest unit that ``module`` is or lies in (only is, for ``exact`` units)."""
    best: tuple[int, str] | None = None
    for depth, units in enumerate(layers):
        for unit in units:
            inside = module == unit or (unit not in exact and module.startswith(unit + "."))
            if inside and (best is None or len(unit) > len(best[1])):
                best = (depth, unit)
    return best


def upward(arrows: Sequence[Arrow], layers: Sequence[Sequence[str]], exact: frozenset[str] = frozenset()) -> list[Arrow]:
    """Arrows from a unit to a higher layer, or to another unit of the same layer (``exact``:
    units that are one module, not a package and what lies in it)."""
    bad = []
    for a in arrows:
        src, dst = _unit(a.src, layers, exact), _unit(a.dst, layers, exact)
        if src is None or dst is None or src[1] == dst[1]:
            continue
        if dst[0] >= src[0]:
            bad.append(a)
    return bad


def _show(arrows: Sequence[Arrow]) -> str:
    return "\n".join(f"{a.src} -> {a.dst} ({a.path.relative_to(ROOT) if a.path.is_relative_to(ROOT) else a.path}:{a.line})"
                     for a in arrows)


PACKAGES = [p for units in PACKAGE_LAYERS for p in units]


def test_no_import_circle() -> None:
    arrows = import_graph(ROOT, PACKAGES)
    assert len(arrows) > 500  # the graph was read (the code base has ~1,000 arrows)
    found = circles(arrows)
    assert not found, "import circles:\n" + "\n".join(
        " <-> ".join(c) + "\n" + textwrap.indent(_show([a for a in arrows if a.src in c and a.dst in c]), "    ")
        for c in found)


def test_packages_import_downward() -> None:
    bad = upward(import_graph(ROOT, PACKAGES), PACKAGE_LAYERS)
    assert not bad, "imports against the package layers:\n" + _show(bad)


def test_advisor_rooms_import_downward() -> None:
    arrows = import_graph(ROOT, ["advisor"])
    bad = upward(arrows, ADVISOR_LAYERS, ADVISOR_EXACT)
    assert not bad, "imports against the advisor's rooms:\n" + _show(bad)
    # every advisor module lies in a room: a new top-level module is placed on purpose
    loose = sorted(m for m in modules(ROOT, ["advisor"]) if _unit(m, ADVISOR_LAYERS, ADVISOR_EXACT) is None)
    assert not loose, f"advisor modules outside every room of ADVISOR_LAYERS: {loose}"


def _package(tmp: Path, files: Mapping[str, str]) -> None:
    for rel, body in files.items():
        path = tmp / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(body))


def test_checker_finds_a_planted_circle(tmp_path: Path) -> None:
    _package(tmp_path, {
        "low/__init__.py": "",
        "low/a.py": "from low.b import B\n",
        "low/b.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from low import c\nB = 1\n",
        "low/c.py": "def f():\n    from .a import B\n    return B\n",
        "low/d.py": "import low.a\n",
        "high/__init__.py": "from low.d import *\n",
    })
    arrows = import_graph(tmp_path, ["low", "high"])
    assert circles(arrows) == [["low.a", "low.b", "low.c"]]
    # the same tree without the function-level import has none
    (tmp_path / "low/c.py").write_text("X = 1\n")
    assert circles(import_graph(tmp_path, ["low", "high"])) == []


def test_checker_finds_an_upward_arrow(tmp_path: Path) -> None:
    _package(tmp_path, {
        "low/__init__.py": "",
        "low/x.py": "def f():\n    import high.y\n",
        "mid/__init__.py": "", "mid/z.py": "from low import x\n",
        "side/__init__.py": "", "side/w.py": "from mid.z import *\n",
        "high/__init__.py": "", "high/y.py": "from low.x import f\nfrom mid import z\n",
    })
    bad = upward(import_graph(tmp_path, ["low", "mid", "side", "high"]), [("low",), ("mid", "side"), ("high",)])
    assert sorted((a.src, a.dst) for a in bad) == [("low.x", "high.y"), ("side.w", "mid.z")]


def test_checker_fails_the_suite_on_a_planted_circle(tmp_path: Path) -> None:
    """Plant a circle in a copy of the advisor package: the check above then fails."""
    import shutil

    copy = tmp_path / "repo"
    for pkg in PACKAGES:
        shutil.copytree(ROOT / pkg, copy / pkg, ignore=shutil.ignore_patterns("*.so", "__pycache__", "*.c"))
    shutil.copytree(Path(__file__).parent, copy / "tests" / "unit", ignore=shutil.ignore_patterns("__pycache__"))
    low = copy / "advisor" / "index" / "frequency.py"
    low.write_text(low.read_text() + "\n\ndef _planted():\n    from advisor.embedded import service\n    return service\n")
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=",
                          str(copy / "tests/unit/test_layering.py"), "-k", "circle and not planted and not checker"],
                         capture_output=True, text=True, timeout=120, cwd=copy)
    assert run.returncode == 1, run.stdout[-3000:] + run.stderr[-3000:]
    assert "advisor.index.frequency" in run.stdout and "import circles" in run.stdout, run.stdout[-3000:]
