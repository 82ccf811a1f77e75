"""NIXL plumbing: agents, backends, registered DRAM staging buffers and blocking transfers.

Facts used here (``../shared/reference/nixl_notes.md``, checked with nixl-cu12 1.5.1):

* ``nixl_agent_config(backends=[])`` then ``create_backend("POSIX")`` gives file I/O on FILE
  memory (``(offset, length, fd)`` descriptors); ``create_backend("OBJ", params)`` gives S3
  on OBJ memory (``(offset, length, dev_id)`` descriptors, object key in the registration's
  metadata string).
* A nixl agent holds at most ONE backend of each type, and an OBJ backend is bound to one
  endpoint + bucket + credentials.  A :class:`NixlHub` therefore keeps one agent (named
  after the storage agent) and adds a further agent only for a second, different OBJ
  configuration.
* A transfer is ``initialize_xfer`` -> ``transfer`` -> poll ``check_xfer_state`` until it
  leaves ``PROC`` -> ``release_xfer_handle``.  Errors surface as ``ERR`` or as exceptions
  from ``check_xfer_state``; both become :class:`TransferError`.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Sequence
from typing import Any

import torch

from .types import TransferError

logger = logging.getLogger(__name__)

os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")

_MIN_STAGING = 1 << 20


def _import_nixl() -> tuple[Any, Any]:
    from nixl_cu12 import nixl_agent, nixl_agent_config

    return nixl_agent, nixl_agent_config


class NixlEngine:
    """One NIXL backend on one nixl agent, plus a reusable registered DRAM staging buffer.

    Callers hold :attr:`lock` while they use the staging buffer and run transfers with it.
    """

    def __init__(self, agent: Any, agent_name: str, backend: str, lock: threading.RLock) -> None:
        self.agent = agent
        self.agent_name = agent_name
        self.backend = backend
        self.lock = lock
        self._slots: dict[int, tuple[torch.Tensor, Any]] = {}
        self._next_dev_id = 1

    # ------------------------------------------------------------------ memory
    def staging(self, nbytes: int, alignment: int = 64, slot: int = 0) -> torch.Tensor:
        """A registered uint8 CPU buffer of at least ``nbytes`` whose address is a multiple of
        ``alignment`` (a power of two); reused across calls, grown by doubling.

        Args:
            slot: which buffer (0, 1, ...): readers double-buffer with slots 0 and 1 so
                that verifying one batch overlaps the transfer of the next.

        The returned view is valid until the next call for the same slot; hold
        :attr:`lock` while using it.
        """
        need = max(nbytes, 1)
        cur = self._slots.get(slot)
        if cur is None or cur[0].numel() - (alignment - 1) < need:
            size = max(_MIN_STAGING, 1 << (need - 1).bit_length()) + alignment
            self._release_slot(slot)
            buf = torch.empty(size, dtype=torch.uint8)
            self._slots[slot] = cur = (buf, self.register_dram(buf))
        pad = (-cur[0].data_ptr()) % alignment
        return cur[0][pad : pad + need]

    def register_dram(self, t: torch.Tensor) -> Any:
        """Register a CPU tensor with this engine's backend (``agent.register_memory``)."""
        try:
            return self.agent.register_memory(t, backends=[self.backend])
        except Exception as exc:  # nixl raises its own binding errors
            raise TransferError(f"NIXL {self.backend}: cannot register {t.numel() * t.element_size()} bytes of DRAM: {exc}") from exc

    def register(self, regs: Sequence[tuple[int, int, int, str]], mem_type: str) -> Any:
        """Register FILE or OBJ regions ``[(offset, length, fd_or_dev_id, meta)]``."""
        try:
            return self.agent.register_memory(list(regs), mem_type, backends=[self.backend])
        except Exception as exc:
            raise TransferError(f"NIXL {self.backend}: cannot register {mem_type} regions {list(regs)[:2]}: {exc}") from exc

    def deregister(self, reg: Any) -> None:
        """Undo :meth:`register` / :meth:`register_dram`; errors are logged, not raised."""
        try:
            self.agent.deregister_memory(reg, backends=[self.backend])
        except Exception as exc:
            logger.warning("NIXL %s: deregister failed: %s", self.backend, exc)

    def new_dev_id(self) -> int:
        """A fresh device id for an OBJ registration."""
        self._next_dev_id += 1
        return self._next_dev_id

    def _release_slot(self, slot: int) -> None:
        cur = self._slots.pop(slot, None)
        if cur is not None:
            self.deregister(cur[1])

    def _release_staging(self) -> None:
        for slot in list(self._slots):
            self._release_slot(slot)

    # ------------------------------------------------------------------ transfers
    def transfer(
        self,
        op: str,
        local: Sequence[tuple[int, int]],
        remote: Sequence[tuple[int, int, int]],
        remote_mem: str,
        timeout_s: float = 300.0,
    ) -> None:
        """Run one NIXL transfer and wait for it.

        Args:
            op: ``"WRITE"`` (DRAM -> storage) or ``"READ"`` (storage -> DRAM).
            local: ``[(address, length)]`` in registered DRAM.
            remote: ``[(offset, length, fd_or_dev_id)]`` in registered ``remote_mem``.
            remote_mem: ``"FILE"`` or ``"OBJ"``.

        Raises:
            TransferError: NIXL refused the request, reported ``ERR`` or did not finish
                within ``timeout_s`` seconds.
        """
        if len(local) != len(remote):
            raise TransferError(f"{len(local)} local descriptors for {len(remote)} remote ones")
        if not local:
            return
        a = self.agent
        handle = None
        try:
            ldesc = a.get_xfer_descs([(addr, ln, 0) for addr, ln in local], "DRAM")
            rdesc = a.get_xfer_descs(list(remote), remote_mem)
            handle = a.initialize_xfer(op, ldesc, rdesc, self.agent_name, backends=[self.backend])
            state = a.transfer(handle)
            deadline = time.monotonic() + timeout_s
            spins = 0
            while state == "PROC":
                state = a.check_xfer_state(handle)
                if state != "PROC":
                    break
                if time.monotonic() > deadline:
                    raise TransferError(f"NIXL {self.backend} {op} did not finish within {timeout_s} s")
                spins += 1
                time.sleep(0 if spins < 100 else 0.0002)
            if state != "DONE":
                raise TransferError(f"NIXL {self.backend} {op} of {len(local)} descriptors ended in state {state!r}")
        except TransferError:
            raise
        except Exception as exc:
            raise TransferError(f"NIXL {self.backend} {op} of {len(local)} descriptors failed: {exc}") from exc
        finally:
            if handle is not None:
                try:
                    a.release_xfer_handle(handle)
                except Exception as exc:  # a handle of a failed transfer may refuse release
                    logger.debug("NIXL release_xfer_handle: %s", exc)

    def close(self) -> None:
        """Deregister the staging buffers."""
        with self.lock:
            self._release_staging()


