"""MHATokenToKVPoolHost against host-pool-contract.md §2.1, §3.2, §4.4, §4.5: token-granular
transfers, geometry, metadata pointers and flat pages from the contract's formulas (the page round
trips of every pool kind are in core/test_transfers.py)."""

from __future__ import annotations

import logging
import re
import types
from unittest import mock

import numpy as np
import pytest
import torch
from hostkv_rs import (
    AsymmetricMHATokenToKVPoolHost,
    HostKVCache,
    HostTensorAllocator,
    MHATokenToKVPool,
    MHATokenToKVPoolHost,
    MLATokenToKVPool,
    TransferError,
    get_mha_host_pool_cls,
)
from hostkv_rs.pools import base
from hostkv_rs.pools import memory as _memory
from reference import (
    ASYM_PAIRS,
    DEVICE_PAGES,
    LAYERS,
    MHA_PAIRS,
    assert_bytes_equal,
    assert_device_equal,
    assert_host_equal,
    expected_backup,
    expected_load,
    fill_random,
    host_planes,
    make_asym,
    make_mha,
    page_tokens,
    round_trip,
    snapshot_device,
    snapshot_host,
)


@pytest.mark.parametrize(
    "backend,layout",
    [p for p in MHA_PAIRS if p[0] == "kernel" or p[1] == "layer_first"],
)
def test_round_trip_scattered_tokens(backend, layout):
    """Token-granular transfers (kernel, direct layer_first): arbitrary slot permutations. SGLang's
    direct ops refuse partial pages, so direct runs them on a page-size-1 pool."""
    rng = np.random.default_rng(7)
    page_size, device_pages = (1, 64) if backend == "direct" else (16, DEVICE_PAGES)
    host, dp = make_mha(layout, page_size, torch.bfloat16, device_pages=device_pages)
    n = 23
    host_tokens = rng.permutation(host.size)[:n]
    dev_rows = device_pages * page_size + page_size
    round_trip(
        host,
        dp,
        backend,
        host_tokens,
        rng.permutation(np.arange(1, dev_rows))[:n],
        rng.permutation(np.arange(1, dev_rows))[:n],
    )


def test_direct_layer_first_refuses_a_partial_page():
    """transfer_kv_direct's check (contract §3.1 / transfer-semantics §3.1), before any byte moves."""
    host, dp = make_mha("layer_first", 16, torch.bfloat16)
    h = host.alloc(16)[:9]
    before = host.kv_buffer.clone(), [t.clone() for t in dp.k_buffer]
    with pytest.raises(RuntimeError, match="Source indices size must be divisible by page size"):
        host.backup_from_device_all_layer(dp, h, torch.arange(16, 25), "direct")
    with pytest.raises(RuntimeError, match="Source indices size must be divisible by page size"):
        host.load_to_device_per_layer(dp, h, torch.arange(16, 25), 0, "direct")
    assert torch.equal(host.kv_buffer, before[0])
    assert all(torch.equal(a, b) for a, b in zip(dp.k_buffer, before[1]))


def test_geometry_and_attributes():
    host, _ = make_mha("layer_first", 16, torch.bfloat16, heads=2, head_dim=8)
    e = 2
    assert host.layer_num == host.target_layer_num == LAYERS
    assert host.size_per_token == 2 * LAYERS * 2 * 8 * e
    assert host.get_ksize_per_token() == LAYERS * 2 * 8 * e
    assert host.token_stride_size == 2 * 8 * e
    assert host.layout_dim == 2 * 8 * e * LAYERS
    assert host.element_dim == 16
    assert host.can_use_write_back_jit is False
    assert host.dtype == torch.bfloat16
    assert host.kv_buffer.shape == (2, LAYERS, host.size, 2, 8)
    assert host.k_buffer.data_ptr() == host.kv_buffer.data_ptr()
    assert host.v_buffer.data_ptr() == host.kv_buffer.data_ptr() + LAYERS * host.size * 32
    assert host.get_hybrid_pool_buffer()[1].data_ptr() == host.v_buffer.data_ptr()
    assert host.start_layer == 0 and host.end_layer == LAYERS - 1
    assert host.fd is None
    assert host.dcp_size == 1 and host.dcp_rank == 0


@pytest.mark.parametrize(
    "layout,shape",
    [
        ("layer_first", lambda L, S, Pn, P, H, D: (2, L, S, H, D)),
        ("page_first", lambda L, S, Pn, P, H, D: (2, S, L, H, D)),
        ("page_first_direct", lambda L, S, Pn, P, H, D: (2, Pn, L, P, H, D)),
        ("page_head", lambda L, S, Pn, P, H, D: (2, Pn, H, P, L, D)),
    ],
)
def test_buffer_shapes_and_fp8_store_dtype(layout, shape):
    host, dp = make_mha(layout, 4, torch.float8_e4m3fn, heads=2, head_dim=8)
    assert dp.store_dtype == torch.uint8 and host.dtype == torch.uint8
    assert host.kv_buffer.is_contiguous()
    assert tuple(host.kv_buffer.shape) == shape(LAYERS, host.size, host.page_num, 4, 2, 8)


def test_data_refs_and_pointer_tables():
    host, _ = make_mha("page_first", 4, torch.bfloat16)
    T, LD = host.token_stride_size, host.layout_dim
    base = host.kv_buffer.data_ptr()
    for layer in range(LAYERS):
        ref = host.k_data_refs[layer]
        assert ref.data_ptr() == base + layer * T
        assert ref.stride(0) * 2 == LD  # row pitch = layout_dim bytes
        assert host.v_data_refs[layer].data_ptr() == base + LAYERS * host.size * T + layer * T
    assert host.k_data_ptrs.dtype == torch.uint64
    assert host.k_data_ptrs.tolist() == [r.data_ptr() for r in host.k_data_refs]
    assert host.v_data_ptrs.tolist() == [r.data_ptr() for r in host.v_data_refs]
    assert len(host.host_kv_data_refs) == 2 * LAYERS

    lf, _ = make_mha("layer_first", 4, torch.bfloat16)
    S, T = lf.size, lf.token_stride_size
    assert lf.k_data_ptrs.tolist() == [
        lf.kv_buffer.data_ptr() + layer * S * T for layer in range(LAYERS)
    ]


