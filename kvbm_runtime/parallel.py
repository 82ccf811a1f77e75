"""Parallel modes of a worker group (torch.distributed: gloo on CPU, NCCL on GPU).

* **Tensor parallel** — rank ``r`` of ``W`` holds heads ``[r·H/W, (r+1)·H/W)`` of every
  block: its own :class:`BlockManager` with ``inner_dim / W`` (:func:`shard_config`), the
  same sequence hashes on every rank (the salt does not depend on the shard) and its own
  storage namespace (``/tp<r>of<W>``).  Every operation runs on every rank;
  :class:`TensorParallelWorker` makes the ranks agree on one reusable prefix (the minimum
  over ranks) so they compute exactly the same blocks.
* **Replicated** — every rank holds the whole block (e.g. MLA's latent KV).
  :class:`ReplicatedLoader` lets rank 0 alone read blocks from G2 / G3 and broadcasts them;
  every rank registers them in its G1, so all ranks end with identical blocks and storage
  is read once.
"""

from __future__ import annotations

import datetime
import enum
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from .block import BlockMeta, ImmutableBlock
from .config import RuntimeConfig
from .errors import KvbmError
from .manager import BlockManager, KvFill, ServeResult
from .transfer import host_bytes


class ParallelConfigError(KvbmError, ValueError):
    """Shapes or ranks that do not divide / fit the parallel mode."""


class GroupInitError(KvbmError):
    """A rank could not join its worker group (the message names the setting, the group,
    the rendezvous and how long the attempt ran; the cause is torch's error)."""


class ParallelMode(str, enum.Enum):
    """How a block is spread over the ranks of a worker group."""

    TENSOR = "tensor"
    REPLICATED = "replicated"


