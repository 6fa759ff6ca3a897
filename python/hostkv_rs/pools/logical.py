"""`LogicalHostPool`: page-aligned token slots without any KV bytes. DeepSeek V4 side pools use
its slots as stable page anchors (SGLang's HiCache anchor pool)."""

from __future__ import annotations

import torch

from hostkv_rs import _core
from hostkv_rs.pools import memory as _memory
from hostkv_rs.pools.args import ZeroSizeError, as_int
from hostkv_rs.pools.base import new_pool_lock, synchronized
from hostkv_rs.pools.slots import (
    SlotFreeList,
    refuse_single_slot,
    slot_table_bytes,
    slots_in_pool,
)
from hostkv_rs.sglang import handover as _handover


class LogicalHostPool(SlotFreeList, metaclass=_handover.PoolMeta):
    """Page-aligned token slots without any KV bytes: the V4 HiCache anchor pool."""

    # G-Sep26 storage hooks; a logical anchor has no physical page envelope.
    shared_allocation_domain = None
    stores_page_envelope = False
    storage_format_tag = None

    def __init__(self, size: int, page_size: int, layout: str = "layer_first"):
        size, page_size = as_int("size", size), as_int("page_size", page_size)
        if page_size <= 0:
            raise (ZeroSizeError if page_size == 0 else ValueError)(
                f"LogicalHostPool page_size must be positive, got {page_size}"
            )
        if size < 0:
            raise ValueError(f"LogicalHostPool size must not be negative, got {size}")
        if size % page_size != 0:
            raise ValueError(
                f"LogicalHostPool size must be page-aligned, got size={size}, page_size={page_size}"
            )
        self.size = size
        # Stands in for a host pool (and group anchor); DCP never widens it.
        self.logical_size = size
        self.page_size = page_size
        self.device = "cpu"
        self.layout = layout
        self.dtype = torch.uint8
        self.layer_num = 0
        self.start_layer = 0
        self.end_layer = 0
        self.kv_buffer = None
        self.size_per_token = 0
        self.allocator = None
        # True on purpose: a group's flag is the AND over its pools, and the anchor must not
        # veto the staged write-back of the pools that do carry bytes.
        self.can_use_write_back_jit = True
        # SGLang checks no memory here; a huge anchor pool would fail inside torch's allocator.
        _memory.check_allocations_fit(
            f"LogicalHostPool(size={size})", {"slot tables": slot_table_bytes(size)}
        )
        new_pool_lock(self)
        self.clear()

    @synchronized
    def clear(self):
        self._reset_free_list(self.size)

    # Two reads (the free list, the release count) that a concurrent free's merge changes in
    # between: under the lock, as alloc and free run.
    available_size = synchronized(SlotFreeList.available_size)

    def destroy(self) -> None:
        return None

    @synchronized
    def alloc(self, need_size: int) -> torch.Tensor | None:
        need_size = as_int("need_size", need_size)
        if need_size % self.page_size != 0:
            raise ValueError(
                "LogicalHostPool allocation must be page-aligned, "
                f"got need_size={need_size}, page_size={self.page_size}"
            )
        if need_size < 0:
            raise ValueError(f"LogicalHostPool allocation must not be negative, got {need_size}")
        return self._take_slots(need_size)

    @synchronized
    def free(self, indices) -> int:
        # SGLang counts len() (the rows of a 2-D tensor) and releases every entry. No dtype in
        # the conversion: int64 would truncate 1.5 to 1, and float or bool values are not slots.
        # Stricter than SGLang on purpose: a double or foreign free is refused (the MHA/MLA
        # pools' error), where SGLang's count of available slots would drift past the size.
        indices = _core.as_tensor(indices)
        refuse_single_slot(indices, "LogicalHostPool free")
        n = len(indices)
        if n % self.page_size != 0:
            raise ValueError(
                "LogicalHostPool free must be page-aligned, "
                f"got len(indices)={n}, page_size={self.page_size}"
            )
        if n == 0:
            return 0
        self._release_slots(slots_in_pool(indices, self.size, "LogicalHostPool free"))
        return n

    def backup_from_device_all_layer(self, device_pool, host_indices, device_indices, io_backend):
        pass

    def load_to_device_per_layer(
        self, device_pool, host_indices, device_indices, layer_id, io_backend, *, is_draft=False
    ):
        pass

    # SGLang 0.5.21+ L2TransferEngine hooks: an anchor has nothing to resolve or move.

    def prepare_transfer_indices(self, host_indices, device_indices, io_backend):
        return host_indices, device_indices

    def backup_from_device_all_layer_physical(
        self, device_pool, host_indices, device_indices, io_backend
    ):
        pass

    def load_to_device_per_layer_physical(
        self, device_pool, host_indices, device_indices, layer_id, io_backend, *, is_draft=False
    ):
        pass

    def get_data_page(self, index, flat=True):
        return torch.empty(0, dtype=torch.uint8)

    def get_dummy_flat_data_page(self):
        return torch.empty(0, dtype=torch.uint8)

    def set_from_flat_data_page(self, index, data_page):
        pass

    def get_page_buffer_meta(self, indices):
        return None

    def get_page_buffer_element_size(self, split_factor: int = 1):
        return None

    def get_ksize_per_token(self):
        return 0
