"""The reuse-signal benchmark's features and labels on a hand-made trace (bench/reuse_signals.py)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

_SPEC = importlib.util.spec_from_file_location(
    "reuse_signals", Path(__file__).resolve().parents[2] / "bench" / "reuse_signals.py")
assert _SPEC and _SPEC.loader
rs = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(rs)


def _write(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_labels_turns_and_classes(tmp_path: Path) -> None:
    # r0: fresh [0 1 2]; r1 continues 0 1 (turn 1) then 3 4; r2 continues 0 1 3 (turn 2) then 5
    trace = _write(tmp_path / "t.jsonl", [
        {"timestamp": 0, "input_length": 1500, "output_length": 10, "hash_ids": [0, 1, 2]},
        {"timestamp": 1000, "input_length": 2500, "output_length": 10, "hash_ids": [0, 1, 3, 4]},
        {"timestamp": 3000, "input_length": 2000, "output_length": 10, "hash_ids": [0, 1, 3, 5]},
    ])
    X, y, req = rs.signals(trace)
    col = {name: X[:, i] for i, name in enumerate(rs.FEATURES)}
    assert req.tolist() == [0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2]
    # referenced again later: 0 and 1 each time but the last, 2 never, 3 once, 4 and 5 never
    assert y.tolist() == [1, 1, 0, 1, 1, 1, 0, 0, 0, 0, 0]
    assert col["seen"].tolist() == [0, 0, 0, 1, 1, 0, 0, 2, 2, 1, 0]
    assert col["continued"].tolist() == [0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1]
    assert col["turn"].tolist() == [0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2]
    assert col["first_new"].tolist() == [0, 0, 0, 0, 0, 1, 0, 0, 0, 0, 1]
    assert col["new_blocks"].tolist() == [3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1]
    assert col["from_end"].tolist() == [2, 1, 0, 3, 2, 1, 0, 3, 2, 1, 0]
    assert col["log2_gap_ms"][7] == pytest.approx(np.log2(2000.0))  # r2's prefix ends at r1's block 3
    assert col["log2_gap_requests"][7] == 0.0  # one request back


def test_class_table_is_the_training_share(tmp_path: Path) -> None:
    X = np.zeros((6, len(rs.FEATURES)))
    X[:3, 0] = 0  # class (seen 0, last block, fresh)
    X[3:, 0] = 2
    y = np.array([1, 0, 0, 1, 1, 0], dtype=np.int8)
    train = np.array([True, True, False, True, True, False])
    test = ~train
    assert rs.class_table_scores(X, y, train, test).tolist() == pytest.approx([0.5, 1.0])


def test_a_line_without_hash_ids_names_its_line(tmp_path: Path) -> None:
    trace = _write(tmp_path / "bad.jsonl", [{"hash_ids": [1]}, {"timestamp": 3}])
    with pytest.raises(ValueError, match="bad.jsonl:2"):
        rs.signals(trace)
