"""The benches' ``--json`` reports and ``bench/summary.py`` (docs/BENCHMARKS.md, headline table).

The reports are real: the three fastest benches run here with small arguments (the advisor
index on 200 requests of the bundled slice, the partition skew of that slice, the runtime's
pool part with ``--quick``), each writing its report; summary.py then reads that folder.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PAGE = REPO / "docs" / "BENCHMARKS.md"
RUNS = {
    "advisor": ["--requests", "200", "--repeat", "1", "--epoch-blocks", "0"],
    "partition_skew": [],
    "runtime": ["--quick", "--pool-only"],
}
"""bench -> small arguments: the fastest benches, a few seconds of CPU each."""


def benches() -> list[Path]:
    """Every bench script: bench/*.py but the shared helper (_report.py) and summary.py."""
    return sorted(p for p in (REPO / "bench").glob("*.py") if not p.name.startswith("_") and p.name != "summary.py")


def _run(args: list[str], timeout: float = 600) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=str(REPO), NIXL_LOG_LEVEL="WARN")
    return subprocess.run([sys.executable, *args], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture(scope="module")
def reports(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("bench-reports")
    for name, args in RUNS.items():
        p = _run([f"bench/{name}.py", *args, "--json", str(out / f"{name}.json")])
        assert p.returncode == 0, f"bench/{name}.py failed:\n{p.stdout[-2000:]}\n{p.stderr[-2000:]}"
    return out


@pytest.mark.parametrize("script", benches(), ids=lambda p: p.name)
def test_every_bench_takes_json(script: Path) -> None:
    p = _run([str(script.relative_to(REPO)), "--help"], timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    assert re.search(r"--json PATH\s", p.stdout), f"{script.name} has no --json PATH option:\n{p.stdout}"


def test_reports_hold_the_common_fields(reports: Path) -> None:
    for name, args in RUNS.items():
        rep = json.loads((reports / f"{name}.json").read_text())
        assert rep["schema"] == 1 and rep["bench"] == name
        # the command is what was run, less the report's own path
        assert rep["command"] == " ".join(["python", f"bench/{name}.py", *args])
        assert rep["cpu"] and rep["cpu"] != "unknown"
        assert rep["cores"] == os.cpu_count()
        assert len(rep["load_start"]) == 3 and len(rep["load_end"]) == 3
        assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", rep["timestamp"])
        assert rep["started"] <= rep["timestamp"]
        assert rep["figures"], name
        for f in rep["figures"]:
            assert {"name", "ours", "reference", "ratio", "unit", "goal", "met", "better"} <= f.keys()
            assert isinstance(f["ours"], (int, float)) and f["unit"]
            if f["reference"]:
                assert f["ratio"] is not None and f["ratio"] > 0
    skew = json.loads((reports / "partition_skew.json").read_text())["figures"][0]
    # ours / reference as printed: the stretch scheme's skew against a whole chain by its ancestor
    assert skew["ratio"] == pytest.approx(skew["ours"] / skew["reference"])
    assert skew["headline"] and skew["unit"] == "max/mean"
    pool = json.loads((reports / "runtime.json").read_text())["figures"]
    assert [f["name"] for f in pool if f["headline"]] == ["pool: batch calls, events through zmq://, "
                                                          "requests of 16 blocks"]


def test_summary_prints_one_row_per_bench(reports: Path) -> None:
    p = _run(["bench/summary.py", str(reports)])
    assert p.returncode == 0, p.stderr
    rows = [line for line in p.stdout.splitlines() if line.startswith("| `bench/")]
    assert [re.search(r"bench/(\w+)\.py", r).group(1) for r in rows] == sorted(RUNS)
    skew = json.loads((reports / "partition_skew.json").read_text())["figures"][0]
    skew_row = next(r for r in rows if "partition_skew" in r)
    assert f"{skew['ours']:.2f} max/mean" in skew_row and f"{skew['ratio']:.2f}×" in skew_row
    assert "**met**" in skew_row if skew["met"] else "**not met**" in skew_row


def test_summary_rewrites_only_the_rows_it_has(reports: Path, tmp_path: Path) -> None:
    page = tmp_path / "BENCHMARKS.md"
    shutil.copy(PAGE, page)
    before = page.read_text()
    block = before[before.index("<!-- headline:begin -->"):before.index("<!-- headline:end -->")]
    old_rows = {re.search(r"bench/(\w+)\.py", r).group(1): r
                for r in block.splitlines() if r.startswith("| [`bench/") or r.startswith("| `bench/")}
    assert set(RUNS) <= old_rows.keys(), "the page's headline table lacks a bench the test runs"
    p = _run(["bench/summary.py", str(reports), "--write", str(page)])
    assert p.returncode == 0, p.stderr
    after = page.read_text()
    # outside the block nothing changed
    assert after[:after.index("<!-- headline:begin -->")] == before[:before.index("<!-- headline:begin -->")]
    assert after[after.index("<!-- headline:end -->"):] == before[before.index("<!-- headline:end -->"):]
    block = after[after.index("<!-- headline:begin -->"):after.index("<!-- headline:end -->")]
    new_rows = {re.search(r"bench/(\w+)\.py", r).group(1): r
                for r in block.splitlines() if r.startswith("| [`bench/") or r.startswith("| `bench/")}
    assert new_rows.keys() == old_rows.keys()  # same benches, same order
    for name, line in new_rows.items():
        if name in RUNS:
            rep = json.loads((reports / f"{name}.json").read_text())
            assert f"`{rep['command']}`" in line and rep["timestamp"][:10] in line
            # the bench cell links to the bench's own section of the page
            anchor = re.search(r"\]\(#([^)]+)\)", line).group(1)
            headings = [h[3:] for h in after.splitlines() if h.startswith("## ") and f"bench/{name}.py" in h]
            assert headings and anchor == re.sub(r"[^\w\- ]", "", headings[0].lower()).replace(" ", "-")
        else:
            assert line == old_rows[name]


def test_summary_refuses_a_bad_report_and_writes_nothing(reports: Path, tmp_path: Path) -> None:
    folder = tmp_path / "reports"
    shutil.copytree(reports, folder)
    (folder / "broken.json").write_text('{"schema": 1, "bench": "x", "figures": []}')
    page = tmp_path / "BENCHMARKS.md"
    shutil.copy(PAGE, page)
    before = page.read_text()
    p = _run(["bench/summary.py", str(folder), "--write", str(page)])
    assert p.returncode == 2
    assert p.stderr.strip().count("\n") == 0 and "broken.json" in p.stderr
    assert page.read_text() == before
    (folder / "broken.json").unlink()
    nomark = tmp_path / "plain.md"
    nomark.write_text("# no table here\n")
    p = _run(["bench/summary.py", str(folder), "--write", str(nomark)])
    assert p.returncode == 2 and "headline:begin" in p.stderr
    assert nomark.read_text() == "# no table here\n"
