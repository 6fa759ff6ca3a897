"""`HostKVCache`: SGLang's abstract HiCache host pool (sizing, memory check, slot allocator,
`destroy`) plus the helpers every concrete pool uses to hand a transfer to the Rust core.

The allocator and helpers only read `size`, `page_size`, `lock`, `device` and the optional
`logical_size` / `logical_page_size` / `dcp_size`, so pools that skip `HostKVCache.__init__`
(the DeepSeek V4 pools) can use them after setting those attributes themselves.
"""

from __future__ import annotations

import abc
import logging
import operator
import threading
import weakref
from collections.abc import Sequence
from functools import wraps
from typing import NamedTuple

import torch

from hostkv_rs import _core, _memory
from hostkv_rs._indices import as_index_array, index_arg

logger = logging.getLogger(__name__)

HICACHE_HOST_MEMORY_RESERVE_BYTES = _memory.HICACHE_HOST_MEMORY_RESERVE_BYTES

# Storage backends whose own allocator owns the host memory in SGLang; hostkv_rs always allocates in
# Rust, so selecting one of these deserves a warning rather than silence.
_STORAGE_OWNED_ALLOCATORS = ("mooncake", "mori", "shm", "tensorcast")

# Creating a missing per-pool lock must itself be race-free (pools that skip __init__).
_LOCK_CREATION = threading.Lock()


def _pool_lock(pool) -> threading.RLock:
    lock = getattr(pool, "lock", None)
    if lock is None:
        with _LOCK_CREATION:
            lock = getattr(pool, "lock", None)
            if lock is None:
                lock = threading.RLock()
                pool.lock = lock
    return lock


def synchronized(func):
    """Run the method while holding the pool's one `RLock` (`self.lock`)."""

    @wraps(func)
    def wrapper(self, *args, **kwargs):
        with _pool_lock(self):
            return func(self, *args, **kwargs)

    return wrapper


def ptr_table(tensors, device) -> torch.Tensor:
    """SGLang's uint64 table of `data_ptr()`s on `device` (the pools' `*_data_ptrs`)."""
    return torch.tensor([t.data_ptr() for t in tensors], dtype=torch.uint64, device=device)


def as_int(name: str, value) -> int:
    if isinstance(value, bool):
        raise TypeError(f"{name} must be an integer, got {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an integer, got {value!r}") from None


def positive_int(name: str, value) -> int:
    value = as_int(name, value)
    if value <= 0:
        raise ValueError(f"{name} must be positive, got {value}")
    return value


def sync_fixed_hicache_size(size: int, host_size) -> int:
    """MIN-reduce a fixed-size (`--hicache-size`) token capacity over SGLang's PP group, so every
    pipeline stage exposes the same host capacity. A no-op outside a distributed SGLang run."""
    if host_size <= 0:
        return size
    try:
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            return size
        from sglang.srt.distributed.parallel_state import get_pp_group

        pp_group = get_pp_group()
    except (ImportError, AssertionError):
        return size
    if pp_group.world_size <= 1:
        return size
    tensor = torch.tensor(size, dtype=torch.int64)
    dist.all_reduce(tensor, op=dist.ReduceOp.MIN, group=pp_group.cpu_group)
    synced = int(tensor.item())
    if synced != size:
        logger.info("Sync fixed-size HiCache host token capacity from %d to %d.", size, synced)
    return synced


def refuse_layer_sharding(device_pool) -> None:
    """CP layer sharding (a device pool holding only some layers) is not mirrored yet; copying as
    if every layer were local would move the wrong layers, so refuse it up front."""
    if getattr(device_pool, "layer_shard_enabled", False):
        raise NotImplementedError(
            "hostkv_rs host pools do not support layer-sharded device pools "
            "(device_pool.layer_shard_enabled is set)"
        )


def ranks_per_host() -> int:
    """Ranks of this job on this machine (SGLang's `base.ranks_per_host`)."""
    return _memory.ranks_per_host()


def host_memory_budget_bytes() -> int:
    """Host RAM this rank may claim for a HiCache pool: (available - 10 GiB) // ranks_per_host()
    (G-Aug26). Kept under SGLang's name in this module, so code that patches
    `base.host_memory_budget_bytes` (as SGLang's tests do) steers the check; it defers to
    `_memory` so patching that module works as well."""
    return _memory.host_memory_budget_bytes()


