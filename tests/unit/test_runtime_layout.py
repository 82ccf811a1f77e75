"""Layouts: geometry, alignment, per-block views, universal byte format, copies."""

from __future__ import annotations

import pytest
import torch

from kvbm_runtime import (
    FullyContiguous,
    LayerSeparated,
    LayoutConfig,
    LayoutConfigError,
    MemoryKind,
    align_up,
    copy_blocks,
    make_layout,
)

CFG = LayoutConfig(num_layers=3, outer_dim=2, page_size=4, inner_dim=6, dtype=torch.float16, alignment=1)


def test_align_up() -> None:
    assert [align_up(v, 64) for v in (0, 1, 63, 64, 65, 200)] == [0, 64, 64, 64, 128, 256]
    assert align_up(7, 1) == 7


@pytest.mark.parametrize(
    "kwargs",
    [
        {"num_layers": 0},
        {"outer_dim": -1},
        {"page_size": 0},
        {"inner_dim": 2.5},
        {"alignment": 3},
        {"alignment": 0},
        {"dtype": "float16"},
    ],
)
def test_invalid_layout_config_raises(kwargs: dict[str, object]) -> None:
    base: dict[str, object] = {"num_layers": 2, "outer_dim": 2, "page_size": 4, "inner_dim": 8}
    base.update(kwargs)
    with pytest.raises(LayoutConfigError):
        LayoutConfig(**base)  # type: ignore[arg-type]


def test_geometry_and_block_stride_alignment() -> None:
    cfg = LayoutConfig(num_layers=3, outer_dim=2, page_size=4, inner_dim=6, alignment=256)
    assert cfg.outer_stride == 4 * 6 * 2
    assert cfg.layer_stride == 2 * 48
    assert cfg.block_bytes == 3 * 96 == 288
    fc = FullyContiguous(cfg, 5)
    assert fc.block_stride == 512  # align_up(3 * 96, 256)
    assert fc.total_bytes == 5 * 512 == fc.storage.numel()
    ls = LayerSeparated(cfg, 5)
    assert ls.block_stride == 256  # align_up(96, 256) per layer
    assert ls.total_bytes == 3 * 5 * 256
    for layout in (fc, ls):
        for b in range(5):
            assert (layout.block_view(b).data_ptr() - layout.storage.data_ptr()) % 256 == 0


@pytest.mark.parametrize("cls", [FullyContiguous, LayerSeparated])
def test_views_are_disjoint_and_typed(cls: type) -> None:
    layout = cls(CFG, 4)
    for b in range(4):
        view = layout.block_view(b)
        assert view.shape == (3, 2, 4, 6) and view.dtype == torch.float16
        view.fill_(b + 1)
    # every block kept its own value: views do not overlap
    for b in range(4):
        assert torch.all(layout.block_view(b) == b + 1)
    # layer view is the (layer, outer) page of the block view
    layout.layer_view(2, 1, 0).fill_(-7)
    assert torch.all(layout.block_view(2)[1, 0] == -7)
    assert torch.all(layout.block_view(2)[1, 1] == 3)
    assert torch.all(layout.block_view(1) == 2)
    with pytest.raises(IndexError):
        layout.block_view(4)


def test_universal_bytes_equal_across_layouts_and_roundtrip() -> None:
    fc = FullyContiguous(CFG, 3)
    ls = LayerSeparated(CFG, 3)
    gen = torch.Generator().manual_seed(0)
    data = torch.randn(CFG.block_shape, generator=gen).to(torch.float16)
    fc.block_view(1).copy_(data)
    ls.block_view(2).copy_(data)
    a, b = fc.read_bytes(1), ls.read_bytes(2)
    assert a.dtype == torch.uint8 and a.numel() == CFG.block_bytes
    assert torch.equal(a, b)
    ls.write_bytes(0, a)
    assert torch.equal(ls.block_view(0), data)
    with pytest.raises(ValueError):
        ls.write_bytes(0, a[:-1])


@pytest.mark.parametrize("src_cls,dst_cls", [(FullyContiguous, FullyContiguous), (FullyContiguous, LayerSeparated), (LayerSeparated, FullyContiguous)])
def test_copy_blocks_moves_exact_blocks(src_cls: type, dst_cls: type) -> None:
    src, dst = src_cls(CFG, 4), dst_cls(CFG, 5)
    for b in range(4):
        src.block_view(b).fill_(10 + b)
    copy_blocks(src, [3, 0, 2], dst, [1, 4, 0])
    assert torch.all(dst.block_view(1) == 13)
    assert torch.all(dst.block_view(4) == 10)
    assert torch.all(dst.block_view(0) == 12)
    assert torch.all(dst.block_view(2) == 0) and torch.all(dst.block_view(3) == 0)
    with pytest.raises(ValueError):
        copy_blocks(src, [0], dst, [0, 1])


def test_make_layout_defaults_and_descriptor() -> None:
    layout = make_layout("LayerSeparated", CFG, 2, tier="g1")
    expected = MemoryKind.DEVICE if torch.cuda.is_available() else MemoryKind.SYSTEM
    assert layout.memory_kind is expected
    d = layout.descriptor().to_dict()
    assert d["kind"] == "LayerSeparated" and d["num_blocks"] == 2 and d["dtype"] == "float16"
    assert d["base_address"] == layout.storage.data_ptr()
    assert d["layer_stride"] == 2 * layout.block_stride
    with pytest.raises(LayoutConfigError):
        make_layout("Paged", CFG, 2)  # type: ignore[arg-type]


def _runs_reference(src_ids: list[int], dst_ids: list[int]) -> list[tuple[int, int, int]]:
    """block_runs spelled out: start a new run wherever either side is not consecutive."""
    runs: list[list[int]] = []
    for s, d in zip(src_ids, dst_ids):
        if runs and s == runs[-1][0] + runs[-1][2] and d == runs[-1][1] + runs[-1][2]:
            runs[-1][2] += 1
        else:
            runs.append([s, d, 1])
    return [tuple(r) for r in runs]  # type: ignore[misc]


@pytest.mark.parametrize(
    ("src", "dst"),
    [
        ([0], [5]),
        (list(range(10)), list(range(3, 13))),  # one run on both sides
        (list(range(10)), [*range(3, 8), *range(20, 25)]),  # destination breaks once
        ([0, 2, 1, 3], [0, 1, 2, 3]),  # first/last look consecutive, the middle is not
        ([5, 6, 7, 9], [1, 2, 3, 4]),
        ([3, 2, 1, 0], [0, 1, 2, 3]),
        ([0, 1, 1, 2], [0, 1, 2, 3]),  # ends consistent with one run, a repeat inside
        ([4, 5, 6], [9, 10, 12]),
    ],
)
def test_block_runs_matches_the_plain_walk(src: list[int], dst: list[int]) -> None:
    from kvbm_runtime.layout import block_runs

    assert block_runs(src, dst) == _runs_reference(src, dst)
