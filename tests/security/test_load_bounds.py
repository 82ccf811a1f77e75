"""``POST /load`` is bounded, over a real uvicorn server: ``copies`` costs one step per block,
not one per copy (4,096 blocks at 65,536 copies: 268 M steps on main, minutes of CPU), and
the number of ``(model, tenant)`` indexes is capped (429 beyond)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
from security_fixtures import advisor  # noqa: F401 - fixture
from security_helpers import settings

from storage_backends.local_s3 import free_port


def dump_event(first: int, n: int, copies: int) -> dict[str, Any]:
    return {"instance_id": 1, "dp_rank": 0, "event": {"stored": {
        "parent_hash": None, "medium": "g1", "copies": copies,
        "blocks": [{"block_hash": h, "tokens_hash": h, "sequence_hash": h} for h in range(first, first + n)]}}}


def test_load_copies_cost_one_step_per_block_and_indexes_are_capped(tmp_path: Path, advisor: Any) -> None:
    svc = advisor(settings(tmp_path, [], api_enabled=True, api_port=free_port()))
    with httpx.Client(base_url=svc.api_url, timeout=120) as c:  # generous: the answer takes milliseconds
        r = c.post("/load", json={"block_size": 16, "dump": {"m:t": [dump_event(1, 4096, 65_536)]}})
        assert r.status_code == 200, r.text
        assert r.json()["blocks"] == 4096 * 65_536
        dumped = c.get("/dump").json()["m:t"]
        assert dumped and all(e["event"]["stored"]["copies"] == 65_536 for e in dumped)
        codes = [c.post("/load", json={"block_size": 16, "dump": {f"model-{k}:t": [dump_event(1, 1, 1)]}}).status_code
                 for k in range(70)]
        assert codes.count(200) == 63 and codes[63:] == [429] * 7  # 64 indexes with m:t
        assert c.get("/dump").status_code == 200
