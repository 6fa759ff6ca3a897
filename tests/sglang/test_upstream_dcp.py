"""SGLang's CPU unit tests of the MLA host pool under decode context parallelism (DCP), each
scenario restated in our words and run with SGLang's classes and with ours after `install()`.

Provenance: repository sgl-project/sglang, folder `test/registered/unit/mem_cache/`,
`test_hicache_dcp_host_pool.py`: commit b0d4f8f5 (the translation is a pool method,
`maybe_dcp_kernel_indices`, on pools built with `__new__` there and real pools here; L3 pages of
a DCP pool refused) and two later stored versions (L3 pages translated to this rank's physical
rows; the translation as `sglang.srt.layers.dcp.layout.maybe_dcp_kernel_indices`; pages written
through the file backend).

Under DCP the radix tree works in a widened index space (pages of page_size * dcp_size slots,
dcp_size times the physical capacity); rank r holds the slots with index % dcp_size == r, at
physical row index // dcp_size. Not restated: `TestTransferEntryPointsTranslate::
test_backup_receives_physical_rows` (it patches `transfer_kv_all_layer_mla`; see the README).
"""

from __future__ import annotations

import os
import tempfile
from itertools import product
from pathlib import Path

import pytest
import sgl_harness as H
import sgl_upstream as U
import torch

side = U.side  # the shared two-sided fixture

DCP = 8
PHYSICAL = 64
WIDE = PHYSICAL * DCP
_layout_mod = H.module_or_none("sglang.srt.layers.dcp.layout")
FREE_FUNCTION = getattr(_layout_mod, "maybe_dcp_kernel_indices", None)
# 0.5.23 reads and writes a DCP pool's L3 pages at this rank's physical rows; earlier releases
# refuse them ("not yet DCP-aware").
L3_TRANSLATED = H.at_least(0, 5, 23)


def _dcp_pool(
    side, rank, *, dcp=DCP, layout="layer_first", dtype=torch.float16, device_size=1024, dev=None
):
    """The side's MLA host pool of rank `rank` over a 1024-token fp16 device pool (rank 8 + rope
    4, 2 layers, physical page 64; or over `dev`), with the widened page the radix tree uses."""
    H.publish(page_size=PHYSICAL, hicache_mem_layout=layout)
    if dev is None:
        dev = _dcp_device(dtype=dtype, size=device_size)
    extra = {"dcp_size": dcp, "dcp_rank": rank} if dcp > 1 else {}
    return U.kv_host(side, "MLATokenToKVPoolHost", dev, layout=layout, page=PHYSICAL * dcp, **extra)


def _dcp_device(*, dtype=torch.float16, size=1024):
    return H.mla_device(size=size, page=PHYSICAL, dtype=dtype, kv_lora_rank=8, rope=4, layers=2)


def _translate(side, indices, rank, dcp=DCP):
    """This release's DCP index translation for `rank`: SGLang's function where it has one, else
    the method of the side's pool (0.5.19)."""
    if FREE_FUNCTION is not None:
        return FREE_FUNCTION(indices, dcp, rank)
    return _dcp_pool(side, rank, dcp=dcp).maybe_dcp_kernel_indices(indices)


def _wide_pages(pages):
    return torch.cat([torch.arange(p * WIDE, (p + 1) * WIDE) for p in pages])


# --------------------------------------------------------------------------- index translation


def test_translation_is_the_identity_without_dcp(side):
    """Restates upstream test_hicache_dcp_host_pool.py::TestDcpKernelIndices::test_identity_without_dcp"""
    indices = torch.arange(37)
    assert _translate(side, indices, 0, dcp=1) is indices


def test_a_wide_page_is_a_whole_physical_page_on_every_rank(side):
    """Restates upstream test_hicache_dcp_host_pool.py::TestDcpKernelIndices::test_aligned_page_translates_to_full_physical_page"""
    for rank in range(DCP):
        out = _translate(side, torch.arange(WIDE, 2 * WIDE), rank)
        assert out.tolist() == list(range(PHYSICAL, 2 * PHYSICAL)), rank


