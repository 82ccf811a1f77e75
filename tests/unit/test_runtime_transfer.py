"""Transfer manager: step-gated offloads, batching, cancellation, weak → strong upgrade,
G2 → G1 onboarding, disk admission filter."""

from __future__ import annotations

import time

import pytest
import torch

from event_plane import KVEvent, NullPublisher
from kvbm_runtime import BlockMeta, BlockPool, LayoutConfig, RuntimeMetrics, make_layout
from kvbm_runtime.transfer import (
    DiskOffloadFilter,
    HostOffloadItem,
    StepEvent,
    TransferClosedError,
    TransferManager,
    TransferPath,
)

CFG = LayoutConfig(num_layers=2, outer_dim=2, page_size=4, inner_dim=8, dtype=torch.float32)
SALT = 7


class Capture:
    def __init__(self) -> None:
        self.batches: list[list[KVEvent]] = []
        self.publisher = NullPublisher("transfer-unit", on_flush=lambda b, _p: self.batches.append(list(b.events)))

    def events(self) -> list[tuple[str, int, str]]:
        self.publisher.flush()
        return [(e.type.name, e.sequence_hash, e.storage_location) for b in self.batches for e in b]

    def clear(self) -> None:
        self.publisher.flush()
        self.batches.clear()


class Rig:
    """A G1 pool, a G2 pool and a transfer manager over them (no storage)."""

    def __init__(self, device: torch.device, g1_blocks: int = 8, g2_blocks: int = 8, batch: int = 256) -> None:
        self.cap = Capture()
        self.device = device
        self.g1 = BlockPool("g1", make_layout("FullyContiguous", CFG, g1_blocks, device, tier="g1"), self.cap.publisher)
        self.g2 = BlockPool("g2", make_layout("FullyContiguous", CFG, g2_blocks, tier="g2"), self.cap.publisher)
        self.metrics = RuntimeMetrics("transfer-unit")
        self.tm = TransferManager(self.g2, self.cap.publisher, self.metrics, max_batch_blocks=batch)

    def registered(self, hashes: list[int]) -> list:
        """Register blocks with these hashes in G1 (data = hash value) and return strong handles."""
        blocks = self.g1.allocate(len(hashes))
        ready = []
        for i, (mb, h) in enumerate(zip(blocks, hashes)):
            mb.view().fill_(float(h % 1000))
            ready.append(mb.init_from(BlockMeta(h, hashes[i - 1] if i else None, hashes[0], SALT)))
        return self.g1.register_blocks(ready)

    def items(self, handles: list) -> list[HostOffloadItem]:
        return [HostOffloadItem(h.meta, self.g1.layout, h.block_id, h.weak()) for h in handles]

    def close(self) -> None:
        self.tm.close()
        self.cap.publisher.close()


@pytest.fixture()
def rig(device: torch.device) -> Rig:
    r = Rig(device)
    yield r
    r.close()


def test_offload_waits_for_its_step_then_copies_and_publishes_in_order(rig: Rig) -> None:
    hs = [101, 102, 103]
    handles = rig.registered(hs)
    rig.cap.clear()
    step = StepEvent()
    fut = rig.tm.offload_to_host(rig.items(handles), step)
    time.sleep(0.05)  # time passes: a copy that did not wait for its step would be done
    assert not fut.done() and rig.g2.resident() == set()
    assert rig.g2.stats().reset == 8 - 3  # destinations reserved at submit
    step.done()
    res = fut.result(timeout=5)
    assert (res.copied, res.already, res.skipped) == (3, 0, 0)
    assert [w.sequence_hash for w in res.blocks] == hs and all(w.alive for w in res.blocks)
    assert rig.cap.events() == [("STORE", h, "g2") for h in hs]
    for h in hs:
        got = rig.g2.get(h)
        assert torch.equal(rig.g2.layout.block_view(got.block_id), torch.full(CFG.block_shape, float(h % 1000)))
        got.release()
    assert rig.metrics.sample("kvbm_offload_blocks_d2h") == 3
    # again: the policy check finds every block in G2, nothing is queued or copied
    again = rig.tm.offload_to_host(rig.items(handles), StepEvent()).result(timeout=5)
    assert (again.copied, again.already) == (0, 3) and rig.cap.events() == [("STORE", h, "g2") for h in hs]
    for h in handles:
        h.release()


