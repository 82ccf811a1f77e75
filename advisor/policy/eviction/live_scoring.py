"""The default policy's priority for the live advisor's blocks (promotion and demotion order).

The live advisor follows the expert its selector leads with
(:class:`advisor.policy.eviction.experts.LiveSelector`, the evaluator's selection) and ranks
blocks in that expert's eviction order, expressed on what the index knows of a block (its
last access and hit count, :func:`expert_rank`).  For ``prefix_value`` that is the same rule
and settings as the evaluator (:mod:`advisor.policy.eviction.prefix_value`): ``priority = last access + horizon × P(reuse | class)``
computed by :func:`advisor.policy.eviction.prefix_value.priority`, with the class of
:func:`advisor.policy.eviction.prefix_value.reuse_class`.  What differs is only where the inputs
come from:

* time is the index's clock (``last_access_ns``, the batches' ``ts_ns``), so the horizon
  is given in seconds (``horizon_s``) rather than learned in reference ticks;
* the class counts are learned from the index's hit counters of the blocks being ranked:
  a block with ``hits`` accesses after its first was referenced in classes
  ``seen = 0 .. hits`` and reused from each of ``0 .. hits - 1`` (capped at ``max_seen``);
  its place in the class (``from_end``) is 0 for a block without indexed children (a leaf)
  and 1 otherwise, and ``continuation`` is whether it has a parent;
* ``pos`` (position in a request) is 0: the callers walk the blocks leaves first
  (:func:`advisor.policy.policies._leaves_first`), which keeps the leaves-first rule.

**Superseded first.**  A block whose ``superseded`` fact is set ranks below every other
block (``last access − 2^62`` ns, below 0 for any ns clock before 2116), by last access
among themselves: the blocks the evaluator's ``prefix_value`` tier evicts first, read from
the live selector's replay of its window
(:attr:`advisor.policy.eviction.experts.LiveSelector.superseded`, the kernel's own verdict:
one implementation).  The kernel's other superseded-branch classes
(:func:`advisor.policy.eviction.prefix_value.superseded_class`, a horizon-weighted demotion
where the rule does not act) are not used: the index keeps no record of which child the
latest request through a block took, so such a block is ranked in its regular class.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import numpy as np

from advisor.policy.eviction.finish_aware import FINISH_UNKNOWN, ReturnTimes
from advisor.policy.eviction.prefix_value import PrefixValueSettings, priority, reuse_class

SUPERSEDED_FIRST_NS = float(1 << 62)
"""Subtracted from a superseded block's last access (ns): below every regular rank (module docstring)."""


@dataclass(frozen=True)
class BlockFacts:
    """What the index knows of a block that the priority needs.

    Attributes:
        last_access_ns: time of its last access (ns, the batches' clock).
        hits: accesses after its first (the index's hit counter).
        leaf: no child of it is indexed.
        has_parent: it continues a prefix (not the first block of a request).
        superseded: ``prefix_value`` ranks it first (module docstring, "Superseded first").
        residual_s: ``finish_aware``'s expected time (s) until its session's next request
            (:meth:`FinishView.residual_s`); ``None``: not known (that order is then prefix-LRU's).
    """

    last_access_ns: int
    hits: int
    leaf: bool
    has_parent: bool
    superseded: bool = False
    residual_s: float | None = None


@dataclass(frozen=True)
class FinishView:
    """The live selector's ``finish_aware`` verdict: each window block's state and the gaps
    learned (:meth:`advisor.policy.eviction.experts.LiveSelector.finish_states`, ``returns``).

    Attributes:
        states: sequence hash → ``(state, since s)``; a block not in it is in the
            ``unknown`` state since its last access.
        returns: the learned gaps; ``None``: none learned (every block ranks by its age).
        now_s: the clock of the ranking (s, the batches' clock: the live selector's latest
            arrival, so a ranking depends on the events alone); ``None``: the host's clock.
    """

    states: Mapping[int, tuple[int, float]] = field(default_factory=dict)
    returns: ReturnTimes | None = None
    now_s: float | None = None

    def residual_s(self, sequence_hash: int, last_access_ns: int, now_s: float) -> float:
        """Expected seconds until the block's session returns, the kernel's eviction key
        (:func:`advisor.policy.eviction.finish_aware.ReturnTimes.residual_life`; the age
        itself without learned gaps)."""
        state, since = self.states.get(sequence_hash, (FINISH_UNKNOWN, last_access_ns / 1e9))
        age = max(now_s - since, 0.0)
        return age if self.returns is None else self.returns.residual_life(state, age)


