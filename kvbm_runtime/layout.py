"""Block layouts over one torch tensor per pool (docs/design.md §5, KVBM's layout terms).

A block holds ``[num_layers][outer_dim][page_size][inner_dim]`` elements of one dtype:
``outer_dim`` is 2 for separate K and V (1 for MLA-style fused KV), ``page_size`` is the
block size in tokens and ``inner_dim`` is ``num_kv_heads * head_dim``.

Byte geometry (all in bytes):

* ``outer_stride = page_size * inner_dim * itemsize``
* ``layer_stride = outer_dim * outer_stride`` (one layer of one block)
* ``block_bytes  = num_layers * layer_stride`` (KV data of one block, no padding)

``FullyContiguous``: every block is one contiguous region; blocks follow each other at
``block_stride = align_up(num_layers * layer_stride, alignment)``.

``LayerSeparated``: one region per layer; inside a layer, blocks follow each other at
``layer_block_stride = align_up(layer_stride, alignment)``.

Both allocate exactly one ``uint8`` tensor.  :meth:`BlockLayout.block_view` gives the typed
``[num_layers, outer_dim, page_size, inner_dim]`` view of one block (contiguous for
``FullyContiguous``, strided across layers for ``LayerSeparated``); the *universal* format
of a block's bytes (what goes to storage) is that view made contiguous.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Literal

import torch

from storage_backends.memory_budget import MemoryBudgetError, check_allocation

from .errors import CapacityConfigError, LayoutConfigError

LayoutKind = Literal["FullyContiguous", "LayerSeparated"]

_DTYPES: dict[str, torch.dtype] = {
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "uint8": torch.uint8,
}


def dtype_from_name(name: str) -> torch.dtype:
    """``"float16"`` → ``torch.float16``.

    Raises:
        LayoutConfigError: for a name outside :data:`_DTYPES`.
    """
    try:
        return _DTYPES[name]
    except KeyError:
        raise LayoutConfigError(f"unsupported KV dtype {name!r}; use one of {sorted(_DTYPES)}") from None


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float16`` → ``"float16"``."""
    return str(dtype).removeprefix("torch.")


def align_up(value: int, alignment: int) -> int:
    """Smallest multiple of ``alignment`` (a power of two) that is ``>= value``."""
    return (value + alignment - 1) & ~(alignment - 1)


class MemoryKind(str, enum.Enum):
    """Where a pool's tensor lives."""

    DEVICE = "device"
    """CUDA device memory (G1 when CUDA is present)."""
    PINNED = "pinned"
    """Page-locked host memory (G2 when CUDA is present)."""
    SYSTEM = "system"
    """Plain pageable host memory (G1 and G2 without CUDA)."""