@pytest.mark.parametrize("layout", ["layer_first", "page_first", "page_first_direct", "page_head"])
def test_get_page_buffer_meta_order_and_sizes(layout):
    P, H, D, e = 4, 2, 8, 2
    host, _ = make_mha(layout, P, torch.bfloat16, heads=H, head_dim=D)
    L, S = LAYERS, host.size
    base = host.kv_buffer.data_ptr()
    vo = L * S * H * D * e
    pages = [3, 0, 5]
    ptrs, sizes = host.get_page_buffer_meta(torch.tensor(page_tokens(pages, P)))
    want = []
    if layout == "layer_first":
        for p in pages:
            for layer in range(L):
                k = base + p * P * H * D * e + layer * S * H * D * e
                want += [k, k + vo]
        assert sizes == [P * H * D * e] * len(want)
    else:
        for p in pages:
            k = base + p * P * L * H * D * e
            want += [k, k + vo]
        assert sizes == [L * P * H * D * e] * len(want)
    assert ptrs == want


def test_get_page_buffer_meta_bytes_are_the_pages_bytes():
    """The region a (ptr, size) entry names holds exactly the page's K (or V) bytes."""
    host, _ = make_mha("page_first_direct", 4, torch.bfloat16)
    planes = host_planes(host)
    planes[0].copy_(torch.arange(planes[0].numel()) % 251)
    planes[1].copy_(torch.arange(planes[1].numel()) % 241)
    ptrs, sizes = host.get_page_buffer_meta(torch.arange(8, 12))
    flat = host.kv_buffer.reshape(-1).view(torch.uint8)
    base = host.kv_buffer.data_ptr()
    k = flat[ptrs[0] - base : ptrs[0] - base + sizes[0]]
    v = flat[ptrs[1] - base : ptrs[1] - base + sizes[1]]
    assert torch.equal(k, host.k_buffer[2].reshape(-1).view(torch.uint8))
    assert torch.equal(v, host.v_buffer[2].reshape(-1).view(torch.uint8))


