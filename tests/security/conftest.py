"""Helpers of the security tests: CURVE keypairs, a started advisor, polling."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from advisor.service import AdvisorService
from advisor.settings import AdvisorSettings
from event_plane import store
from event_plane.curve import keygen

BS = 4096


def chain(hashes: list[int], loc: str) -> list[Any]:
    """Store events of one prefix chain (first hash = prefix hash) at ``loc``."""
    out, parent = [], None
    for h in hashes:
        out.append(store(h, hashes[0], parent, BS, loc))
        parent = h
    return out


def wait_for(pred: Callable[[], bool], timeout: float = 15.0, what: str = "condition") -> None:
    """Poll ``pred`` until true; fail after ``timeout`` seconds (generous: the machine is shared)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(0.02)
    raise AssertionError(f"{what} not reached in {timeout} s")


def per_location(svc: AdvisorService, hashes: list[int]) -> dict[str, int]:
    """How many of ``hashes`` (a chain) the advisor's index holds, per location."""
    return dict(svc.query().lookup(hashes).per_location)


def settings(tmp_path: Path, urls: list[str], **kw: Any) -> AdvisorSettings:
    """Advisor settings for an ingest-only advisor journaling under ``tmp_path``."""
    base: dict[str, Any] = {"journal_path": str(tmp_path / "journal.sqlite"), "subscribe_urls": urls,
                            "api_enabled": False, "snapshot_store": "none", "policy_interval_s": 0,
                            "get_timeout_s": 0.05}
    return AdvisorSettings(**{**base, **kw})


@pytest.fixture()
def advisor() -> Iterator[Callable[[AdvisorSettings], AdvisorService]]:
    """Factory of started advisors, all stopped at the end."""
    started: list[AdvisorService] = []

    def make(s: AdvisorSettings) -> AdvisorService:
        svc = AdvisorService(s)
        started.append(svc)
        svc.start()
        return svc

    yield make
    for svc in started:
        svc.stop()


@pytest.fixture()
def keys(tmp_path: Path) -> Callable[[str], tuple[Path, Path]]:
    """``keys(name)`` -> ``(public file, secret file)`` of a new keypair in ``tmp_path/name/``."""

    def make(name: str) -> tuple[Path, Path]:
        return keygen(tmp_path / name, name)

    return make
