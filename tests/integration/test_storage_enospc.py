"""Case C14 on a real 1 MiB filesystem: a tmpfs the test mounts under ``tmp_path``.

Where mounting is refused (EPERM: not root, no CAP_SYS_ADMIN) the tests run against an
injected writer that stops one byte short and then raises ENOSPC; the reason is then in
the test id, so a run that could not use the real filesystem says so.
"""

from __future__ import annotations

import ctypes
import errno
import os
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from storage_backends import (
    BlockKey,
    MediaClass,
    SqliteCatalog,
    StorageAgent,
    VolumeDescriptor,
    VolumeFullError,
    VolumeKind,
)

NS = "c14c14c14c14c14c"
BLOCK = 256 << 10


def _probe_mount() -> tuple[bool, str]:
    """Can this process mount a tmpfs?  ``(True, "")`` or ``(False, reason)``."""
    d = tempfile.mkdtemp(prefix="kvadvisor-mount-probe-")
    try:
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", d], capture_output=True, text=True)
        if r.returncode != 0:
            return False, (r.stderr.strip().splitlines() or ["mount failed"])[-1][:60].replace(" ", "_")
        subprocess.run(["umount", d], check=True)
        return True, ""
    except OSError as exc:  # no mount binary
        return False, f"{type(exc).__name__}_{exc.errno}"
    finally:
        os.rmdir(d)


_CAN_MOUNT, _WHY = _probe_mount()
MODE = "tmpfs-1MiB" if _CAN_MOUNT else f"injected-short-writer[EPERM:{_WHY}]"


def block(h: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(h)
    return torch.randint(0, 256, (BLOCK,), dtype=torch.uint8, generator=g)


@pytest.fixture(params=[MODE])
def small_fs(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Path]:
    """A 1 MiB filesystem at ``tmp_path/mnt`` (real tmpfs), unmounted afterwards.

    tmpfs has no metadata overhead, so 4 x 256 KiB would fit exactly; a 4 KiB file of
    another tenant stands in for the overhead a real filesystem has.
    """
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    if _CAN_MOUNT:
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], check=True)
    try:
        (mnt / "other-tenant").write_bytes(b"x" * 4096)
        yield mnt
    finally:
        if _CAN_MOUNT:
            subprocess.run(["umount", str(mnt)], check=True)


def _agent(tmp_path: Path, root: Path, name: str) -> tuple[StorageAgent, SqliteCatalog]:
    cat = SqliteCatalog(tmp_path / "catalog.sqlite")  # the catalog is NOT on the small filesystem
    agent = StorageAgent(cat, name=name)
    # capacity says 1 GiB: the filesystem, not the catalog's accounting, runs out
    agent.register_volume(VolumeDescriptor("tiny", VolumeKind.POSIX, MediaClass.SSD, 1 << 30, root=str(root),
                                           segment_bytes=BLOCK))
    return agent, cat


def _inject_short_writer(vol: object) -> None:
    """Fallback where mounting is impossible: every write stops one byte short, then ENOSPC
    once three segments exist (the fourth would not fit on a 1 MiB filesystem)."""
    orig = vol._write  # type: ignore[attr-defined]

    def write(fd: int, path: Path, local: np.ndarray, size: int, before_piece: object = None) -> None:
        if len(list(vol.dir.iterdir())) <= 3:  # type: ignore[attr-defined]
            orig(fd, path, local, size, before_piece)
            return
        data = b"".join(ctypes.string_at(int(a), int(n)) for a, n, _ in local.tolist())
        os.pwrite(fd, data[: size - 1], 0)
        raise OSError(errno.ENOSPC, "No space left on device")

    vol._write = write  # type: ignore[attr-defined]
    vol.fallocate = lambda fd, off, n: None  # type: ignore[attr-defined]