def test_cancelled_offload_frees_its_blocks_and_the_next_job_still_runs(rig: Rig) -> None:
    a, b = rig.registered([201, 202, 203]), rig.registered([301, 302])
    rig.cap.clear()
    step_a, step_b = StepEvent(), StepEvent()
    fa = rig.tm.offload_to_host(rig.items(a), step_a)
    fb = rig.tm.offload_to_host(rig.items(b), step_b)
    assert rig.g2.stats().reset == 8 - 5 and rig.tm.pending(TransferPath.G1_TO_G2) == 2
    assert fa.cancel()
    assert fa.cancelled() and rig.g2.stats().reset == 8 - 2  # A's 3 reserved blocks are back
    assert rig.tm.pending(TransferPath.G1_TO_G2) == 1
    step_a.done()  # the cancelled job's step finishing changes nothing
    step_b.done()
    res = fb.result(timeout=5)
    assert res.copied == 2 and rig.g2.resident() == {301, 302}
    assert rig.cap.events() == [("STORE", 301, "g2"), ("STORE", 302, "g2")]
    assert not fb.cancel()  # finished jobs cannot be cancelled
    st = rig.g2.stats()
    assert (st.reset, st.inactive, st.active) == (6, 2, 0)
    for h in a + b:
        h.release()


def test_ready_jobs_are_batched_into_one_transfer(rig: Rig) -> None:
    step = StepEvent()
    futs = [rig.tm.offload_to_host(rig.items(rig.registered([400 + 10 * k, 401 + 10 * k])), step) for k in range(3)]
    before = rig.tm.batches(TransferPath.G1_TO_G2)
    step.done()
    assert [f.result(timeout=5).copied for f in futs] == [2, 2, 2]
    assert rig.tm.batches(TransferPath.G1_TO_G2) - before == 1
    # Stores follow submission order
    assert [h for _, h, loc in rig.cap.events() if loc == "g2"] == [400, 401, 410, 411, 420, 421]


def test_batch_size_limit_splits_batches(device: torch.device) -> None:
    r = Rig(device, batch=2)
    try:
        step = StepEvent()
        futs = [r.tm.offload_to_host(r.items(r.registered([500 + k])), step) for k in range(3)]
        step.done()
        assert [f.result(timeout=5).copied for f in futs] == [1, 1, 1]
        assert r.tm.batches(TransferPath.G1_TO_G2) == 2
    finally:
        r.close()


def test_source_evicted_before_the_step_ends_is_skipped_not_resurrected(rig: Rig) -> None:
    handles = rig.registered([601, 602])
    items = rig.items(handles)
    step = StepEvent()
    fut = rig.tm.offload_to_host(items, step)
    handles[1].release()
    assert rig.g1.evict() == 1  # 602 is gone from G1 before the copy
    handles[1] = None
    step.done()
    res = fut.result(timeout=5)
    assert (res.copied, res.skipped) == (1, 1) and res.blocks[1] is None
    assert rig.g2.resident() == {601} and rig.g2.stats().reset == 7  # the unused reservation is free
    handles[0].release()


def test_onboard_from_host_copies_and_releases_sources(rig: Rig) -> None:
    handles = rig.registered([701, 702])
    rig.tm.offload_to_host(rig.items(handles), StepEvent.completed()).result(timeout=5)
    srcs = rig.g2.match_blocks([701, 702])
    assert rig.g2.stats().active == 2
    dst = make_layout("LayerSeparated", CFG, 4, rig.device, tier="g1")
    assert rig.tm.onboard_from_host(srcs, dst, [3, 1]).result(timeout=5) == 2
    assert dst.block_view(3).device.type == rig.device.type  # (compared where it lives)
    assert torch.equal(dst.block_view(3), torch.full(CFG.block_shape, 701.0, device=dst.block_view(3).device))
    assert torch.equal(dst.block_view(1), torch.full(CFG.block_shape, 702.0, device=dst.block_view(1).device))
    assert rig.g2.stats().active == 0 and all(s.consumed for s in srcs)
    assert rig.metrics.sample("kvbm_onboard_blocks_h2d") == 2
    with pytest.raises(ValueError, match="2 sources for 1 destinations"):
        rig.tm.onboard_from_host(rig.g2.match_blocks([701, 702]), dst, [0])
    for h in handles:
        h.release()


