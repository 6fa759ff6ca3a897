"""`HostKVCache`: SGLang's abstract HiCache host pool (constructor forms, sizing and the memory
check, slot allocator, `destroy`) and the glue between its transfer methods and the device
binding that the Rust core holds (`_core.DeviceBinding`).

The allocator and helpers only read `size`, `page_size`, `lock`, `device` and the optional
`logical_size` / `logical_page_size` / `dcp_size`, so pools that skip `HostKVCache.__init__`
(the DeepSeek V4 pools) can use them after setting those attributes themselves.
"""

from __future__ import annotations

import abc
import logging
import os
import threading
import weakref
from functools import partial, wraps

import torch

from hostkv_rs import _core, _env
from hostkv_rs.pools import memory as _memory
from hostkv_rs.pools.args import (
    FlatPageError,
    NoHeadSplitError,
    NoKVBytesError,
    as_int,
    element_count,
    finite_number,
    finite_product,
    layer_tensors,
    positive_int,
    required,
    truth,
)
from hostkv_rs.pools.device_side import (
    device_pool_extent,
    layer_key,
    owned_range,
    sharded_host_layer_num,
)
from hostkv_rs.pools.slots import SlotFreeList, slot_table_bytes, slots_in_pool
from hostkv_rs.sglang import budgets as _budgets
from hostkv_rs.sglang import handover as _handover
from hostkv_rs.sglang import sources as _sources

logger = logging.getLogger(__name__)

# Storage backends whose own allocator owns the host memory in SGLang. With SGLang installed the
# release's `get_allocator_from_storage` makes it and the pool adopts its memory; without SGLang
# hostkv_rs allocates in Rust, which deserves a warning rather than silence.
_STORAGE_OWNED_ALLOCATORS = ("mooncake", "mori", "shm", "tensorcast")

# Creating a missing per-pool lock must itself be race-free (pools that skip __init__).
_LOCK_CREATION = threading.Lock()
# Every pool that has a lock. A lock some other thread holds when the process forks stays held
# in the child forever (that thread does not exist there), so the child gives each pool a fresh
# one; weak, so tracking keeps no pool alive.
_LOCKED_POOLS: weakref.WeakSet = weakref.WeakSet()


def new_pool_lock(pool) -> threading.RLock:
    """Give `pool` its one `RLock` (`pool.lock`), replaced by a free one in a forked child."""
    lock = threading.RLock()
    pool.lock = lock
    _LOCKED_POOLS.add(pool)
    return lock


def _pool_lock(pool) -> threading.RLock:
    lock = getattr(pool, "lock", None)
    if lock is None:
        with _LOCK_CREATION:
            lock = getattr(pool, "lock", None)
            if lock is None:
                lock = new_pool_lock(pool)
    return lock


def _fresh_locks_after_fork() -> None:
    global _LOCK_CREATION
    # The creation lock may have been held by another thread at the fork as well.
    _LOCK_CREATION = threading.Lock()
    for pool in list(_LOCKED_POOLS):
        pool.lock = threading.RLock()


os.register_at_fork(after_in_child=_fresh_locks_after_fork)


def synchronized(func):
    """Run the method while holding the pool's one `RLock` (`self.lock`)."""

    @wraps(func)
    def wrapper(self, *args, **kwargs):
        with _pool_lock(self):
            return func(self, *args, **kwargs)

    return wrapper


def _check_slot_device(device) -> None:
    """An allocator-only pool keeps only its legacy `mem_state` on `device`: a device torch cannot
    name or this machine does not have is refused by name before any table is built."""
    try:
        torch.empty(0, dtype=torch.uint8, device=device)
    except (TypeError, RuntimeError, AssertionError) as exc:
        raise ValueError(f"device={device!r} cannot hold the pool's slot state: {exc}") from None


def host_memory_budget_bytes(requested_bytes: int = 0, *, auto_size: bool = False) -> int:
    """Host RAM this rank may claim for a HiCache pool (`hostkv_rs.sglang.budgets`). Kept under
    SGLang's name in this module, so code that patches `base.host_memory_budget_bytes` (as
    SGLang's tests do) steers the check; it defers to the budgets module's function at call
    time, so patching that one works as well."""
    return _budgets.call_budget(
        _budgets.host_memory_budget_bytes, requested_bytes, auto_size=auto_size
    )


host_memory_budget_scope = _budgets.host_memory_budget_scope
_DEFAULT_BUDGET = host_memory_budget_bytes


def host_memory_budget_and_source(
    requested_bytes: int = 0, sglang_module: str = _budgets.SGLANG_POOL_BASE
) -> tuple[int, str | None]:
    """The host budget through this module's (possibly patched) `host_memory_budget_bytes`,
    or SGLang's in `sglang_module` where a caller patched that, and where it came from (None
    when a caller patched one)."""
    return _budgets.budget_and_source(
        host_memory_budget_bytes, _DEFAULT_BUDGET, requested_bytes, sglang_module
    )


def check_host_memory(requested_bytes: int) -> int:
    """Raise SGLang's ValueError when `requested_bytes` exceeds the host budget; returns the
    budget."""
    available_bytes, source = host_memory_budget_and_source(requested_bytes)
    _budgets.check_host_memory(requested_bytes, available_bytes, source)
    return available_bytes


