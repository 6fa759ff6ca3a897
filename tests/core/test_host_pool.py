"""Binding-level behaviour of hostkv_rs._core: buffer protocol, lifetimes, errors, transfers."""

from __future__ import annotations

import gc
import os
import re
import subprocess
import sys

import numpy as np
import psutil
import pytest
import torch
from hostkv_rs import _core

PAIRS = [
    ("layer_first", "kernel"),
    ("page_first", "kernel"),
    ("page_head", "kernel"),
    ("layer_first", "direct"),
    ("page_first_direct", "direct"),
]


def idx(t: torch.Tensor) -> tuple[int, int, int, bool]:
    return (t.data_ptr(), t.numel(), t.element_size(), False)


# ---------------------------------------------------------------- HostRegion


def test_buffer_protocol_is_writable_bytes():
    r = _core.HostRegion(10_000)
    m = memoryview(r)
    assert (m.nbytes, m.format, m.itemsize, m.ndim, m.readonly) == (10_000, "B", 1, 1, False)
    assert len(r) == r.nbytes == 10_000
    assert r.address % 4096 == 0
    assert not any(m)  # pre-touched zeros
    m[9_999] = 7
    a = np.frombuffer(r, dtype=np.uint8)
    t = torch.frombuffer(r, dtype=torch.uint8)
    assert a[9_999] == 7 and int(t[9_999]) == 7
    t[0] = 3
    assert m[0] == 3 and a[0] == 3
    assert t.data_ptr() == r.address
    m.release()


def test_view_keeps_region_alive():
    r = _core.HostRegion(1 << 16)
    t = torch.frombuffer(r, dtype=torch.uint8)
    del r
    gc.collect()
    t.fill_(5)
    assert int(t.sum()) == 5 << 16


def _rss() -> int:
    return psutil.Process().memory_info().rss


def test_rss_returns_after_last_view_and_region_die():
    n = 64 << 20
    gc.collect()
    before = _rss()
    r = _core.HostRegion(n)
    assert _rss() - before > n * 0.9, "region was not pre-touched"
    t = torch.frombuffer(r, dtype=torch.uint8).view(torch.int32)
    del r
    gc.collect()
    assert _rss() - before > n * 0.9, "memory freed while a view is alive"
    assert int(t[-1]) == 0
    del t
    gc.collect()
    assert _rss() - before < n * 0.1, "memory not returned after the last view died"


def test_zero_byte_region():
    r = _core.HostRegion(0)
    assert (r.nbytes, r.address, len(r), r.pinned, r.registered_ranges) == (0, 0, 0, False, [])
    assert bytes(r) == b""
    assert np.frombuffer(r, dtype=np.uint8).size == 0
    r.unregister_cuda()


def test_region_options_and_errors():
    r = _core.HostRegion(3 << 20, hugepage="2MB", hugepage_mode="prefer", pretouch_threads=2)
    assert r.hugepage_tier in ("2MB", "thp", "base")
    assert r.nbytes == 3 << 20
    with pytest.raises(ValueError, match="Unsupported hugepage size"):
        _core.HostRegion(4096, hugepage="3MB")
    with pytest.raises(ValueError, match="Unsupported hugepage mode"):
        _core.HostRegion(4096, hugepage_mode="sometimes")
    # None is each default; another type is a TypeError naming the parameter.
    assert _core.HostRegion(4096, hugepage=None, hugepage_mode=None).hugepage_tier == "base"
    with pytest.raises(TypeError, match=r"hugepage must be a string \('' for base pages"):
        _core.HostRegion(4096, hugepage=2)
    with pytest.raises(TypeError, match="hugepage_mode must be a string .*got True"):
        _core.HostRegion(4096, hugepage_mode=True)
    with pytest.raises(ValueError, match=re.escape("nbytes must lie in [0, 2**63), got -1")):
        _core.HostRegion(-1)
    with pytest.raises(ValueError, match="NUMA node 4000 does not exist"):
        _core.HostRegion(4096, numa_node=4000)
    assert _core.HostRegion(4096, numa_node=0).numa_node == 0
    # register_cuda's sizes are checked by name before CUDA is asked (no OverflowError)
    for kwargs, text in (
        ({"granularity": -1}, "granularity must lie in [0, 2**64), got -1"),
        ({"chunk_limit": 2**64}, "chunk_limit must lie in [0, 2**64), got 18446744073709551616"),
    ):
        with pytest.raises(ValueError, match=re.escape(text)):
            r.register_cuda(**kwargs)
    with pytest.raises(TypeError, match="not an \\(owner, byte_offset\\) pair"):
        _core.HostRegion.adopt((torch.zeros(16, dtype=torch.uint8), 4))