def test_onboard_of_n_blocks_is_one_copy_and_one_release_call(rig: Rig, monkeypatch: pytest.MonkeyPatch) -> None:
    """The per-block work of an onboard is batched: N sources of one pool into one layout
    are one ``copy_blocks`` and one ``release_blocks`` call, not N releases."""
    import kvbm_runtime.transfer as transfer

    hashes = [711, 712, 713, 714, 715, 716]
    handles = rig.registered(hashes)
    rig.tm.offload_to_host(rig.items(handles), StepEvent.completed()).result(timeout=5)
    copies: list[tuple[list[int], list[int]]] = []
    releases: list[int] = []
    real_copy, real_release = transfer.copy_blocks, rig.g2.release_blocks
    monkeypatch.setattr(transfer, "copy_blocks", lambda s, si, d, di: (copies.append((list(si), list(di))), real_copy(s, si, d, di)))
    monkeypatch.setattr(rig.g2, "release_blocks", lambda hs: (releases.append(len(hs)), real_release(hs)))
    srcs = rig.g2.match_blocks(hashes)
    src_ids = [h.block_id for h in srcs]
    dst = make_layout("FullyContiguous", CFG, 8, rig.device, tier="g1")
    assert rig.tm.onboard_from_host(srcs, dst, [2, 3, 4, 5, 0, 1]).result(timeout=5) == 6
    assert copies == [(src_ids, [2, 3, 4, 5, 0, 1])]
    assert releases == [6] and all(s.consumed for s in srcs) and rig.g2.stats().active == 0
    for h, d in zip(hashes, [2, 3, 4, 5, 0, 1]):
        assert torch.equal(dst.block_view(d), torch.full(CFG.block_shape, float(h), device=dst.block_view(d).device))
    # the same source handle listed twice (one block onboarded into two places): both
    # copies land, the handle is released once
    (twice,) = rig.g2.match_blocks([713])
    releases.clear()
    assert rig.tm.onboard_from_host([twice, twice], dst, [6, 7]).result(timeout=5) == 2
    assert releases == [1] and twice.consumed and rig.g2.stats().active == 0
    assert torch.equal(dst.block_view(6), dst.block_view(7)) and torch.equal(dst.block_view(6), dst.block_view(4))
    for h in handles:
        h.release()


def test_closed_manager_refuses_and_cancels_queued_work(rig: Rig) -> None:
    handles = rig.registered([801])
    fut = rig.tm.offload_to_host(rig.items(handles), StepEvent())
    rig.tm.close()
    assert fut.cancelled() and rig.g2.stats().reset == 8
    with pytest.raises(TransferClosedError):
        rig.tm.offload_to_host(rig.items(handles), StepEvent.completed())
    handles[0].release()


