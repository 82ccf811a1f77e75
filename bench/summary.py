"""The headline table of docs/BENCHMARKS.md, from the benches' own JSON reports.

Every bench takes ``--json PATH`` and writes one report per run (bench/_report.py: ours,
the reference, ratio, units, command, CPU, load average, timestamp).  This script reads a
folder of such reports and prints one markdown row per bench (its headline figure):

    python bench/events.py --json results/events.json      # ... any benches, any order
    python bench/summary.py results/                        # print the headline table
    python bench/summary.py results/ --details              # and every figure, one table per bench
    python bench/summary.py results/ --write docs/BENCHMARKS.md

``--write`` replaces, between the lines ``<!-- headline:begin -->`` and
``<!-- headline:end -->`` of the page, the rows of the benches found in the folder; the rows
of the other benches stay as they are (a bench not run again keeps its last figures), and a
bench new to the table is added at the end.  When a folder holds several reports of one
bench, the newest (``timestamp``) wins.  A report that cannot be read stops the script with a
one-line error before anything is written.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from pathlib import Path
from typing import Any

BEGIN = "<!-- headline:begin -->"
END = "<!-- headline:end -->"
HEADER = ("| bench | headline figure | ours | reference | ratio | goal | command | machine, load average | date |\n"
          "|---|---|---|---|---|---|---|---|---|")
_BENCH_CELL = re.compile(r"bench/([A-Za-z0-9_]+)\.py")


class SummaryError(Exception):
    """A report or the page cannot be used; the message is one line naming the file."""


def load_reports(folder: Path) -> dict[str, dict[str, Any]]:
    """The newest report of each bench in ``folder`` (``*.json``, not recursive), by bench name.

    Raises:
        SummaryError: the folder is missing or holds no report, or a file is not a report
            of schema 1 (not JSON, no ``bench``, no figures, a figure without ``ours``).
    """
    if not folder.is_dir():
        raise SummaryError(f"{folder}: not a folder")
    found: dict[str, dict[str, Any]] = {}
    for path in sorted(folder.glob("*.json")):
        try:
            rep = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise SummaryError(f"{path}: not a JSON report ({exc})") from None
        if not isinstance(rep, dict) or rep.get("schema") != 1 or not isinstance(rep.get("bench"), str):
            raise SummaryError(f"{path}: not a bench report of schema 1 (bench/_report.py)")
        figs = rep.get("figures")
        if not isinstance(figs, list) or not figs or not all(isinstance(f, dict) and "ours" in f for f in figs):
            raise SummaryError(f"{path}: a bench report without figures")
        old = found.get(rep["bench"])
        if old is None or str(rep.get("timestamp", "")) > str(old.get("timestamp", "")):
            found[rep["bench"]] = rep
    if not found:
        raise SummaryError(f"{folder}: no bench reports (*.json)")
    return found


def fmt_number(x: float | None) -> str:
    """A figure for a table: thousands separators from 1,000, about 3 significant digits below."""
    if x is None:
        return "—"
    ax = abs(x)
    if float(x).is_integer() and ax < 1e15:
        return f"{int(x):,}"
    if ax >= 1000:
        return f"{x:,.0f}"
    if ax >= 100:
        return f"{x:.0f}"
    if ax >= 10:
        return f"{x:.1f}"
    if ax >= 1:
        return f"{x:.2f}"
    return f"{x:.3g}"


def fmt_ratio(fig: dict[str, Any]) -> str:
    """ours / reference as ``0.93×``; a small ratio of a lower-is-better figure also as 1/N."""
    r = fig.get("ratio")
    if r is None:
        return "—"
    text = f"{r:.2f}×" if r >= 0.1 else f"{r:.3g}×"
    if fig.get("better") == "lower" and 0 < r < 0.5:
        text += f" (1/{1 / r:.0f})"
    return text


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def headline(rep: dict[str, Any]) -> dict[str, Any]:
    """The report's headline figure: the one marked ``headline``, else the first."""
    return next((f for f in rep["figures"] if f.get("headline")), rep["figures"][0])


def machine(rep: dict[str, Any]) -> str:
    """``CPU, N cores, load a → b`` (1-minute load average at the start and the end of the run)."""
    load = ""
    if rep.get("load_start") and rep.get("load_end"):
        load = f", load {rep['load_start'][0]:.1f} → {rep['load_end'][0]:.1f}"
    pinned = rep.get("affinity")
    cores = rep.get("cores")
    pin = f" (pinned to {','.join(map(str, pinned))})" if pinned and cores and len(pinned) < cores else ""
    return f"{rep.get('cpu', 'unknown CPU')}, {cores} cores{pin}{load}"