class LiveScorer:
    """Priorities of live blocks under the default policy (lower = demote first).

    Args:
        settings: the evaluator's policy settings (classes, caps, prior).
        horizon_s: horizon in seconds (> 0).

    Raises:
        ValueError: ``horizon_s`` <= 0.
    """

    def __init__(self, settings: PrefixValueSettings, horizon_s: float) -> None:
        if not horizon_s > 0:
            raise ValueError(f"horizon_s must be > 0, got {horizon_s}")
        self.settings = settings
        self.horizon_ns = float(horizon_s) * 1e9
        n_cls = (settings.max_seen + 1) * (settings.max_from_end + 1) * 2
        self.inserts = np.zeros(n_cls)
        self.reuses = np.zeros(n_cls)

    def _cls(self, seen: int, facts: BlockFacts) -> int:
        s = self.settings
        return int(reuse_class(seen, 0 if facts.leaf else 1, 1 if facts.has_parent else 0, s.max_seen, s.max_from_end))

    def learn(self, blocks: Iterable[BlockFacts]) -> None:
        """Count each block's references and reuses into its classes (module docstring)."""
        cap = self.settings.max_seen
        for f in blocks:
            for seen in range(min(f.hits, cap) + 1):
                c = self._cls(seen, f)
                n = 1 if seen < cap else f.hits - cap + 1  # the capped class took every later reference
                self.inserts[c] += n
                if seen < f.hits:
                    self.reuses[c] += n if seen < cap else n - 1

    def p_reuse(self, facts: BlockFacts) -> float:
        """Smoothed ``P(reuse | class)`` of the block's current class, in [0, 1]."""
        s = self.settings
        c = self._cls(facts.hits, facts)
        return float((self.reuses[c] + s.prior_weight * s.prior_reuse) / (self.inserts[c] + s.prior_weight))

    def score(self, facts: BlockFacts, depth: int = 0) -> float:
        """The block's priority: :func:`~advisor.policy.eviction.prefix_value.priority` at its class.

        Args:
            facts: the block.
            depth: its distance from the leaves of its chain on the tier (0 = leaf).
        """
        if facts.superseded:
            return float(facts.last_access_ns) - SUPERSEDED_FIRST_NS
        s = self.settings
        c = self._cls(facts.hits, facts)
        return float(priority(float(facts.last_access_ns), self.horizon_ns, self.reuses[c], self.inserts[c],
                              s.prior_reuse, s.prior_weight, depth))

    def explain(self, facts: BlockFacts) -> str:
        """The score and its parts, for a plan item's reason."""
        if facts.superseded:
            return (f"prefix value {self.score(facts):.0f} = last access {facts.last_access_ns} − 2^62: a superseded "
                    f"branch (ranked first)")
        return (f"prefix value {self.score(facts):.0f} = last access {facts.last_access_ns} + horizon "
                f"{self.horizon_ns:.0f} ns × P(reuse | hits={facts.hits}, leaf={facts.leaf}) {self.p_reuse(facts):.3f}")


def expert_rank(expert: str, facts: BlockFacts, scorer: LiveScorer) -> float:
    """Rank of a live block in ``expert``'s eviction order (lower = demoted first).

    Each expert's order on the index's facts (last access ``t``, hits ``h`` = accesses
    after the first, horizon ``H`` = ``scorer``'s, in ns):

    * ``prefix_value``: :meth:`LiveScorer.score`;
    * ``lru_tail``, ``prefix_lru``: ``t`` (the planner walks leaves first, which is prefix-LRU);
    * ``arc_tail``, ``s3fifo_tail``, ``sieve``: ``t + H·[h ≥ 1]`` — a block seen once (ARC's T1,
      S3-FIFO's small queue, SIEVE's unvisited) leaves before a block seen again that is
      at most ``H`` older (ARC's T2, S3-FIFO's main queue, SIEVE's visited);
    * ``lfu_da_tail``: ``t + H·min(h, 4)`` — frequency first, aged by recency (dynamic aging
      lets an old frequent block go after ``H`` per hit);
    * ``finish_aware``: ``−residual_s`` (the expected time until the block's session
      returns, longest first out; :class:`FinishView`), or ``t`` where it is not known.

    Raises:
        ValueError: an unknown expert.
    """
    t = float(facts.last_access_ns)
    expert = expert.removesuffix("_tail")  # the planner walks leaves first: every order here is tail first
    if expert == "prefix_value":
        return scorer.score(facts)
    if expert in ("lru", "prefix_lru"):
        return t
    if expert in ("arc", "s3fifo", "sieve"):
        return t + scorer.horizon_ns * (1.0 if facts.hits >= 1 else 0.0)
    if expert == "lfu_da":
        return t + scorer.horizon_ns * float(min(facts.hits, 4))
    if expert == "finish_aware":
        return t if facts.residual_s is None else -facts.residual_s
    raise ValueError(f"unknown expert {expert!r}")


__all__ = ["SUPERSEDED_FIRST_NS", "BlockFacts", "FinishView", "LiveScorer", "expert_rank"]
