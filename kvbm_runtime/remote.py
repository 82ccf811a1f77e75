"""Remote blocks: read another worker's pool (typically a prefill worker's G2) with NIXL.

Owner side (:class:`RemoteExporter`): registers its pool's tensor with a NIXL agent using
the UCX backend and publishes an :class:`ExportedLayout` — the agent's metadata, the
serialized registration descriptors and the pool's :class:`~kvbm_runtime.layout.LayoutDescriptor`
(base address, strides, device, memory kind).  ``export(hashes)`` pins the longest
registered prefix of ``hashes`` and returns a :class:`BlockExport` (layout + block ids +
identities) that travels as bytes over any channel (ZMQ, a pipe).

Reader side (:class:`RemoteReader`): imports the layout (``add_remote_agent``), allocates
blocks in its own pool, computes the remote and local byte ranges of every block from the
two layout descriptors (``base + block·block_stride + layer·layer_stride +
outer·outer_stride``: valid for ``FullyContiguous`` and ``LayerSeparated`` alike; a
contiguous block is one range), issues one NIXL ``READ`` and registers the blocks under
their identities (Store events for the reader's tier).  The owner keeps the blocks pinned
until the reader says it is done (``release``).

NIXL facts relied on (docs/design.md §10): ``nixl_agent_config(backends=["UCX"])``
moves DRAM ↔ DRAM between agents on loopback without a GPU; torch CPU tensors register
directly; transfer descriptors are ``(addr, length, dev_id)`` lists with mem type ``"DRAM"``.
"""

from __future__ import annotations

import itertools
import os
import threading
import time

import msgspec

from event_plane.schema import U64

from .block import BlockMeta, ImmutableBlock, MutableBlock
from .errors import KvbmError
from .layout import LayoutDescriptor
from .pool import BlockPool

os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")


class RemoteBlockError(KvbmError):
    """A remote layout cannot be read into this pool (geometry mismatch, bad message, or a
    failed / timed-out NIXL transfer).  Nothing is registered when this is raised."""


class RemoteBlock(msgspec.Struct, array_like=True, frozen=True):
    """One exported block: its identity and where it lives in the owner's layout.

    The hashes are u64 (checked when an export is decoded: a hash outside [0, 2**64) makes
    :meth:`BlockExport.from_bytes` raise :class:`RemoteBlockError`, as ``BlockMeta`` would
    refuse it later).
    """

    sequence_hash: U64
    parent_hash: U64 | None
    prefix_hash: U64
    salt: int
    block_id: int

    def meta(self) -> BlockMeta:
        """Identity as a :class:`BlockMeta`."""
        return BlockMeta(self.sequence_hash, self.parent_hash, self.prefix_hash, self.salt)


class ExportedLayout(msgspec.Struct, frozen=True):
    """What a reader needs to address an owner's pool through NIXL.

    Attributes:
        agent_name: the owner's NIXL agent name.
        agent_metadata: ``get_agent_metadata()`` of the owner's agent.
        reg_descs: ``get_serialized_descs`` of the registered region.
        mem_type: ``"DRAM"`` or ``"VRAM"``.
        dev_id: device id of the region (0 for host memory).
        layout: :meth:`LayoutDescriptor.to_dict` of the pool's layout.
        tier: tier name of the owner's pool (``"g2"``).
    """

    agent_name: str
    agent_metadata: bytes
    reg_descs: bytes
    mem_type: str
    dev_id: int
    layout: dict[str, int | str]
    tier: str

    def descriptor(self) -> LayoutDescriptor:
        """The owner's layout descriptor."""
        return LayoutDescriptor.from_dict(self.layout)


class BlockExport(msgspec.Struct, frozen=True):
    """A pinned set of blocks offered to one reader (see module doc).

    Attributes:
        lease: id to hand back to :meth:`RemoteExporter.release`.
        layout: the owner's exported layout.
        blocks: the exported blocks, in sequence order.
    """

    lease: int
    layout: ExportedLayout
    blocks: list[RemoteBlock]

    def to_bytes(self) -> bytes:
        """MessagePack encoding."""
        return msgspec.msgpack.encode(self)

    @classmethod
    def from_bytes(cls, data: bytes) -> BlockExport:
        """Decode :meth:`to_bytes` output.

        Raises:
            RemoteBlockError: malformed message.
        """
        try:
            return msgspec.msgpack.decode(data, type=cls)
        except msgspec.DecodeError as exc:
            raise RemoteBlockError(f"malformed block export: {exc}") from exc


def _mem(pool: BlockPool) -> tuple[str, int]:
    dev = pool.layout.device
    if dev.type == "cuda":
        return "VRAM", dev.index or 0
    return "DRAM", 0


def _agent(name: str):  # noqa: ANN202 - nixl has no type hints
    from storage_backends.nixl_import import nixl_api  # the build for this machine's CUDA

    nixl_agent, nixl_agent_config = nixl_api()
    return nixl_agent(name, nixl_agent_config(backends=["UCX"]))