def test_disk_filter_frequencies_double_on_offers_and_drop_by_one_per_decay_step() -> None:
    """KVBM's frequency filter: 1 when first seen, x2 on each further offer, -1 per decay
    step (entries reaching 0 are forgotten); admitted from frequency 2."""
    now = [0.0]
    f = DiskOffloadFilter(min_frequency=2, decay_interval_s=10.0, clock=lambda: now[0])
    trace: list[tuple[str, int, bool | None, int]] = []

    def offer(h: int) -> None:
        ok = f.offer(h)
        trace.append(("offer", h, ok, f.frequency(h)))

    def decay_to(t: float, h: int) -> None:
        now[0] = t
        trace.append(("decay", h, None, f.frequency(h)))

    offer(1)
    offer(1)
    offer(1)
    offer(2)
    decay_to(10.5, 1)  # one step: 4 -> 3, 1 -> 0
    trace.append(("check", 2, None, f.frequency(2)))
    offer(1)  # 3 -> 6
    offer(2)  # forgotten: from 1 again
    decay_to(39.9, 1)  # steps at 20 and 30: 6 -> 4, and 2's 1 -> 0
    decay_to(40.0, 1)  # step at 40: 4 -> 3
    offer(2)
    offer(2)
    decay_to(70.0, 2)  # three steps: 2 -> 0
    assert trace == [
        ("offer", 1, False, 1),
        ("offer", 1, True, 2),
        ("offer", 1, True, 4),
        ("offer", 2, False, 1),
        ("decay", 1, None, 3),
        ("check", 2, None, 0),
        ("offer", 1, True, 6),
        ("offer", 2, False, 1),
        ("decay", 1, None, 4),
        ("decay", 1, None, 3),
        ("offer", 2, False, 1),
        ("offer", 2, True, 2),
        ("decay", 2, None, 0),
    ]
    assert f.frequency(1) == 0 and len(f) == 0  # 3 - 3 steps: forgotten too
    with pytest.raises(ValueError, match="min_frequency=0"):
        DiskOffloadFilter(min_frequency=0)


def test_disk_filter_frequency_is_capped() -> None:
    f = DiskOffloadFilter(decay_interval_s=1e9)
    for _ in range(20):
        f.offer(7)
    assert f.frequency(7) == 1 << 16


def test_disk_filter_bounds_its_table_with_the_fewest_decay_steps() -> None:
    now = [0.0]
    f = DiskOffloadFilter(max_entries=3, decay_interval_s=10.0, clock=lambda: now[0])
    for h, offers in ((0, 3), (1, 2), (2, 1)):  # frequencies 4, 2, 1
        for _ in range(offers):
            f.offer(h)
    now[0] = 5.0
    f.offer(99)  # a fourth entry (1): one decay step leaves 3, 1 -> the two 1s go
    assert [f.frequency(h) for h in (0, 1, 2, 99)] == [3, 1, 0, 0] and len(f) == 2
    f.offer(98)
    f.offer(97)  # 3, 1, 1, 1: one step is enough again
    assert [f.frequency(h) for h in (0, 1, 98, 97)] == [2, 0, 0, 0] and len(f) == 1
    now[0] = 14.0  # the decay clock restarted at 5.0: no step before 15.0
    assert f.frequency(0) == 2
    now[0] = 15.0
    assert f.frequency(0) == 1


def test_a_copy_that_fails_part_way_gives_every_reserved_block_back(rig: Rig, monkeypatch: pytest.MonkeyPatch) -> None:
    """The copy raising: the future fails with its error, no G2 block stays reserved or is
    registered, no Store is published, and the sources are released (G1 can evict them)."""
    import kvbm_runtime.transfer as transfer

    handles = rig.registered([301, 302, 303])
    rig.cap.clear()

    def broken_copy(*_a: object) -> None:
        raise OSError("copy engine fell over")

    monkeypatch.setattr(transfer, "copy_blocks", broken_copy)
    fut = rig.tm.offload_to_host(rig.items(handles), StepEvent.completed())
    with pytest.raises(OSError, match="fell over"):
        fut.result(timeout=5)
    st = rig.g2.stats()
    assert (st.reset, st.active, st.registered_hashes) == (8, 0, 0)
    assert rig.cap.events() == []
    for h in handles:
        h.release()
    assert rig.g1.evict() == 3  # nothing of the failed batch still pins a source
    monkeypatch.undo()
    # the manager still works after the failure
    again = rig.registered([311])
    assert rig.tm.offload_to_host(rig.items(again), StepEvent.completed()).result(timeout=5).copied == 1
    again[0].release()


