"""Start a real HTTP S3 endpoint (moto's server) on loopback when none is configured.

Used by ``kvadvisor demo`` and by the tests: the S3 volume then talks to a real HTTP
endpoint through NIXL OBJ and boto3, not to an in-process fake.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field

import httpx

from storage_backends.ports import free_port

LOCAL_ACCESS_KEY = "kvadvisor"
LOCAL_SECRET_KEY = "kvadvisor-secret"


@dataclass
class LocalS3:
    """A running ``moto_server`` process.

    Attributes:
        endpoint: ``http://127.0.0.1:PORT``.
        access_key / secret_key: credentials to pass to boto3 and NIXL OBJ (moto accepts any).
    """

    endpoint: str
    process: subprocess.Popen[bytes]
    access_key: str = LOCAL_ACCESS_KEY
    secret_key: str = LOCAL_SECRET_KEY
    _stopped: bool = field(default=False, repr=False)

    def stop(self) -> None:
        """Terminate the server (idempotent)."""
        if self._stopped:
            return
        self._stopped = True
        self.process.terminate()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()

    def __enter__(self) -> LocalS3:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def start_local_s3(port: int | None = None, timeout_s: float = 30.0) -> LocalS3:
    """Launch ``moto_server`` on ``127.0.0.1:port`` (a free port by default) and wait for it.

    Raises:
        RuntimeError: if the ``moto_server`` executable is missing or the server does not
            answer within ``timeout_s`` seconds.
    """
    # The one installed beside this interpreter (the project's venv) first, then PATH.
    exe = os.path.join(os.path.dirname(sys.executable), "moto_server")
    if not os.path.exists(exe):
        exe = shutil.which("moto_server") or exe
    if not os.path.exists(exe):
        raise RuntimeError("moto_server not found: install the project (pip install -e .) first")
    port = port or free_port()
    proc = subprocess.Popen(
        [exe, "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    endpoint = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"moto_server exited with code {proc.returncode} on port {port}")
        try:
            httpx.get(endpoint, timeout=1.0)
            return LocalS3(endpoint=endpoint, process=proc)
        except httpx.HTTPError:
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError(f"moto_server did not answer on {endpoint} within {timeout_s} s")
