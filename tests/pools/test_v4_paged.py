"""DeepSeekV4PagedHostPool against the contract (host-pool-contract.md §1.5, §2.4, §3.5, §4.1,
§4.4, §4.5). Every expected byte is computed here from the contract's shapes, never by asking the
pool where a row lives."""

from __future__ import annotations

import ctypes
import logging
import re

import numpy as np
import pytest
import torch
from hostkv_rs import DeepSeekV4PagedHostPool, LayerIndexError, LogicalHostPool, TransferError
from hostkv_rs.pools import v4_paged
from hostkv_rs.pools.base import HostKVCache
from hostkv_rs.pools.hisparse import HiSparseHostPoolMixin
from hostkv_rs.sglang import budgets as _budgets
from hypothesis import given, settings
from hypothesis import strategies as st

SUPPORTED = [
    ("kernel", "layer_first"),
    ("kernel", "page_first"),
    ("direct", "layer_first"),
    ("direct", "page_first_direct"),
]
LAYOUTS = ["layer_first", "page_first", "page_first_direct"]
BACKENDS = ["kernel", "direct", "kernel_ascend", "bogus"]
# kernel_ascend has its own refusal (see pools/test_v4_paged.py); every other pair not served
# raises the one V4 text.
UNSUPPORTED = [
    (b, lay)
    for b in BACKENDS
    for lay in LAYOUTS
    if (b, lay) not in SUPPORTED and b != "kernel_ascend"
]

