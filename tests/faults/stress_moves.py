"""Stress: moves racing evictions, compactions, puts and gets on ONE storage agent (POSIX
volumes through NIXL), as an advisor's policy, garbage-collection and API threads share
its agent; run under ``faulthandler`` so a crash in NIXL leaves a traceback of every thread.

Threads (seeded, so a run can be repeated): two movers (``copy_many`` + ``commit_move``,
``fast`` -> ``slow`` and back), an evictor (``delete`` of random blocks: their segments are
dropped once empty), a compactor (``compact`` of random sealed segments), a writer (new
blocks) and a reader (``get``).  The storage errors a race may cause (a block deleted or
moved under a copy, a segment dropped under a read, a version conflict) are counted; any
other exception fails the run, as does a NIXL deregistration error (a region deregistered
twice, or used after it was deregistered: ``deregister failed`` / ``NIXL_ERR_NOT_FOUND``
on stderr, which the caller checks) or a crash.  At the end every block the catalog still
holds reads back byte-exact.

Run: ``python -m tests.faults.stress_moves --seconds 60 --seed 1`` (``make stress``);
exit status 0 when clean.
"""

from __future__ import annotations

import argparse
import faulthandler
import logging
import random
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import torch

from storage_backends import BlockKey, SqliteCatalog, StorageAgent
from storage_backends.types import MediaClass, StorageError, VolumeDescriptor, VolumeKind

NS = "stress"
BLK = 16 << 10


def block(h: int) -> torch.Tensor:
    """Block ``h``'s bytes (deterministic)."""
    return torch.full((BLK,), h % 251, dtype=torch.uint8)


