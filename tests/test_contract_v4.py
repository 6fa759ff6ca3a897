"""DeepSeekV4PagedHostPool and LogicalHostPool audited against host-pool-contract.md (§1.5, §2.4,
§3.1, §3.5, §3.6, §4.1) and SGLang's memory_pool_host.py (00343773 version, the one with
`attach_scale_buffers`): staging buffer, logs, scale buffers, kernel_ascend page copies, the
HiSparse mixin and hostile inputs. Expected bytes come from the contract's shapes."""

from __future__ import annotations

import logging
import re

import pytest
import torch
from hostkv_rs import TransferError
from hostkv_rs.hisparse import HiSparseHostPoolMixin
from hostkv_rs.v4 import DeepSeekV4PagedHostPool, LogicalHostPool

LAYOUTS = ["layer_first", "page_first", "page_first_direct"]
ASCEND_LAYOUTS = ["layer_first", "page_first_direct"]
C4_P, C4_ROW = 64, 37440


def make_pool(layout="layer_first", L=3, item=48, pages=5, P=2, dev_pages=6, seed=0, **kw):
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


@pytest.mark.parametrize("pages, cap", [(5, 5), (70, 64)])
def test_page_first_allocates_sglangs_staging_buffer(pages, cap):
    # §3.1: (min(Nh, 64), L, item_bytes) uint8 on the device buffers' device, JIT or not.
    pool, dev = make_pool("page_first", L=3, item=48, pages=pages)
    assert pool.can_use_write_back_jit is False
    assert pool.staging_buffer.shape == (cap, 3, 48)
    assert pool.staging_buffer.dtype == torch.uint8
    assert pool.staging_buffer.device == dev[0].device


@pytest.mark.parametrize("layout", ["layer_first", "page_first_direct"])
def test_other_layouts_have_no_staging_buffer(layout):
    pool, _ = make_pool(layout)
    assert pool.staging_buffer is None


def test_construction_logs_sglangs_allocation_line(caplog):
    with caplog.at_level(logging.INFO):
        make_pool("page_first_direct", L=3, item=48, pages=5)
    assert (
        "Allocating 0.00 GB host memory for V4 paged pool 'c4_kv' "
        "(layers=3, pages=5, item_bytes=48, layout=page_first_direct)."
    ) in caplog.text


def test_memory_check_reads_the_budget_where_sglang_imports_it(monkeypatch):
    # SGLang's V4 pool imports host_memory_budget_bytes from pool_host.base.
    from hostkv_rs import base

    monkeypatch.setattr(base, "host_memory_budget_bytes", lambda: 3 * 5 * 48 - 1)
    with pytest.raises(ValueError) as e:
        make_pool(L=3, item=48, pages=5)
    assert str(e.value) == (
        "Not enough host memory for V4 paged pool c4_kv. Requesting 0.00 GB but only have "
        "0.00 GB free."
    )
    monkeypatch.setattr(base, "host_memory_budget_bytes", lambda: 3 * 5 * 48)
    assert make_pool(L=3, item=48, pages=5)[0].size == 10


def test_allocator_is_sglangs_default_host_allocator():
    from hostkv_rs._memory import HostTensorAllocator

    pool, _ = make_pool()
    assert isinstance(pool.allocator, HostTensorAllocator) and pool.fd is None


def test_host_device_must_be_cpu():
    with pytest.raises(
        AssertionError,
        match=re.escape("HostTensorAllocator only supports CPU allocations; got device='cuda'"),
    ):
        make_pool(device="cuda")


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
    pool, _ = make_pool(layout, L=3, pages=5)
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


def test_attach_scale_buffers_errors_use_sglangs_text_and_change_nothing():
    pool, _ = make_pool(L=3)
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


def test_kernel_ascend_on_page_first_raises_the_host_page_view_error():
    pool, dev = make_pool("page_first")
    poison_host(pool.kv_buffer, 1)
    before = rows_of(pool.kv_buffer, "page_first", 3, 48)
    dev_before = [d.clone() for d in dev]
    text = (
        "c4_kv _host_page_view: kernel_ascend requires layer_first or page_first_direct layout, "
        "got 'page_first'"
    )
    h, d = tokens([1], 2), tokens([2], 2)
    with pytest.raises(ValueError) as e:
        pool.backup_from_device_all_layer(None, h, d, "kernel_ascend")
    assert str(e.value) == text
    with pytest.raises(ValueError) as e:
        pool.load_to_device_per_layer(None, h, d, 0, "kernel_ascend")
    assert str(e.value) == text
    assert torch.equal(rows_of(pool.kv_buffer, "page_first", 3, 48), before)
    assert all(torch.equal(a, b) for a, b in zip(dev, dev_before))