def test_split_heads_page_buffer_meta():
    P, H, D, e = 4, 4, 8, 2
    host, _ = make_mha("page_head", P, torch.bfloat16, heads=H, head_dim=D)
    L, S = LAYERS, host.size
    base = host.kv_buffer.data_ptr()
    vo = L * S * H * D * e
    ptrs, sizes = host.get_split_heads_page_buffer_meta(torch.tensor(page_tokens([2, 1], P)), 2)
    want = []
    for p in (2, 1):
        for h0 in (0, 2):
            k = base + p * P * L * H * D * e + h0 * P * L * D * e
            want += [k, k + vo]
    assert ptrs == want
    assert sizes == [L * P * H * D * e // 2] * 8


def _flat_page_reference(host, slot):
    """The flat page's elements in the layout's own order (contract §4.4)."""
    P = host.page_size
    kv = host.kv_buffer
    if host.layout == "layer_first":
        return kv[:, :, slot : slot + P].reshape(-1)
    if host.layout == "page_first":
        return kv[:, slot : slot + P].reshape(-1)
    return kv[:, slot // P].reshape(-1)


@pytest.mark.parametrize("layout", ["layer_first", "page_first", "page_first_direct", "page_head"])
@pytest.mark.parametrize("page_size", [1, 16])
def test_flat_data_pages_round_trip(layout, page_size):
    rng = np.random.default_rng(3)
    host, _ = make_mha(layout, page_size, torch.bfloat16)
    for plane in host_planes(host):
        plane.copy_(torch.from_numpy(rng.integers(0, 256, plane.numel(), dtype=np.uint8)))
    before = snapshot_host(host)
    src, dst = 2 * page_size, 5 * page_size

    page = host.get_data_page(src)
    assert page.dim() == 1
    assert torch.equal(page.view(torch.uint8), _flat_page_reference(host, src).view(torch.uint8))
    dummy = host.get_dummy_flat_data_page()
    assert dummy.numel() == page.numel() and dummy.dtype == host.dtype
    assert not dummy.any()
    dummy.copy_(page)  # what an L3 backend's batch_get does
    original_dst = host.get_data_page(dst).clone()

    host.set_from_flat_data_page(dst, dummy)
    assert torch.equal(
        _flat_page_reference(host, dst).view(torch.uint8),
        _flat_page_reference(host, src).view(torch.uint8),
    )
    # Everything except the destination page is untouched.
    host.set_from_flat_data_page(dst, original_dst)
    for got, want in zip(snapshot_host(host), before, strict=True):
        assert_bytes_equal(got, want, "host after restoring the page")

    unflat = host.get_data_page(src, flat=False)
    assert unflat.data_ptr() >= host.kv_buffer.data_ptr()
    assert torch.equal(unflat.reshape(-1).view(torch.uint8), page.view(torch.uint8))


def test_flat_pages_are_layout_specific():
    """The same logical page flattens in a different element order under another layout."""
    lf, _ = make_mha("layer_first", 4, torch.bfloat16)
    pf, _ = make_mha("page_first", 4, torch.bfloat16)
    assert lf.get_dummy_flat_data_page().numel() == pf.get_dummy_flat_data_page().numel()
    values = torch.arange(lf.get_dummy_flat_data_page().numel(), dtype=torch.float32)
    page = values.to(torch.bfloat16)
    lf.set_from_flat_data_page(0, page)
    pf.set_from_flat_data_page(0, page)
    assert torch.equal(lf.get_data_page(0), pf.get_data_page(0))
    # K of layer 1, token 0 sits at a different flat position in each layout.
    assert not torch.equal(lf.k_buffer[1, 0], pf.k_buffer[0, 1])


def test_is_stride_page_aligned():
    host, _ = make_mha("page_first_direct", 64, torch.bfloat16, heads=2, head_dim=16)
    assert host.kv_buffer.data_ptr() % 4096 == 0
    # page stride = 64 * 5 * 2 * 16 * 2 = 20480 bytes = 5 * 4096
    assert host.is_stride_page_aligned() is True
    odd, _ = make_mha("page_first_direct", 1, torch.bfloat16, heads=2, head_dim=8)
    assert odd.is_stride_page_aligned() is False
    lf, _ = make_mha("layer_first", 64, torch.bfloat16, heads=2, head_dim=16)
    assert lf.is_stride_page_aligned() is False


def test_empty_transfer_is_a_no_op():
    host, dp = make_mha("layer_first", 4, torch.bfloat16)
    before = snapshot_host(host)
    empty = torch.empty(0, dtype=torch.int64)
    host.backup_from_device_all_layer(dp, empty, empty, "kernel")
    host.load_to_device_per_layer(dp, empty, empty, 0, "direct")
    for got, want in zip(snapshot_host(host), before, strict=True):
        assert_bytes_equal(got, want, "host")


def test_destroy_is_idempotent_and_stops_transfers():
    host, dp = make_mha("layer_first", 4, torch.bfloat16)
    idx = torch.arange(4)
    host.destroy()
    host.destroy()
    assert host.kv_buffer is None
    with pytest.raises(RuntimeError, match="destroyed"):
        host.backup_from_device_all_layer(dp, idx, idx + 4, "kernel")
    with pytest.raises(RuntimeError, match="destroyed"):
        host.load_to_device_per_layer(dp, idx, idx + 4, 0, "kernel")
    with pytest.raises(RuntimeError, match="no KV bytes"):
        host.get_data_page(0)
    with pytest.raises(RuntimeError, match="no KV bytes"):
        host.get_page_buffer_meta(idx)
    assert host.is_stride_page_aligned() is False
    # the allocator keeps working (SGLang's destroy only drops the bytes)
    assert host.alloc(4) is not None


def test_split_heads_factor_must_be_an_integer():
    dev = MHATokenToKVPool(64, 4, torch.float16, 4, 8, 2)
    host = MHATokenToKVPoolHost(dev, 2.0, 0, 4, "page_head")
    with pytest.raises(TypeError, match="split_factor must be an integer"):
        host.get_split_heads_page_buffer_meta(torch.arange(4), 2.5)


# --- from test_contract_mha.py:
# Contract audit of the MHA host pools and HostKVCache (host-pool-contract.md §1-§4) as an outside
# caller sees them: device pools that are plain namespaces with only SGLang's attributes (§2.0), MTP
# draft packing (§1.2, §1.4, §2.1, §3.1), the allocator object, SGLang's abstract methods, the
# budget hook under its SGLang name, and hostile index arguments that must be refused without
# touching either pool.


L, H, D, P = 3, 2, 8, 16


def duck_mha_pool(
    size=64,
    page_size=P,
    dtype=torch.bfloat16,
    heads=H,
    head_dim=D,
    v_head_dim=None,
    layers=L,
    start_layer=0,
):
    """Only the attributes SGLang's MHATokenToKVPool has (§2.0): no methods, no sharding hooks."""
    v_head_dim = head_dim if v_head_dim is None else v_head_dim
    fp8 = (torch.float8_e4m3fn, torch.float8_e5m2)
    store = torch.uint8 if dtype in fp8 else dtype
    k = [torch.zeros(size + page_size, heads, head_dim, dtype=store) for _ in range(layers)]
    v = [torch.zeros(size + page_size, heads, v_head_dim, dtype=store) for _ in range(layers)]
    k_ptrs = torch.tensor([t.data_ptr() for t in k], dtype=torch.uint64)
    v_ptrs = torch.tensor([t.data_ptr() for t in v], dtype=torch.uint64)
    return types.SimpleNamespace(
        size=size,
        page_size=page_size,
        dtype=dtype,
        store_dtype=store,
        device="cpu",
        layer_num=layers,
        start_layer=start_layer,
        end_layer=start_layer + layers - 1,
        head_num=heads,
        head_dim=head_dim,
        v_head_dim=v_head_dim,
        row_dim=heads * head_dim,
        k_buffer=k,
        v_buffer=v,
        k_data_ptrs=k_ptrs,
        v_data_ptrs=v_ptrs,
        data_ptrs=torch.cat([k_ptrs, v_ptrs]),
    )


def _raw(tensors):
    return [t.view(torch.uint8) for t in tensors]


# ---- §2.0 / §2.1 / §2.2 with a namespace device pool -----------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=["bf16", "fp8"])
@pytest.mark.parametrize("layout", ["layer_first", "page_first", "page_first_direct", "page_head"])
def test_namespace_device_pool_geometry(layout, dtype):
    dp = duck_mha_pool(dtype=dtype)
    host = get_mha_host_pool_cls(dp)(dp, 2.0, 0, P, layout)
    assert type(host) is MHATokenToKVPoolHost
    e = 1 if dtype == torch.float8_e4m3fn else 2
    S, Pn = 144, 9  # 64 * 2.0 = 128 tokens -> 8 pages + 1
    assert (host.size, host.page_num, host.page_size) == (S, Pn, P)
    assert host.dtype == (torch.uint8 if e == 1 else torch.bfloat16)
    shape = {
        "layer_first": (2, L, S, H, D),
        "page_first": (2, S, L, H, D),
        "page_first_direct": (2, Pn, L, P, H, D),
        "page_head": (2, Pn, H, P, L, D),
    }[layout]
    assert tuple(host.kv_buffer.shape) == shape and host.kv_buffer.is_contiguous()
    assert host.size_per_token == 2 * L * H * D * e
    assert host.get_ksize_per_token() == L * H * D * e
    assert host.token_stride_size == H * D * e and host.layout_dim == L * H * D * e
    assert host.element_dim == H * D
    assert host.v_buffer.data_ptr() - host.k_buffer.data_ptr() == L * S * H * D * e
    assert host.k_data_ptrs.dtype == torch.uint64 and host.k_data_ptrs.device.type == "cpu"
    assert len(host.host_kv_data_refs) == 2 * len(host.k_data_refs)
    # No GPU staging exists, so the controller must keep kernel page_first indices on the device.
    assert host.can_use_write_back_jit is False
    assert (host.staging_page_capacity, host.staging_token_capacity) == (0, 0)
    assert host.staging_k_buffer is None and host.staging_v_buffer is None
    assert isinstance(host.allocator, _memory.HostTensorAllocator) and host.fd is None


PAIRS = [(b, lay, False) for b, lay in MHA_PAIRS] + [(b, lay, True) for b, lay in ASYM_PAIRS]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e5m2], ids=["bf16", "fp8"])
@pytest.mark.parametrize("backend,layout,asym", PAIRS)
def test_namespace_device_pool_round_trip(backend, layout, asym, dtype):
    dp = duck_mha_pool(dtype=dtype, v_head_dim=4 if asym else None)
    host = get_mha_host_pool_cls(dp)(dp, 2.0, 0, P, layout)
    assert isinstance(host, AsymmetricMHATokenToKVPoolHost) == asym
    round_trip(
        host,
        dp,
        backend,
        page_tokens([5, 0, 8], P),
        page_tokens([1, 4, 2], P),
        page_tokens([3, 1, 4], P),
    )


def test_asymmetric_has_no_shared_stride_and_no_staging():
    dp = duck_mha_pool(v_head_dim=4)
    host = get_mha_host_pool_cls(dp)(dp, 2.0, 0, P, "page_first")
    assert isinstance(host.kv_buffer, tuple) and len(host.kv_buffer) == 2
    for name in ("token_stride_size", "layout_dim"):
        with pytest.raises(AttributeError):
            getattr(host, name)
    assert host.staging_k_buffer is None and host.can_use_write_back_jit is False