def get_allocator_from_storage(allocator_type=None, pool_label: str = "kv"):
    """SGLang picks the host allocator from `--hicache-storage-backend`. For a storage-owned type
    (mooncake, mori, shm, tensorcast) the installed release's own `get_allocator_from_storage`
    decides, with its warnings and errors: the allocator it makes (e.g. `ShmHostTensorAllocator`,
    whose `fd` a second process maps) allocates the pool's planes, which the core adopts. Where
    SGLang falls back to its plain `HostTensorAllocator` (the backend's package is missing, a
    release without that type), and for every other type, the pool gets hostkv_rs's default
    allocator (Rust memory). Without SGLang a storage-owned type is warned about."""
    if allocator_type in _STORAGE_OWNED_ALLOCATORS:
        module = _memory.sglang_allocator_module()
        if module is not None:
            allocator = module.get_allocator_from_storage(allocator_type)
            if type(allocator) is not module.HostTensorAllocator:
                return allocator
        else:
            logger.warning(
                "hostkv_rs allocates HiCache host memory itself; the %r storage allocator is "
                "not used for the %s host pool (SGLang is not importable here).",
                allocator_type,
                pool_label,
            )
    return _memory.HostTensorAllocator()


def _forget_foreign(host_ref, device_pool_id: int, _dead) -> None:
    """Weak-reference callback: a device pool handed to transfers died, so the host pool drops
    its bindings over it (before its id can name another object)."""
    host = host_ref()
    if host is not None:
        host.__dict__.get("_foreign_bindings", {}).pop(device_pool_id, None)


def _check_dcp_run(slots: int | None, dcp_size: int) -> None:
    """SGLang 0.5.18-0.5.19's DCP translation assert (None: a count not known, not checked)."""
    if slots is not None and slots % dcp_size != 0:
        raise AssertionError(
            f"HiCache DCP translation expects runs of whole widened pages; got {slots} logical "
            f"slots with dcp_size={dcp_size}."
        )


def on_destroy(pool, callback) -> None:
    """Have `pool.destroy()` call `callback()` (once, on its first call), before the pool lets go
    of its memory. hostkv_rs.l3 uses it to unregister a pool's buffers from a store client."""
    pool.__dict__.setdefault("_on_destroy", []).append(callback)


def run_destroy_callbacks(pool) -> None:
    """Run and forget the `on_destroy` callbacks of `pool`; one that raises is logged."""
    for callback in pool.__dict__.pop("_on_destroy", ()):
        try:
            callback()
        except Exception:
            logger.exception("a destroy callback of %s failed", type(pool).__name__)