@pytest.mark.parametrize("with_scales", [False, True])
@pytest.mark.parametrize("layout", ASCEND_LAYOUTS)
def test_kernel_ascend_moves_whole_pages_and_their_scales(layout, with_scales):
    L, item, P, pages, dev_pages, sib = 3, 48, 2, 5, 6, 8
    pool, dev = make_pool(layout, L=L, item=item, pages=pages, P=P, dev_pages=dev_pages)
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


def test_kernel_ascend_refuses_before_any_byte_when_the_scale_rows_are_short():
    L, item, P = 2, 48, 2
    pool, _ = make_pool("layer_first", L=L, item=item, pages=5, P=P, dev_pages=6)
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
        pool, _ = make_pool("layer_first", L=2, item=C4_ROW, pages=2, P=C4_P, dev_pages=2, seed=9)
        h, d = torch.tensor([3, 70, 100]), torch.tensor([5, 64, 127])
        pool.backup_from_device_all_layer(None, h, d, backend)
        results.append(rows_of(pool.kv_buffer, "layer_first", 2, C4_ROW))
    assert torch.equal(results[0], results[1])
    assert results[0].any()


# ---- ordering and hostile inputs -------------------------------------------------------------


def test_unsupported_pair_is_reported_before_a_bad_layer():
    pool, _ = make_pool("page_first_direct")
    with pytest.raises(ValueError) as e:
        pool.load_to_device_per_layer(None, tokens([0], 2), tokens([0], 2), 99, "kernel")
    assert str(e.value) == "Unsupported V4 paged host layout/backend: page_first_direct/kernel"


def test_empty_load_is_a_no_op_whatever_the_layer_and_takes_is_draft():
    pool, _ = make_pool("layer_first")
    empty = torch.empty(0, dtype=torch.int64)
    assert pool.load_to_device_per_layer(None, empty, empty, 99, "kernel") is None
    assert pool.load_to_device_per_layer(None, empty, empty, None, "kernel") is None
    assert pool.load_to_device_per_layer(None, empty, empty, 0, "direct", is_draft=False) is None


@pytest.mark.parametrize(
    "bad", [torch.tensor([1.0, 2.0]), torch.tensor([True, False]), [0.5, 1.5]], ids=str
)
def test_free_refuses_non_integer_slots(bad):
    pool, _ = make_pool(pages=5, P=2)
    pool.alloc(10)
    with pytest.raises(TypeError):
        pool.free(bad)
    assert pool.available_size() == 0 and pool.release_slots == []


def test_page_buffer_meta_refuses_float_indices():
    pool, _ = make_pool()
    with pytest.raises(TypeError):
        pool.get_page_buffer_meta(torch.arange(4).float())


def test_set_from_flat_data_page_refuses_a_list():
    pool, _ = make_pool()
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
    pool, dev = make_pool("page_first", L=3, pages=5, P=2)
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
    pool, _ = make_pool(layout)
    with pytest.raises(ValueError) as e:
        pool.backup_from_device_all_layer(None, tokens([0], 2), tokens([0], 2), ["kernel"])
    assert str(e.value) == f"Unsupported V4 paged host layout/backend: {layout}/['kernel']"


@pytest.mark.parametrize("layout, aligned", [("layer_first", False), ("page_first", True)])
def test_stride_page_alignment_uses_the_page_row(layout, aligned):
    # §4.3: L * item_bytes = 4 * 1024 = 4096 bytes per page row.
    pool, _ = make_pool(layout, L=4, item=1024, pages=3)
    assert pool.is_stride_page_aligned() is aligned


def test_meta_device_buffers_build_but_cannot_transfer():
    dev = [torch.zeros(4, 48, dtype=torch.uint8, device="meta") for _ in range(2)]
    pool = DeepSeekV4PagedHostPool("c4_kv", dev, 48, 3, 2)
    assert pool.gpu_device.type == "meta" and pool.size == 6
    with pytest.raises(ValueError, match="must be on CPU or CUDA"):
        pool.backup_from_device_all_layer(None, tokens([0], 2), tokens([1], 2), "direct")
    with pytest.raises(ValueError, match="must be on CPU or CUDA"):
        pool.load_to_device_per_layer(None, tokens([0], 2), tokens([1], 2), 0, "direct")