@pytest.mark.parametrize("v_head_dim", [4, 16])
def test_the_symmetric_class_refuses_v_rows_of_another_width(v_head_dim, monkeypatch):
    """Its K and V planes have one width: over V rows narrower or wider than K's, every V page
    would be read or written at K's width. The factory picks the asymmetric class; a direct
    construction is refused by name before any host memory is taken."""
    dp = duck_mha_pool(v_head_dim=v_head_dim)
    allocations = []
    monkeypatch.setattr(MHATokenToKVPoolHost, "_allocate", lambda *a: allocations.append(a))
    with pytest.raises(
        ValueError, match=f"v_head_dim={v_head_dim}.*AsymmetricMHATokenToKVPoolHost"
    ):
        MHATokenToKVPoolHost(dp, 2.0, 0, P, "page_first")
    assert allocations == []
    assert get_mha_host_pool_cls(dp) is AsymmetricMHATokenToKVPoolHost


# ---- §1.2 / §1.4 / §2.1 / §3.1: MTP draft packing ------------------------------------------


def _mtp_pools(v_head_dim=None, drafts=2):
    target = duck_mha_pool(v_head_dim=v_head_dim)
    return target, [duck_mha_pool(v_head_dim=v_head_dim, layers=1) for _ in range(drafts)]


@pytest.mark.parametrize("drafts", [5, None, torch.zeros(2, 3), np.zeros(2)])
def test_draft_pools_that_are_not_a_sequence_of_pools_are_refused_by_name(drafts):
    target, _ = _mtp_pools()
    with pytest.raises(TypeError, match="mtp_draft_device_pools must be a sequence of pools"):
        MHATokenToKVPoolHost(target, 2.0, 0, P, "page_first", mtp_draft_device_pools=drafts)


def test_mtp_geometry_tables_and_log(caplog):
    target, drafts = _mtp_pools()
    with caplog.at_level(logging.INFO, logger="hostkv_rs"):
        host = MHATokenToKVPoolHost(
            target, 2.0, 0, P, "page_first", mtp_draft_device_pools=drafts, pool_label="kv"
        )
    assert (host.target_layer_num, host.layer_num) == (L, L + 2)
    assert host.mtp_draft_device_pools == tuple(drafts)
    assert host.size_per_token == 2 * (L + 2) * H * D * 2
    assert tuple(host.kv_buffer.shape) == (2, host.size, L + 2, H, D)
    packed_k = target.k_buffer + [t for d in drafts for t in d.k_buffer]
    packed_v = target.v_buffer + [t for d in drafts for t in d.v_buffer]
    assert all(a is b for a, b in zip(host.packed_device_k_buffers, packed_k, strict=True))
    assert all(a is b for a, b in zip(host.packed_device_v_buffers, packed_v, strict=True))
    assert len(host.packed_device_kv_buffers) == 2 * (L + 2)
    assert host.packed_device_k_data_ptrs.tolist() == [t.data_ptr() for t in packed_k]
    assert host.packed_device_v_data_ptrs.dtype == torch.uint64
    gb = host.size * host.size_per_token / 1e9
    assert (
        f"Allocating kv hierarchical KV host pool: {host.size} tokens, {gb:.2f} GB host memory, "
        f"packed MTP KV layers: target_layers={L}, draft_layers=2, total_layers={L + 2}."
    ) in caplog.text
    # Without drafts the packed tables do not exist and the plain log is used.
    plain = MHATokenToKVPoolHost(target, 2.0, 0, P, "page_first")
    assert plain.mtp_draft_device_pools == () and not hasattr(plain, "packed_device_k_buffers")


@pytest.mark.parametrize("backend,layout,asym", PAIRS)
def test_mtp_backup_and_draft_load_bytes(backend, layout, asym):
    target, drafts = _mtp_pools(v_head_dim=4 if asym else None)
    host = get_mha_host_pool_cls(target)(target, 2.0, 0, P, layout, mtp_draft_device_pools=drafts)
    rng = np.random.default_rng(3)
    for pool in (target, *drafts):
        fill_random(_raw(pool.k_buffer + pool.v_buffer), rng)
    fill_random(host_planes(host), rng)
    host_before = snapshot_host(host)
    # The oracle sees the packed layer lists as one device pool of L + 2 layers.
    packed = types.SimpleNamespace(
        k_buffer=host.packed_device_k_buffers, v_buffer=host.packed_device_v_buffers
    )
    h_idx, d_idx = page_tokens([6, 2], P), page_tokens([3, 1], P)
    hi, di = torch.as_tensor(h_idx), torch.as_tensor(d_idx)
    # SGLang backs up the packed target + draft layers whatever pool is passed.
    host.backup_from_device_all_layer(target, hi, di, backend)
    want_host = expected_backup(host, host_before, packed, h_idx, d_idx)
    assert_host_equal(host, want_host, "host after MTP backup")

    # Draft k (host layer L + k) loads into layer 0 of the draft device pool it is given.
    for k, draft in enumerate(drafts):
        fill_random(_raw(draft.k_buffer + draft.v_buffer), rng)
        before = snapshot_device(draft)
        load_rows = page_tokens([4], P)
        host_rows = page_tokens([2], P)
        host.load_to_device_per_layer(
            draft,
            torch.as_tensor(host_rows),
            torch.as_tensor(load_rows),
            L + k,
            backend,
            is_draft=True,
        )
        # expected_load writes device layer == host layer; re-index the draft's single layer.
        widened = [[np.zeros_like(plane[0])] * (L + k) + plane for plane in before]
        want = expected_load(host, want_host, widened, host_rows, load_rows, L + k)
        assert_device_equal(draft, [plane[L + k :] for plane in want], f"draft {k} after load")
    assert_host_equal(host, want_host, "host after draft loads")


@pytest.mark.parametrize("layer_id", [0, L - 1, L + 2, -1])
def test_mtp_draft_load_out_of_range_is_refused(layer_id):
    target, drafts = _mtp_pools()
    host = MHATokenToKVPoolHost(target, 2.0, 0, P, "layer_first", mtp_draft_device_pools=drafts)
    rng = np.random.default_rng(0)
    fill_random(_raw(drafts[0].k_buffer + drafts[0].v_buffer), rng)
    fill_random(host_planes(host), rng)
    dev_before, host_before = snapshot_device(drafts[0]), snapshot_host(host)
    idx = torch.arange(P, 2 * P)
    with pytest.raises(TransferError, match="not a packed MTP draft layer"):
        host.load_to_device_per_layer(drafts[0], idx, idx, layer_id, "kernel", is_draft=True)
    assert_device_equal(drafts[0], dev_before)
    assert_host_equal(host, host_before)


