"""The default policy's kernel (advisor/policy/eviction/prefix_value.py): leaves first, superseded
branches, the censored estimate, settings validation, determinism, and its relation to LRU
and S3-FIFO on a real slice."""

from __future__ import annotations

import itertools
from collections.abc import Callable

import numpy as np
import pytest

from advisor.policy.eviction import lru, prefix_value, s3fifo
from advisor.policy.eviction.compact import CompactTrace, compact
from advisor.policy.eviction.prefix_value import PrefixValueSettings, reuse_class, superseded_class
from kvadvisor.evaluate import load_trace
from kvadvisor.trace import bundled_trace


def test_leaves_go_first_so_the_prefix_survives() -> None:
    # 4 blocks on a tier of 3: LRU evicts the oldest (the root 10) and the repeat hits
    # nothing; leaves-first keeps 10, 11, 12 and the repeat hits 3 blocks
    reqs = [[10, 11, 12, 13], [10, 11, 12, 13]]
    assert prefix_value.simulate(compact(reqs), 3).tolist() == [0, 3]
    assert lru.simulate(compact(reqs), 3).tolist() == [0, 0]


def test_the_last_partial_block_is_the_first_to_go() -> None:
    # block 3 of every request is a request's last block and is never reused; after a few
    # requests the policy has learned it, so on a 3-block tier the shared prefix [1, 2]
    # stays and every later request hits 2 blocks
    reqs = [[1, 2, 100 + i] for i in range(30)]
    hits = prefix_value.simulate(compact(reqs), 3).tolist()
    assert hits[0] == 0 and all(h == 2 for h in hits[1:])


def test_a_superseded_branch_goes_before_the_branch_that_replaced_it() -> None:
    # a conversation sends [1 2 3 | 10 11] twice, then continues the known prefix 1 2 3 along
    # another branch 20 21 (twice). On a tier of 5 blocks the third request leaves 7 blocks:
    # without supersession 10 11 (referenced twice: the better class) outrank the new 20 21,
    # which go, and the fourth request hits only the prefix; with it, 10 is superseded
    # (the branch the previous request through 3 took), goes first with its child 11, and
    # the fourth request hits all 5 blocks
    a, b = [1, 2, 3, 10, 11], [1, 2, 3, 20, 21]
    ct = compact([a, a, b, b])
    assert prefix_value.simulate(ct, 5).tolist() == [0, 5, 3, 5]
    assert prefix_value.simulate(ct, 5, settings=PrefixValueSettings(supersede=False)).tolist() == [0, 5, 3, 3]


def test_a_new_request_that_shares_only_its_first_block_supersedes_nothing() -> None:
    # the same shape, but the requests share only their first block (a common root, as the
    # Mooncake trace's block 0): the second branch is a new request, not a continuation,
    # so both settings replay it identically
    off = PrefixValueSettings(supersede=False)
    a, b = [1, 10, 11, 12, 13], [1, 20, 21, 22, 23]
    ct = compact([a, a, b, b])
    assert prefix_value.simulate(ct, 5).tolist() == prefix_value.simulate(ct, 5, settings=off).tolist() == [0, 5, 1, 1]
    # sharing two blocks makes the second branch a continuation: it supersedes the first
    a, b = [1, 2, 10, 11, 12], [1, 2, 20, 21, 22]
    ct = compact([a, a, b, b])
    assert prefix_value.simulate(ct, 5).tolist() == [0, 5, 2, 5]
    assert prefix_value.simulate(ct, 5, settings=off).tolist() == [0, 5, 2, 2]


def _fresh_ids(first: int = 1000) -> Callable[[int], list[int]]:
    """``take(k)``: the next ``k`` block ids never handed out before (from ``first`` on)."""
    ids = itertools.count(first)
    return lambda k: list(itertools.islice(ids, k))


def _rule_on_off(ct: CompactTrace, cap: int) -> tuple[np.ndarray, np.ndarray]:
    """Hits per request with superseded-first on and off (``supersede_first_below=0``), both
    with a short initial horizon so the gate's trials are decided within a small trace."""
    on = prefix_value.simulate(ct, cap, settings=PrefixValueSettings(initial_horizon=20.0))
    off = prefix_value.simulate(ct, cap, settings=PrefixValueSettings(initial_horizon=20.0, supersede_first_below=0.0))
    return on, off


