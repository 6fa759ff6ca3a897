"""DeepSeek V4 paged host pool: the page-row mirror of one V4 compressed sub-pool.

`DeepSeekV4PagedHostPool` mirrors one V4 compressed paged sub-pool (C4, C128, indexer ...). Its
unit is a *page row*: one device row holds one slot page (`slot_page_size` tokens) of one layer,
`item_bytes` bytes. Rust owns the bytes (one `HostRegion`) and moves them (`HostPool`); this
module only builds torch views, checks arguments and maps token indices to rows.
"""

from __future__ import annotations

import logging

import torch

from hostkv_rs import _core
from hostkv_rs.pools import base as pool_host_base
from hostkv_rs.pools import memory as _memory
from hostkv_rs.pools.args import FlatPageError, as_int, layer_tensors, positive_int, truth
from hostkv_rs.pools.base import (
    HostKVCache,
    get_allocator_from_storage,
    new_pool_lock,
    synchronized,
)
from hostkv_rs.pools.device_side import ptr_table
from hostkv_rs.pools.hisparse import HiSparseHostPoolMixin
from hostkv_rs.pools.slots import index_list, slot_table_bytes, slots_in_pool
from hostkv_rs.pools.tensor_mode import outside_inference_mode
from hostkv_rs.sglang.budgets import SGLANG_V4_POOLS, budget_source_text
from hostkv_rs.sglang.sources import hicache_device_kernels, sglang_release

logger = logging.getLogger(__name__)

# A page outside the pool: our ValueError, and the IndexError SGLang's `kv_buffer[row]` raises.
PageIndexError = _core.PageIndexError


