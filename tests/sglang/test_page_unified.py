"""page_unified (SGLang 0.5.23) against SGLang's own classes and `PageUnifiedLayout`: the same
construction site builds ours, with SGLang's buffer, attributes, layout object, page metadata
and flat-page answers (SGLang's refusals included), and our bytes sit where SGLang's own
`chunk_span` says. Transfers are where ours goes further: 0.5.23's pools refuse every transfer
of this layout (its kernels exist, no pool calls them), ours move the bytes through the kernel
path (README, "SGLang releases")."""

from __future__ import annotations

import pickle
import re

import pytest
import sgl_harness as H
import torch
from test_side_by_side import _assert_none, flat_page_diffs, geometry_diffs, meta_diffs

pytestmark = pytest.mark.skipif(not H.at_least(0, 5, 23), reason="page_unified: SGLang 0.5.23+")

KINDS = ("mha", "mla")


def _device(kind, dtype=torch.bfloat16, page=16, layers=3):
    if kind == "mla":
        return H.mla_device(size=256, page=page, dtype=dtype, layers=layers)
    return H.mha_device(size=256, page=page, dtype=dtype, layers=layers, heads=4, head_dim=16)


def _call(kind, dtype=torch.bfloat16, page=16):
    dev = _device(kind, dtype, page)
    return dev, H.recorded_kv_host_call(dev, use_mla=kind == "mla", layout="page_unified")


def _sglang_layout_cls():
    return H.module_or_none("sglang.srt.mem_cache.pool_host.page_unified").PageUnifiedLayout


FIELDS = ("page_size", "layer_num", "head_num", "head_group_num", "head_dim", "itemsize", "is_mla")
DERIVED = (
    "components",
    "heads_per_group",
    "group_bytes",
    "layer_bytes",
    "head_group_bytes",
    "bytes_per_page",
)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dname", list(H.DTYPES))
@pytest.mark.parametrize("page", [1, 16])
def test_built_like_sglangs_pool(kind, dname, page):
    _dev, call = _call(kind, H.DTYPES[dname], page)
    assert call.pool is not None, "SGLang's class did not build"
    ours = call.ours()
    assert H.is_ours(ours)
    _assert_none(geometry_diffs(call.pool, ours), f"{kind} page_unified")
    _assert_none(meta_diffs(call.pool, ours), f"{kind} page_unified")
    _assert_none(flat_page_diffs(call.pool, ours, torch.Generator().manual_seed(1)), kind)
    theirs_layout, ours_layout = call.pool.page_unified_layout, ours.page_unified_layout
    for name in FIELDS + DERIVED:
        assert getattr(ours_layout, name) == getattr(theirs_layout, name), name
    pages = call.pool.page_num
    assert tuple(ours_layout.page_dims(pages)) == tuple(theirs_layout.page_dims(pages))
    # SGLang's own struct: equal, hashable, picklable and encodable as SGLang's code expects.
    msgspec = pytest.importorskip("msgspec")  # SGLang's struct library
    assert type(ours_layout) is type(theirs_layout) and ours_layout == theirs_layout
    assert pickle.loads(pickle.dumps(ours_layout)) == theirs_layout
    assert msgspec.json.encode(ours_layout) == msgspec.json.encode(theirs_layout)
    for name in ("k_data_refs", "v_data_refs", "k_data_ptrs", "v_data_ptrs"):
        if hasattr(call.pool, name):
            assert getattr(ours, name) == getattr(call.pool, name) or (
                getattr(ours, name) is None and getattr(call.pool, name) is None
            ), name
    assert ours.is_stride_page_aligned() == call.pool.is_stride_page_aligned()


@pytest.mark.parametrize("groups", [1, 2, 4])
def test_backup_puts_bytes_where_sglangs_chunk_span_says(groups):
    """Every (page, head group, layer) cell, located with SGLang's own PageUnifiedLayout: K of
    the page's tokens first, then V, each token one head group's row of the device layer."""
    dev = _device("mha")
    call = H.recorded_kv_host_call(dev, use_mla=False, layout="page_unified")
    kwargs = dict(call.kwargs, head_group_num=groups)
    import hostkv_rs

    pool = hostkv_rs.MHATokenToKVPoolHost(*call.args, **kwargs)
    layout = _sglang_layout_cls()(
        page_size=pool.page_size,
        layer_num=pool.layer_num,
        head_num=pool.head_num,
        head_group_num=groups,
        head_dim=pool.head_dim,
        itemsize=pool.dtype.itemsize,
    )
    gen = torch.Generator().manual_seed(groups)
    planes = [list(dev.k_buffer), list(dev.v_buffer)]
    H.fill_random([t for plane in planes for t in plane], gen)
    p = pool.page_size
    host, device = H.page_slots([2, 5], p), H.page_slots([1, 3], p)
    pool.backup_from_device_all_layer(dev, host, device, "kernel")
    flat = pool.kv_buffer.reshape(-1).view(torch.uint8)
    gb = layout.group_bytes
    for k, page in enumerate((2, 5)):
        base = page * layout.bytes_per_page
        for layer in range(pool.layer_num):
            for g in range(groups):
                off, length = layout.chunk_span((layer, layer + 1), g)
                cell = flat[base + off : base + off + length].view(2, p, gb)
                for c in range(2):
                    rows = planes[c][layer][device[k * p : (k + 1) * p]]
                    want = H.byte_rows(rows)[:, g * gb : (g + 1) * gb]
                    assert torch.equal(cell[c], want), (page, layer, g, c)