def _compacting_conversations() -> tuple[list[list[int]], list[int]]:
    """Twelve conversations that each compact their context once (the old 6-block branch
    is never read again), then a request B, a conversation A that compacts an 8-block
    branch, a new request, and B again."""
    take = _fresh_ids()

    reqs = []
    for _ in range(12):
        root = take(2)
        reqs += [root + take(6), root + take(3)]
    b, a = take(6), take(2)
    reqs += [b, a + take(8), a + take(3), take(4), b]
    return reqs, b


def test_once_superseded_branches_prove_dead_they_leave_first() -> None:
    # after twelve compactions whose old branches never came back (matured misses of the
    # superseded class, learned P(reuse) = 0.3 / 13 < 0.05), A's superseded 8-block branch
    # leaves before B (older, but a regular block); with the rule off (0) the class's
    # horizon-weighted priority keeps part of A's dead branch and B's return loses a block
    reqs, b = _compacting_conversations()
    ct = compact(reqs)
    for cap in (16, 18, 20):
        on, off = _rule_on_off(ct, cap)
        assert on[-1] == len(b) and off[-1] == len(b) - 1
        assert on.sum() == off.sum() + 1


def test_one_off_last_blocks_do_not_judge_real_branches() -> None:
    # forty short chats whose second turn replaces the first turn's one-off last block (a
    # dead one-block "branch" each), then a real 4-block branch superseded at a fork, a new
    # request that needs room, and the branch's return. The gate keeps one estimate per
    # kind, so forty dead last blocks say nothing of branches: the branch is ranked by its
    # class, as with the rule off, and comes back whole (7 blocks). Pooled, the last blocks
    # opened the gate for the branch, which was evicted first (3 blocks: only the fork)
    take = _fresh_ids()

    reqs = []
    for _ in range(40):
        root = take(2)
        reqs += [root + take(1), root + take(2)]
    fork = take(3)
    branch = fork + take(4)
    reqs += [branch, fork + take(2), take(3), branch]
    ct = compact(reqs)
    for cap in (12, 14, 16):
        on, off = _rule_on_off(ct, cap)
        assert on[-1] == off[-1] == len(branch)


def test_a_header_many_requests_share_is_no_fork() -> None:
    # after the same twelve dead compactions, six objects under one 2-block header are read
    # in turn (each read "supersedes" the sibling read before it), a new request needs room,
    # and object 4 comes back. Its header had 4 children when object 5 was read, so that
    # read is no conversation's fork: object 4 keeps its place and comes back whole (5
    # blocks); acting at every fork evicts it first and only the header hits
    reqs, _ = _compacting_conversations()
    reqs = reqs[:24]
    header = list(range(5000, 5002))
    objs = [header + list(range(5002 + 3 * i, 5005 + 3 * i)) for i in range(6)]
    reqs += objs + [list(range(6000, 6004)), objs[4]]
    ct = compact(reqs)
    for cap in (12, 18, 24):
        forks = prefix_value.simulate(ct, cap, settings=PrefixValueSettings(initial_horizon=20.0))
        every = prefix_value.simulate(ct, cap, settings=PrefixValueSettings(initial_horizon=20.0,
                                                                            supersede_max_fork=1000))
        assert forks[-1] == 5 and every[-1] == 2


def compactions(first: int, n_conv: int = 40) -> tuple[list[list[int]], list[list[int]], list[list[int]]]:
    """``(requests, dead, replacements)``: one branch that comes back at once, then
    ``n_conv`` conversations that each compact once (``dead[i]``, 6 blocks, never read
    again; ``replacements[i]`` the request that replaced it); ids from ``first`` on."""
    take = _fresh_ids(first)
    root, br = take(2), take(3)
    reqs = [root + br, root + take(3), root + br]
    dead, new = [], []
    for _ in range(n_conv):
        r, old = take(2), take(6)
        new.append(r + take(3))
        reqs += [r + old, new[-1]]
        dead.append(old)
    return reqs, dead, new


