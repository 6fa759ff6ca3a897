"""Helpers for a host pool's device side. The mapping of controller layer ids to host layers and
device tensors, and every check of those tensors, live in the core (`_core.DeviceBinding`):
SGLang 0.5.22+ captures the device buffers when it builds a host pool (0.5.23 from buffer infos
holding only this rank's layers), and so does the pool, once, at construction.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from hostkv_rs.pools.args import as_int


def ptr_table(tensors, device) -> torch.Tensor:
    """SGLang's uint64 table of `data_ptr()`s on `device` (the pools' `*_data_ptrs`)."""
    return torch.tensor([t.data_ptr() for t in tensors], dtype=torch.uint64, device=device)


def first_device(planes: Sequence[Sequence]) -> torch.device:
    """The device of the first device layer tensor (CPU without any); unchecked: the core's
    binding checks every tensor on first use."""
    for plane in planes:
        for tensor in plane:
            return getattr(tensor, "device", torch.device("cpu"))
    return torch.device("cpu")


def layers_device(side: dict) -> torch.device:
    """The device a pool's transfers run on: its device layers' (a CUDA tensor's device names
    the GPU index SGLang's bare "cuda" string lacks), or the device pool's for a pool given only
    geometry."""
    return side.get("device") or first_device(side.get("planes") or ())


def layer_key(layer_id) -> int:
    """A layer id as an int. SGLang compares it with ints (`0 <= layer_id < n`), so a value that
    is not an integer fails there too; a bool is refused rather than read as 0 or 1."""
    return as_int("layer_id", layer_id)


def device_pool_extent(device_pool) -> tuple[int, int, int]:
    """(device capacity in tokens, start layer, end layer) of a device pool, as SGLang's host
    pools read them (`host_capacity_tokens` where the pool has it, else `size`)."""
    capacity = getattr(device_pool, "host_capacity_tokens", None)
    size = device_pool.size if capacity is None else capacity
    return size, device_pool.start_layer, device_pool.end_layer


def owned_range(device_pool) -> tuple[int, int]:
    """`[start, end)` of the local device layers a (possibly layer-sharded) device pool stores."""
    if getattr(device_pool, "layer_shard_enabled", False):
        start, end = device_pool._owned_local_layer_range()
        return int(start), int(end)
    if not hasattr(device_pool, "layer_num"):
        raise TypeError(
            f"device_pool must be a device KV pool (with layer_num), got "
            f"{type(device_pool).__name__}"
        )
    return 0, int(device_pool.layer_num)


def sharded_host_layer_num(device_pool) -> int:
    """Host target layers SGLang allocates for a device pool: ceil(L / shard) when sharded."""
    if getattr(device_pool, "layer_shard_enabled", False):
        shard = int(device_pool.layer_shard_size)
        return (int(device_pool.layer_num) + shard - 1) // shard
    return int(device_pool.layer_num)
