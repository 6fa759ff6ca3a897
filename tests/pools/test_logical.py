"""LogicalHostPool against the contract (host-pool-contract.md §1.5, §2.5, §4.1, §4.4, §4.5)."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
from hostkv_rs import LogicalHostPool


def test_attributes():
    pool = LogicalHostPool(64, 16)
    assert (pool.size, pool.logical_size, pool.page_size) == (64, 64, 16)
    assert pool.layout == "layer_first"
    assert (pool.layer_num, pool.start_layer, pool.end_layer) == (0, 0, 0)
    assert pool.kv_buffer is None  # storage backends read None as "anchor only"
    assert pool.size_per_token == 0 and pool.get_ksize_per_token() == 0
    assert pool.dtype == torch.uint8
    assert pool.device == "cpu"
    assert pool.allocator is None
    assert pool.can_use_write_back_jit is True
    assert isinstance(pool.lock, type(threading.RLock()))
    assert LogicalHostPool(32, 8, layout="page_first").layout == "page_first"
    # G-Sep26 extras
    assert pool.get_page_buffer_element_size() is None
    assert pool.get_page_buffer_element_size(split_factor=2) is None
    assert pool.shared_allocation_domain is None
    assert pool.stores_page_envelope is False
    assert pool.storage_format_tag is None
    assert pool.destroy() is None


def test_size_must_be_page_aligned():
    with pytest.raises(ValueError) as e:
        LogicalHostPool(65, 16)
    assert str(e.value) == "LogicalHostPool size must be page-aligned, got size=65, page_size=16"
    with pytest.raises(ValueError, match="page_size must be positive"):
        LogicalHostPool(64, 0)
    with pytest.raises(ValueError, match="size must not be negative"):
        LogicalHostPool(-16, 16)


def test_alloc_is_page_checked_fifo():
    pool = LogicalHostPool(64, 16)
    with pytest.raises(ValueError) as e:
        pool.alloc(17)
    assert str(e.value) == (
        "LogicalHostPool allocation must be page-aligned, got need_size=17, page_size=16"
    )
    assert pool.available_size() == 64
    assert pool.alloc(16).tolist() == list(range(16))
    assert pool.alloc(32).tolist() == list(range(16, 48))
    assert pool.alloc(32) is None
    assert pool.available_size() == 16
    assert pool.alloc(0).numel() == 0
    with pytest.raises(ValueError):
        pool.alloc(-16)
    assert pool.available_size() == 16


def test_free_is_page_checked_and_changes_nothing_when_refused():
    pool = LogicalHostPool(64, 16)
    taken = pool.alloc(64)
    with pytest.raises(ValueError) as e:
        pool.free(taken[:15])
    assert str(e.value) == (
        "LogicalHostPool free must be page-aligned, got len(indices)=15, page_size=16"
    )
    with pytest.raises(ValueError, match=r"indices must lie in \[0, 64\)"):
        pool.free(torch.arange(60, 76))
    assert pool.available_size() == 0 and pool.release_slots == []
    assert pool.free(torch.empty(0, dtype=torch.int64)) == 0
    assert pool.release_slots == []


def test_lazy_release_order_and_conversion():
    pool = LogicalHostPool(64, 16)
    pool.alloc(64)
    assert pool.free(torch.arange(32, 48, dtype=torch.int32)) == 16
    assert pool.free(torch.arange(0, 16).flip(0)) == 16
    # released lazily: counted, kept as int64 CPU chunks in release order
    assert pool.available_size() == 32
    assert len(pool.free_slots) == 0 and pool.num_release_slots == 32
    assert all(c.dtype == torch.int64 and c.device.type == "cpu" for c in pool.release_slots)
    assert pool.alloc(16).tolist() == list(range(32, 48))
    assert pool.alloc(16).tolist() == list(range(15, -1, -1))
    assert pool.alloc(16) is None


def test_free_flattens():
    pool = LogicalHostPool(32, 4)
    pool.alloc(32)
    # len() of a (4, 4) tensor is 4 rows, page-aligned; all 16 entries are released
    assert pool.free(torch.arange(16).reshape(4, 4)) == 4
    assert pool.num_release_slots == 16
    assert pool.release_slots[0].shape == (16,)
    assert pool.free([20, 21, 22, 23]) == 4


def test_single_chunk_is_adopted_and_clear_resets():
    pool = LogicalHostPool(32, 8)
    pool.alloc(32)
    pool.free(torch.arange(24, 32))
    assert pool.alloc(8).tolist() == list(range(24, 32))
    pool.clear()
    assert pool.available_size() == 32
    assert pool.free_slots.tolist() == list(range(32))
    assert pool.release_slots == [] and pool.num_release_slots == 0


def test_transfers_and_pages_are_no_ops():
    pool = LogicalHostPool(32, 8)
    before = (pool.free_slots.clone(), list(pool.release_slots))
    # transfers take any arguments and do nothing, even for layouts/backends a real pool refuses
    assert (
        pool.backup_from_device_all_layer(None, torch.arange(8), torch.arange(3), "bogus") is None
    )
    assert pool.load_to_device_per_layer(None, torch.arange(8), None, 99, "direct") is None
    assert pool.load_to_device_per_layer(None, None, None, 0, "kernel", is_draft=True) is None
    for page in (pool.get_data_page(8), pool.get_data_page(0, flat=False)):
        assert page.dtype == torch.uint8 and page.numel() == 0
    dummy = pool.get_dummy_flat_data_page()
    assert dummy.dtype == torch.uint8 and dummy.numel() == 0
    assert pool.set_from_flat_data_page(0, torch.ones(10, dtype=torch.uint8)) is None
    assert pool.get_page_buffer_meta(torch.arange(8)) is None
    assert torch.equal(pool.free_slots, before[0]) and pool.release_slots == before[1]


def test_logical_free_owns_a_numpy_array_it_was_given():
    pool = LogicalHostPool(16, 4)
    pool.alloc(16)
    freed = np.arange(4, dtype=np.int64)
    assert pool.free(freed) == 4
    freed[:] = 99  # the caller reuses its buffer; the pool must not see it
    assert pool.alloc(4).tolist() == [0, 1, 2, 3]


def test_logical_free_refuses_float_slots_instead_of_truncating():
    pool = LogicalHostPool(16, 2)
    pool.alloc(16)
    with pytest.raises(TypeError, match="integer tensors"):
        pool.free([1.5, 2.5])
    assert pool.num_release_slots == 0


def test_a_zero_page_size_is_also_sglangs_zero_division():
    with pytest.raises(ZeroDivisionError, match="page_size must be positive, got 0") as exc:
        LogicalHostPool(0, 0)
    assert isinstance(exc.value, ValueError)