class HostKVCache(SlotFreeList, abc.ABC, metaclass=_handover.PoolMeta):
    """Abstract HiCache host pool with SGLang's constructor sequence and slot allocator.

    Two constructor forms, as SGLang's releases have them:

    * device-pool form (up to 0.5.21): `HostKVCache(device_pool, host_to_device_ratio, host_size,
      page_size, layout, pin_memory, device, allocator_type="default", dcp_size=1, dcp_rank=0,
      *, pool_label="kv")`; the geometry comes from `get_size_per_token()` (which sets
      `layer_num`, ... as a side effect) and the device pool's `store_dtype`, `size`,
      `start_layer` and `end_layer`.
    * geometry form (0.5.22+): keyword-only `dtype`, `device_capacity_tokens`, `size_per_token`,
      `start_layer`, `end_layer` plus the same sizing arguments, `is_dummy` (allocator only) and
      (0.5.23) `host_token_capacity` (an exact, page-aligned capacity without the padding page).
    """

    # Class defaults so that subclasses which skip __init__ still work (as in SGLang).
    dcp_size = 1
    dcp_rank = 0
    pool_label = "kv"
    can_use_write_back_jit = False
    mtp_draft_device_pools: tuple = ()
    device_pool = None
    # SGLang 0.5.21+/0.5.22+ storage hooks: a plain pool shares no allocation domain, stores no
    # page envelope and keeps SGLang's default page byte format (no tag in storage keys).
    shared_allocation_domain = None
    stores_page_envelope = False
    storage_format_tag: str | None = None
    # Bytes between strided device rows (SGLang 0.5.22+: per-layer views of a unified pool's
    # token-major entries, which the core's copies follow); None: packed rows.
    _strided_device_row_bytes: int | None = None

    def __new__(cls, *args, **kwargs):
        # Construction SGLang supports but hostkv_rs does not (a layout, scales, a device type)
        # goes to SGLang's own class once install() has recorded it; otherwise our __init__
        # refuses it with SGLang's error.
        original = _handover.handover(cls, args, kwargs)
        if original is not None:
            return original
        return super().__new__(cls)

    # The core's pool kind of a KV pool built from a device pool or buffer info ("mha", "mla",
    # ...); None for pools with constructors of their own.
    _spec_kind: str | None = None

    @classmethod
    def _unsupported_reason(cls, args, kwargs) -> str | None:
        """Why hostkv_rs cannot serve this construction (then SGLang's class does), or None."""
        if cls._spec_kind is None:
            return None
        source = _sources.arg(args, kwargs, 0, "device_pool")
        if source is None:
            source = kwargs.get("buffer_info")
        reason = cls._layout_reason(_sources.arg(args, kwargs, 4, "layout"))
        if reason is None and source is not None:
            reason = cls._source_reason(source)
        return reason or _sources.io_backend_reason()

    @classmethod
    def _layout_reason(cls, layout) -> str | None:
        """A layout SGLang's own class of this kind serves and hostkv_rs does not: the support
        table's hand-back column."""
        if isinstance(layout, str) and layout in _core.handed_back_layouts(cls._spec_kind):
            return f"layout {layout!r} is not implemented by hostkv_rs"
        return None

    @classmethod
    def _source_reason(cls, source) -> str | None:
        """Why the device pool or buffer info lives where hostkv_rs does not copy, or None."""
        return _sources.device_type_reason(source)

    def __init__(
        self,
        device_pool=None,
        host_to_device_ratio=None,
        host_size=None,
        page_size=None,
        layout=None,
        pin_memory=None,
        device=None,
        allocator_type: str = "default",
        dcp_size: int = 1,
        dcp_rank: int = 0,
        *,
        pool_label: str = "kv",
        dtype=None,
        device_capacity_tokens=None,
        size_per_token=None,
        start_layer=None,
        end_layer=None,
        is_dummy: bool = False,
        host_token_capacity=None,
    ):
        is_dummy = truth("is_dummy", is_dummy)
        if device_pool is None:
            required(
                "HostKVCache without a device pool",
                dtype=dtype,
                device_capacity_tokens=device_capacity_tokens,
                size_per_token=size_per_token,
                start_layer=start_layer,
                end_layer=end_layer,
                host_to_device_ratio=host_to_device_ratio,
                host_size=host_size,
                page_size=page_size,
                layout=layout,
            )
        # pin_memory and device are read as SGLang reads them (`if pin_memory:`, the allocator's
        # CPU assert) in _init_args, whichever form built the pool.
        self._init_args(
            page_size,
            layout,
            pin_memory,
            device,
            allocator_type,
            dcp_size,
            dcp_rank,
            pool_label,
            owns_bytes=not is_dummy,
        )
        if device_pool is not None:
            self.device_pool = device_pool
            self.dtype = device_pool.store_dtype
            self.size_per_token = self.get_size_per_token()
            self.device_capacity_tokens, start_layer, end_layer = device_pool_extent(device_pool)
        else:
            self.dtype = dtype
            self.size_per_token = as_int("size_per_token", size_per_token)
            self.device_capacity_tokens = as_int("device_capacity_tokens", device_capacity_tokens)
        if self.size_per_token <= 0:
            raise ValueError(
                f"{type(self).__name__}: bytes per token must be positive, got "
                f"{self.size_per_token} (check the device pool's layer and head geometry)"
            )
        self.size, self.page_num = self._host_capacity(
            host_to_device_ratio, host_size, host_token_capacity
        )
        if self.page_num <= 0 and not is_dummy:
            # Only a negative device capacity gets here (ratio x capacity below one page less
            # than none); SGLang's allocator then fails on the empty size (OSError).
            raise ValueError(
                f"host_to_device_ratio x device_capacity_tokens ({self.device_capacity_tokens}) "
                f"sizes the host pool at {self.page_num} pages; it needs at least one"
            )
        self.start_layer = start_layer
        self.end_layer = end_layer
        if not is_dummy:
            self._allocate_host_buffer()
        else:
            self._check_allocations_fit(0)
        new_pool_lock(self)
        self.clear()

    def _init_args(
        self,
        page_size,
        layout,
        pin_memory,
        device,
        allocator_type,
        dcp_size,
        dcp_rank,
        pool_label,
        *,
        owns_bytes: bool,
    ) -> None:
        """SGLang's constructor steps 1-2: DCP page widening, layout, pinning, the allocator.
        An allocator-only (dummy) pool never reaches the CPU allocator and words the DCP check as
        SGLang's dummy init does."""
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
        self.dcp_size = dcp_size
        self.dcp_rank = dcp_rank
        self.page_size = page_size // dcp_size
        self.layout = layout
        truth("pin_memory", pin_memory)
        self.pin_memory = pin_memory
        if owns_bytes and device != "cpu":
            raise AssertionError(
                f"HostTensorAllocator only supports CPU allocations; got device={device!r}"
            )
        if not owns_bytes:
            _check_slot_device(device)
        self.device = device
        self.allocator_type = allocator_type
        self.allocator = get_allocator_from_storage(allocator_type, pool_label)
        self.can_use_write_back_jit = False

    def _allocate_host_buffer(self) -> None:
        """SGLang's `_allocate_host_buffer`: the small-pool warning, the memory check and the
        allocation log, then `init_kv_buffer()`."""
        if self.size <= self.device_capacity_tokens:
            logger.warning(
                "HiCache %s host pool (%d tokens) is smaller than the device pool (%d tokens);"
                "L2 cache effectiveness is reduced."
                "Consider increasing --hicache-ratio (or --hicache-size) for higher L2 cache hit "
                "rate.",
                self.pool_label,
                self.size,
                self.device_capacity_tokens,
            )
        requested_bytes = self.size * self.size_per_token
        with _budgets.unbooked_on_failure():
            check_host_memory(requested_bytes)
            self._check_allocations_fit(requested_bytes)
        # SGLang reads layer_num - target_layer_num here; getattr keeps subclasses that define
        # neither (e.g. allocator-only test pools) working.
        layer_num = getattr(self, "layer_num", 0)
        target_layer_num = getattr(self, "target_layer_num", layer_num)
        draft_layer_num = layer_num - target_layer_num
        if draft_layer_num > 0:
            logger.info(
                "Allocating %s hierarchical KV host pool: %d tokens, %.2f GB host memory, "
                "packed MTP KV layers: target_layers=%d, draft_layers=%d, total_layers=%d.",
                self.pool_label,
                self.size,
                requested_bytes / 1e9,
                target_layer_num,
                draft_layer_num,
                layer_num,
            )
        else:
            logger.info(
                "Allocating %s hierarchical KV host pool: %d tokens, %.2f GB host memory.",
                self.pool_label,
                self.size,
                requested_bytes / 1e9,
            )
        self.kv_buffer = self.init_kv_buffer()
        self.fd = getattr(self.allocator, "fd", None)

    def _check_allocations_fit(self, kv_bytes: int) -> None:
        """Everything the pool allocates on the host (KV bytes, the slot tables of its logical
        slots and the legacy one-byte `mem_state`) must fit the memory available now, or the
        pool is refused before the first allocation."""
        slots = self.logical_size
        _memory.check_allocations_fit(
            f"{type(self).__name__} ({self.pool_label})",
            {"KV buffer": kv_bytes, "slot tables": slot_table_bytes(slots) + slots},
        )

    # Set True on a subclass whose transfers pass both index tensors through the DCP
    # translation (as SGLang's MLA pool does).
    dcp_aware_transfers = False

    @classmethod
    def _dcp_ready(cls) -> bool:
        """DCP only changes the slot space; the allocator handles that. A pool accepts it if its
        transfers translate logical slots (every concrete pool has transfers: they are
        abstract)."""
        return bool(cls.dcp_aware_transfers)

    def _host_capacity(self, host_to_device_ratio, host_size, host_token_capacity):
        """(size, page_num): an exact `host_token_capacity` (0.5.23; page-aligned, no padding
        page), else decimal GB / bytes per token (floor) or ratio x device capacity, then one
        extra page, always (SGLang's `size // page_size + 1`)."""
        if host_token_capacity is not None:
            capacity = as_int("host_token_capacity", host_token_capacity)
            if capacity <= 0 or capacity % self.page_size:
                raise ValueError(
                    "Host token capacity must be positive and page-aligned, got "
                    f"{capacity} for page_size={self.page_size}"
                )
            return capacity, capacity // self.page_size
        host_size = finite_number(
            "host_size", host_size, "a finite number of GB (0: use the ratio)"
        )
        if host_size > 0:
            host_bytes = finite_product("host_size", host_size, 1e9, "the size in bytes")
            size = int(host_bytes // self.size_per_token)
            size = _budgets.sync_fixed_hicache_size(size, host_size)
        else:
            ratio = finite_number(
                "host_to_device_ratio", host_to_device_ratio, "a finite non-negative number"
            )
            if ratio < 0:
                raise ValueError(
                    f"host_to_device_ratio must be a finite non-negative number, got {ratio!r}"
                )
            size = int(
                finite_product(
                    "host_to_device_ratio",
                    ratio,
                    self.device_capacity_tokens,
                    "the host token count",
                )
            )
        page_num = size // self.page_size + 1
        return page_num * self.page_size, page_num

    # ----------------------------------------------------------------- geometry (abstract)

    @abc.abstractmethod
    def get_size_per_token(self):
        """Bytes per token over all layers (the device-pool form also sets the geometry
        attributes here, as a side effect)."""
        raise NotImplementedError()

    @abc.abstractmethod
    def init_kv_buffer(self):
        """Allocate and return `kv_buffer` (sets `token_stride_size` / `layout_dim`)."""
        raise NotImplementedError()

    # Abstract in SGLang too (its seven): a subclass missing one is refused when built.

    @abc.abstractmethod
    def load_to_device_per_layer(
        self, device_pool, host_indices, device_indices, layer_id, io_backend, *, is_draft=False
    ) -> None:
        raise NotImplementedError()

    @abc.abstractmethod
    def backup_from_device_all_layer(
        self, device_pool, host_indices, device_indices, io_backend
    ) -> None:
        raise NotImplementedError()

    @abc.abstractmethod
    def get_data_page(self, index, flat: bool = True) -> torch.Tensor:
        raise NotImplementedError()

    @abc.abstractmethod
    def get_dummy_flat_data_page(self) -> torch.Tensor:
        raise NotImplementedError()

    @abc.abstractmethod
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

    # ----------------------------------------------------------------- transfer-engine hooks

    def get_page_buffer_element_size(self, split_factor: int = 1) -> int | None:
        """Byte size of one storage element (SGLang 0.5.21+), or None for a logical anchor."""
        split_factor = as_int("split_factor", split_factor)
        if split_factor != 1 and not hasattr(self, "get_split_heads_page_buffer_meta"):
            raise NoHeadSplitError(
                f"{type(self).__name__} has no head split: split_factor must be 1, got "
                f"{split_factor}"
            )
        count = self.page_size
        if self.dcp_size != 1 and _sources.refuses_dcp_l3_pages():
            # SGLang 0.5.21-0.5.22 read `page_size` indices as one page of this rank's rows and
            # return its size; ours take logical slots in every release (0.5.23's page API), so
            # the same page is a widened one. 0.5.23 passes `page_size` and asserts, as ours.
            count = self.logical_page_size
        indices = torch.zeros(count, dtype=torch.int64)
        meta = (
            self.get_split_heads_page_buffer_meta(indices, split_factor)
            if split_factor != 1
            else self.get_page_buffer_meta(indices)
        )
        sizes = meta[1] if meta else None
        return int(sizes[0]) if sizes else None

    def prepare_transfer_indices(self, host_indices, device_indices, io_backend):
        """SGLang 0.5.21+ L2TransferEngine hook: a plain pool's indices are already physical."""
        return host_indices, device_indices

    def backup_from_device_all_layer_physical(
        self, device_pool, host_indices, device_indices, io_backend
    ) -> None:
        self.backup_from_device_all_layer(device_pool, host_indices, device_indices, io_backend)

    def load_to_device_per_layer_physical(
        self, device_pool, host_indices, device_indices, layer_id, io_backend, *, is_draft=False
    ) -> None:
        self.load_to_device_per_layer(
            device_pool, host_indices, device_indices, layer_id, io_backend, is_draft=is_draft
        )

    def _init_device_row_stride(self, device_buffers) -> None:
        """SGLang 0.5.22+: record the row stride of strided device layers (all must share one,
        else SGLang's NotImplementedError)."""
        pitch = _core.device_row_pitch(list(device_buffers))
        if pitch is not None:
            self._strided_device_row_bytes = pitch

    @property
    def device_rows_packed(self) -> bool:
        return self._strided_device_row_bytes is None

    @property
    def device_row_stride_bytes(self) -> int:
        """Bytes between consecutive device rows (the row width: the core moves packed rows)."""
        return self._strided_device_row_bytes or self.token_stride_size

    # SGLang's layer-sharding helpers (device pool defaults to the one the pool was built from).

    def _is_device_layer_sharded(self, device_pool=None) -> bool:
        device_pool = self.device_pool if device_pool is None else device_pool
        return bool(getattr(device_pool, "layer_shard_enabled", False))

    def _device_owned_layer_range(self, device_pool=None) -> tuple[int, int]:
        return owned_range(self.device_pool if device_pool is None else device_pool)

    def _effective_host_layer_num(self, device_pool=None) -> int:
        return sharded_host_layer_num(self.device_pool if device_pool is None else device_pool)

    def _is_device_layer_owned(self, device_pool, layer_id: int) -> bool:
        start, end = self._device_owned_layer_range(device_pool)
        return start <= layer_id < end

    def _host_layer_index(self, layer_id: int, device_pool=None) -> int:
        start, _ = self._device_owned_layer_range(device_pool)
        return layer_id - start

    def _owned_device_layer_ids(self, device_pool) -> list[int]:
        start, end = self._device_owned_layer_range(device_pool)
        return list(range(start, end))

    # ----------------------------------------------------------------- slot allocator

    @property
    def logical_size(self) -> int:
        """Slots the radix/controller layer sees: dcp_size of them share a row."""
        return self.size * self.dcp_size

    @property
    def logical_page_size(self) -> int:
        """Page size in that same logical space (the widened DCP page)."""
        return self.page_size * self.dcp_size

    @synchronized
    def clear(self):
        """Forget every allocation: a fresh pool hands out slots 0, 1, 2, ... again."""
        n = self.logical_size
        # Legacy and unused by SGLang's callers, but part of the pool's surface.
        self.mem_state = torch.zeros((n,), dtype=torch.uint8, device=getattr(self, "device", "cpu"))
        self._reset_free_list(n)

    available_size = synchronized(SlotFreeList.available_size)

    @synchronized
    def alloc(self, need_size: int) -> torch.Tensor | None:
        """`need_size` slots (a page multiple) in FIFO order, or None when the pool is short.

        Returns a view of the free list, as SGLang does; clone it to keep it long-term.
        """
        need_size = as_int("need_size", need_size)
        if need_size < 0:
            raise ValueError(f"need_size must not be negative, got {need_size}")
        if need_size % self.logical_page_size != 0:
            raise AssertionError("The requested size should be a multiple of the page size.")
        slots = self._take_slots(need_size)
        core = self.__dict__.get("_pool_core")
        if slots is not None and core is not None and core.watches_pages:
            # HOSTKV_PAGE_DIGEST: the new owner may fill these pages by means the core does not
            # see (a storage backend writing `get_data_page` views, PD's direct-to-host writes
            # at `get_contiguous_buf_infos` addresses), so digests of their earlier contents go.
            core.forget_pages(slots.tolist())
        return slots

    @synchronized
    def _untake(self, slots: torch.Tensor, generation: int) -> None:
        """Put back the slots an `alloc` returned at free-list `generation`, for a call that
        failed after it (`SlotFreeList._untake_slots`)."""
        self._untake_slots(slots, generation)

    @synchronized
    def free(self, indices) -> int:
        """Return slots to the pool (any tensor, GPU included); returns how many were freed.

        A slot that is not currently allocated, or that appears twice in one call, is a double
        free: AssertionError, and nothing is released.
        """
        slots = slots_in_pool(indices, self.slot_used.numel(), "free")
        self._release_slots(slots)
        return slots.numel()

    def maybe_dcp_kernel_indices(self, indices):
        """Per-rank physical slots of DCP-widened logical slots (identity when dcp_size == 1):
        the method SGLang 0.5.18-0.5.19 pools have. Transfers do not call it: the core applies
        the same translation while it reads the indices (`_index_map`)."""
        dcp_size = int(self.dcp_size)
        if dcp_size == 1 or indices is None:
            return indices
        _check_dcp_run(indices.numel(), dcp_size)
        return indices[int(self.dcp_rank) :: dcp_size] // dcp_size

    # ----------------------------------------------------------------- page addressing

    def _page_view(self, index) -> torch.Tensor:
        """The L3 page `index` names, as the core addresses it (SGLang's `get_data_page` slice):
        a strided view of the pool's first allocation; a page outside the pool raises
        PageIndexError before anything is read."""
        return self._view_at(self._page_geometry(index))

    def _page_geometry(self, index) -> tuple:
        """(offset, shape, strides) of page `index` in the pool's first allocation; a page
        outside the pool raises PageIndexError."""
        return self._spec.page_view(index)  # the layout's refusal, then the index's

    def _view_at(self, geometry) -> torch.Tensor:
        offset, shape, strides = geometry
        base = self._page_base()
        return torch.as_strided(base, shape, strides, base.storage_offset() + offset)

    def _write_page(self, geometry, source: torch.Tensor) -> None:
        """Copy `source` (already read and shaped) into the page at `geometry`. The view is made
        only now, after the caller's page was read: Python run while it was read (a subclass's or
        a torch-function mode's hook) could have freed or moved the pool's memory, which a view
        made earlier would still point at (`as_strided` refuses a storage now too small). The
        view and the copy run with torch-function overrides off. A source that is a view of the
        pool itself (a page read with `get_data_page` at a token index that is not a page start)
        may overlap the page it is written to, which `copy_` refuses: it is copied out first."""
        with torch._C.DisableTorchFunction():
            view = self._view_at(geometry)
            if source.untyped_storage().data_ptr() == view.untyped_storage().data_ptr():
                source = source.clone()
            view.copy_(source)

    def _page_base(self) -> torch.Tensor:
        # Read once: destroy() on another thread may clear it after `_require_bytes` looked.
        buffer = getattr(self, "kv_buffer", None)
        if buffer is None:
            raise self._no_bytes()
        return buffer

    @staticmethod
    def _flat_page_as(data_page, shape) -> torch.Tensor:
        """A flat L3 page read as `shape` (this layout's element order), refused unless it holds
        exactly one page of values."""
        expected = 1
        for extent in shape:
            expected *= extent
        if not isinstance(data_page, torch.Tensor) or data_page.numel() != expected:
            got = data_page.numel() if isinstance(data_page, torch.Tensor) else type(data_page)
            raise FlatPageError(f"a flat data page of this pool has {expected} elements, got {got}")
        if data_page.device.type == "meta":
            raise ValueError("a flat data page on the meta device holds no values")
        _core.check_page_values(data_page, "flat data page")
        return data_page.reshape(shape)

    # ----------------------------------------------------------------- transfer glue

    # Device pool attributes holding the per-layer tensors of each plane, in plane order (set by
    # the pools that move bytes, e.g. ("k_buffer", "v_buffer")).
    _device_plane_names: tuple = ()
    # The captured device side: a `_core.DeviceBinding` (set by pools that move bytes).
    _device_side = None
    # Device pools the side was captured from (device-pool form): a transfer handed one of them,
    # or None, uses the captured side; another device pool is read as SGLang <= 0.5.21 does.
    _captured_pools: tuple = ()
    _captured_first = None

    def _names_other_pool(self, device_pool) -> bool:
        """Whether a transfer handed `device_pool` reads that pool's layers rather than the
        captured ones (checked only past the cheap identity tests: this is every call's path)."""
        return (
            device_pool is not None
            and device_pool is not self._captured_first
            and self._foreign(device_pool)
        )

    def _foreign(self, device_pool) -> bool:
        """A device pool other than the ones this pool was built from, read as SGLang <= 0.5.21
        reads it (device-pool form only; SGLang 0.5.22+ and the buffer-info form ignore the
        argument, and so do ours under an installed 0.5.22+)."""
        if device_pool is None or not self._captured_pools:
            return False
        if any(device_pool is pool for pool in self._captured_pools):
            return False
        if _sources.ignores_transfer_device_pool():
            return False
        return all(hasattr(device_pool, name) for name in self._device_plane_names)

    # Controller layer ids -> host layers of a pool built from a device pool's geometry alone
    # (SGLang <= 0.5.21 captures nothing then): no binding exists until a transfer names a
    # device pool, so the core's `LayerMap` of the layers that pool owns answers meanwhile.
    _layer_map: _core.LayerMap | None = None

    def _layer_index_or_none(self):
        """The device binding's layer lookups, or the geometry-only pool's `LayerMap`; None for
        a pool built without its constructor."""
        return self._device_side if self._device_side is not None else self._layer_map

    @property
    def _layer_index(self):
        index = self._layer_index_or_none()
        if index is None:
            raise RuntimeError(
                f"{type(self).__name__} was built without its constructor: it has no device "
                "layers to transfer"
            )
        return index

    def _lookup_layer(self, layer_id, is_draft: bool):
        """The host layer of controller layer `layer_id`, None for a target layer not held."""
        return self._layer_index.lookup(layer_id, is_draft)

    def _host_layer_total(self) -> int:
        index = self._layer_index_or_none()
        return self.layer_num if index is None else index.host_layer_num

    def _device_rows_like(self) -> list:
        """Per plane, the `(dtype, (heads, head_dim))` device rows must have (see
        `check_device_layers`)."""
        return []

    # Device pool attributes a foreign pool must agree on: (ours, theirs) attribute names.
    _device_pool_geometry: tuple = ()

    def _check_device_pool(self, device_pool) -> None:
        """A device pool handed to a transfer must describe the same data as this pool, not only
        rows of the same byte size; each attribute it exposes is compared and named."""
        for ours, theirs in self._device_pool_geometry:
            value = getattr(device_pool, theirs, None)
            if value is not None and value != getattr(self, ours):
                raise ValueError(
                    f"device pool {theirs}={value} differs from the host pool's "
                    f"{ours}={getattr(self, ours)}"
                )

    def _bind_device_side(self, side: dict) -> None:
        """Hand the captured device layers to the core (`_core.DeviceBinding`): checked there
        on first use, then each transfer passes only the layer id and the indices."""
        self._device_side = _core.DeviceBinding(
            self._pool_core,
            side["planes"],
            list(side["owned"]),
            side["device_layer_num"],
            self.target_layer_num,
            like=self._device_rows_like(),
            name=type(self).__name__,
            index_map=self._index_map(),
            packed=self._packed_tables(),
        )
        self._captured_first = self._captured_pools[0] if self._captured_pools else None

    def _packed_tables(self):
        """(plane name, layers) of SGLang's packed target + MTP draft device tables: SGLang
        (device-pool form) packs every layer of every draft pool after the target's and backs
        each up into its own host layer, so a draft pool of more than one layer cannot be
        backed up."""
        count = getattr(self, "_packed_layer_count", None)
        if not self.mtp_draft_device_pools or count is None:
            return None
        return (self._device_plane_names[0], count)

    # Bindings kept per device pool handed to calls, over its current tensors: one per layer
    # loaded and one per backup fit for any model; past this many they start over.
    _FOREIGN_BINDINGS_PER_POOL = 512

    def _foreign_binding(self, device_pool, positions, slots, host_layers):
        """A binding over the device layers at `positions` of a device pool handed to one call
        (SGLang <= 0.5.21 reads the pool it is given). Reused while the same tensors come back,
        kept per device pool by identity (its own `__eq__`/`__hash__` play no part) and dropped
        when that pool dies or its layer tensors are replaced, so it never keeps device memory
        alive that the device pool let go; a device pool that cannot be weakly referenced gets a
        new binding each call."""
        planes = [
            layer_tensors(f"device pool {name}", getattr(device_pool, name))
            for name in self._device_plane_names
        ]
        pools = self.__dict__.setdefault("_foreign_bindings", {})
        entry = pools.get(id(device_pool))
        if entry is None or entry[0]() is not device_pool:
            try:
                # A weak reference kept here (no global finalizer registry): it goes with this
                # pool, and its callback, holding this pool weakly, with the device pool.
                watch = weakref.ref(
                    device_pool, partial(_forget_foreign, weakref.ref(self), id(device_pool))
                )
            except TypeError:
                entry = [None, {}, None]  # not weakly referenceable: not cached
            else:
                # [the watch, bindings by (tensors, positions, host layers), those tensors]
                entry = pools[id(device_pool)] = [watch, {}, None]
        tensors = tuple(map(id, (t for plane in planes for t in plane)))
        key = (tensors, tuple(positions), tuple(host_layers))
        binding = entry[1].get(key)
        if binding is not None:
            return binding
        if entry[2] != tensors:
            # The device pool holds other tensors now (its layers were replaced): the bindings
            # over the old ones would keep that device memory alive for nothing. A new dict, not
            # a cleared one: another thread may be reading the old one (the key still names the
            # tensors, so no thread takes a binding over tensors it was not handed).
            entry[1], entry[2] = {}, tensors
        cache = entry[1]
        binding = _core.DeviceBinding(
            self._live_core(),
            planes,
            slots,
            0,
            self._host_layer_total(),
            host_layers=host_layers,
            like=self._device_rows_like(),
            name=type(self).__name__,
            index_map=self._index_map(),
            positions=positions,
        )
        if len(cache) >= self._FOREIGN_BINDINGS_PER_POOL:
            cache.clear()
        cache[key] = binding
        return binding

    def _hand_built_pair_first(self, io_backend) -> None:
        """A pool built by hand: SGLang's (layout, backend) refusal comes first, before its
        buffers are read (the geometry `_check_io` reads also checks them)."""
        if self._layer_index_or_none() is None:
            self._make_spec().check_pair(io_backend)

    def _foreign_load(self, device_pool, layer_id, io_backend, is_draft, indices):
        """The binding of a per-layer load from a device pool handed to the call, or None when
        this pool does not hold that target layer (SGLang returns without copying)."""
        self._hand_built_pair_first(io_backend)
        host_layer = self._lookup_layer(layer_id, is_draft)
        if host_layer is None:
            return None
        self._dcp_runs_first(*indices)
        # SGLang refuses an unserved (layout, backend) pair before it reads the device pool.
        self._check_io(io_backend)
        self._check_device_pool(device_pool)
        # SGLang <= 0.5.21: the given pool's layer (layer 0 of a draft pool).
        device_layer = 0 if is_draft else layer_key(layer_id)
        return self._foreign_binding(
            device_pool, [device_layer], [layer_key(layer_id)], [host_layer]
        )

    def _foreign_backup(self, device_pool):
        """The binding of an all-layer backup from a device pool handed to the call."""
        self._check_device_pool(device_pool)
        targets = self._layer_index.targets
        slots = [slot for slot, _ in targets]
        return self._foreign_binding(device_pool, slots, slots, [h for _, h in targets])

    def _dcp_runs_first(self, host_indices, device_indices) -> None:
        """SGLang 0.5.18-0.5.19 translate a DCP pool's slots, asserting whole widened pages,
        before they look at the io backend or the device pool. Only the count is checked here
        (the core translates while it copies), and only where Python refuses something first: a
        transfer naming another device pool, a layer-sharded backup (the captured device side's
        core counts before its own refusal)."""
        if self.dcp_size != 1 and _sources.dcp_whole_pages_only():
            for indices in (host_indices, device_indices):
                _check_dcp_run(element_count(indices), int(self.dcp_size))

    def _index_map(self):
        """How the core reads both index arrays of every transfer: with dcp_size > 1 (only
        DCP-aware pools), SGLang's translation of logical widened slots to this rank's physical
        slots, `idx[dcp_rank::dcp_size] // dcp_size`, applied while the core reads them (over
        whole widened pages only, where the release asserts that)."""
        if self.dcp_size == 1:
            return None
        name = "dcp" if _sources.dcp_whole_pages_only() else "dcp_share"
        return (name, int(self.dcp_size), int(self.dcp_rank))

    def _load_planes(
        self, device_pool, host_indices, device_indices, layer_id, io_backend, is_draft
    ):
        """One per-layer load through the core, every argument checked before a byte moves. A
        target layer this pool does not hold returns first, whatever else is passed (SGLang)."""
        binding = self._device_side
        if (
            binding is not None
            and is_draft is False
            and (device_pool is self._captured_first or not self._captured_pools)
        ):
            # Every SGLang call's path (the pool this one was built from, or 0.5.23's buffer-info
            # form, which reads no pool it is handed): no further checks in Python.
            binding.load(layer_id, host_indices, device_indices, io_backend, False)
            return
        if binding is None or self._names_other_pool(device_pool):
            is_draft = truth("is_draft", is_draft)
            if binding is None:
                # Built from geometry alone: the layers are those of the pool this call names.
                device_pool = self.device_pool if device_pool is None else device_pool
            binding = self._foreign_load(
                device_pool, layer_id, io_backend, is_draft, (host_indices, device_indices)
            )
            if binding is None:
                return
            is_draft = False  # the one-layer binding holds the layer as a target
        binding.load(
            layer_id, host_indices, device_indices, io_backend, truth("is_draft", is_draft)
        )

    def _backup_planes(self, device_pool, host_indices, device_indices, io_backend):
        """One all-layer backup through the core, every argument checked before a byte moves."""
        binding = self._device_side
        if binding is not None and (device_pool is self._captured_first or device_pool is None):
            # Every SGLang call's path: no further checks in Python.
            binding.backup(host_indices, device_indices, io_backend)
            return
        # With packed MTP drafts SGLang reads its packed tables and ignores the given pool.
        if not self.mtp_draft_device_pools and (
            binding is None or self._names_other_pool(device_pool)
        ):
            if binding is None:
                device_pool = self.device_pool if device_pool is None else device_pool
            self._dcp_runs_first(host_indices, device_indices)
            self._hand_built_pair_first(io_backend)
            self._check_io(io_backend)
            self._live_core()
            binding = self._foreign_backup(device_pool)
        binding.backup(host_indices, device_indices, io_backend)

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
        run_destroy_callbacks(self)  # e.g. hostkv_rs.l3 detaching the pool from a store
        if self._device_side is not None:
            self._device_side.release()
        self.__dict__.pop("_foreign_bindings", None)
        for region in getattr(self, "_host_regions", ()):
            region.unregister_cuda()
        self.kv_buffer = None

    def _allocate(self, spec):
        """The pool's host memory as `spec` lists it (one tensor per allocation), each chunk of
        its CUDA registration whole copy units; the kv_buffer SGLang has (a tuple when there
        are two allocations)."""
        buffers, owners = [], []
        # The GPU the memory is pinned for: the transfers' device when it is a GPU (its index
        # is the one SGLang's bare "cuda" string lacks), else the device pool's device string.
        layers = getattr(self, "_transfer_device", None)
        named = getattr(getattr(self, "device_pool", None), "device", None)
        device = layers if getattr(layers, "type", None) == "cuda" else named
        for index, shape in enumerate(spec.allocation_shapes):
            buffer, owner = _memory.alloc_pool_memory(
                self.allocator,
                self.dtype,
                shape,
                self.pin_memory,
                spec.registration_unit(index),
                device,
            )
            buffers.append(buffer)
            owners.append(owner)
        self._host_regions = owners
        return buffers[0] if len(buffers) == 1 else tuple(buffers)

    def _new_host_pool(self):
        """The core's pool over this pool's allocations (`_core.HostPool`); with
        HOSTKV_PAGE_DIGEST set, its backups digest the pages they write and its loads verify
        them (in the core). page_unified has no page metadata (as in SGLang) and is not
        checked."""
        buffer = self.kv_buffer
        allocations = list(buffer) if isinstance(buffer, tuple) else [buffer]
        # The tensors themselves, not their regions: the core then checks on every call that
        # their storages still hold the memory (`resize_` or `share_memory_`, also done by
        # torch.multiprocessing when a tensor is sent to another process, would leave
        # `kv_buffer` and the core's bytes apart, or the bytes freed).
        watch = _env.page_digest()
        if watch and self._spec.page_unified_layout is not None:
            logger.warning("HOSTKV_PAGE_DIGEST: %s page_unified pages are not checked", self)
            watch = False
        return _core.HostPool(self._spec, allocations, watch_pages=watch)

    def _live_buffer(self):
        """`kv_buffer`, or a clear error once `destroy()` has released it."""
        buffer = getattr(self, "kv_buffer", None)
        if buffer is None:
            state = "has been destroyed" if getattr(self, "_destroyed", False) else "holds no bytes"
            raise RuntimeError(f"{type(self).__name__} {state}: its KV buffers are gone")
        return buffer

    def _require_bytes(self):
        if getattr(self, "kv_buffer", None) is None:
            raise self._no_bytes()

    def _no_bytes(self) -> NoKVBytesError:
        return NoKVBytesError(
            f"{type(self).__name__} holds no KV bytes (dummy mode or destroyed); it has no pages"
        )

    def _live_core(self):
        if getattr(self, "_destroyed", False):
            raise RuntimeError(f"{type(self).__name__} has been destroyed; it cannot transfer")
        core = getattr(self, "_pool_core", None)
        if core is None:
            raise NoKVBytesError(f"{type(self).__name__} holds no KV bytes; it cannot transfer")
        return core
