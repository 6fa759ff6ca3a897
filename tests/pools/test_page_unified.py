"""page_unified (SGLang 0.5.23's fused page block) on MHA and MLA pools: SGLang's shape,
attributes and `PageUnifiedLayout`, bytes in SGLang's `page_dims` order, and SGLang's refusals
for what 0.5.23 does not move (the direct backend, page metadata, flat pages). The byte
round trips over every supported pair are in core/test_transfers.py (reference.py's formula)."""

from __future__ import annotations

import pytest
import torch
from hostkv_rs import (
    MHATokenToKVPool,
    MHATokenToKVPoolHost,
    MLATokenToKVPool,
    MLATokenToKVPoolHost,
    _core,
)

P, L, H, D = 4, 3, 4, 8


def mha(groups=2, heads=H, head_dim=D, dtype=torch.bfloat16, layers=L):
    dev = MHATokenToKVPool(16 * P, P, dtype, head_num=heads, head_dim=head_dim, layer_num=layers)
    host = MHATokenToKVPoolHost(dev, 2.0, 0, P, "page_unified", head_group_num=groups)
    return host, dev


def mla(layers=L):
    dev = MLATokenToKVPool(
        16 * P, P, torch.bfloat16, kv_lora_rank=12, qk_rope_head_dim=4, layer_num=layers
    )
    return MLATokenToKVPoolHost(dev, 2.0, 0, P, "page_unified"), dev


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def test_mha_pool_has_sglangs_buffer_and_attributes():
    host, _ = mha()
    pages = host.size // P
    assert tuple(host.kv_buffer.shape) == (pages, 2, L, 2, P, H // 2, D)
    assert host.kv_buffer.is_contiguous()
    layout = host.page_unified_layout
    assert (layout.page_size, layout.layer_num, layout.head_num, layout.head_group_num) == (
        P,
        L,
        H,
        2,
    )
    assert (layout.head_dim, layout.itemsize, layout.is_mla) == (D, 2, False)
    assert layout.page_dims(pages) == tuple(host.kv_buffer.shape)
    assert layout.bytes_per_page * pages == host.kv_buffer.numel() * 2
    assert host.head_group_num == 2
    assert host.token_stride_size == H * D * 2 and host.layout_dim == host.token_stride_size * L
    # SGLang 0.5.23's quirks: no per-layer views, and k_buffer / v_buffer are page blocks 0 and 1.
    assert host.k_data_refs == [] and host.v_data_refs == [] and host.k_data_ptrs is None
    assert torch.equal(bits(host.k_buffer), bits(host.kv_buffer[0]))
    assert torch.equal(bits(host.v_buffer), bits(host.kv_buffer[1]))
    assert not host.is_stride_page_aligned()


def test_mla_pool_is_four_dimensional():
    host, _ = mla()
    pages = host.size // P
    assert tuple(host.kv_buffer.shape) == (pages, L, P, 16)
    assert host.page_unified_layout.is_mla and host.page_unified_layout.components == 1
    ptrs, lens, items = host.get_contiguous_buf_infos()
    base = host.kv_buffer.data_ptr()
    assert ptrs == [base + i * L * P * 32 for i in range(L)]  # page slabs, SGLang's quirk
    assert lens == [L * P * 32] * L and items == [P * 32] * L


@pytest.mark.parametrize("groups", [1, 2, 4])
def test_backup_and_load_use_sglangs_page_dims_order(groups):
    host, dev = mha(groups)
    gen = torch.Generator().manual_seed(groups)
    for t in [*dev.k_buffer, *dev.v_buffer]:
        bits(t).copy_(torch.randint(0, 256, bits(t).shape, dtype=torch.uint8, generator=gen))
    h = host.alloc(2 * P)
    d = torch.arange(3 * P, 5 * P)
    host.backup_from_device_all_layer(dev, h, d, "kernel")
    hpg = H // groups
    for ht, dt in zip(h.tolist(), d.tolist()):
        for layer in range(L):
            for c, plane in enumerate((dev.k_buffer, dev.v_buffer)):
                for g in range(groups):
                    want = plane[layer][dt, g * hpg : (g + 1) * hpg]
                    assert torch.equal(
                        bits(host.kv_buffer[ht // P, g, layer, c, ht % P]), bits(want)
                    )
    for t in [*dev.k_buffer, *dev.v_buffer]:
        t.zero_()
    host.load_to_device_per_layer(dev, h, d, 1, "kernel")
    k, v = dev.k_buffer[1][d], dev.v_buffer[1][d]
    again = host.kv_buffer[h // P, :, 1, :, h % P]  # (n, G, 2, H/G, D)
    assert torch.equal(bits(again[:, :, 0].reshape(k.shape)), bits(k))
    assert torch.equal(bits(again[:, :, 1].reshape(v.shape)), bits(v))
    assert not dev.k_buffer[0].any() and not dev.k_buffer[2].any()


def test_what_sglang_0_5_23_does_not_move_is_refused_with_its_texts():
    host, dev = mha()
    h, d = host.alloc(P), torch.arange(P, 2 * P)
    before = bits(host.kv_buffer).clone()
    with pytest.raises(ValueError, match="^Unsupported layout: page_unified$"):
        host.backup_from_device_all_layer(dev, h, d, "direct")
    with pytest.raises(ValueError, match="^Unsupported layout: page_unified$"):
        host.load_to_device_per_layer(dev, h, d, 0, "direct")
    for call in (
        lambda: host.get_data_page(0),
        lambda: host.set_from_flat_data_page(0, host.get_dummy_flat_data_page()),
        lambda: host.get_page_buffer_meta(h),
        # The layout is refused before any index is read (SGLang's order), only after the
        # whole-pages assert.
        lambda: host.get_page_buffer_meta(h + 1),
        lambda: host.get_page_buffer_meta(h + 10**9),
        lambda: host.get_data_page(-16),
        lambda: host.get_data_page(10**30, flat=False),
        lambda: host.get_data_page("x"),
        lambda: host.set_from_flat_data_page(None, host.get_dummy_flat_data_page()),
    ):
        with pytest.raises(ValueError, match="^Unsupported layout: page_unified$"):
            call()
    with pytest.raises(AssertionError):
        host.get_page_buffer_meta(h[:-1])
    assert torch.equal(bits(host.kv_buffer), before)
    # Layout-independent, as in SGLang: (2, L, P, H, D) zeros.
    assert host.get_dummy_flat_data_page().numel() == 2 * L * P * H * D
    mhost, _ = mla()
    with pytest.raises(ValueError, match="^Unsupported layout: page_unified$"):
        mhost.get_data_page(0)


@pytest.mark.parametrize("groups", [3, 0, -1, None, "two"])
def test_other_layouts_ignore_head_group_num(groups):
    # SGLang stores head_group_num on every MHA pool but reads it only for page_unified.
    dev = MHATokenToKVPool(16 * P, P, torch.bfloat16, head_num=H, head_dim=D, layer_num=L)
    host = MHATokenToKVPoolHost(dev, 2.0, 0, P, "page_first", head_group_num=groups)
    assert host.head_group_num == groups
    assert tuple(host.kv_buffer.shape) == (2, host.size, L, H, D)


@pytest.mark.parametrize(
    ("kwargs", "text"),
    [
        ({"groups": 3}, "head_group_num=3 must divide the pool's 4 kv heads."),
        ({"groups": 4, "head_dim": 2}, "one head group's token row is 4 bytes"),
        ({"groups": 0}, "head_group_num must be positive: PageUnifiedLayout(page_size=4"),
        (
            {"groups": -1},
            (
                "head_group_num must be positive: PageUnifiedLayout(page_size=4, layer_num=3, "
                "head_num=4, head_group_num=-1, head_dim=8, itemsize=2, is_mla=False)"
            ),
        ),
    ],
)
def test_geometry_sglang_refuses_is_refused_with_its_text(kwargs, text):
    with pytest.raises(ValueError) as exc:
        mha(**kwargs)
    assert str(exc.value).startswith(text), str(exc.value)


def test_page_unified_layout_is_sglangs_struct():
    make = _core.PageUnifiedLayout
    lay = make(page_size=4, layer_num=6, head_num=4, head_group_num=2, head_dim=8, itemsize=2)
    assert (lay.group_bytes, lay.layer_bytes, lay.head_group_bytes, lay.bytes_per_page) == (
        32,
        256,
        1536,
        3072,
    )
    assert lay.page_dims(3) == (3, 2, 6, 2, 4, 2, 8)
    assert lay.chunk_span((1, 3), 1) == (1792, 512)
    # Ragged L3 windows of a 61-layer pool tile the page.
    big = make(
        page_size=64,
        layer_num=61,
        head_num=1,
        head_group_num=1,
        head_dim=576,
        itemsize=2,
        is_mla=True,
    )
    spans = [big.chunk_span(r) for r in ((0, 30), (30, 60), (60, 61))]
    assert sum(n for _, n in spans) == big.bytes_per_page and spans[2][0] == 60 * big.layer_bytes
    with pytest.raises(ValueError, match=r"layer range \(3, 3\) is not a non-empty sub-range"):
        lay.chunk_span((3, 3))
    with pytest.raises(ValueError, match=r"head group 2 is outside \[0, 2\)\."):
        lay.chunk_span((0, 1), 2)
    with pytest.raises(ValueError, match="MLA page blocks have no head axis"):
        make(
            page_size=4,
            layer_num=1,
            head_num=2,
            head_group_num=2,
            head_dim=8,
            itemsize=2,
            is_mla=True,
        )
    with pytest.raises(TypeError):
        make(4, 6, 4, 2, 8, 2)  # keyword-only
    with pytest.raises(AttributeError):
        lay.page_size = 8  # frozen
    same = make(page_size=4, layer_num=6, head_num=4, head_group_num=2, head_dim=8, itemsize=2)
    assert lay == same and hash(lay) == hash(same)
    assert "PageUnifiedLayout(page_size=4, layer_num=6" in repr(lay)