def test_is_draft_without_drafts_is_refused():
    dp = duck_mha_pool()
    host = MHATokenToKVPoolHost(dp, 2.0, 0, P, "layer_first")
    idx = torch.arange(P)
    with pytest.raises(TransferError, match=re.escape("this host pool holds no drafts")):
        host.load_to_device_per_layer(dp, idx, idx + P, 0, "kernel", is_draft=True)


def test_mtp_draft_with_more_than_one_layer_is_refused_at_backup():
    target = duck_mha_pool()
    host = MHATokenToKVPoolHost(
        target, 2.0, 0, P, "layer_first", mtp_draft_device_pools=[duck_mha_pool(layers=2)]
    )
    before = snapshot_host(host)
    idx = torch.arange(P)
    with pytest.raises(TransferError, match="packed target \\+ MTP draft device pools"):
        host.backup_from_device_all_layer(target, idx, idx + P, "kernel")
    assert_host_equal(host, before)


# ---- §1.3 / §1.4 / §4.3: base class surface -------------------------------------------------


class _SlotsOnly(HostKVCache):
    """A subclass with only SGLang's two geometry hooks: the transfers and flat pages are abstract
    too, as in SGLang, so it cannot be built."""

    def get_size_per_token(self):
        self.layer_num = 1
        return 8

    def init_kv_buffer(self):
        return torch.zeros(self.size, 8, dtype=torch.uint8)


class _NoTransfers(_SlotsOnly):
    """The allocator alone: every transfer and flat page raises."""

    def load_to_device_per_layer(self, *args, **kwargs):
        raise NotImplementedError()

    backup_from_device_all_layer = get_data_page = load_to_device_per_layer
    get_dummy_flat_data_page = set_from_flat_data_page = load_to_device_per_layer


def test_sglangs_seven_abstract_methods():
    assert HostKVCache.__abstractmethods__ == {
        "backup_from_device_all_layer",
        "get_data_page",
        "get_dummy_flat_data_page",
        "get_size_per_token",
        "init_kv_buffer",
        "load_to_device_per_layer",
        "set_from_flat_data_page",
    }
    dp = duck_mha_pool()
    for cls in (_SlotsOnly, HostKVCache):
        with pytest.raises(TypeError, match="abstract method"):
            cls(dp, 1.0, 0, P, "layer_first", True, "cpu")


def test_budget_hook_under_sglang_name(monkeypatch):
    dp = duck_mha_pool()
    requested = 144 * 2 * L * H * D * 2
    monkeypatch.setattr(base, "host_memory_budget_bytes", lambda: requested - 1)
    want = (
        f"Not enough host memory available. Requesting {requested / 1e9:.2f} GB but only have "
        f"{(requested - 1) / 1e9:.2f} GB free. Please reduce the size of the hierarchical cache."
    )
    with pytest.raises(ValueError, match=re.escape(want)):
        MHATokenToKVPoolHost(dp, 2.0, 0, P, "layer_first")
    monkeypatch.setattr(base, "host_memory_budget_bytes", lambda: requested)
    MHATokenToKVPoolHost(dp, 2.0, 0, P, "layer_first")


def test_budget_follows_psutil(monkeypatch):
    class VM:
        available = 10 * 1024**3 + 1000

    monkeypatch.setattr(_memory.psutil, "virtual_memory", lambda: VM)
    assert base.host_memory_budget_bytes() == 1000
    with pytest.raises(ValueError, match="but only have 0.00 GB free"):
        MHATokenToKVPoolHost(duck_mha_pool(), 2.0, 0, P, "layer_first")


def test_host_tensor_allocator():
    assert HostTensorAllocator is _memory.HostTensorAllocator  # exported like SGLang's pool_host
    alloc = HostTensorAllocator()
    t = alloc.allocate((3, 5), torch.bfloat16, "cpu")
    assert t.shape == (3, 5) and t.dtype == torch.bfloat16 and bool((t == 0).all())
    with pytest.raises(
        AssertionError,
        match=re.escape("HostTensorAllocator only supports CPU allocations; got device='cuda'"),
    ):
        alloc.allocate((3,), torch.uint8, "cuda")


def test_mxfp8_detection_ignores_mock_attributes():
    dp = mock.MagicMock()
    dp.head_dim, dp.v_head_dim = 8, 8  # a Mock's is_mxfp8 is a truthy Mock, not True
    assert get_mha_host_pool_cls(dp) is MHATokenToKVPoolHost
    dp.v_head_dim = 4
    assert get_mha_host_pool_cls(dp) is AsymmetricMHATokenToKVPoolHost


# ---- hostile index arguments -----------------------------------------------------------------


HOSTILE = {
    "meta": (lambda i: torch.empty(i.numel(), dtype=torch.int64, device="meta"), ValueError),
    "none": (lambda i: None, TypeError),
    "float-list": (lambda i: [float(x) + 0.5 for x in i.tolist()], TypeError),
    "float-ndarray": (lambda i: i.numpy().astype(np.float64), TypeError),
    "complex": (lambda i: i.to(torch.complex64), TypeError),
    "ragged": (lambda i: [[0], [1, 2]], TypeError),
}


@pytest.mark.parametrize("kind", HOSTILE)
@pytest.mark.parametrize("side", ["host", "device"])
@pytest.mark.parametrize("op", ["backup", "load"])
def test_hostile_transfer_indices_change_nothing(op, side, kind):
    make, exc = HOSTILE[kind]
    dp = duck_mha_pool()
    host = MHATokenToKVPoolHost(dp, 2.0, 0, P, "page_first")
    rng = np.random.default_rng(1)
    fill_random(_raw(dp.k_buffer + dp.v_buffer), rng)
    fill_random(host_planes(host), rng)
    host_before, dev_before = snapshot_host(host), snapshot_device(dp)
    good = torch.arange(P, 2 * P)
    bad = make(good)
    hi, di = (bad, good) if side == "host" else (good, bad)
    with pytest.raises(exc):
        if op == "backup":
            host.backup_from_device_all_layer(dp, hi, di, "kernel")
        else:
            host.load_to_device_per_layer(dp, hi, di, 0, "kernel")
    assert_host_equal(host, host_before)
    assert_device_equal(dp, dev_before)