def test_hugepage_required_fails_cleanly_or_gets_hugepages():
    try:
        r = _core.HostRegion(1 << 20, hugepage="1GB", hugepage_mode="required")
    except MemoryError as e:
        assert "1GB hugepages" in str(e)
    else:
        assert r.hugepage_tier == "1GB"


@pytest.mark.skipif(_core.cuda_available(), reason="checks the no-CUDA path")
def test_register_without_cuda_raises_runtime_error():
    r = _core.HostRegion(4096)
    with pytest.raises(RuntimeError, match="CUDA is not available"):
        r.register_cuda(0, 1 << 30)
    assert not r.pinned
    r.unregister_cuda()


def test_module_surface():
    assert isinstance(_core.__version__, str)
    assert isinstance(_core.cuda_available(), bool)
    assert "hostkv_rs" in _core.runtime_info()
    _core.check_device_errors()


def test_transfer_error_is_value_and_runtime_error():
    te = _core.TransferError
    assert issubclass(te, ValueError) and issubclass(te, RuntimeError)
    assert te.__module__ == "hostkv_rs._core"
    for base in (ValueError, RuntimeError):
        with pytest.raises(base):
            raise te("x")


# ---------------------------------------------------------------- HostPool geometry


def test_plane_nbytes_and_offsets():
    assert _core.HostPool.plane_nbytes("page_first", 61, 12, 4, 1152) == 61 * 12 * 1152
    assert _core.HostPool.plane_nbytes("page_head", 3, 8, 4, 24, head_num=4) == 3 * 8 * 24
    with pytest.raises(ValueError, match="not divisible by head_num"):
        _core.HostPool.plane_nbytes("page_head", 3, 8, 4, 24, head_num=5)
    with pytest.raises(ValueError, match="Unsupported layout: nope"):
        _core.HostPool.plane_nbytes("nope", 3, 8, 4, 24)
    with pytest.raises(ValueError, match="overflows"):
        _core.HostPool.plane_nbytes("layer_first", 1 << 30, 1 << 30, 1, 1 << 20)
    core = _core.HostPool.from_geometry(
        "page_head", 3, 8, 4, [24], [_core.HostRegion(3 * 8 * 24)], head_num=2
    )
    L, P, seg = 3, 4, 12
    t, l, h = 6, 2, 1
    assert (
        core.offset(0, t, l, h)
        == (t // P) * P * L * 24 + h * P * L * seg + (t % P) * L * seg + l * seg
    )
    with pytest.raises(_core.TransferError):
        core.offset(0, 8, 0)
    with pytest.raises(_core.TransferError):
        core.offset(1, 0, 0)
    with pytest.raises(_core.TransferError):
        core.offset(0, -1, 0)
    assert (core.layout, core.num_layers, core.rows, core.page_size, core.head_num) == (
        "page_head",
        3,
        8,
        4,
        2,
    )


def test_pool_core_rejects_bad_construction():
    region = _core.HostRegion(64)
    with pytest.raises(ValueError, match="1 or 2 planes"):
        _core.HostPool.from_geometry("page_first", 2, 4, 1, [8, 8, 8], [region] * 3)
    with pytest.raises(ValueError, match="cannot hold 64 bytes"):
        _core.HostPool.from_geometry("page_first", 2, 4, 1, [8], [_core.HostRegion(63)])
    with pytest.raises(ValueError, match="cannot hold 64 bytes"):
        _core.HostPool.from_geometry("page_first", 2, 4, 1, [8], [(region, 1)])
    with pytest.raises(ValueError, match="lies past the end"):
        _core.HostPool.from_geometry("page_first", 2, 4, 1, [8], [(region, 65)])
    with pytest.raises(ValueError, match="not a multiple of page_size"):
        _core.HostPool.from_geometry("page_first_direct", 2, 6, 4, [8], [region])


def test_pool_core_never_takes_a_bare_address_and_keeps_its_memory_alive():
    with pytest.raises(TypeError, match="must be a HostRegion, a CPU torch tensor"):
        _core.HostPool.from_geometry("layer_first", 1, 4, 1, [8], [1 << 20])
    with pytest.raises(ValueError, match="must be host memory"):
        _core.HostPool.from_geometry("layer_first", 1, 4, 1, [8], [torch.zeros(32, device="meta")])
    with pytest.raises(ValueError, match="contiguous"):
        _core.HostPool.from_geometry("layer_first", 1, 4, 1, [8], [torch.zeros(8, 8)[:, 0]])
    host = torch.zeros(32, dtype=torch.uint8)
    core = _core.HostPool.from_geometry("layer_first", 1, 4, 1, [8], [host])
    addr = host.data_ptr()
    host.set_(torch.zeros(1, dtype=torch.uint8))  # the tensor lets go of its storage...
    del host
    gc.collect()
    assert core.plane_addrs == [addr]
    dev = torch.arange(32, dtype=torch.uint8)
    idx = torch.arange(4)
    arg = (idx.data_ptr(), 4, 8, False)
    # ...but the core still holds it: a transfer after that writes memory the core owns.
    core.backup("kernel", [dev.data_ptr()], 4, arg, arg, "cpu", 0)
    region = _core.HostRegion(32)
    view = torch.frombuffer(region, dtype=torch.uint8)
    core = _core.HostPool.from_geometry("layer_first", 1, 4, 1, [8], [region])
    del region
    gc.collect()
    core.backup("kernel", [dev.data_ptr()], 4, arg, arg, "cpu", 0)
    assert torch.equal(view, dev)


def test_a_host_pool_is_built_from_its_spec_and_answers_from_its_own_memory():
    # MHA page_first_direct: 2 layers, 2 pages of 4 tokens, 2 heads x 8 dims of bf16.
    spec = _core.PoolSpec("mha", "page_first_direct", 2, 8, 4, [8, 8], 2, head_num=2)
    assert spec.allocation_shapes == [[2, 2, 2, 4, 2, 8]]
    page = 2 * 4 * 2 * 8 * 2  # every layer of one page of one plane
    assert spec.registration_unit(0) == page
    with pytest.raises(ValueError, match=r"allocation 1 is out of range \[0, 1\)"):
        spec.registration_unit(1)
    kv = torch.zeros(spec.allocation_shapes[0], dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"this pool has 1 allocation\(s\), got 2"):
        _core.HostPool(spec, [kv, kv])
    with pytest.raises(ValueError, match="plane 1 memory of 88 bytes .* cannot hold 512 bytes"):
        _core.HostPool(spec, [torch.zeros(300, dtype=torch.bfloat16)])
    pool = _core.HostPool(spec, [kv])
    assert pool.spec is spec
    base, v_base = kv.data_ptr(), kv.data_ptr() + 2 * page
    assert pool.plane_addrs == [base, v_base]
    # Page metadata points into the pool's own planes: no address comes from the caller.
    assert pool.page_meta([4, 5, 6, 7]) == ([base + page, v_base + page], [page, page])
    assert pool.is_stride_page_aligned(page) == (base % page == 0)
    assert not pool.is_stride_page_aligned(page * 3)
    assert not hasattr(spec, "page_meta")
    # A binding checks (layout, io_backend) by the pool's spec; a row geometry without one
    # cannot be bound.
    rows = _core.HostPool.from_geometry("layer_first", 1, 4, 1, [8], [torch.zeros(32)])
    assert rows.spec is None
    with pytest.raises(ValueError, match="has no PoolSpec"):
        _core.DeviceBinding(rows, [[torch.zeros(32, dtype=torch.uint8)]], [0], 1, 1)
    with pytest.raises(ValueError, match="built without a PoolSpec"):
        rows.page_meta([0])
    with pytest.raises(ValueError, match="built without a PoolSpec"):
        rows.contiguous_buf_infos()


# ---------------------------------------------------------------- transfers vs a torch reference


class Pool:
    """A 1- or 2-plane host pool on a HostRegion plus a layer-first CPU 'device' pool."""

    def __init__(self, layout, L=3, S=16, P=4, items=(24, 24), H=2, dev_rows=12):
        self.layout, self.L, self.S, self.P, self.items, self.H = layout, L, S, P, items, H
        self.dev_rows = dev_rows
        sizes = [_core.HostPool.plane_nbytes(layout, L, S, P, i, head_num=H) for i in items]
        self.region = _core.HostRegion(sum(sizes))
        flat = torch.frombuffer(self.region, dtype=torch.uint8)
        flat.copy_(torch.randint(0, 256, flat.shape, dtype=torch.uint8))
        offs = [0, sizes[0]]
        self.host = [flat[o : o + s] for o, s in zip(offs, sizes)]
        self.core = _core.HostPool.from_geometry(
            layout,
            L,
            S,
            P,
            list(items),
            [(self.region, o) for o in offs[: len(items)]],
            head_num=H,
        )
        self.dev = [torch.randint(0, 256, (L, dev_rows, i), dtype=torch.uint8) for i in items]

    def host_item(self, p: int, t: int, l: int) -> torch.Tensor:
        """Bytes of (plane p, row t, layer l), from the contract's shapes."""
        L, S, P, H, item = self.L, self.S, self.P, self.H, self.items[p]
        h = self.host[p]
        if self.layout == "layer_first":
            return h.view(L, S, item)[l, t]
        if self.layout == "page_first":
            return h.view(S, L, item)[t, l]
        if self.layout == "page_first_direct":
            return h.view(S // P, L, P, item)[t // P, l, t % P]
        return h.view(S // P, H, P, L, item // H)[t // P, :, t % P, l].reshape(-1)

    def snapshot(self):
        return [h.clone() for h in self.host], [d.clone() for d in self.dev]


def _pairs_for(pool: Pool, h: torch.Tensor, d: torch.Tensor, backend: str):
    if backend == "direct" and pool.layout == "page_first_direct":
        P = pool.P
        out = []
        for k in range(h.numel() // P):
            hp, ds = int(h[k * P]) // P, int(d[k * P])
            out += [(hp * P + r, ds + r) for r in range(P)]
        return out
    return list(zip(h.tolist(), d.tolist()))


@pytest.mark.parametrize("layout,backend", PAIRS)
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("items", [(24, 24), (16, 8), (12,)])
def test_backup_and_load_match_reference(layout, backend, dtype, items):
    g = torch.Generator().manual_seed(hash((layout, backend, str(dtype), items)) & 0xFFFF)
    pool = Pool(layout, items=items)
    P = pool.P
    hp = torch.randperm(pool.S // P, generator=g)[:2]
    dp = torch.randperm(pool.dev_rows // P, generator=g)[:2]
    h = (hp[:, None] * P + torch.arange(P)).reshape(-1).to(dtype)
    d = (dp[:, None] * P + torch.arange(P)).reshape(-1).to(dtype)
    pairs = _pairs_for(pool, h, d, backend)

    # backup: every layer, device -> host
    ptrs = [pool.dev[p][l].data_ptr() for p in range(len(items)) for l in range(pool.L)]
    pool.core.backup(backend, ptrs, pool.dev_rows, idx(h), idx(d), "cpu", 0)
    for p in range(len(items)):
        for l in range(pool.L):
            for t, r in pairs:
                assert torch.equal(pool.host_item(p, t, l), pool.dev[p][l, r]), (p, l, t, r)

    # load: one host layer into a fresh device layer
    for p in range(len(items)):
        pool.host[p].copy_(torch.randint(0, 256, pool.host[p].shape, dtype=torch.uint8))
    layer = 2
    before = [pool.dev[p][0].clone() for p in range(len(items))]
    pool.core.load(
        backend,
        layer,
        [pool.dev[p][0].data_ptr() for p in range(len(items))],
        pool.dev_rows,
        idx(h),
        idx(d),
        "cpu",
        0,
    )
    for p in range(len(items)):
        touched = set()
        for t, r in pairs:
            assert torch.equal(pool.dev[p][0, r], pool.host_item(p, t, layer))
            touched.add(r)
        for r in set(range(pool.dev_rows)) - touched:
            assert torch.equal(pool.dev[p][0, r], before[p][r]), "wrote outside the indices"


@pytest.mark.parametrize("layout,backend", PAIRS)
def test_refused_transfers_leave_both_pools_unchanged(layout, backend):
    pool = Pool(layout)
    P = pool.P
    good_h = torch.arange(4, 12)
    good_d = torch.arange(0, 8)
    dev_ptrs = [pool.dev[p][0].data_ptr() for p in range(2)]
    all_ptrs = [pool.dev[p][l].data_ptr() for p in range(2) for l in range(pool.L)]
    bad_cases = []
    h = good_h.clone()
    h[-1] = pool.S  # last index out of range: nothing before it may be written either
    bad_cases.append((h, good_d, "out of range"))
    d = good_d.clone()
    d[-1] = -2
    bad_cases.append((good_h, d, "-2"))
    bad_cases.append((good_h[:-1], good_d, "same length"))
    bad_cases.append((good_h, torch.arange(0, 8) + pool.dev_rows - 7, "out of range"))
    for h, d, needle in bad_cases:
        snap = pool.snapshot()
        for op in ("backup", "load"):
            with pytest.raises(_core.TransferError, match=needle):
                if op == "backup":
                    pool.core.backup(backend, all_ptrs, pool.dev_rows, idx(h), idx(d), "cpu", 0)
                else:
                    pool.core.load(backend, 1, dev_ptrs, pool.dev_rows, idx(h), idx(d), "cpu", 0)
            assert all(torch.equal(a, b) for a, b in zip(pool.host, snap[0]))
            assert all(torch.equal(a, b) for a, b in zip(pool.dev, snap[1]))
    assert P == 4


def test_structural_errors():
    pool = Pool("page_first_direct")
    h, d = torch.arange(4, 8), torch.arange(0, 4)
    ptrs = [pool.dev[p][0].data_ptr() for p in range(2)]
    with pytest.raises(_core.TransferError, match="host layer 3 is out of range"):
        pool.core.load("direct", 3, ptrs, pool.dev_rows, idx(h), idx(d), "cpu", 0)
    with pytest.raises(_core.TransferError, match="host layer -1 is out of range"):
        pool.core.load("direct", -1, ptrs, pool.dev_rows, idx(h), idx(d), "cpu", 0)
    with pytest.raises(_core.TransferError, match="expected 6 device layer pointers"):
        pool.core.backup("direct", ptrs, pool.dev_rows, idx(h), idx(d), "cpu", 0)
    with pytest.raises(_core.TransferError, match="divisible by page size"):
        pool.core.load("direct", 0, ptrs, pool.dev_rows, idx(h[:3]), idx(d[:3]), "cpu", 0)
    with pytest.raises(_core.TransferError, match="int32 or int64"):
        h16 = h.to(torch.int16)
        pool.core.load("direct", 0, ptrs, pool.dev_rows, idx(h16), idx(d), "cpu", 0)
    on_dev = (d.data_ptr(), 4, 8, True)
    with pytest.raises(_core.TransferError, match="GPU memory"):
        pool.core.load("direct", 0, ptrs, pool.dev_rows, idx(h), on_dev, "cpu", 0)
    with pytest.raises(ValueError, match="Unsupported IO backend: dma"):
        pool.core.load("dma", 0, ptrs, pool.dev_rows, idx(h), idx(d), "cpu", 0)
    with pytest.raises(ValueError, match="Unsupported device"):
        pool.core.load("direct", 0, ptrs, pool.dev_rows, idx(h), idx(d), "tpu", 0)
    with pytest.raises(ValueError, match="Unsupported engine"):
        pool.core.load("direct", 0, ptrs, pool.dev_rows, idx(h), idx(d), "cpu", 0, engine="x")
    pf = Pool("page_first")
    with pytest.raises(ValueError, match="Unsupported layout: page_first"):
        pf.core.load("direct", 0, ptrs, pf.dev_rows, idx(h), idx(d), "cpu", 0)
    # An empty transfer is valid and moves nothing.
    e = torch.empty(0, dtype=torch.int64)
    snap = pool.snapshot()
    pool.core.load("direct", 0, ptrs, pool.dev_rows, idx(e), idx(e), "cpu", 0)
    assert all(torch.equal(a, b) for a, b in zip(pool.dev, snap[1]))


def test_large_backup_releases_gil_and_copies_exactly():
    # > 4 MiB moves through the multi-threaded path with the GIL released.
    L, S, P, item = 4, 2048, 64, 1024
    pool = Pool("page_first_direct", L=L, S=S, P=P, items=(item,), H=1, dev_rows=S)
    h = torch.arange(S).view(-1, P).flip(0).reshape(-1)
    d = torch.arange(S)
    ptrs = [pool.dev[0][l].data_ptr() for l in range(L)]
    pool.core.backup("direct", ptrs, S, idx(h), idx(d), "cpu", 0)
    hv = pool.host[0].view(S // P, L, P, item)
    dv = pool.dev[0].view(L, S // P, P, item)
    assert torch.equal(hv.flip(0), dv.permute(1, 0, 2, 3))


def test_supported_pairs_are_the_contracts_matrix():
    from reference import ASYM_PAIRS, MHA_PAIRS, MLA_PAIRS, V4_PAIRS

    def as_set(pairs):
        return {(backend, layout) for backend, layout in pairs}

    swap = [(b, lay) for lay, b in _core.supported_pairs("mha")]
    assert as_set(swap) == as_set(MHA_PAIRS)
    for kind, want in (("mha_asymmetric", ASYM_PAIRS), ("mla", MLA_PAIRS), ("v4_paged", V4_PAIRS)):
        assert {(b, lay) for lay, b in _core.supported_pairs(kind)} == as_set(want), kind
    with pytest.raises(ValueError, match="unknown pool kind"):
        _core.supported_pairs("mamba")


def test_the_support_table_answers_every_transfer_kind_and_the_hand_back_column():
    v4 = _core.PoolSpec("v4_paged", "page_first", 2, 8, 1, [64], 1, name="c4")
    mla = _core.PoolSpec("mla", "page_first_direct", 2, 8, 4, [16], 2)
    # kernel_ascend moves V4 pages the direct way on a host; SGLang names the pool in its refusal.
    assert (
        _core.PoolSpec("v4_paged", "layer_first", 2, 8, 1, [64], 1).check_pair("kernel_ascend")
        == "direct"
    )
    assert v4.check_pair("kernel_ascend") == "kernel"  # SGLang 0.5.20+: page_first too
    with pytest.raises(ValueError, match=r"^Unsupported V4 paged host layout/backend: page_first/"):
        v4.check_pair("kernel", "tokens")
    assert mla.check_pair("direct") == "direct"
    with pytest.raises(ValueError, match="Layer-sharded direct HiCache backup only supports"):
        mla.check_pair("direct", "sharded_backup")
    with pytest.raises(ValueError, match="does not support IO backend: 7$"):
        mla.check_pair(7, "sharded_backup")
    with pytest.raises(ValueError, match='unknown transfer kind "pages"'):
        mla.check_pair("kernel", "pages")
    assert _core.handed_back_layouts("mla") == ["page_first_kv_split"]
    assert _core.handed_back_layouts("mha") == []


@pytest.mark.parametrize(
    ("index_map", "error", "text"),
    [
        (
            ("dcp", 2, 2),
            ValueError,
            r"index_map: dcp_rank must lie in \[0, dcp_size\); got dcp_rank=2",
        ),
        (("dcp", 0, 0), ValueError, "dcp_rank must lie"),
        (
            ("page_rows", 0),
            ValueError,
            "index_map: a page-row index map needs a positive page size",
        ),
        (("page_rows",), ValueError, "index_map must be None, "),
        (("mamba",), ValueError, "index_map must be None, "),
        (5, ValueError, "index_map must be None, "),
        (("dcp", True, 0), TypeError, "dcp_size must be an integer"),
    ],
)
def test_a_bad_index_map_is_refused_by_name(index_map, error, text):
    core = _core.HostPool.from_geometry(
        "layer_first", 2, 8, 4, [16], [_core.HostRegion(2 * 8 * 16)]
    )
    empty = idx(torch.empty(0, dtype=torch.int64))
    dev = [torch.zeros(8, 16, dtype=torch.uint8) for _ in range(2)]
    ptrs = [t.data_ptr() for t in dev]
    with pytest.raises(error, match=text):
        core.backup("kernel", ptrs, 8, empty, empty, "cpu", 0, index_map=index_map)


def test_stream_copy_copies_bytes_and_refuses_what_it_cannot_copy():
    """The benchmarks' streaming-store yardstick: dst[:] = src for byte buffers, refusing
    overlap, read-only destinations and length mismatches by name."""

    src = np.arange(1 << 16, dtype=np.uint8)
    dst = np.zeros_like(src)
    _core.stream_copy(dst, src)
    assert np.array_equal(dst, src)
    odd = np.zeros(1000 + 3, dtype=np.uint8)
    _core.stream_copy(odd[3:], src[:1000])  # unaligned, not a multiple of 16
    assert np.array_equal(odd[3:], src[:1000]) and not odd[:3].any()
    with pytest.raises(ValueError, match="overlap"):
        _core.stream_copy(src[10:20], src[15:25])
    with pytest.raises(ValueError, match="dst has 5 bytes, src 6"):
        _core.stream_copy(dst[:5], src[:6])
    with pytest.raises(ValueError, match="read-only"):
        _core.stream_copy(memoryview(bytes(4)), src[:4])


# A pool whose host memory is then freed or moved under it by torch (CHANGE, on the storage of
# its first buffer). ALLOC "storage": a storage backend's allocator whose memory is an ordinary
# (resizable) torch storage, large enough that freeing it unmaps it (a write through a stale
# address then faults, not corrupts); "default": hostkv_rs's own regions. Each call prints
# REFUSED or ACCEPTED; the flat-page paths of V4 follow torch, which raises its own error.
_STALE_STORAGE = """
import torch
from hostkv_rs import (DeepSeekV4PagedHostPool, MHATokenToKVPool, MHATokenToKVPoolHost,
                       MLATokenToKVPool, MLATokenToKVPoolHost)
from hostkv_rs.pools import base, v4_paged

class Alloc:
    def allocate(self, dims, dtype, device):
        return torch.zeros(dims, dtype=dtype)

if "ALLOC" == "storage":
    base.get_allocator_from_storage = v4_paged.get_allocator_from_storage = (
        lambda *args, **kwargs: Alloc()
    )
kind = "KIND"
if kind == "v4":
    dev = [torch.zeros(64, 656, dtype=torch.uint8) for _ in range(4)]
    host = DeepSeekV4PagedHostPool("c4_kv", dev, 656, 256, 4, layout="LAYOUT", allocator_type="shm")
    h, d, dev = torch.arange(4, 8), torch.arange(4), None
    buffer = host._flat
else:
    Dev, Host = (MHATokenToKVPool, MHATokenToKVPoolHost) if kind == "mha" else (
        MLATokenToKVPool, MLATokenToKVPoolHost)
    dims = dict(head_num=2, head_dim=64) if kind == "mha" else dict(kv_lora_rank=96, qk_rope_head_dim=32)
    dev = Dev(4096, 16, torch.bfloat16, layer_num=4, **dims)
    host = Host(dev, 2.0, 0, 16, "LAYOUT", allocator_type="shm")
    h, d = host.alloc(64), torch.arange(16, 80)
    buffer = host.kv_buffer[0] if kind == "mha" else host.kv_buffer
adopted = host._host_regions[0] if kind != "v4" else host._region
assert (adopted.hugepage_tier == "adopted") == ("ALLOC" == "storage"), adopted.hugepage_tier
host.backup_from_device_all_layer(dev, h, d, "kernel")
storage = buffer.untyped_storage()
CHANGE
for call in (
    lambda: host.backup_from_device_all_layer(dev, h, d, "kernel"),
    lambda: host.load_to_device_per_layer(dev, h, d, 0, "kernel"),
    lambda: host.get_page_buffer_meta(h[:: host.page_size]),
):
    try:
        call()
        print("ACCEPTED")
    except ValueError as exc:
        print("REFUSED", exc)
if kind == "v4":
    for call in (lambda: host.get_data_page(1), lambda: host.set_from_flat_data_page(1, host.get_dummy_flat_data_page())):
        try:
            call()
            print("FLAT ACCEPTED")
        except RuntimeError as exc:
            print("FLAT REFUSED BY TORCH", exc)
"""


@pytest.mark.parametrize(
    ("kind", "layout"),
    [("mha", "layer_first"), ("mha", "page_first"), ("mla", "page_first"), ("v4", "page_first")],
)
@pytest.mark.parametrize(
    ("alloc", "change"),
    [
        ("storage", "storage.resize_(0)"),
        ("storage", "storage.resize_(storage.nbytes() * 2)"),
        ("storage", "storage.share_memory_()"),
        # A view of a region cannot be resized, but can be moved.
        ("default", "storage.share_memory_()"),
    ],
)
def test_host_memory_whose_storage_was_freed_or_moved_is_never_used(kind, layout, alloc, change):
    """A pool's buffers are torch tensors over its memory (the allocator's own, adopted, or
    views of hostkv_rs's regions): once their storage lets go of that memory (resize_,
    share_memory_, which torch.multiprocessing also calls) every transfer and address hand-out
    is refused instead of writing freed memory or memory `kv_buffer` no longer shows."""
    script = (
        _STALE_STORAGE.replace("LAYOUT", layout)
        .replace("CHANGE", change)
        .replace("ALLOC", alloc)
        .replace("KIND", kind)
    )
    for extent in ("auto", "python"):
        done = subprocess.run(
            [sys.executable, "-c", script],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
            env={**os.environ, "HOSTKV_TENSOR_EXTENT": extent},
        )
        assert done.returncode == 0, (extent, done.returncode, done.stderr[-3000:])
        lines = done.stdout.splitlines()
        assert len(lines) == (5 if kind == "v4" else 3), done.stdout
        assert all(line.startswith("REFUSED") for line in lines[:3]), done.stdout
        assert "no longer holds the memory it was built over" in lines[0]
        assert "host pool plane 0" in lines[0]
        if kind == "v4" and change == "storage.resize_(0)":
            assert all(line.startswith("FLAT REFUSED BY TORCH") for line in lines[3:]), lines


def test_an_adopted_region_refuses_its_buffer_and_pinning_once_its_storage_moved():
    tensor = torch.zeros(64, dtype=torch.uint8)
    region = _core.HostRegion.adopt(tensor)
    assert torch.frombuffer(region, dtype=torch.uint8).numel() == 64
    tensor.untyped_storage().resize_(0)
    with pytest.raises(ValueError, match=r"HostRegion \(adopted memory\).*64 bytes at"):
        memoryview(region)
    with pytest.raises(ValueError, match="no longer holds"):
        region.register_cuda()
    # A core built over the tensor itself (a torch storage) checks the same way.
    host = torch.zeros(32, dtype=torch.uint8)
    core = _core.HostPool.from_geometry("layer_first", 1, 4, 1, [8], [host])
    assert core.plane_addrs == [host.data_ptr()]
    host.untyped_storage().resize_(64)
    dev = torch.arange(32, dtype=torch.uint8)
    arg = (torch.arange(4).data_ptr(), 4, 8, False)
    with pytest.raises(ValueError, match="host pool plane 0: the torch storage"):
        core.backup("kernel", [dev.data_ptr()], 4, arg, arg, "cpu", 0)
    # Addresses are handed out under the same check.
    with pytest.raises(ValueError, match="host pool plane 0: the torch storage"):
        _ = core.plane_addrs
    with pytest.raises(ValueError, match="no longer holds"):
        _ = region.address


def test_host_memory_is_located_by_torch_not_by_attributes_set_on_the_tensor():
    """A plain tensor's (or its storage's) own attributes shadow the methods of those names: a
    storage allocator's tensor that said its memory was elsewhere used to be adopted there."""

    class Elsewhere:
        def data_ptr(self):
            return 0x10000

        def nbytes(self):
            return 1 << 30

    tensor = torch.zeros(4, 64, dtype=torch.uint8)
    tensor.untyped_storage = lambda: Elsewhere()
    tensor.data_ptr = lambda: 0x10000
    tensor.untyped_storage_of_torch = torch.Tensor.untyped_storage(tensor)
    tensor.untyped_storage_of_torch.nbytes = lambda: 1 << 30
    core = _core.HostPool.from_geometry("layer_first", 1, 4, 1, [64], [tensor])
    assert core.plane_addrs == [torch.Tensor.data_ptr(tensor)]
    region = _core.HostRegion.adopt(tensor)
    assert region.address == torch.Tensor.data_ptr(tensor)
    assert memoryview(region).nbytes == 256


def test_a_tensor_subclass_naming_another_storage_is_watched_through_its_own():
    # `untyped_storage()` of this subclass answers with another storage object over the same
    # bytes: the core reads the plain tensor instead, so it holds and checks the tensor's own
    # storage, never the one the subclass names.
    data = bytearray(1 << 16)
    named = torch.frombuffer(data, dtype=torch.uint8)

    class OtherStorage(torch.Tensor):
        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):
            if func is torch.Tensor.untyped_storage:
                return named.untyped_storage()
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **(kwargs or {}))

    tensor = torch.frombuffer(data, dtype=torch.uint8).as_subclass(OtherStorage)
    region = _core.HostRegion.adopt(tensor)
    assert memoryview(region).nbytes == 1 << 16
    named.untyped_storage().share_memory_()  # copies the named storage away: ours stays put
    assert memoryview(region).nbytes == 1 << 16
    with torch._C.DisableTorchFunctionSubclass():
        tensor.untyped_storage().share_memory_()
    with pytest.raises(ValueError, match="no longer holds the memory it was built over"):
        memoryview(region)