def check_host_memory(requested_bytes: int) -> int:
    """Raise SGLang's ValueError when `requested_bytes` exceeds the G-Aug26 host budget; returns
    the budget. The budget function is looked up at call time so tests can patch it."""
    available_bytes = host_memory_budget_bytes()
    if requested_bytes > available_bytes:
        raise ValueError(
            f"Not enough host memory available. Requesting {requested_bytes / 1e9:.2f} GB but "
            f"only have {available_bytes / 1e9:.2f} GB free. Please reduce the size of the "
            f"hierarchical cache."
        )
    return available_bytes


def get_allocator_from_storage(allocator_type=None, pool_label: str = "kv"):
    """SGLang picks the host allocator from `--hicache-storage-backend`; hostkv_rs always
    allocates in Rust, so every type gets the default `HostTensorAllocator`. The storage-owned
    allocators (mooncake, mori, shm, tensorcast) deserve a warning rather than silence."""
    if allocator_type in _STORAGE_OWNED_ALLOCATORS:
        logger.warning(
            "hostkv_rs allocates HiCache host memory itself; the %r storage allocator is "
            "not used for the %s host pool.",
            allocator_type,
            pool_label,
        )
    return _memory.HostTensorAllocator()


_CPU = torch.device("cpu")


def slots_in_pool(indices, size: int, what: str) -> torch.Tensor:
    """`indices` as a CPU int64 tensor of slots in `[0, size)` that the pool owns: a copy, since
    the caller may keep writing to what it passed (a tensor, or a numpy array that
    `as_index_array` only wraps) after the slots sit on a release list."""
    slots = as_index_array(indices, _CPU).to(torch.int64)
    if slots.numel():
        lo, hi = int(slots.min()), int(slots.max())
        if lo < 0 or hi >= size:
            raise ValueError(f"{what}: indices must lie in [0, {size}), got min={lo}, max={hi}")
    return slots.clone()


class SlotFreeList:
    """SGLang's lazy-release free list: `alloc` takes from the front of `free_slots`, `free`
    parks chunks on `release_slots`, merged only when `free_slots` runs short (one torch.cat per
    merge, not per free; #30658). Pool-specific checks stay with each pool's alloc/free."""

    def _reset_free_list(self, n: int) -> None:
        self.free_slots = torch.arange(n, dtype=torch.int64)
        self.release_slots = []
        self.num_release_slots = 0

    def available_size(self):
        return len(self.free_slots) + self.num_release_slots

    def _merge_release_slots(self):
        if self.num_release_slots == 0:
            return
        if len(self.free_slots) == 0 and len(self.release_slots) == 1:
            self.free_slots = self.release_slots[0]
        else:
            self.free_slots = torch.cat([self.free_slots, *self.release_slots])
        self.release_slots = []
        self.num_release_slots = 0

    def _take_slots(self, need_size: int, vet=None) -> torch.Tensor | None:
        """The first `need_size` free slots (a view of the free list, as in SGLang), or None when
        the pool is short. `vet(selected)` may refuse them before the free list moves on."""
        if need_size > self.available_size():
            return None
        if need_size > len(self.free_slots):
            self._merge_release_slots()
        selected = self.free_slots[:need_size]
        if vet is not None:
            vet(selected)
        self.free_slots = self.free_slots[need_size:]
        return selected

    def _release_slots(self, slots: torch.Tensor) -> None:
        self.release_slots.append(slots)
        self.num_release_slots += slots.numel()


class DeviceLayers(NamedTuple):
    """The device side of one transfer, as `PoolCore.backup/load` take it."""

    ptrs: list[int]
    rows: int
    device: str  # "cpu" | "cuda"
    stream: int
    engine: str