def row(rep: dict[str, Any], anchors: dict[str, str] | None = None) -> str:
    """One headline-table row for a report; the bench cell links to its section when
    ``anchors`` (bench name → anchor) has it."""
    f = headline(rep)
    name = f"bench/{rep['bench']}.py"
    link = f"[`{name}`](#{anchors[rep['bench']]})" if anchors and rep["bench"] in anchors else f"`{name}`"
    unit = f" {f['unit']}" if f.get("unit") else ""
    ref = "—" if f.get("reference") is None else f"{fmt_number(f['reference'])}{unit}"
    if f.get("reference_name") and f.get("reference") is not None:
        ref += f" ({f['reference_name']})"
    goal = f.get("goal") or "—"
    if f.get("met") is not None:
        goal += " **met**" if f["met"] else " **not met**"
    cells = [link, f["name"], f"{fmt_number(f.get('ours'))}{unit}", ref, fmt_ratio(f), goal,
             f"`{rep.get('command', '')}`", machine(rep), str(rep.get("timestamp", ""))[:10]]
    return "| " + " | ".join(_cell(c) for c in cells) + " |"


def details(rep: dict[str, Any]) -> str:
    """Every figure of one report as a markdown table, under its command, machine and date."""
    lines = [f"### bench/{rep['bench']}.py", "",
             f"`{rep.get('command', '')}` — {machine(rep)}, {rep.get('timestamp', '')}"
             + (f", commit {rep['commit']}" if rep.get("commit") else ""), "",
             "| figure | ours | reference | ratio | goal |", "|---|---|---|---|---|"]
    for f in rep["figures"]:
        unit = f" {f['unit']}" if f.get("unit") else ""
        ref = "—" if f.get("reference") is None else f"{fmt_number(f['reference'])}{unit}"
        if f.get("reference_name") and f.get("reference") is not None:
            ref += f" ({f['reference_name']})"
        goal = (f.get("goal") or "—") + ("" if f.get("met") is None else (" met" if f["met"] else " not met"))
        lines.append("| " + " | ".join(_cell(c) for c in (
            f["name"], f"{fmt_number(f.get('ours'))}{unit}", ref, fmt_ratio(f), goal)) + " |")
    return "\n".join(lines)


def slug(heading: str) -> str:
    """GitHub's anchor of a markdown heading: lower case, punctuation dropped, spaces → ``-``."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def section_anchors(page: str) -> dict[str, str]:
    """bench name → anchor of the first ``##`` heading that names ``bench/<name>.py``."""
    out: dict[str, str] = {}
    for line in page.splitlines():
        if line.startswith("## "):
            for m in _BENCH_CELL.finditer(line):
                out.setdefault(m.group(1), slug(line[3:]))
    return out


def merge_table(page: str, reports: dict[str, dict[str, Any]]) -> str:
    """``page`` with the headline block's rows of ``reports``' benches replaced (or added).

    Raises:
        SummaryError: the page has no ``BEGIN`` ... ``END`` block.
    """
    start, end = page.find(BEGIN), page.find(END)
    if start < 0 or end < start:
        raise SummaryError(f"the page has no {BEGIN} ... {END} block")
    anchors = section_anchors(page)
    body = page[start + len(BEGIN):end]
    kept: list[tuple[str | None, str]] = []
    for line in body.splitlines():
        if not line.startswith("|") or line.startswith("| bench |") or line.startswith("|---"):
            continue
        m = _BENCH_CELL.search(line.split("|")[1])
        kept.append((m.group(1) if m else None, line))
    new = {name: row(rep, anchors) for name, rep in reports.items()}
    rows = [new.pop(name) if name in new else line for name, line in kept]
    rows += [new[name] for name in sorted(new)]
    return page[:start] + BEGIN + "\n" + HEADER + "\n" + "\n".join(rows) + "\n" + page[end:]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("folder", type=Path, help="folder of the benches' --json reports")
    ap.add_argument("--write", type=Path, default=None, metavar="PAGE",
                    help=f"replace these benches' rows between {BEGIN} and {END} in PAGE")
    ap.add_argument("--details", action="store_true", help="also print every figure, one table per bench")
    args = ap.parse_args(argv)
    try:
        reports = load_reports(args.folder)
        if args.write is not None:
            try:
                page = args.write.read_text()
            except OSError as exc:
                raise SummaryError(f"{args.write}: {exc.strerror}") from None
            try:
                merged = merge_table(page, reports)
            except SummaryError as exc:
                raise SummaryError(f"{args.write}: {exc}") from None
            tmp = args.write.with_name(args.write.name + ".tmp")
            tmp.write_text(merged)
            os.replace(tmp, args.write)
            print(f"{args.write}: {len(reports)} headline row(s) written ({', '.join(sorted(reports))})")
        else:
            print(HEADER)
            for name in sorted(reports):
                print(row(reports[name]))
        if args.details:
            for name in sorted(reports):
                print("\n" + details(reports[name]))
    except SummaryError as exc:
        print(f"summary: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