@pytest.mark.parametrize("kind", HOSTILE)
def test_hostile_free_changes_nothing(kind):
    make, exc = HOSTILE[kind]
    host = MHATokenToKVPoolHost(duck_mha_pool(), 2.0, 0, P, "layer_first")
    slots = host.alloc(2 * P).clone()
    with pytest.raises(exc):
        host.free(make(slots[:2]))
    assert host.available_size() == host.size - 2 * P
    assert bool(host.slot_used[slots].all()) and host.num_release_slots == 0


def test_free_accepts_empty_and_integer_lists():
    host = MHATokenToKVPoolHost(duck_mha_pool(), 2.0, 0, P, "layer_first")
    host.alloc(P)
    assert host.free([]) == 0
    assert host.free([1, 2]) == 2 and host.free(np.array([3], dtype=np.int16)) == 1
    assert host.available_size() == host.size - P + 3


# ---- §2.0: the reference device pools take SGLang's constructor arguments --------------------


def test_reference_pools_take_sglang_positional_arguments():
    # SGLang: (size, page_size, dtype, head_num, head_dim, layer_num, device,
    # enable_memory_saver, v_head_dim, swa_head_num, swa_head_dim, swa_v_head_dim, start_layer,
    # end_layer, enable_alt_stream, enable_kv_cache_copy)
    dp = MHATokenToKVPool(32, 8, torch.bfloat16, 2, 8, 3, "cpu", False, 4, None, None, None, 1, 3)
    assert (dp.v_head_dim, dp.start_layer, dp.end_layer, dp.enable_memory_saver) == (4, 1, 3, False)
    assert get_mha_host_pool_cls(dp) is AsymmetricMHATokenToKVPoolHost
    swa = MHATokenToKVPool(
        32, 8, torch.bfloat16, 2, 8, 3, "cpu", False, swa_head_num=4, swa_head_dim=16
    )
    assert (swa.head_num, swa.head_dim, swa.v_head_dim, swa.row_dim) == (4, 16, 16, 64)
    assert tuple(swa.k_buffer[0].shape) == (40, 4, 16)
    # SGLang: (size, page_size, dtype, kv_lora_rank, qk_rope_head_dim, layer_num, device,
    # enable_memory_saver, start_layer, end_layer, use_nsa, override_kv_cache_dim)
    mla = MLATokenToKVPool(32, 8, torch.uint8, 512, 64, 2, "cpu", False, None, None, True, 656)
    assert mla.kv_cache_dim == 656 and tuple(mla.kv_buffer[0].shape) == (40, 1, 656)
    assert MLATokenToKVPool(32, 8, torch.bfloat16, 12, 4, 2).kv_cache_dim == 16
    with pytest.raises(ValueError, match="disagree"):
        MLATokenToKVPool(
            32, 8, torch.uint8, 512, 64, 2, override_kv_cache_dim=656, kv_cache_dim=600
        )


@pytest.mark.parametrize("backend", [["kernel"], {"kernel": 1}, 3, b"kernel"], ids=repr)
@pytest.mark.parametrize("v_head_dim", [None, 4], ids=["mha", "asym"])
def test_non_string_io_backend_gets_sglang_value_error(backend, v_head_dim):
    dp = duck_mha_pool(v_head_dim=v_head_dim)
    host = get_mha_host_pool_cls(dp)(dp, 2.0, 0, P, "page_first")
    idx = torch.arange(P)
    prefix = "Unsupported IO backend" + (
        "" if v_head_dim is None else " for models with head_dim != v_head_dim"
    )
    want = f"{prefix}: {backend}"
    with pytest.raises(ValueError, match=re.escape(want)):
        host.load_to_device_per_layer(dp, idx, idx + P, 0, backend)
    with pytest.raises(ValueError, match=re.escape(want)):
        host.backup_from_device_all_layer(dp, idx, idx + P, backend)


def test_meta_flat_page_is_refused_and_changes_nothing():
    host = MHATokenToKVPoolHost(duck_mha_pool(), 2.0, 0, P, "layer_first")
    fill_random(host_planes(host), np.random.default_rng(2))
    before = snapshot_host(host)
    page = torch.empty(host.get_dummy_flat_data_page().numel(), dtype=host.dtype, device="meta")
    with pytest.raises(ValueError, match="meta device"):
        host.set_from_flat_data_page(P, page)
    assert_host_equal(host, before)


def test_dcp_slot_space_on_a_pool_without_transfers():
    """§1.3 / §4.1: page_size arrives widened; size/page_size are per rank, slots are logical."""
    dp = duck_mha_pool()

    class _Dcp(_NoTransfers):
        dcp_aware_transfers = True

    pool = _Dcp(dp, 1.0, 0, 2 * P, "layer_first", True, "cpu", "default", 2, 1)
    assert (pool.dcp_size, pool.dcp_rank, pool.page_size) == (2, 1, P)
    assert (pool.size, pool.page_num) == (80, 5)
    assert (pool.logical_size, pool.logical_page_size) == (160, 2 * P)
    assert pool.available_size() == 160 and pool.slot_used.numel() == 160
    with pytest.raises(AssertionError, match="multiple of the page size"):
        pool.alloc(P)
    slots = pool.alloc(2 * P)
    assert slots.tolist() == list(range(2 * P))
    assert pool.maybe_dcp_kernel_indices(slots).tolist() == list(range(P))
    assert pool.free(slots) == 2 * P
    with pytest.raises(ValueError, match="dcp_rank"):
        _Dcp(dp, 1.0, 0, 2 * P, "layer_first", True, "cpu", "default", 2, 2)
    # Pools whose transfers do not translate logical slots still refuse DCP.
    with pytest.raises(NotImplementedError, match="decode context parallelism"):
        _NoTransfers(dp, 1.0, 0, 2 * P, "layer_first", True, "cpu", "default", 2, 0)


@pytest.mark.parametrize("layer_id", [-1, L, 10**19])
def test_out_of_range_layer_returns_and_changes_nothing(layer_id):
    # SGLang returns for a target layer the pool does not hold (all releases).
    dp = duck_mha_pool()
    host = MHATokenToKVPoolHost(dp, 2.0, 0, P, "page_first")
    fill_random(host_planes(host), np.random.default_rng(4))
    dev_before = snapshot_device(dp)
    idx = torch.arange(P)
    assert host.load_to_device_per_layer(dp, idx, idx + P, layer_id, "kernel") is None
    assert_device_equal(dp, dev_before)


# --- from test_asymmetric.py:
# AsymmetricMHATokenToKVPoolHost (head_dim != v_head_dim) against host-pool-contract.md §2.2,
# §3.3, §4.4, §4.5 and the factory of §1.1 (the page round trips of every pool kind are in
# core/test_transfers.py).


