"""The scaled topology from the CLI, as a new user runs it, and its figures agreeing wherever
a user reads them.

One ``kvadvisor up`` (3-node NATS JetStream cluster with authorization, redis-server, an S3
endpoint, 3 cluster advisors with movers, the cluster API, eight partitions) and one
``kvadvisor demo --scaled --requests 300`` on it (workers publishing partitioned events; the
cluster's index checked against what the workers and the catalog hold, every block read
back) serve every test of this module: a topology and its demo cost about a minute of a
2-core machine, so they are made once (:func:`cluster`), and the tests run in the order
they are written: what one reads, the next may change (the third kills an advisor, the
last stops the topology and starts a smaller one on the same directory).

The advisors run a policy round every :data:`ROUND_S` seconds (``--policy-interval``; 5 by
default): the demo waits for about four rounds of the movers after its replay.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

KVADVISOR = [sys.executable, "-m", "kvadvisor.cli"]
REPO = Path(__file__).resolve().parents[2]
ROUND_S = "1"
"""``kvadvisor up --policy-interval`` here (module docstring)."""


def _run(*args: str, timeout: float = 400) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, COLUMNS="200", NIXL_LOG_LEVEL="WARN")
    return subprocess.run([*KVADVISOR, *args], capture_output=True, text=True, timeout=timeout, cwd=REPO, env=env)


def _rows(text: str) -> list[str]:
    """Table lines with the box characters gone and the cells single-spaced."""
    return [" ".join(ln.replace("│", " ").replace("┃", " ").split()) for ln in text.splitlines()]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").exists() and Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """``kvadvisor up --dir ROOT`` (the README's topology) and one ``kvadvisor demo --scaled
    --requests 300 --json`` on it: ``root``, ``up`` and ``demo`` (the commands' results),
    ``state`` (``cluster.json``), ``report`` (the demo's JSON report).  Stopped at the end
    unless a test stopped it."""
    tmp = tmp_path_factory.mktemp("scaled")
    root = tmp / "cluster"
    up = _run("up", "--dir", str(root), "--policy-interval", ROUND_S)
    assert up.returncode == 0, up.stdout + up.stderr
    try:
        state = json.loads((root / "cluster.json").read_text())
        report_file = tmp / "report.json"
        demo = _run("demo", "--scaled", "--dir", str(root), "--requests", "300", "--json", str(report_file))
        assert demo.returncode == 0, demo.stdout + demo.stderr
        yield {"root": root, "up": up, "demo": demo, "state": state, "report": json.loads(report_file.read_text()),
               "tmp": tmp}
    finally:
        if (root / "cluster.json").exists():
            d = _run("down", "--dir", str(root))
            assert d.returncode == 0, d.stdout + d.stderr


def test_up_keeps_its_secrets_private_and_refuses_a_second_up(cluster: dict[str, Any]) -> None:
    root, r, state = cluster["root"], cluster["up"], cluster["state"]
    state_file = root / "cluster.json"
    assert stat.S_IMODE(state_file.stat().st_mode) == 0o600  # it holds the Redis password and S3 keys
    # logs/, nats/ (every event) and volumes/ (KV bytes) lie under a directory only its user enters
    assert stat.S_IMODE(root.stat().st_mode) == 0o700 and stat.S_IMODE((root / "logs").stat().st_mode) == 0o700
    assert state["redis_url"].split("@")[0] not in r.stdout + r.stderr  # the password is never printed
    assert len(state["nats_urls"]) == 3 and len(state["advisors"]) == 3
    assert all(_alive(pid) for pid in state["pids"].values())
    password = state["redis_url"].split("@")[0].rsplit(":", 1)[1]
    # NATS runs with authorization: the users file is private, its passwords on no command line
    users_file = Path(state["nats_users"])
    assert stat.S_IMODE(users_file.stat().st_mode) == 0o600
    assert stat.S_IMODE(users_file.with_name("auth.conf").stat().st_mode) == 0o600
    nats_password = json.loads(users_file.read_text())["advisor"]
    assert nats_password not in r.stdout + r.stderr
    for pid in state["pids"].values():  # no secret on any command line (ps shows them to every user)
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
        assert password not in cmdline and nats_password not in cmdline
    # the advisors' policy rounds come as often as asked
    assert json.loads(Path(state["storage"]).read_text())["policy_interval_s"] == float(ROUND_S)
    # a second `up` on the same directory is refused, nothing started twice
    again = _run("up", "--dir", str(root))
    assert again.returncode != 0 and "exists" in again.stderr + again.stdout
    assert json.loads(state_file.read_text())["pids"] == state["pids"]


def test_scaled_report_status_and_stats_agree(cluster: dict[str, Any]) -> None:
    """The report of ``kvadvisor demo --scaled``, ``kvadvisor status --url`` and ``GET
    /v1/stats`` / ``GET /v1/volumes`` of the cluster's API show the same events, moves,
    sources and volumes (the demo is the topology's only replay)."""
    api, rep, r = cluster["state"]["api_url"], cluster["report"], cluster["demo"]
    stats = httpx.get(f"{api}/v1/stats", timeout=30).json()
    vols = {v["id"]: v for v in httpx.get(f"{api}/v1/volumes", timeout=30).json()["volumes"]}
    st = _run("status", "--url", api)
    assert st.returncode == 0, st.stdout + st.stderr
    status = _rows(st.stdout)

    # moves: the movers acted on the replay (the report waits for their rounds), and the
    # report, /v1/stats and status count the same ones
    m = stats["moves"]
    assert rep["promotions"] > 0, rep
    assert (rep["promotions"], rep["demotions"], rep["compactions"], rep["bytes_moved"]) == (
        m["promotions"], m["demotions"], m["compactions"], m["bytes_moved"]), (rep, m)
    assert sum(rep["failed_moves"].values()) == sum(m["failed"].values()) == 0
    moves_line = next(ln for ln in status if ln.startswith("moves:"))
    assert moves_line == (f"moves: {m['promotions']:,} promotions, {m['demotions']:,} demotions, "
                          f"{m['compactions']:,} compactions, {m['bytes_moved']:,} bytes moved, failed 0")

    # events: workers' + the movers' = what the partitions applied (a fresh topology)
    assert rep["advisor_events"] == stats["advisor_events"] > 0
    assert rep["events"] == rep["worker_events"] + rep["advisor_events"] == stats["events_applied"]
    head = status[status.index("blocks orphans pending events/s (10 s) events applied gaps dropped") + 2]
    assert head.split()[3] == f"{stats['events_applied']:,}", head

    # sources: each worker as its publishers counted it, each mover as the partitions applied it
    assert rep["sources"] == {k: {"batches": v["batches"], "events": v["events"]}
                              for k, v in stats["sources"].items()}, (rep["sources"], stats["sources"])
    assert any(k.endswith("-mover") for k in rep["sources"]) and sum(
        v["events"] for k, v in rep["sources"].items() if k.startswith("worker-")) == rep["worker_events"]
    report_text = _rows(r.stdout)
    src_line = next(ln for ln in report_text if ln.startswith("sources: batches / events"))
    for src, v in stats["sources"].items():
        assert f"{src} {v['batches']:,} / {v['events']:,}" in src_line, src_line
        row = next(ln for ln in status if ln.startswith(src + " "))
        assert f" {v['batches']:,} {v['events']:,} " in row and "never" not in row, row

    # volumes: the advisors' storage declaration, with usage and the blocks placed on each
    assert {k: v["role"] for k, v in vols.items()} == {"fast": "fast", "slow": "slow", "s3": "archive"}
    for vid, v in vols.items():
        checked = rep["verified"][vid]  # the demo's index == catalog check per volume
        assert checked["equal"], checked
        assert v["indexed_blocks"] == checked["index"] and v["blocks"] == checked["held"], (vid, v, checked)
        row = next(ln for ln in status if ln.startswith(f"{vid} {v['role']} "))
        assert row.split()[-1] == f"{v['indexed_blocks']:,}" and row.split()[3] == f"{v['used_bytes']:,}", row
    assert vols["slow"]["used_bytes"] > 0 and vols["fast"]["indexed_blocks"] > 0
    assert {v["id"]: (v["role"], v["indexed_blocks"], v["stats"]["blocks"]) for v in rep["volumes"]} == {
        k: (v["role"], v["indexed_blocks"], v["blocks"]) for k, v in vols.items()}


def test_scaled_demo_answers_across_partitions_and_outlives_an_advisor(cluster: dict[str, Any]) -> None:
    state, r = cluster["state"], cluster["demo"]
    out = r.stdout + r.stderr
    users_file = Path(state["nats_users"])
    # each demo worker published as a NATS user of its own, whose password is never printed
    workers_users = json.loads(users_file.read_text())["workers"]
    assert len(workers_users) == 2 and all(w.startswith("worker-") for w in workers_users)
    assert not any(pw in out for pw in workers_users.values())
    # the cluster's one query face: the same routes as one advisor's API
    api = state["api_url"]
    stats = httpx.get(f"{api}/v1/stats", timeout=30).json()
    assert stats["blocks"] > 0 and stats["ingest"]["origin_refused"] == 0
    # the report's events, ingest rate and stream URL; the API's sources agree with them
    rows = {ln.split("│")[1].strip(): ln.split("│")[2].strip() for ln in out.splitlines() if ln.count("│") >= 3}
    total, rest = rows["events (workers + advisor)"].split(" (", 1)
    worker_events = int(rest.split(" + ")[0].replace(",", ""))
    assert worker_events > 0 and int(total.replace(",", "")) >= worker_events
    rate = next(v for k, v in rows.items() if k.startswith("advisor ingest"))
    assert float(rate.split()[0].replace(",", "")) > 0, rate
    url_line = next(ln for ln in out.splitlines() if ln.startswith("event streams ("))
    assert f"?namespace={state['namespace']}&replicas=" in url_line and "…" not in url_line, url_line
    run_sources = {k: v for k, v in stats["sources"].items() if k.startswith("worker-")}
    assert run_sources and all(v["batches"] > 0 and v["events"] > 0 and v["last_seen"] for v in run_sources.values())
    assert sum(v["events"] for v in run_sources.values()) == worker_events
    assert stats["events_applied"] >= worker_events
    # `kvadvisor status --url` shows the same sources with their batches and events
    st = _run("status", "--url", api)
    assert st.returncode == 0, st.stdout + st.stderr
    lines = [" ".join(ln.replace("│", " ").split()) for ln in st.stdout.splitlines()]
    for src, v in run_sources.items():
        row = next(ln for ln in lines if ln.startswith(src + " "))
        assert f" {v['batches']:,} {v['events']:,} " in row and "never" not in row, row
    moves_line = next(ln for ln in lines if ln.startswith("moves:"))
    assert moves_line.split()[1].replace(",", "").isdigit()
    workers = sorted({loc.split("/")[0] for loc in stats["blocks_per_location"] if "/" in loc})
    held = httpx.get(f"{api}/v1/locations/{workers[0]}/g1/blocks", params={"limit": 1000}, timeout=30).json()
    # the listing is the union over partitions; the summed count holds each trunk block
    # (the shared first block) once per partition
    summed = stats["blocks_per_location"][f"{workers[0]}/g1"]
    assert held["count"] <= summed <= held["count"] + 7 * 8
    # a chain, walked up through its parents with /v1/blocks, is answered across partitions
    chain = [held["sequence_hashes"][len(held["sequence_hashes"]) // 2]]
    while True:
        info = httpx.get(f"{api}/v1/blocks/{chain[-1]}", timeout=30).json()
        if info["parent"] is None:
            break
        chain.append(info["parent"])
    chain.reverse()
    assert len(chain) > 1
    got = httpx.post(f"{api}/v1/lookup", json={"sequence_hashes": chain}, timeout=30).json()
    assert got["any_location"] == len(chain)  # every block of it is indexed somewhere
    assert httpx.post(f"{api}/v1/plans/run", timeout=30).status_code in (401, 403, 501)
    # the cluster advisors' movers promote the blocks the workers read back from `slow`
    # (a policy round every ROUND_S); the API sums their results over partitions
    moved: dict = {}
    for _ in range(60):
        moved = httpx.get(f"{api}/v1/stats", timeout=30).json()["moves"]
        if moved["done"]["promote"] > 0:
            break
        time.sleep(0.5)
    assert moved["done"]["promote"] > 0 and moved["bytes_by_kind"]["promote"] > 0, moved
    assert sum(moved["failed"].values()) == 0, moved
    # an advisor dies: while its partitions wait for the lease TTL, answers are 503 + Retry-After
    victim = state["pids"]["advisor-0"]
    os.kill(victim, 9)
    codes = set()
    for _ in range(40):
        resp = httpx.get(f"{api}/v1/stats", timeout=30)
        codes.add(resp.status_code)
        if resp.status_code == 503:
            assert int(resp.headers["Retry-After"]) >= 1
            assert resp.json()["error"] == "partition_unavailable"
        elif 503 in codes:
            break
        time.sleep(0.5)
    assert 503 in codes and 200 in codes, codes
    assert "7/7 locations" in out  # g1 and g2 of both workers, fast, slow and s3: index == held
    line = next(ln for ln in out.splitlines() if "read back byte-exact" in ln)
    ok, checked = (int(x.replace(",", "")) for x in line.split("│")[2].strip().split("/"))
    assert checked > 0 and ok == checked


def test_down_then_up_again_on_the_same_directory(cluster: dict[str, Any]) -> None:
    root, state, tmp = cluster["root"], cluster["state"], cluster["tmp"]
    d = _run("down", "--dir", str(root))
    assert d.returncode == 0, d.stdout + d.stderr
    assert not (root / "cluster.json").exists()
    assert not any(_alive(pid) for pid in state["pids"].values())
    assert state["api_url"].startswith("http://127.0.0.1:")
    # `up` again on the same directory (the README's default runs/cluster): the stopped
    # topology's stream and volumes went with its in-memory catalog; the new one starts
    # clean, so its figures are again this run's and no offload collides with an old segment
    r = _run("up", "--dir", str(root), "--nodes", "1", "--advisors", "1", "--partitions", "2",
             "--policy-interval", ROUND_S)
    assert r.returncode == 0, r.stdout + r.stderr
    report_file = tmp / "report-again.json"
    try:
        api = json.loads((root / "cluster.json").read_text())["api_url"]
        r = _run("demo", "--scaled", "--dir", str(root), "--requests", "60", "--json", str(report_file))
        assert r.returncode == 0 and "offload of" not in r.stdout + r.stderr, r.stdout + r.stderr
        rep = json.loads(report_file.read_text())
        stats = httpx.get(f"{api}/v1/stats", timeout=30).json()
        assert rep["sources"] == {k: {"batches": v["batches"], "events": v["events"]}
                                  for k, v in stats["sources"].items()}, (rep["sources"], stats["sources"])
        assert rep["events"] == stats["events_applied"] and rep["verified"]["bytes_ok"] == rep["verified"]["bytes_checked"]
    finally:
        d = _run("down", "--dir", str(root))
        assert d.returncode == 0, d.stdout + d.stderr
    # without a topology the scaled demo says so and exits non-zero
    r = _run("demo", "--scaled", "--dir", str(root), "--requests", "10")
    assert r.returncode != 0 and "kvadvisor up" in r.stdout + r.stderr
