"""NIXL plumbing: agents, backends, registered DRAM staging buffers and blocking transfers.

Facts used here (docs/design.md §10, checked with nixl-cu12 1.5.1):

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
  from ``check_xfer_state``; both become :class:`TransferError`.  Descriptor lists may be
  ``N x 3`` int64 numpy arrays (``get_xfer_descs`` takes them ~10x faster than tuples).
* Every local DRAM descriptor of a transfer must lie inside ONE registered region, and
  NIXL looks a descriptor up in the region with the greatest start <= its address only
  (checked here: a descriptor inside an outer region but past a nested inner one is
  refused).  DRAM registration with the POSIX and OBJ backends is bookkeeping only (no
  pinning: 1 TiB of unmapped address space registers in < 1 ms), so a registration that
  outlives its memory is harmless.  :class:`DramRegions` keeps registered regions
  disjoint, which makes the lookup exact.
"""

from __future__ import annotations

import bisect
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from .environ import environment
from .gcpause import gc_pause_yield
from .types import TransferError

logger = logging.getLogger(__name__)

os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")

_MIN_STAGING = 1 << 20
#: caller buffers kept registered (disjoint regions; the cache starts over beyond it)
_MAX_DRAM_REGIONS = 1 << 14


def _import_nixl() -> tuple[Any, Any]:
    # the build for this machine's CUDA (storage_backends/nixl_import.py)
    from .nixl_import import nixl_api

    return nixl_api()