FLAT_TEXT = (
    "Models with head_dim != v_head_dim do not support the flat-page interface used by HiCache "
    "L3 storage backends {hf3fs, eic, nixl}. Use a backend that does not use this interface "
    "(e.g. mooncake, simm)."
)


def test_kernel_page_first_scattered_tokens():
    rng = np.random.default_rng(5)
    host, dp = make_asym("page_first", 16, torch.bfloat16)
    n = 19
    rows = DEVICE_PAGES * 16 + 16
    round_trip(
        host,
        dp,
        "kernel",
        rng.permutation(host.size)[:n],
        rng.permutation(np.arange(1, rows))[:n],
        rng.permutation(np.arange(1, rows))[:n],
    )


def test_factory_picks_the_class():
    sym = MHATokenToKVPool(32, 16, torch.bfloat16, 2, 8, 3)
    asym = MHATokenToKVPool(32, 16, torch.bfloat16, 2, 8, 3, v_head_dim=4)
    assert get_mha_host_pool_cls(sym) is MHATokenToKVPoolHost
    assert get_mha_host_pool_cls(asym) is AsymmetricMHATokenToKVPoolHost


class MHATokenToKVPoolMXFP8(MHATokenToKVPool):
    """Stand-in for SGLang's MXFP8 device pool class (recognised by class name)."""


def test_factory_mxfp8():
    asym = MHATokenToKVPoolMXFP8(32, 16, torch.bfloat16, 2, 8, 3, v_head_dim=4)
    with pytest.raises(
        NotImplementedError,
        match=re.escape("MXFP8 HiCache does not support asymmetric K/V head dimensions yet."),
    ):
        get_mha_host_pool_cls(asym)
    sym = MHATokenToKVPoolMXFP8(32, 16, torch.bfloat16, 2, 8, 3)
    with pytest.raises(NotImplementedError, match="MXFP8"):
        get_mha_host_pool_cls(sym)
    flagged = MHATokenToKVPool(32, 16, torch.bfloat16, 2, 8, 3)
    flagged.is_mxfp8 = True
    with pytest.raises(NotImplementedError, match="MXFP8"):
        get_mha_host_pool_cls(flagged)


@pytest.mark.parametrize("layout", ["page_first", "page_first_direct"])
def test_geometry_two_buffers_no_shared_stride(layout):
    P, H, D, Dv, e = 4, 2, 8, 4, 2
    host, _ = make_asym(layout, P, torch.bfloat16, heads=H, head_dim=D, v_head_dim=Dv)
    L, S, Pn = LAYERS, host.size, host.page_num
    assert isinstance(host.kv_buffer, tuple) and len(host.kv_buffer) == 2
    k, v = host.kv_buffer
    assert host.k_buffer is k and host.v_buffer is v
    if layout == "page_first":
        assert k.shape == (S, L, H, D) and v.shape == (S, L, H, Dv)
    else:
        assert k.shape == (Pn, L, P, H, D) and v.shape == (Pn, L, P, H, Dv)
    assert host.size_per_token == (D + Dv) * H * L * e
    assert host.get_ksize_per_token() == D * H * L * e
    for name in ("token_stride_size", "layout_dim"):
        with pytest.raises(AttributeError):
            getattr(host, name)
    assert host.get_hybrid_pool_buffer() == [k, v]


@pytest.mark.parametrize("layout", ["page_first", "page_first_direct"])
def test_get_page_buffer_meta(layout):
    P, H, D, Dv, e = 4, 2, 8, 4, 2
    host, _ = make_asym(layout, P, torch.bfloat16, heads=H, head_dim=D, v_head_dim=Dv)
    L = LAYERS
    kb, vb = host.k_buffer.data_ptr(), host.v_buffer.data_ptr()
    pages = [4, 1]
    ptrs, sizes = host.get_page_buffer_meta(torch.tensor(page_tokens(pages, P)))
    want = []
    for p in pages:
        want += [kb + p * L * P * H * D * e, vb + p * L * P * H * Dv * e]
    assert ptrs == want
    assert sizes == [L * P * H * D * e, L * P * H * Dv * e] * 2


def test_flat_pages_and_split_heads_are_refused():
    host, _ = make_asym("page_first", 4, torch.bfloat16)
    for call in (
        lambda: host.get_data_page(0),
        lambda: host.get_dummy_flat_data_page(),
        lambda: host.set_from_flat_data_page(0, torch.zeros(1)),
    ):
        with pytest.raises(NotImplementedError, match=re.escape(FLAT_TEXT)):
            call()
    with pytest.raises(
        NotImplementedError,
        match=re.escape(
            "get_split_heads_page_buffer_meta requires layout='page_head', which is not "
            "supported for models with head_dim != v_head_dim."
        ),
    ):
        host.get_split_heads_page_buffer_meta(torch.arange(4), 1)


def test_is_stride_page_aligned_checks_both_buffers():
    host, _ = make_asym(
        "page_first_direct", 64, torch.bfloat16, heads=2, head_dim=32, v_head_dim=16
    )
    # K page 64*5*2*32*2 = 40960 = 10*4096, V page 20480 = 5*4096
    assert host.is_stride_page_aligned() is True
    odd, _ = make_asym("page_first_direct", 64, torch.bfloat16, heads=2, head_dim=32, v_head_dim=4)
    # V page 64*5*2*4*2 = 5120, not a multiple of 4096
    assert odd.is_stride_page_aligned() is False


def test_get_mha_host_pool_cls_takes_the_device_pool_or_buffer_info_by_either_name():
    # 0.5.23 names the parameter buffer_info; earlier releases device_pool.
    dp = duck_mha_pool()
    assert get_mha_host_pool_cls(dp) is MHATokenToKVPoolHost
    assert get_mha_host_pool_cls(buffer_info=dp) is MHATokenToKVPoolHost
    assert get_mha_host_pool_cls(device_pool=dp) is MHATokenToKVPoolHost
    with pytest.raises(TypeError, match="got neither"):
        get_mha_host_pool_cls()
    with pytest.raises(TypeError, match="got both"):
        get_mha_host_pool_cls(dp, buffer_info=dp)