def test_merged_unordered_pages_follow_the_owner_rule(side):
    """Restates upstream test_hicache_dcp_host_pool.py::TestDcpKernelIndices::test_matches_owner_rule_on_merged_unordered_pages"""
    indices = _wide_pages([3, 0, 5])
    for rank in range(DCP):
        out = _translate(side, indices, rank)
        assert out.tolist() == (indices[indices % DCP == rank] // DCP).tolist(), rank
        assert out.numel() * DCP == indices.numel()


@U.requires(FREE_FUNCTION is None, "its translation function does not check for a ragged run")
def test_a_ragged_run_is_refused(side):
    """Restates upstream test_hicache_dcp_host_pool.py::TestDcpKernelIndices::test_ragged_run_is_rejected"""
    with pytest.raises(AssertionError):
        _translate(side, torch.arange(WIDE + 1), 0)


def test_host_and_device_slots_stay_paired_after_the_host_sort(side, gen):
    """Restates upstream test_hicache_dcp_host_pool.py::TestDcpKernelIndices::test_positional_residue_pairing_survives_host_sort"""
    host, device = _wide_pages([7, 2]), _wide_pages([1, 4])
    perm = torch.randperm(host.numel(), generator=gen)
    # The direct / layer_first move sorts the host slots and permutes the device slots alike.
    host_sorted, order = host[perm].sort()
    device_matched = device[perm][order]
    for rank in range(DCP):
        assert torch.equal(host_sorted % DCP == rank, device_matched % DCP == rank)
        assert _translate(side, host_sorted, rank).numel() == host.numel() // DCP


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
def test_our_transfers_move_the_rows_the_translation_names(side, gen, layout):
    """Not an upstream scenario: the pool's own backup and per-layer load under DCP move exactly
    the physical rows the owner rule (and this release's translation function) names for each
    rank, host and device alike, and no other row. SGLang's pools move them through its CUDA
    kernels, which a CPU run cannot call, so only ours run it."""
    if not side.ours:
        pytest.skip("SGLang's MLA transfers need its CUDA kernels")
    host_idx, dev_idx = _wide_pages([2, 0]), _wide_pages([0, 1])
    backend = "kernel" if layout == "page_first" else "direct"
    for rank in (0, 3, DCP - 1):
        host_rows = host_idx[host_idx % DCP == rank] // DCP
        dev_rows = dev_idx[dev_idx % DCP == rank] // DCP
        if FREE_FUNCTION is not None:
            assert torch.equal(FREE_FUNCTION(host_idx, DCP, rank), host_rows)
            assert torch.equal(FREE_FUNCTION(dev_idx, DCP, rank), dev_rows)
        dev = _dcp_device()
        pool = _dcp_pool(side, rank, layout=layout, dev=dev)
        for layer in dev.kv_buffer:
            layer.copy_(torch.randn(layer.shape, generator=gen).to(layer.dtype))
        before = pool.kv_buffer.clone()
        pool.backup_from_device_all_layer(dev, host_idx, dev_idx, backend)
        expected = before.clone()
        for layer, device_layer in enumerate(dev.kv_buffer):
            rows = device_layer[dev_rows].view(-1, 1, device_layer.shape[-1])
            if layout == "layer_first":
                expected[layer, host_rows] = rows
            else:
                expected[host_rows, layer] = rows
        assert torch.equal(pool.kv_buffer, expected), (layout, rank)

        device_before = [layer.clone() for layer in dev.kv_buffer]
        for layer in dev.kv_buffer:
            layer.zero_()
        for layer_id in range(dev.layer_num):
            pool.load_to_device_per_layer(dev, host_idx, dev_idx, layer_id, backend)
        for layer, (now, was) in enumerate(zip(dev.kv_buffer, device_before, strict=True)):
            want = torch.zeros_like(was)
            want[dev_rows] = was[dev_rows]
            assert torch.equal(now, want), (layout, rank, layer)

        short_host, short_dev = host_idx[:-1], dev_idx[:-1]
        if FREE_FUNCTION is None:  # <= 0.5.19: the pool method asserts whole widened pages
            with pytest.raises(AssertionError, match="runs of whole widened pages"):
                pool.backup_from_device_all_layer(dev, short_host, short_dev, backend)
        elif backend == "direct" and FREE_FUNCTION(short_host, DCP, rank).numel() % PHYSICAL:
            # 0.5.20+ slices the rank's share of any run; the direct copy takes whole pages only.
            with pytest.raises(ValueError, match="indices size must be divisible by page size"):
                pool.backup_from_device_all_layer(dev, short_host, short_dev, backend)
        else:  # 0.5.20+ slices the rank's share of any run, as its free function does
            pool.backup_from_device_all_layer(dev, short_host, short_dev, backend)
        assert torch.equal(pool.kv_buffer, expected)  # the same device rows, or nothing


# --------------------------------------------------------------------------- sizing


def test_logical_and_physical_sizes(side):
    """Restates upstream test_hicache_dcp_host_pool.py::TestHostPoolSizingUnderDcp::test_logical_and_physical_sizing"""
    pool = _dcp_pool(side, 3)
    assert (pool.page_size, pool.logical_page_size) == (PHYSICAL, WIDE)
    assert pool.size == pool.page_num * PHYSICAL
    assert pool.logical_size == pool.size * DCP
    assert pool.kv_buffer.shape[1] == pool.size  # only physical rows are materialized
    assert pool.free_slots.numel() == pool.logical_size  # the allocator is logical
    assert pool.mem_state.numel() == pool.logical_size


def test_allocation_is_by_wide_page(side):
    """Restates upstream test_hicache_dcp_host_pool.py::TestHostPoolSizingUnderDcp::test_alloc_is_widened_page_granular"""
    pool = _dcp_pool(side, 0)
    assert pool.alloc(WIDE).tolist() == list(range(WIDE))
    with pytest.raises(AssertionError):
        pool.alloc(PHYSICAL)


def test_a_pool_without_dcp_is_unchanged(side):
    """Restates upstream test_hicache_dcp_host_pool.py::TestHostPoolSizingUnderDcp::test_non_dcp_pool_unchanged"""
    pool = _dcp_pool(side, 0, dcp=1)
    assert pool.page_size == pool.logical_page_size == PHYSICAL
    assert pool.logical_size == pool.size == pool.page_num * PHYSICAL


# --------------------------------------------------------------------------- L3 pages


@U.requires(not L3_TRANSLATED, "its DCP pools translate L3 pages instead of refusing them")
def test_l3_pages_of_a_dcp_pool_are_refused(side):
    """Restates upstream test_hicache_dcp_host_pool.py::TestTransferEntryPointsTranslate::test_l3_data_page_is_guarded"""
    with pytest.raises(AssertionError, match="not yet DCP-aware"):
        _dcp_pool(side, 0).get_data_page(0)


_L3_WHY = "its DCP pools refuse L3 pages (not yet DCP-aware)"


@U.requires(L3_TRANSLATED, _L3_WHY)
def test_page_offset_becomes_a_physical_row(side):
    """Restates upstream test_hicache_dcp_host_pool.py::TestL3PageTranslationUnderDcp::test_data_page_offset_is_translated_to_a_physical_row"""
    pool = _dcp_pool(side, 3)
    page = pool.get_data_page(WIDE, flat=False)
    expected = pool.kv_buffer[:, PHYSICAL : 2 * PHYSICAL, :, :]
    assert page.shape == expected.shape == (2, PHYSICAL, 1, 12)
    assert page.data_ptr() == expected.data_ptr()


@U.requires(L3_TRANSLATED, _L3_WHY)
def test_a_page_is_one_ranks_shard(side):
    """Restates upstream test_hicache_dcp_host_pool.py::TestL3PageTranslationUnderDcp::test_page_length_stays_physical"""
    pool = _dcp_pool(side, 0)
    flat = pool.get_data_page(0)
    assert flat.numel() == pool.layer_num * PHYSICAL * pool.kv_cache_dim == 2 * 64 * 12
    assert flat.numel() == pool.get_dummy_flat_data_page().numel()


@U.requires(L3_TRANSLATED, _L3_WHY)
def test_a_flat_page_lands_on_the_owned_row_only(side):
    """Restates upstream test_hicache_dcp_host_pool.py::TestL3PageTranslationUnderDcp::test_set_from_flat_data_page_round_trips_at_the_owned_row"""
    pool = _dcp_pool(side, 6)
    pool.kv_buffer.zero_()
    payload = torch.arange(pool.layer_num * PHYSICAL * pool.kv_cache_dim, dtype=pool.dtype)
    pool.set_from_flat_data_page(2 * WIDE, payload)
    assert torch.equal(pool.get_data_page(2 * WIDE), payload)
    assert torch.equal(pool.kv_buffer[:, 2 * PHYSICAL : 3 * PHYSICAL].flatten(), payload)
    rest = torch.cat([pool.kv_buffer[:, : 2 * PHYSICAL], pool.kv_buffer[:, 3 * PHYSICAL :]], 1)
    assert int(rest.abs().sum()) == 0  # nothing outside that physical page moved


@U.requires(L3_TRANSLATED, _L3_WHY)
def test_every_rank_reads_the_same_row_of_its_own_buffer(side):
    """Restates upstream test_hicache_dcp_host_pool.py::TestL3PageTranslationUnderDcp::test_every_rank_reads_its_own_buffer_at_the_same_row"""
    offsets = set()
    for rank in range(DCP):
        pool = _dcp_pool(side, rank)
        page = pool.get_data_page(3 * WIDE, flat=False)
        offsets.add(page.data_ptr() - pool.kv_buffer.data_ptr())
    assert offsets == {3 * PHYSICAL * 12 * 2}  # row 192 of fp16 rows of 12


@U.requires(L3_TRANSLATED, _L3_WHY)
def test_an_unaligned_page_start_is_refused(side):
    """Restates upstream test_hicache_dcp_host_pool.py::TestL3PageTranslationUnderDcp::test_unaligned_index_is_refused_rather_than_translated"""
    pool = _dcp_pool(side, 1)
    with pytest.raises(ValueError):
        pool.get_data_page(WIDE + 1)
    with pytest.raises(ValueError):
        pool.set_from_flat_data_page(1, pool.get_dummy_flat_data_page())


def test_without_dcp_page_offsets_are_untouched(side):
    """Restates upstream test_hicache_dcp_host_pool.py::TestL3PageTranslationUnderDcp::test_without_dcp_offsets_are_untouched
    (less its `dcp_page_row` helper, which no release here has)"""
    pool = _dcp_pool(side, 0, dcp=1)
    assert pool.dcp_size == 1
    page = pool.get_data_page(PHYSICAL, flat=False)
    assert page.data_ptr() == pool.kv_buffer[:, PHYSICAL : 2 * PHYSICAL].data_ptr()


@U.requires(L3_TRANSLATED, _L3_WHY)
def test_invalid_logical_page_starts_are_refused(side):
    """Restates upstream test_hicache_dcp_host_pool.py::TestDcpStoragePages::test_invalid_logical_starts_are_rejected"""
    pool = _dcp_pool(side, 1, dcp=2, layout="page_first")
    for index in (-128, 1, 64):
        with pytest.raises(ValueError):
            pool.get_data_page(index)
        with pytest.raises(ValueError):
            pool.set_from_flat_data_page(index, pool.get_dummy_flat_data_page())
    with pytest.raises(IndexError):
        pool.get_data_page(pool.logical_size)
    pointers, sizes = pool.get_page_buffer_meta(torch.arange(128))
    assert pointers == [pool.kv_buffer.data_ptr()]
    assert sizes == [64 * 2 * 12 * pool.kv_buffer.element_size()]


def _page_rows(buffer, layout, page):
    if layout == "layer_first":
        return buffer[:, page * PHYSICAL : (page + 1) * PHYSICAL]
    if layout == "page_first":
        return buffer[page * PHYSICAL : (page + 1) * PHYSICAL]
    return buffer[page : page + 1]


@U.requires(L3_TRANSLATED, _L3_WHY)
@pytest.mark.parametrize("layout", ["layer_first", "page_first", "page_first_direct"])
def test_pages_round_trip_through_the_file_backend(side, layout, monkeypatch):
    """Restates upstream test_hicache_dcp_host_pool.py::TestDcpStoragePages::test_file_round_trip_to_different_allocations
    (bf16 and fp8-as-uint8 rows; the file backend of this release takes no dtype or layout)"""
    from sglang.srt.mem_cache.hicache_storage import HiCacheFile, HiCacheStorageConfig

    with tempfile.TemporaryDirectory() as directory:
        monkeypatch.setenv("SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR", directory)
        for dcp, dtype in product((2, 4), (torch.bfloat16, torch.uint8)):
            for rank in range(dcp):
                source = _dcp_pool(side, rank, dcp=dcp, layout=layout, dtype=dtype)
                target = _dcp_pool(side, rank, dcp=dcp, layout=layout, dtype=dtype)
                values = (torch.arange(source.kv_buffer.numel()) * 13 + rank * 17) % 251
                source.kv_buffer.copy_(values.reshape(source.kv_buffer.shape))
                target.kv_buffer.fill_(255)
                expected = target.kv_buffer.clone()
                backend = HiCacheFile(
                    HiCacheStorageConfig(
                        tp_rank=rank,
                        tp_size=dcp,
                        pp_rank=0,
                        pp_size=1,
                        attn_cp_rank=0,
                        attn_cp_size=1,
                        is_mla_model=True,
                        enable_storage_metrics=False,
                        is_page_first_layout=layout == "page_first",
                        model_name="page-test",
                        dcp_size=dcp,
                        dcp_rank=rank,
                        logical_page_size=PHYSICAL * dcp,
                        extra_config={"max_size": "0", "min_free_space": "0"},
                    )
                )
                page_bytes = PHYSICAL * 2 * 12 * source.kv_buffer.element_size()
                for src_page, dst_page in ((3, 5), (1, 0)):
                    key = f"page-{layout}-{dcp}-{dtype}-{src_page}"
                    payload = source.get_data_page(src_page * PHYSICAL * dcp)
                    assert payload.numel() * payload.element_size() == page_bytes
                    assert torch.equal(
                        payload, _page_rows(source.kv_buffer, layout, src_page).flatten()
                    )
                    assert backend.set(key, payload)
                    path = Path(directory) / f"{backend._get_suffixed_key(key)}.bin"
                    assert os.path.getsize(path) == page_bytes
                    restored = backend.get(key, target.get_dummy_flat_data_page())
                    target.set_from_flat_data_page(dst_page * PHYSICAL * dcp, restored)
                    _page_rows(expected, layout, dst_page).copy_(
                        _page_rows(source.kv_buffer, layout, src_page)
                    )
                assert torch.equal(target.kv_buffer, expected), (dcp, dtype, rank)