class NixlEngine:
    """One NIXL backend on one nixl agent, its registered DRAM (:attr:`dram`: staging
    buffers and caller buffers) and reusable staging buffers.

    Callers hold :attr:`lock` while they use the staging buffer and run transfers with it.

    Every call into the nixl agent (register, deregister, transfer, and
    :meth:`NixlHub.engine` adding a backend) is made holding :attr:`lock`, the agent's lock
    (shared by the engines of one agent): the agents are created without NIXL's own thread
    synchronisation (``nixl_agent_config`` without a listener thread gives
    ``NIXL_THREAD_SYNC_NONE``), and the bindings release the GIL, so a deregistration on one
    thread (a segment file closed when its segment is deleted) racing a registration or
    transfer on another corrupted the agent's memory sections: a ``deregisterMem ...
    NIXL_ERR_NOT_FOUND`` and then a segmentation fault or a heap-corruption abort
    (``tests/faults/stress_registrations.py`` reproduces it within seconds without the lock).
    """

    #: OBJ transfers of several descriptors run as one NIXL request per descriptor, all
    #: posted, then all waited for (:meth:`_transfer_each`); ``False`` sends them as one
    #: request, which NIXL OBJ reports failed while its other requests still run (A/B
    #: benches only)
    split_obj_transfers: bool = True

    def __init__(self, agent: Any, agent_name: str, backend: str, lock: threading.RLock) -> None:
        self.agent = agent
        self.agent_name = agent_name
        self.backend = backend
        self.lock = lock
        self._slots: dict[int, torch.Tensor] = {}
        self._next_dev_id = 1
        self.dram = DramRegions(self)

    # ------------------------------------------------------------------ memory
    def staging(self, nbytes: int, alignment: int = 64, slot: int = 0) -> torch.Tensor:
        """A registered uint8 CPU buffer of at least ``nbytes`` whose address is a multiple of
        ``alignment`` (a power of two); reused across calls, grown by doubling.

        Args:
            slot: which buffer (0, 1, ...): readers double-buffer with slots 0 and 1 so
                that verifying one batch overlaps the transfer of the next.

        The returned view is valid until the next call for the same slot; hold
        :attr:`lock` while using it.

        Raises:
            TransferError: NIXL refused the registration.
        """
        need = max(nbytes, 1)
        cur = self._slots.get(slot)
        if cur is None or cur.numel() - (alignment - 1) < need:
            size = max(_MIN_STAGING, 1 << (need - 1).bit_length()) + alignment
            self._slots.pop(slot, None)  # its region stays registered: harmless, see DramRegions
            cur = self._slots[slot] = torch.empty(size, dtype=torch.uint8)
        self.register_tensor(cur)
        pad = (-cur.data_ptr()) % alignment
        return cur[pad : pad + need]

    def register_tensor(self, t: torch.Tensor) -> None:
        """Make sure a CPU tensor's bytes are registered DRAM of this engine (its whole
        storage is registered once and cached in :attr:`dram`).

        Raises:
            TransferError: NIXL refused the registration.
        """
        addr = t.data_ptr()
        n = t.numel() * t.element_size()
        st = t.untyped_storage()
        self.dram.ensure(np.array([addr], dtype=np.int64), np.array([addr + max(n, 1)], dtype=np.int64),
                         lambda _: (st.data_ptr(), st.nbytes()))

    def register_dram_range(self, address: int, nbytes: int) -> Any:
        """Register ``nbytes`` of DRAM at ``address`` (used by :class:`DramRegions`, which
        keeps the regions of one engine disjoint; do not mix with other DRAM registrations).

        Raises:
            TransferError: NIXL refused the registration.
        """
        try:
            with self.lock:
                return self.agent.register_memory([(address, nbytes, 0, "")], "DRAM", backends=[self.backend])
        except Exception as exc:  # nixl raises its own binding errors
            raise TransferError(f"NIXL {self.backend}: cannot register {nbytes} bytes of DRAM at {address:#x}: {exc}") from exc

    def register(self, regs: Sequence[tuple[int, int, int, str]], mem_type: str) -> Any:
        """Register FILE or OBJ regions ``[(offset, length, fd_or_dev_id, meta)]``."""
        try:
            with self.lock:
                return self.agent.register_memory(list(regs), mem_type, backends=[self.backend])
        except Exception as exc:
            raise TransferError(f"NIXL {self.backend}: cannot register {mem_type} regions {list(regs)[:2]}: {exc}") from exc

    def deregister(self, reg: Any) -> None:
        """Undo :meth:`register` / :meth:`register_dram_range`; errors are logged, not raised."""
        try:
            with self.lock:
                self.agent.deregister_memory(reg, backends=[self.backend])
        except Exception as exc:
            logger.warning("NIXL %s: deregister failed: %s", self.backend, exc)

    def new_dev_id(self) -> int:
        """A fresh device id for an OBJ registration."""
        self._next_dev_id += 1
        return self._next_dev_id

    # ------------------------------------------------------------------ transfers
    def transfer(
        self,
        op: str,
        local: Sequence[tuple[int, int]] | np.ndarray,
        remote: Sequence[tuple[int, int, int]] | np.ndarray,
        remote_mem: str,
        timeout_s: float = 300.0,
    ) -> None:
        """Run one NIXL transfer and wait for it.

        Args:
            op: ``"WRITE"`` (DRAM -> storage) or ``"READ"`` (storage -> DRAM).
            local: ``[(address, length)]`` in registered DRAM, or an ``N x 3`` int64 array
                of ``(address, length, 0)`` rows.
            remote: ``[(offset, length, fd_or_dev_id)]`` in registered ``remote_mem``, or
                an ``N x 3`` int64 array of such rows.
            remote_mem: ``"FILE"`` or ``"OBJ"``.

        Raises:
            TransferError: NIXL refused the request, reported ``ERR`` or did not finish
                within ``timeout_s`` seconds.
        """
        with self.lock:  # the agent is not thread-safe on its own (see the class)
            if len(local) != len(remote):
                raise TransferError(f"{len(local)} local descriptors for {len(remote)} remote ones")
            if len(local) == 0:
                return
            if self.backend == "OBJ" and len(local) > 1 and self.split_obj_transfers:
                self._transfer_each(op, local, remote, remote_mem, timeout_s)
                return
            a = self.agent
            handle = None
            try:
                if isinstance(local, np.ndarray):
                    ldesc = a.get_xfer_descs(local, "DRAM")
                else:
                    ldesc = a.get_xfer_descs([(addr, ln, 0) for addr, ln in local], "DRAM")
                rdesc = a.get_xfer_descs(remote if isinstance(remote, np.ndarray) else list(remote), remote_mem)
                handle = a.initialize_xfer(op, ldesc, rdesc, self.agent_name, backends=[self.backend])
                state = a.transfer(handle)
                start = time.monotonic()
                deadline = start + timeout_s
                spins = 0
                yielded = False
                while state == "PROC":
                    state = a.check_xfer_state(handle)
                    if state != "PROC":
                        break
                    now = time.monotonic()
                    if now > deadline:
                        raise TransferError(f"NIXL {self.backend} {op} did not finish within {timeout_s} s")
                    spins += 1
                    if not yielded and now - start > 1.0:  # a long wait (e.g. S3 retrying inside)
                        gc_pause_yield()
                        yielded = True
                    # NIXL has no blocking wait: poll, yielding at once for short transfers,
                    # then sleeping about 1/20 of the time waited so far (20 us .. 1 ms), so
                    # a long transfer (an S3 PUT: tens of ms) finishes at most ~5 % late and
                    # the polling does not take the CPU from the threads (or, against a local
                    # endpoint, the server) that do the work
                    time.sleep(0 if spins < 32 else min(0.001, max(0.00002, (now - start) / 20)))
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

    def _transfer_each(
        self,
        op: str,
        local: Sequence[tuple[int, int]] | np.ndarray,
        remote: Sequence[tuple[int, int, int]] | np.ndarray,
        remote_mem: str,
        timeout_s: float,
    ) -> None:
        """:meth:`transfer` of several OBJ descriptors: one NIXL request per descriptor,
        all posted before any is waited for (they run concurrently on the backend's
        threads, as one request of several descriptors would), and waited for ALL.

        NIXL OBJ (nixl-cu12 1.5.1) reports a request of several descriptors as ``ERR`` as
        soon as one of them failed, while the others' PUTs / ranged GETs are still in
        flight: a PUT then landed after the wave's objects were deleted (an object left
        behind), and a GET could still write into a staging buffer or a caller's tensor
        after the call had returned.  With one descriptor per request, every request's
        state is exact, and this returns or raises only once none of them runs (or when
        ``timeout_s`` passed: then requests may still be running).

        Raises:
            TransferError: a request was refused or ended in ``ERR`` (the first error,
                after every request ended), or ``timeout_s`` passed.
        """
        a = self.agent
        loc = local if isinstance(local, np.ndarray) else np.array([(ad, ln, 0) for ad, ln in local], dtype=np.int64)
        rem = remote if isinstance(remote, np.ndarray) else np.array(list(remote), dtype=np.int64)
        handles: list[Any] = []
        states: list[str] = []
        first: BaseException | None = None
        try:
            for i in range(len(loc)):
                try:
                    ldesc = a.get_xfer_descs(loc[i : i + 1], "DRAM")
                    rdesc = a.get_xfer_descs(rem[i : i + 1], remote_mem)
                    h = a.initialize_xfer(op, ldesc, rdesc, self.agent_name, backends=[self.backend])
                except Exception as exc:
                    first = exc
                    break
                handles.append(h)
                try:
                    states.append(a.transfer(h))
                except Exception as exc:
                    states.append("ERR")
                    first = exc
                    break
            start = time.monotonic()
            deadline = start + timeout_s
            spins = 0
            yielded = False
            while True:
                pending = False
                for j, h in enumerate(handles):
                    if states[j] != "PROC":
                        continue
                    try:
                        states[j] = a.check_xfer_state(h)
                    except Exception as exc:
                        states[j] = "ERR"
                        first = first or exc
                    pending = pending or states[j] == "PROC"
                if not pending:
                    break
                now = time.monotonic()
                if now > deadline:
                    raise TransferError(f"NIXL {self.backend} {op} did not finish within {timeout_s} s")
                spins += 1
                if not yielded and now - start > 1.0:
                    gc_pause_yield()
                    yielded = True
                time.sleep(0 if spins < 32 else min(0.001, max(0.00002, (now - start) / 20)))
            if first is not None:
                raise TransferError(f"NIXL {self.backend} {op} of {len(loc)} descriptors failed: {first}") from first
            bad = [j for j, st in enumerate(states) if st != "DONE"]
            if bad:
                raise TransferError(
                    f"NIXL {self.backend} {op}: {len(bad)} of {len(loc)} descriptors ended in state "
                    f"{states[bad[0]]!r} (first: descriptor {bad[0]})"
                )
        finally:
            for h in handles:
                try:
                    a.release_xfer_handle(h)
                except Exception as exc:
                    logger.debug("NIXL release_xfer_handle: %s", exc)

    def close(self) -> None:
        """Drop the staging buffers and deregister every cached DRAM region."""
        with self.lock:
            self._slots.clear()
            self.dram.clear()