_names = itertools.count()


def _unique(prefix: str) -> str:
    return f"{prefix}-{os.getpid()}-{next(_names)}"


def block_ranges(desc: LayoutDescriptor, block_id: int, *, split: bool = False) -> list[tuple[int, int]]:
    """Byte ranges ``(address, length)`` of one block in universal order (layer, outer).

    One range when the block is contiguous (``FullyContiguous``) and ``split`` is false,
    else one per ``(layer, outer)`` page.
    """
    page = desc.config().outer_stride
    start = desc.base_address + desc.byte_offset(block_id, 0, 0)
    if not split and desc.layer_stride == desc.outer_dim * page and desc.outer_stride == page:
        return [(start, desc.num_layers * desc.outer_dim * page)]
    return [
        (desc.base_address + desc.byte_offset(block_id, layer, outer), page)
        for layer in range(desc.num_layers)
        for outer in range(desc.outer_dim)
    ]


class RemoteExporter:
    """Owner side: exposes ``pool`` to remote readers (see module doc).

    Args:
        pool: the pool to export (a prefill worker's G2, or G1).
        name: NIXL agent name prefix (made unique per process).

    Raises:
        RemoteBlockError: NIXL could not register the pool's memory.
    """

    def __init__(self, pool: BlockPool, name: str = "kvbm-export") -> None:
        self.pool = pool
        self.agent_name = _unique(name)
        self._agent = _agent(self.agent_name)
        try:
            self._reg = self._agent.register_memory(pool.layout.storage)
        except Exception as exc:  # noqa: BLE001 - nixl raises plain exceptions
            raise RemoteBlockError(f"cannot register {pool.tier} with NIXL: {exc}") from exc
        mem, dev = _mem(pool)
        self._layout = ExportedLayout(
            agent_name=self.agent_name,
            agent_metadata=self._agent.get_agent_metadata(),
            reg_descs=self._agent.get_serialized_descs(self._reg),
            mem_type=mem,
            dev_id=dev,
            layout=pool.layout.descriptor().to_dict(),
            tier=pool.tier,
        )
        self._leases: dict[int, list[ImmutableBlock]] = {}
        self._next = itertools.count(1)
        self._lock = threading.Lock()
        self._closed = False

    def layout(self) -> ExportedLayout:
        """The exported layout (agent metadata + descriptors)."""
        return self._layout

    def export(self, sequence_hashes: list[int]) -> BlockExport:
        """Pin the longest registered prefix of ``sequence_hashes`` and describe it.

        Returns:
            A :class:`BlockExport`; its blocks stay pinned until :meth:`release` of its
            ``lease`` (an empty export holds nothing).

        Raises:
            RemoteBlockError: the exporter is closed.
        """
        with self._lock:
            if self._closed:
                raise RemoteBlockError("exporter is closed")
            handles = self.pool.match_blocks(sequence_hashes)
            lease = next(self._next)
            if handles:
                self._leases[lease] = handles
        blocks = [
            RemoteBlock(h.meta.sequence_hash, h.meta.parent_hash, h.meta.prefix_hash, h.meta.salt, h.block_id)
            for h in handles
        ]
        return BlockExport(lease=lease, layout=self._layout, blocks=blocks)

    def release(self, lease: int) -> int:
        """Unpin the blocks of ``lease``; returns how many were pinned (0 if unknown)."""
        with self._lock:
            handles = self._leases.pop(lease, [])
        for h in handles:
            h.release()
        return len(handles)

    def leases(self) -> int:
        """Exports not released yet."""
        with self._lock:
            return len(self._leases)

    def close(self) -> None:
        """Release every lease and deregister the memory (idempotent)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            leases = list(self._leases)
        for lease in leases:
            self.release(lease)
        try:
            self._agent.deregister_memory(self._reg)
        except Exception:  # noqa: BLE001 - best effort at shutdown
            pass


class RemoteReader:
    """Reader side: onboards exported blocks into ``pool`` with NIXL READ.

    Args:
        pool: destination pool (a decode worker's G1, or G2).
        name: NIXL agent name prefix (made unique per process).
        timeout_s: longest wait for one transfer.
    """

    def __init__(self, pool: BlockPool, name: str = "kvbm-reader", timeout_s: float = 30.0) -> None:
        self.pool = pool
        self.timeout_s = timeout_s
        self.agent_name = _unique(name)
        self._agent = _agent(self.agent_name)
        try:
            self._reg = self._agent.register_memory(pool.layout.storage)
        except Exception as exc:  # noqa: BLE001
            raise RemoteBlockError(f"cannot register {pool.tier} with NIXL: {exc}") from exc
        self._mem, self._dev = _mem(pool)
        self._remotes: dict[str, str] = {}
        self.bytes_read = 0

    def import_layout(self, layout: ExportedLayout) -> str:
        """Add the owner's agent (once per agent name); returns NIXL's remote name.

        Raises:
            RemoteBlockError: incompatible geometry, or NIXL refused the metadata.
        """
        mine = self.pool.layout.config
        theirs = layout.descriptor()
        if (theirs.num_layers, theirs.outer_dim, theirs.page_size, theirs.inner_dim) != mine.block_shape or theirs.dtype != str(
            mine.dtype
        ).removeprefix("torch."):
            raise RemoteBlockError(
                f"remote layout {theirs.num_layers}x{theirs.outer_dim}x{theirs.page_size}x{theirs.inner_dim} "
                f"{theirs.dtype} does not match local {mine.block_shape} {mine.dtype}"
            )
        name = self._remotes.get(layout.agent_name)
        if name is None:
            try:
                got = self._agent.add_remote_agent(layout.agent_metadata)
            except Exception as exc:  # noqa: BLE001
                raise RemoteBlockError(f"cannot add remote agent {layout.agent_name}: {exc}") from exc
            name = got.decode() if isinstance(got, bytes) else str(got)
            self._remotes[layout.agent_name] = name
        return name

    def onboard(self, export: BlockExport) -> list[ImmutableBlock]:
        """Read every block of ``export`` into fresh blocks of the pool and register them.

        Returns:
            Strong handles, in export order (hashes the pool already holds are not read:
            their existing block is returned).

        Raises:
            RemoteBlockError: geometry mismatch or a failed / timed-out transfer (the
                allocated blocks go back to Reset, nothing is registered).
            PoolExhaustedError: not enough free blocks in the pool.
        """
        if not export.blocks:
            return []
        remote = self.import_layout(export.layout)
        theirs = export.layout.descriptor()
        mine = self.pool.layout.descriptor()
        wanted = [b for b in export.blocks if not self.pool.contains(b.sequence_hash)]
        fresh: list[MutableBlock] = self.pool.allocate(len(wanted))
        try:
            if wanted:
                local_r: list[tuple[int, int, int]] = []
                remote_r: list[tuple[int, int, int]] = []
                for b, mb in zip(wanted, fresh, strict=True):
                    lr = block_ranges(mine, mb.block_id)
                    rr = block_ranges(theirs, b.block_id)
                    if len(lr) != len(rr):  # one side is strided: page by page on both
                        lr = block_ranges(mine, mb.block_id, split=True)
                        rr = block_ranges(theirs, b.block_id, split=True)
                    local_r += [(a, n, self._dev) for a, n in lr]
                    remote_r += [(a, n, export.layout.dev_id) for a, n in rr]
                self._read(local_r, remote_r, remote, export.layout.mem_type)
                self.bytes_read += sum(n for _, n, _ in local_r)
            ready = [mb.init_from(b.meta()) for b, mb in zip(wanted, fresh, strict=True)]
        except BaseException:
            for mb in fresh:
                if not mb.consumed:
                    mb.release()
            raise
        registered = dict(zip([b.sequence_hash for b in wanted], self.pool.register_blocks(ready), strict=True))
        out: list[ImmutableBlock] = []
        for b in export.blocks:
            handle = registered.pop(b.sequence_hash, None)
            if handle is None:
                handle = self.pool.get(b.sequence_hash, touch=True)
                if handle is None:  # evicted between the check and now: read it again
                    raise RemoteBlockError(f"block {b.sequence_hash:#x} vanished from {self.pool.tier} during onboarding")
            out.append(handle)
        return out

    def _read(self, local: list[tuple[int, int, int]], remote: list[tuple[int, int, int]], remote_name: str, remote_mem: str) -> None:
        agent = self._agent
        ldesc = agent.get_xfer_descs(local, self._mem)
        rdesc = agent.get_xfer_descs(remote, remote_mem)
        try:
            handle = agent.initialize_xfer("READ", ldesc, rdesc, remote_name)
        except Exception as exc:  # noqa: BLE001
            raise RemoteBlockError(f"cannot start NIXL READ from {remote_name}: {exc}") from exc
        try:
            state = agent.transfer(handle)
            deadline = time.monotonic() + self.timeout_s
            while state not in ("DONE", "ERR"):
                if time.monotonic() > deadline:
                    raise RemoteBlockError(f"NIXL READ from {remote_name} timed out after {self.timeout_s} s")
                state = agent.check_xfer_state(handle)
            if state == "ERR":
                raise RemoteBlockError(f"NIXL READ from {remote_name} failed")
        finally:
            agent.release_xfer_handle(handle)

    def forget(self, layout: ExportedLayout) -> None:
        """Drop the owner's agent (call when the owner goes away)."""
        name = self._remotes.pop(layout.agent_name, None)
        if name is not None:
            try:
                self._agent.remove_remote_agent(name)
            except Exception:  # noqa: BLE001 - already gone
                pass

    def close(self) -> None:
        """Forget remotes and deregister the pool's memory."""
        for name in list(self._remotes.values()):
            try:
                self._agent.remove_remote_agent(name)
            except Exception:  # noqa: BLE001
                pass
        self._remotes.clear()
        try:
            self._agent.deregister_memory(self._reg)
        except Exception:  # noqa: BLE001
            pass