# DSV4 C4 page row as sglang's transfer_cache_dsv4_mla lays it out (see v4_paged.py): 64 tokens,
# values of 576 bytes first, then 8-byte scales, the row padded to a multiple of 576.
C4_P, C4_VALUE, C4_SCALE = 64, 576, 8
C4_ROW = -(-(C4_VALUE + C4_SCALE) * C4_P // 576) * 576
C4_SCALE_AT = C4_VALUE * C4_P


def make_pool(layout="layer_first", L=3, item=656, pages=6, P=4, dev_pages=7, seed=0, **kw):
    g = torch.Generator().manual_seed(seed)
    dev = [
        torch.randint(0, 256, (dev_pages, item), dtype=torch.uint8, generator=g) for _ in range(L)
    ]
    pool = DeepSeekV4PagedHostPool("c4_kv", dev, item, pages, P, layout=layout, **kw)
    return pool, dev


def host_row(pool, row, layer) -> torch.Tensor:
    """Bytes of (page row, layer) read through the contract's kv_buffer shapes."""
    if pool.layout == "layer_first":
        return pool.kv_buffer[layer][row]
    if pool.layout == "page_first":
        return pool.kv_buffer[row, layer]
    return pool.kv_buffer[row, layer, 0]


def host_bytes(pool) -> torch.Tensor:
    """The whole host pool as (Nh, L, item) for comparisons."""
    if pool.layout == "layer_first":
        return torch.stack(list(pool.kv_buffer), dim=1).clone()
    return pool.kv_buffer.reshape(pool.num_host_pages, pool.layer_num, pool.item_bytes).clone()


def poison(pool, seed=1):
    g = torch.Generator().manual_seed(seed)
    for r in range(pool.num_host_pages):
        for layer in range(pool.layer_num):
            host_row(pool, r, layer).copy_(
                torch.randint(0, 256, (pool.item_bytes,), dtype=torch.uint8, generator=g)
            )


def token_indices(pages, P, dtype=torch.int64):
    if not len(pages):
        return torch.empty(0, dtype=dtype)
    return torch.cat([torch.arange(p * P, (p + 1) * P) for p in pages]).to(dtype)


def pick(n, k, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randperm(n, generator=g)[:k].tolist()


def snapshot(pool, dev):
    return host_bytes(pool), [d.clone() for d in dev]


def assert_unchanged(pool, dev, snap):
    host, devs = snap
    assert torch.equal(host_bytes(pool), host)
    for d, s in zip(dev, devs):
        assert torch.equal(d, s)


# ---- construction and attributes -------------------------------------------------------------


@pytest.mark.parametrize("layout", LAYOUTS)
def test_attributes_follow_the_contract(layout):
    L, item, pages, P = 5, 1152, 6, 4
    pool, dev = make_pool(layout, L=L, item=item, pages=pages, P=P)
    assert isinstance(pool, HostKVCache)
    assert pool.size == pages * P  # no +1 page
    assert pool.page_size == P
    assert pool.size_per_token == item
    assert pool.get_size_per_token() == item
    assert pool.get_ksize_per_token() == item
    assert pool.dtype == torch.uint8
    assert pool.layer_num == L
    assert (pool.start_layer, pool.end_layer) == (0, L)
    assert pool.gpu_device == dev[0].device
    assert pool.layout == layout
    assert pool.can_use_jit is False
    assert pool.can_use_write_back_jit is False
    assert pool.scale_kv_buffer is None
    assert pool.scale_item_bytes == 0
    assert pool.device_ptrs.dtype == torch.uint64
    assert pool.device_ptrs.device == dev[0].device
    assert pool.device_ptrs.tolist() == [d.data_ptr() for d in dev]
    if layout == "layer_first":
        assert isinstance(pool.kv_buffer, list) and len(pool.kv_buffer) == L
        base = pool.kv_buffer[0].data_ptr()
        for layer, buf in enumerate(pool.kv_buffer):
            assert buf.shape == (pages, item) and buf.dtype == torch.uint8
            # one region laid out layer-first
            assert buf.data_ptr() == base + layer * pages * item
        assert pool.data_refs == pool.kv_buffer
        assert pool.data_ptrs.dtype == torch.uint64
        assert pool.data_ptrs.tolist() == [b.data_ptr() for b in pool.kv_buffer]
        assert pool.get_hybrid_pool_buffer() == pool.kv_buffer
    else:
        shape = (pages, L, item) if layout == "page_first" else (pages, L, 1, item)
        assert pool.kv_buffer.shape == shape
        assert pool.kv_buffer.is_contiguous()
        assert pool.data_refs == []
        assert pool.data_ptrs is None
        hybrid = pool.get_hybrid_pool_buffer()
        assert len(hybrid) == 1 and hybrid[0] is pool.kv_buffer
    assert pool.init_kv_buffer() is pool.kv_buffer


@pytest.mark.parametrize("layout", ["page_head", None, 5, b"layer_first"])
def test_unsupported_layout_is_refused(layout):
    # SGLang compares the argument with each layout's name and formats what it got.
    with pytest.raises(ValueError) as e:
        make_pool(layout)
    assert str(e.value) == f"Unsupported layout: {layout}"


@pytest.mark.parametrize("name", [None, 5])
def test_a_pool_name_that_is_not_a_string_is_only_formatted(name):
    dev = [torch.zeros((2, 64), dtype=torch.uint8)]
    pool = DeepSeekV4PagedHostPool(name, dev, 64, 2, 1, pin_memory=False)
    dev[0].fill_(7)
    pool.backup_from_device_all_layer(None, torch.arange(2), torch.arange(2), "kernel")
    assert pool.pool_name is name and bool((pool.kv_buffer[0] == 7).all())


def test_memory_check_message(monkeypatch):
    monkeypatch.setattr(_budgets, "host_memory_budget_bytes", lambda: 1_500_000_000)
    dev = [torch.zeros((2, 1000), dtype=torch.uint8) for _ in range(3)]
    with pytest.raises(ValueError) as e:
        DeepSeekV4PagedHostPool("c128_kv", dev, 1000, 1_000_000, 4)
    assert str(e.value) == (
        "Not enough host memory for V4 paged pool c128_kv. "
        "Requesting 3.00 GB but only have 1.50 GB free."
    )
    # exactly at the budget is allowed (requested = L * Nh * item_bytes)
    monkeypatch.setattr(_budgets, "host_memory_budget_bytes", lambda: 3 * 4 * 1000)
    pool = DeepSeekV4PagedHostPool("c128_kv", dev, 1000, 4, 4)
    assert pool.size == 16


@pytest.mark.parametrize(
    "kwargs, text",
    [
        ({"item": 0}, "c4_kv: item_bytes must be positive, got 0"),
        ({"pages": -1}, "c4_kv: num_host_pages must not be negative, got -1"),
        ({"P": 0}, "c4_kv: slot_page_size must be positive, got 0"),
    ],
)
def test_bad_geometry_is_refused(kwargs, text):
    args = {"L": 2, "item": 16, "pages": 2, "P": 4}
    args.update(kwargs)
    dev = [torch.zeros((2, 16), dtype=torch.uint8) for _ in range(args["L"])]
    with pytest.raises(ValueError) as e:
        DeepSeekV4PagedHostPool("c4_kv", dev, args["item"], args["pages"], args["P"])
    assert str(e.value) == text


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
def test_transfers_follow_a_device_buffer_whose_storage_was_swapped(layout):
    # The pool holds the caller's buffers, not views made at construction: after `set_` the
    # buffer's new memory is what a transfer reads and writes, and bounds are checked again.
    pool, dev = make_pool(layout, L=2, item=64, pages=4, dev_pages=5)
    h, d = torch.arange(4, 8), torch.arange(8, 12)  # host page 1, device page 2
    pool.load_to_device_per_layer(None, h, d, 1, "kernel")
    old = dev[1]
    new = torch.zeros_like(old).view(torch.int32)  # the same bytes, another dtype and shape
    old.set_(new.view(torch.uint8).view(old.shape))
    host_row(pool, 1, 1).fill_(7)
    pool.load_to_device_per_layer(None, h, d, 1, "kernel")
    assert bool(dev[1][2].eq(7).all()) and bool(new.view(torch.uint8).view(5, 64)[2].eq(7).all())
    dev[1][2].fill_(9)
    pool.backup_from_device_all_layer(None, h, d, "kernel")
    assert bool(host_row(pool, 1, 1).eq(9).all())
    # A buffer swapped for one too small for the named page is refused, nothing written.
    dev[0].set_(torch.zeros((1, 64), dtype=torch.uint8))
    before = host_bytes(pool)
    with pytest.raises(ValueError, match=r"device index 2 at position 0 is out of range \[0, 1\)"):
        pool.load_to_device_per_layer(None, h, d, 0, "kernel")
    with pytest.raises(ValueError, match="out of range"):
        pool.backup_from_device_all_layer(None, h, d, "kernel")
    assert torch.equal(host_bytes(pool), before) and bool(dev[0].eq(0).all())


@pytest.mark.parametrize("case", ["short_row", "strided", "one_byte"])
def test_device_buffer_that_is_not_whole_rows_is_built_then_refused_by_transfers(case):
    """SGLang builds a V4 pool over any device buffers (its unit tests use one-byte ones): ours is
    built too, with SGLang's staging buffer, and every transfer then refuses those buffers by
    name, changing nothing on either side."""
    buffers = {
        "short_row": [
            torch.zeros((4, 10), dtype=torch.uint8),
            torch.zeros((4, 9), dtype=torch.uint8),
        ],
        "strided": [torch.zeros((4, 20), dtype=torch.uint8)[:, :10]],
        "one_byte": [torch.zeros(1, dtype=torch.uint8) for _ in range(2)],
    }[case]
    refused = {"short_row": 1, "strided": 0, "one_byte": 0}[case]
    layout = "page_first" if case == "one_byte" else "layer_first"
    pool = DeepSeekV4PagedHostPool("c4_kv", buffers, 10, 2, 4, layout=layout)
    if pool.staging_buffer is not None:
        assert pool.staging_buffer.shape == (2, len(buffers), 10)
    host_before = pool._flat.clone()
    device_before = [b.clone() for b in buffers]
    text = f"c4_kv transfer: c4_kv: device buffer {refused} must be contiguous rows of 10 bytes"
    with pytest.raises(ValueError, match=text):
        pool.backup_from_device_all_layer(None, torch.arange(4, 8), torch.arange(4), "kernel")
    with pytest.raises(ValueError, match=text):
        pool.load_to_device_per_layer(None, torch.arange(4, 8), torch.arange(4), 0, "kernel")
    assert torch.equal(pool._flat, host_before)
    assert all(torch.equal(b, d) for b, d in zip(buffers, device_before, strict=True))


def test_device_buffers_of_any_dtype_count_in_bytes():
    dev = [torch.zeros((3, 8), dtype=torch.float32) for _ in range(2)]  # 32-byte rows
    pool = DeepSeekV4PagedHostPool("idx", dev, 32, 2, 1)
    dev[1][2] = torch.arange(8, dtype=torch.float32)
    pool.backup_from_device_all_layer(None, torch.tensor([1]), torch.tensor([2]), "kernel")
    assert torch.equal(pool.kv_buffer[1][1], dev[1][2].view(torch.uint8))


@pytest.mark.parametrize("kind", [list, tuple])
def test_device_buffers_are_kept_as_given(kind):
    # SGLang stores the caller's sequence; a tuple stays a tuple (and still moves pages).
    dev = kind(torch.zeros((3, 8), dtype=torch.uint8) for _ in range(2))
    pool = DeepSeekV4PagedHostPool("idx", dev, 8, 2, 1)
    assert pool.device_buffers is dev
    dev[1][2] = torch.arange(8, dtype=torch.uint8)
    pool.backup_from_device_all_layer(None, torch.tensor([1]), torch.tensor([2]), "kernel")
    assert torch.equal(pool.kv_buffer[1][1], dev[1][2])


# ---- page-aligned transfers ------------------------------------------------------------------


@pytest.mark.parametrize("backend, layout", SUPPORTED)
@pytest.mark.parametrize("L, item, P", [(3, 656, 4), (7, 1152, 1), (5, 13, 64)])
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("engine", ["plan", "emulated"])
def test_page_round_trip_is_byte_exact(
    backend, layout, L, item, P, dtype, engine, monkeypatch, request
):
    # "emulated" runs the CUDA kernels / batched-copy code under the CPU shim.
    if engine == "emulated":
        request.getfixturevalue("emulation_built")
    monkeypatch.setenv("HOSTKV_CPU_ENGINE", engine)
    pages, dev_pages = 6, 7
    pool, dev = make_pool(layout, L=L, item=item, pages=pages, P=P, dev_pages=dev_pages)
    poison(pool)
    host_pages = pick(pages, 4, seed=L)
    dev_src = pick(dev_pages, 4, seed=item)
    before, dev_before = snapshot(pool, dev)

    pool.backup_from_device_all_layer(
        None, token_indices(host_pages, P, dtype), token_indices(dev_src, P, dtype), backend
    )
    expected = before.clone()
    for hp, dp in zip(host_pages, dev_src):
        for layer in range(L):
            expected[hp, layer] = dev[layer][dp]
    assert torch.equal(host_bytes(pool), expected)
    for d, s in zip(dev, dev_before):
        assert torch.equal(d, s)  # a backup never writes the device

    # load every layer back into other device pages
    for d in dev:
        d.fill_(0xA5)
    dev_dst = pick(dev_pages, 4, seed=item + 1)
    for layer in range(L):
        pool.load_to_device_per_layer(
            None,
            token_indices(host_pages, P, dtype),
            token_indices(dev_dst, P, dtype),
            layer,
            backend,
        )
    for layer in range(L):
        want = torch.full((dev_pages, item), 0xA5, dtype=torch.uint8)
        for hp, dp in zip(host_pages, dev_dst):
            want[dp] = expected[hp, layer]
        assert torch.equal(dev[layer], want)
    assert torch.equal(host_bytes(pool), expected)  # a load never writes the host


@pytest.mark.parametrize("backend, layout", SUPPORTED)
def test_load_touches_only_its_layer(backend, layout):
    pool, dev = make_pool(layout, L=5, item=40, pages=4, P=2, dev_pages=4)
    poison(pool)
    snap = snapshot(pool, dev)
    pool.load_to_device_per_layer(None, token_indices([3], 2), token_indices([1], 2), 2, backend)
    for layer in range(5):
        want = snap[1][layer].clone()
        if layer == 2:
            want[1] = host_row(pool, 3, 2)
        assert torch.equal(dev[layer], want)


def test_page_rows_come_from_the_first_token_of_each_page():
    pool, dev = make_pool("layer_first", L=2, item=24, pages=4, P=4, dev_pages=4)
    poison(pool)
    snap = snapshot(pool, dev)
    pool.backup_from_device_all_layer(None, token_indices([2], 4), token_indices([3], 4), "kernel")
    expected = snap[0].clone()
    expected[2, 0], expected[2, 1] = dev[0][3], dev[1][3]
    assert torch.equal(host_bytes(pool), expected)


@pytest.mark.parametrize(
    ("host", "devi", "text"),
    [
        # SGLang reads only the first token of each page; the rest must be that whole page.
        ([4, 5, 6, 1000000000], [0, 1, 2, 3], "host index 1000000000 at position 3 breaks"),
        ([4, 5, 10, 11], [0, 1, 2, 3], "host index 10 at position 2 breaks the run 4..8"),
        ([8, 99, -5, 1000], [12, 13, 14, 15], "host index 99 at position 1 breaks"),
        ([4, 5, 6, 7], [2, 3, 4, 5], "device index 2 at position 0 does not start a page"),
    ],
)
@pytest.mark.parametrize("backend", ["kernel", "direct"])
def test_page_rows_refuse_a_page_that_is_not_whole(host, devi, text, backend):
    pool, dev = make_pool("layer_first", L=2, item=24, pages=4, P=4, dev_pages=4)
    poison(pool)
    snap = snapshot(pool, dev)
    h, d = torch.tensor(host), torch.tensor(devi)
    with pytest.raises(ValueError, match=text):
        pool.backup_from_device_all_layer(None, h, d, backend)
    with pytest.raises(ValueError, match=text):
        pool.load_to_device_per_layer(None, h, d, 1, backend)
    assert_unchanged(pool, dev, snap)


def test_list_indices_are_accepted():
    pool, dev = make_pool("page_first", L=2, item=32, pages=3, P=2, dev_pages=3)
    pool.backup_from_device_all_layer(None, [4, 5], [0, 1], "kernel")
    assert torch.equal(pool.kv_buffer[2, 1], dev[1][0])


@settings(max_examples=40, deadline=None)
@given(
    pair=st.sampled_from(SUPPORTED),
    L=st.integers(1, 6),
    item=st.integers(1, 300),
    P=st.sampled_from([1, 2, 3, 8]),
    data=st.data(),
)
def test_page_transfers_match_a_reference_model(pair, L, item, P, data):
    backend, layout = pair
    pages, dev_pages = 5, 6
    pool, dev = make_pool(layout, L=L, item=item, pages=pages, P=P, dev_pages=dev_pages)
    poison(pool)
    k = data.draw(st.integers(1, pages))
    host_pages = data.draw(st.permutations(range(pages)))[:k]
    dev_src = data.draw(st.lists(st.integers(0, dev_pages - 1), min_size=k, max_size=k))
    dtype = data.draw(st.sampled_from([torch.int32, torch.int64]))
    expected = host_bytes(pool)
    pool.backup_from_device_all_layer(
        None, token_indices(host_pages, P, dtype), token_indices(dev_src, P, dtype), backend
    )
    for hp, dp in zip(host_pages, dev_src):
        for layer in range(L):
            expected[hp, layer] = dev[layer][dp]
    assert torch.equal(host_bytes(pool), expected)

    layer = data.draw(st.integers(0, L - 1))
    dev_dst = data.draw(st.permutations(range(dev_pages)))[:k]
    want = [d.clone() for d in dev]
    for hp, dp in zip(host_pages, dev_dst):
        want[layer][dp] = expected[hp, layer]
    pool.load_to_device_per_layer(
        None, token_indices(host_pages, P, dtype), token_indices(dev_dst, P, dtype), layer, backend
    )
    for d, w in zip(dev, want):
        assert torch.equal(d, w)


# ---- token-granular transfers (DSV4 C4 page rows) --------------------------------------------


def c4_copy(dst: torch.Tensor, dst_tok: int, src: torch.Tensor, src_tok: int):
    """sglang transfer_cache_dsv4_mla for one token of one layer: value and scale segments."""
    dr, ds = divmod(dst_tok, C4_P)
    sr, ss = divmod(src_tok, C4_P)
    dst[dr, ds * C4_VALUE : (ds + 1) * C4_VALUE] = src[sr, ss * C4_VALUE : (ss + 1) * C4_VALUE]
    d0, s0 = C4_SCALE_AT + ds * C4_SCALE, C4_SCALE_AT + ss * C4_SCALE
    dst[dr, d0 : d0 + C4_SCALE] = src[sr, s0 : s0 + C4_SCALE]


@pytest.mark.parametrize("backend", ["kernel", "direct"])
@pytest.mark.parametrize("count", [1, 37, 65, 127])
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("engine", ["plan", "emulated"])
def test_token_granular_round_trip_is_byte_exact(
    backend, count, dtype, engine, monkeypatch, request
):
    if engine == "emulated":
        request.getfixturevalue("emulation_built")
    monkeypatch.setenv("HOSTKV_CPU_ENGINE", engine)
    L, pages, dev_pages = 3, 3, 4
    assert C4_ROW == 37440
    pool, dev = make_pool("layer_first", L=L, item=C4_ROW, pages=pages, P=C4_P, dev_pages=dev_pages)
    poison(pool)
    host_tok = pick(pages * C4_P, count, seed=count)
    dev_tok = pick(dev_pages * C4_P, count, seed=count + 1)
    before, dev_before = snapshot(pool, dev)

    pool.backup_from_device_all_layer(
        None, torch.tensor(host_tok, dtype=dtype), torch.tensor(dev_tok, dtype=dtype), backend
    )
    expected = [before[:, layer].clone() for layer in range(L)]
    for ht, dt in zip(host_tok, dev_tok):
        for layer in range(L):
            c4_copy(expected[layer], ht, dev[layer], dt)
    for layer in range(L):
        assert torch.equal(pool.kv_buffer[layer], expected[layer])
        assert torch.equal(dev[layer], dev_before[layer])

    for d in dev:
        d.fill_(0x3C)
    for layer in (2, 0):
        pool.load_to_device_per_layer(
            None,
            torch.tensor(host_tok, dtype=dtype),
            torch.tensor(dev_tok, dtype=dtype),
            layer,
            backend,
        )
    for layer in range(L):
        want = torch.full((dev_pages, C4_ROW), 0x3C, dtype=torch.uint8)
        if layer != 1:
            for ht, dt in zip(host_tok, dev_tok):
                c4_copy(want, dt, expected[layer], ht)
        assert torch.equal(dev[layer], want)


def test_token_granular_leaves_padding_alone():
    pool, dev = make_pool("layer_first", L=1, item=C4_ROW, pages=1, P=C4_P, dev_pages=1)
    for d in dev:
        d.fill_(0xFF)
    pool.kv_buffer[0].zero_()
    pool.backup_from_device_all_layer(None, torch.arange(63), torch.arange(63), "direct")
    row = pool.kv_buffer[0][0]
    assert row[: 63 * C4_VALUE].eq(0xFF).all()
    assert row[63 * C4_VALUE : C4_SCALE_AT].eq(0).all()  # token 63 not moved
    assert row[C4_SCALE_AT : C4_SCALE_AT + 63 * C4_SCALE].eq(0xFF).all()
    assert row[C4_SCALE_AT + 63 * C4_SCALE :].eq(0).all()  # its scale and the padding


class _ChangingIndex:
    """An int-like whose `__index__` gives `values` in turn (then the last one)."""

    def __init__(self, *values):
        self.values, self.calls = values, 0

    def __index__(self):
        self.calls += 1
        return self.values[min(self.calls, len(self.values)) - 1]


def test_token_granular_load_reads_its_layer_id_once():
    # A token's value and its scale are two copies: both go to the layer the one read names.
    pool, dev = make_pool("layer_first", L=2, item=C4_ROW, pages=1, P=C4_P, dev_pages=1)
    for layer in range(2):
        pool.kv_buffer[layer].fill_(layer + 1)
    for d in dev:
        d.zero_()
    layer_id = _ChangingIndex(0, 1, 1)
    pool.load_to_device_per_layer(None, torch.tensor([3]), torch.tensor([3]), layer_id, "kernel")
    assert layer_id.calls == 1
    value, scale = dev[0][0, 3 * C4_VALUE], dev[0][0, C4_SCALE_AT + 3 * C4_SCALE]
    assert (int(value), int(scale)) == (1, 1) and not dev[1].any()


@pytest.mark.parametrize(
    "layout, backend", [("page_first", "kernel"), ("page_first_direct", "direct")]
)
def test_token_granular_needs_layer_first(layout, backend):
    pool, dev = make_pool(layout, L=2, item=C4_ROW, pages=2, P=C4_P, dev_pages=2)
    snap = snapshot(pool, dev)
    for call in (
        lambda: pool.backup_from_device_all_layer(None, torch.arange(3), torch.arange(3), backend),
        lambda: pool.load_to_device_per_layer(None, torch.arange(3), torch.arange(3), 0, backend),
    ):
        with pytest.raises(ValueError) as e:
            call()
        assert str(e.value) == (
            f"Unsupported V4 paged host layout/backend: {layout}/{backend} (single tokens move "
            "only in layer_first pools; whole pages of slot_page_size indices move in every "
            "layout)"
        )
    assert_unchanged(pool, dev, snap)


def test_token_granular_on_a_non_c4_row_is_refused():
    pool, dev = make_pool("layer_first", L=2, item=656, pages=2, P=4, dev_pages=2)
    snap = snapshot(pool, dev)
    with pytest.raises(ValueError) as e:
        pool.backup_from_device_all_layer(None, torch.arange(3), torch.arange(3), "kernel")
    assert str(e.value) == (
        "c4_kv token-granular transfers need the DSV4 C4 page row (slot_page_size=64, "
        "item_bytes=37440), got slot_page_size=4, item_bytes=656"
    )
    assert_unchanged(pool, dev, snap)


@pytest.mark.parametrize(
    "host, devi, text",
    [
        ([5, 3 * C4_P], [0, 1], "host token indices must lie in [0, 192), got min=5, max=192"),
        ([-1, 2], [0, 1], "host token indices must lie in [0, 192), got min=-1, max=2"),
        ([0, 1], [0, 4 * C4_P], "device token indices must lie in [0, 256), got min=0, max=256"),
    ],
)
def test_token_granular_out_of_range_changes_nothing(host, devi, text):
    pool, dev = make_pool("layer_first", L=2, item=C4_ROW, pages=3, P=C4_P, dev_pages=4)
    snap = snapshot(pool, dev)
    # The core's refusal, of the class every other path raises, naming the caller's tokens.
    with pytest.raises(TransferError) as e:
        pool.backup_from_device_all_layer(None, torch.tensor(host), torch.tensor(devi), "kernel")
    assert str(e.value) == f"token-granular transfer: {text}"
    assert e.value.kind == "token_out_of_range"
    with pytest.raises(TransferError, match="token indices must lie"):
        pool.load_to_device_per_layer(None, torch.tensor(host), torch.tensor(devi), 1, "direct")
    assert_unchanged(pool, dev, snap)


@pytest.mark.parametrize("call", ["backup_tokens", "backup", "load"])
def test_token_granular_into_a_buffer_swapped_for_one_not_whole_page_rows_changes_nothing(call):
    # 66 value rows (38016 bytes) are whole value rows and whole scale rows, but not whole C4
    # page rows: the values of token 64 would fit, its scales would not. Nothing moves.
    pool, dev = make_pool("layer_first", L=2, item=C4_ROW, pages=2, P=C4_P, dev_pages=2)
    h = d = torch.tensor([64, 3])
    pool.backup_tokens_from_device_all_layer(h, d)
    dev[1].set_(torch.full((66 * C4_VALUE,), 0xAB, dtype=torch.uint8))
    snap = snapshot(pool, dev)
    with pytest.raises(ValueError, match="38016 bytes are not whole rows of 37440 bytes"):
        if call == "backup_tokens":
            pool.backup_tokens_from_device_all_layer(h, d)
        elif call == "backup":
            pool.backup_from_device_all_layer(None, h, d, "kernel")
        else:
            pool.load_to_device_per_layer(None, h, d, 1, "direct")
    assert_unchanged(pool, dev, snap)


# ---- refusals ---------------------------------------------------------------------------------


@pytest.mark.parametrize("backend, layout", UNSUPPORTED)
def test_unsupported_pairs_are_refused_before_any_byte_moves(backend, layout):
    pool, dev = make_pool(layout, L=3, item=48, pages=4, P=2, dev_pages=4)
    poison(pool)
    snap = snapshot(pool, dev)
    text = f"Unsupported V4 paged host layout/backend: {layout}/{backend}"
    with pytest.raises(ValueError) as e:
        pool.backup_from_device_all_layer(
            None, token_indices([1], 2), token_indices([2], 2), backend
        )
    assert str(e.value) == text
    with pytest.raises(ValueError) as e:
        pool.load_to_device_per_layer(
            None, token_indices([1], 2), token_indices([2], 2), 1, backend
        )
    assert str(e.value) == text
    assert_unchanged(pool, dev, snap)


@pytest.mark.parametrize("backend, layout", SUPPORTED)
def test_length_mismatch_is_refused(backend, layout):
    pool, dev = make_pool(layout, L=2, item=48, pages=4, P=2, dev_pages=4)
    snap = snapshot(pool, dev)
    with pytest.raises(ValueError) as e:
        pool.backup_from_device_all_layer(None, torch.arange(4), torch.arange(2), backend)
    assert str(e.value) == "c4_kv transfer index size mismatch: host=4, device=2"
    # The same class and fields as every other pool's length refusal, with SGLang's V4 text.
    assert isinstance(e.value, TransferError)
    assert (e.value.kind, e.value.host_len, e.value.device_len) == ("length_mismatch", 4, 2)
    with pytest.raises(ValueError) as e:
        pool.load_to_device_per_layer(None, torch.arange(2), torch.arange(6), 0, backend)
    assert str(e.value) == "c4_kv transfer index size mismatch: host=2, device=6"
    assert (e.value.kind, e.value.host_len, e.value.device_len) == ("length_mismatch", 2, 6)
    assert_unchanged(pool, dev, snap)


@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_or_missing_indices_are_a_no_op(backend):
    # Emptiness is checked before the layout/backend pair, as in sglang.
    pool, dev = make_pool("page_first", L=2, item=48, pages=4, P=2, dev_pages=4)
    snap = snapshot(pool, dev)
    empty = torch.empty(0, dtype=torch.int64)
    pool.backup_from_device_all_layer(None, empty, empty, backend)
    pool.load_to_device_per_layer(None, empty, empty, 0, backend)
    pool.backup_from_device_all_layer(None, None, empty, backend)
    pool.load_to_device_per_layer(None, empty, None, 0, backend)
    assert_unchanged(pool, dev, snap)


@pytest.mark.parametrize("backend, layout", SUPPORTED)
@pytest.mark.parametrize(
    "host_pages, dev_pages_",
    [([0, 4], [0, 1]), ([0, 1], [1, 4]), ([-1, 0], [0, 1])],
)
def test_out_of_range_pages_change_nothing(backend, layout, host_pages, dev_pages_):
    pool, dev = make_pool(layout, L=3, item=40, pages=4, P=2, dev_pages=4)
    poison(pool)
    snap = snapshot(pool, dev)
    h, d = token_indices(host_pages, 2), token_indices(dev_pages_, 2)
    with pytest.raises(ValueError):
        pool.backup_from_device_all_layer(None, h, d, backend)
    with pytest.raises(ValueError):
        pool.load_to_device_per_layer(None, h, d, 1, backend)
    assert_unchanged(pool, dev, snap)


@pytest.mark.parametrize("layer", [-1, 3, 100])
def test_bad_layer_id_changes_nothing(layer):
    pool, dev = make_pool("layer_first", L=3, item=40, pages=4, P=2, dev_pages=4)
    snap = snapshot(pool, dev)
    with pytest.raises(ValueError) as e:
        pool.load_to_device_per_layer(
            None, token_indices([0], 2), token_indices([0], 2), layer, "kernel"
        )
    assert str(e.value) == f"c4_kv layer_id {layer} out of range [0, 3)"
    assert_unchanged(pool, dev, snap)


def test_backup_bounds_use_the_smallest_device_buffer():
    dev = [torch.zeros((6, 16), dtype=torch.uint8), torch.zeros((3, 16), dtype=torch.uint8)]
    pool = DeepSeekV4PagedHostPool("c4_kv", dev, 16, 4, 1)
    with pytest.raises(ValueError):
        pool.backup_from_device_all_layer(None, torch.tensor([0]), torch.tensor([4]), "kernel")
    # a load reads only its own layer's buffer, so layer 0 may use row 4
    pool.kv_buffer[0][1].fill_(7)
    pool.load_to_device_per_layer(None, torch.tensor([1]), torch.tensor([4]), 0, "direct")
    assert dev[0][4].eq(7).all()
    with pytest.raises(ValueError):
        pool.load_to_device_per_layer(None, torch.tensor([1]), torch.tensor([4]), 1, "direct")


# ---- allocator --------------------------------------------------------------------------------


def test_alloc_rounds_up_to_whole_pages_fifo():
    pool, _ = make_pool(pages=8, P=4)
    assert pool.available_size() == 32
    first = pool.alloc(5)
    assert first.tolist() == list(range(8))
    assert pool.alloc(0).numel() == 0
    assert pool.alloc(4).tolist() == list(range(8, 12))
    assert pool.alloc_page(2).tolist() == list(range(12, 20))
    assert pool.available_size() == 12
    assert pool.alloc(13) is None  # rounds to 16 > 12
    assert pool.available_size() == 12
    assert pool.alloc(12).tolist() == list(range(20, 32))
    assert pool.alloc(1) is None
    with pytest.raises(ValueError):
        pool.alloc(-4)


def test_lazy_release_order():
    pool, _ = make_pool(pages=8, P=4)
    pool.alloc(8)
    # free has no alignment check and returns the count
    assert pool.free(torch.tensor([0, 1, 2])) == 3
    assert pool.free(torch.tensor([], dtype=torch.int64)) == 0
    assert pool.free(torch.tensor([4, 5, 6, 7, 3], dtype=torch.int32)) == 5
    assert pool.num_release_slots == 8 and len(pool.release_slots) == 2
    assert pool.available_size() == 32  # released slots count before they are merged
    # the initial free list comes first, released chunks follow in release order
    assert pool.alloc(24).tolist() == list(range(8, 32))
    assert pool.num_release_slots == 8  # not merged: the free list was long enough
    assert pool.alloc(4).tolist() == [0, 1, 2, 4]
    assert pool.release_slots == [] and pool.num_release_slots == 0
    assert pool.alloc(4).tolist() == [5, 6, 7, 3]
    assert pool.alloc(4) is None


def test_allocator_of_a_pool_made_with_new():
    """SGLang's own unit tests build a V4 pool with `__new__` and set only `size`,
    `slot_page_size` and `lock`: clear, alloc (rounded up to whole page rows) and the lazy free
    must work from those alone."""
    import threading

    pool = DeepSeekV4PagedHostPool.__new__(DeepSeekV4PagedHostPool)
    pool.size, pool.slot_page_size, pool.lock = 8, 2, threading.RLock()
    pool.clear()
    assert pool.free(torch.empty(0, dtype=torch.int64)) == 0
    taken = pool.alloc(6)
    front = pool.free_slots
    pool.free(taken[:2])
    assert pool.free_slots is front  # parked, not merged
    assert (pool.num_release_slots, pool.available_size()) == (2, 4)
    assert pool.alloc(2).tolist() == [6, 7]
    assert pool.alloc(2).tolist() == [0, 1]  # the free list ran out: the parked chunk merged
    assert (pool.num_release_slots, pool.release_slots, pool.available_size()) == (0, [], 0)
    with pytest.raises(AssertionError, match="Double-free"):
        pool.free(torch.tensor([0, 0]))
    pool.clear()
    assert len(pool.alloc(1)) == 2


def test_dummy_flat_page_of_a_pool_made_with_new():
    # From SGLang's own attributes alone, as its method reads them.
    pool = DeepSeekV4PagedHostPool.__new__(DeepSeekV4PagedHostPool)
    pool.layer_num, pool.item_bytes, pool.dtype = 3, 40, torch.uint8
    pool.device, pool.pin_memory = "cpu", False
    page = pool.get_dummy_flat_data_page()
    assert (page.shape, page.dtype, bool(page.any())) == ((120,), torch.uint8, False)


def test_page_aligned_refusal_of_a_pool_made_with_new():
    """A page-aligned-only pool made with `__new__` (SGLang's unit tests set `pool_name`,
    `slot_page_size`, `layer_num`, `page_aligned_only`) refuses a partial page before it looks
    at anything else."""
    pool = DeepSeekV4PagedHostPool.__new__(DeepSeekV4PagedHostPool)
    pool.pool_name, pool.slot_page_size, pool.layer_num = "c4_indexer", 4, 1
    pool.page_aligned_only = True
    three = torch.arange(3, dtype=torch.int64)
    with pytest.raises(ValueError, match="c4_indexer expects page-aligned indices") as e:
        pool.backup_from_device_all_layer(None, three, three, "direct")
    assert isinstance(e.value, TransferError)
    assert (e.value.kind, e.value.len, e.value.page_size) == ("partial_page", 3, 4)
    with pytest.raises(ValueError, match="page-aligned"):
        pool.load_to_device_per_layer(None, three, three, 0, "direct")


def test_a_pool_made_with_new_says_why_a_whole_page_call_cannot_move():
    """Past the refusals SGLang makes first, a pool made with `__new__` has no device side:
    the message says so, not only that there are no page rows."""
    pool = DeepSeekV4PagedHostPool.__new__(DeepSeekV4PagedHostPool)
    pool.pool_name, pool.slot_page_size, pool.layer_num = "c4", 2, 2
    pool.kv_buffer = torch.zeros(4, 2, 4, dtype=torch.uint8)
    four = torch.arange(4, dtype=torch.int64)
    with pytest.raises(ValueError, match="c4 transfer: .*built without its constructor"):
        pool.backup_from_device_all_layer(None, four, four, "kernel")
    assert not pool.kv_buffer.any()


def test_page_alignment_follows_the_flag_as_it_is_at_the_call():
    """The page-alignment refusal reads the pool's `page_aligned_only` when the call is made, so a
    flag set after construction (as SGLang's unit tests set it) takes effect."""
    pool, dev = make_pool(P=4)
    three = torch.arange(3, dtype=torch.int64)
    pool.page_aligned_only = True
    before = [t.clone() for t in dev]
    for call in (
        lambda: pool.backup_from_device_all_layer(None, three, three, "direct"),
        lambda: pool.load_to_device_per_layer(None, three, three, 0, "direct"),
        lambda: pool.backup_tokens_from_device_all_layer(three, three),
    ):
        with pytest.raises(ValueError, match="c4_kv expects page-aligned indices"):
            call()
    assert all(torch.equal(a, b) for a, b in zip(dev, before))


@pytest.mark.parametrize(
    "flag, refused", [(0, False), (None, False), (1, True), (torch.tensor(True), True)]
)
def test_a_flag_set_later_is_read_for_its_truth_as_sglang_reads_it(flag, refused):
    """SGLang tests `if self.page_aligned_only`: any value a caller assigns later counts by its
    truth, and a whole-page call moves whatever the flag."""
    pool, _ = make_pool(P=4)
    pool.page_aligned_only = flag
    four, three = torch.arange(4, dtype=torch.int64), torch.arange(3, dtype=torch.int64)
    pool.backup_from_device_all_layer(None, four, four, "direct")
    pool.load_to_device_per_layer(None, four, four, 0, "direct")
    if refused:
        with pytest.raises(ValueError, match="c4_kv expects page-aligned indices"):
            pool.backup_tokens_from_device_all_layer(three, three)
    else:  # past the alignment check, to the token path (which needs C4 rows: not these)
        with pytest.raises(ValueError, match="token-granular transfers need the DSV4 C4 page"):
            pool.backup_tokens_from_device_all_layer(three, three)


@pytest.mark.parametrize("layer_id", [np.uint64(2**64 - 1), 2**70, torch.tensor(7)])
def test_a_load_layer_past_the_pool_names_its_value(layer_id):
    pool, _ = make_pool(L=2, P=4)
    four = torch.arange(4, dtype=torch.int64)
    with pytest.raises(LayerIndexError, match=rf"c4_kv layer_id {int(layer_id)} out of range"):
        pool.load_to_device_per_layer(None, four, four, layer_id, "direct")


def test_single_released_chunk_is_adopted():
    pool, _ = make_pool(pages=2, P=4)
    pool.alloc(8)
    chunk = torch.tensor([4, 5, 6, 7, 0, 1, 2, 3])
    pool.free(chunk)
    assert pool.alloc(8).tolist() == chunk.tolist()


def test_free_out_of_range_is_refused_and_clear_resets():
    pool, _ = make_pool(pages=2, P=4)
    pool.alloc(8)
    with pytest.raises(ValueError) as e:
        pool.free(torch.tensor([1, 8]))
    assert str(e.value) == "c4_kv free: indices must lie in [0, 8), got min=1, max=8"
    assert pool.num_release_slots == 0
    pool.clear()
    assert pool.available_size() == 8 and pool.free_slots.tolist() == list(range(8))
    assert pool.release_slots == []


# ---- flat data pages and zero-copy metadata ---------------------------------------------------


@pytest.mark.parametrize("layout", LAYOUTS)
def test_flat_data_pages(layout):
    L, item, P = 3, 24, 4
    pool, _ = make_pool(layout, L=L, item=item, pages=5, P=P)
    poison(pool)
    dummy = pool.get_dummy_flat_data_page()
    assert dummy.shape == (L * item,) and dummy.dtype == torch.uint8 and not dummy.any()

    page = torch.randint(0, 256, (L * item,), dtype=torch.uint8)
    before = host_bytes(pool)
    pool.set_from_flat_data_page(2 * P, page)
    expected = before.clone()
    expected[2] = page.view(L, item)
    assert torch.equal(host_bytes(pool), expected)

    got = pool.get_data_page(2 * P + 3)  # any token of the page names the page
    assert torch.equal(got, page)
    raw = pool.get_data_page(2 * P, flat=False)
    want_shape = {
        "layer_first": (L, item),
        "page_first": (L, item),
        "page_first_direct": (L, 1, item),
    }
    assert raw.shape == want_shape[layout]
    got.fill_(0)
    # layer_first stacks a copy; page layouts hand out a view of the row
    assert host_bytes(pool)[2].eq(0).all() == (layout != "layer_first")


@pytest.mark.parametrize("flat", [True, False])
def test_a_one_layer_layer_first_page_is_a_copy_as_sglangs_stack_is(flat):
    # With one layer the page's rows are contiguous in the pool, so a flattened view would be
    # the pool's own bytes: a storage backend writing into it would change the pool.
    pool, _ = make_pool("layer_first", L=1, item=24, pages=3, P=4)
    pool.set_from_flat_data_page(4, torch.full((24,), 1, dtype=torch.uint8))
    page = pool.get_data_page(4, flat=flat)
    page.fill_(7)
    assert pool.get_data_page(4).eq(1).all()


def test_set_from_flat_data_page_accepts_other_dtypes_of_the_right_size():
    pool, _ = make_pool("page_first", L=2, item=16, pages=2, P=4)
    page = torch.arange(8, dtype=torch.float32)  # 32 bytes = 2 x 16
    pool.set_from_flat_data_page(4, page)
    assert torch.equal(pool.kv_buffer[1].reshape(-1), page.view(torch.uint8))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_flat_page_errors_change_nothing(layout):
    pool, _ = make_pool(layout, L=2, item=16, pages=2, P=4)
    poison(pool)
    before = host_bytes(pool)
    with pytest.raises(ValueError) as e:
        pool.set_from_flat_data_page(0, torch.zeros(31, dtype=torch.uint8))
    assert str(e.value) == "c4_kv set_from_flat_data_page: expected 32 bytes (2 x 16), got 31"
    for index in (8, -1):
        with pytest.raises(ValueError) as e:
            pool.set_from_flat_data_page(index, torch.zeros(32, dtype=torch.uint8))
        assert str(e.value) == f"c4_kv page index {index} out of range [0, 8)"
        with pytest.raises(ValueError):
            pool.get_data_page(index)
    assert torch.equal(host_bytes(pool), before)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_page_buffer_meta(layout):
    L, item, pages, P = 3, 40, 5, 4
    pool, _ = make_pool(layout, L=L, item=item, pages=pages, P=P)
    poison(pool)
    rows = [3, 0, 4]
    ptrs, sizes = pool.get_page_buffer_meta(token_indices(rows, P))
    if layout == "layer_first":
        bases = [b.data_ptr() for b in pool.kv_buffer]
        assert ptrs == [bases[layer] + r * item for r in rows for layer in range(L)]
        assert sizes == [item] * (len(rows) * L)
        for (r, layer), p in zip([(r, layer) for r in rows for layer in range(L)], ptrs):
            assert ctypes.string_at(p, item) == host_row(pool, r, layer).numpy().tobytes()
    else:
        base = pool.kv_buffer.data_ptr()
        assert ptrs == [base + r * L * item for r in rows]
        assert sizes == [L * item] * len(rows)
        for r, p in zip(rows, ptrs):
            want = b"".join(host_row(pool, r, layer).numpy().tobytes() for layer in range(L))
            assert ctypes.string_at(p, L * item) == want


def test_page_buffer_meta_refuses_pointers_outside_the_pool():
    pool, _ = make_pool("page_first", L=2, item=16, pages=2, P=4)
    with pytest.raises(ValueError) as e:
        pool.get_page_buffer_meta(torch.arange(8, 12))
    assert str(e.value) == "c4_kv page index 8 out of range [0, 8)"
    with pytest.raises(ValueError) as e:
        pool.get_page_buffer_meta(torch.arange(6))
    assert isinstance(e.value, RuntimeError)  # what SGLang's reshape raises there
    assert (
        str(e.value)
        == "c4_kv get_page_buffer_meta needs whole pages: got 6 indices for page size 4"
    )


def test_contiguous_buf_infos():
    pool, _ = make_pool("layer_first", L=3, item=40, pages=5, P=4)
    ptrs, lens, items = pool.get_contiguous_buf_infos()
    assert ptrs == [b.data_ptr() for b in pool.kv_buffer]
    assert lens == [5 * 40] * 3
    assert items == [40] * 3
    for layout in ("page_first", "page_first_direct"):
        # SGLang 0.5.20+: no per-layer pointers (no data_refs), and kv_buffer[i]'s bytes (page
        # row i: L rows) for each layer i.
        pool, _ = make_pool(layout, L=3, item=40, pages=5)
        assert pool.get_contiguous_buf_infos() == ([], [3 * 40] * 3, [40] * 3)
        pool, _ = make_pool(layout, L=3, item=40, pages=2)  # SGLang: kv_buffer[2] IndexError
        with pytest.raises(IndexError, match="kv_buffer has 2 page rows but the pool has 3") as e:
            pool.get_contiguous_buf_infos()
        assert isinstance(e.value, ValueError)


@pytest.mark.parametrize("layout", ["page_first", "page_first_direct"])
def test_contiguous_buf_infos_of_page_layouts_before_0_5_20_are_refused(monkeypatch, layout):
    # 0.5.18-0.5.19 fail there on `data_ptrs = None`.
    monkeypatch.setattr(v4_paged, "sglang_release", lambda: (0, 5, 19))
    pool, _ = make_pool(layout)
    with pytest.raises(ValueError) as e:
        pool.get_contiguous_buf_infos()
    assert str(e.value) == (
        f"c4_kv get_contiguous_buf_infos requires layer_first layout, got {layout}"
    )


def test_is_stride_page_aligned():
    assert make_pool("layer_first", L=4, item=1024)[0].is_stride_page_aligned() is False
    for layout in ("page_first", "page_first_direct"):
        assert make_pool(layout, L=4, item=1024)[0].is_stride_page_aligned() is True
        assert make_pool(layout, L=4, item=656)[0].is_stride_page_aligned() is False
        assert make_pool(layout, L=2, item=1024)[0].is_stride_page_aligned(2048) is True


# ---- teardown ---------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", LAYOUTS)
def test_destroy_is_idempotent_and_final(layout):
    pool, _ = make_pool(layout)
    pool.destroy()
    pool.destroy()
    assert pool.kv_buffer is None
    assert pool.data_ptrs is None
    with pytest.raises(RuntimeError, match="c4_kv host pool has been destroyed"):
        pool.backup_from_device_all_layer(None, torch.arange(4), torch.arange(4), "direct")
    with pytest.raises(RuntimeError):
        pool.get_page_buffer_meta(torch.arange(4))


def test_pool_without_rows():
    dev = [torch.zeros((2, 8), dtype=torch.uint8)]
    pool = DeepSeekV4PagedHostPool("empty", dev, 8, 0, 4)
    assert pool.size == 0 and pool.alloc(1) is None
    assert pool.kv_buffer[0].shape == (0, 8)
    with pytest.raises(ValueError):
        pool.backup_from_device_all_layer(None, torch.arange(4), torch.arange(4), "kernel")
    pool.destroy()


# ---- HiSparse request rows --------------------------------------------------------------------


def test_hisparse_request_rows_grow_page_by_page():
    pool, _ = make_pool(pages=4, P=4)
    rows = torch.full((2, 16), -1, dtype=torch.int64)
    lens = torch.zeros(2, dtype=torch.int64)
    assert pool.alloc_paged_token_slots(rows, lens, 1, 0, 0).numel() == 0
    assert pool.alloc_paged_token_slots(rows, lens, 1, 0, 5).tolist() == [0, 1, 2, 3, 4]
    assert lens.tolist() == [0, 8] and rows[1, :8].tolist() == list(range(8))
    # inside the allocated pages: nothing new is taken
    assert pool.alloc_paged_token_slots(rows, lens, 1, 5, 2).tolist() == [5, 6]
    assert pool.available_size() == 8
    assert pool.alloc_paged_token_slots(rows, lens, 1, 7, 3).tolist() == [7, 8, 9]
    assert lens.tolist() == [0, 12]
    assert pool.allocated_host_indices(rows, 1, 9).tolist() == list(range(12))
    assert pool.allocated_host_indices(rows, 0, 9).tolist() == []
    with pytest.raises(AssertionError):
        pool.alloc_paged_token_slots(rows, lens, 0, 4, 1)  # past the allocated length
    with pytest.raises(RuntimeError) as e:
        pool.alloc_paged_token_slots(rows, lens, 0, 0, 8)  # 2 pages, 1 left
    assert str(e.value) == "HiSparse host mem pool alloc failed for 2 pages"
    # Two more pages, one left, and a row too narrow: SGLang takes the pages first.
    with pytest.raises(RuntimeError, match="alloc failed for 2 pages"):
        pool.alloc_paged_token_slots(rows, lens, 1, 12, 8)
    assert lens.tolist() == [0, 12] and pool.available_size() == 4
    pool.free(torch.tensor([8, 9, 10, 11]))  # two pages would now fit the pool, not the row
    with pytest.raises(ValueError, match="request row holds 16 host slots but 20 are needed"):
        pool.alloc_paged_token_slots(rows, lens, 1, 12, 8)
    assert lens.tolist() == [0, 12]


@pytest.mark.parametrize("kind", ["v4", "mla"])
def test_hisparse_a_request_table_torch_cannot_read_takes_no_slots(kind):
    # The slots are taken before the row is read: a table whose row cannot be sliced (its
    # storage shrunk after it was made) must hand them back, as any other refusal does.
    if kind == "v4":
        pool, _ = make_pool(pages=6, P=4)
    else:
        from reference import make_mla

        pool, _ = make_mla("layer_first", 4)
    rows = torch.full((2, 16), -1, dtype=torch.int64)
    rows.untyped_storage().resize_(32)  # room for row 0's first 4 slots only
    lens = torch.zeros(2, dtype=torch.int64)
    free = pool.available_size()
    with pytest.raises(RuntimeError, match="storage"):
        pool.alloc_paged_token_slots(rows, lens, 1, 0, 5)
    assert pool.available_size() == free and lens.tolist() == [0, 0]
    assert pool.alloc(free).numel() == free  # every slot is still free


# ---- CUDA device pools (run where a GPU is present) ------------------------------------------


def _cuda_ready():
    from hostkv_rs import _core

    return torch.cuda.is_available() and _core.cuda_available()


@pytest.mark.gpu
@pytest.mark.skipif(not _cuda_ready(), reason="needs a CUDA device")
@pytest.mark.parametrize("backend, layout", SUPPORTED)
def test_cuda_page_round_trip(backend, layout):
    L, item, P, pages, dev_pages = 3, 656, 4, 6, 7
    g = torch.Generator().manual_seed(5)
    cpu_dev = [
        torch.randint(0, 256, (dev_pages, item), dtype=torch.uint8, generator=g) for _ in range(L)
    ]
    dev = [d.cuda() for d in cpu_dev]
    pool = DeepSeekV4PagedHostPool("c4_kv", dev, item, pages, P, layout=layout)
    assert pool.device_ptrs.is_cuda
    host_pages, dev_pages_ = [4, 1, 5], [0, 6, 2]
    h, d = token_indices(host_pages, P), token_indices(dev_pages_, P)
    pool.backup_from_device_all_layer(None, h, d, backend)
    torch.cuda.synchronize()
    for hp, dp in zip(host_pages, dev_pages_):
        for layer in range(L):
            assert torch.equal(host_row(pool, hp, layer), cpu_dev[layer][dp])
    for x in dev:
        x.zero_()
    for layer in range(L):
        pool.load_to_device_per_layer(None, h, d, layer, backend)
    torch.cuda.synchronize()
    for layer in range(L):
        want = torch.zeros((dev_pages, item), dtype=torch.uint8)
        for dp in dev_pages_:
            want[dp] = cpu_dev[layer][dp]
        assert torch.equal(dev[layer].cpu(), want)


@pytest.mark.gpu
@pytest.mark.skipif(not _cuda_ready(), reason="needs a CUDA device")
@pytest.mark.parametrize("backend", ["kernel", "direct"])
def test_cuda_token_granular_round_trip(backend):
    L, pages = 2, 3
    g = torch.Generator().manual_seed(6)
    cpu_dev = [
        torch.randint(0, 256, (pages, C4_ROW), dtype=torch.uint8, generator=g) for _ in range(L)
    ]
    dev = [d.cuda() for d in cpu_dev]
    pool = DeepSeekV4PagedHostPool("c4_kv", dev, C4_ROW, pages, C4_P)
    poison(pool)
    before = host_bytes(pool)
    host_tok, dev_tok = pick(pages * C4_P, 45, seed=1), pick(pages * C4_P, 45, seed=2)
    pool.backup_from_device_all_layer(None, torch.tensor(host_tok), torch.tensor(dev_tok), backend)
    torch.cuda.synchronize()
    for layer in range(L):
        want = before[:, layer].clone()
        for ht, dt in zip(host_tok, dev_tok):
            c4_copy(want, ht, cpu_dev[layer], dt)
        assert torch.equal(pool.kv_buffer[layer], want)


def _small_v4_pool(pages: int = 8, item: int = 16, page_size: int = 2):
    device = [torch.zeros(pages, item, dtype=torch.uint8) for _ in range(2)]
    return DeepSeekV4PagedHostPool("c4", device, item, pages, page_size), device


def test_v4_free_owns_a_numpy_array_it_was_given():
    pool, _ = _small_v4_pool()
    pool.alloc(pool.size)
    freed = np.array([0, 1], dtype=np.int64)
    pool.free(freed)
    freed[:] = 1000  # outside the pool: handing it out later would name a slot that is not there
    assert pool.alloc(2).tolist() == [0, 1]


def test_v4_transfer_refuses_float_indices_instead_of_truncating():
    pool, device = _small_v4_pool()
    device[0][1] = 7
    with pytest.raises(TypeError, match="integer tensors"):
        pool.backup_from_device_all_layer(None, [2.5, 3.5], [2.7, 3.9], "direct")
    assert int(pool.kv_buffer[0].sum()) == 0


# --- from test_contract_v4.py:
# DeepSeekV4PagedHostPool and LogicalHostPool audited against host-pool-contract.md (§1.5, §2.4,
# §3.1, §3.5, §3.6, §4.1) and SGLang's memory_pool_host.py (00343773 version, the one with
# `attach_scale_buffers`): staging buffer, logs, scale buffers, kernel_ascend page copies, the
# HiSparse mixin and hostile inputs. Expected bytes come from the contract's shapes.


# SGLang 0.5.20+ views a host layer for kernel_ascend in each of the three layouts.
ASCEND_LAYOUTS = LAYOUTS
C4_P, C4_ROW = 64, 37440


def make_contract_pool(layout="layer_first", L=3, item=48, pages=5, P=2, dev_pages=6, seed=0, **kw):
    g = torch.Generator().manual_seed(seed)
    dev = [
        torch.randint(0, 256, (dev_pages, item), dtype=torch.uint8, generator=g) for _ in range(L)
    ]
    return DeepSeekV4PagedHostPool("c4_kv", dev, item, pages, P, layout=layout, **kw), dev


def rows_of(buffer, layout, layer_num, width):
    """(Nh, L, width) copy of a host buffer in any of the three V4 shapes."""
    if layout == "layer_first":
        return torch.stack(list(buffer), dim=1).clone()
    return buffer.reshape(buffer.shape[0], layer_num, width).clone()


def poison_host(buffer, seed):
    g = torch.Generator().manual_seed(seed)
    for t in buffer if isinstance(buffer, list) else [buffer]:
        t.copy_(torch.randint(0, 256, t.shape, dtype=torch.uint8, generator=g))


def tokens(pages, P):
    return torch.cat([torch.arange(p * P, (p + 1) * P) for p in pages])


# ---- construction ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("release", "kernels", "made"),
    [
        ((0, 5, 21), False, True),  # made whatever the platform
        ((0, 5, 22), False, False),  # 0.5.22+: where SGLang's HiCache device kernels run
        ((0, 5, 22), True, True),
        (None, False, False),  # no SGLang: the newest release's rule
        (None, True, True),
    ],
)
def test_page_first_makes_sglangs_staging_buffer_where_the_release_does(
    monkeypatch, release, kernels, made
):
    monkeypatch.setattr(v4_paged, "sglang_release", lambda: release)
    monkeypatch.setattr(v4_paged, "hicache_device_kernels", lambda: kernels)
    pool, _ = make_contract_pool("page_first", L=3, item=48, pages=5)
    assert (pool.staging_buffer is not None) == made


@pytest.mark.parametrize("pages, cap", [(5, 5), (70, 64)])
def test_page_first_allocates_sglangs_staging_buffer(monkeypatch, pages, cap):
    # §3.1: (min(Nh, 64), L, item_bytes) uint8 on the device buffers' device, JIT or not.
    monkeypatch.setattr(v4_paged, "sglang_release", lambda: (0, 5, 21))
    pool, dev = make_contract_pool("page_first", L=3, item=48, pages=pages)
    assert pool.can_use_write_back_jit is False
    assert pool.staging_buffer.shape == (cap, 3, 48)
    assert pool.staging_buffer.dtype == torch.uint8
    assert pool.staging_buffer.device == dev[0].device


@pytest.mark.parametrize("layout", ["layer_first", "page_first_direct"])
def test_other_layouts_have_no_staging_buffer(layout):
    pool, _ = make_contract_pool(layout)
    assert pool.staging_buffer is None


def test_construction_logs_sglangs_allocation_line(caplog):
    with caplog.at_level(logging.INFO):
        make_contract_pool("page_first_direct", L=3, item=48, pages=5)
    assert (
        "Allocating 0.00 GB host memory for V4 paged pool 'c4_kv' "
        "(layers=3, pages=5, item_bytes=48, layout=page_first_direct)."
    ) in caplog.text


def test_memory_check_reads_the_budget_where_sglang_imports_it(monkeypatch):
    # SGLang's V4 pool imports host_memory_budget_bytes from pool_host.base.
    from hostkv_rs.pools import base

    monkeypatch.setattr(base, "host_memory_budget_bytes", lambda: 3 * 5 * 48 - 1)
    with pytest.raises(ValueError) as e:
        make_contract_pool(L=3, item=48, pages=5)
    assert str(e.value) == (
        "Not enough host memory for V4 paged pool c4_kv. Requesting 0.00 GB but only have "
        "0.00 GB free."
    )
    monkeypatch.setattr(base, "host_memory_budget_bytes", lambda: 3 * 5 * 48)
    assert make_contract_pool(L=3, item=48, pages=5)[0].size == 10


def test_allocator_is_sglangs_default_host_allocator():
    from hostkv_rs.pools.memory import HostTensorAllocator

    pool, _ = make_contract_pool()
    assert isinstance(pool.allocator, HostTensorAllocator) and pool.fd is None


def test_host_device_must_be_cpu():
    with pytest.raises(
        AssertionError,
        match=re.escape("HostTensorAllocator only supports CPU allocations; got device='cuda'"),
    ):
        make_contract_pool(device="cuda")


def test_hisparse_mixin_comes_first_in_the_bases():
    assert DeepSeekV4PagedHostPool.__mro__[1] is HiSparseHostPoolMixin


# ---- scale buffers ---------------------------------------------------------------------------


def scale_buffers(L=3, dev_pages=6, sib=8, seed=7):
    g = torch.Generator().manual_seed(seed)
    # fp16 scales shaped (pages, slot_page_size, 1, scale_dim): sib bytes per device page row
    return [
        torch.randint(-100, 100, (dev_pages, 2, 1, sib // 4), generator=g).to(torch.float16)
        for _ in range(L)
    ]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_attach_scale_buffers_shapes_and_log(layout, caplog):
    pool, _ = make_contract_pool(layout, L=3, pages=5)
    with caplog.at_level(logging.INFO):
        pool.attach_scale_buffers(scale_buffers(), 8)
    assert pool.scale_item_bytes == 8 and len(pool.scale_device_buffers) == 3
    if layout == "layer_first":
        assert isinstance(pool.scale_kv_buffer, list) and len(pool.scale_kv_buffer) == 3
        assert all(b.shape == (5, 8) and b.dtype == torch.uint8 for b in pool.scale_kv_buffer)
    else:
        assert pool.scale_kv_buffer.shape == (5, 3, 1, 8)
        assert pool.scale_kv_buffer.dtype == torch.uint8
    assert (
        "Attaching 0.00 MB host memory for V4 indexer scale pool 'c4_kv' "
        f"(layers=3, pages=5, scale_item_bytes=8, layout={layout})."
    ) in caplog.text


def test_a_page_whose_reading_destroys_the_pool_is_not_written():
    # As on the MHA and MLA pools (whose bytes are gone after destroy()): a flat page whose
    # torch-function hook destroys the pool while it is read is refused, not written.
    pool, _ = make_pool()
    before = pool._flat.clone()

    class Destroying(torch.Tensor):
        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):
            pool.destroy()
            return super().__torch_function__(func, types, args, kwargs or {})

    page = torch.full((pool.layer_num * pool.item_bytes,), 7, dtype=torch.uint8)
    with pytest.raises(RuntimeError, match="has been destroyed"):
        pool.set_from_flat_data_page(0, page.as_subclass(Destroying))
    assert torch.equal(pool._flat, before)


@pytest.mark.parametrize("step", ["HostPool", "DeviceBinding"])
def test_attach_scale_buffers_refused_by_the_core_attaches_nothing(monkeypatch, step):
    # The two-plane core or its bindings refused: the pool is left as it was (no half-attached
    # scales that every retry refuses as "already attached"), and attaching works afterwards.
    pool, _ = make_contract_pool("layer_first", L=3, pages=5)
    real = getattr(v4_paged._core, step)

    def refusing(*args, **kwargs):
        if step == "DeviceBinding" or len(args[1]) == 2:
            raise ValueError("refused by the core")
        return real(*args, **kwargs)

    monkeypatch.setattr(v4_paged._core, step, refusing)
    transfers = pool._transfers
    with pytest.raises(ValueError, match="refused by the core"):
        pool.attach_scale_buffers(scale_buffers(), 8)
    assert pool.scale_kv_buffer is None and pool.scale_device_buffers is None
    assert pool.scale_item_bytes == 0 and list(pool._pool.spec.item_bytes) == [pool.item_bytes]
    assert pool._transfers is transfers
    monkeypatch.undo()
    pool.attach_scale_buffers(scale_buffers(), 8)
    assert list(pool._pool.spec.item_bytes) == [pool.item_bytes, 8]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_scale_rows_attached_under_inference_mode_are_normal_tensors(layout):
    with torch.inference_mode():
        pool, _ = make_contract_pool(layout, L=3, pages=5)
        pool.attach_scale_buffers(scale_buffers(), 8)
    rows = (
        pool.scale_kv_buffer if isinstance(pool.scale_kv_buffer, list) else [pool.scale_kv_buffer]
    )
    assert not any(r.is_inference() for r in rows)
    rows[0].fill_(1)  # a thread outside inference mode may write them


@pytest.mark.parametrize("layout", LAYOUTS)
def test_scale_rows_become_the_pools_second_plane_and_change_no_page_answer(layout):
    # One core holds the page rows and, once attached, the scale rows: every binding moves its
    # planes of it (kernel_ascend's both: test_kernel_ascend_moves_whole_pages_and_their_scales),
    # and what SGLang asks of the page rows answers as before.
    pool, dev = make_contract_pool(layout, L=3, pages=5)
    h, d = torch.arange(4), torch.arange(4)
    pool.backup_from_device_all_layer(
        None, h, d, "kernel" if layout != "page_first_direct" else "direct"
    )
    before = (
        pool.is_stride_page_aligned(16),
        pool.is_stride_page_aligned(48),
        pool.get_page_buffer_meta(h),
        pool.get_data_page(2).clone(),
    )
    pool.attach_scale_buffers(scale_buffers(), 8)
    assert pool._pool.spec.item_bytes == [48, 8]
    after = (
        pool.is_stride_page_aligned(16),
        pool.is_stride_page_aligned(48),
        pool.get_page_buffer_meta(h),
        pool.get_data_page(2).clone(),
    )
    assert after[:3] == before[:3] and torch.equal(after[3], before[3])
    for t in dev:
        t.zero_()
    backend = "kernel" if layout != "page_first_direct" else "direct"
    pool.load_to_device_per_layer(None, h, d, 1, backend)  # the page rows alone
    assert bool(dev[1][:2].any())


def test_attach_scale_buffers_errors_use_sglangs_text_and_change_nothing():
    pool, _ = make_contract_pool(L=3)
    with pytest.raises(ValueError) as e:
        pool.attach_scale_buffers(scale_buffers(L=2), 8)
    assert str(e.value) == "c4_kv: scale_device_buffers has 2 layers, expected 3"
    assert pool.scale_kv_buffer is None and pool.scale_device_buffers is None
    with pytest.raises(ValueError, match="must be contiguous rows of 7 bytes"):
        pool.attach_scale_buffers(scale_buffers(sib=8), 7)  # 48 bytes per layer: not 7-byte rows
    assert pool.scale_kv_buffer is None and pool.scale_item_bytes == 0
    pool.attach_scale_buffers(scale_buffers(), 8)
    with pytest.raises(RuntimeError) as e:
        pool.attach_scale_buffers(scale_buffers(), 8)
    assert str(e.value) == "c4_kv: scale buffers already attached"


# ---- kernel_ascend ---------------------------------------------------------------------------


@pytest.mark.parametrize("with_scales", [False, True])
@pytest.mark.parametrize("layout", ASCEND_LAYOUTS)
def test_kernel_ascend_moves_whole_pages_and_their_scales(layout, with_scales):
    L, item, P, pages, dev_pages, sib = 3, 48, 2, 5, 6, 8
    pool, dev = make_contract_pool(layout, L=L, item=item, pages=pages, P=P, dev_pages=dev_pages)
    sdev = scale_buffers(L, dev_pages, sib)
    if with_scales:
        pool.attach_scale_buffers(sdev, sib)
        poison_host(pool.scale_kv_buffer, 3)
    poison_host(pool.kv_buffer, 2)
    host_pages, dev_src, dev_dst = [4, 0, 2], [5, 1, 3], [0, 2, 4]

    want = rows_of(pool.kv_buffer, layout, L, item)
    for hp, dp in zip(host_pages, dev_src):
        for layer in range(L):
            want[hp, layer] = dev[layer][dp]
    if with_scales:
        want_s = rows_of(pool.scale_kv_buffer, layout, L, sib)
        for hp, dp in zip(host_pages, dev_src):
            for layer in range(L):
                want_s[hp, layer] = sdev[layer][dp].reshape(-1).view(torch.uint8)
    pool.backup_from_device_all_layer(
        None, tokens(host_pages, P), tokens(dev_src, P), "kernel_ascend"
    )
    assert torch.equal(rows_of(pool.kv_buffer, layout, L, item), want)
    if with_scales:
        assert torch.equal(rows_of(pool.scale_kv_buffer, layout, L, sib), want_s)

    for t in dev + sdev:
        t.zero_()
    pool.load_to_device_per_layer(
        None, tokens(host_pages, P), tokens(dev_dst, P), 1, "kernel_ascend"
    )
    for layer in range(L):
        for dp in range(dev_pages):
            if layer == 1 and dp in dev_dst:
                hp = host_pages[dev_dst.index(dp)]
                assert torch.equal(dev[layer][dp], want[hp, layer])
                if with_scales:
                    got = sdev[layer][dp].reshape(-1).view(torch.uint8)
                    assert torch.equal(got, want_s[hp, layer])
            else:
                assert not dev[layer][dp].any()
                assert not sdev[layer][dp].any()


@pytest.mark.parametrize("release", [(0, 5, 18), (0, 5, 19)])
@pytest.mark.parametrize("layout", ASCEND_LAYOUTS)
def test_kernel_ascend_is_unknown_to_releases_before_0_5_20(monkeypatch, release, layout):
    # 0.5.18-0.5.19's V4 pool has no kernel_ascend copy: whole pages are refused as any
    # unknown backend is, before a byte moves; single tokens never read the backend there.
    monkeypatch.setattr(v4_paged, "sglang_release", lambda: release)
    P = 2
    pool, dev = make_contract_pool(layout, L=3, item=48, pages=5, P=P, dev_pages=6)
    poison_host(pool.kv_buffer, 4)
    host_before = rows_of(pool.kv_buffer, layout, 3, 48)
    dev_before = [t.clone() for t in dev]
    text = f"Unsupported V4 paged host layout/backend: {layout}/kernel_ascend"
    h, d = tokens([4, 0], P), tokens([5, 1], P)
    with pytest.raises(ValueError) as e:
        pool.backup_from_device_all_layer(None, h, d, "kernel_ascend")
    assert str(e.value) == text
    with pytest.raises(ValueError) as e:
        pool.load_to_device_per_layer(None, h, d, 1, "kernel_ascend")
    assert str(e.value) == text
    assert torch.equal(rows_of(pool.kv_buffer, layout, 3, 48), host_before)
    assert all(torch.equal(t, was) for t, was in zip(dev, dev_before))


def test_kernel_ascend_refuses_before_any_byte_when_the_scale_rows_are_short():
    L, item, P = 2, 48, 2
    pool, _ = make_contract_pool("layer_first", L=L, item=item, pages=5, P=P, dev_pages=6)
    pool.attach_scale_buffers(scale_buffers(L, dev_pages=3), 8)  # only 3 scale rows
    poison_host(pool.kv_buffer, 4)
    before = rows_of(pool.kv_buffer, "layer_first", L, item)
    # The KV call is bounded by the scale rows too, so its check (before any byte) covers both.
    with pytest.raises(TransferError, match=r"device index 4 .*out of range \[0, 3\)"):
        pool.backup_from_device_all_layer(
            None, tokens([0, 1], P), tokens([1, 4], P), "kernel_ascend"
        )
    assert torch.equal(rows_of(pool.kv_buffer, "layer_first", L, item), before)


def test_kernel_ascend_token_granular_runs_the_dsv4_copy_like_the_other_backends():
    # §3.5: a transfer that is not page aligned goes to transfer_cache_dsv4_mla whatever the
    # backend; kernel_ascend must land the same bytes as direct.
    results = []
    for backend in ("direct", "kernel_ascend"):
        pool, _ = make_contract_pool(
            "layer_first", L=2, item=C4_ROW, pages=2, P=C4_P, dev_pages=2, seed=9
        )
        h, d = torch.tensor([3, 70, 100]), torch.tensor([5, 64, 127])
        pool.backup_from_device_all_layer(None, h, d, backend)
        results.append(rows_of(pool.kv_buffer, "layer_first", 2, C4_ROW))
    assert torch.equal(results[0], results[1])
    assert results[0].any()


# ---- ordering and hostile inputs -------------------------------------------------------------


def test_unsupported_pair_is_reported_before_a_bad_layer():
    pool, _ = make_contract_pool("page_first_direct")
    with pytest.raises(ValueError) as e:
        pool.load_to_device_per_layer(None, tokens([0], 2), tokens([0], 2), 99, "kernel")
    assert str(e.value) == "Unsupported V4 paged host layout/backend: page_first_direct/kernel"


def test_empty_load_is_a_no_op_whatever_the_layer_and_takes_is_draft():
    pool, _ = make_contract_pool("layer_first")
    empty = torch.empty(0, dtype=torch.int64)
    assert pool.load_to_device_per_layer(None, empty, empty, 99, "kernel") is None
    assert pool.load_to_device_per_layer(None, empty, empty, None, "kernel") is None
    assert pool.load_to_device_per_layer(None, empty, empty, 0, "direct", is_draft=False) is None


@pytest.mark.parametrize(
    "bad", [torch.tensor([1.0, 2.0]), torch.tensor([True, False]), [0.5, 1.5]], ids=str
)
def test_free_refuses_non_integer_slots(bad):
    pool, _ = make_contract_pool(pages=5, P=2)
    pool.alloc(10)
    with pytest.raises(TypeError):
        pool.free(bad)
    assert pool.available_size() == 0 and pool.release_slots == []


def test_page_buffer_meta_refuses_float_indices():
    pool, _ = make_contract_pool()
    with pytest.raises(TypeError):
        pool.get_page_buffer_meta(torch.arange(4).float())


def test_set_from_flat_data_page_refuses_a_list():
    pool, _ = make_contract_pool()
    with pytest.raises(TypeError):
        pool.set_from_flat_data_page(0, [0] * (3 * 48))


@pytest.mark.parametrize("bad", [torch.arange(8).float(), torch.ones(8, dtype=torch.bool)])
def test_logical_free_refuses_non_integer_slots(bad):
    pool = LogicalHostPool(32, 8)
    pool.alloc(32)
    with pytest.raises(TypeError):
        pool.free(bad)
    assert pool.available_size() == 0 and pool.release_slots == []


def test_out_of_range_layers_and_pages_are_also_sglangs_index_errors():
    # SGLang indexes Python lists / tensors here, so callers may catch IndexError.
    pool, dev = make_contract_pool("page_first", L=3, pages=5, P=2)
    before = rows_of(pool.kv_buffer, "page_first", 3, 48)
    dev_before = [d.clone() for d in dev]
    with pytest.raises(IndexError) as e:
        pool.load_to_device_per_layer(None, tokens([0], 2), tokens([0], 2), 3, "kernel")
    assert isinstance(e.value, TransferError) and isinstance(e.value, ValueError)
    for call in (
        lambda: pool.get_data_page(10),
        lambda: pool.set_from_flat_data_page(-1, torch.zeros(3 * 48, dtype=torch.uint8)),
        lambda: pool.get_page_buffer_meta(tokens([5], 2)),
    ):
        with pytest.raises(IndexError) as e:
            call()
        assert isinstance(e.value, ValueError)
    assert torch.equal(rows_of(pool.kv_buffer, "page_first", 3, 48), before)
    assert all(torch.equal(a, b) for a, b in zip(dev, dev_before))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_unhashable_backend_gets_the_v4_value_error(layout):
    pool, _ = make_contract_pool(layout)
    with pytest.raises(ValueError) as e:
        pool.backup_from_device_all_layer(None, tokens([0], 2), tokens([0], 2), ["kernel"])
    assert str(e.value) == f"Unsupported V4 paged host layout/backend: {layout}/['kernel']"


@pytest.mark.parametrize("layout, aligned", [("layer_first", False), ("page_first", True)])
def test_stride_page_alignment_uses_the_page_row(layout, aligned):
    # §4.3: L * item_bytes = 4 * 1024 = 4096 bytes per page row.
    pool, _ = make_contract_pool(layout, L=4, item=1024, pages=3)
    assert pool.is_stride_page_aligned() is aligned


def test_meta_device_buffers_build_but_cannot_transfer():
    dev = [torch.zeros(4, 48, dtype=torch.uint8, device="meta") for _ in range(2)]
    pool = DeepSeekV4PagedHostPool("c4_kv", dev, 48, 3, 2)
    assert pool.gpu_device.type == "meta" and pool.size == 6
    with pytest.raises(ValueError, match="must be on CPU or CUDA"):
        pool.backup_from_device_all_layer(None, tokens([0], 2), tokens([1], 2), "direct")
    with pytest.raises(ValueError, match="must be on CPU or CUDA"):
        pool.load_to_device_per_layer(None, tokens([0], 2), tokens([1], 2), 0, "direct")


def test_without_device_buffers_gpu_device_is_the_device_argument_as_given():
    # SGLang: `device_buffers[0].device if device_buffers else device` (a string here).
    pool = DeepSeekV4PagedHostPool("c4_kv", [], 48, 3, 2)
    assert pool.gpu_device == "cpu"


def test_transfers_use_the_device_layers_checked_at_construction():
    # device_buffers is the caller's own list; what the caller puts in it later (here a buffer
    # of the wrong row size) is not what the pool's transfers read.
    dev = [torch.zeros((3, 8), dtype=torch.uint8) for _ in range(2)]
    pool = DeepSeekV4PagedHostPool("idx", dev, 8, 2, 1)
    layer = dev[1]
    layer[2] = torch.arange(8, dtype=torch.uint8)
    dev[1] = torch.zeros((3, 5), dtype=torch.uint8)
    pool.backup_from_device_all_layer(None, torch.tensor([1]), torch.tensor([2]), "kernel")
    assert torch.equal(pool.kv_buffer[1][1], layer[2])
