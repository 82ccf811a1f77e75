"""KVBM's disk options on real POSIX volumes (``VolumeDescriptor.require_o_direct``,
``zerofill_fallback``): a filesystem that refuses O_DIRECT, one without
``fallocate(FALLOC_FL_KEEP_SIZE)`` (ramfs refuses both), and a full tmpfs during the
zero-fill.

ramfs and the 1 MiB tmpfs are mounted under ``tmp_path`` (needs root / CAP_SYS_ADMIN);
where mounting is refused, /dev/shm and tmp_path are tried for an O_DIRECT refusal and the
other tests skip, saying why.
"""

from __future__ import annotations

import errno
import logging
import os
import subprocess
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
    VolumeConfigError,
    VolumeDescriptor,
    VolumeFullError,
    VolumeKind,
)

NS = "diskoptsdiskopts"


def _mount(kind: str, where: Path, *options: str) -> str:
    """Mount a ``kind`` filesystem at ``where``; ``""`` or why it failed."""
    where.mkdir(parents=True, exist_ok=True)
    try:
        r = subprocess.run(["mount", "-t", kind, *options, kind, str(where)], capture_output=True, text=True)
    except OSError as exc:
        return f"no mount binary ({exc})"
    return "" if r.returncode == 0 else (r.stderr.strip() or f"mount exited {r.returncode}")