def test_c14_offload_4x256k_onto_1mib_only_whole_blocks_are_stored(tmp_path: Path, small_fs: Path) -> None:
    agent, cat = _agent(tmp_path, small_fs, "c14-prealloc")
    try:
        vol = agent._vol("tiny")  # type: ignore[attr-defined]
        if not _CAN_MOUNT:
            _inject_short_writer(vol)
        keys = [BlockKey(NS, i) for i in range(4)]
        with pytest.raises(VolumeFullError) as ei:
            agent.put([(k, block(i)) for i, k in enumerate(keys)], "tiny")
        assert ei.value.errno == errno.ENOSPC and "[Errno 28]" in str(ei.value)
        # blocks 0-2 landed whole and were acknowledged; no placement for block 3
        assert agent.exists(keys) == [True, True, True, False]
        # the error says which blocks landed, with their placements, in item order
        assert ei.value.stored == agent.locate(keys[:3])
        got = agent.get(keys[:3])
        assert all(torch.equal(g, block(i)) for i, g in enumerate(got))
        # no partial segment left behind, in the catalog or on the filesystem
        segs = agent.segments("tiny")
        assert len(segs) == 3 and all(s.sealed and s.live_blocks == 1 for s in segs)
        assert sorted(vol.list_segments()) == [s.segment_id for s in segs]
        assert all(os.path.getsize(vol.path(s.segment_id)) == BLOCK for s in segs)
        # freeing space makes room again: the same block now lands
        agent.delete([keys[0]])
        (p3,) = agent.put([(keys[3], block(3))], "tiny")
        assert torch.equal(agent.get([keys[3]])[0], block(3)) and p3.length == BLOCK
    finally:
        agent.close()
        cat.close()


def test_c14_short_nixl_write_is_detected_and_nothing_registered(tmp_path: Path, small_fs: Path) -> None:
    """Preallocation that reserves nothing (thin / copy-on-write filesystems behave so):
    the NIXL WRITE itself runs out of space part-way.  The short transfer is detected
    (NIXL's error, and the file length), reported as ENOSPC, and the file is removed."""
    agent, cat = _agent(tmp_path, small_fs, "c14-short")
    try:
        vol = agent._vol("tiny")  # type: ignore[attr-defined]
        if _CAN_MOUNT:
            vol.fallocate = lambda fd, off, n: None
        else:
            _inject_short_writer(vol)
        first = [BlockKey(NS, 10 + i) for i in range(2)]
        agent.put([(k, block(10 + i)) for i, k in enumerate(first)], "tiny")  # acknowledged
        rest = [BlockKey(NS, 20 + i) for i in range(2)]
        with pytest.raises(VolumeFullError) as ei:
            # with the 4 KiB tenant file, the second of these cannot land whole
            agent.put([(k, block(20 + i)) for i, k in enumerate(rest)], "tiny")
        assert ei.value.errno == errno.ENOSPC
        assert agent.exists(first + rest) == [True, True, True, False]
        assert ei.value.stored == agent.locate(rest[:1])
        assert len(agent.segments("tiny")) == 3 and len(vol.list_segments()) == 3
        got = agent.get(first + rest[:1])
        assert [torch.equal(g, block(h)) for g, h in zip(got, (10, 11, 20))] == [True] * 3
    finally:
        agent.close()
        cat.close()


def test_put_that_fails_on_its_first_segment_reports_only_blocks_already_held(tmp_path: Path, small_fs: Path) -> None:
    agent, cat = _agent(tmp_path, small_fs, "c14-held")
    try:
        vol = agent._vol("tiny")  # type: ignore[attr-defined]
        if not _CAN_MOUNT:
            _inject_short_writer(vol)
        keys = [BlockKey(NS, 30 + i) for i in range(5)]
        agent.put([(keys[0], block(30))], "tiny")
        held = agent.locate(keys[:1])
        agent.put([(k, block(31 + i)) for i, k in enumerate(keys[1:3])], "tiny")
        with pytest.raises(VolumeFullError) as ei:  # keys[0] is held, 3 and 4 cannot land
            agent.put([(keys[3], block(33)), (keys[0], block(30)), (keys[4], block(34))], "tiny")
        assert ei.value.stored == held
        assert agent.exists(keys) == [True, True, True, False, False]
    finally:
        agent.close()
        cat.close()