def _checked_layers(planes: Sequence[Sequence], item_bytes: Sequence[int], what: str):
    """Check per-plane lists of device layer tensors: `(ptrs, rows, device_type, cuda_device)`.

    Every tensor must be a dense layer-first array whose rows are exactly the host item size of
    its plane; all must sit on one device type (CPU or CUDA). `rows` is the smallest dim 0, so
    the core's bounds check covers every layer. Pointers are plane-major.
    """
    ptrs: list[int] = []
    rows: int | None = None
    device_type: str | None = None
    cuda_device = None
    for plane, (tensors, want) in enumerate(zip(planes, item_bytes, strict=True)):
        for layer, tensor in enumerate(tensors):
            where = f"{what} plane {plane} layer {layer}"
            if not isinstance(tensor, torch.Tensor):
                raise TypeError(f"{where}: expected a torch.Tensor, got {type(tensor).__name__}")
            if tensor.device.type not in ("cpu", "cuda"):
                raise ValueError(
                    f"{where}: device pools must be on CPU or CUDA, got {tensor.device}"
                )
            if device_type is None:
                device_type = tensor.device.type
                cuda_device = tensor.device if device_type == "cuda" else None
            elif tensor.device.type != device_type:
                raise ValueError(
                    f"{where}: device tensors mix {device_type} and {tensor.device.type}"
                )
            elif cuda_device is not None and tensor.device != cuda_device:
                # One call runs on one GPU's stream; another GPU's layer is not its memory.
                raise ValueError(f"{where}: device tensors mix {cuda_device} and {tensor.device}")
            if tensor.dim() < 1:
                raise ValueError(f"{where}: expected a tensor with a token dimension")
            if not tensor.is_contiguous():
                raise ValueError(f"{where}: device layer tensors must be contiguous")
            row_bytes = tensor.element_size()
            for extent in tensor.shape[1:]:
                row_bytes *= extent
            if row_bytes != want:
                raise ValueError(
                    f"{where}: device rows are {row_bytes} bytes but the host pool's item size is "
                    f"{want} bytes (dtype or head geometry differs from the host pool)"
                )
            n = tensor.shape[0]
            rows = n if rows is None else min(rows, n)
            ptrs.append(tensor.data_ptr())
    if device_type is None:
        raise ValueError(f"{what}: no device layer tensors")
    return ptrs, rows or 0, device_type, cuda_device


class DeviceLayerCache:
    """Device layers already checked by `_checked_layers`, keyed by tensor identity.

    SGLang's device pools keep the same per-layer tensors for their whole life, and checking a
    tensor costs more than a one-page copy, so a transfer re-checks only what can change under
    the same Python object: its address and shape. Entries hold weak references, so the cache
    never keeps a device pool's memory alive, and it is bounded.
    """

    _LIMIT = 512

    def __init__(self):
        self._entries: dict = {}

    def lookup(self, planes: Sequence[Sequence], item_bytes: Sequence[int], what: str):
        tensors = [t for plane in planes for t in plane]
        key = (tuple(map(id, tensors)), tuple(item_bytes))
        entry = self._entries.get(key)
        if entry is not None:
            refs, shapes, checked = entry
            ptrs = checked[0]
            if all(
                ref() is t and t.data_ptr() == ptr and t.shape == shape
                for ref, t, ptr, shape in zip(refs, tensors, ptrs, shapes)
            ):
                return checked
        checked = _checked_layers(planes, item_bytes, what)
        if len(self._entries) >= self._LIMIT:
            self._entries.clear()
        self._entries[key] = (
            tuple(weakref.ref(t) for t in tensors),
            tuple(t.shape for t in tensors),
            checked,
        )
        return checked


def device_layers(
    planes: Sequence[Sequence],
    item_bytes: Sequence[int],
    what: str,
    cache: DeviceLayerCache | None = None,
) -> DeviceLayers:
    """The device side of one transfer: checked layer pointers (see `_checked_layers`), plus the
    stream and engine of this call."""
    if cache is None:
        ptrs, rows, _, cuda_device = _checked_layers(planes, item_bytes, what)
    else:
        ptrs, rows, _, cuda_device = cache.lookup(planes, item_bytes, what)
    where = cuda_device if cuda_device is not None else _CPU
    return DeviceLayers(ptrs, rows, *stream_and_engine(where))


def stream_and_engine(device: torch.device) -> tuple[str, int, str]:
    """(device type, stream, engine) for the core: torch's current stream of a CUDA device, else
    the CPU engine chosen by HOSTKV_CPU_ENGINE. Only a CUDA device pool may touch torch.cuda:
    CPU-only runs never initialise it."""
    if device.type == "cuda":
        return "cuda", torch.cuda.current_stream(device).cuda_stream, "plan"
    return "cpu", 0, _memory.cpu_engine()


def run_backup(core, backend: str, dev: DeviceLayers, host_idx, dev_idx) -> None:
    core.backup(
        backend,
        dev.ptrs,
        dev.rows,
        index_arg(host_idx),
        index_arg(dev_idx),
        dev.device,
        dev.stream,
        dev.engine,
    )


