"""``gc_paused``: the collector is paused for a put / get and restored exactly, also when
the call fails, when calls nest or overlap on several threads, when a long wait ends the
pause early, and when the application had it disabled already.  And ``_fast_placement`` builds placements equal to normal ones."""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from storage_backends import BlockKey, BlockNotFoundError, MediaClass, Placement, SqliteCatalog, StorageAgent
from storage_backends import VolumeDescriptor, VolumeKind
from storage_backends.gcpause import gc_pause_yield, gc_paused
from storage_backends.sqlite_catalog import _fast_placement


@pytest.fixture
def agent(tmp_path: Path) -> Iterator[StorageAgent]:
    cat = SqliteCatalog(tmp_path / "c.sqlite")
    a = StorageAgent(cat, name=f"gc-{tmp_path.name}")
    a.register_volume(VolumeDescriptor("v", VolumeKind.POSIX, MediaClass.NVME, 1 << 30, root=str(tmp_path / "v")))
    yield a
    a.close()
    cat.close()


@pytest.fixture(autouse=True)
def _restore_gc() -> Iterator[None]:
    was = gc.isenabled()
    yield
    if was:
        gc.enable()
    else:
        gc.disable()


def test_put_and_get_pause_the_collector_and_restore_it(agent: StorageAgent, monkeypatch: pytest.MonkeyPatch) -> None:
    gc.enable()
    seen: list[bool] = []
    orig = agent.catalog.get_many

    def spy(keys):  # type: ignore[no-untyped-def]
        seen.append(gc.isenabled())
        return orig(keys)

    monkeypatch.setattr(agent.catalog, "get_many", spy)
    (p,) = agent.put([(BlockKey("ns", 1), torch.arange(100, dtype=torch.uint8))], "v")
    assert torch.equal(agent.get([p.key])[0], torch.arange(100, dtype=torch.uint8))
    assert seen == [False, False] and gc.isenabled()
    with pytest.raises(BlockNotFoundError):
        agent.get([BlockKey("ns", 2)])
    assert gc.isenabled()  # restored after a failing call too


def test_an_application_that_disabled_the_collector_keeps_it_disabled(agent: StorageAgent) -> None:
    gc.disable()
    (p,) = agent.put([(BlockKey("ns", 3), torch.ones(10, dtype=torch.uint8))], "v")
    agent.get([p.key])
    assert not gc.isenabled()


def test_nested_and_overlapping_pauses_share_one_pause() -> None:
    gc.enable()
    inside = threading.Event()
    release = threading.Event()

    def other() -> None:
        with gc_paused():
            inside.set()
            release.wait(5)

    t = threading.Thread(target=other)
    with gc_paused():
        t.start()
        assert inside.wait(5)
        with gc_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()
    assert not gc.isenabled()  # the other thread is still inside
    release.set()
    t.join(5)
    assert gc.isenabled()  # the last one out restored it


def test_a_long_wait_ends_the_pause_early_but_never_enables_a_disabled_collector() -> None:
    gc.enable()
    with gc_paused():
        assert not gc.isenabled()
        gc_pause_yield()  # e.g. a transfer still running after a second
        assert gc.isenabled()
    assert gc.isenabled()
    gc.disable()
    with gc_paused():
        gc_pause_yield()
        assert not gc.isenabled()
    assert not gc.isenabled()
    gc_pause_yield()  # outside a pause: nothing
    assert not gc.isenabled()


def test_fast_placements_equal_normal_ones() -> None:
    k = BlockKey("ns", 2**64 - 1)
    fast = _fast_placement(k, "v", 3, 4096, 65536, 2**63 + 5, 2)
    normal = Placement(k, "v", 3, 4096, 65536, 2**63 + 5, 2)
    assert fast == normal and hash(fast) == hash(normal) and repr(fast) == repr(normal)
    with pytest.raises(AttributeError):
        fast.offset = 0  # type: ignore[misc]  # still frozen
