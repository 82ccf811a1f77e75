"""Several processes on one catalog and one volume: concurrent puts, and kill -9 mid-work."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time
import uuid
from pathlib import Path

import pytest
import torch

from storage_backends import (
    BlockKey,
    BlockNotFoundError,
    LocalS3,
    MediaClass,
    PlacementCatalog,
    RedisCatalog,
    SqliteCatalog,
    StorageAgent,
    VolumeDescriptor,
    VolumeKind,
)
from tests import polling

NS = "00000000deadbeef"


def block(h: int) -> torch.Tensor:
    """Content is a function of the key, so every process writes the same bytes for it."""
    n = 1000 + (h * 7919) % 20000
    g = torch.Generator().manual_seed(h)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)


def _descs(root: str, s3_endpoint: str | None, ak: str, sk: str) -> list[VolumeDescriptor]:
    out = [VolumeDescriptor("shared", VolumeKind.POSIX, MediaClass.SSD, 1 << 30, root=root)]
    if s3_endpoint:
        out.append(VolumeDescriptor("obj", VolumeKind.S3, MediaClass.OBJECT, 1 << 30, endpoint=s3_endpoint,
                                    bucket="kvadvisor-mp", prefix="mp", access_key=ak, secret_key=sk))
    return out


def _writer(db: str, root: str, s3: tuple[str, str, str] | None, wid: int, rounds: int) -> None:
    os.environ["NIXL_LOG_LEVEL"] = "WARN"
    cat = SqliteCatalog(db)
    agent = StorageAgent(cat, name=f"mp-writer-{wid}")
    for d in _descs(root, *(s3 or (None, "", ""))):
        agent.register_volume(d)
    vols = [d.id for d in agent.volumes()]
    for r in range(rounds):
        own = [10_000 * (wid + 1) + r * 4 + i for i in range(4)]
        shared = [r * 2, r * 2 + 1]  # both writers put these
        hashes = own + shared if wid % 2 == 0 else shared + own
        agent.put([(BlockKey(NS, h), block(h)) for h in hashes], vols[r % len(vols)])
        # read back everything this writer knows is stored, while the other one writes
        keys = [BlockKey(NS, h) for h in hashes]
        for k, g in zip(keys, agent.get(keys)):
            if not torch.equal(g, block(k.sequence_hash)):
                raise AssertionError(f"writer {wid}: wrong bytes for {k}")
    agent.close()
    cat.close()


def test_two_processes_put_to_one_catalog_and_volume(tmp_path: Path, local_s3: LocalS3) -> None:
    db, root = str(tmp_path / "catalog.sqlite"), str(tmp_path / "vol")
    s3 = (local_s3.endpoint, local_s3.access_key, local_s3.secret_key)
    ctx = mp.get_context("spawn")
    rounds = 12
    procs = [ctx.Process(target=_writer, args=(db, root, s3, w, rounds)) for w in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
    assert [p.exitcode for p in procs] == [0, 0]

    cat = SqliteCatalog(db)
    agent = StorageAgent(cat, name="mp-checker")
    try:
        for d in _descs(root, *s3):
            agent.register_volume(d)
        expected = sorted({10_000 * (w + 1) + r * 4 + i for w in range(2) for r in range(rounds) for i in range(4)}
                          | set(range(2 * rounds)))
        keys = [BlockKey(NS, h) for h in expected]
        got = agent.get(keys)
        assert all(torch.equal(g, block(k.sequence_hash)) for g, k in zip(got, keys))
        # one placement per key, no two live blocks overlapping inside a segment
        placements = [p for v in ("shared", "obj") for p in cat.iter_volume(v)]
        assert sorted(p.key.sequence_hash for p in placements) == expected
        by_seg: dict[tuple[str, int], list[tuple[int, int]]] = {}
        for p in placements:
            by_seg.setdefault((p.volume_id, p.segment_id), []).append((p.offset, p.offset + p.length))
        for spans in by_seg.values():
            spans.sort()
            assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))
        # segment accounting matches, every segment file exists, no orphan files
        total_live = sum(s.live_blocks for v in ("shared", "obj") for s in agent.segments(v))
        assert total_live == len(expected)
        posix = agent._vol("shared")  # type: ignore[attr-defined]
        assert set(posix.list_segments()) == {s.segment_id for s in agent.segments("shared")}
    finally:
        agent.close()
        cat.close()


def _open_catalog(spec: tuple[str, str, str]) -> PlacementCatalog:
    """``("sqlite", path, "")`` or ``("redis", url, prefix)``."""
    kind, where, prefix = spec
    return SqliteCatalog(where) if kind == "sqlite" else RedisCatalog(where, prefix=prefix)


def _crasher(db: tuple[str, str, str], root: str, ack_path: str, base: int, kill_at: str) -> None:
    """Put acknowledged batches, delete one block of each, compact, forever.

    ``kill_at`` = ``"timed"``: run until the parent kills it.  Otherwise the process
    SIGKILLs itself at that step, once at least three batches were acknowledged:
    ``"put"`` (segment written durably, catalog not yet updated), ``"compact-copy"`` (new
    segment written and verified, no block moved yet) or ``"compact-commit"`` (the first
    block of a compaction moved, the rest not).
    """
    os.environ["NIXL_LOG_LEVEL"] = "WARN"
    cat = _open_catalog(db)
    agent = StorageAgent(cat, name=f"mp-crasher-{base}")
    agent.register_volume(_descs(root, None, "", "")[0])
    batches = 0
    die = lambda: os.kill(os.getpid(), signal.SIGKILL)  # noqa: E731
    if kill_at == "put":
        insert = cat.insert_if_absent
        cat.insert_if_absent = lambda ps: die() if batches >= 3 else insert(ps)  # type: ignore[method-assign]
    elif kill_at == "delete":  # the delete took effect; its "-" line is never written
        delete = agent.delete
        agent.delete = lambda ks: (delete(ks), die() if batches >= 3 else None)  # type: ignore[method-assign]
    elif kill_at in ("compact-copy", "compact-commit"):
        commit = agent.commit_move
        moved = [0]

        def commit_then_die(old, new, fence=None):  # type: ignore[no-untyped-def]
            if batches >= 3 and kill_at == "compact-copy":
                die()
            out = commit(old, new, fence)
            moved[0] += 1
            if batches >= 3 and moved[0] >= 1:
                die()
            return out

        agent.commit_move = commit_then_die  # type: ignore[method-assign]
    with open(ack_path, "a") as ack:
        h = base
        while True:
            hashes = list(range(h, h + 8))
            h += 8
            agent.put([(BlockKey(NS, x), block(x)) for x in hashes], "shared")
            ack.write(" ".join(map(str, hashes)) + "\n")  # acknowledged only after put returned
            ack.flush()
            batches += 1
            # a kill between the delete and its "-" line leaves the block deleted but
            # acknowledged: "?" first says its fate is open until "-" settles it
            ack.write(f"?{hashes[0]}\n")
            ack.flush()
            agent.delete([BlockKey(NS, hashes[0])])  # holes for compaction
            ack.write(f"-{hashes[0]}\n")
            ack.flush()
            # sealed ones only: compact() refuses a segment a put may still commit into
            # (here: the leftover of a put an earlier crasher was killed in)
            for seg in [sg for sg in agent.segments("shared") if sg.sealed][:2]:
                agent.compact("shared", seg.segment_id)


@pytest.mark.timeout(900)  # a hang bound: up to five crashers, each importing torch (minutes when loaded)
@pytest.mark.parametrize("catalog", ["sqlite", "redis"])
def test_kill_9_during_puts_and_compaction_loses_no_acknowledged_block(
    tmp_path: Path, catalog: str, request: pytest.FixtureRequest
) -> None:
    root = str(tmp_path / "vol")
    db = (("sqlite", str(tmp_path / "catalog.sqlite"), "") if catalog == "sqlite"
          else ("redis", request.getfixturevalue("redis_url"), f"kvadvisor-test:{uuid.uuid4().hex}"))
    try:
        modes = ["put", "delete", "compact-copy", "compact-commit", "timed"] if catalog == "sqlite" else ["compact-commit", "timed"]
        _kill_and_recover(db, root, str(tmp_path), modes)
    finally:
        if catalog == "redis":
            c = _open_catalog(db)
            assert isinstance(c, RedisCatalog)
            c.destroy()
            c.close()


def _acknowledged(paths: list[str]) -> set[int]:
    """Blocks that must be readable: acknowledged by a put, with no delete started."""
    return _ack_state(paths)[0]


def _ack_state(paths: list[str]) -> tuple[set[int], set[int]]:
    """(live, in doubt): in doubt are blocks whose delete started ("?") and never
    returned ("-") before the kill; each may be there or gone, never wrong."""
    live: set[int] = set()
    doubt: set[int] = set()
    for path in paths:
        with open(path) as f:
            for line in f:
                if not line.endswith("\n"):
                    continue  # torn last line: that batch's ack never completed
                if line.startswith("?"):
                    live.discard(int(line[1:]))
                    doubt.add(int(line[1:]))
                elif line.startswith("-"):
                    live.discard(int(line[1:]))
                    doubt.discard(int(line[1:]))
                else:
                    live.update(int(x) for x in line.split())
    return live, doubt


def _kill_and_recover(db: tuple[str, str, str], root: str, ack_dir: str, modes: list[str]) -> None:
    """One crasher per mode, each on the same catalog and volume; after each kill, a fresh
    process view must read every block acknowledged so far, by any run, with its bytes."""
    ctx = mp.get_context("spawn")
    acks: list[str] = []
    for run, mode in enumerate(modes):
        ack_path = os.path.join(ack_dir, f"acks-{run}")
        acks.append(ack_path)
        p = ctx.Process(target=_crasher, args=(db, root, ack_path, run * 1_000_000, mode))
        p.start()
        if mode == "timed":  # killed anywhere in its writes, once three batches were acknowledged (as the others)
            polling.wait_until(lambda: os.path.exists(ack_path) and len(_acknowledged([ack_path])) >= 7 * 3, 180,
                               "three batches acknowledged by the timed crasher", every=0.02)
            time.sleep(0.2)  # time passes: the crasher is killed somewhere in its writes
            assert p.is_alive(), "the crasher died on its own"
            os.kill(p.pid, signal.SIGKILL)
        p.join(timeout=180)  # bounds a wait: a crasher imports torch first, slow on a loaded machine
        assert p.exitcode == -signal.SIGKILL, (mode, p.exitcode)

        live, doubt = _ack_state(acks)
        assert len(doubt) <= run + 1  # at most one delete cut short per kill
        assert len(_acknowledged([ack_path])) >= 7 * 3 - 1
        cat = _open_catalog(db)
        agent = StorageAgent(cat, name="mp-recover")
        try:
            agent.register_volume(_descs(root, None, "", "")[0])
            keys = [BlockKey(NS, h) for h in sorted(live)]
            got = agent.get(keys)
            assert all(torch.equal(g, block(k.sequence_hash)) for g, k in zip(got, keys))
            if mode == "delete":  # killed after the delete returned: the block must be gone
                (gone,) = _ack_state([ack_path])[1]
                with pytest.raises(BlockNotFoundError):
                    agent.get([BlockKey(NS, gone)])
            for h in doubt:  # a delete cut short: the block is there whole or not at all
                try:
                    (g,) = agent.get([BlockKey(NS, h)])
                except BlockNotFoundError:
                    continue
                assert torch.equal(g, block(h)), h
            agent.collect_garbage("shared", min_age_s=0)
            vol = agent._vol("shared")  # type: ignore[attr-defined]
            assert set(vol.list_segments()) == {s.segment_id for s in agent.segments("shared")}
            assert all(s.sealed or s.live_blocks for s in agent.segments("shared"))
            # the catalog's accounting agrees with its placements
            placed = list(cat.iter_volume("shared"))
            assert sum(s.live_blocks for s in agent.segments("shared")) == len(placed)
            assert live <= {p.key.sequence_hash for p in placed}
        finally:
            agent.close()
            cat.close()