@dataclass(frozen=True, slots=True)
class LayoutConfig:
    """Geometry of one block.

    Attributes:
        num_layers: transformer layers (> 0).
        outer_dim: 2 for separate K/V, 1 for fused (> 0).
        page_size: tokens per block (> 0); the block size used for hashing.
        inner_dim: ``num_kv_heads * head_dim`` (> 0).
        dtype: element dtype.
        alignment: byte alignment of block (or per-layer block) starts; a power of two.

    Raises:
        LayoutConfigError: on any invalid field.
    """

    num_layers: int
    outer_dim: int
    page_size: int
    inner_dim: int
    dtype: torch.dtype = torch.float16
    alignment: int = 1

    def __post_init__(self) -> None:
        for name in ("num_layers", "outer_dim", "page_size", "inner_dim", "alignment"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise LayoutConfigError(f"LayoutConfig.{name} must be a positive int, got {value!r}")
        if self.alignment & (self.alignment - 1):
            raise LayoutConfigError(f"LayoutConfig.alignment must be a power of two, got {self.alignment}")
        if not isinstance(self.dtype, torch.dtype):
            raise LayoutConfigError(f"LayoutConfig.dtype must be a torch.dtype, got {self.dtype!r}")

    @property
    def itemsize(self) -> int:
        """Bytes per element."""
        return self.dtype.itemsize

    @property
    def outer_stride(self) -> int:
        """Bytes of one ``[page_size, inner_dim]`` page."""
        return self.page_size * self.inner_dim * self.itemsize

    @property
    def layer_stride(self) -> int:
        """Bytes of one layer of one block (``outer_dim`` pages)."""
        return self.outer_dim * self.outer_stride

    @property
    def block_bytes(self) -> int:
        """Bytes of KV data in one block (no padding); the ``block_size`` of events."""
        return self.num_layers * self.layer_stride

    @property
    def block_shape(self) -> tuple[int, int, int, int]:
        """``(num_layers, outer_dim, page_size, inner_dim)``."""
        return (self.num_layers, self.outer_dim, self.page_size, self.inner_dim)


@dataclass(frozen=True, slots=True)
class LayoutDescriptor:
    """Serializable description of an allocated layout (for remote readers / debugging).

    Attributes:
        kind: ``"FullyContiguous"`` or ``"LayerSeparated"``.
        num_blocks: blocks in the layout.
        num_layers, outer_dim, page_size, inner_dim: block geometry.
        dtype: dtype name (``"float16"``).
        alignment: byte alignment.
        base_address: address of the first byte of the tensor.
        block_stride: bytes between consecutive blocks (within a layer for LayerSeparated).
        layer_stride: bytes between consecutive layers of one block.
        outer_stride: bytes between consecutive outer (K/V) pages.
        total_bytes: bytes of the whole tensor.
        device: torch device string (``"cpu"``, ``"cuda:0"``).
        memory_kind: :class:`MemoryKind` value.
    """

    kind: str
    num_blocks: int
    num_layers: int
    outer_dim: int
    page_size: int
    inner_dim: int
    dtype: str
    alignment: int
    base_address: int
    block_stride: int
    layer_stride: int
    outer_stride: int
    total_bytes: int
    device: str
    memory_kind: str

    def to_dict(self) -> dict[str, int | str]:
        """Plain dict (JSON / msgpack friendly)."""
        return {name: getattr(self, name) for name in self.__slots__}  # type: ignore[attr-defined]

    @classmethod
    def from_dict(cls, data: dict[str, int | str]) -> LayoutDescriptor:
        """Inverse of :meth:`to_dict`.

        Raises:
            LayoutConfigError: missing or extra keys, or a value of the wrong type.
        """
        names = list(cls.__slots__)  # type: ignore[attr-defined]
        missing = [n for n in names if n not in data]
        extra = [k for k in data if k not in names]
        if missing or extra:
            raise LayoutConfigError(f"layout descriptor: missing keys {missing}, unknown keys {extra}")
        text = {"kind", "dtype", "device", "memory_kind"}
        for n in names:
            want = str if n in text else int
            if not isinstance(data[n], want) or isinstance(data[n], bool):
                raise LayoutConfigError(f"layout descriptor field {n!r} must be {want.__name__}, got {data[n]!r}")
        return cls(**data)  # type: ignore[arg-type]

    def config(self) -> LayoutConfig:
        """Block geometry as a :class:`LayoutConfig`."""
        return LayoutConfig(
            num_layers=self.num_layers,
            outer_dim=self.outer_dim,
            page_size=self.page_size,
            inner_dim=self.inner_dim,
            dtype=dtype_from_name(self.dtype),
            alignment=self.alignment,
        )

    def byte_offset(self, block_id: int, layer: int, outer: int) -> int:
        """Offset from ``base_address`` of page ``(block_id, layer, outer)``:
        ``block_id·block_stride + layer·layer_stride + outer·outer_stride`` (valid for both
        layout kinds)."""
        return block_id * self.block_stride + layer * self.layer_stride + outer * self.outer_stride


def default_device(tier: Literal["g1", "g2"]) -> tuple[torch.device, MemoryKind]:
    """Device and memory kind for a tier: G1 on CUDA when present (else CPU), G2 on host
    (pinned when CUDA is present)."""
    if torch.cuda.is_available():
        if tier == "g1":
            return torch.device("cuda", torch.cuda.current_device()), MemoryKind.DEVICE
        return torch.device("cpu"), MemoryKind.PINNED
    return torch.device("cpu"), MemoryKind.SYSTEM


@dataclass(eq=False)
class BlockLayout(ABC):
    """``num_blocks`` blocks of ``config`` geometry in one ``uint8`` tensor.

    Attributes:
        config: block geometry.
        num_blocks: number of blocks (> 0).
        device: torch device of the tensor.
        memory_kind: :class:`MemoryKind` of the tensor.
        storage: the single ``uint8`` tensor backing every block.
        purpose: what the layout is (``"g1"``, ``"g2"``), named when its size is refused.

    Raises:
        CapacityConfigError: ``num_blocks`` x block bytes exceed the memory ``device`` has
            available (checked before allocating, :mod:`storage_backends.memory_budget`).
    """

    config: LayoutConfig
    num_blocks: int
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    memory_kind: MemoryKind = MemoryKind.SYSTEM
    storage: torch.Tensor = field(init=False, repr=False)
    purpose: str = field(default="", compare=False)

    kind: str = field(init=False, default="")

    def __post_init__(self) -> None:
        if not isinstance(self.num_blocks, int) or self.num_blocks <= 0:
            raise LayoutConfigError(f"num_blocks must be a positive int, got {self.num_blocks!r}")
        pin = self.memory_kind is MemoryKind.PINNED
        if self.memory_kind is MemoryKind.DEVICE and self.device.type != "cuda":
            raise LayoutConfigError("MemoryKind.DEVICE needs a CUDA device")
        try:
            check_allocation(f"{(self.purpose or 'block').upper()} pool", self.total_bytes,
                             f"num_blocks={self.num_blocks} x {self.config.block_bytes} bytes per block", self.device)
        except MemoryBudgetError as exc:
            raise CapacityConfigError(str(exc)) from None
        self.storage = torch.zeros(self.total_bytes, dtype=torch.uint8, device=self.device, pin_memory=pin)

    @classmethod
    def for_tier(cls, config: LayoutConfig, num_blocks: int, tier: Literal["g1", "g2"]) -> BlockLayout:
        """Allocate on the tier's default device (see :func:`default_device`)."""
        device, kind = default_device(tier)
        return cls(config, num_blocks, device, kind, purpose=tier)

    @property
    def block_bytes(self) -> int:
        """Bytes of KV data per block."""
        return self.config.block_bytes

    @property
    def has_block_views(self) -> bool:
        """Whether :meth:`block_view` gives a writable view (False only for an
        :class:`ExternalLayout` whose layers are separate tensors)."""
        return True

    @property
    @abstractmethod
    def block_stride(self) -> int:
        """Bytes between the starts of consecutive blocks (within one layer region for
        ``LayerSeparated``)."""

    @property
    @abstractmethod
    def total_bytes(self) -> int:
        """Bytes of the backing tensor."""

    @abstractmethod
    def block_view(self, block_id: int) -> torch.Tensor:
        """Typed ``[num_layers, outer_dim, page_size, inner_dim]`` view of one block.

        Raises:
            IndexError: when ``block_id`` is outside ``[0, num_blocks)``.
        """

    def layer_view(self, block_id: int, layer: int, outer: int) -> torch.Tensor:
        """Typed ``[page_size, inner_dim]`` view of one (block, layer, outer) page."""
        return self.block_view(block_id)[layer, outer]

    def read_bytes(self, block_id: int) -> torch.Tensor:
        """Copy of one block in universal format: a contiguous CPU ``uint8`` tensor of
        ``block_bytes`` bytes (layer-major, then outer, page, inner)."""
        view = self.block_view(block_id)
        return view.contiguous().view(torch.uint8).reshape(-1).to("cpu", copy=True)

    def write_bytes(self, block_id: int, data: torch.Tensor) -> None:
        """Fill one block from ``block_bytes`` bytes in universal format (any device).

        Raises:
            ValueError: when ``data`` does not hold exactly ``block_bytes`` bytes.
        """
        flat = data.reshape(-1)
        if flat.dtype != torch.uint8:
            flat = flat.contiguous().view(torch.uint8)
        if flat.numel() != self.block_bytes:
            raise ValueError(f"block data has {flat.numel()} bytes, layout needs {self.block_bytes}")
        typed = flat.contiguous().view(self.config.dtype).view(self.config.block_shape)
        self.block_view(block_id).copy_(typed)

    def _check(self, block_id: int) -> None:
        if not 0 <= block_id < self.num_blocks:
            raise IndexError(f"block id {block_id} outside [0, {self.num_blocks})")

    def descriptor(self) -> LayoutDescriptor:
        """Serializable description of this allocation."""
        c = self.config
        return LayoutDescriptor(
            kind=self.kind,
            num_blocks=self.num_blocks,
            num_layers=c.num_layers,
            outer_dim=c.outer_dim,
            page_size=c.page_size,
            inner_dim=c.inner_dim,
            dtype=dtype_name(c.dtype),
            alignment=c.alignment,
            base_address=self.storage.data_ptr(),
            block_stride=self.block_stride,
            layer_stride=self._layer_step(),
            outer_stride=c.outer_stride,
            total_bytes=self.total_bytes,
            device=str(self.device),
            memory_kind=self.memory_kind.value,
        )

    @abstractmethod
    def _layer_step(self) -> int:
        """Bytes between layer ``l`` and ``l + 1`` of the same block."""


@dataclass(eq=False)
class FullyContiguous(BlockLayout):
    """Each block is one contiguous ``[num_layers][outer_dim][page_size][inner_dim]`` region."""

    kind: str = field(init=False, default="FullyContiguous")

    @property
    def block_stride(self) -> int:
        return align_up(self.config.num_layers * self.config.layer_stride, self.config.alignment)

    @property
    def total_bytes(self) -> int:
        return self.num_blocks * self.block_stride

    def block_view(self, block_id: int) -> torch.Tensor:
        self._check(block_id)
        start = block_id * self.block_stride
        raw = self.storage[start : start + self.block_bytes]
        return raw.view(self.config.dtype).view(self.config.block_shape)

    def blocks_bytes_view(self) -> torch.Tensor:
        """``[num_blocks, block_stride]`` uint8 view of the whole tensor (batched copies)."""
        return self.storage.view(self.num_blocks, self.block_stride)

    def _layer_step(self) -> int:
        return self.config.layer_stride


@dataclass(eq=False)
class LayerSeparated(BlockLayout):
    """One region per layer; a layer region holds every block's page set for that layer."""

    kind: str = field(init=False, default="LayerSeparated")

    @property
    def block_stride(self) -> int:
        return align_up(self.config.layer_stride, self.config.alignment)

    @property
    def total_bytes(self) -> int:
        return self.config.num_layers * self.num_blocks * self.block_stride

    def block_view(self, block_id: int) -> torch.Tensor:
        self._check(block_id)
        c = self.config
        per_layer = self.storage.view(c.num_layers, self.num_blocks, self.block_stride)
        raw = per_layer[:, block_id, : c.layer_stride]  # [num_layers, layer_stride], strided
        return raw.view(c.dtype).view(c.num_layers, c.outer_dim, c.page_size, c.inner_dim)

    def _layer_step(self) -> int:
        return self.num_blocks * self.block_stride


def make_layout(
    kind: LayoutKind,
    config: LayoutConfig,
    num_blocks: int,
    device: torch.device | None = None,
    memory_kind: MemoryKind | None = None,
    tier: Literal["g1", "g2"] = "g2",
) -> BlockLayout:
    """Allocate a layout of ``kind``; device and memory kind default to the tier's.

    Raises:
        LayoutConfigError: unknown ``kind`` or invalid geometry.
        CapacityConfigError: the pool is larger than the memory its device has available
            (checked before allocating; names the tier, the bytes and ``num_blocks``).
    """
    classes: dict[str, type[BlockLayout]] = {"FullyContiguous": FullyContiguous, "LayerSeparated": LayerSeparated}
    if kind not in classes:
        raise LayoutConfigError(f"unknown layout kind {kind!r}; use one of {sorted(classes)}")
    if device is None or memory_kind is None:
        d, m = default_device(tier)
        device = device or d
        memory_kind = memory_kind or m
    return classes[kind](config, num_blocks, device, memory_kind, purpose=tier)


def block_runs(src_ids: list[int], dst_ids: list[int]) -> list[tuple[int, int, int]]:
    """Split paired id lists into runs ``(src_start, dst_start, length)`` that are
    consecutive on both sides, in order."""
    s0, d0, count = src_ids[0], dst_ids[0], len(src_ids)
    # the common case, a batch that is one run on both sides, checked at C speed
    if src_ids[-1] - s0 == count - 1 and dst_ids[-1] - d0 == count - 1:
        if src_ids == list(range(s0, s0 + count)) and dst_ids == list(range(d0, d0 + count)):
            return [(s0, d0, count)]
    runs: list[tuple[int, int, int]] = []
    n = 1
    for s, d in zip(src_ids[1:], dst_ids[1:]):
        if s == s0 + n and d == d0 + n:
            n += 1
        else:
            runs.append((s0, d0, n))
            s0, d0, n = s, d, 1
    runs.append((s0, d0, n))
    return runs


def copy_blocks(src: BlockLayout, src_ids: list[int], dst: BlockLayout, dst_ids: list[int]) -> None:
    """Copy blocks ``src_ids`` of ``src`` into blocks ``dst_ids`` of ``dst`` (same geometry).

    When both are ``FullyContiguous`` with the same stride, ids are grouped into runs that
    are consecutive on both sides and each run is one slice copy (no gather buffer: the
    bytes move once); otherwise one typed copy per block (works across layouts and
    devices), or per page for an :class:`ExternalLayout` without block views.

    Raises:
        ValueError: different geometry or id lists of different lengths.
    """
    if len(src_ids) != len(dst_ids):
        raise ValueError(f"{len(src_ids)} source ids vs {len(dst_ids)} destination ids")
    if src.config.block_shape != dst.config.block_shape or src.config.dtype != dst.config.dtype:
        raise ValueError("source and destination layouts have different block geometry")
    if not src_ids:
        return
    if isinstance(src, FullyContiguous) and isinstance(dst, FullyContiguous) and src.block_stride == dst.block_stride:
        for s0, d0, n in block_runs(src_ids, dst_ids):
            if s0 < 0 or s0 + n > src.num_blocks or d0 < 0 or d0 + n > dst.num_blocks:
                raise IndexError(f"block ids outside the layouts: {s0}+{n} of {src.num_blocks}, {d0}+{n} of {dst.num_blocks}")
            stride = src.block_stride
            dst.storage[d0 * stride : (d0 + n) * stride].copy_(src.storage[s0 * stride : (s0 + n) * stride], non_blocking=True)
    elif src.has_block_views and dst.has_block_views:
        for s, d in zip(src_ids, dst_ids, strict=True):
            dst.block_view(d).copy_(src.block_view(s), non_blocking=True)
    else:  # an engine cache whose layers are separate tensors: page by page
        c = src.config
        for s, d in zip(src_ids, dst_ids, strict=True):
            for layer in range(c.num_layers):
                for outer in range(c.outer_dim):
                    dst.layer_view(d, layer, outer).copy_(src.layer_view(s, layer, outer), non_blocking=True)
    # copies touching CUDA may still be in flight: the bytes must be there when we return
    for dev in {src.device, dst.device}:
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)