class DeregisterErrors(logging.Handler):
    """Counts the engine's ``deregister failed`` warnings."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.count = 0

    def emit(self, record: logging.LogRecord) -> None:
        if "deregister failed" in record.getMessage():
            self.count += 1


class Threads:
    """The threads of a stress: counters, the stop flag and the failures they share.

    Each body runs in a loop on its own thread with its own ``random.Random`` (seeded from
    the run's seed and the body's name, so a run can be repeated); a
    :class:`~storage_backends.types.StorageError` (a race the storage layer reports) is
    counted as ``<name>:<error type>``, any other exception is a failure: counted as
    ``errors``, kept in :attr:`failures`, and every thread stops.
    """

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self.counts: Counter[str] = Counter()
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.failures: list[str] = []

    def note(self, what: str) -> None:
        """Count one ``what``."""
        with self.lock:
            self.counts[what] += 1

    def _guarded(self, name: str, body: Callable[[random.Random], None]) -> None:
        rng = random.Random(f"{self.seed}-{name}")
        while not self.stop.is_set():
            try:
                body(rng)
            except StorageError as exc:  # a race the storage layer reports: expected
                self.note(f"{name}:{type(exc).__name__}")
            except Exception as exc:  # noqa: BLE001 - anything else fails the run
                self.failures.append(f"{name}: {type(exc).__name__}: {exc}")
                self.note("errors")
                self.stop.set()

    def run(self, bodies: dict[str, Callable[[random.Random], None]], seconds: float) -> None:
        """Run every body for ``seconds`` (or until one fails), then wait for the threads."""
        threads = [threading.Thread(target=self._guarded, args=(n, b), name=f"stress-{n}", daemon=True)
                   for n, b in bodies.items()]
        for t in threads:
            t.start()
        self.stop.wait(seconds)
        self.stop.set()
        for t in threads:
            t.join(timeout=60)

    def report(self) -> dict[str, int]:
        """Print the first failures to stderr; return the counters."""
        for f in self.failures[:10]:
            print("FAILURE:", f, file=sys.stderr, flush=True)
        return dict(self.counts)


def stress_main(doc: str, default_seconds: float, run_one: Callable[[Path, argparse.Namespace], dict[str, int]],
                add_args: Callable[[argparse.ArgumentParser], None] | None = None) -> int:
    """The command line of a stress module (``--seconds``, ``--seed``, ``--root``, and the
    module's own options from ``add_args``): runs ``run_one(working directory, arguments)``
    under ``faulthandler``, counts the engine's ``deregister failed`` warnings, prints the
    counters as ``key=value`` on one line.

    Returns:
        the exit status: 1 when the run counted ``errors`` or a deregistration failed, else 0.
    """
    faulthandler.enable(all_threads=True)
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=default_seconds)
    ap.add_argument("--seed", type=int, default=1)
    if add_args is not None:
        add_args(ap)
    ap.add_argument("--root", type=Path, help="working directory (default: a temporary one)")
    a = ap.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    dereg = DeregisterErrors()
    logging.getLogger("storage_backends").addHandler(dereg)
    with tempfile.TemporaryDirectory(prefix="kvadvisor-stress-", dir=a.root) as tmp:
        counts = run_one(Path(tmp), a)
    counts["deregister_failed"] = dereg.count
    print(" ".join(f"{k}={v}" for k, v in sorted(counts.items())), flush=True)
    return 1 if counts.get("errors") or dereg.count else 0


def run(root: Path, seconds: float, seed: int, max_open: int = 4) -> dict[str, int]:
    """Run the stress for ``seconds``; returns the counters (``errors`` > 0: it failed).

    The movers, the compactor and the collector share the advisor's agent; the writer,
    the evictor and the reader are a worker's (a second agent on the same catalog and
    volumes), as in a deployment.  ``max_open``: segment files each POSIX volume keeps open
    (registered) for reads; a small number makes reads open, register, deregister and
    close files all the time, as a volume with many more segments than ``max_open`` does."""
    catalog = SqliteCatalog(root / "catalog.sqlite")
    agent = StorageAgent(catalog, "stress-advisor")
    worker = StorageAgent(SqliteCatalog(root / "catalog.sqlite"), "stress-worker")
    for a in (agent, worker):
        for vid, media in (("fast", MediaClass.NVME), ("slow", MediaClass.HDD)):
            a.register_volume(VolumeDescriptor(vid, VolumeKind.POSIX, media, 1 << 30, root=str(root / vid),
                                               segment_bytes=8 * BLK))
        for v in a._volumes.values():
            v.max_open = max_open  # type: ignore[attr-defined]
    stress = Threads(seed)
    note, lock = stress.note, stress.lock
    next_h = [1]

    def new_hashes(n: int) -> list[int]:
        with lock:
            h = next_h[0]
            next_h[0] += n
        return list(range(h, h + n))

    def known(rng: random.Random, n: int) -> list[BlockKey]:
        with lock:
            top = next_h[0]
        return [BlockKey(NS, rng.randrange(1, top)) for _ in range(n)] if top > 1 else []

    def writer(rng: random.Random) -> None:
        hs = new_hashes(rng.randint(1, 12))
        worker.put([(BlockKey(NS, h), block(h)) for h in hs], rng.choice(["fast", "slow"]))
        note("put")

    def mover(src: str, dst: str):  # noqa: ANN202
        def body(rng: random.Random) -> None:
            places = [p for p in agent.locate(known(rng, 16)) if p is not None and p.volume_id == src]
            if not places:
                time.sleep(0.001)
                return
            news = agent.copy_many(places, dst)  # a block deleted under it: BlockNotFoundError, counted
            for old, new in zip(places, news):
                try:
                    agent.commit_move(old, new)
                    note("move")
                except StorageError as exc:
                    note(f"commit:{type(exc).__name__}")
        return body

    def evictor(rng: random.Random) -> None:
        worker.delete(known(rng, rng.randint(1, 8)))
        note("delete")
        time.sleep(0.0005)

    def compactor(rng: random.Random) -> None:
        vid = rng.choice(["fast", "slow"])
        segs = [s for s in agent.segments(vid) if s.sealed]
        if not segs:
            time.sleep(0.001)
            return
        agent.compact(vid, rng.choice(segs).segment_id)
        note("compact")

    def reader(rng: random.Random) -> None:
        ks = known(rng, 8)
        keys = [k for k, p in zip(ks, worker.locate(ks)) if p is not None]
        if keys:
            for k, t in zip(keys, (agent if rng.random() < 0.5 else worker).get(keys)):
                if not torch.equal(t, block(k.sequence_hash)):
                    raise AssertionError(f"{k} read back wrong bytes")
            note("get")

    def gc(rng: random.Random) -> None:
        agent.collect_garbage(rng.choice(["fast", "slow"]), min_age_s=3600)
        note("gc")
        time.sleep(0.01)

    bodies = {"writer": writer, "up": mover("slow", "fast"), "down": mover("fast", "slow"), "evictor": evictor,
              "compactor": compactor, "reader": reader, "gc": gc}
    stress.run(bodies, seconds)
    # every block still in the catalog reads back byte-exact
    keys = [p.key for v in ("fast", "slow") for p in catalog.iter_volume(v)]
    for i in range(0, len(keys), 256):
        chunk = keys[i : i + 256]
        for k, t in zip(chunk, agent.get(chunk)):
            if not torch.equal(t, block(k.sequence_hash)):
                stress.failures.append(f"{k} does not read back at the end")
                note("errors")
    stress.counts["blocks_at_end"] = len(keys)
    agent.close()
    worker.close()
    worker.catalog.close()
    catalog.close()
    return stress.report()


def main() -> int:
    def options(ap: argparse.ArgumentParser) -> None:
        ap.add_argument("--max-open", type=int, default=4, help="segment files kept open per volume")

    return stress_main(__doc__, 60.0, lambda root, a: run(root, a.seconds, a.seed, a.max_open), options)


if __name__ == "__main__":
    sys.exit(main())
