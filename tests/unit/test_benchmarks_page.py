"""docs/BENCHMARKS.md stays one current page: the headline table, then at most one table per
bench section, under 400 lines; its history lives in docs/benchmarks-history.md."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PAGE = REPO / "docs" / "BENCHMARKS.md"

_SPEC = importlib.util.spec_from_file_location("bench_summary", REPO / "bench" / "summary.py")
assert _SPEC and _SPEC.loader
summary = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(summary)


def _benches() -> list[str]:
    return sorted(p.stem for p in (REPO / "bench").glob("*.py") if not p.name.startswith("_") and p.stem != "summary")


def _sections(text: str) -> list[tuple[str, list[str]]]:
    out: list[tuple[str, list[str]]] = []
    for line in text.splitlines():
        if line.startswith("## "):
            out.append((line[3:], []))
        elif out:
            out[-1][1].append(line)
    return out


def test_page_is_short() -> None:
    assert len(PAGE.read_text().splitlines()) < 400


def test_headline_table_comes_first_and_names_every_bench() -> None:
    text = PAGE.read_text()
    start, end = text.index(summary.BEGIN), text.index(summary.END)
    assert "|---" not in text[:start], "a table before the headline table"
    rows = [r for r in text[start:end].splitlines() if r.startswith("| [`bench/")]
    named = [re.search(r"bench/(\w+)\.py", r).group(1) for r in rows]
    assert sorted(named) == _benches()
    assert len(text[start:end].splitlines()) == len(rows) + 3  # marker, header, separator, rows
    anchors = summary.section_anchors(text)
    for r, name in zip(rows, named):
        assert f"](#{anchors[name]})" in r, f"the {name} row does not link to its section"


def test_one_section_per_bench_with_at_most_one_table() -> None:
    sections = _sections(PAGE.read_text())
    for name in _benches():
        assert sum(f"bench/{name}.py" in title for title, _ in sections) == 1, f"bench/{name}.py: no section, or two"
    for title, body in sections:
        tables = sum(1 for line in body if line.startswith("|---"))
        assert tables <= 1 or title == "Headline figures", f"section {title!r} has {tables} tables"


def test_history_is_linked_and_kept() -> None:
    text = PAGE.read_text()
    assert "(benchmarks-history.md)" in text
    history = (REPO / "docs" / "benchmarks-history.md").read_text()
    # the dated rounds moved there, e.g. the pool's compiled-core round and the storage rounds
    assert "#### Compiled pool core round" in history and "### Previous round" in history
