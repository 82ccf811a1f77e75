"""Offline evaluator: hand-computed LRU / Belady hit counts, trace loaders, the table and
its margins, lookahead, and the CLI on a slice of the Mooncake trace."""

from __future__ import annotations

import gzip
import io
import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvadvisor.cli import app
from kvadvisor.evaluate import (
    EvaluateError,
    evaluate,
    load_trace,
    load_weka,
    next_uses,
    parse_capacities,
    parse_lookaheads,
    simulate_belady,
    simulate_lru,
    simulate_prefix_value,
)
from kvadvisor.trace import bundled_trace

# 4 requests, 10 block references
REQS = [[1, 2, 3], [1, 2, 4], [5], [1, 2, 3]]


def test_lru_hand_computed() -> None:
    # cap 3: r1 hits 1,2 (2); inserting 4 evicts 3; r2 inserts 5 evicting 1; r3 misses at 1
    assert simulate_lru(REQS, 3) == 2
    # cap 5: nothing evicted before r3 (1,2,3,4,5 fit) -> 2 + 3
    assert simulate_lru(REQS, 5) == 5
    assert simulate_lru(REQS, 1) == 0


def test_belady_hand_computed() -> None:
    assert next_uses(REQS) == [[1, 1, 3], [3, 3, 4], [4], [4, 4, 4]]
    # cap 3: after r1, 4 (never used again) is evicted; after r2, 5 is evicted; r3 hits all 3
    assert simulate_belady(REQS, 3) == 5
    assert simulate_belady(REQS, 1) == 0


def test_unbounded_capacity_all_policies_equal() -> None:
    best = simulate_lru(REQS, 100)
    assert best == 5
    assert simulate_belady(REQS, 100) == simulate_prefix_value(REQS, 100) == best


def test_evaluate_table_and_errors() -> None:
    ev = evaluate(REQS, [3, 100], ["prefix_value"], trace="toy")
    r3 = ev.results[0]
    assert r3.hit_rate["lru"] == pytest.approx(0.2)
    assert r3.hit_rate["belady"] == pytest.approx(0.5)
    assert set(r3.hit_rate) == {"lru", "arc", "lfu_da", "s3fifo", "sieve", "prefix_lru", "belady", "prefix_value"}
    name, best = r3.best_baseline()
    assert best == max(r3.hit_rate[p] for p in ev.baselines) and name in ev.baselines
    assert r3.margin("prefix_value") == pytest.approx(r3.hit_rate["prefix_value"] - best)
    assert ev.results[1].gap_closed("prefix_value") is None  # Belady == LRU
    with pytest.raises(EvaluateError):
        evaluate([], [3])
    with pytest.raises(EvaluateError):
        evaluate(REQS, [0])
    with pytest.raises(EvaluateError):
        evaluate(REQS, [3], ["fifo"])
    with pytest.raises(EvaluateError):
        evaluate(REQS, [3], lookaheads=[-1])
    assert parse_capacities("1_000, 5859") == [1000, 5859]
    with pytest.raises(EvaluateError):
        parse_capacities("10,x")
    assert parse_lookaheads("0,1,4,16,4") == [0, 1, 4, 16]
    for bad in ("1,-1", "x", ""):
        with pytest.raises(EvaluateError):
            parse_lookaheads(bad)


def test_lookahead_columns_and_promotion() -> None:
    from advisor.policy.eviction import prefix_value
    from advisor.policy.eviction.compact import compact

    # 40 requests cycling over 3 two-block prefixes with [1,2] once in the middle, then
    # [1,2] again, on a tier of 4 blocks: without hints [1,2] is long gone when it comes back
    cycle = [[100 + i % 3, 200 + i % 3] for i in range(40)]
    reqs = cycle[:10] + [[1, 2]] + cycle[10:] + [[1, 2]]
    ct = compact(reqs)
    assert prefix_value.simulate(ct, 4)[-1] == 0
    # seeing 1 request ahead, its known prefix is promoted before it runs
    assert prefix_value.simulate(ct, 4, lookahead=1)[-1] == 2
    # hints without promotion only keep cached blocks: nothing to keep here
    assert prefix_value.simulate(ct, 4, lookahead=1, promote=False)[-1] == 0
    ev = evaluate(reqs, [4], ["prefix_value"], lookaheads=[0, 1])
    assert ev.policies == ["prefix_value", "prefix_value@1"]
    r = ev.results[0]
    assert r.hit_rate["prefix_value@1"] > r.hit_rate["prefix_value"]
    # promotion can pass Belady (no hints): the lookahead column's gap is measured up to the infinite tier
    assert r.hit_rate["prefix_value@1"] > r.hit_rate["belady"]
    assert r.hit_rate["prefix_value@1"] <= r.infinite
    g = r.gap_closed("prefix_value@1")
    assert g is not None and 0 < g <= 1.0
    assert g == pytest.approx((r.hit_rate["prefix_value@1"] - r.hit_rate["lru"]) / (r.infinite - r.hit_rate["lru"]))
    # on a real slice, hints help: the known prefixes of the next 4 requests are promoted
    real = compact(load_trace(bundled_trace(), "mooncake", limit=600))
    assert prefix_value.simulate(real, 300, 4).sum() > prefix_value.simulate(real, 300).sum()
    assert simulate_prefix_value(reqs, 4, lookahead=1) == int(prefix_value.simulate(ct, 4, 1).sum())


