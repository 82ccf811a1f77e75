"""The demo command fails with one clear line, never a traceback, and refuses a kept work
directory whose S3 objects died with an earlier demo's own S3 endpoint (nothing changed)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from kvadvisor.cli import app
from kvadvisor.demo import S3, DemoError, run_demo
from kvadvisor.settings import DemoSettings
from storage_backends import BlockKey, Placement, SqliteCatalog, free_port

pytestmark = pytest.mark.e2e


def _one_line_error(result) -> str:  # noqa: ANN001 - click Result
    out = result.output
    assert result.exit_code != 0
    assert "Traceback" not in out and "──" not in out, out
    errors = [line for line in out.splitlines() if line.startswith("error:")]
    assert errors, out
    return errors[0]


def test_a_nats_url_that_is_not_a_server_address_is_refused_before_anything_starts() -> None:
    line = _one_line_error(CliRunner().invoke(app, ["demo", "--transport", "nats", "--nats-url", "foo"]))
    assert "invalid demo settings" in line and "nats://127.0.0.1:4222" in line
    with pytest.raises(ValueError, match="not a NATS server address"):
        DemoSettings(nats_url="nats://127.0.0.1:4222?namespace=x")


def test_an_unreachable_nats_server_is_one_error_line(tmp_path: Path) -> None:
    port = free_port()  # nothing listens there
    result = CliRunner().invoke(app, ["demo", "--transport", "nats", "--nats-url", f"nats://127.0.0.1:{port}",
                                      "--requests", "5", "--workdir", str(tmp_path / "w")])
    line = _one_line_error(result)
    assert "TransportError" in line and f"127.0.0.1:{port}" in line


def test_a_kept_workdir_with_blocks_on_the_demos_own_s3_is_refused_and_left_as_it_is(tmp_path: Path) -> None:
    workdir = tmp_path / "kept"
    workdir.mkdir()
    cat = SqliteCatalog(workdir / "catalog.sqlite")
    key = BlockKey("demo-model", 0xDEADBEEF)
    seg = cat.new_segment(S3, 1 << 20)
    cat.insert_if_absent([Placement(key, S3, seg, 0, 4096, 12345)])
    cat.close()
    before = (workdir / "catalog.sqlite").read_bytes()
    with pytest.raises(DemoError, match=r"1 block\(s\) on the 's3' volume .* --s3-endpoint"):
        run_demo(DemoSettings(requests=5, workdir=workdir))
    assert (workdir / "catalog.sqlite").read_bytes() == before
    # the working directory's lock file (kvadvisor/workdir_lock.py) is the only thing added
    assert sorted(p.name for p in workdir.iterdir()) == [".kvadvisor.lock", "catalog.sqlite"]


def test_the_byte_check_counts_an_unreadable_copy_instead_of_stopping(tmp_path: Path) -> None:
    from kvadvisor.demo import FAST, read_back
    from kvbm_runtime import synthetic_block_bytes
    from conftest import posix_agent

    s = DemoSettings(num_layers=2, outer_dim=2, page_size=64, inner_dim=8)
    shape = (s.num_layers, s.outer_dim, s.page_size, s.inner_dim)
    hashes = [0x1000 + i for i in range(40)]  # 4 KiB blocks: 1 MiB segments hold them all
    with posix_agent(tmp_path, "read-back", FAST) as agent:
        agent.put([(BlockKey("m", h), synthetic_block_bytes(h, shape)) for h in hashes], FAST)
        assert read_back(agent, s) == (40, 40, [])
        bad = next(iter(agent.catalog.iter_volume(FAST)))
        seg_file = next((tmp_path / FAST).rglob(f"*{bad.segment_id}*"))
        os.truncate(seg_file, 0)  # the volume keeps its segment files open: cut, not unlinked
        checked, exact, unreadable = read_back(agent, s)
    assert checked == 40 and exact == 0
    assert "SegmentTruncatedError" in unreadable[0]
    assert len(unreadable) == 41 and all(line.startswith(f"{FAST}: 0x") for line in unreadable[1:])


def test_a_negative_request_count_is_refused_with_the_rule_the_help_gives() -> None:
    line = _one_line_error(CliRunner().invoke(app, ["demo", "--requests", "-1"]))
    assert "--requests must be >= 0" in line and "0 = all" in line and "-1" in line


@pytest.fixture(scope="module")
def short_demo(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One ``kvadvisor demo`` on the first 4 requests of the bundled trace, asked for 50, run
    from a fresh directory with a relative ``--workdir runs/w`` (its own S3 endpoint, gone
    with it): ``result`` (click's), ``dir`` (where it ran), ``workdir``.  Three tests below
    read it (a demo costs seconds of start and stop; they ran one each)."""
    from kvadvisor.trace import bundled_trace

    tmp = tmp_path_factory.mktemp("short-demo")
    trace = tmp / "short.jsonl"
    with open(bundled_trace()) as f:
        trace.write_text("".join(next(f) for _ in range(4)))
    cwd = os.getcwd()
    os.chdir(tmp)
    try:
        result = CliRunner().invoke(app, ["demo", "--trace", str(trace), "--requests", "50", "--workdir", "runs/w"])
    finally:
        os.chdir(cwd)
    assert result.exit_code == 0, result.output
    return {"result": result, "dir": tmp, "workdir": tmp / "runs" / "w"}