class ExternalLayout(BlockLayout):
    """Blocks held in an engine's own per-layer KV-cache tensors (not allocated here).

    Every layer tensor has shape ``[num_blocks, outer_dim, page_size, inner_dim]`` (vLLM's
    connector hands them over as ``{layer_name: tensor}`` in layer order), one dtype, one
    device.  When the layers are views of one allocation at a constant distance (the usual
    ``kv[l]`` of a ``[num_layers, num_blocks, ...]`` tensor), :meth:`block_view` is a real
    strided view; otherwise blocks are moved page by page through :meth:`layer_view`.

    Args:
        layers: the layer tensors, in layer order.
        alignment: reported alignment (bytes).

    Raises:
        LayoutConfigError: no layers, or layers of different shape / dtype / device, or a
            shape that is not 4-D.
    """

    kind: str = "External"

    def __init__(self, layers: list[torch.Tensor], alignment: int = 1) -> None:  # noqa: D107
        if not layers:
            raise LayoutConfigError("an external layout needs at least one layer tensor")
        first = layers[0]
        if first.dim() != 4:
            raise LayoutConfigError(
                f"layer tensors must be [num_blocks, outer_dim, page_size, inner_dim], got shape {tuple(first.shape)}"
            )
        for i, t in enumerate(layers):
            if t.shape != first.shape or t.dtype != first.dtype or t.device != first.device:
                raise LayoutConfigError(
                    f"layer {i} is {tuple(t.shape)} {t.dtype} on {t.device}; layer 0 is "
                    f"{tuple(first.shape)} {first.dtype} on {first.device}"
                )
        num_blocks, outer, page, inner = (int(x) for x in first.shape)
        self.config = LayoutConfig(len(layers), outer, page, inner, first.dtype, alignment)
        self.num_blocks = num_blocks
        self.device = first.device
        self.memory_kind = MemoryKind.DEVICE if first.device.type == "cuda" else MemoryKind.SYSTEM
        self.layers = list(layers)
        self.storage = first
        self._step = self._uniform_step()

    def _uniform_step(self) -> int | None:
        """Elements between layer l and l+1 when all layers share one storage, else None."""
        layers = self.layers
        if len(layers) == 1:
            return 0
        try:
            base = layers[0].untyped_storage().data_ptr()
            if any(t.untyped_storage().data_ptr() != base for t in layers):
                return None
        except RuntimeError:
            return None
        step = layers[1].storage_offset() - layers[0].storage_offset()
        if step == 0 or any(
            layers[i].storage_offset() - layers[i - 1].storage_offset() != step or layers[i].stride() != layers[0].stride()
            for i in range(1, len(layers))
        ):
            return None
        return step

    @property
    def has_block_views(self) -> bool:
        return self._step is not None

    @property
    def block_stride(self) -> int:
        return self.layers[0].stride(0) * self.config.itemsize

    @property
    def total_bytes(self) -> int:
        return sum(t.numel() for t in self.layers) * self.config.itemsize

    def block_view(self, block_id: int) -> torch.Tensor:
        """Strided ``[num_layers, outer_dim, page_size, inner_dim]`` view of one block.

        Raises:
            IndexError: ``block_id`` out of range.
            LayoutConfigError: the layers are separate tensors (use :meth:`layer_view`).
        """
        self._check(block_id)
        if self._step is None:
            raise LayoutConfigError("layers are separate tensors: no single view of a block")
        t = self.layers[0]
        return torch.as_strided(
            t,
            size=self.config.block_shape,
            stride=(self._step, *t.stride()[1:]),
            storage_offset=t.storage_offset() + block_id * t.stride(0),
        )

    def layer_view(self, block_id: int, layer: int, outer: int) -> torch.Tensor:
        self._check(block_id)
        return self.layers[layer][block_id, outer]

    def read_bytes(self, block_id: int) -> torch.Tensor:
        self._check(block_id)
        pages = [self.layers[layer][block_id] for layer in range(self.config.num_layers)]
        return torch.stack(pages).contiguous().view(torch.uint8).reshape(-1).to("cpu", copy=True)

    def write_bytes(self, block_id: int, data: torch.Tensor) -> None:
        self._check(block_id)
        flat = data.reshape(-1)
        if flat.dtype != torch.uint8:
            flat = flat.contiguous().view(torch.uint8)
        if flat.numel() != self.block_bytes:
            raise ValueError(f"block data has {flat.numel()} bytes, layout needs {self.block_bytes}")
        typed = flat.contiguous().view(self.config.dtype).view(self.config.block_shape)
        for layer in range(self.config.num_layers):
            self.layers[layer][block_id].copy_(typed[layer])

    def _layer_step(self) -> int:
        return (self._step or 0) * self.config.itemsize

    def __repr__(self) -> str:
        return f"ExternalLayout({self.num_blocks} blocks x {self.config.block_shape} {self.config.dtype}, {self.device})"
