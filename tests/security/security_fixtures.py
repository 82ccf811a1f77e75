"""Fixtures of the security tests: started advisors, CURVE keypairs.  Test modules import
them by name (a ``conftest.py`` here would shadow the top-level one that other test
directories import helpers from)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from advisor.embedded.service import AdvisorService
from advisor.settings import AdvisorSettings
from event_plane.curve import keygen


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