class DeepSeekV4PagedHostPool(HiSparseHostPoolMixin, HostKVCache):
    """Host mirror of a DeepSeek V4 paged KV/indexer sub-pool, in page-row units."""

    # HostKVCache.__init__ is not called (as in SGLang), so the DCP defaults live here too.
    dcp_size = 1
    dcp_rank = 0
    # What the slot allocator and the transfers' first checks read, for a pool made with
    # `__new__` and a few attributes set by hand (SGLang's own unit tests build V4 pools that
    # way: `size`, `slot_page_size` and `lock` for the allocator; `pool_name`,
    # `slot_page_size` and `page_aligned_only` for the page-alignment refusal).
    pool_name = "DeepSeekV4PagedHostPool"

    @property
    def _name(self) -> str:
        """`pool_name` as the core's texts show it (SGLang only formats it: any value goes)."""
        return str(self.pool_name)

    page_aligned_only = False
    _destroyed = False
    _device_refusal: str | None = None

    @classmethod
    def _unsupported_reason(cls, args, kwargs) -> str | None:
        buffers = args[1] if len(args) > 1 else kwargs.get("device_buffers")
        try:
            # Not `buffers or ()`: a tensor of several elements has no truth value.
            first = next(iter(() if buffers is None else buffers), None)
        except TypeError:
            return None
        kind = getattr(getattr(first, "device", None), "type", None)
        if kind is not None and kind not in ("cpu", "cuda", "meta"):
            return f"device buffers on {kind!r}"
        return None

    def __init__(
        self,
        pool_name: str,
        device_buffers: list[torch.Tensor],
        item_bytes: int,
        num_host_pages: int,
        slot_page_size: int,
        layout: str = "layer_first",
        device: str = "cpu",
        pin_memory: bool = True,
        allocator_type: str = "default",
        page_aligned_only: bool = False,
    ):
        self.pool_name = pool_name
        given = device_buffers
        device_buffers = layer_tensors(f"{pool_name}: device_buffers", device_buffers)
        for i, buf in enumerate(device_buffers):
            if not isinstance(buf, torch.Tensor):
                raise TypeError(
                    f"{pool_name}: device_buffers[{i}] must be a torch.Tensor, got "
                    f"{type(buf).__name__}"
                )
        # SGLang 0.5.20+: pools whose rows are not the C4 page refuse token-granular transfers.
        self.page_aligned_only = truth("page_aligned_only", page_aligned_only)
        item_bytes = as_int("item_bytes", item_bytes)
        num_host_pages = as_int("num_host_pages", num_host_pages)
        slot_page_size = as_int("slot_page_size", slot_page_size)
        if item_bytes <= 0:
            raise ValueError(f"{pool_name}: item_bytes must be positive, got {item_bytes}")
        if num_host_pages < 0:
            raise ValueError(
                f"{pool_name}: num_host_pages must not be negative, got {num_host_pages}"
            )
        if slot_page_size <= 0:
            raise ValueError(f"{pool_name}: slot_page_size must be positive, got {slot_page_size}")

        self.layer_num = len(device_buffers)
        self.item_bytes = item_bytes
        self.num_host_pages = num_host_pages
        self.slot_page_size = slot_page_size
        self.dtype = torch.uint8
        self.device = device
        truth("pin_memory", pin_memory)
        self.pin_memory = pin_memory
        self.allocator_type = allocator_type
        # The default allocator's bytes come from a Rust HostRegion; a storage allocator's (shm,
        # Mooncake, ...) from its own allocate(), adopted by the core.
        self.allocator = get_allocator_from_storage(allocator_type, pool_name)
        self.page_size = slot_page_size
        self.size = num_host_pages * slot_page_size
        self.page_num = num_host_pages
        self.layout = layout
        self.size_per_token = item_bytes
        self.start_layer = 0
        self.end_layer = self.layer_num
        new_pool_lock(self)
        # The sequence as given (SGLang keeps the caller's tuple or list).
        self.device_buffers = given if isinstance(given, (list, tuple)) else device_buffers
        # What the core binds: the layers checked here, whatever the caller does to its list.
        self._device_layers = device_buffers
        # SGLang's attribute: the buffers' device, else the `device` argument as given (a
        # string); `gpu` is the same as a torch.device, for the checks here.
        self.gpu_device = device_buffers[0].device if device_buffers else device
        gpu = torch.device(self.gpu_device)
        self._device_refusal = self._device_rows_refusal(
            device_buffers, item_bytes, "device buffer"
        )

        requested_bytes = self.layer_num * num_host_pages * item_bytes
        # Looked up on `base` at call time, like SGLang's import from pool_host.base, so patching
        # `base.host_memory_budget_bytes` (or `budgets`') steers this check too. SGLang books
        # nothing here (it passes no request).
        available_bytes, source = pool_host_base.host_memory_budget_and_source(
            sglang_module=SGLANG_V4_POOLS
        )
        if requested_bytes > available_bytes:
            raise ValueError(
                f"Not enough host memory for V4 paged pool {pool_name}. "
                f"Requesting {_memory.gb(requested_bytes)} GB but only have "
                f"{_memory.gb(available_bytes)} GB free.{budget_source_text(source)}"
            )
        # The geometry in the core: refuses another layout with SGLang's text.
        release = sglang_release()
        self._spec = _core.PoolSpec(
            "v4_paged",
            layout,
            self.layer_num,
            num_host_pages,
            slot_page_size,
            [item_bytes],
            1,
            name=self._name,
            release=release,
        )
        # SGLang's check sees only the page rows; the slot tables (one entry per token slot) and
        # a staging buffer on a CPU device count against the memory there is as well.
        staging = self._spec.staging_shape
        if (release is None or release >= (0, 5, 22)) and not hicache_device_kernels():
            staging = None  # 0.5.22+ makes it only where its device kernels run
        staging_bytes = 0
        if staging is not None and gpu.type == "cpu":
            staging_bytes = staging[0] * staging[1] * staging[2]
        _memory.check_allocations_fit(
            f"V4 paged pool {pool_name}",
            {
                "page rows": requested_bytes,
                "slot tables": slot_table_bytes(self.size),
                "staging buffer": staging_bytes,
            },
        )
        if device != "cpu":
            # SGLang's HostTensorAllocator.allocate asserts the same.
            raise AssertionError(
                f"HostTensorAllocator only supports CPU allocations; got device={device!r}"
            )

        # One allocation in the core's layout, layer_first included (SGLang makes one per layer
        # there; a core plane is one contiguous allocation).
        self._region = None
        rows = torch.empty(0, dtype=torch.uint8)
        if requested_bytes > 0:
            rows, self._region = _memory.alloc_pool_memory(
                self.allocator,
                torch.uint8,
                self._spec.shape(0),
                pin_memory,
                self._spec.registration_unit(0),
                gpu,
            )
        # The page rows as one flat tensor, which every view of them shares (its storage is
        # the allocator's where a storage backend's allocator made it), and the core's pool
        # over it (an empty one for a pool of no pages), which checks on every call that the
        # storage still holds that memory.
        self._flat = rows.view(-1)
        self._pool = _core.HostPool(self._spec, [self._flat])
        self.fd = getattr(self.allocator, "fd", None)

        L, Nh, IB = self.layer_num, num_host_pages, item_bytes
        self.data_refs = []
        self.kv_buffer = self._flat.view(self._spec.shape(0))
        if self._spec.layer_view_dim(False) is not None:
            # A list of per-layer (Nh, IB) tensors, as SGLang has (layer_first); one region laid
            # out layer-first underneath, the core's arithmetic.
            self.kv_buffer = list(self.kv_buffer.unbind(0))
            self.data_refs = list(self.kv_buffer)
        logger.info(
            "Allocating %.2f GB host memory for V4 paged pool '%s' "
            "(layers=%d, pages=%d, item_bytes=%d, layout=%s).",
            requested_bytes / 1e9,
            pool_name,
            L,
            Nh,
            IB,
            layout,
        )

        self.device_ptrs = ptr_table(device_buffers, gpu)
        self.data_ptrs = ptr_table(self.data_refs, gpu) if self.data_refs else None
        self.scale_kv_buffer = None
        self.scale_device_buffers = None
        self.scale_item_bytes = 0
        self._scale_region = None
        self.can_use_jit = False
        self.can_use_write_back_jit = False
        # SGLang allocates the page_first staging buffer on the device buffers' device even
        # though its write-back JIT may stay off (and hostkv_rs never turns it on), so callers
        # and memory budgets see the same buffer (0.5.22+: on CUDA and ROCm platforms only).
        self.staging_buffer = None
        if staging is not None:
            self.staging_buffer = torch.empty(staging, dtype=self.dtype, device=gpu)
        self._destroyed = False
        self._transfers = self._bind()
        self.clear()

    # ---- construction helpers -------------------------------------------------------------

    def _device_rows_refusal(self, buffers, row_bytes: int, what: str) -> str | None:
        """Why the device buffers cannot be moved as rows of `row_bytes` (None where they can).
        Each buffer must be a tensor with storage on the pool's device; one that is not
        contiguous whole rows is taken, as SGLang takes it (its unit tests build pools over
        one-byte buffers), and refused by the first transfer."""
        refusal = None
        expected = torch.device(self.gpu_device)
        for i, buf in enumerate(buffers):
            if not isinstance(buf, torch.Tensor):
                raise TypeError(f"{self.pool_name}: {what} {i} is not a tensor")
            if buf.device != expected:
                raise ValueError(
                    f"{self.pool_name}: {what} {i} is on {buf.device}, expected {expected}"
                )
            nbytes = buf.numel() * buf.element_size()
            _core.check_storage(buf, f"{self.pool_name}: {what} {i}")
            if refusal is None and (not buf.is_contiguous() or nbytes % row_bytes != 0):
                refusal = (
                    f"{self.pool_name}: {what} {i} must be contiguous rows of "
                    f"{row_bytes} bytes, got shape {tuple(buf.shape)} "
                    f"({nbytes} bytes, contiguous={buf.is_contiguous()})"
                )
        return refusal

    def _bind(self, scales=None):
        """The pool's transfers in the core (`_core.V4Transfers`: every check, in SGLang's order,
        and the device bindings that move the bytes). Each `_core.DeviceBinding` pairs the core
        (page rows; for the C4 row the same bytes read as rows of one value and rows of one
        scale; with `scales`, the page rows and scale rows together for kernel_ascend) with the
        device buffers seen as rows of that size, checked on first use. Device buffers that are
        not whole rows get no binding: the first transfer refuses them."""
        bindings = {}
        if self._device_refusal is None:
            IB = self.item_bytes
            bindings["page"] = self._binding(("page_rows", self.slot_page_size), [0], [IB])
            if self._spec.token_rows:
                # Both read whole C4 page rows, so a token call moves its values and its
                # scales or neither.
                bindings["tokens"] = (
                    self._binding(("c4_value",), [0], [IB]),
                    self._binding(("c4_scale",), [0], [IB]),
                )
            if scales is not None:
                bindings["ascend"] = self._binding(
                    ("page_rows", self.slot_page_size),
                    None,
                    [IB, self.scale_item_bytes],
                    buffers=[self._device_layers, scales],
                )
        return _core.V4Transfers(
            self._name,
            self.slot_page_size,
            self.item_bytes,
            torch.device(self.gpu_device),
            spec=self._spec,
            refusal=self._device_refusal,
            has_rows=self._region is not None,
            **bindings,
        )

    def _binding(self, index_map, host_planes, page_rows: list[int], buffers=None):
        """The core's device side for its planes `host_planes` (or the rows `index_map` reads
        them as): per plane, every layer's device buffer, whole page rows of that plane's
        `page_rows` bytes, read as its bytes in rows of the core's row size. The binding holds
        the buffers themselves, so one whose storage is swapped is checked again, and followed,
        at the next transfer."""
        planes = [list(plane) for plane in buffers or [self._device_layers]]
        L = self.layer_num
        return _core.DeviceBinding(
            self._pool,
            planes,
            list(range(L)),
            L,
            L,
            what=f"{self.pool_name} device buffer",
            name=self._name,
            index_map=index_map,
            host_planes=host_planes,
            byte_rows=page_rows,
        )

    # ---- geometry getters ------------------------------------------------------------------

    def get_size_per_token(self):
        return self.item_bytes

    def get_ksize_per_token(self):
        return self.item_bytes

    def init_kv_buffer(self):
        return self.kv_buffer

    def get_hybrid_pool_buffer(self):
        return self.kv_buffer if isinstance(self.kv_buffer, list) else [self.kv_buffer]

    def get_contiguous_buf_infos(self):
        """Per-layer page-row buffers for PD direct-to-host transfer. The page layouts have no
        per-layer host buffers: SGLang 0.5.20+ lists no pointers and `kv_buffer[i]`'s bytes for
        each layer i; before, it failed on `data_ptrs = None` (refused here, with why)."""
        self._require_live()
        return self._pool.contiguous_buf_infos()

    def is_stride_page_aligned(self, page_size_bytes: int = 4096) -> bool:
        spec = self.__dict__.get("_spec")  # none on a pool made with `__new__`
        if spec is not None and not spec.page_strided:
            return False  # SGLang's answer for layer_first, the argument unread
        page_size_bytes = positive_int("page_size_bytes", page_size_bytes)
        if self.kv_buffer is None:
            return False
        return self._pool.is_stride_page_aligned(page_size_bytes)

    # ---- slot allocator (page-row units, lazy release, no used-tracking) --------------------

    @synchronized
    def clear(self):
        self._reset_free_list(self.size)

    # available_size and the lazy merge are HostKVCache's; alloc differs from it (page rounding
    # instead of an assert), as in SGLang; free refuses a double free, which SGLang's V4 pool
    # does not detect.

    @synchronized
    def alloc(self, need_size: int) -> torch.Tensor | None:
        need_size = as_int("need_size", need_size)
        if need_size < 0:
            raise ValueError(
                f"{self.pool_name} alloc: need_size must not be negative, got {need_size}"
            )
        P = self.slot_page_size
        return self._take_slots((need_size + P - 1) // P * P)

    @synchronized
    def free(self, indices) -> int:
        """Release slots lazily (any device; no page check, as in SGLang). Stricter than SGLang
        on purpose: a slot that is not allocated (a double free, or one never handed out) is
        refused with the MHA/MLA pools' "Double-free detected" error and nothing is released;
        SGLang would later hand it to two owners."""
        slots = slots_in_pool(indices, self.size, f"{self.pool_name} free")
        self._release_slots(slots)
        return slots.numel()

    # ---- indexer scale buffers (NPU C4 indexer) ---------------------------------------------

    @outside_inference_mode  # host tensors as writable as the constructor's (PoolMeta)
    @synchronized  # two attaching threads: one attaches, the other is told so
    def attach_scale_buffers(self, scale_device_buffers: list, scale_item_bytes: int) -> None:
        """Mirror per-layer scale rows (`scale_item_bytes` per device page row) next to the KV
        rows. Only kernel_ascend transfers move them, as in SGLang."""
        if self.scale_kv_buffer is not None:
            raise RuntimeError(f"{self.pool_name}: scale buffers already attached")
        self._require_live()
        buffers = layer_tensors(f"{self.pool_name}: scale_device_buffers", scale_device_buffers)
        if len(buffers) != self.layer_num:
            raise ValueError(
                f"{self.pool_name}: scale_device_buffers has {len(buffers)} layers, "
                f"expected {self.layer_num}"
            )
        scale_item_bytes = as_int("scale_item_bytes", scale_item_bytes)
        if scale_item_bytes <= 0:
            raise ValueError(
                f"{self.pool_name}: scale_item_bytes must be positive, got {scale_item_bytes}"
            )
        # Checked here for clear messages; the binding bounds each transfer by these rows.
        refusal = self._device_rows_refusal(buffers, scale_item_bytes, "scale device buffer")
        if refusal is not None:
            raise ValueError(refusal)

        L, Nh, SIB = self.layer_num, self.num_host_pages, scale_item_bytes
        nbytes = L * Nh * SIB
        _memory.check_allocations_fit(
            f"the indexer scale rows of V4 paged pool {self.pool_name}", {"scale rows": nbytes}
        )
        logger.info(
            "Attaching %.2f MB host memory for V4 indexer scale pool '%s' "
            "(layers=%d, pages=%d, scale_item_bytes=%d, layout=%s).",
            nbytes / 1e6,
            self.pool_name,
            L,
            Nh,
            SIB,
            self.layout,
        )
        # The scale rows are the pool's second plane: the page rows' geometry with their own
        # row size and allocation.
        spec = _core.PoolSpec(
            "v4_paged",
            self.layout,
            L,
            Nh,
            self.slot_page_size,
            [self.item_bytes, SIB],
            1,
            name=self._name,
            release=sglang_release(),
        )
        region, scale_flat = None, torch.empty(0, dtype=torch.uint8)
        if nbytes > 0:
            scale_flat, region = _memory.alloc_pool_memory(
                self.allocator,
                torch.uint8,
                (nbytes,),
                self.pin_memory,
                spec.registration_unit(1),
                getattr(self, "gpu_device", None),
            )

        scale_rows = scale_flat.view(tuple(spec.shape(1)))
        if spec.layer_view_dim(False) is not None:
            host = list(scale_rows.unbind(0))  # SGLang's list of per-layer rows
        else:
            host = scale_rows.view(Nh, L, 1, SIB)  # SGLang's shape for both page layouts
        # What attaching changes, put back if any step of it is refused (the two-plane core or
        # its bindings), so a retry is not told the scales are attached already.
        names = ("_scale_region", "scale_device_buffers", "scale_item_bytes", "scale_kv_buffer")
        changed = (*names, "_spec", "_pool", "_transfers")
        before = [getattr(self, n) for n in changed]
        try:
            self._require_live()  # destroy() does not wait for the pool's lock
            for name, value in zip(names, (region, buffers, SIB, host)):
                setattr(self, name, value)
            if region is not None and self._region is not None:
                # One core over both planes. kernel_ascend moves the page rows and the scale
                # rows of a page together, so one check covers both before a byte moves; every
                # other binding moves the page rows alone. The bindings over the old core are
                # dropped, not released: a transfer still running through one finishes over the
                # same memory.
                self._spec, self._pool = spec, _core.HostPool(spec, [self._flat, scale_flat])
                self._transfers = self._bind(scales=buffers)
        except BaseException:
            for name, value in zip(changed, before):
                setattr(self, name, value)
            raise

    # ---- transfers --------------------------------------------------------------------------

    def _require_live(self):
        if self._destroyed:
            raise RuntimeError(f"{self.pool_name} host pool has been destroyed")

    def _moves(self):
        """The core's transfers. A pool made with `__new__` and a few attributes set by hand (as
        SGLang's unit tests make them) has no bytes and no device side: its transfers make the
        index and page-alignment refusals, and refuse anything past them for want of page
        rows."""
        transfers = self.__dict__.get("_transfers")
        if transfers is None:
            device = torch.device("cpu")
            transfers = _core.V4Transfers(self._name, self.slot_page_size, 0, device)
        return transfers

    def backup_from_device_all_layer(self, device_pool, host_indices, device_indices, io_backend):
        self._require_live()
        # Read as SGLang reads it (`if self.page_aligned_only`): the attribute may be reset later.
        aligned_only = bool(self.page_aligned_only)
        self._moves().backup(
            host_indices, device_indices, io_backend, page_aligned_only=aligned_only
        )

    def backup_tokens_from_device_all_layer(self, host_indices, device_indices) -> None:
        """Every layer of single tokens, device -> host (SGLang 0.5.23's HiSparse decode
        backup): each token's C4 value and scale, whatever the index count, so a multiple of the
        page size is never taken for whole pages. Needs the layer_first C4 rows; a
        page-aligned-only pool refuses it."""
        self._require_live()
        aligned_only = bool(self.page_aligned_only)
        self._moves().backup_tokens(host_indices, device_indices, page_aligned_only=aligned_only)

    def load_to_device_per_layer(
        self, device_pool, host_indices, device_indices, layer_id, io_backend, *, is_draft=False
    ):
        self._require_live()
        self._moves().load(
            layer_id,
            host_indices,
            device_indices,
            io_backend,
            page_aligned_only=bool(self.page_aligned_only),
        )

    # ---- L3 flat pages and zero-copy metadata ----------------------------------------------

    def _page_base(self) -> torch.Tensor:
        # Asked again where a page is written: reading the caller's page may have run Python
        # (a subclass's hook) that destroyed the pool, as the other pools' base is gone then.
        self._require_live()
        return self._flat

    def get_data_page(self, index, flat=True):
        self._require_live()
        data_page = self._page_view(index)
        flat = truth("flat", flat)
        if self._spec.layer_view_dim(False) is not None:
            # SGLang stacks the per-layer rows: a copy, not a view of the pool, flat or not (with
            # one layer the view is contiguous, and flatten alone would hand out the pool's bytes).
            data_page = data_page.clone(memory_format=torch.contiguous_format)
        return data_page.flatten() if flat else data_page

    def get_dummy_flat_data_page(self):
        # SGLang's own attributes, not the spec: a pool its unit tests build with `__new__` and
        # a few attributes has none.
        return torch.zeros(
            (self.layer_num, self.item_bytes),
            dtype=self.dtype,
            device=self.device,
            pin_memory=_memory.pin_dummy_pages(self.pin_memory),
        ).flatten()

    def set_from_flat_data_page(self, index, data_page):
        self._require_live()
        geometry = self._page_geometry(index)
        if not isinstance(data_page, torch.Tensor):
            raise TypeError(
                f"{self.pool_name} set_from_flat_data_page: expected a tensor, "
                f"got {type(data_page).__name__}"
            )
        if data_page.is_meta:
            raise ValueError(
                f"{self.pool_name} set_from_flat_data_page: a page on the meta device holds no "
                f"values"
            )
        _core.check_page_values(data_page, f"{self.pool_name} set_from_flat_data_page")
        expected = self.layer_num * self.item_bytes
        got = data_page.numel() * data_page.element_size()
        if got != expected:
            raise FlatPageError(
                f"{self.pool_name} set_from_flat_data_page: expected {expected} bytes "
                f"({self.layer_num} x {self.item_bytes}), got {got}"
            )
        source = data_page.contiguous().view(self.dtype).reshape(geometry[1])
        self._write_page(geometry, source)

    def get_page_buffer_meta(self, indices):
        self._require_live()
        return self._pool.page_meta(index_list(indices))

    # ---- teardown -----------------------------------------------------------------------------

    def destroy(self):
        """Unregister the CUDA host registration now rather than at exit (idempotent)."""
        if getattr(self, "_destroyed", True):
            return
        self._destroyed = True
        pool_host_base.run_destroy_callbacks(self)  # e.g. hostkv_rs.l3 detaching from a store
        for region in (self._region, self._scale_region):
            if region is not None:
                region.unregister_cuda()
        self._transfers.release()
        self.kv_buffer = None
        self.data_refs = []
        self.data_ptrs = None