def test_asking_for_more_requests_than_the_trace_holds_says_how_many_were_replayed(short_demo: dict[str, Any]) -> None:
    out = " ".join(short_demo["result"].output.split())  # the console wraps long lines
    assert "note: the trace holds 4 requests; all of them were replayed (--requests asked for 50)" in out


def test_a_relative_workdir_leaves_an_advisor_json_that_works_from_any_directory(short_demo: dict[str, Any]) -> None:
    """A README check found it: `demo --workdir runs/demo2` wrote its paths relative to the
    directory it ran in, so `advisor run --config advisor.json` started from inside the
    workdir silently opened a new, empty journal and catalog.  The paths are absolute now."""
    import json

    workdir = short_demo["workdir"]  # runs/w, given relative to the directory the demo ran in
    cfg = json.loads((workdir / "advisor.json").read_text())
    paths = [v for k, v in cfg.items() if k.endswith("_path") and isinstance(v, str)]
    paths += [v["root"] for v in cfg.get("volumes", []) if isinstance(v, dict) and v.get("root")]
    assert paths and all(Path(p).is_absolute() for p in paths), paths
    assert all(Path(p).resolve().is_relative_to(workdir.resolve()) for p in paths), paths


# --- every error a new user hit: one line, the cause first, a hint, exit != 0, no traceback,
# --- and no progress bar after it


def _no_bar(result) -> None:  # noqa: ANN001 - click Result
    assert "replaying" not in result.output, result.output


def test_a_directory_as_trace_names_the_weka_reader(tmp_path: Path) -> None:
    weka = tmp_path / "claude_code_weka"
    weka.mkdir()
    (weka / "trace_0001.json").write_text("{}")
    result = CliRunner().invoke(app, ["demo", "--trace", str(weka), "--requests", "5"])
    line = _one_line_error(result)
    assert line.startswith(f"error: {weka} is a directory, not a Mooncake jsonl file")
    assert "--format weka" in line and "does not exist" not in line
    _no_bar(result)


def test_a_compressed_trace_is_named_not_text(tmp_path: Path) -> None:
    gz = tmp_path / "trace_0001.json.gz"
    gz.write_bytes(b"\x1f\x8b\x08\x00\xff\xfe\x00")
    result = CliRunner().invoke(app, ["demo", "--trace", str(gz), "--requests", "5"])
    line = _one_line_error(result)
    assert line.startswith(f"error: {gz} is not a text file") and "--format weka" in line
    _no_bar(result)


def test_a_workdir_that_cannot_be_created_or_is_a_file(tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["demo", "--workdir", "/proc/kvadvisor-x", "--requests", "5"])
    line = _one_line_error(result)
    assert line.startswith("error: --workdir /proc/kvadvisor-x cannot be created (") and "Errno" not in line
    _no_bar(result)
    f = tmp_path / "hostname"
    f.write_text("x\n")
    result = CliRunner().invoke(app, ["demo", "--workdir", str(f), "--requests", "5"])
    line = _one_line_error(result)
    assert line == f"error: --workdir {f} is a file, not a directory; pass a directory (created when missing)"
    _no_bar(result)


def test_an_s3_endpoint_that_does_not_answer_is_named_first(tmp_path: Path) -> None:
    port = free_port()
    result = CliRunner().invoke(app, ["demo", "--s3-endpoint", f"http://127.0.0.1:{port}", "--requests", "5",
                                      "--workdir", str(tmp_path / "w")])
    line = _one_line_error(result)
    assert line.startswith(f"error: the S3 endpoint http://127.0.0.1:{port} does not answer (")
    assert "moto_server" in line and "--s3-endpoint" in line and len(line) < 400
    assert not (tmp_path / "w" / "advisor.log").exists()  # refused before the advisor started
    _no_bar(result)


def test_status_without_an_api_hints_at_url() -> None:
    port = free_port()
    result = CliRunner().invoke(app, ["status", "--url", f"http://127.0.0.1:{port}"])
    line = _one_line_error(result)
    assert line.startswith(f"error: no advisor API answers at http://127.0.0.1:{port} (connection refused)")
    assert "--url" in line


def test_advisor_run_and_check_on_a_workdir_whose_s3_is_gone_say_so_and_what_to_do(short_demo: dict[str, Any]) -> None:
    """A plain `demo --workdir` kept its s3 blocks in the demo's own S3, gone with it."""
    import subprocess
    import sys

    workdir = short_demo["workdir"]
    cfg = workdir / "advisor.json"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    for args in (["advisor", "run", "--config", str(cfg)], ["check", "--workdir", str(workdir), "--deep"]):
        res = subprocess.run([sys.executable, "-m", "kvadvisor.cli", *args], capture_output=True, text=True,
                             env=env, timeout=300)
        out = (res.stdout + res.stderr).strip()
        assert res.returncode != 0, out
        assert "Traceback" not in out and "WARNING" not in out, out
        assert len(out.splitlines()) == 1, out
        assert "the S3 endpoint http://127.0.0.1:" in out and "of volume 's3' is unreachable" in out, out
        assert "--s3-endpoint" in out and "moto_server" in out, out