def shard_config(config: RuntimeConfig, rank: int, world_size: int, num_heads: int) -> RuntimeConfig:
    """Configuration of tensor-parallel rank ``rank``: ``inner_dim / world_size`` per block.

    Args:
        config: the unsharded configuration (``inner_dim = num_heads · head_dim``).
        rank, world_size: this rank and the group size.
        num_heads: KV heads of the model (must divide by ``world_size``).

    Raises:
        ParallelConfigError: heads not divisible, ``inner_dim`` not ``num_heads · k``, or
            ``rank`` outside ``[0, world_size)``.
    """
    if not 0 <= rank < world_size:
        raise ParallelConfigError(f"rank {rank} outside [0, {world_size})")
    if num_heads % world_size or config.inner_dim % num_heads:
        raise ParallelConfigError(
            f"{num_heads} KV heads (inner_dim {config.inner_dim}) cannot be split over {world_size} ranks"
        )
    data = config.model_dump()
    data.update(inner_dim=config.inner_dim // world_size, tp_rank=rank, tp_size=world_size)
    return RuntimeConfig(**data)


def head_shard(kv: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """Rank ``rank``'s slice of the last (``inner_dim``) dimension of ``kv`` (a view).

    Heads are contiguous in ``inner_dim`` (``[head][head_dim]``), so a rank's heads are
    one slice.

    Raises:
        ParallelConfigError: ``inner_dim`` not divisible by ``world_size``.
    """
    inner = kv.shape[-1]
    if inner % world_size:
        raise ParallelConfigError(f"inner_dim {inner} cannot be split over {world_size} ranks")
    w = inner // world_size
    return kv[..., rank * w : (rank + 1) * w]


def init_group(config: RuntimeConfig, rank: int, world_size: int, init_method: str, backend: str | None = None) -> None:
    """Join the worker group: ``torch.distributed.init_process_group`` with NCCL when CUDA
    is present (else gloo) and ``config.leader_worker_init_timeout_secs``
    (``DYN_KVBM_LEADER_WORKER_INIT_TIMEOUT_SECS``) as the time ranks wait for each other.

    Raises:
        ParallelConfigError: ``rank`` outside ``[0, world_size)``.
        GroupInitError: the rendezvous failed or timed out (torch's ``DistStoreError`` /
            ``DistNetworkError`` / ``DistError`` / ``TimeoutError``, kept as the cause): the
            message names ``DYN_KVBM_LEADER_WORKER_INIT_TIMEOUT_SECS``, the rank, the group
            size, ``init_method``, the backend and the seconds the attempt ran.
    """
    if not 0 <= rank < world_size:
        raise ParallelConfigError(f"rank {rank} outside [0, {world_size})")
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    limit = config.leader_worker_init_timeout_secs
    t0 = time.monotonic()
    try:
        dist.init_process_group(
            backend,
            init_method=init_method,
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=limit),
        )
    except (dist.DistError, TimeoutError, ConnectionError) as exc:
        ran = time.monotonic() - t0
        first = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else ""
        raise GroupInitError(
            f"rank {rank} of {world_size} could not join the worker group at {init_method} ({backend}) after "
            f"{ran:.1f} s (DYN_KVBM_LEADER_WORKER_INIT_TIMEOUT_SECS = {limit:g} s): {type(exc).__name__}: {first}; "
            "check that every rank starts and reaches the same address, or raise the setting if ranks start slowly"
        ) from exc


def _device(group: Any) -> torch.device:
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class TensorParallelWorker:
    """One tensor-parallel rank: its shard's :class:`BlockManager` plus the group.

    Args:
        manager: this rank's manager (configured with :func:`shard_config`).
        group: process group (``None``: the default group).
    """

    def __init__(self, manager: BlockManager, group: Any = None) -> None:
        if not dist.is_initialized():
            raise ParallelConfigError("torch.distributed is not initialized")
        self.manager = manager
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        if manager.config.tp_size != self.world_size or manager.config.tp_rank != self.rank:
            raise ParallelConfigError(
                f"manager is configured as tp rank {manager.config.tp_rank}/{manager.config.tp_size}, "
                f"the group says {self.rank}/{self.world_size}"
            )

    def serve(self, tokens: np.ndarray | Sequence[int], kv_fill: KvFill) -> ServeResult:
        """``manager.serve`` on every rank with one agreed prefix length (the minimum of
        the ranks' lookups), so every rank computes the same blocks (collective call)."""
        local = self.manager.lookup(tokens)
        agreed = torch.tensor([local], dtype=torch.int64, device=_device(self.group))
        dist.all_reduce(agreed, op=dist.ReduceOp.MIN, group=self.group)
        return self.manager.serve(tokens, kv_fill, max_prefix=int(agreed.item()))


@dataclass(slots=True)
class ReplicatedResult:
    """Outcome of :meth:`ReplicatedLoader.onboard` on one rank.

    Attributes:
        blocks: strong G1 handles of the loaded prefix, in order (caller releases).
        prefix: blocks of the request now in every rank's G1.
        loaded_g2, loaded_g3: blocks this rank read from G2 / storage (0 except on rank 0).
        broadcast_bytes: bytes broadcast from rank 0.
    """

    blocks: list[ImmutableBlock] = field(default_factory=list)
    prefix: int = 0
    loaded_g2: int = 0
    loaded_g3: int = 0
    broadcast_bytes: int = 0


class ReplicatedLoader:
    """Replicated mode: rank 0 loads, every rank registers (see module doc).

    Args:
        manager: this rank's manager (same configuration on every rank).
        group: process group (``None``: the default group).
        src: the loading rank (0).
    """

    def __init__(self, manager: BlockManager, group: Any = None, src: int = 0) -> None:
        if not dist.is_initialized():
            raise ParallelConfigError("torch.distributed is not initialized")
        self.manager = manager
        self.group = group
        self.src = src
        self.rank = dist.get_rank(group)
        self.loads_g2 = 0
        self.loads_g3 = 0

    def onboard(self, sequence_hashes: Sequence[int]) -> ReplicatedResult:
        """Bring the longest prefix of ``sequence_hashes`` that rank 0 can find (G1, G2 or
        storage) into every rank's G1 (collective call).

        Every rank first reports the hashes its G1 lacks; rank 0 reads the union once
        (G1 copy, G2 copy or storage read, checksum-verified) and broadcasts the bytes;
        each rank registers what it lacked.  A storage read failure on rank 0 ends the
        prefix there on every rank.

        Returns:
            This rank's :class:`ReplicatedResult`.
        """
        mgr = self.manager
        hashes = list(sequence_hashes)
        metas = [BlockMeta(h, hashes[i - 1] if i else None, hashes[0], mgr.salt) for i, h in enumerate(hashes)]
        lacking = [h for h in hashes if not mgr.g1.contains(h)]
        everyone: list[list[int] | None] = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(everyone, lacking, group=self.group)
        need = set().union(*(set(x or []) for x in everyone))
        result = ReplicatedResult()
        if self.rank == self.src:
            prefix, rows, res = self._read_on_source(metas, need)
            result.loaded_g2, result.loaded_g3 = res
            header: list[Any] = [prefix, [h for h in hashes[:prefix] if h in need]]
        else:
            header = [0, []]
            rows = None
        dist.broadcast_object_list(header, src=self.src, group=self.group)
        prefix, sent = int(header[0]), list(header[1])
        dev = _device(self.group)
        bb = mgr.block_bytes
        data = rows.to(dev) if rows is not None else torch.empty((len(sent), bb), dtype=torch.uint8, device=dev)
        if sent:
            dist.broadcast(data, src=self.src, group=self.group)
        result.broadcast_bytes = len(sent) * bb
        by_hash = {h: k for k, h in enumerate(sent)}
        todo = [i for i in range(prefix) if not mgr.g1.contains(hashes[i])]
        fresh = mgr.g1.allocate(len(todo))
        ready = []
        try:
            for i, mb in zip(todo, fresh, strict=True):
                mgr.g1.layout.write_bytes(mb.block_id, data[by_hash[hashes[i]]])
                ready.append(mb.init_from(metas[i]))
        except BaseException:
            for mb in fresh + ready:
                if not mb.consumed:
                    mb.release()
            raise
        for h in mgr.g1.register_blocks(ready):
            h.release()
        result.blocks = mgr.g1.match_blocks(hashes[:prefix])
        result.prefix = len(result.blocks)
        self.loads_g2 += result.loaded_g2
        self.loads_g3 += result.loaded_g3
        return result

    def _read_on_source(self, metas: list[BlockMeta], need: set[int]) -> tuple[int, torch.Tensor, tuple[int, int]]:
        """Rank 0: the prefix length and the bytes of its blocks some rank lacks."""
        mgr = self.manager
        rows: list[torch.Tensor] = []
        g2_reads = g3_reads = 0
        prefix = 0
        for i, m in enumerate(metas):
            h = m.sequence_hash
            if h not in need:
                if not mgr.g1.contains(h):
                    break
                prefix = i + 1
                continue
            handle = mgr.g1.get(h) or mgr.g2.get(h)
            if handle is not None:
                try:
                    rows.append(host_bytes(handle._pool.layout, handle.block_id).clone())
                    g2_reads += handle.tier == "g2"
                finally:
                    handle.release()
            elif mgr.store is not None and mgr.store.exists([mgr.block_key(h)])[0]:
                try:
                    rows.append(mgr.store.get([mgr.block_key(h)])[0])
                except Exception:  # noqa: BLE001 - the prefix ends at a failed read
                    break
                g3_reads += 1
            else:
                break
            prefix = i + 1
        data = torch.stack(rows) if rows else torch.empty((0, mgr.block_bytes), dtype=torch.uint8)
        return prefix, data, (g2_reads, g3_reads)
