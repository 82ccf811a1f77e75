"""The default policy's kernel (advisor/eviction/prefix_value.py): leaves first, settings
validation, determinism, and its relation to LRU on a real slice."""

from __future__ import annotations

import pytest

from advisor.eviction import lru, prefix_value
from advisor.eviction.compact import compact
from advisor.eviction.prefix_value import PrefixValueSettings
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


def test_settings_are_validated() -> None:
    for bad in (dict(horizon_multiplier=0.0), dict(prior_reuse=1.5), dict(max_seen=-1),
                dict(min_window=16.0, initial_window=8.0), dict(adapt_step=1.0), dict(adapt_every=0.0)):
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