def run_load(core, backend: str, host_layer: int, dev: DeviceLayers, host_idx, dev_idx) -> None:
    core.load(
        backend,
        host_layer,
        dev.ptrs,
        dev.rows,
        index_arg(host_idx),
        index_arg(dev_idx),
        dev.device,
        dev.stream,
        dev.engine,
    )


def transfer_indices(host_indices, device_indices, io_backend: str, device: str):
    """Index tensors in the form the core reads: contiguous int32/int64. CPU device pools and the
    direct backend read them on the host; a CUDA kernel transfer keeps device-resident indices
    where they are (the kernel bounds-checks them itself)."""
    target = None if (device == "cuda" and io_backend == "kernel") else _CPU
    return as_index_array(host_indices, target), as_index_array(device_indices, target)


def check_io_pair(io_backend, layout: str, supported: dict, ascend_layouts: tuple = ()) -> None:
    """SGLang's refusals for an (io_backend, layout) pair of the MHA and MLA pools: `supported`
    maps each backend served here to its layouts. `kernel_ascend` needs an Ascend NPU: on one of
    its own `ascend_layouts` it is an unsupported backend here, elsewhere an unsupported layout
    (SGLang checks the layout first)."""
    # isinstance first: an unhashable value (a list) must get SGLang's ValueError too.
    if isinstance(io_backend, str) and io_backend in supported:
        if layout not in supported[io_backend]:
            raise ValueError(f"Unsupported layout: {layout}")
        return
    if io_backend == "kernel_ascend" and layout not in ascend_layouts:
        raise ValueError(f"Unsupported layout: {layout}")
    raise ValueError(f"Unsupported IO backend: {io_backend}")


class LayerIndexError(_core.TransferError, IndexError):
    """A layer id outside the pools: a TransferError (nothing was copied) that is also the
    IndexError SGLang's `k_buffer[layer_id]` would raise."""


def check_layer_id(layer_id, device_layers_count: int, host_layers: int) -> int:
    """A local device layer id valid on both sides (Python would otherwise wrap negatives)."""
    layer = as_int("layer_id", layer_id)
    limit = min(device_layers_count, host_layers)
    if not 0 <= layer < limit:
        raise LayerIndexError(
            f"layer_id {layer} is out of range: the device pool has {device_layers_count} layers "
            f"and the host pool {host_layers}"
        )
    return layer


def check_layer_count(what: str, tensors: Sequence, expected: int) -> list:
    tensors = list(tensors)
    if len(tensors) != expected:
        raise _core.TransferError(
            f"{what} has {len(tensors)} layers but the host pool holds {expected}"
        )
    return tensors


