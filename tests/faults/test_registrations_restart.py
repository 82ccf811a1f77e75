"""Worker registrations of the indexer-compatible API survive a restart of the advisor's
process: a registration is stored when ``/register`` accepts it and a deregistration removes
it, so after a kill (-9) and a restart the workers are registered again and their events
reach the index (a worker's earlier blocks through its replay socket); at a restart under a
narrower allow-list the stored ones are refused, dropped, logged and counted
(docs/operations.md, "Indexer API"; docs/reliability.md)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from advisor.embedded.run_state import RunStateStore
from api.token_hashes import local_block_hashes
from event_plane.adapters import PeerEmitter
from storage_backends.local_s3 import free_port
from tests.faults._world import REPO, settings, wait_until

BS = 16
MODEL = "tiny-llama"
TOKENS = list(range(2000, 2000 + 4 * BS))
RUN_ADVISOR = r"""
import sys
from advisor import AdvisorService, AdvisorSettings
svc = AdvisorService(AdvisorSettings.from_json_file(sys.argv[1]))
svc.start()
print("STARTED", flush=True)
svc.run_forever()
"""


def _start(cfg: Path, log: Path, **env: str) -> subprocess.Popen[str]:
    e = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""), **env)
    proc = subprocess.Popen([sys.executable, "-c", RUN_ADVISOR, str(cfg)], stdout=subprocess.PIPE,
                            stderr=log.open("a"), text=True, env=e)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "STARTED", log.read_text()[-3000:]
    return proc


def _kill(proc: subprocess.Popen[str]) -> None:
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)


def _workers(c: httpx.Client) -> list[tuple[int, dict[str, str]]]:
    return [(w["instance_id"], w["endpoints"]) for w in c.get("/workers").json()]


def _scores(c: httpx.Client) -> dict[str, Any]:
    return c.post("/query", json={"token_ids": TOKENS, "model_name": MODEL}).json().get("scores", {})


def _emitter() -> tuple[PeerEmitter, str, str]:
    pub, rep = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    return PeerEmitter(pub, rep, flavor="vllm", form="map"), pub, rep


def _store(em: PeerEmitter, hashes: list[int], first_block: int) -> Any:
    return em.stored(hashes, None, block_size=BS, token_ids=TOKENS[first_block * BS:(first_block + len(hashes)) * BS])


def check_restored(c: httpx.Client, em2: PeerEmitter, pub1: str, pub2: str) -> None:
    """After a restart: workers 1 (dp 0, at ``pub1``) and 2 (dp 1, at ``pub2``) registered
    again, worker 1's two blocks back through its replay socket, worker 2's new events
    (sent by ``em2``) indexed."""
    wait_until(lambda: _workers(c) == [(1, {"0": pub1}), (2, {"1": pub2})], 60, "registrations restored")
    wait_until(lambda: _scores(c).get("1") == {"0": 2 * BS}, 30, "worker 1 caught up through its replay")

    def _w2_seen() -> bool:
        em2.send([_store(em2, [21, 22, 23], 0)], dp_rank=1)
        time.sleep(0.2)  # a resend cadence, not a wait for the result (polled by wait_until)
        return _scores(c).get("2") == {"1": 3 * BS}

    wait_until(_w2_seen, 30, "worker 2's new events indexed")
    local = local_block_hashes(TOKENS, BS)
    r = c.post("/query_by_hash", json={"block_hashes": local[:2], "model_name": MODEL}).json()
    assert r["scores"] == {"1": {"0": 2 * BS}, "2": {"1": 2 * BS}}


def test_registrations_survive_a_killed_advisor_and_are_checked_again(tmp_path: Path) -> None:
    port = free_port()
    s = settings(tmp_path, api_enabled=True, api_port=port)
    cfg = tmp_path / "advisor.json"
    cfg.write_text(s.model_dump_json())
    cfg.chmod(0o600)
    log = tmp_path / "advisor.log"
    em1, pub1, rep1 = _emitter()
    em2, pub2, rep2 = _emitter()
    procs: list[subprocess.Popen[str]] = []
    try:
        procs.append(_start(cfg, log))
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10.0) as c:
            for inst, dp, pub, rep in ((1, 0, pub1, rep1), (2, 1, pub2, rep2), (3, 0, pub2, None)):
                body = {"instance_id": inst, "dp_rank": dp, "endpoint": pub, "replay_endpoint": rep,
                        "model_name": MODEL, "block_size": BS}
                r = c.post("/register", json=body)
                assert r.status_code == 200, r.text
            assert c.post("/unregister", json={"instance_id": 3, "model_name": MODEL}).json() == {"removed": 1}
            em1.send([_store(em1, [11, 12], 0)], dp_rank=0)
            wait_until(lambda: _scores(c) == {"1": {"0": 2 * BS}}, 30, "worker 1's blocks indexed")
        _kill(procs.pop())  # -9: nothing is written at stop

        procs.append(_start(cfg, log))
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10.0) as c:
            check_restored(c, em2, pub1, pub2)
        _kill(procs.pop())

        # today's allow-list no longer holds loopback: both are refused, dropped and counted
        procs.append(_start(cfg, log, KVADVISOR_API_REGISTER_NETWORKS='["10.0.0.0/8"]'))
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10.0) as c:
            wait_until(lambda: c.get("/v1/stats").json()["ingest"]["registrations_dropped"] == 2, 60,
                       "refused registrations counted")
            assert _workers(c) == []
        last = procs.pop()
        last.send_signal(signal.SIGTERM)
        last.wait(timeout=60)
        text = log.read_text()
        assert "instance 1 dp_rank 0" in text and "endpoint_not_allowed" in text, text[-3000:]
        store = RunStateStore(s.journal_path)
        try:
            assert store.admin()["registrations"] == []  # dropped for good
        finally:
            store.close()
    finally:
        for p in procs:
            _kill(p)
        em1.close()
        em2.close()


class _FailingStore:
    """A store whose writes fail (a full or read-only journal file)."""

    def load_registrations(self) -> list[dict[str, Any]]:
        return []

    def save_registrations(self, registrations: list[dict[str, Any]]) -> None:
        raise OSError(28, "No space left on device")

    def count_registrations_dropped(self, n: int) -> None:
        raise AssertionError("nothing to drop")


def test_a_registration_that_cannot_be_stored_is_undone() -> None:
    from api.errors import ApiError
    from api.indexer_registry import IndexerRegistry, Registration

    em, pub, rep = _emitter()
    reg = IndexerRegistry(store=_FailingStore())
    try:
        try:
            reg.register(Registration(1, 0, MODEL, "default", pub, rep, BS))
            raise AssertionError("accepted without being stored")
        except ApiError as exc:
            assert (exc.status, exc.error) == (503, "state_not_saved")
        assert reg.registrations() == []
        idx = reg.index(MODEL, "default")
        assert idx is not None and idx.overlap(local_block_hashes(TOKENS, BS)).blocks == {}
    finally:
        reg.close()
        em.close()
