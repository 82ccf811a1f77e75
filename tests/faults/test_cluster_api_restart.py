"""Worker registrations of a scaled cluster's REST API (``python -m api.cluster_api``)
survive a restart of its process: each registration ``/register`` accepts is stored in the
cluster's JetStream KV (a real NATS server) before the answer, ``/unregister`` removes it, and
after a kill (-9) and a restart the API subscribes to the stored ones again, so their
workers' blocks are found again (worker 1's earlier ones through its replay socket) and new
events are indexed.  Volumes and drains are not accepted there (501): registrations are the
whole of its run-time state.  A stored value the API cannot read stops it with a one-line
error and leaves the value as it is (docs/operations.md, "Indexer API"; docs/reliability.md)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import httpx
import nats

from advisor.cluster.api_state import state_key
from storage_backends.local_s3 import free_port
from tests.faults._world import REPO, wait_until
from tests.faults.test_registrations_restart import BS, MODEL, _emitter, _kill, _scores, _store, check_restored


def _start(nats_url: str, ns: str, bucket: str, port: int, log: Path, **env: str) -> subprocess.Popen[str]:
    e = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""), **env)
    proc = subprocess.Popen([sys.executable, "-m", "api.cluster_api", "--nats", nats_url, "--namespace", ns,
                             "--partitions", "2", "--port", str(port), "--state-bucket", bucket],
                            stdout=subprocess.PIPE, stderr=log.open("a"), text=True, env=e)
    assert proc.stdout is not None
    line = proc.stdout.readline().strip()
    assert line.startswith("api http://"), (line, log.read_text()[-3000:])
    return proc


def _kv(nats_url: str, bucket: str, key: str, value: bytes | None = None, delete: bool = False) -> Any:
    """Read ``key`` of ``bucket`` (``None`` if absent), or put ``value``, or delete the bucket."""
    async def run() -> Any:
        nc = await nats.connect(nats_url)
        try:
            js = nc.jetstream()
            if delete:
                try:
                    await js.delete_key_value(bucket)
                except Exception:  # noqa: BLE001 - never created
                    pass
                return None
            kv = await js.key_value(bucket)
            if value is not None:
                return await kv.put(key, value)
            try:
                return (await kv.get(key)).value
            except nats.js.errors.KeyNotFoundError:
                return None
        finally:
            await nc.close()
    return asyncio.run(run())


def test_cluster_api_registrations_survive_a_killed_process(tmp_path: Path, nats_url: str) -> None:
    ns = f"capi-{uuid.uuid4().hex[:8]}"
    bucket = f"KVADVISOR_API_T{uuid.uuid4().hex[:8]}"
    port = free_port()
    log = tmp_path / "cluster_api.log"
    em1, pub1, rep1 = _emitter()
    em2, pub2, rep2 = _emitter()
    procs: list[subprocess.Popen[str]] = []
    try:
        procs.append(_start(nats_url, ns, bucket, port, log))
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10.0) as c:
            # the only run-time state the cluster's API takes: volumes and drains are refused
            assert c.post("/v1/volumes/fast/drain", json={}).status_code == 501
            assert c.delete("/v1/volumes/fast/drain").status_code == 501
            for inst, dp, pub, rep in ((1, 0, pub1, rep1), (2, 1, pub2, rep2), (3, 0, pub2, None)):
                r = c.post("/register", json={"instance_id": inst, "dp_rank": dp, "endpoint": pub,
                                              "replay_endpoint": rep, "model_name": MODEL, "block_size": BS})
                assert r.status_code == 200, r.text
            assert c.post("/unregister", json={"instance_id": 3, "model_name": MODEL}).json() == {"removed": 1}
            em1.send([_store(em1, [11, 12], 0)], dp_rank=0)
            wait_until(lambda: _scores(c) == {"1": {"0": 2 * BS}}, 30, "worker 1's blocks indexed")
        stored = json.loads(_kv(nats_url, bucket, state_key(ns)))
        assert [(r["instance_id"], r["dp_rank"]) for r in stored["registrations"]] == [(1, 0), (2, 1)]
        _kill(procs.pop())  # -9: nothing is written at stop

        procs.append(_start(nats_url, ns, bucket, port, log))
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10.0) as c:
            check_restored(c, em2, pub1, pub2)
            # a deregistration after the restart is stored too
            assert c.post("/unregister", json={"instance_id": 2, "model_name": MODEL}).json() == {"removed": 1}
        stored = json.loads(_kv(nats_url, bucket, state_key(ns)))
        assert [r["instance_id"] for r in stored["registrations"]] == [1]
        last = procs.pop()
        last.send_signal(signal.SIGTERM)
        assert last.wait(timeout=60) == 0

        # a value the API cannot read: a one-line error, exit 2, the value left as it was
        _kv(nats_url, bucket, state_key(ns), b"not json")
        proc = subprocess.run([sys.executable, "-m", "api.cluster_api", "--nats", nats_url, "--namespace", ns,
                               "--port", str(port), "--state-bucket", bucket], capture_output=True, text=True,
                              timeout=120, env=dict(os.environ, PYTHONPATH=str(REPO)))
        assert proc.returncode == 2, proc.stdout + proc.stderr
        assert proc.stdout.strip().startswith("error: stored registrations") and "Traceback" not in proc.stderr
        assert _kv(nats_url, bucket, state_key(ns)) == b"not json"
    finally:
        for p in procs:
            _kill(p)
        em1.close()
        em2.close()
        _kv(nats_url, bucket, "", delete=True)
