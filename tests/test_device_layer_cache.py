"""The per-pool cache of checked device layers must never serve stale pointers or shapes."""

from __future__ import annotations

import pytest
import torch
from hostkv_rs import MHATokenToKVPool, MHATokenToKVPoolHost


def _pools():
    dev = MHATokenToKVPool(64, 16, torch.bfloat16, head_num=2, head_dim=8, layer_num=3)
    host = MHATokenToKVPoolHost(dev, 2.0, 0, 16, "layer_first")
    return dev, host


def test_repeated_loads_follow_a_tensor_whose_storage_was_swapped():
    dev, host = _pools()
    h = host.alloc(16)
    d = torch.arange(16, 32)
    host.kv_buffer.view(torch.uint8).fill_(7)
    host.load_to_device_per_layer(dev, h, d, 1, "kernel")  # primes the cache
    replacement = torch.zeros_like(dev.k_buffer[1])
    dev.k_buffer[1].set_(replacement)  # same Python object, new memory
    host.load_to_device_per_layer(dev, h, d, 1, "kernel")
    assert torch.equal(replacement.view(torch.uint8)[16:32], host.k_buffer[1][h].view(torch.uint8))


def test_a_reshaped_tensor_is_checked_again():
    dev, host = _pools()
    h = host.alloc(16)
    d = torch.arange(16, 32)
    host.load_to_device_per_layer(dev, h, d, 1, "kernel")
    dev.k_buffer[1].set_(torch.zeros(80, 4, 8, dtype=torch.bfloat16))  # rows no longer match
    with pytest.raises(ValueError, match=r"head split \(4, 8\) \(heads, head_dim\) differs"):
        host.load_to_device_per_layer(dev, h, d, 1, "kernel")


def test_a_new_device_pool_is_not_confused_with_a_dead_one():
    dev, host = _pools()
    h = host.alloc(16)
    d = torch.arange(16, 32)
    host.kv_buffer.view(torch.uint8).fill_(3)
    host.load_to_device_per_layer(dev, h, d, 0, "direct")
    del dev
    dev2 = MHATokenToKVPool(64, 16, torch.bfloat16, head_num=2, head_dim=8, layer_num=3)
    host.load_to_device_per_layer(dev2, h, d, 0, "direct")
    assert bool((dev2.k_buffer[0][16:32].view(torch.uint8) == 3).all())
