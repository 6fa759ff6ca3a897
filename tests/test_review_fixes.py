"""Regression tests for bugs found in the pre-release review of the Python package."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hostkv_rs import MHATokenToKVPool, MHATokenToKVPoolHost, MLATokenToKVPool, MLATokenToKVPoolHost
from hostkv_rs.v4 import DeepSeekV4PagedHostPool, LogicalHostPool


def _v4_pool(pages: int = 8, item: int = 16, page_size: int = 2):
    device = [torch.zeros(pages, item, dtype=torch.uint8) for _ in range(2)]
    return DeepSeekV4PagedHostPool("c4", device, item, pages, page_size), device


def test_logical_free_owns_a_numpy_array_it_was_given():
    pool = LogicalHostPool(16, 4)
    pool.alloc(16)
    freed = np.arange(4, dtype=np.int64)
    assert pool.free(freed) == 4
    freed[:] = 99  # the caller reuses its buffer; the pool must not see it
    assert pool.alloc(4).tolist() == [0, 1, 2, 3]


def test_v4_free_owns_a_numpy_array_it_was_given():
    pool, _ = _v4_pool()
    pool.alloc(pool.size)
    freed = np.array([0, 1], dtype=np.int64)
    pool.free(freed)
    freed[:] = 1000  # outside the pool: handing it out later would name a slot that is not there
    assert pool.alloc(2).tolist() == [0, 1]


def test_logical_free_refuses_float_slots_instead_of_truncating():
    pool = LogicalHostPool(16, 2)
    pool.alloc(16)
    with pytest.raises(TypeError, match="integer tensors"):
        pool.free([1.5, 2.5])
    assert pool.num_release_slots == 0


def test_v4_transfer_refuses_float_indices_instead_of_truncating():
    pool, device = _v4_pool()
    device[0][1] = 7
    with pytest.raises(TypeError, match="integer tensors"):
        pool.backup_from_device_all_layer(None, [2.5, 3.5], [2.7, 3.9], "direct")
    assert int(pool.kv_buffer[0].sum()) == 0


def test_mla_flat_page_on_the_meta_device_is_a_value_error():
    dev = MLATokenToKVPool(64, 4, torch.float16, 8, 4, 2)
    host = MLATokenToKVPoolHost(dev, 2.0, 0, 4, "layer_first")
    page = torch.empty(host.get_dummy_flat_data_page().numel(), device="meta")
    with pytest.raises(ValueError, match="meta device"):
        host.set_from_flat_data_page(0, page)


def test_hisparse_unaligned_row_end_is_refused_before_taking_slots():
    dev = MLATokenToKVPool(64, 4, torch.float16, 8, 4, 2)
    host = MLATokenToKVPoolHost(dev, 2.0, 0, 4, "layer_first")
    row = torch.full((1, 16), -1, dtype=torch.int64)
    allocated = torch.tensor([2])
    before = host.available_size()
    with pytest.raises(ValueError, match="not a multiple of the page size 4"):
        host.alloc_paged_token_slots(row, allocated, 0, 0, 6)
    assert host.available_size() == before
    assert int(allocated[0]) == 2


def test_split_heads_factor_must_be_an_integer():
    dev = MHATokenToKVPool(64, 4, torch.float16, 4, 8, 2)
    host = MHATokenToKVPoolHost(dev, 2.0, 0, 4, "page_head")
    with pytest.raises(TypeError, match="split_factor must be an integer"):
        host.get_split_heads_page_buffer_meta(torch.arange(4), 2.5)