@pytest.mark.parametrize("kind", KINDS)
def test_transfers_sglang_refuses_and_ours_moves(kind):
    dev, call = _call(kind)
    ours = call.ours()
    p = ours.page_size
    host, device = H.page_slots([1, 2], p), H.page_slots([1, 3], p)
    for theirs_call in (
        lambda: call.pool.backup_from_device_all_layer(dev, host, device, "kernel"),
        lambda: call.pool.load_to_device_per_layer(dev, host, device, 0, "kernel"),
    ):
        kind_t, exc = H.outcome(theirs_call)
        assert kind_t == "raise" and "Unsupported layout: page_unified" in str(exc), exc
    gen = torch.Generator().manual_seed(3)
    planes = H.device_planes(dev)
    H.fill_random(planes, gen)
    before = H.snapshot(planes)
    ours.backup_from_device_all_layer(dev, host, device, "kernel")
    for t in planes:
        t.zero_()
    for layer in range(ours.layer_num):
        ours.load_to_device_per_layer(dev, host, device, layer, "kernel")
    for t, b in zip(planes, before):
        assert torch.equal(H.byte_rows(t)[device], H.byte_rows(b)[device])
    # The direct backend is refused by both, with SGLang's pool text.
    for direct in (
        lambda pool: pool.backup_from_device_all_layer(dev, host, device, "direct"),
        lambda pool: pool.load_to_device_per_layer(dev, host, device, 0, "direct"),
    ):
        kind_t, exc = H.outcome(lambda direct=direct: direct(call.pool))
        assert kind_t == "raise", exc
        with pytest.raises(type(exc), match=f"^{re.escape(str(exc))}$"):
            direct(ours)


@pytest.mark.parametrize("dcp_rank", [0, 1])
def test_an_mla_pool_under_dcp_checks_the_page_start_before_the_layout(dcp_rank):
    """SGLang's MLA pool under DCP reads a page call's index (a logical page start inside the
    pool) before it refuses page_unified; without DCP the layout comes first."""
    _, call = _call("mla")
    call = H.Call(call.name, call.cls, call.args, dict(call.kwargs, dcp_size=2, dcp_rank=dcp_rank))
    theirs, ours = call.theirs(), call.ours()
    n = theirs.logical_size
    page = theirs.get_dummy_flat_data_page()
    for what in (
        lambda pool: pool.get_data_page(1),
        lambda pool: pool.get_data_page(n),
        lambda pool: pool.get_data_page(0),
        lambda pool: pool.set_from_flat_data_page(1, page),
        lambda pool: pool.get_page_buffer_meta(torch.arange(n, n + 2 * pool.page_size)),
        lambda pool: pool.get_page_buffer_meta(torch.arange(2 * pool.page_size)),
    ):
        kind_t, exc = H.outcome(lambda what=what: what(theirs))
        assert kind_t == "raise", exc
        with pytest.raises(type(exc), match=f"^{re.escape(str(exc))}$"):
            what(ours)


@pytest.mark.parametrize(("groups", "head_dim"), [(3, 16), (4, 2), (0, 16)])
def test_geometry_refusals_match_sglangs(groups, head_dim):
    dev = H.mha_device(size=256, page=16, heads=4, head_dim=head_dim, layers=3)
    call = H.recorded_kv_host_call(dev, use_mla=False, layout="page_unified")
    kwargs = dict(call.kwargs, head_group_num=groups)
    theirs = H.outcome(lambda: H._sglang_pool(call.cls, call.args, kwargs))
    import hostkv_rs

    ours = H.outcome(lambda: hostkv_rs.MHATokenToKVPoolHost(*call.args, **kwargs))
    assert theirs[0] == "raise" and ours[0] == "raise", (theirs, ours)
    assert (msg := H.same_error(ours[1], theirs[1])) is None, msg


def test_build_kv_host_pool_builds_ours(installed, publish):
    for kind in KINDS:
        dev = _device(kind)
        publish(page_size=dev.page_size, hicache_mem_layout="page_unified")
        pool = H.build_kv_host_pool(kv_pool=dev, page_size=dev.page_size, use_mla=kind == "mla")
        assert H.is_ours(pool), type(pool)
        assert isinstance(pool, H.ORIG["HostKVCache"])