@pytest.fixture
def ramfs(tmp_path: Path) -> Iterator[Path]:
    """A ramfs at ``tmp_path/ramfs``: refuses O_DIRECT (EINVAL) and FALLOC_FL_KEEP_SIZE
    (EOPNOTSUPP)."""
    mnt = tmp_path / "ramfs"
    why = _mount("ramfs", mnt)
    if why:
        pytest.skip(f"cannot mount a ramfs (needs root / CAP_SYS_ADMIN): {why}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], check=True)


def _refuses_o_direct(d: Path) -> bool:
    probe = d / f".probe-{os.getpid()}"
    try:
        fd = os.open(probe, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600)
    except OSError as exc:
        return exc.errno == errno.EINVAL
    finally:
        probe.unlink(missing_ok=True)
    os.close(fd)
    return False


@pytest.fixture
def no_o_direct_dir(tmp_path: Path) -> Iterator[Path]:
    """A directory on a filesystem that refuses O_DIRECT: a ramfs, else /dev/shm (tmpfs
    before Linux 6.6), else tmp_path; skips when none refuses it."""
    mnt = tmp_path / "ramfs"
    tried = []
    why = _mount("ramfs", mnt)
    if not why:
        try:
            assert _refuses_o_direct(mnt), "ramfs accepted O_DIRECT"
            yield mnt
        finally:
            subprocess.run(["umount", str(mnt)], check=True)
        return
    tried.append(f"ramfs: {why}")
    for d in (Path("/dev/shm"), tmp_path):
        if d.is_dir() and os.access(d, os.W_OK):
            if _refuses_o_direct(d):
                sub = d / f"kvadvisor-odirect-{os.getpid()}-{tmp_path.name}"
                sub.mkdir()
                try:
                    yield sub
                finally:
                    subprocess.run(["rm", "-rf", str(sub)], check=True)
                return
            tried.append(f"{d} accepts O_DIRECT")
    pytest.skip("no filesystem here refuses O_DIRECT (" + "; ".join(tried) + ")")


def _agent(tmp_path: Path, name: str) -> tuple[StorageAgent, SqliteCatalog]:
    cat = SqliteCatalog(tmp_path / f"{name}.sqlite")
    return StorageAgent(cat, name=name), cat


def _posix(vid: str, root: Path, **kw: object) -> VolumeDescriptor:
    return VolumeDescriptor(vid, VolumeKind.POSIX, MediaClass.SSD, 1 << 30, root=str(root), **kw)  # type: ignore[arg-type]


def _blocks(n: int, nbytes: int) -> list[tuple[BlockKey, torch.Tensor]]:
    return [(BlockKey(NS, i), torch.full((nbytes,), i + 1, dtype=torch.uint8)) for i in range(n)]


def test_open_direct_requires_a_filesystem_that_takes_o_direct(tmp_path: Path, no_o_direct_dir: Path) -> None:
    agent, cat = _agent(tmp_path, "open-direct")
    try:
        with pytest.raises(VolumeConfigError, match="refuses O_DIRECT .*require_o_direct is set"):
            agent.register_volume(_posix("od", no_o_direct_dir, o_direct=True, require_o_direct=True))
        assert [p.name for p in (no_o_direct_dir / "od").iterdir()] == []  # the probe is gone
        # the default allocator falls back to buffered I/O there, counted (today's behaviour)
        vol = agent.register_volume(_posix("buffered", no_o_direct_dir, o_direct=True))
        items = _blocks(2, 8192)
        agent.put(items, "buffered")
        assert [torch.equal(g, t) for g, (_, t) in zip(agent.get([k for k, _ in items]), items)] == [True, True]
        assert vol.counters.extra["o_direct_fallbacks"] == 1 and vol.block_alignment == 1
        with pytest.raises(VolumeConfigError, match="require_o_direct needs o_direct=True"):
            agent.register_volume(_posix("nod", no_o_direct_dir, require_o_direct=True))
    finally:
        agent.close()
        cat.close()


def test_open_direct_on_a_filesystem_that_takes_o_direct(tmp_path: Path) -> None:
    if _refuses_o_direct(tmp_path):
        pytest.skip(f"{tmp_path} refuses O_DIRECT")
    agent, cat = _agent(tmp_path, "open-direct-ok")
    try:
        vol = agent.register_volume(_posix("od", tmp_path / "vol", o_direct=True, require_o_direct=True))
        items = _blocks(3, 4096)
        ps = agent.put(items, "od")
        assert all(p.offset % 4096 == 0 for p in ps)
        assert [torch.equal(g, t) for g, (_, t) in zip(agent.get([k for k, _ in items]), items)] == [True] * 3
        assert vol.counters.extra.get("o_direct_fallbacks", 0) == 0 and vol.block_alignment == 4096
    finally:
        agent.close()
        cat.close()


def _write_watching_allocation(vol: object, cat: SqliteCatalog, size: int) -> tuple[int, int]:
    """Write one ``size``-byte segment through the volume; returns the segment file's
    ``(st_size, allocated bytes)`` seen right before its first byte is written."""
    seen: list[tuple[int, int]] = []
    seg = cat.new_segment(vol.desc.id, size)  # type: ignore[attr-defined]

    def before_piece(j: int, end: int) -> None:
        if not seen:
            st = os.stat(vol.path(seg))  # type: ignore[attr-defined]
            seen.append((st.st_size, st.st_blocks * 512))

    with vol.engine.lock:  # type: ignore[attr-defined]
        buf = vol.engine.staging(size, 4096)  # type: ignore[attr-defined]
        buf[:size].fill_(7)
        local = np.array([[buf.data_ptr(), size, 0]], dtype=np.int64)
        vol.write_segments([(seg, local, size)], before_piece=before_piece)  # type: ignore[attr-defined]
    assert os.path.getsize(vol.path(seg)) == size  # type: ignore[attr-defined]
    return seen[0]


@pytest.mark.parametrize("zerofill", [True, False], ids=["zerofill", "extend-only"])
def test_zerofill_fallback_where_fallocate_is_unsupported(
    tmp_path: Path, ramfs: Path, zerofill: bool, caplog: pytest.LogCaptureFixture
) -> None:
    agent, cat = _agent(tmp_path, f"zf-{zerofill}")
    size = 3 << 20
    try:
        vol = agent.register_volume(_posix("z", ramfs, zerofill_fallback=zerofill))
        with caplog.at_level(logging.INFO, logger="storage_backends.posix_volume"):
            first = _write_watching_allocation(vol, cat, size)
            _write_watching_allocation(vol, cat, size)
        if zerofill:  # the space was really allocated before the write
            assert first[0] == size and first[1] >= size
        else:  # only extended: nothing allocated yet
            assert first == (size, 0)
        assert vol.counters.extra["fallocate_fallbacks"] == 2
        extend_logs = [r for r in caplog.records if "only extended (ftruncate)" in r.getMessage()]
        assert len(extend_logs) == (0 if zerofill else 1)  # logged once per volume
        items = _blocks(2, 100_000)
        agent.put(items, "z")
        assert [torch.equal(g, t) for g, (_, t) in zip(agent.get([k for k, _ in items]), items)] == [True, True]
    finally:
        agent.close()
        cat.close()


def test_enospc_during_the_zero_fill_is_a_volume_full_error(tmp_path: Path) -> None:
    """A 1 MiB tmpfs; fallocate refused (the volume's fault-injection hook) so the segment is
    zero-filled and the fill itself hits ENOSPC: a VolumeFullError, not the BufferError of
    closing a mapping whose view is still exported."""
    mnt = tmp_path / "small"
    why = _mount("tmpfs", mnt, "-o", "size=1m")
    if why:
        pytest.skip(f"cannot mount a 1 MiB tmpfs (needs root / CAP_SYS_ADMIN): {why}")
    agent, cat = _agent(tmp_path, "zf-enospc")
    try:
        vol = agent.register_volume(_posix("tiny", mnt))  # zerofill_fallback: on by default

        def no_fallocate(fd: int, off: int, n: int) -> None:
            raise OSError(errno.EOPNOTSUPP, "fallocate not supported")

        vol.fallocate = no_fallocate  # type: ignore[attr-defined]
        with pytest.raises(VolumeFullError, match="no space") as ei:
            agent.put(_blocks(1, 2 << 20), "tiny")
        assert ei.value.errno == errno.ENOSPC
        assert agent.exists([BlockKey(NS, 0)]) == [False] and list(vol.dir.iterdir()) == []  # type: ignore[attr-defined]
        agent.put(_blocks(1, 256 << 10), "tiny")  # space is given back: a block that fits lands
    finally:
        agent.close()
        cat.close()
        subprocess.run(["umount", str(mnt)], check=True)
