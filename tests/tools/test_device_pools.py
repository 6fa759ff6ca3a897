"""The reference device pools carry SGLang's attribute names and shapes (host-pool-contract.md
§2.0), which is all the host pools read."""

from __future__ import annotations

import pytest
import torch
from hostkv_rs import MHATokenToKVPool, MLATokenToKVPool


def test_mha_device_pool_shapes_and_tables():
    dp = MHATokenToKVPool(64, 16, torch.bfloat16, 4, 8, 3, v_head_dim=6)
    assert (dp.size, dp.page_size, dp.layer_num) == (64, 16, 3)
    assert (dp.head_num, dp.head_dim, dp.v_head_dim, dp.row_dim) == (4, 8, 6, 32)
    assert dp.store_dtype == dp.dtype == torch.bfloat16
    assert dp.device == "cpu"
    assert (dp.start_layer, dp.end_layer) == (0, 2)
    assert dp.layer_shard_enabled is False and dp._owned_local_layer_range() == (0, 3)
    assert len(dp.k_buffer) == len(dp.v_buffer) == 3
    for k, v in zip(dp.k_buffer, dp.v_buffer, strict=True):
        assert k.shape == (80, 4, 8) and v.shape == (80, 4, 6)
        assert not k.any() and not v.any()
    assert dp.k_data_ptrs.dtype == torch.uint64
    assert dp.k_data_ptrs.tolist() == [t.data_ptr() for t in dp.k_buffer]
    assert dp.v_data_ptrs.tolist() == [t.data_ptr() for t in dp.v_buffer]
    assert dp.data_ptrs.tolist() == dp.k_data_ptrs.tolist() + dp.v_data_ptrs.tolist()
    assert dp.data_strides.tolist() == [64] * 3 + [48] * 3
    assert dp.get_key_buffer(1) is dp.k_buffer[1]
    assert dp.get_kv_buffer(2) == (dp.k_buffer[2], dp.v_buffer[2])


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_fp8_is_stored_as_uint8(dtype):
    dp = MHATokenToKVPool(16, 4, dtype, 1, 8, 2)
    assert dp.dtype == dtype and dp.store_dtype == torch.uint8
    assert dp.k_buffer[0].dtype == torch.uint8
    mla = MLATokenToKVPool(16, 4, dtype, 8, 8, 2)
    assert mla.store_dtype == torch.uint8 and mla.kv_buffer[0].dtype == torch.uint8


def test_mla_device_pool():
    dp = MLATokenToKVPool(32, 8, torch.bfloat16, 12, 4, 5, start_layer=2, end_layer=6)
    assert dp.kv_cache_dim == 16
    assert len(dp.kv_buffer) == 5 and dp.kv_buffer[0].shape == (40, 1, 16)
    assert dp.data_ptrs.tolist() == [t.data_ptr() for t in dp.kv_buffer]
    assert dp.get_key_buffer(3) is dp.kv_buffer[1]
    packed = MLATokenToKVPool(32, 8, torch.uint8, 512, 64, 1, kv_cache_dim=656)
    assert packed.kv_buffer[0].shape == (40, 1, 656)


def test_bad_arguments():
    with pytest.raises(ValueError, match="size"):
        MHATokenToKVPool(0, 4, torch.bfloat16, 1, 8, 2)
    with pytest.raises(TypeError, match="dtype"):
        MHATokenToKVPool(16, 4, "bf16", 1, 8, 2)
    with pytest.raises(ValueError, match="cpu or cuda"):
        MLATokenToKVPool(16, 4, torch.bfloat16, 8, 8, 2, device="meta")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.gpu
def test_cuda_device_pool_tables_live_on_the_gpu():
    dp = MHATokenToKVPool(16, 4, torch.bfloat16, 1, 8, 2, device="cuda")
    assert dp.k_buffer[0].is_cuda and dp.k_data_ptrs.is_cuda
    assert dp.k_data_ptrs.cpu().tolist() == [t.data_ptr() for t in dp.k_buffer]
