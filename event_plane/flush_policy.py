"""Adaptive flush time limit: the batch age bound shrinks as the event rate rises.

Rule (``docs/events.md`` §3.1), with ``rate`` the publisher's recent event rate in events/s::

    flush_delay = clamp(target_batch_events / rate, min_delay_s, max_delay_s)

so a pending batch never waits longer than it takes, at the current rate, to gather about
``target_batch_events`` events, but never less than ``min_delay_s`` (to keep batches worth
sending) nor more than ``max_delay_s`` (the configured ceiling, 10 s by default). At rest
(rate → 0) the delay is ``max_delay_s``.

``rate`` is an exponentially weighted event count over a time constant ``window_s``
(events observed ``t`` seconds ago weigh ``exp(-t / window_s)``), divided by ``window_s``.
It reaches ~63 % of a new steady rate after one window, so a burst lowers the delay within
a fraction of a second, and it decays back when publishing stops.

The decay (one ``exp``) is applied at most once per ``window_s / 1000`` (1 ms at the
default 1 s window): events observed in between are summed and folded in at the next
update, so a publisher called hundreds of thousands of times a second does not pay an
``exp`` per call.  The estimate differs from a per-call update by at most that fraction
of a window (0.1 %).
"""

from __future__ import annotations

import math


class AdaptiveDelay:
    """Event-rate estimator plus the flush time limit rule above. Not thread-safe (the
    publisher calls it under its lock).

    Args:
        max_delay_s: ceiling of the time limit, seconds (> 0).
        min_delay_s: floor of the time limit, seconds (> 0); capped at ``max_delay_s``.
        target_batch_events: events a batch should gather at most before the time limit
            sends it (> 0).
        window_s: time constant of the rate estimate, seconds (> 0).
        enabled: ``False`` pins the time limit at ``max_delay_s``.
    """

    __slots__ = (
        "enabled", "max_delay_s", "min_delay_s", "target_batch_events", "window_s", "_weight", "_at", "_pending", "_step"
    )

    def __init__(
        self,
        max_delay_s: float,
        min_delay_s: float,
        target_batch_events: int,
        window_s: float = 1.0,
        *,
        enabled: bool = True,
    ) -> None:
        self.max_delay_s = float(max_delay_s)
        self.min_delay_s = min(float(min_delay_s), self.max_delay_s)
        self.target_batch_events = int(target_batch_events)
        self.window_s = float(window_s)
        self.enabled = enabled
        self._weight = 0.0  # decayed event count as of ``_at``
        self._at = -math.inf  # the first observation always updates
        self._pending = 0  # events observed since ``_at``, not folded into ``_weight`` yet
        self._step = self.window_s / 1000.0  # least time between two decay updates

    def observe(self, n: int, now: float) -> bool:
        """Record ``n`` events published at monotonic time ``now`` (seconds).

        Returns:
            ``True`` when the estimate was updated now (at most once per
            ``window_s / 1000``), ``False`` when the events were only summed: the caller
            need only re-read :meth:`delay` after an update.
        """
        at = self._at
        if 0.0 <= now - at < self._step:
            self._pending += n
            return False
        weight = self._weight + self._pending
        if weight:
            weight *= math.exp(-max(0.0, now - at) / self.window_s)
        self._weight = weight + n
        self._pending = 0
        self._at = now
        return True

    def rate(self, now: float) -> float:
        """Estimated event rate at ``now``, events per second."""
        weight = self._weight + self._pending
        if not weight:
            return 0.0
        return weight * math.exp(-max(0.0, now - self._at) / self.window_s) / self.window_s

    def delay(self, now: float) -> float:
        """The flush time limit at ``now``, seconds, in ``[min_delay_s, max_delay_s]``."""
        if not self.enabled:
            return self.max_delay_s
        return flush_delay(self.rate(now), self.target_batch_events, self.min_delay_s, self.max_delay_s)


def flush_delay(rate: float, target_batch_events: int, min_delay_s: float, max_delay_s: float) -> float:
    """``clamp(target_batch_events / rate, min_delay_s, max_delay_s)`` (seconds); a rate of
    0 or less (events/s) gives ``max_delay_s``."""
    if rate <= 0.0:
        return max_delay_s
    return min(max_delay_s, max(min_delay_s, target_batch_events / rate))
