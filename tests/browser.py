"""Headless Chromium for dashboard tests: run Debian's chromium, read the DOM it dumps.

Shared by tests that load ``/dashboard`` (tests/integration/test_api_dashboard.py,
tests/e2e/test_pipeline.py); ``.ci/services.sh`` installs chromium.
"""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass
from html.parser import HTMLParser
from pathlib import Path

import pytest

CHROMIUM = Path("/usr/bin/chromium")


# ---------------------------------------------------------------- DOM reading
@dataclass
class Node:
    tag: str
    attrs: dict[str, str]
    text: str = ""
    row: str | None = None  # data-key of the enclosing <tr>
    table: str | None = None  # id of the enclosing <tbody>
    hidden: bool = False


class Dom(HTMLParser):
    """Elements with an ``id`` or ``data-field`` of a dumped DOM, with their text."""

    VOID = frozenset({"meta", "link", "br", "img", "input", "hr", "col", "source", "wbr"})

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.by_id: dict[str, Node] = {}
        self.cells: list[Node] = []
        self._stack: list[tuple[str, Node | None, str | None, str | None]] = []  # (tag, node, row, tbody)
        self._open: list[Node] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = {k: v or "" for k, v in attrs}
        row = self._stack[-1][2] if self._stack else None
        table = self._stack[-1][3] if self._stack else None
        if tag == "tr":
            row = a.get("data-key")
        if tag == "tbody":
            table = a.get("id")
        node = None
        if "id" in a or "data-field" in a:
            node = Node(tag, a, row=row, table=table, hidden="hidden" in a)
            if "id" in a:
                self.by_id[a["id"]] = node
            if "data-field" in a:
                self.cells.append(node)
            self._open.append(node)
        if tag not in self.VOID:
            self._stack.append((tag, node, row, table))

    def handle_endtag(self, tag: str) -> None:
        while self._stack:
            t, node, _r, _tb = self._stack.pop()
            if node is not None:
                self._open.remove(node)
            if t == tag:
                break

    def handle_data(self, data: str) -> None:
        for node in self._open:
            node.text += data

    def table(self, tbody: str) -> dict[str, dict[str, Node]]:
        """``{row data-key: {data-field: cell}}`` of one ``<tbody id=...>``."""
        out: dict[str, dict[str, Node]] = {}
        for c in self.cells:
            if c.table == tbody and c.row is not None:
                out.setdefault(c.row, {})[c.attrs["data-field"]] = c
        return out

    def num(self, id_: str) -> int:
        """Raw value (``data-value``) of a key number, checked against its displayed text."""
        node = self.by_id[id_]
        value = int(node.attrs["data-value"])
        assert node.text.strip().replace(",", "") == str(value), (id_, node.text)
        return value


def parse_dom(html: str) -> Dom:
    dom = Dom()
    dom.feed(html)
    dom.close()
    return dom


# ---------------------------------------------------------------- browser
def chromium_cmd(tmp: Path, name: str, *extra: str) -> list[str]:
    if not CHROMIUM.exists():
        pytest.fail(f"{CHROMIUM} is missing: run `.ci/services.sh` as root (it installs Debian's chromium)")
    return [
        str(CHROMIUM), "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync",
        "--disable-dev-shm-usage", "--hide-scrollbars", f"--user-data-dir={tmp / ('profile-' + name)}",
        "--virtual-time-budget=5000", *extra,
    ]


def run_browsers(jobs: list[list[str]], timeout_s: float = 40.0) -> list[subprocess.CompletedProcess[str]]:
    """Run chromium invocations in parallel; each must exit 0."""
    env = {**os.environ, "HOME": os.environ.get("HOME", "/tmp")}
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env) for cmd in jobs]
    out = []
    for cmd, p in zip(jobs, procs):
        try:
            stdout, stderr = p.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise AssertionError(f"chromium did not finish within {timeout_s} s: {cmd}") from None
        assert p.returncode == 0, f"chromium exited {p.returncode}: {stderr[-2000:]}"
        out.append(subprocess.CompletedProcess(cmd, p.returncode, stdout, stderr))
    return out


