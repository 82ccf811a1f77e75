"""Start-up errors name the setting, what was under way and how long it ran: a worker group
that cannot form (torch's DistStoreError / DistNetworkError become one GroupInitError
without C++ frames), and a leader / worker join that times out while the late rank is
still allocating its host cache (docs/reliability.md)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch.distributed as dist

from kvbm_runtime import RuntimeConfig
from kvbm_runtime.handshake import WorkerJoinError, WorkerProgress, endpoint_path, join_workers
from kvbm_runtime.parallel import GroupInitError, init_group
from storage_backends import free_port

SETTING = "DYN_KVBM_LEADER_WORKER_INIT_TIMEOUT_SECS"


def _config() -> RuntimeConfig:
    return RuntimeConfig(model_name="faults/startup", page_size=4, inner_dim=16, g1_blocks=8, g2_blocks=16,
                         leader_worker_init_timeout_secs=2.0)


@pytest.mark.parametrize("rank", [0, 1], ids=["leader_alone", "no_leader"])
def test_a_group_that_cannot_form_names_the_setting_and_the_time(rank: int) -> None:
    url = f"tcp://127.0.0.1:{free_port()}"  # rank 0 serves the store; nobody else comes (or nobody serves)
    t0 = time.monotonic()
    with pytest.raises(GroupInitError) as ei:
        init_group(_config(), rank, 2, url, backend="gloo")
    ran = time.monotonic() - t0
    msg = str(ei.value)
    assert f"rank {rank} of 2" in msg and url in msg and "gloo" in msg
    assert SETTING in msg and "= 2 s" in msg
    took = float(msg.split(" after ")[1].split(" s ")[0])
    assert 0 < took <= ran + 0.1
    assert isinstance(ei.value.__cause__, (dist.DistError, TimeoutError, ConnectionError))
    assert "Exception raised from" not in msg and "frame #" not in msg  # no C++ frames
    assert not dist.is_initialized()


def test_a_join_timeout_says_what_the_late_worker_was_doing(tmp_path: Path) -> None:
    socks = tmp_path / "sockets"
    late, absent = endpoint_path("engine-f", 0, socks), endpoint_path("engine-f", 1, socks)
    progress = WorkerProgress(late)
    progress.phase("allocating the G2 host cache: 6,553,600 blocks, 200.0 GiB")
    with pytest.raises(WorkerJoinError) as ei:
        join_workers([late], 0.5, {})
    msg = str(ei.value)
    assert "rank 0" in msg and SETTING in msg and "within 0.5 s" in msg
    assert "was allocating the G2 host cache: 6,553,600 blocks, 200.0 GiB (for " in msg
    assert "since it started" in msg
    progress.done()
    assert not Path(late.removeprefix("ipc://") + ".phase").exists()
    with pytest.raises(WorkerJoinError, match="reported no start-up progress"):
        join_workers([absent], 0.2, {})
