"""Operational formats (NHD / HND) and the universal format; serializable layout
descriptors; engine-owned (external) layouts."""

from __future__ import annotations

import json

import pytest
import torch

from kvbm_runtime import LayoutConfig, LayoutConfigError, LayoutDescriptor, copy_blocks, make_layout
from kvbm_runtime.formats import KvFormat, convert, from_universal, to_universal
from kvbm_runtime.layout import ExternalLayout

HEADS, HD, PAGE = 3, 4, 5
SHAPE = (2, 2, PAGE, HEADS * HD)


def test_hnd_page_is_heads_outermost_and_round_trips() -> None:
    # universal block where value encodes (token, head, dim)
    tok = torch.arange(PAGE).view(1, 1, PAGE, 1, 1)
    head = torch.arange(HEADS).view(1, 1, 1, HEADS, 1)
    dim = torch.arange(HD).view(1, 1, 1, 1, HD)
    uni = (100 * tok + 10 * head + dim).expand(2, 2, PAGE, HEADS, HD).reshape(SHAPE).float()
    hnd = from_universal(uni, KvFormat.HND, HEADS)
    assert hnd.shape == SHAPE and hnd.is_contiguous()
    raw = hnd.view(2, 2, HEADS, PAGE, HD)  # memory order of an HND page
    assert raw[1, 0, 2, 4, 3].item() == 100 * 4 + 10 * 2 + 3
    assert raw[0, 1, 0, 1, 0].item() == 100 * 1
    assert torch.equal(to_universal(hnd, KvFormat.HND, HEADS), uni)
    assert torch.equal(convert(hnd, KvFormat.HND, KvFormat.NHD, HEADS), uni)
    assert torch.equal(convert(uni, KvFormat.NHD, KvFormat.HND, HEADS), hnd)
    assert not torch.equal(hnd, uni)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_random_blocks_round_trip_both_ways(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(3)
    block = torch.randn(SHAPE, generator=gen).to(dtype)
    for fmt in KvFormat:
        assert torch.equal(to_universal(from_universal(block, fmt, HEADS), fmt, HEADS), block)
        assert torch.equal(from_universal(to_universal(block, fmt, HEADS), fmt, HEADS), block)
    # NHD is the universal order: the identity, but a copy
    same = to_universal(block, KvFormat.NHD, HEADS)
    assert torch.equal(same, block) and same.data_ptr() != block.data_ptr()


def test_hnd_engine_block_stored_and_onboarded_by_an_nhd_engine() -> None:
    cfg = LayoutConfig(2, 2, PAGE, HEADS * HD, torch.float32)
    hnd_engine = make_layout("LayerSeparated", cfg, 2, tier="g2")
    nhd_engine = make_layout("FullyContiguous", cfg, 2, tier="g2")
    gen = torch.Generator().manual_seed(9)
    truth = torch.randn(SHAPE, generator=gen)  # universal
    hnd_engine.block_view(1).copy_(from_universal(truth, KvFormat.HND, HEADS))
    stored = to_universal(hnd_engine.block_view(1), KvFormat.HND, HEADS)  # what goes to G3
    nhd_engine.write_bytes(0, from_universal(stored, KvFormat.NHD, HEADS).view(torch.uint8))
    assert torch.equal(nhd_engine.block_view(0), truth)


def test_bad_shapes_are_refused() -> None:
    with pytest.raises(LayoutConfigError, match="not divisible into 5 heads"):
        to_universal(torch.zeros(SHAPE), KvFormat.HND, 5)
    with pytest.raises(LayoutConfigError, match="must be"):
        from_universal(torch.zeros(2, 3), KvFormat.NHD, 1)
    with pytest.raises(ValueError):
        to_universal(torch.zeros(SHAPE), "NDH", HEADS)  # type: ignore[arg-type]


@pytest.mark.parametrize("kind", ["FullyContiguous", "LayerSeparated"])
def test_descriptor_serializes_and_addresses_every_page(kind: str) -> None:
    cfg = LayoutConfig(3, 2, 4, 8, torch.float16, alignment=64)
    layout = make_layout(kind, cfg, 5, tier="g2")  # type: ignore[arg-type]
    desc = layout.descriptor()
    back = LayoutDescriptor.from_dict(json.loads(json.dumps(desc.to_dict())))
    assert back == desc and back.config() == cfg
    assert back.memory_kind == layout.memory_kind.value and back.device == str(layout.device)
    for b in (0, 3):
        for layer in range(3):
            for outer in range(2):
                page = layout.layer_view(b, layer, outer)
                assert page.data_ptr() == desc.base_address + desc.byte_offset(b, layer, outer)
    bad = desc.to_dict()
    bad["num_blocks"] = "5"
    with pytest.raises(LayoutConfigError, match="num_blocks"):
        LayoutDescriptor.from_dict(bad)
    del bad["num_blocks"]
    with pytest.raises(LayoutConfigError, match="missing keys"):
        LayoutDescriptor.from_dict(bad)


def test_external_layout_over_one_tensor_and_over_separate_tensors() -> None:
    cfg = LayoutConfig(3, 2, 4, 8, torch.float32)
    kv = torch.randn(3, 6, 2, 4, 8)  # [layers, blocks, 2, page, inner]
    one = ExternalLayout([kv[i] for i in range(3)])
    assert one.has_block_views and one.num_blocks == 6 and one.config == cfg
    assert torch.equal(one.block_view(4), kv[:, 4])
    one.block_view(4).fill_(7.0)  # a real view: writes reach the engine's tensor
    assert torch.all(kv[:, 4] == 7.0)
    separate = ExternalLayout([torch.randn(6, 2, 4, 8) for _ in range(3)])
    assert not separate.has_block_views
    with pytest.raises(LayoutConfigError, match="separate tensors"):
        separate.block_view(0)
    host = make_layout("FullyContiguous", cfg, 4, tier="g2")
    copy_blocks(separate, [5, 1], host, [0, 2])
    assert torch.equal(host.read_bytes(2), separate.read_bytes(1))
    copy_blocks(host, [0], one, [0])
    assert torch.equal(one.read_bytes(0), separate.read_bytes(5))
    separate.write_bytes(3, host.read_bytes(0))
    assert torch.equal(torch.stack([t[3] for t in separate.layers]), host.block_view(0))
    with pytest.raises(LayoutConfigError, match="layer 1"):
        ExternalLayout([torch.zeros(6, 2, 4, 8), torch.zeros(6, 2, 4, 4)])
