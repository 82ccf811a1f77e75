"""The finish-aware expert: prefix-LRU's order where no finish reason is known, and the
sessions waiting on a tool call kept over those that ended their turn where one is."""

from __future__ import annotations

import numpy as np
import pytest

from advisor.policy.eviction import experts, finish_aware, prefix_lru
from advisor.policy.eviction.compact import RequestFinishes, compact
from advisor.policy.eviction.finish_aware import (
    FINISH_END_TURN,
    FINISH_TOOL_CALL,
    FINISH_UNKNOWN,
    IN_FLIGHT,
    finish_class,
)
from kvadvisor import synthetic
from kvadvisor.synthetic import conversation_tree, zipf


def agent_sessions(seed: int, steps: int = 1_500) -> tuple[list[list[int]], RequestFinishes, int]:
    """The synthetic suite's agent sessions (:func:`kvadvisor.synthetic.agent_sessions`):
    requests, finishes, and a tier of an eighth of their working set."""
    case = synthetic.agent_sessions(seed, n_requests=steps)
    assert case.finishes is not None
    return case.requests, case.finishes, case.capacities[0]


def test_finish_reasons_are_classed_as_openai_vllm_and_anthropic_name_them() -> None:
    assert finish_class("tool_calls") == finish_class("tool_use") == FINISH_TOOL_CALL
    assert finish_class("stop") == finish_class("end_turn") == FINISH_END_TURN
    assert finish_class(None) == finish_class("") == finish_class("abort") == FINISH_UNKNOWN


@pytest.mark.parametrize("capacity", [40, 300, 2_000])
def test_without_finish_reasons_the_order_is_prefix_lru_exactly(capacity: int) -> None:
    for reqs in (conversation_tree(3, n_requests=800).requests, zipf(0.8, 4, n_requests=800).requests):
        trace = compact(reqs)
        assert np.array_equal(finish_aware.simulate(trace, capacity), prefix_lru.simulate(trace, capacity))
        # times without reasons: one state, the same order
        n = trace.requests
        timed = compact(reqs, RequestFinishes(np.arange(n, dtype=float), np.arange(n, dtype=float),
                                              np.zeros(n, dtype=np.int8)))
        assert np.array_equal(finish_aware.simulate(timed, capacity), prefix_lru.simulate(trace, capacity))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_sessions_waiting_on_a_tool_call_are_kept_over_those_that_ended_their_turn(seed: int) -> None:
    reqs, fin, cap = agent_sessions(seed)
    trace = compact(reqs, fin)
    ours = finish_aware.simulate(trace, cap).sum()
    lru = prefix_lru.simulate(trace, cap).sum()
    assert ours > 1.05 * lru, (ours, lru)  # 1.08-1.11 on seeds 0-2
    # the classes are learned, not named: swapped labels give the same replay ...
    swapped = compact(reqs, RequestFinishes(fin.arrival, fin.finish,
                                            np.where(fin.reason == FINISH_TOOL_CALL, FINISH_END_TURN,
                                                     FINISH_TOOL_CALL).astype(np.int8)))
    assert finish_aware.simulate(swapped, cap).sum() == ours
    # ... and shuffled ones (the same times, reasons that tell nothing) lose the gain
    shuffled = compact(reqs, RequestFinishes(fin.arrival, fin.finish,
                                             np.random.default_rng(seed).permutation(fin.reason)))
    assert finish_aware.simulate(shuffled, cap).sum() < 0.96 * ours  # 0.90-0.92
    # and the selector follows it
    run = experts.run(trace, cap)
    assert experts.EXPERTS[run.leader[-1]] == "finish_aware"
    assert run.hits.sum() > lru


def test_a_finish_reason_is_not_used_before_the_request_finishes() -> None:
    reqs, fin, cap = agent_sessions(5, steps=600)
    late = len(reqs) - 40  # these requests finish after the trace's last arrival
    finish = fin.finish.copy()
    finish[late:] = fin.arrival[-1] + 1_000.0
    a = RequestFinishes(fin.arrival, finish, fin.reason)
    flipped = fin.reason.copy()
    flipped[late:] = np.where(flipped[late:] == FINISH_TOOL_CALL, FINISH_END_TURN, FINISH_TOOL_CALL)
    b = RequestFinishes(fin.arrival, finish, flipped)
    assert np.array_equal(finish_aware.simulate(compact(reqs, a), cap), finish_aware.simulate(compact(reqs, b), cap))
    # while the same flip on requests that finished in time changes the replay
    c = RequestFinishes(fin.arrival, fin.finish, flipped)
    assert not np.array_equal(finish_aware.simulate(compact(reqs, c), cap),
                              finish_aware.simulate(compact(reqs, fin), cap))


def test_the_learned_gaps_give_a_tool_call_a_shorter_residual_life() -> None:
    reqs, fin, _ = agent_sessions(7)
    _, returns = finish_aware.learn(compact(reqs, fin), 10**6)
    assert returns.residual_life(FINISH_TOOL_CALL, 5.0) < returns.residual_life(FINISH_END_TURN, 5.0)
    assert returns.residual_life(FINISH_UNKNOWN, 5.0) > finish_aware.MAX_TIME  # nothing learned: first out
    assert returns.residual_life(IN_FLIGHT, 1.0) < returns.residual_life(FINISH_END_TURN, 1.0)
    with pytest.raises(ValueError, match="state"):
        returns.residual_life(IN_FLIGHT + 1, 1.0)


def test_request_finishes_are_checked() -> None:
    one = np.zeros(1)
    with pytest.raises(ValueError, match="finish >= arrival"):
        RequestFinishes(np.ones(1), one, np.zeros(1, dtype=np.int8))
    with pytest.raises(ValueError, match="arrivals in order"):
        RequestFinishes(np.array([2.0, 1.0]), np.array([2.0, 1.0]), np.zeros(2, dtype=np.int8))
    with pytest.raises(ValueError, match="classes in 0..3"):
        RequestFinishes(one, one, np.array([4], dtype=np.int8))
    with pytest.raises(ValueError, match="one length"):
        RequestFinishes(one, np.zeros(2), np.zeros(1, dtype=np.int8))
    with pytest.raises(ValueError, match="finishes cover 1 requests"):
        compact([[1], [2]], RequestFinishes(one, one, np.zeros(1, dtype=np.int8)))


def test_an_epoch_clock_replays_as_the_trace_clock() -> None:
    # the live selector's arrivals are Unix seconds (~1.7e9): the replay does not depend on
    # the clock's origin
    reqs, fin, cap = agent_sessions(3, steps=600)
    shift = 1.7e9
    epoch = RequestFinishes(fin.arrival + shift, fin.finish + shift, fin.reason)
    a = finish_aware.simulate(compact(reqs, fin), cap)
    b = finish_aware.simulate(compact(reqs, epoch), cap)
    assert np.array_equal(a, b)
