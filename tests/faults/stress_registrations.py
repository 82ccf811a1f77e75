"""Stress: segment files registered and deregistered with NIXL by several threads on the
two POSIX volumes of ONE storage agent (one nixl agent), as fast as they can, under
``faulthandler``.

The move/eviction/compaction stress (:mod:`tests.faults.stress_moves`) spends nearly all
its time in Python (catalog, hashing, packing) and reaches NIXL a few thousand times a
second, so two threads are seldom inside the agent at the same moment: with the volumes'
opens and deletes taking only their own volume's lock it did not crash in 13 runs of 6 to
20 s (nor in 21 runs of 10 s before).  Here each thread does
nothing but what a read or a delete does to the agent, on one volume each:

* an opener per volume: ``page_cache_files([s])`` (the segment file opened and registered
  as FILE memory, then closed and deregistered on the way out: ``max_open`` is 0) or
  ``read_many`` of the segment (registered, one NIXL READ, deregistered), its bytes
  checked;
* a deleter per volume: ``delete_segment(s)`` (a cached registration dropped, the file
  unlinked), then the file put back (a hard link kept aside).

With every call into the agent holding the agent's lock (storage_backends/nixl_engine.py)
this runs clean; with the volumes' registrations and deletes taking only their own
volume's lock (two volumes, two locks, one agent), NIXL logs ``deregisterMem ...
NIXL_ERR_NOT_FOUND`` and the process dies of a segmentation fault or a heap-corruption
abort (``malloc(): unaligned tcache chunk detected``) within seconds: 21 of 22 runs of 5 s
on the 2-core development machine, 0.1 to 2 s after the threads started where timed; the
crashing thread in ``nixlLocalSection::remDescList`` (``std::_Rb_tree_rebalance_for_erase``,
as when the agent's map of sections loses the FILE section that a deregistration emptied
while another thread's registration adds to the map).

Run: ``python -X faulthandler -m tests.faults.stress_registrations --seconds 5 --seed 1``;
exit status 0 when clean, 1 on a failed check or a NIXL deregistration error, a signal's
when it crashes.
"""

from __future__ import annotations

import os
import random
import sys
from pathlib import Path

import torch

from storage_backends import SqliteCatalog, StorageAgent
from storage_backends.types import MediaClass, VolumeDescriptor, VolumeKind
from tests.faults.stress_moves import Threads, stress_main

BLK = 4096  # bytes per segment (one block)
NSEG = 4  # segments per volume


def content(volume: int, segment: int) -> torch.Tensor:
    """The bytes of segment ``segment`` of volume number ``volume`` (deterministic)."""
    return torch.full((BLK,), (volume * 16 + segment) % 251, dtype=torch.uint8)


def run(root: Path, seconds: float, seed: int) -> dict[str, int]:
    """Run the stress for ``seconds`` in ``root``; returns the counters (``errors`` > 0:
    a thread met an exception other than the missing segment a delete may cause, or read
    wrong bytes)."""
    agent = StorageAgent(SqliteCatalog(root / "catalog.sqlite"), "stress-registrations")
    vols = [agent.register_volume(VolumeDescriptor(vid, VolumeKind.POSIX, MediaClass.NVME, 1 << 30,
                                                   root=str(root / vid), segment_bytes=BLK))
            for vid in ("fast", "slow")]
    eng = vols[0].engine
    assert all(v.engine is eng for v in vols), "the two volumes share one NIXL agent"
    keep = root / "keep"
    keep.mkdir()
    with eng.lock:
        buf = eng.staging(BLK)
        for n, vol in enumerate(vols):
            vol.max_open = 0  # type: ignore[attr-defined]  # every open is closed at once
            for s in range(1, NSEG + 1):
                buf.copy_(content(n, s))
                vol.write_segment(s, buf, BLK)
                os.link(vol.path(s), keep / f"{vol.desc.id}-{s}")  # type: ignore[attr-defined]
    stress = Threads(seed)

    def opener(n: int):  # noqa: ANN202
        vol = vols[n]
        out = torch.empty(BLK, dtype=torch.uint8)
        with eng.lock:
            eng.register_tensor(out)

        def body(rng: random.Random) -> None:
            s = rng.randrange(1, NSEG + 1)
            if rng.random() < 0.5:
                with vol.page_cache_files([s]) as files:
                    if files is not None and s in files.fds:
                        stress.note("pinned")
                return
            vol.read_many([(s, 0, BLK)], out)  # a segment deleted at this moment: SegmentMissingError, counted
            if not torch.equal(out, content(n, s)):
                raise AssertionError(f"segment {s} of {vol.desc.id!r} read back wrong bytes")
            stress.note("read")
        return body

    def deleter(n: int):  # noqa: ANN202
        vol = vols[n]

        def body(rng: random.Random) -> None:
            s = rng.randrange(1, NSEG + 1)
            vol.delete_segment(s)
            os.link(keep / f"{vol.desc.id}-{s}", vol.path(s))  # type: ignore[attr-defined]
            stress.note("delete")
        return body

    stress.run({f"{role.__name__}-{vols[n].desc.id}": role(n) for n in range(len(vols)) for role in (opener, deleter)},
               seconds)
    agent.close()
    agent.catalog.close()
    return stress.report()


def main() -> int:
    return stress_main(__doc__, 5.0, lambda root, a: run(root, a.seconds, a.seed))


if __name__ == "__main__":
    sys.exit(main())
