"""Every command of the README's ``bash`` blocks, in order, on a fresh directory, the way the
README shows it: each must exit 0.

The commands are read from README.md itself, so the test stays in step with it: a README
command this test neither runs nor lists in :data:`NOT_RUN` (with the reason) fails the
test, and so does a :data:`NOT_RUN` entry that matches no README command.

What is changed, and only this, so that the suite stays affordable and uses free ports:

* ``make demo [DEMO_ARGS="..."]`` runs ``.venv/bin/kvadvisor demo ...`` (what it runs once
  the venv is installed; installing is not this test's job);
* a ``demo`` replays at most :data:`SMALL` requests (``--requests`` lowered or added;
  ``--requests 0``, a whole file, is kept: ``$KVADVISOR_TRACES`` holds a 60-request
  ``conversation_trace.jsonl`` cut from the bundled slice);
* the README's S3 port 9000 becomes a free port, its NATS 127.0.0.1:4222 the suite's server;
* ``events stats ... --duration S`` measures for at most :data:`STATS_S` seconds (the
  command's work is the same; only its measuring window is shorter);
* ``kvadvisor up`` gets ``--policy-interval`` :data:`ROUND_S` (its advisors' policy rounds;
  5 s by default): the scaled demo after it waits for about four of them;
* a command ending in ``&`` runs in the background until the end; ``advisor run`` (it
  serves until Ctrl-C) must print ``ADVISOR READY`` and then exit 0 on SIGTERM.

The working directory is a new temporary one holding only ``.venv`` and ``kvadvisor``
(links into the repository: the README's commands name ``.venv/bin/...`` and the bundled
trace), with ``PYTHONPATH`` on this checkout.
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import time
from pathlib import Path

import pytest

from storage_backends import free_port

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
SMALL = 20
"""Requests a README demo replays here."""
STATS_S = 2
"""Seconds a README ``events stats`` measures here."""
ROUND_S = 1
"""Seconds between the policy rounds of the advisors a README ``kvadvisor up`` starts here."""

NOT_RUN: dict[str, str] = {
    "make test": "the whole suite, of which this test is a part",
    ".venv/bin/kvadvisor status --url http://127.0.0.1:PORT": (
        "PORT is the one a running demo prints (tests/e2e/test_pipeline.py runs status against a demo's API; "
        "the scaled status below is run)"),
    ".venv/bin/kvadvisor events tail": "follows a running demo's stream until Ctrl-C, from another terminal",
    ".venv/bin/kvadvisor events relay": "relays a running vLLM or SGLang engine's events until Ctrl-C",
    ".venv/bin/python bench/": "a benchmark: its figures are in docs/BENCHMARKS.md",
    "git clone <this repository>": "installing is not this test's job (CI runs `make test` on a clean clone)",
    ".venv/bin/kvadvisor demo --engine vllm": (
        "real vLLM engines, minutes each: tests/vllm/test_engine_demo.py runs the engine demo"),
    "cat > /srv/kv/advisor.json": "a template (NAMESPACE, /srv/kv are the user's); tests/vllm/test_vllm_loop.py runs this loop",
    ".venv/bin/python -c \"from kvadvisor.engine_demo.run import connector_namespace": "a template (MODEL_DIR is the user's model)",
    ".venv/bin/kvadvisor advisor run --config /srv/kv/": "a template (the settings above); `advisor run` itself runs above",
    "DYN_KVBM_DISABLE_DISK_OFFLOAD_FILTER=true ": "a template (MODEL_DIR is the user's model)",
    "P='{\"model\": \"MODEL_DIR\"": "a template (the user's model and prompt)",
    "curl -s localhost:800": "asks the template's engines",
    "sleep 1; curl -s localhost:800": "asks the template's engines",
}
"""README command prefix → why this test does not run it."""


def readme_commands(text: str) -> list[str]:
    """The commands of the README's ``bash`` blocks, in order: continuation lines joined,
    comments dropped."""
    out: list[str] = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        joined = re.sub(r"\\\n\s*", " ", block)
        pending = ""
        heredoc = ""  # the end word of a here-document being read
        for line in joined.splitlines():
            if heredoc:  # a here-document's body belongs to its command
                out[-1] += "\n" + line
                if line.strip() == heredoc:
                    heredoc = ""
                continue
            if pending:  # inside a quoted argument that spans lines
                pending += " " + line.strip()
                if pending.count("'") % 2 == 0:
                    out.append(pending)
                    pending = ""
                continue
            line = re.sub(r"\s{2,}#\s.*$", "", line).strip()
            if not line or line.startswith("#"):
                continue
            if line.count("'") % 2 and not re.search(r"<<-?'?\w+'?$", line):
                pending = line
            else:
                out.append(line)
                if m := re.search(r"<<-?'?(\w+)'?$", line):
                    heredoc = m.group(1)
        assert not pending, f"unbalanced quote in a README command: {pending}"
        assert not heredoc, f"a here-document without its end line {heredoc!r}"
    return out


def _not_run(cmd: str) -> str | None:
    return next((p for p in NOT_RUN if cmd.startswith(p)), None)


def _rewrite(cmd: str, s3_port: int, nats: str) -> str:
    """The changes listed in the module docstring."""
    m = re.match(r'make demo(?: DEMO_ARGS="([^"]*)")?$', cmd)
    if m:
        cmd = ".venv/bin/kvadvisor demo " + (m.group(1) or "")
    cmd = cmd.replace("127.0.0.1:9000", f"127.0.0.1:{s3_port}").replace("-p 9000", f"-p {s3_port}")
    cmd = cmd.replace("nats://127.0.0.1:4222", nats)
    if re.search(r"(^|\s)\.venv/bin/kvadvisor demo\b", cmd) and "--help" not in cmd:
        n = re.search(r"--requests (\d+)", cmd)
        if n is None:
            cmd += f" --requests {SMALL}"
        elif int(n.group(1)) > SMALL:
            cmd = cmd.replace(n.group(0), f"--requests {SMALL}")
        if re.search(r"--transport (nats|mixed)", cmd):
            cmd += f" --nats-url {nats}"
    if re.match(r"\.venv/bin/kvadvisor up\b", cmd) and "--policy-interval" not in cmd:
        cmd += f" --policy-interval {ROUND_S}"
    if re.search(r"(^|\s)\.venv/bin/kvadvisor events stats\b", cmd):
        d = re.search(r"--duration (\d+(?:\.\d+)?)", cmd)
        if d is not None and float(d.group(1)) > STATS_S:
            cmd = cmd.replace(d.group(0), f"--duration {STATS_S}")
    return cmd.strip()


@pytest.mark.timeout(1500)  # about 40 s of CPU; a loaded 2-core machine stretches its wall time
def test_readme_commands_run_in_order(tmp_path: Path, nats_url: str) -> None:
    commands = readme_commands((REPO / "README.md").read_text())
    assert len(commands) >= 15, commands
    used = {p for c in commands if (p := _not_run(c))}
    assert used == set(NOT_RUN), f"NOT_RUN entries matching no README command: {set(NOT_RUN) - used}"

    work = tmp_path / "fresh"
    work.mkdir()
    (work / ".venv").symlink_to(REPO / ".venv")
    (work / "kvadvisor").symlink_to(REPO / "kvadvisor")
    traces = tmp_path / "traces"
    traces.mkdir()
    with open(REPO / "kvadvisor" / "data" / "mooncake_conversation_2000.jsonl") as f:
        (traces / "conversation_trace.jsonl").write_text("".join(next(f) for _ in range(60)))
    env = dict(os.environ, PYTHONPATH=str(REPO), KVADVISOR_TRACES=str(traces), COLUMNS="200", NIXL_LOG_LEVEL="WARN")
    s3_port = free_port()
    background: list[subprocess.Popen[bytes]] = []
    ran: list[str] = []
    try:
        for readme_cmd in commands:
            if _not_run(readme_cmd):
                continue
            cmd = _rewrite(readme_cmd, s3_port, nats_url)
            t0 = time.monotonic()
            if cmd.endswith("&"):
                background.append(subprocess.Popen(["bash", "-c", cmd[:-1]], cwd=work, env=env, start_new_session=True,
                                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
                if "moto_server" in cmd:
                    _wait_port(s3_port, background[-1])
            elif " advisor run " in f" {cmd} ":
                _serves_until_sigterm(cmd, work, env)
            else:
                r = subprocess.run(["bash", "-c", cmd], cwd=work, env=env, capture_output=True, text=True, timeout=900)
                assert r.returncode == 0, f"README: {readme_cmd}\nran: {cmd}\nexit {r.returncode}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
            ran.append(readme_cmd)
            print(f"README command ran in {time.monotonic() - t0:.1f} s: {cmd}")  # shown with -s or on failure
    finally:
        if (work / "runs" / "cluster" / "cluster.json").exists():
            subprocess.run(["bash", "-c", ".venv/bin/kvadvisor down"], cwd=work, env=env, timeout=300)
        for p in background:
            os.killpg(p.pid, signal.SIGTERM)
            p.wait(timeout=30)
    # every README command either ran or is listed in NOT_RUN with its reason
    assert set(ran) | {c for c in commands if _not_run(c)} == set(commands)
    assert any(c.startswith(".venv/bin/kvadvisor up") for c in ran) and any("check --workdir" in c for c in ran)


def _wait_port(port: int, proc: subprocess.Popen[bytes], timeout_s: float = 60.0) -> None:
    import socket

    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        assert proc.poll() is None, f"background command exited {proc.returncode}"
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return
        except OSError:
            time.sleep(0.1)
    raise AssertionError(f"nothing listens on 127.0.0.1:{port} after {timeout_s} s")


def _serves_until_sigterm(cmd: str, work: Path, env: dict[str, str], timeout_s: float = 180.0) -> None:
    """Start ``cmd`` (a service that runs until Ctrl-C): it must print ``ADVISOR READY``, then
    exit 0 on SIGTERM."""
    argv = shlex.split(cmd)
    env = dict(env)
    while argv and re.match(r"[A-Za-z_][A-Za-z0-9_]*=", argv[0]):  # leading VAR=value assignments
        name, value = argv.pop(0).split("=", 1)
        env[name] = value
    p = subprocess.Popen(argv, cwd=work, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert p.stdout is not None
    end = time.monotonic() + timeout_s
    line = ""
    while time.monotonic() < end and "ADVISOR READY" not in line:
        line = p.stdout.readline()
        if not line and p.poll() is not None:
            break
    try:
        assert "ADVISOR READY" in line, f"{shlex.quote(cmd)}: no ADVISOR READY; exit {p.poll()}: {p.stderr.read() if p.poll() is not None else ''}"
    finally:
        p.send_signal(signal.SIGTERM)
        rc = p.wait(timeout=60)
    assert rc == 0, f"{cmd}: exit {rc} on SIGTERM"