class DramRegions:
    """Caller-owned DRAM (``get(out=...)`` tensors) kept registered with one engine, so that
    reads land straight in it without a staging copy.

    Regions are the tensors' whole storages, registered on first use and kept (a pool's
    storage is registered once for good).  They stay pairwise disjoint and never touch: a
    new storage that overlaps or touches cached regions (their memory was freed and
    reused, two tensors view one buffer, or two storages are back to back) replaces them
    with the union of all of them.  When
    :data:`_MAX_DRAM_REGIONS` regions are held, the next :meth:`ensure` starts from an
    empty cache (never in the middle of a call's ranges).  Callers hold the engine's
    :attr:`NixlEngine.lock` from :meth:`ensure` until their transfers are done.
    """

    def __init__(self, engine: NixlEngine) -> None:
        self._engine = engine
        self._regs: dict[int, tuple[int, Any]] = {}  # start -> (end, handle)
        self._sorted: list[int] = []  # starts, ascending
        self._starts = np.empty(0, dtype=np.int64)
        self._ends = np.empty(0, dtype=np.int64)
        self._dirty = False
        #: registrations made so far (a steady state makes none)
        self.registrations = 0

    def __len__(self) -> int:
        return len(self._regs)

    def uncovered(self, addrs: np.ndarray, ends: np.ndarray) -> np.ndarray:
        """Indexes of the ranges ``[addrs[i], ends[i])`` that no registered region holds."""
        if self._dirty:
            self._starts = np.array(self._sorted, dtype=np.int64)
            self._ends = np.array([self._regs[s][0] for s in self._sorted], dtype=np.int64)
            self._dirty = False
        if len(self._starts) == 0:
            return np.arange(len(addrs))
        idx = np.searchsorted(self._starts, addrs, side="right") - 1
        ok = (idx >= 0) & (self._ends[np.maximum(idx, 0)] >= ends)
        return np.flatnonzero(~ok)

    def _covers(self, a: int, e: int) -> bool:
        j = bisect.bisect_right(self._sorted, a) - 1
        return j >= 0 and self._regs[self._sorted[j]][0] >= e

    def ensure(self, addrs: np.ndarray, ends: np.ndarray, storage_of: Callable[[int], tuple[int, int]]) -> None:
        """Register what is needed so that every ``[addrs[i], ends[i])`` lies in one region.

        Args:
            addrs, ends: int64 arrays of byte ranges (caller tensors' bytes).
            storage_of: ``i -> (start, nbytes)`` of the allocation holding range ``i``
                (registered whole, so later tensors of the same storage hit the cache).

        Raises:
            TransferError: NIXL refused a registration.
        """
        if len(self._regs) >= _MAX_DRAM_REGIONS:
            self.clear()  # before this call's ranges are looked up, so none of them is dropped
        miss = self.uncovered(addrs, ends)
        for i in miss.tolist():
            a, e = int(addrs[i]), int(ends[i])
            if self._covers(a, e):
                continue  # an earlier miss of this call registered its storage
            s, n = storage_of(i)
            lo, hi = min(s, a), max(s + n, e)
            j = bisect.bisect_right(self._sorted, lo) - 1
            if j < 0 or self._regs[self._sorted[j]][0] < lo:
                j += 1  # the region starting before lo ends before it: keep it
            k = j
            while k < len(self._sorted) and self._sorted[k] <= hi:
                k += 1
            # overlapping or touching regions: replaced by the union (so no two regions
            # touch, and a run of ranges contiguous in memory, which the volumes send as
            # ONE descriptor, always lies in one region, even over two storages)
            for start in self._sorted[j:k]:
                end, handle = self._regs.pop(start)
                lo, hi = min(lo, start), max(hi, end)
                self._engine.deregister(handle)
            del self._sorted[j:k]
            self._dirty = True
            handle = self._engine.register_dram_range(lo, hi - lo)
            self._regs[lo] = (hi, handle)
            bisect.insort(self._sorted, lo)
            self.registrations += 1

    def clear(self) -> None:
        """Deregister every cached region."""
        for _, handle in self._regs.values():
            self._engine.deregister(handle)
        self._regs.clear()
        self._sorted.clear()
        self._dirty = True


_ENV_LOCK = threading.Lock()
"""Held while a backend is created, with its environment variables set (the process
environment is shared: two creations at once would see each other's)."""


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

    def engine(self, backend: str, params: dict[str, str] | None = None,
               env: dict[str, str] | None = None) -> NixlEngine:
        """The engine for ``backend`` with ``params``, created on first use.

        Args:
            env: environment variables set while NIXL creates the backend (and restored
                after), for settings its libraries read from the environment only (the
                aws-sdk retry strategy of OBJ); part of what tells engines apart.

        Raises:
            TransferError: NIXL cannot create the backend (message from NIXL).
        """
        key = (backend, tuple(sorted((params or {}).items())) + tuple(sorted((env or {}).items())))
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
                # the agent's lock: an agent that already has a backend may be transferring
                # on another thread (an S3 volume registered at run time beside POSIX ones)
                with lock, _ENV_LOCK, environment(env):
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
