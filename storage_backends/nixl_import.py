"""The one place that imports NIXL: finds the build installed for this machine's CUDA.

NIXL ships one wheel per CUDA major version, each under its own module name:
``nixl-cu12`` (module ``nixl_cu12``) and ``nixl-cu13`` (``nixl_cu13``); NVIDIA's ``nixl``
meta-package installs both and picks one at import.  A build for another CUDA major than
the process's CUDA runtime imports fine but cannot register GPU memory (UCX sees VRAM as
host memory: ``NIXL_ERR_BACKEND``, docs/operations.md "NIXL and CUDA").

Which build (:func:`nixl_module`):

1. ``KVADVISOR_NIXL_MODULE`` (``nixl_cu12`` / ``nixl_cu13``), when set: that one, or an error.
2. torch built for CUDA (``torch.version.cuda``, e.g. ``"13.0"``): the build of that
   major, ``nixl_cu<major>``, or an error naming the package to install (the rule of
   NVIDIA's meta-package, ``nixl_meta_utils.detect_cuda_major``).
3. CPU-only torch: ``nixl_cu12`` (the default extra, the build the facts in
   docs/design.md §10 were checked with), else ``nixl_cu13``.  Both run CPU-only (DRAM,
   FILE and OBJ memory, POSIX and OBJ backends).

Installing: ``nixl-cu12`` is a core dependency (CPU-only and CUDA 12 machines); a CUDA 13
machine adds the ``[cu13]`` extra (``pip install 'kvadvisor[cu13]'``).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from functools import cache
from types import ModuleType
from typing import Any

#: NIXL builds this module knows, by CUDA major
BUILDS = {12: "nixl_cu12", 13: "nixl_cu13"}
#: order tried on a machine whose torch has no CUDA
CPU_ORDER = ("nixl_cu12", "nixl_cu13")
ENV = "KVADVISOR_NIXL_MODULE"


class NixlImportError(ImportError):
    """No usable NIXL build is installed; the message names the package to install."""


def _package(module: str) -> str:
    return module.replace("_", "-")


def _extra(module: str) -> str:
    return "kvadvisor" if module == "nixl_cu12" else f"'kvadvisor[{module.removeprefix('nixl_')}]'"


def torch_cuda_major() -> int | None:
    """CUDA major version torch was built for (``None``: CPU-only torch or no torch)."""
    torch = sys.modules.get("torch")
    if torch is None:
        try:
            import torch  # noqa: PLC0415 - only when the caller has not imported it
        except ImportError:
            return None
    version = getattr(getattr(torch, "version", None), "cuda", None)
    return int(str(version).split(".")[0]) if version else None


def _load(module: str) -> ModuleType | None:
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name != module:  # the build is there but something it needs is not
            raise
        return None


@cache
def nixl_module() -> ModuleType:
    """The NIXL build to use here (see the module docstring for the rule); cached.

    Raises:
        NixlImportError: ``KVADVISOR_NIXL_MODULE`` names no known or no installed build;
            torch is built for CUDA ``N`` and ``nixl-cuN`` is not installed (or no build
            exists for ``N``); no build at all is installed.  The message says what to
            install.
    """
    forced = os.environ.get(ENV)
    if forced:
        if forced not in BUILDS.values():
            raise NixlImportError(f"{ENV}={forced!r}: expected one of {sorted(BUILDS.values())}")
        mod = _load(forced)
        if mod is None:
            raise NixlImportError(f"{ENV}={forced}, but {_package(forced)} is not installed: pip install {_package(forced)}==1.5.1")
        return mod
    cuda = torch_cuda_major()
    if cuda is not None:
        want = BUILDS.get(cuda)
        if want is None:
            raise NixlImportError(f"torch is built for CUDA {cuda}; this kvadvisor knows NIXL builds for CUDA {sorted(BUILDS)} only")
        mod = _load(want)
        if mod is None:
            others = [m for m in BUILDS.values() if m != want and importlib.util.find_spec(m) is not None]
            found = f" ({', '.join(map(_package, others))} is installed, but it cannot register CUDA {cuda} memory)" if others else ""
            raise NixlImportError(
                f"torch is built for CUDA {cuda}: NIXL needs {_package(want)}{found}; "
                f"pip install {_extra(want)} (or {_package(want)}==1.5.1)"
            )
        return mod
    for name in CPU_ORDER:
        mod = _load(name)
        if mod is not None:
            return mod
    raise NixlImportError("no NIXL build is installed: pip install kvadvisor (nixl-cu12), or 'kvadvisor[cu13]' on a CUDA 13 machine")


def nixl_api() -> tuple[Any, Any]:
    """``(nixl_agent, nixl_agent_config)`` of :func:`nixl_module`.

    Raises:
        NixlImportError: as :func:`nixl_module`.
    """
    mod = nixl_module()
    return mod.nixl_agent, mod.nixl_agent_config
