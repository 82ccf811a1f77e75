"""The coverage-guided fuzz targets (``tests/fuzz/fuzz_*.py``), bounded for the suite.

* every committed input (seed corpus and minimised crashers, ``corpus/<target>/`` and
  ``regressions/<target>/``) passes its target's ``check``;
* each target runs :data:`RUNS` atheris iterations from its seed corpus and crashers in a
  subprocess
  (a crash there fails the test with the fuzzer's report; long runs: ``make fuzz``).
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from pathlib import Path

import _fuzzlib
import msgspec
import pytest

import event_plane.codec
from event_plane.codec import MAX_METADATA_DEPTH, decode_batch, encode_batch
from event_plane.schema import WIRE_VERSION, EventBatch, store

TARGETS = ("codec", "adapters", "journal")
RUNS = 2000
"""Atheris iterations per target in the suite (each target takes a few seconds)."""

MODULES = {name: importlib.import_module(f"fuzz_{name}") for name in TARGETS}
INPUTS = [(name, path) for name in TARGETS for path in _fuzzlib.iter_inputs(name)]


def test_targets_check_this_worktree() -> None:
    """The targets import the packages of this checkout, not an installed copy."""
    assert Path(event_plane.codec.__file__).resolve().is_relative_to(_fuzzlib.REPO)


@pytest.mark.parametrize("name", TARGETS)
def test_every_target_has_seeds(name: str) -> None:
    """A target without seeds would start from nothing and reach little in a bounded run."""
    assert len(list(_fuzzlib.corpus_dir(name).iterdir())) >= 5


@pytest.mark.parametrize(("name", "path"), INPUTS, ids=[f"{n}/{p.parent.name}/{p.name}" for n, p in INPUTS])
def test_committed_input_passes(name: str, path: Path) -> None:
    """Every seed and every minimised crasher passes its target's invariants."""
    MODULES[name].check(path.read_bytes())


def _metadata(depth: int) -> dict[str, object]:
    inner: object = 1
    for level in range(depth - 1, 0, -1):
        inner = [inner] if level % 2 else {"k": inner}
    return {"d": inner}


def test_stack_budget_fits_the_deepest_legal_batch() -> None:
    """``fuzz_codec``'s deep-stack decode leaves enough recursion for every legal batch, so
    a failure there is a batch nesting past the limit, not a budget too small."""
    budget = MODULES["codec"].STACK_BUDGET
    legal = encode_batch(EventBatch(WIRE_VERSION, "s", 1, 0, 0, [store(1, 1, None, 0, "fast", _metadata(MAX_METADATA_DEPTH))]))
    assert _fuzzlib.call_with_stack_budget(budget, lambda: decode_batch(legal)).events[0].sequence_hash == 1
    # and tight enough to tell: msgspec runs out of it at 3x the legal nesting, which a
    # shallow stack decodes
    nested = b"\x91" * (3 * MAX_METADATA_DEPTH) + b"\x01"
    assert msgspec.msgpack.decode(nested)
    with pytest.raises(RecursionError):
        _fuzzlib.call_with_stack_budget(budget, lambda: msgspec.msgpack.decode(nested))


def test_record_stream_round_trip() -> None:
    """``join_records`` / ``split_records`` (the input format of the multi-batch targets)."""
    records = [b"", b"a", bytes(300)]
    data = _fuzzlib.join_records(5, records)
    assert data[0] == 5 and _fuzzlib.split_records(data[1:]) == records
    assert _fuzzlib.split_records(b"\x00\x09abc") == [b"abc"]  # short last record: what is left


@pytest.mark.parametrize("name", TARGETS)
def test_bounded_fuzz_run(name: str, tmp_path: Path) -> None:
    """``RUNS`` coverage-guided iterations of the target find no crash."""
    pytest.importorskip("atheris", reason="atheris is in the [test] extra: pip install -e '.[test]'")
    script = _fuzzlib.FUZZ_DIR / f"fuzz_{name}.py"
    new_inputs = tmp_path / "corpus"
    new_inputs.mkdir()
    env = {**os.environ, "PYTHONPATH": str(_fuzzlib.REPO), _fuzzlib.SCRATCH_ENV: str(tmp_path / "scratch")}
    proc = subprocess.run(
        [sys.executable, str(script), f"-runs={RUNS}", "-seed=1", "-max_len=4096", "-rss_limit_mb=2048",
         f"-artifact_prefix={tmp_path}/", str(new_inputs), str(_fuzzlib.corpus_dir(name)),
         *[str(d) for d in (_fuzzlib.regressions_dir(name),) if d.is_dir()]],
        cwd=_fuzzlib.REPO, env=env, capture_output=True, text=True, timeout=240,
    )
    out = proc.stdout + proc.stderr
    crashes = sorted(p.name for p in tmp_path.iterdir() if p.is_file())
    assert proc.returncode == 0 and not crashes, f"fuzz_{name} failed (rc {proc.returncode}, {crashes}):\n{out[-6000:]}"
    assert f"Done {RUNS} runs" in out, out[-3000:]
    if name == "journal":  # its SQLite files went to the scratch directory given
        assert list((tmp_path / "scratch").glob("kvadvisor-fuzz-journal-*/journal.sqlite*"))


def test_nesting_depth_counts_maps_arrays_and_array_keys() -> None:
    """The fuzz targets' own count of what ``MAX_METADATA_DEPTH`` limits."""
    assert _fuzzlib.nesting_depth(None) == 0 and _fuzzlib.nesting_depth({"a": 1}) == 1
    assert _fuzzlib.nesting_depth({"a": [{"b": 1}]}) == 3
    assert _fuzzlib.nesting_depth({"a": {((1,),): 1}}) == 4  # {a: {[[1]]: 1}}


def test_seed_corpora_are_what_make_seeds_writes() -> None:
    """The committed seeds are ``make_seeds.py``'s output (deterministic), so changing a seed
    means changing the script that documents it."""
    import make_seeds

    for name, seeds in (("codec", make_seeds.codec_seeds()), ("adapters", make_seeds.adapter_seeds()),
                        ("journal", make_seeds.journal_seeds())):
        committed = {p.name: p.read_bytes() for p in _fuzzlib.corpus_dir(name).iterdir()}
        assert committed == seeds, f"tests/fuzz/corpus/{name} differs from make_seeds.py: rerun it"
