"""``Volume.write_segments``: several segments in one call are all or nothing (real NIXL
POSIX on files under tmp_path): when one of them fails, the ones already written are
deleted, and the catalog never hears of any."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from storage_backends import MediaClass, SqliteCatalog, StorageAgent, TransferError, VolumeDescriptor, VolumeKind


@pytest.fixture
def agent(tmp_path: Path) -> Iterator[StorageAgent]:
    cat = SqliteCatalog(tmp_path / "c.sqlite")
    a = StorageAgent(cat, name=f"waves-{tmp_path.name}")
    a.register_volume(VolumeDescriptor("v", VolumeKind.POSIX, MediaClass.NVME, 1 << 30, root=str(tmp_path / "v")))
    yield a
    a.close()
    cat.close()


def test_a_failing_segment_takes_the_already_written_ones_of_its_call_with_it(agent: StorageAgent) -> None:
    vol = agent._vol("v")  # type: ignore[attr-defined]
    buf = torch.arange(8192, dtype=torch.int64).view(torch.uint8)[:8192]
    vol.engine.register_tensor(buf)
    good = np.array([[buf.data_ptr(), 4096, 0]], dtype=np.int64)
    vol.write_segments([(901, good, 4096)])  # a call of one: written and kept
    assert vol.list_segments() == [901] and vol.path(901).read_bytes() == buf[:4096].numpy().tobytes()
    unregistered = np.array([[0x10, 4096, 0]], dtype=np.int64)  # no registered memory there
    deleted = vol.counters.segments_deleted
    with pytest.raises(TransferError):
        vol.write_segments([(902, good, 4096), (903, unregistered, 4096)])
    assert vol.list_segments() == [901]  # 902 was written, then deleted with the call
    assert vol.counters.segments_deleted == deleted + 1
    assert not vol.path(903).exists()