def test_superseded_first_names_the_blocks_the_rule_ranks_first() -> None:
    # one branch that comes back at once (the gate's wait is its return distance), then
    # forty conversations that each compact once and never read the old 6-block branch
    # again. Once the gate has matured enough misses it acts: from then on each old branch
    # (its root, and the root's descendants) is named, the earlier ones are not (they were
    # ranked by their class), and a branch read again is named no more
    reqs, dead, new = compactions(1000)
    ct = compact(reqs)
    _, sup = prefix_value.superseded_first(ct, 20)
    assert ct.keys is not None
    named = set(ct.keys[sup].tolist())
    per_branch = [sum(b in named for b in old) for old in dead]
    assert set(per_branch) == {0, 6} and per_branch[0] == 0 and per_branch[-1] == 6
    assert per_branch == sorted(per_branch)  # the gate closes once and stays closed
    assert named == {b for old in dead for b in old if b in named}  # only dead branches
    # the last conversation goes back to its old branch (and on): that branch is live again
    ct2 = compact(reqs + [new[-1][:2] + dead[-1] + [5000, 5001]])  # two new blocks
    _, sup2 = prefix_value.superseded_first(ct2, 20)
    assert ct2.keys is not None
    assert set(ct2.keys[sup2].tolist()) == named - set(dead[-1])
    # the rule off: nothing is named
    assert not prefix_value.superseded_first(ct, 20, PrefixValueSettings(supersede_first_below=0.0))[1].any()
    with pytest.raises(ValueError):
        prefix_value.superseded_first(ct, 0)


def test_superseded_blocks_that_come_back_a_cycle_later_are_not_judged_dead() -> None:
    # a loop over objects that share multi-block headers: reading an object "supersedes" the
    # sibling read before it under the same header, and every sibling comes back one cycle
    # later. The gate's misses wait for the superseded blocks' own reuse distance, so the
    # rule never fires and the replay is the rule-off replay exactly; waiting for the mean
    # reuse distance of all blocks (the headers' short one) judged them dead first and
    # evicted them first (MRU on a loop: 5,761 / 5,883 hit blocks against 5,620 at the two
    # larger capacities)
    from kvadvisor import synthetic

    case = synthetic.loop(0, n_objects=300, n_requests=3000)
    ct = compact(case.requests)
    off = PrefixValueSettings(supersede_first_below=0.0)
    for cap in case.capacities:
        assert prefix_value.simulate(ct, cap).tolist() == prefix_value.simulate(ct, cap, settings=off).tolist()


def test_superseded_classes_follow_the_regular_ones() -> None:
    s = PrefixValueSettings()
    regular = {reuse_class(seen, fe, c, s.max_seen, s.max_from_end)
               for seen in range(s.max_seen + 2) for fe in range(s.max_from_end + 2) for c in (0, 1)}
    n = (s.max_seen + 1) * (s.max_from_end + 1) * 2
    assert regular == set(range(n))
    assert superseded_class(1, s.max_seen, s.max_from_end) == n
    assert superseded_class(2, s.max_seen, s.max_from_end) == superseded_class(9, s.max_seen, s.max_from_end) == n + 1


def test_the_censored_estimate_wins_the_cold_start_of_a_real_slice() -> None:
    # the bundled 2,000 Mooncake requests are a cold start: most reuses come 128+ requests
    # after a block's first reference, so counting every reference as a trial at once
    # (censor_after = 0) drives every class towards P = 0 for hundreds of requests; waiting
    # 2 mean reuse distances before counting a miss keeps the classes apart. Measured:
    # 4,535 / 5,549 hit blocks at 2,000 / 3,000 blocks against 3,488 / 4,433, and above
    # S3-FIFO (4,173 / 5,221), which the former estimator was not
    ct = compact(load_trace(bundled_trace(), "mooncake"))
    immediate = PrefixValueSettings(censor_after=0.0)
    for cap in (2000, 3000):
        censored = int(prefix_value.simulate(ct, cap).sum())
        assert censored > int(prefix_value.simulate(ct, cap, settings=immediate).sum())
        assert censored > int(s3fifo.simulate(ct, cap).sum())