def test_weka_loader_pairs_ids_with_file_and_flattens_subagents(tmp_path: Path) -> None:
    conv = {"id": "trace_0007", "block_size": 64, "requests": [
        {"t": 0.0, "type": "n", "hash_ids": [1, 2]},
        {"t": 10.0, "type": "subagent", "requests": [
            {"t": 0.0, "type": "n", "hash_ids": [50]},
            {"t": 5.0, "type": "n", "hash_ids": [50, 51]}]},
        {"t": 12.0, "type": "s", "hash_ids": [1, 2, 3]},
    ]}
    with gzip.open(tmp_path / "trace_0007.json.gz", "wt") as fh:
        json.dump(conv, fh)
    other = {"id": "trace_0009", "requests": [{"t": 1.0, "type": "n", "hash_ids": [1]}]}
    (tmp_path / "trace_0009.json").write_text(json.dumps(other))
    reqs = load_weka(tmp_path, stagger_s=100.0)
    t7, t9 = 7 << 32, 9 << 32
    # file 0009 starts 100 s later, subagent requests at 10 s and 15 s
    assert reqs == [[t7 | 1, t7 | 2], [t7 | 50], [t7 | 1, t7 | 2, t7 | 3], [t7 | 50, t7 | 51], [t9 | 1]]
    (tmp_path / "trace_0010.json").write_text("{\"requests\": [{\"t\": 0}]}")
    from kvadvisor.trace import TraceFormatError
    with pytest.raises(TraceFormatError):
        load_weka(tmp_path)


def test_mooncake_slice_policy_beats_lru() -> None:
    reqs = load_trace(bundled_trace(), "mooncake")
    ev = evaluate(reqs, [500, 2000], ["prefix_value"])
    for r in ev.results:
        assert r.hit_rate["lru"] <= r.hit_rate["prefix_value"] <= r.hit_rate["belady"]


def test_cli_evaluate_prints_table_and_plot(tmp_path: Path) -> None:
    out = tmp_path / "p.png"
    res = CliRunner().invoke(app, ["evaluate", "--trace", str(bundled_trace()), "--capacity", "300,1000",
                                   "--limit", "600", "--plot", str(out), "--json", str(tmp_path / "r.json"),
                                   "--lookahead", "0,4", "--markdown"])
    assert res.exit_code == 0, res.output
    assert "LRU" in res.output and "replayed in" in res.output and "| capacity (blocks) |" in res.output
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    data = json.loads((tmp_path / "r.json").read_text())
    assert [r["capacity"] for r in data["results"]] == [300, 1000]
    assert set(data["results"][0]["hit_rate"]) == {"lru", "arc", "lfu_da", "s3fifo", "sieve", "prefix_lru",
                                                   "belady", "adaptive", "adaptive@4"}
    assert data["results"][0]["best_baseline"] in data["baselines"]
    bad = CliRunner().invoke(app, ["evaluate", "--trace", str(bundled_trace()), "--capacity", "0"])
    assert bad.exit_code == 2
    bad = CliRunner().invoke(app, ["evaluate", "--trace", str(bundled_trace()), "--capacity", "10",
                                   "--lookahead", "-2"])
    assert bad.exit_code == 2 and "lookahead" in bad.output


def test_the_table_keeps_policy_names_whole_in_80_columns() -> None:
    from rich.console import Console

    from kvadvisor.evaluate import render_table

    ev = evaluate(REQS, [3, 100, 1000, 10000], ["prefix_value"], lookaheads=[0, 16], trace="toy")
    con = Console(width=80, record=True, file=io.StringIO())
    con.print(render_table(ev))
    text = con.export_text()
    assert "prefix_value K=16" in text and "prefix-LRU" in text and "…" not in text
    assert max(len(line) for line in text.splitlines()) <= 80


def test_count_reports_a_held_out_range_of_a_whole_replay() -> None:
    from advisor.policy.eviction import lru
    from advisor.policy.eviction.compact import compact

    reqs = [list(r) for r in load_trace(bundled_trace(), "mooncake", limit=400)]
    ct = compact(reqs)
    ev = evaluate(ct, [100], ["prefix_value"], count=(200, 400))
    hits = lru.simulate(ct, 100)  # warm start: replayed from request 0, counted from 200
    refs = int(ct.offsets[400] - ct.offsets[200])
    assert ev.block_refs == refs and ev.requests == 200
    assert ev.results[0].hit_rate["lru"] == pytest.approx(hits[200:].sum() / refs)
    with pytest.raises(EvaluateError):
        evaluate(ct, [100], count=(300, 300))