class NixlHub:
    """The NIXL agents of one storage agent, handing out one :class:`NixlEngine` per
    (backend type, parameters).

    Args:
        name: name of the first nixl agent; further ones get ``<name>.<n>``.
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self._agents: list[tuple[Any, str, threading.RLock, set[str]]] = []
        self._engines: dict[tuple[str, tuple[tuple[str, str], ...]], NixlEngine] = {}
        self._lock = threading.Lock()

    def engine(self, backend: str, params: dict[str, str] | None = None) -> NixlEngine:
        """The engine for ``backend`` with ``params``, created on first use.

        Raises:
            TransferError: NIXL cannot create the backend (message from NIXL).
        """
        key = (backend, tuple(sorted((params or {}).items())))
        with self._lock:
            eng = self._engines.get(key)
            if eng is not None:
                return eng
            slot = next((s for s in self._agents if backend not in s[3]), None)
            if slot is None:
                nixl_agent, nixl_agent_config = _import_nixl()
                agent_name = self.name if not self._agents else f"{self.name}.{len(self._agents)}"
                try:
                    agent = nixl_agent(agent_name, nixl_agent_config(backends=[]))
                except Exception as exc:
                    raise TransferError(f"cannot create NIXL agent {agent_name!r}: {exc}") from exc
                slot = (agent, agent_name, threading.RLock(), set())
                self._agents.append(slot)
            agent, agent_name, lock, used = slot
            try:
                agent.create_backend(backend, dict(params or {}))
            except Exception as exc:
                raise TransferError(f"NIXL cannot create backend {backend}: {exc}") from exc
            used.add(backend)
            eng = NixlEngine(agent, agent_name, backend, lock)
            self._engines[key] = eng
            return eng

    def close(self) -> None:
        """Release every engine's staging buffer (the agents go with the process)."""
        with self._lock:
            for eng in self._engines.values():
                eng.close()
            self._engines.clear()
