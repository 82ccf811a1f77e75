"""Finding 4: a working directory has one owner. A second ``kvadvisor demo`` on it is
refused at once, naming the owner, and changes nothing; the lock dies with its owner."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvadvisor.workdir_lock import WorkdirLockedError, workdir_lock
from tests.faults._world import REPO

HOLD = r"""
import sys, time
from pathlib import Path
from kvadvisor.workdir_lock import workdir_lock
with workdir_lock(Path(sys.argv[1]), "holder"):
    print("LOCKED", flush=True)
    time.sleep(600)
"""


def _env() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))


def test_a_second_demo_on_a_locked_workdir_is_refused(tmp_path: Path) -> None:
    wd = tmp_path / "wd"
    wd.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(wd)], stdout=subprocess.PIPE, text=True, env=_env())
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "LOCKED"
        before = sorted(p.name for p in wd.iterdir())
        r = subprocess.run([sys.executable, "-c", "from kvadvisor.cli import app; app()", "demo", "--workdir", str(wd),
                            "--requests", "5"], capture_output=True, text=True, env=_env(), timeout=300)
        assert r.returncode == 2, r.stdout + r.stderr
        assert "in use by another process" in r.stderr and f"pid {holder.pid}" in r.stderr, r.stderr
        assert sorted(p.name for p in wd.iterdir()) == before  # nothing created or changed
        with pytest.raises(WorkdirLockedError, match=f"pid {holder.pid}"):
            with workdir_lock(wd, "test"):
                pass
    finally:
        holder.kill()
        holder.wait()
    with workdir_lock(wd, "after the owner died"):  # the kernel released the flock
        assert "after the owner died" in (wd / ".kvadvisor.lock.owner").read_text()


RUN_ADVISOR = r"""
import sys
from advisor import AdvisorService, AdvisorSettings
svc = AdvisorService(AdvisorSettings.from_json_file(sys.argv[1]))
svc.start()
print("STARTED", flush=True)
svc.run_forever()
"""


def test_a_journal_has_one_advisor_and_check_repair_waits_for_it(tmp_path: Path) -> None:
    from advisor import AdvisorError, AdvisorService
    from tests.faults._world import settings

    s = settings(tmp_path)
    cfg = tmp_path / "advisor.json"
    cfg.write_text(s.model_dump_json())
    cfg.chmod(0o600)
    first = subprocess.Popen([sys.executable, "-c", RUN_ADVISOR, str(cfg)], stdout=subprocess.PIPE, text=True,
                             env=_env())
    try:
        assert first.stdout is not None and first.stdout.readline().strip() == "STARTED"
        second = AdvisorService(s)
        with pytest.raises(AdvisorError, match=f"journal .* in use by another process \\(pid {first.pid}"):
            second.start()
        second.stop()
        r = subprocess.run([sys.executable, "-c", "from kvadvisor.cli import app; app()", "check", "--config", str(cfg),
                            "--repair"], capture_output=True, text=True, env=_env(), timeout=300)
        assert r.returncode == 2 and f"pid {first.pid}" in r.stderr, r.stdout + r.stderr
    finally:
        first.kill()
        first.wait()
    with AdvisorService(s):  # the lock died with its owner
        pass
