"""The scaled topology from the CLI, as a new user runs it: ``kvadvisor up`` (3-node NATS
JetStream cluster, redis-server, S3 endpoint, 3 cluster advisors), ``kvadvisor demo
--scaled`` (workers publishing partitioned events; the cluster's index checked against what
the workers and the catalog hold, every block read back), ``kvadvisor down``."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import httpx

KVADVISOR = [sys.executable, "-m", "kvadvisor.cli"]
REPO = Path(__file__).resolve().parents[2]


def _run(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, COLUMNS="200", NIXL_LOG_LEVEL="WARN")
    return subprocess.run([*KVADVISOR, *args], capture_output=True, text=True, timeout=timeout, cwd=REPO, env=env)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").exists() and Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"


def test_up_scaled_demo_down(tmp_path: Path) -> None:
    root = tmp_path / "cluster"
    r = _run("up", "--dir", str(root))
    assert r.returncode == 0, r.stdout + r.stderr
    state_file = root / "cluster.json"
    try:
        assert stat.S_IMODE(state_file.stat().st_mode) == 0o600  # it holds the Redis password and S3 keys
        # logs/, nats/ (every event) and volumes/ (KV bytes) lie under a directory only its user enters
        assert stat.S_IMODE(root.stat().st_mode) == 0o700 and stat.S_IMODE((root / "logs").stat().st_mode) == 0o700
        state = json.loads(state_file.read_text())
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
        # a second `up` on the same directory is refused, nothing started twice
        again = _run("up", "--dir", str(root))
        assert again.returncode != 0 and "exists" in again.stderr + again.stdout

        r = _run("demo", "--scaled", "--dir", str(root), "--requests", "300")
        out = r.stdout + r.stderr
        assert r.returncode == 0, out
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
        # (policy rounds every 5 s); the API sums their results over partitions
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
    finally:
        d = _run("down", "--dir", str(root))
    assert d.returncode == 0, d.stdout + d.stderr
    assert not state_file.exists()
    assert not any(_alive(pid) for pid in state["pids"].values())
    assert state["api_url"].startswith("http://127.0.0.1:")
    # without a topology the scaled demo and `down` say so and exit non-zero
    r = _run("demo", "--scaled", "--dir", str(root), "--requests", "10")
    assert r.returncode != 0 and "kvadvisor up" in r.stdout + r.stderr