@pytest.mark.parametrize(
    ("kwargs", "error", "text"),
    [
        # SGLang divides by these: ours are ValueErrors naming them and ZeroDivisionErrors too.
        ({"page_size": 0}, ZeroDivisionError, "page_size must be positive, got 0"),
        ({"page_size": -4}, ValueError, "page_size must be positive, got -4"),
        ({"layout": None}, ValueError, "Unsupported layout: None"),
        ({"layout": 5}, ValueError, "Unsupported layout: 5"),
        ({"layout": b"page_first"}, ValueError, "Unsupported layout: b'page_first'"),
    ],
)
def test_sizes_and_layouts_sglang_refuses_raise_its_exception_class(kwargs, error, text):
    dev = MHATokenToKVPool(64, 4, torch.bfloat16, head_num=2, head_dim=8, layer_num=2)
    args = {"host_to_device_ratio": 2.0, "host_size": 0, "page_size": 4, "layout": "page_first"}
    with pytest.raises(error, match=f"^{re.escape(text)}$") as exc:
        MHATokenToKVPoolHost(dev, **{**args, **kwargs})
    assert isinstance(exc.value, ValueError)


def test_the_asymmetric_pool_refuses_a_missing_layout_with_its_own_text():
    dev = MHATokenToKVPool(64, 4, torch.bfloat16, head_num=2, head_dim=8, layer_num=2)
    dev.v_head_dim = 4
    text = (
        "Unsupported layout for models with head_dim != v_head_dim: None; expected "
        "'page_first' or 'page_first_direct'."
    )
    with pytest.raises(ValueError, match=f"^{re.escape(text)}$"):
        AsymmetricMHATokenToKVPoolHost(dev, 2.0, 0, 4, None)


# ---- strided device rows (SGLang 0.5.22+'s unified pools) -------------------------------------


def strided_mha_pool(seed=0, pad=6):
    """A device pool whose layers are views of one token-major buffer, as SGLang's unified pools
    hand them over: token t holds every layer's K and V row, then `pad` spare elements, so each
    layer's rows are a whole entry apart."""
    dp = duck_mha_pool(dtype=torch.float32)
    row = H * D
    entries = torch.randn(
        dp.size + dp.page_size, L * 2 * row + pad, generator=torch.Generator().manual_seed(seed)
    )
    dp.k_buffer = [entries[:, 2 * l * row :][:, :row].view(-1, H, D) for l in range(L)]
    dp.v_buffer = [entries[:, (2 * l + 1) * row :][:, :row].view(-1, H, D) for l in range(L)]
    dp.entries = entries
    return dp


@pytest.mark.parametrize(
    "layout, backend",
    [
        ("layer_first", "kernel"),
        ("page_first", "kernel"),
        ("layer_first", "direct"),
    ],
)
def test_strided_device_rows_round_trip_and_touch_nothing_else(layout, backend):
    src, dst = strided_mha_pool(1), strided_mha_pool(2)
    host = MHATokenToKVPoolHost(src, 2.0, 0, P, layout)
    assert not host.device_rows_packed
    assert host.device_row_stride_bytes == (L * 2 * H * D + 6) * 4
    h, d, d2 = host.alloc(2 * P), torch.arange(P, 3 * P), torch.arange(2 * P, 4 * P)
    host.backup_from_device_all_layer(src, h, d, backend)
    want = dst.entries.clone()
    kv = L * 2 * H * D  # the rows' elements of an entry; the padding after them stays
    want[d2, :kv] = src.entries[d, :kv]
    for layer in range(L):
        host.load_to_device_per_layer(dst, h, d2, layer, backend)
    assert torch.equal(dst.entries, want)


@pytest.mark.parametrize(
    "layout, backend, load_kernel, backup_kernel",
    [
        (
            "page_first_direct",
            "direct",
            "transfer_kv_per_layer_direct_pf_lf",
            "transfer_kv_all_layer_direct_lf_pf",
        ),
        # SGLang 0.5.22+ refuses page_head on every platform: no JIT kernel takes it.
        ("page_head", "kernel", "transfer_kv_per_layer_ph_lf", "transfer_kv_all_layer_lf_ph"),
    ],
)
def test_strided_device_rows_are_refused_where_sglang_has_no_copy_for_them(
    layout, backend, load_kernel, backup_kernel
):
    src = strided_mha_pool()
    host = MHATokenToKVPoolHost(src, 2.0, 0, P, layout)
    h = host.alloc(P)
    host_before = host.kv_buffer.clone()
    before = src.entries.clone()
    row = H * D * 4
    pitch = (L * 2 * H * D + 6) * 4
    for kernel, call in [
        (load_kernel, lambda: host.load_to_device_per_layer(src, h, torch.arange(P), 0, backend)),
        (
            backup_kernel,
            lambda: host.backup_from_device_all_layer(src, h, torch.arange(P), backend),
        ),
    ]:
        with pytest.raises(NotImplementedError) as e:
            call()
        assert str(e.value) == (
            f"HiCache: {kernel} steps device rows by the row width ({row} B), but this device "
            f"pool's rows are {pitch} B apart. Use the JIT HiCache kernels with a layer_first "
            "or page_first host layout."
        )
        assert torch.equal(src.entries, before)
        assert torch.equal(host.kv_buffer, host_before)


def test_strided_device_rows_must_share_one_stride():
    src = strided_mha_pool()
    src.k_buffer[1] = src.k_buffer[1].contiguous()  # one packed layer among strided ones
    with pytest.raises(NotImplementedError, match="do not share one row stride"):
        MHATokenToKVPoolHost(src, 2.0, 0, P, "layer_first")
    # Two strides, no packed layer: SGLang's transfers take one stride.
    src = strided_mha_pool()
    wider = torch.zeros(src.entries.shape[0], src.entries.shape[1] + 4)
    src.v_buffer = [wider[:, l * H * D :][:, : H * D].view(-1, H, D) for l in range(L)]
    stride = 4 * src.entries.shape[1]
    with pytest.raises(NotImplementedError, match=rf"strided rows \[{stride}, {stride + 16}\] B"):
        MHATokenToKVPoolHost(src, 2.0, 0, P, "layer_first")


def test_a_device_pool_whose_layers_are_a_nested_tensor_is_refused_by_name():
    # torch fails inside iterating one ("NestedTensorImpl doesn't support sizes").
    import warnings

    nested = duck_mha_pool()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "nested tensors are in prototype stage"
        nested.k_buffer = torch.nested.nested_tensor(list(nested.k_buffer))
    with pytest.raises(TypeError, match="device pool k_buffer: .* got a nested tensor"):
        MHATokenToKVPoolHost(nested, 2.0, 0, P, "layer_first")
    host = MHATokenToKVPoolHost(duck_mha_pool(), 2.0, 0, P, "layer_first")
    h = host.alloc(P)
    with pytest.raises(TypeError, match="device pool k_buffer: .* got a nested tensor"):
        host.load_to_device_per_layer(nested, h, torch.arange(P), 0, "kernel")
