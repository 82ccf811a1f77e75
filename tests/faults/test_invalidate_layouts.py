"""Invalidating a model retires every parallel layout of its blocks: TP=1 (the model's
namespace), TP=2 (``<ns>/tp0of2``, ``<ns>/tp1of2``, as ``KvbmConfig.namespace_suffix`` names
them) and pipeline stages (``<ns>/pp0of2``, ``<ns>/pp1of2``); another model's blocks stay,
also one whose namespace merely starts with the same characters (docs/operations.md)."""

from __future__ import annotations

from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from advisor import AdvisorService
from api import create_app
from kvbm_runtime.hashing import ModelFingerprint
from storage_backends import BlockKey
from tests.faults._world import Worker, chain, data, settings

MODEL = {"name": "m-par", "dtype": "float16", "layout": "FullyContiguous", "block_size": 32}
FP = ModelFingerprint(MODEL["name"], MODEL["dtype"], MODEL["layout"], MODEL["block_size"])
OTHER = ModelFingerprint("m-other", "float16", "FullyContiguous", 32).namespace()
LAYOUTS = {"tp1": [""], "tp2": ["/tp0of2", "/tp1of2"], "pp2": ["/pp0of2", "/pp1of2"]}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_invalidate_by_model_retires_every_parallel_layout(tmp_path: Path, layout: str) -> None:
    ns = FP.namespace()
    s = settings(tmp_path, api_enabled=True, api_port=0)
    w = Worker(s)
    try:
        with AdvisorService(s) as svc:
            hs = {"fast": [601, 602], "slow": [611, 612, 613]}
            n = 0
            for vol, hashes in hs.items():  # every rank stores the same sequence hashes in its own namespace
                for suffix in LAYOUTS[layout]:
                    w.agent.put([(BlockKey(ns + suffix, h), data(h)) for h in hashes], vol)
                    n += len(hashes)
                w.send(svc, "w0", *chain(hashes, vol))
            kept = [BlockKey(OTHER, 900), BlockKey(ns[:-1] + "x/tp0of2", 901), BlockKey(ns + "x", 902)]
            w.agent.put([(k, data(k.sequence_hash)) for k in kept], "slow")
            c = TestClient(create_app(svc.query()), base_url="http://127.0.0.1")
            r = c.post("/v1/actions/invalidate", json={"model": MODEL})
            assert r.status_code == 200, r.text
            ranks = len(LAYOUTS[layout])
            assert r.json() == {"namespace": ns, "deleted": {"fast": 2 * ranks, "slow": 3 * ranks},
                                "removes_published": 5}
            gone = [BlockKey(ns + sfx, h) for sfx in LAYOUTS[layout] for v in hs.values() for h in v]
            assert len(gone) == n and w.agent.locate(gone) == [None] * n
            assert all(p is not None for p in w.agent.locate(kept))
            assert all(g.equal(data(k.sequence_hash)) for g, k in zip(w.agent.get(kept), kept))
            assert svc.index.blocks_at("fast") == set() and svc.index.blocks_at("slow") == set()
            assert c.post("/v1/actions/invalidate", json={"model": MODEL}).json()["deleted"] == {}
    finally:
        w.close()