def test_a_hash_registered_in_g2_meanwhile_dedups_and_the_weak_handle_names_that_copy(rig: Rig) -> None:
    """While the job waits for its step, another path registers one of its hashes in G2:
    registration dedups onto that copy, the result's weak handle names it (alive, its block
    id), no second Store is published and the job's own reservation goes back to Reset."""
    handles = rig.registered([901, 902, 903])
    rig.cap.clear()
    step = StepEvent()
    fut = rig.tm.offload_to_host(rig.items(handles), step)
    other = rig.g2.register_blocks(rig.g2.allocate_complete([handles[1].meta]))[0]
    other_id = other.block_id
    other.release()
    step.done()
    res = fut.result(timeout=5)
    assert res.copied == 3 and [w.sequence_hash for w in res.blocks] == [901, 902, 903]
    assert all(w.alive for w in res.blocks)
    got = rig.g2.upgrade_many(res.blocks)
    assert got[1].block_id == other_id and len({g.block_id for g in got}) == 3
    rig.g2.release_blocks(got)
    assert rig.cap.events() == [("STORE", 902, "g2"), ("STORE", 901, "g2"), ("STORE", 903, "g2")]
    st = rig.g2.stats()
    assert (st.reset, st.inactive, st.active) == (8 - 3, 3, 0)
    for h in handles:
        h.release()


def test_one_batch_with_a_lost_source_a_caller_owned_source_and_a_partly_held_job(rig: Rig) -> None:
    """Three jobs in one batch: A loses a source to eviction, B's items carry no weak handle
    (the caller keeps the source alive), C has one hash G2 already holds.  Each result's
    handles line up with its own items, all alive, and the bytes landed."""
    a = rig.registered([1001, 1002])
    b = rig.registered([1011])
    c = rig.registered([1021, 1022])
    rig.tm.offload_to_host(rig.items(c[:1]), StepEvent.completed()).result(timeout=5)  # G2 holds 1021
    rig.cap.clear()
    step = StepEvent()
    before = rig.tm.batches(TransferPath.G1_TO_G2)
    fa = rig.tm.offload_to_host(rig.items(a), step)
    fb = rig.tm.offload_to_host([HostOffloadItem(h.meta, rig.g1.layout, h.block_id, None) for h in b], step)
    fc = rig.tm.offload_to_host(rig.items(c), step)
    a[0].release()
    assert rig.g1.evict() == 1  # 1001 is gone before the copy
    step.done()
    ra, rb, rc = fa.result(timeout=5), fb.result(timeout=5), fc.result(timeout=5)
    assert rig.tm.batches(TransferPath.G1_TO_G2) - before == 1
    assert (ra.copied, ra.skipped, ra.blocks[0]) == (1, 1, None)
    assert ra.blocks[1].sequence_hash == 1002 and ra.blocks[1].alive
    assert (rb.copied, [w.sequence_hash for w in rb.blocks]) == (1, [1011])
    assert (rc.copied, rc.already, [w.sequence_hash for w in rc.blocks]) == (1, 1, [1021, 1022])
    assert [e for e in rig.cap.events() if e[2] == "g2"] == [("STORE", h, "g2") for h in (1002, 1011, 1022)]
    for w in (ra.blocks[1], rb.blocks[0], *rc.blocks):
        assert w.alive
        h = w.upgrade()
        expect = torch.full(CFG.block_shape, float(w.sequence_hash % 1000))
        assert torch.equal(rig.g2.layout.block_view(h.block_id), expect)
        h.release()
    assert rig.g2.stats().reset == 8 - 4
    for h in [a[1], *b, *c]:
        h.release()


def test_completed_step_is_one_shared_finished_instance(rig: Rig) -> None:
    """``StepEvent.completed()`` is shared and stays finished (``done()`` on it changes
    nothing); offloads gated by it run at once, and a fresh ``StepEvent()`` still waits."""
    a, b = StepEvent.completed(), StepEvent.completed()
    assert a is b and a.is_done and a.wait(0)
    a.done()
    assert a.is_done and not StepEvent().is_done
    handles = rig.registered([1101])
    assert rig.tm.offload_to_host(rig.items(handles), a).result(timeout=5).copied == 1
    handles[0].release()