def test_settings_are_validated() -> None:
    for bad in (dict(horizon_multiplier=0.0), dict(prior_reuse=1.5), dict(max_seen=-1),
                dict(min_window=16.0, initial_window=8.0), dict(adapt_step=1.0), dict(adapt_every=0.0),
                dict(censor_after=-1.0), dict(adapt_z=-0.5), dict(max_seen=200, max_from_end=200),
                dict(supersede_first_below=-0.1), dict(supersede_first_below=1.5),
                dict(supersede_censor_after=0.0), dict(supersede_max_fork=0)):
        with pytest.raises(ValueError):
            PrefixValueSettings(**bad)  # type: ignore[arg-type]
    ct = compact([[1, 2]])
    with pytest.raises(ValueError):
        prefix_value.simulate(ct, 0)
    with pytest.raises(ValueError):
        prefix_value.simulate(ct, 4, lookahead=-1)


def test_deterministic_and_at_least_lru_on_a_real_slice() -> None:
    ct = compact(load_trace(bundled_trace(), "mooncake"))
    for cap in (300, 1000, 3000):
        ours = prefix_value.simulate(ct, cap)
        assert (ours == prefix_value.simulate(ct, cap)).all()
        assert ours.sum() > lru.simulate(ct, cap).sum()


def test_a_window_held_open_is_the_former_policy() -> None:
    # with the memory window held at its maximum nothing is forgotten, and the adaptive
    # shadows cannot change anything: the result does not depend on the adaptation period
    ct = compact(load_trace(bundled_trace(), "mooncake", limit=800))
    fixed = [PrefixValueSettings(initial_window=64.0, min_window=64.0, adapt_every=e) for e in (1.0, 50.0)]
    a, b = (prefix_value.simulate(ct, 500, settings=s) for s in fixed)
    assert (a == b).all()
    # an adaptive window does change the outcome on the same slice
    assert (prefix_value.simulate(ct, 500) != a).any()


def test_a_noise_bound_nothing_passes_keeps_the_window_where_it_started() -> None:
    # the tier's replay depends on its own window only (the shadows just vote); with a noise
    # bound no hit-count difference can pass, the window stays at its initial 8 x capacity,
    # the same replay as a window pinned there; with the default bound it moves
    ct = compact(load_trace(bundled_trace(), "mooncake", limit=800))
    frozen = prefix_value.simulate(ct, 500, settings=PrefixValueSettings(adapt_z=1e12))
    pinned = PrefixValueSettings(initial_window=8.0, min_window=8.0, max_window=8.0 * (1 + 1e-9))
    assert (frozen == prefix_value.simulate(ct, 500, settings=pinned)).all()
    assert (prefix_value.simulate(ct, 500) != frozen).any()


def test_a_reuse_override_ranks_by_the_given_probability() -> None:
    # two fresh requests on a tier of 2: by its own estimate (one class, same P) the policy
    # keeps the more recent [3 4] and the repeat of [1 2] misses; told that [1 2] will be
    # reused (P = 1) and [3 4] not (P = 0), it keeps [1 2] and the repeat hits both
    reqs = [[1, 2], [3, 4], [1, 2]]
    trace = compact(reqs)
    assert prefix_value.simulate(trace, 2).tolist() == [0, 0, 0]
    told = np.array([1.0, 1.0, 0.0, 0.0, -1.0, -1.0])
    assert prefix_value.simulate(trace, 2, reuse_override=told).tolist() == [0, 0, 2]
    # negative everywhere = the policy's own estimate, on a real slice too
    real = compact(load_trace(bundled_trace(), limit=400))
    assert (prefix_value.simulate(real, 300, reuse_override=np.full(real.refs, -1.0))
            == prefix_value.simulate(real, 300)).all()
    with pytest.raises(ValueError, match="reuse_override"):
        prefix_value.simulate(trace, 2, reuse_override=np.zeros(5))
    with pytest.raises(ValueError, match="reuse_override"):
        prefix_value.simulate(trace, 2, reuse_override=np.array([1.5, 0, 0, 0, 0, 0]))
