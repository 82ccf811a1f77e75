"""Decayed block frequency (TinyLFU-style) and the SSD-wear admission filter.

:class:`FrequencySketch` is a count-min sketch (``depth`` rows of ``width`` 8-bit
counters, numpy ``uint8[depth, width]``) with a *doorkeeper* (the first sighting of a
block only sets a doorkeeper entry) and *aging*: after ``sample_size`` increments every
counter is halved and the doorkeeper is cleared, so the estimate is a frequency over a
sliding window that decays geometrically (TinyLFU, Einziger et al. 2017).  It is fed by
re-Stores of known blocks (onboarding, other workers) and by ``extra_metadata["hits"]``.

:class:`SsdAdmissionFilter` writes a block to an SSD volume only once its frequency is
``>= min_frequency`` (default 2): a Store adds 1, a reported hit *doubles* the estimate,
aging halves it.
"""

from __future__ import annotations

import numpy as np
from pydantic import BaseModel, Field

_MASK64 = (1 << 64) - 1
_SEEDS = (0x9E3779B97F4A7C15, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9, 0xD6E8FEB86659FD93,
          0xFF51AFD7ED558CCD, 0xC4CEB9FE1A85EC53, 0x2545F4914F6CDD1D, 0x94D049BB133111EB)


class FrequencySettings(BaseModel):
    """Sketch size and aging.

    Attributes:
        width: counters per row (rounded up to a power of two).
        depth: rows (independent hashes), 1..8.
        sample_size: increments between two agings (halvings).
        doorkeeper: count a block's first sighting in the doorkeeper only.
    """

    width: int = Field(1 << 16, ge=16)
    depth: int = Field(4, ge=1, le=8)
    sample_size: int = Field(1 << 18, ge=1)
    doorkeeper: bool = True


class FrequencySketch:
    """Approximate, decaying access counts of u64 sequence hashes (never undercounts
    within the current window; saturates at 255).

    Args:
        settings: size and aging.
    """

    def __init__(self, settings: FrequencySettings | None = None) -> None:
        self.settings = s = settings or FrequencySettings()
        width = 1 << max(4, (s.width - 1).bit_length())
        self._shift = 64 - (width.bit_length() - 1)
        self._table = np.zeros((s.depth, width), dtype=np.uint8)
        self._rows = np.arange(s.depth)
        self._seeds = _SEEDS[: s.depth]
        self._door: set[int] = set()
        self._ops = 0
        self.agings = 0

    def _index(self, h: int) -> list[int]:
        x = (h ^ (h >> 31)) & _MASK64
        sh = self._shift
        return [((x * k) & _MASK64) >> sh for k in self._seeds]

    def increment(self, h: int, n: int = 1) -> None:
        """Count ``n`` accesses of block ``h`` (``n >= 1``; any larger ``n``, up to the u64
        hit counts partners report, saturates the 8-bit counters at 255)."""
        if n <= 0:
            return
        if n > 256:
            n = 256  # the doorkeeper may take one; counters saturate at 255 anyway
        if self.settings.doorkeeper and h not in self._door:
            self._door.add(h)
            n -= 1
        if n:
            cols = self._index(h)
            t = self._table
            cur = t[self._rows, cols]
            t[self._rows, cols] = np.minimum(cur.astype(np.int32) + n, 255).astype(np.uint8)
        self._ops += 1
        if self._ops >= self.settings.sample_size:
            self.age()

    def estimate(self, h: int) -> int:
        """Decayed access count of ``h`` (0 for a block never seen in the window)."""
        base = int(self._table[self._rows, self._index(h)].min())
        return base + (1 if h in self._door else 0)

    def age(self) -> None:
        """Halve every counter and clear the doorkeeper (called every ``sample_size`` ops)."""
        self._table >>= 1
        self._door.clear()
        self._ops = 0
        self.agings += 1


class SsdAdmissionFilter:
    """Admit a block to an SSD volume only when its decayed frequency is high enough.

    Args:
        min_frequency: admit at ``estimate >= min_frequency`` (default 2).
        sketch: the frequency sketch to use (a private one by default).
    """

    def __init__(self, min_frequency: int = 2, sketch: FrequencySketch | None = None) -> None:
        if min_frequency < 1:
            raise ValueError(f"min_frequency must be >= 1, got {min_frequency}")
        self.min_frequency = min_frequency
        self.sketch = sketch or FrequencySketch()
        self.admitted = 0
        self.refused = 0

    def record_store(self, h: int) -> None:
        """A Store (compute, onboard or copy) of block ``h``: +1."""
        self.sketch.increment(h, 1)

    def record_hit(self, h: int) -> None:
        """A hit of block ``h``: doubles its estimate (at least +1)."""
        self.sketch.increment(h, max(1, self.sketch.estimate(h)))

    def admit(self, h: int) -> bool:
        """Whether to write ``h`` to the SSD now (counted in ``admitted`` / ``refused``)."""
        ok = self.sketch.estimate(h) >= self.min_frequency
        if ok:
            self.admitted += 1
        else:
            self.refused += 1
        return ok


__all__ = ["FrequencySettings", "FrequencySketch", "SsdAdmissionFilter"]
