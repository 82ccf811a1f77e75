"""Time model of the evaluator (``kvadvisor evaluate --tiers``): blocks ready in time and TTFT.

The hit rate says which blocks sit on the fast tier; this model says *when* the others can
be there, so that prefetching is no longer free.

* **Tiers.**  The fast tier is the evaluated capacity (host DRAM next to the GPU: a block on
  it is ready).  Below it, :data:`DEFAULT_TIERS` (named after real media): local NVMe
  (7 GB/s, 0.1 ms, 100,000 blocks) and S3 (1.25 GB/s = 10 Gb/s, 30 ms, unbounded).  Every
  block once referenced is written down; the lower tiers hold blocks by recency (NVMe: the
  ``capacity`` most recently referenced distinct blocks; S3: everything older).  Each tier
  has one link, a FIFO server: a transfer of ``B`` bytes issued at ``t`` starts at
  ``max(t, link free)``, occupies the link ``B / bandwidth`` and is done ``latency`` after.
* **Blocks.**  ``block_bytes`` = 512 tokens × 128 KiB per token (Llama-3.1-8B, fp16 K and
  V: 32 layers × 8 KV heads × 128 dims × 2 × 2 B) = 64 MiB, the Mooncake trace's 512-token
  blocks.
* **Arrivals** come from the trace's timestamps; a request's prefill starts at its arrival
  (enough engines: queueing at the GPU is not modelled).
* **Lookahead K** (a router's ``/v1/lookup`` or a scheduler's queue of K requests): request
  i becomes visible at the arrival of request i − K.  The policy then promotes its blocks
  that sit on a lower tier (:func:`advisor.policy.eviction.prefix_value.simulate_promotions`),
  and each promotion is a transfer on that tier's link issued at that moment.  A block
  counts as *ready in time* only if it is on the fast tier and, if it was promoted, its
  transfer is done when the request's prefill starts; the ready prefix ends at the first
  block that is not.
* **Background promotions** (the default policy's refill after a switch of experts,
  :attr:`advisor.policy.eviction.experts.SelectorRun.promoted_at`): each is a transfer on
  its block's tier link issued at the arrival of the request it was made before; a hit on
  the block is ready once it is done.
* **TTFT proxy** (seconds) of a request: with the ready prefix of r blocks, either load the
  following blocks that a lower tier holds (demand transfers issued at arrival, on the
  links, after the prefetches already queued) and recompute the rest, or recompute
  everything after the ready prefix, whichever is sooner, at ``prefill_tokens_per_s``
  (16,000 tokens/s, an 8B model's prefill on one H100-class GPU).  Decode is not counted.

Everything is per request in arrival order, in one pass (O(references)).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numba
import numpy as np

from advisor.policy.eviction.compact import CompactTrace
from advisor.policy.eviction.dlist import new_lists, push_head, unlink


@dataclass(frozen=True)
class Tier:
    """A tier below the fast one.

    Attributes:
        name: its name (the medium).
        bandwidth: bytes per second of its link.
        latency: seconds from a transfer's start to its first byte.
        capacity: blocks it holds (``math.inf``: everything).
    """

    name: str
    bandwidth: float
    latency: float
    capacity: float

    def __post_init__(self) -> None:
        if not (self.bandwidth > 0 and self.latency >= 0 and self.capacity >= 1):
            raise ValueError(f"tier {self.name}: need bandwidth > 0, latency >= 0, capacity >= 1")


DEFAULT_TIERS: tuple[Tier, ...] = (
    Tier("nvme", 7e9, 100e-6, 100_000),
    Tier("s3", 1.25e9, 30e-3, math.inf),
)


@dataclass(frozen=True)
class TimeModel:
    """Settings of the time model (module docstring).

    Attributes:
        tiers: the tiers below the fast one, fastest first.
        block_tokens: tokens per block.
        block_bytes: bytes of one block's KV cache.
        prefill_tokens_per_s: recompute rate.
    """

    tiers: tuple[Tier, ...] = DEFAULT_TIERS
    block_tokens: int = 512
    block_bytes: float = 512 * 131_072
    prefill_tokens_per_s: float = 16_000.0

    def __post_init__(self) -> None:
        if not self.tiers or self.block_tokens < 1 or self.block_bytes <= 0 or self.prefill_tokens_per_s <= 0:
            raise ValueError("need at least one tier and positive block size, bytes and prefill rate")


@dataclass
class TimedResult:
    """One policy under the time model.

    Attributes:
        ready: blocks ready in time per request (int64 ``[requests]``).
        ttft: TTFT proxy per request, seconds (float64 ``[requests]``).
        prefetched: promotions transferred.
        late: requests whose ready prefix a promotion not yet done cut short.
        link_busy: seconds each tier's link was busy.
    """

    ready: np.ndarray
    ttft: np.ndarray
    prefetched: int = 0
    late: int = 0
    link_busy: list[float] = field(default_factory=list)

    def ready_rate(self, refs: int) -> float:
        """Blocks ready in time / block references."""
        return float(self.ready.sum()) / refs if refs else 0.0

    def percentile(self, q: float) -> float:
        """TTFT proxy percentile ``q`` (0–100), seconds."""
        return float(np.percentile(self.ttft, q)) if self.ttft.size else 0.0


def parse_tiers(text: str) -> tuple[Tier, ...]:
    """``"default"`` or ``"name=GB/s:latency_ms:capacity_blocks,..."`` (capacity ``inf`` for
    unbounded), fastest first → the tiers.

    Raises:
        ValueError: a malformed part, with the part named.
    """
    if text.strip() == "default":
        return DEFAULT_TIERS
    out = []
    for part in text.split(","):
        try:
            name, rest = part.split("=", 1)
            bw, lat, cap = rest.split(":")
            out.append(Tier(name.strip(), float(bw) * 1e9, float(lat) / 1e3, float(cap)))
        except ValueError as exc:
            raise ValueError(f"tier {part!r}: expected name=GB/s:latency_ms:capacity_blocks ({exc})") from exc
    if not out:
        raise ValueError("no tiers given")
    return tuple(out)


def describe(model: TimeModel) -> str:
    """One line naming the model's tiers, block size and prefill rate."""
    tiers = ", ".join(f"{t.name} {t.bandwidth / 1e9:g} GB/s {t.latency * 1e3:g} ms {t.capacity:,.0f} blocks"
                      for t in model.tiers)
    return (f"{tiers}; {model.block_bytes / 2**20:.0f} MiB blocks of {model.block_tokens} tokens, "
            f"recompute at {model.prefill_tokens_per_s:,.0f} tokens/s")