class HostKVCache(SlotFreeList, abc.ABC):
    """Abstract HiCache host pool with SGLang's constructor sequence and slot allocator."""

    # Class defaults so that subclasses which skip __init__ still work (as in SGLang).
    dcp_size = 1
    dcp_rank = 0
    pool_label = "kv"
    can_use_write_back_jit = False
    mtp_draft_device_pools: tuple = ()
    # Device pool attributes holding the per-layer tensors of each plane, in plane order (set by
    # the pools that move bytes, e.g. ("k_buffer", "v_buffer")).
    _device_plane_names: tuple = ()

    def __init__(
        self,
        device_pool,
        host_to_device_ratio: float,
        host_size,
        page_size: int,
        layout: str,
        pin_memory: bool,
        device: str,
        allocator_type: str = "default",
        dcp_size: int = 1,
        dcp_rank: int = 0,
        *,
        pool_label: str = "kv",
    ):
        self._init_geometry(
            device_pool,
            host_to_device_ratio,
            host_size,
            page_size,
            layout,
            pin_memory,
            device,
            allocator_type,
            dcp_size,
            dcp_rank,
            pool_label,
        )
        if self.size <= device_pool.size:
            logger.warning(
                "HiCache %s host pool (%d tokens) is smaller than the device pool (%d tokens);"
                "L2 cache effectiveness is reduced."
                "Consider increasing --hicache-ratio (or --hicache-size) for higher L2 cache hit "
                "rate.",
                pool_label,
                self.size,
                device_pool.size,
            )

        requested_bytes = self.size * self.size_per_token
        check_host_memory(requested_bytes)
        # SGLang reads layer_num - target_layer_num here; getattr keeps subclasses that define
        # neither (e.g. allocator-only test pools) working.
        layer_num = getattr(self, "layer_num", 0)
        target_layer_num = getattr(self, "target_layer_num", layer_num)
        draft_layer_num = layer_num - target_layer_num
        if draft_layer_num > 0:
            logger.info(
                "Allocating %s hierarchical KV host pool: %d tokens, %.2f GB host memory, "
                "packed MTP KV layers: target_layers=%d, draft_layers=%d, total_layers=%d.",
                pool_label,
                self.size,
                requested_bytes / 1e9,
                target_layer_num,
                draft_layer_num,
                layer_num,
            )
        else:
            logger.info(
                "Allocating %s hierarchical KV host pool: %d tokens, %.2f GB host memory.",
                pool_label,
                self.size,
                requested_bytes / 1e9,
            )

        self.kv_buffer = self.init_kv_buffer()
        self.fd = getattr(self.allocator, "fd", None)
        self.lock = threading.RLock()
        self.clear()

    def _init_geometry(
        self,
        device_pool,
        host_to_device_ratio,
        host_size,
        page_size,
        layout,
        pin_memory,
        device,
        allocator_type,
        dcp_size,
        dcp_rank,
        pool_label,
        *,
        owns_bytes: bool = True,
    ) -> None:
        """SGLang's constructor steps 1-7 (arguments, geometry, size, page count): everything up
        to the memory check. `owns_bytes=False` is MLA's allocator-only (dummy) pool, which never
        reaches the CPU allocator and words the DCP check as SGLang's dummy init does."""
        self.device_pool = device_pool
        self.pool_label = pool_label
        page_size = positive_int("page_size", page_size)
        dcp_size = positive_int("dcp_size", dcp_size)
        if page_size % dcp_size != 0:
            hint = "; expected the widened page from the DCP paged allocator" if owns_bytes else ""
            raise AssertionError(
                f"HiCache host pool page_size ({page_size}) must be a multiple of dcp_size "
                f"({dcp_size}){hint}."
            )
        dcp_rank = as_int("dcp_rank", dcp_rank)
        if not 0 <= dcp_rank < dcp_size:
            raise ValueError(f"dcp_rank must lie in [0, {dcp_size}), got {dcp_rank}")
        if dcp_size != 1 and not self._dcp_ready():
            raise NotImplementedError(
                f"hostkv_rs host pools do not implement decode context parallelism yet "
                f"(dcp_size={dcp_size}, dcp_rank={dcp_rank}); use dcp_size=1"
            )
        refuse_layer_sharding(device_pool)
        self.dcp_size = dcp_size
        self.dcp_rank = dcp_rank
        self.page_size = page_size // dcp_size
        self.layout = layout
        self.pin_memory = pin_memory
        if owns_bytes and device != "cpu":
            raise AssertionError(
                f"HostTensorAllocator only supports CPU allocations; got device={device!r}"
            )
        self.device = device
        self.allocator_type = allocator_type
        self.allocator = get_allocator_from_storage(allocator_type, pool_label)
        self.can_use_write_back_jit = False

        self.dtype = device_pool.store_dtype
        self.size_per_token = self.get_size_per_token()
        if self.size_per_token <= 0:
            raise ValueError(
                f"{type(self).__name__}: bytes per token must be positive, got "
                f"{self.size_per_token} (check the device pool's layer and head geometry)"
            )
        self.size, self.page_num = self._host_capacity(device_pool, host_to_device_ratio, host_size)
        self.logical_size = self.size * dcp_size
        self.logical_page_size = self.page_size * dcp_size
        self.start_layer = device_pool.start_layer
        self.end_layer = device_pool.end_layer

    # Set True on a subclass whose transfers pass both index tensors through
    # maybe_dcp_kernel_indices (as SGLang's MLA pool does).
    dcp_aware_transfers = False

    @classmethod
    def _dcp_ready(cls) -> bool:
        """DCP only changes the slot space; the allocator handles that. A pool may accept it if
        its transfers translate logical slots, or if it has no transfers of its own."""
        if cls.dcp_aware_transfers:
            return True
        return (
            cls.load_to_device_per_layer is HostKVCache.load_to_device_per_layer
            and cls.backup_from_device_all_layer is HostKVCache.backup_from_device_all_layer
        )

    def _host_capacity(self, device_pool, host_to_device_ratio, host_size) -> tuple[int, int]:
        """(size, page_num): decimal GB / bytes per token (floor) or ratio x device size, then one
        extra page, always (SGLang's `size // page_size + 1`)."""
        if host_size > 0:
            size = int(host_size * 1e9 // self.size_per_token)
            size = sync_fixed_hicache_size(size, host_size)
        else:
            if host_to_device_ratio < 0:
                raise ValueError(
                    f"host_to_device_ratio must not be negative, got {host_to_device_ratio}"
                )
            size = int(device_pool.size * host_to_device_ratio)
        page_num = size // self.page_size + 1
        return page_num * self.page_size, page_num

    # ----------------------------------------------------------------- geometry (abstract)

    @abc.abstractmethod
    def get_size_per_token(self):
        """Bytes per token over all layers; sets the geometry attributes as a side effect."""
        raise NotImplementedError()

    @abc.abstractmethod
    def init_kv_buffer(self):
        """Allocate and return `kv_buffer` (sets `token_stride_size` / `layout_dim`)."""
        raise NotImplementedError()

    # SGLang declares these abstract; here they raise like an abstract method would when called,
    # so that an allocator-only subclass (two abstract methods) can still be built.

    def load_to_device_per_layer(
        self, device_pool, host_indices, device_indices, layer_id, io_backend, *, is_draft=False
    ) -> None:
        raise NotImplementedError()

    def backup_from_device_all_layer(
        self, device_pool, host_indices, device_indices, io_backend
    ) -> None:
        raise NotImplementedError()

    def get_data_page(self, index, flat: bool = True) -> torch.Tensor:
        raise NotImplementedError()

    def get_dummy_flat_data_page(self) -> torch.Tensor:
        raise NotImplementedError()

    def set_from_flat_data_page(self, index: int, data_page: torch.Tensor) -> None:
        raise NotImplementedError()

    def get_ksize_per_token(self):
        return self.get_size_per_token()

    def is_stride_page_aligned(self, page_size_bytes: int = 4096) -> bool:
        logger.warning(
            "%s does not implement is_stride_page_aligned(); assuming not aligned. "
            "O_DIRECT with a file-based NIXL backend will fall back to copy mode for this pool.",
            type(self).__name__,
        )
        return False

    # ----------------------------------------------------------------- slot allocator

    def _logical_size(self) -> int:
        value = getattr(self, "logical_size", None)
        return int(value) if value is not None else int(self.size) * int(self.dcp_size)

    def _logical_page_size(self) -> int:
        value = getattr(self, "logical_page_size", None)
        return int(value) if value is not None else int(self.page_size) * int(self.dcp_size)

    @synchronized
    def clear(self):
        """Forget every allocation: a fresh pool hands out slots 0, 1, 2, ... again."""
        n = self._logical_size()
        # Legacy and unused by SGLang's callers, but part of the pool's surface.
        self.mem_state = torch.zeros((n,), dtype=torch.uint8, device=getattr(self, "device", "cpu"))
        self._reset_free_list(n)
        self.slot_used = torch.zeros(n, dtype=torch.bool)

    available_size = synchronized(SlotFreeList.available_size)

    def _refuse_double_alloc(self, selected: torch.Tensor) -> None:
        already = self.slot_used[selected]
        if bool(already.any()):
            raise AssertionError(
                f"Double-alloc detected: slots already allocated: {selected[already].tolist()}."
            )

    @synchronized
    def alloc(self, need_size: int) -> torch.Tensor | None:
        """`need_size` slots (a page multiple) in FIFO order, or None when the pool is short.

        Returns a view of the free list, as SGLang does; clone it to keep it long-term.
        """
        need_size = as_int("need_size", need_size)
        if need_size < 0:
            raise ValueError(f"need_size must not be negative, got {need_size}")
        if need_size % self._logical_page_size() != 0:
            raise AssertionError("The requested size should be a multiple of the page size.")
        selected = self._take_slots(need_size, self._refuse_double_alloc)
        if selected is not None:
            self.slot_used[selected] = True
        return selected

    @synchronized
    def free(self, indices) -> int:
        """Return slots to the pool (any tensor, GPU included); returns how many were freed.

        A slot that is not currently allocated, or that appears twice in one call, is a double
        free: AssertionError, and nothing is released.
        """
        slots = slots_in_pool(indices, self.slot_used.numel(), "free")
        if slots.numel() == 0:
            return 0
        used = self.slot_used[slots]
        if not bool(used.all()):
            raise AssertionError(
                f"Double-free detected: slots not currently allocated: {slots[~used].tolist()}."
            )
        unique, counts = torch.unique(slots, return_counts=True)
        if bool((counts > 1).any()):
            raise AssertionError(
                f"Double-free detected: slots not currently allocated: "
                f"{unique[counts > 1].tolist()}."
            )
        self.slot_used[slots] = False
        self._release_slots(slots)
        return slots.numel()

    def maybe_dcp_kernel_indices(self, indices):
        """Per-rank physical slots of DCP-widened logical slots (identity when dcp_size == 1)."""
        dcp_size = int(self.dcp_size)
        if dcp_size == 1 or indices is None:
            return indices
        if indices.numel() % dcp_size != 0:
            raise AssertionError(
                f"HiCache DCP translation expects runs of whole widened pages; got "
                f"{indices.numel()} logical slots with dcp_size={dcp_size}."
            )
        return indices[int(self.dcp_rank) :: dcp_size] // dcp_size

    # ----------------------------------------------------------------- page addressing

    def _page_slot(self, index, page_major: bool) -> int:
        """First token slot of an L3 data page, checked so the page lies inside the pool.
        Page-major layouts floor any slot to its page, as SGLang does; token-major layouts need
        `index + page_size <= size`."""
        index = as_int("index", index)
        if page_major:
            if not 0 <= index < self.size:
                raise IndexError(f"page index {index} is outside the host pool [0, {self.size})")
        elif not 0 <= index <= self.size - self.page_size:
            raise IndexError(
                f"page starting at slot {index} does not fit in the host pool of {self.size} slots"
            )
        return index

    @staticmethod
    def _flat_page_as(data_page, shape) -> torch.Tensor:
        """A flat L3 page read as `shape` (this layout's element order), refused unless it holds
        exactly one page of values."""
        expected = 1
        for extent in shape:
            expected *= extent
        if not isinstance(data_page, torch.Tensor) or data_page.numel() != expected:
            got = data_page.numel() if isinstance(data_page, torch.Tensor) else type(data_page)
            raise ValueError(f"a flat data page of this pool has {expected} elements, got {got}")
        if data_page.device.type == "meta":
            raise ValueError("a flat data page on the meta device holds no values")
        return data_page.reshape(shape)

    def _meta_page_starts(self, indices, page_major: bool) -> list[int]:
        """First slot of each page of `indices` (every page_size-th entry), each checked to name a
        whole page inside the pool; page-major layouts also need page-aligned starts, because
        their pointer formulas assume one."""
        starts = as_index_array(indices, torch.device("cpu")).tolist()
        if len(starts) % self.page_size != 0:
            raise AssertionError(
                f"{len(starts)} indices is not a multiple of the page size {self.page_size}"
            )
        starts = starts[:: self.page_size]
        for t in starts:
            if not 0 <= t <= self.size - self.page_size:
                raise ValueError(
                    f"page starting at slot {t} does not fit in the host pool of {self.size} slots"
                )
            if page_major and t % self.page_size != 0:
                raise ValueError(
                    f"slot {t} is not the first slot of a page (page size {self.page_size})"
                )
        return starts

    # ----------------------------------------------------------------- transfer glue

    def _packed_device_layers(self, name: str) -> list:
        """SGLang's MTP packing: the target pool's layers of plane `name` followed by every draft
        pool's, in the host's layer order."""
        pools = (self.device_pool, *self.mtp_draft_device_pools)
        return [t for pool in pools for t in getattr(pool, name)]

    def _load_device_layers(self, device_pool, layer_id, is_draft) -> tuple[int, list]:
        """(host layer, one device layer tensor per plane) of one per-layer load. A draft call
        (`is_draft=True`, `layer_id = target_layer_num + k`) reads host layer `layer_id` into
        layer 0 of the draft device pool it is given, as SGLang's MTP packing does."""
        planes = [list(getattr(device_pool, name)) for name in self._device_plane_names]
        if not is_draft:
            layer = check_layer_id(layer_id, min(map(len, planes)), self.layer_num)
            return layer, [plane[layer] for plane in planes]
        host_layer = as_int("layer_id", layer_id)
        if not self.target_layer_num <= host_layer < self.layer_num:
            raise LayerIndexError(
                f"is_draft layer_id {host_layer} is not a packed MTP draft layer: this host pool "
                f"holds draft layers [{self.target_layer_num}, {self.layer_num})"
            )
        if not all(planes):
            raise _core.TransferError("the draft device pool has no layers")
        return host_layer, [plane[0] for plane in planes]

    def _backup_device_planes(self, device_pool) -> list[list]:
        """Per-plane device layer lists of an all-layer backup: the packed target + draft lists
        when MTP drafts are packed (SGLang then ignores `device_pool`), else the pool's own."""
        if self.mtp_draft_device_pools:
            what = "packed target + MTP draft device pools"
            planes = [getattr(self, f"packed_device_{n}s") for n in self._device_plane_names]
        else:
            what = "device pool"
            planes = [getattr(device_pool, n) for n in self._device_plane_names]
        return [
            check_layer_count(f"{what} {name}", layers, self.layer_num)
            for name, layers in zip(self._device_plane_names, planes, strict=True)
        ]

    def _core_indices(self, host_indices, device_indices, io_backend: str, dev: DeviceLayers):
        """Both index arrays as the core reads them, after SGLang's DCP translation (logical
        widened slots -> this rank's physical slots); only DCP-aware pools get dcp_size > 1."""
        host_idx, dev_idx = transfer_indices(host_indices, device_indices, io_backend, dev.device)
        if int(self.dcp_size) != 1:
            host_idx = self.maybe_dcp_kernel_indices(host_idx).contiguous()
            dev_idx = self.maybe_dcp_kernel_indices(dev_idx).contiguous()
        return host_idx, dev_idx

    def _load_planes(
        self, device_pool, host_indices, device_indices, layer_id, io_backend, is_draft
    ):
        """One per-layer load through the core, every argument checked before a byte moves."""
        self._check_io(io_backend)
        core = self._live_core()
        host_layer, layers = self._load_device_layers(device_pool, layer_id, bool(is_draft))
        dev = self._device_layers([[t] for t in layers], self._plane_item_bytes())
        host_idx, dev_idx = self._core_indices(host_indices, device_indices, io_backend, dev)
        run_load(core, io_backend, host_layer, dev, host_idx, dev_idx)

    def _backup_planes(self, device_pool, host_indices, device_indices, io_backend):
        """One all-layer backup through the core, every argument checked before a byte moves."""
        self._check_io(io_backend)
        core = self._live_core()
        planes = self._backup_device_planes(device_pool)
        dev = self._device_layers(planes, self._plane_item_bytes())
        host_idx, dev_idx = self._core_indices(host_indices, device_indices, io_backend, dev)
        run_backup(core, io_backend, dev, host_idx, dev_idx)

    def _no_write_back_staging(self, *buffer_names: str) -> None:
        # SGLang allocates GPU staging buffers only for its staged write-back JIT, which hostkv_rs
        # never enables (the core copies straight into host memory), so the controller must not
        # keep host indices on the CPU for it.
        self.can_use_write_back_jit = False
        self.staging_page_capacity = 0
        self.staging_token_capacity = 0
        for name in buffer_names:
            setattr(self, name, None)

    # ----------------------------------------------------------------- lifetime

    def destroy(self):
        """Unregister the pool's CUDA host registrations now rather than at process exit (the
        kernel unpinning huge ranges on SIGKILL can stall teardown). Idempotent.

        The Rust regions themselves stay alive while any view of them does, so a transfer racing
        with destroy never touches freed memory; later transfers raise instead.
        """
        if getattr(self, "_destroyed", False):
            return
        self._destroyed = True
        for region in getattr(self, "_host_regions", ()):
            region.unregister_cuda()
        self.kv_buffer = None

    def _require_bytes(self):
        if getattr(self, "kv_buffer", None) is None:
            raise RuntimeError(
                f"{type(self).__name__} holds no KV bytes (dummy mode or destroyed); it has no pages"
            )

    def _live_core(self):
        core = getattr(self, "_pool_core", None)
        if getattr(self, "_destroyed", False) or core is None:
            raise RuntimeError(f"{type(self).__name__} has been destroyed; it cannot transfer")
        return core

    def _device_layers(self, planes: Sequence[Sequence], item_bytes: Sequence[int]) -> DeviceLayers:
        """`device_layers` with this pool's cache of already checked device tensors."""
        cache = self.__dict__.get("_device_layer_cache")
        if cache is None:
            cache = self._device_layer_cache = DeviceLayerCache()
        return device_layers(planes, item_bytes, "device pool", cache)
