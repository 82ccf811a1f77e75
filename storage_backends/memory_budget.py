"""Refuse an allocation sized from configuration before it is made.

A pool, staging buffer or bounce buffer whose size comes from a setting (blocks x block
bytes, a volume's ``segment_bytes``...) is checked against the memory the device can give
*before* torch allocates it: instead of the allocator's raw error, or the OOM killer when the
size is under the kernel's overcommit limit, the caller gets one error naming what was
being sized, the bytes, the setting and the memory available.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch

_GIB = 1 << 30


class MemoryBudgetError(ValueError):
    """An allocation sized from configuration exceeds the memory available."""


def available_bytes(device: torch.device | str = "cpu") -> int | None:
    """Memory available to a new allocation on ``device``, in bytes, or ``None`` if unknown.

    CPU: ``MemAvailable`` of ``/proc/meminfo`` (Linux), else psutil's
    ``virtual_memory().available`` when installed. CUDA: the free bytes of
    ``torch.cuda.mem_get_info`` for that device.
    """
    dev = torch.device(device)
    if dev.type == "cuda":
        with contextlib.suppress(RuntimeError, AssertionError):
            return int(torch.cuda.mem_get_info(dev)[0])
        return None
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024  # kB
    try:
        import psutil  # type: ignore[import-untyped]
    except ImportError:
        return None
    return int(psutil.virtual_memory().available)


def check_allocation(what: str, nbytes: int, setting: str, device: torch.device | str = "cpu",
                     available: int | None = None) -> None:
    """Refuse to allocate ``nbytes`` for ``what`` when ``device`` has less available.

    Args:
        what: what is being sized, e.g. ``"G2 host pool"`` or ``"staging buffer of volume 'fast'"``.
        nbytes: bytes the allocation needs.
        setting: the setting(s) it is sized from, e.g. ``"g2_blocks=1000000 x 2097152 bytes"``.
        device: where it will be allocated.
        available: bytes available (default :func:`available_bytes`; unknown: no check).

    Raises:
        MemoryBudgetError: e.g. ``"G2 host pool needs 1907.35 GiB (2048000000000 bytes;
            g2_blocks=1000000 x 2048000 bytes) but cpu has 12.00 GiB available"``.
    """
    avail = available_bytes(device) if available is None else available
    if avail is None or nbytes <= avail:
        return
    dev = torch.device(device)
    raise MemoryBudgetError(
        f"{what} needs {nbytes / _GIB:.2f} GiB ({nbytes} bytes; {setting}) but {dev} has "
        f"{avail / _GIB:.2f} GiB ({avail} bytes) available; lower the setting"
    )