@numba.njit(cache=True)
def _lower_tier_of(flat: np.ndarray, offsets: np.ndarray, n_blocks: int, caps: np.ndarray, q_req: np.ndarray,
                   q_blk: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For each reference, the lower tier holding its block before the request: 0 = never
    seen, t >= 1 = tier t (tiers hold the most recently referenced distinct blocks, tier 1
    the first ``caps[0]``, tier 2 the next ``caps[1]``, ...): an LRU stack cut at the
    cumulative capacities, tracked with one list per tier.  The same for each query
    ``(q_req[k], q_blk[k])`` (``q_req`` non-decreasing): block ``q_blk[k]`` before request
    ``q_req[k]``."""
    n_t = caps.shape[0]
    prev, nxt, head, tail, size = new_lists(n_blocks, n_t)
    where = np.full(n_blocks, -1, dtype=np.int64)
    out = np.zeros(flat.shape[0], dtype=np.int8)
    q_out = np.zeros(q_req.shape[0], dtype=np.int8)
    k = 0
    for i in range(offsets.shape[0] - 1):
        a, b = offsets[i], offsets[i + 1]
        while k < q_req.shape[0] and q_req[k] <= i:
            q_out[k] = where[q_blk[k]] + 1
            k += 1
        for j in range(a, b):
            out[j] = where[flat[j]] + 1
        for j in range(a, b):
            x = flat[j]
            if where[x] >= 0:
                unlink(prev, nxt, head, tail, size, where[x], x)
            push_head(prev, nxt, head, tail, size, 0, x)
            where[x] = 0
            t = 0
            while t < n_t - 1 and size[t] > caps[t]:  # the oldest moves one tier down
                v = tail[t]
                unlink(prev, nxt, head, tail, size, t, v)
                push_head(prev, nxt, head, tail, size, t + 1, v)
                where[v] = t + 1
                t += 1
            if size[n_t - 1] > caps[n_t - 1]:
                v = tail[n_t - 1]
                unlink(prev, nxt, head, tail, size, n_t - 1, v)
                where[v] = -1
    return out, q_out


@numba.njit(cache=True, inline="always")
def _promote(now: float, lower: int, x: int, free: np.ndarray, busy: np.ndarray, ready_at: np.ndarray,
             xfer: np.ndarray, lat: np.ndarray) -> None:
    """A promotion of block ``x`` from tier ``lower`` (0 = never seen: the last tier) issued at
    ``now`` on that tier's link (FIFO): the link's free time, its busy time and when ``x`` is ready."""
    t = lower - 1 if lower >= 1 else free.shape[0] - 1
    start = max(now, free[t])
    free[t] = start + xfer[t]
    busy[t] += xfer[t]
    ready_at[x] = start + xfer[t] + lat[t]


@numba.njit(cache=True)
def _timed(flat: np.ndarray, offsets: np.ndarray, n_blocks: int, times: np.ndarray, hits: np.ndarray,
           promoted: np.ndarray, lookahead: int, tier: np.ndarray, bw: np.ndarray, lat: np.ndarray,
           block_bytes: float, block_s: float, bg_req: np.ndarray, bg_blk: np.ndarray, bg_tier: np.ndarray) -> tuple:
    n_req = offsets.shape[0] - 1
    n_t = bw.shape[0]
    free = np.zeros(n_t)
    busy = np.zeros(n_t)
    ready_at = np.zeros(n_blocks)
    ready = np.zeros(n_req, dtype=np.int64)
    ttft = np.zeros(n_req)
    n_pref = 0
    n_late = 0
    xfer = block_bytes / bw
    k = 0
    for i in range(n_req):
        now = times[i]
        while k < bg_req.shape[0] and bg_req[k] <= i:  # background promotions issued now
            _promote(now, bg_tier[k], bg_blk[k], free, busy, ready_at, xfer, lat)
            n_pref += 1
            k += 1
        w = i + lookahead
        if lookahead > 0 and promoted.shape[0] > 0 and w < n_req:  # request w became visible now
            for jj in range(offsets[w], offsets[w + 1]):
                if promoted[jj]:
                    _promote(now, tier[jj], flat[jj], free, busy, ready_at, xfer, lat)
                    n_pref += 1
        a, b = offsets[i], offsets[i + 1]
        r = 0
        while r < hits[i] and ready_at[flat[a + r]] <= now:
            r += 1
        if r < hits[i]:
            n_late += 1
        ready[i] = r
        # TTFT: load what lower tiers (or late transfers) hold after the ready prefix, or recompute
        recompute = (b - a - r) * block_s
        best = recompute
        done = now
        j = a + r
        f2 = free.copy()
        add = np.zeros(n_t)
        while j < b:
            x = flat[j]
            if j - a < hits[i]:  # on its way (a late promotion)
                done = max(done, ready_at[x])
            elif tier[j] >= 1:
                t = tier[j] - 1
                start = max(now, f2[t])
                f2[t] = start + xfer[t]
                add[t] += xfer[t]
                done = max(done, start + xfer[t] + lat[t])
            else:
                break
            j += 1
            cand = (done - now) + (b - j) * block_s
            if cand < best:
                best = cand
                for t in range(n_t):  # commit the demand transfers up to here
                    free[t] = f2[t]
                    busy[t] += add[t]
                    add[t] = 0.0
        ttft[i] = best
    return ready, ttft, n_pref, n_late, busy


def replay(trace: CompactTrace, times_s: Sequence[float] | np.ndarray, hits: np.ndarray,
           promoted: np.ndarray | None = None, lookahead: int = 0, model: TimeModel | None = None,
           background: tuple[np.ndarray, np.ndarray] | None = None) -> TimedResult:
    """Blocks ready in time and the TTFT proxy of a policy's replay (module docstring).

    Args:
        trace: the compact trace.
        times_s: arrival time of each request, seconds (non-decreasing), ``[requests]``.
        hits: the policy's fast-tier hit blocks per request (int64 ``[requests]``).
        promoted: with a lookahead, bool ``[refs]`` from
            :func:`advisor.policy.eviction.prefix_value.simulate_promotions`.
        lookahead: K (0 = no hints).
        model: tiers, block size, prefill rate (default :class:`TimeModel`).
        background: promotions not tied to a request, ``(request, block)`` (int64
            ``[promotions]`` each, requests non-decreasing, dense block ids): each is a
            transfer from the block's lower tier issued at that request's arrival (the
            default policy's refill promotions, :attr:`advisor.policy.eviction.experts.
            SelectorRun.promoted_at`); a hit on the block is ready once it is done.

    Raises:
        ValueError: shapes that do not match the trace, a lookahead without ``promoted``, or
            background promotions out of order or out of range.
    """
    m = model or TimeModel()
    times = np.asarray(times_s, dtype=np.float64)
    if times.shape != (trace.requests,) or hits.shape != (trace.requests,):
        raise ValueError(f"need one time and one hit count per request ({trace.requests})")
    if lookahead > 0 and (promoted is None or promoted.shape != (trace.refs,)):
        raise ValueError("a lookahead needs the policy's promotions, one flag per reference")
    raw = [np.asarray(x) for x in background] if background is not None else [np.zeros(0, dtype=np.int64)] * 2
    if any(not np.issubdtype(x.dtype, np.integer) and x.size for x in raw):
        raise ValueError("background promotions need integer request and block indices")
    bg_req, bg_blk = (x.astype(np.int64) for x in raw)
    if bg_req.shape != bg_blk.shape or bg_req.ndim != 1 or (bg_req.size and (
            (np.diff(bg_req) < 0).any() or bg_req.min() < 0 or bg_req.max() >= trace.requests
            or bg_blk.min() < 0 or bg_blk.max() >= trace.n_blocks)):
        raise ValueError("background promotions need one block per request index, requests non-decreasing and "
                         "in range")
    caps = np.array([min(t.capacity, 2**62) for t in m.tiers], dtype=np.int64)
    tier, bg_tier = _lower_tier_of(trace.flat, trace.offsets, trace.n_blocks, caps, bg_req, bg_blk)
    bw = np.array([t.bandwidth for t in m.tiers])
    lat = np.array([t.latency for t in m.tiers])
    prom = promoted if promoted is not None else np.zeros(0, dtype=np.bool_)
    ready, ttft, n_pref, n_late, busy = _timed(trace.flat, trace.offsets, trace.n_blocks, times,
                                               hits.astype(np.int64), prom, lookahead, tier, bw, lat,
                                               float(m.block_bytes), m.block_tokens / m.prefill_tokens_per_s,
                                               bg_req, bg_blk, bg_tier)
    return TimedResult(ready, ttft, int(n_pref), int(n_late), [float(x) for x in busy])



@dataclass
class TimedRow:
    """One policy's line of the time-model table at one capacity."""

    policy: str
    hit_rate: float
    ready_rate: float
    result: TimedResult


def evaluate_timed(trace: CompactTrace, times_s: np.ndarray, capacity: int, lookaheads: Sequence[int],
                   model: TimeModel | None = None,
                   known: dict[str, np.ndarray] | None = None) -> list[TimedRow]:
    """LRU, Belady, the default policy and the default policy with each lookahead K > 0,
    under the time model at ``capacity`` blocks.

    Args:
        known: hits per request already replayed at this capacity (``lru``, ``belady``),
            to skip those replays (the default policy is replayed here: its refill
            promotions go on the links).
    """
    from advisor.policy.eviction import experts, prefix_value
    from advisor.policy.eviction.registry import POLICIES

    known = known or {}
    rows = []
    for name in ("lru", "belady"):
        h = known[name] if name in known else POLICIES[name](trace, capacity, 0, True)
        rows.append(TimedRow(name, float(h.sum()) / trace.refs, 0.0, replay(trace, times_s, h, None, 0, model)))
    run = experts.run(trace, capacity)  # its refill promotions are transfers on the links
    rows.append(TimedRow("adaptive", float(run.hits.sum()) / trace.refs, 0.0,
                         replay(trace, times_s, run.hits, None, 0, model, (run.promoted_at, run.promoted_blocks))))
    for k in lookaheads:
        if k > 0:
            h, prom = prefix_value.simulate_promotions(trace, capacity, k)
            rows.append(TimedRow(f"adaptive@{k}", float(h.sum()) / trace.refs, 0.0,
                                 replay(trace, times_s, h, prom, k, model)))
    for r in rows:
        r.ready_rate = r.result.ready_rate(trace.refs)
    return rows


def timed_markdown(capacity: int, rows: Sequence[TimedRow]) -> str:
    """The time-model table at one capacity (markdown): hit rate, blocks ready in time, the
    share of the LRU→Belady gap they close, TTFT proxy mean / p50 / p90, prefetches."""
    lru = next(r for r in rows if r.policy == "lru").ready_rate
    opt = next(r for r in rows if r.policy == "belady").ready_rate
    lines = [f"| {capacity:,} blocks | hit rate | ready in time | gap closed (LRU→Belady) | TTFT mean (s) | "
             "TTFT p50 (s) | TTFT p90 (s) | prefetched (requests cut by a late one) |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        g = "—" if opt - lru <= 1e-12 else f"{100 * (r.ready_rate - lru) / (opt - lru):.1f}%"
        name, _, k = r.policy.partition("@")
        label = {"lru": "LRU", "belady": "Belady", "adaptive": "default"}[name] + (f" K={k}" if k else "")
        lines.append(f"| {label} | {r.hit_rate:.4f} | {r.ready_rate:.4f} | {g} | {r.result.ttft.mean():.3f} | "
                     f"{r.result.percentile(50):.3f} | {r.result.percentile(90):.3f} | "
                     f"{r.result.prefetched:,} ({r.result.late:,}) |")
    return "\n".join(lines)


__all__ = ["DEFAULT_TIERS", "Tier", "TimeModel", "TimedResult", "TimedRow", "describe", "evaluate_timed", "parse_tiers", "replay",
           "timed_markdown"]
