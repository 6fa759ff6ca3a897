"""`MLATokenToKVPoolHost`: the host mirror of SGLang's `MLATokenToKVPool` (one latent plane of
`kv_cache_dim` elements per token and layer, in one Rust region)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence

import torch

from hostkv_rs import _core, _memory
from hostkv_rs.base import HostKVCache, check_io_pair, ptr_table
from hostkv_rs.hisparse import HiSparseHostPoolMixin

logger = logging.getLogger(__name__)

MLA_LAYOUTS = ("layer_first", "page_first", "page_first_direct")
_SUPPORTED = {
    "kernel": ("layer_first", "page_first"),
    "direct": ("layer_first", "page_first_direct"),
}


class MLATokenToKVPoolHost(HiSparseHostPoolMixin, HostKVCache):
    """Supported (io_backend, layout): kernel + layer_first/page_first, direct +
    layer_first/page_first_direct. `kernel_ascend` serves only the Ascend `page_first_kv_split`
    layout, which this package does not build, so it is refused with SGLang's
    `Unsupported layout: {layout}`.

    `is_dummy=True` sizes the pool and runs the slot allocator without allocating any bytes
    (`kv_buffer = data_refs = data_ptrs = None`); transfers on it fail SGLang's asserts.

    MTP packing: with `mtp_draft_device_pools` the host holds the target's layers followed by one
    layer per draft pool; backups read the packed device layer lists, and a draft load comes with
    `is_draft=True`, `layer_id = target_layer_num + k` and the draft device pool. DCP: slots are
    logical (widened) and transfers translate them to this rank's physical slots.
    """

    _device_plane_names = ("kv_buffer",)
    # load/backup pass both index tensors through maybe_dcp_kernel_indices (SGLang §3.4).
    dcp_aware_transfers = True

    def __init__(
        self,
        device_pool,
        host_to_device_ratio: float,
        host_size,
        page_size: int,
        layout: str,
        pin_memory: bool = True,
        device: str = "cpu",
        allocator_type: str = "default",
        override_kv_cache_dim: int | None = None,
        mtp_draft_device_pools: Sequence = (),
        dcp_size: int = 1,
        dcp_rank: int = 0,
        *,
        pool_label: str = "kv",
        is_dummy: bool = False,
    ):
        self.override_kv_cache_dim = override_kv_cache_dim
        self.mtp_draft_device_pools = tuple(mtp_draft_device_pools)
        self._is_dummy = bool(is_dummy)
        if self._is_dummy:
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
                owns_bytes=False,
            )
            self._init_dummy()
            return
        super().__init__(
            device_pool,
            host_to_device_ratio,
            host_size,
            page_size,
            layout,
            pin_memory,
            device,
            allocator_type,
            dcp_size=dcp_size,
            dcp_rank=dcp_rank,
            pool_label=pool_label,
        )
        self.can_use_jit = False
        self._no_write_back_staging("staging_buffer")
        if self.layout == "page_first":
            view = self.kv_buffer.transpose(0, 1)
        else:
            # page_first_direct: dim 0 is the page, so these are page slabs, as in SGLang.
            view = self.kv_buffer
        count = min(self.layer_num, view.shape[0])
        self.data_refs = [view[i] for i in range(count)]
        self.data_ptrs = ptr_table(self.data_refs, self.device_pool.device)
        self._init_packed_device_tables()
        self._pool_core = _core.PoolCore(
            self.layout,
            self.layer_num,
            self.size,
            self.page_size,
            [self.token_stride_size],
            [self.kv_buffer.data_ptr()],
            1,
        )

    def _init_packed_device_tables(self) -> None:
        """MTP packing (G-Aug26): the host holds the target's layers followed by one layer per
        draft pool, and backups read the target pool's layers followed by every draft pool's
        (SGLang's packed_device_* tables; absent without drafts)."""
        if not self.mtp_draft_device_pools:
            return
        self.packed_device_kv_buffers = self._packed_device_layers("kv_buffer")
        self.packed_device_data_ptrs = ptr_table(
            self.packed_device_kv_buffers, self.device_pool.device
        )

    def _init_dummy(self) -> None:
        """The rest of an allocator-only pool (one TP rank keeps the MLA bytes, the others only
        the slots). It owns no bytes, so DCP is only its slot arithmetic: slots are handed out in
        the widened (logical) space, `size`/`page_size` stay per-rank physical."""
        self.token_stride_size = self.kv_cache_dim * self.dtype.itemsize
        self.layout_dim = self.token_stride_size * self.layer_num
        self.can_use_jit = False
        self._no_write_back_staging("staging_buffer")
        self.kv_buffer = None
        self.data_refs = None
        self.data_ptrs = None
        self.fd = getattr(self.allocator, "fd", None)
        logger.info(
            "MLATokenToKVPoolHost dummy mode: allocator-only, size=%d tokens, saving %.2f GB "
            "host memory",
            self.size,
            self.size * self.size_per_token / 1e9,
        )
        self.lock = threading.RLock()
        self.clear()

    # ----------------------------------------------------------------- geometry

    def get_size_per_token(self):
        dp = self.device_pool
        self.kv_lora_rank = dp.kv_lora_rank
        self.qk_rope_head_dim = dp.qk_rope_head_dim
        # Read by L3 stores (FP8 DSA packs K/V into one device buffer); kept for parity.
        self.dsa_kv_cache_store_fp8 = getattr(dp, "dsa_kv_cache_store_fp8", False)
        self.target_layer_num = dp.layer_num
        self.layer_num = self.target_layer_num + len(self.mtp_draft_device_pools)
        self.kv_cache_dim = self.override_kv_cache_dim or (
            self.kv_lora_rank + self.qk_rope_head_dim
        )
        return self.kv_cache_dim * self.dtype.itemsize * self.layer_num

    def get_ksize_per_token(self):
        return self.get_size_per_token()

    def init_kv_buffer(self):
        L, S, P, Pn, C = self.layer_num, self.size, self.page_size, self.page_num, self.kv_cache_dim
        if self.layout == "layer_first":
            dims = (L, S, 1, C)
        elif self.layout == "page_first":
            dims = (S, L, 1, C)
        elif self.layout == "page_first_direct":
            dims = (Pn, L, P, 1, C)
        else:
            raise ValueError(f"Unsupported layout: {self.layout}")
        self.token_stride_size = C * self.dtype.itemsize
        self.layout_dim = self.token_stride_size * L
        granularity = (
            P * self.layout_dim if self.layout in ("page_first", "page_first_direct") else 0
        )
        region = _memory.alloc_host_region(
            L * S * self.token_stride_size, self.pin_memory, granularity
        )
        self._host_regions = [region]
        return _memory.region_view(region, self.dtype, dims)

    def get_contiguous_buf_infos(self):
        """(per-layer host pointers, `kv_buffer[l].nbytes`, `token_stride_size * page_size`) for
        registering the host pool with a disaggregation transfer engine, as SGLang reports them.
        Only layer_first has per-layer slabs; for the page layouts SGLang reports the per-layer
        `data_refs` pointers next to `kv_buffer[l]` (one token or one page), and so do we."""
        if self._is_dummy:
            return [], [], []
        self._require_bytes()
        L = self.layer_num
        if self.kv_buffer.shape[0] < L:
            # page_first_direct with fewer pages than layers: SGLang fails building data_refs.
            raise ValueError(
                f"get_contiguous_buf_infos: kv_buffer has {self.kv_buffer.shape[0]} entries along "
                f"dim 0 but the pool has {L} layers (layout {self.layout!r})"
            )
        data_ptrs = [ref.data_ptr() for ref in self.data_refs]
        data_lens = [self.kv_buffer[i].nbytes for i in range(L)]
        item_lens = [self.token_stride_size * self.page_size] * L
        return data_ptrs, data_lens, item_lens

    def get_hybrid_pool_buffer(self):
        return [] if self.kv_buffer is None else [self.kv_buffer]

    def is_stride_page_aligned(self, page_size_bytes: int = 4096) -> bool:
        if self.kv_buffer is None or self.layout not in ("page_first", "page_first_direct"):
            return False
        stride = self.page_size * self.layout_dim
        return self.kv_buffer.data_ptr() % page_size_bytes == 0 and stride % page_size_bytes == 0

    # ----------------------------------------------------------------- transfers

    def _check_io(self, io_backend: str):
        check_io_pair(io_backend, self.layout, _SUPPORTED)

    def _plane_item_bytes(self) -> list[int]:
        return [self.token_stride_size]

    def load_to_device_per_layer(
        self, device_pool, host_indices, device_indices, layer_id, io_backend, *, is_draft=False
    ):
        if self._is_dummy:
            raise AssertionError("load on a dummy (non-src MLA) host pool")
        self._load_planes(device_pool, host_indices, device_indices, layer_id, io_backend, is_draft)

    def backup_from_device_all_layer(self, device_pool, host_indices, device_indices, io_backend):
        if self._is_dummy:
            raise AssertionError("backup on a dummy (non-src MLA) host pool")
        self._backup_planes(device_pool, host_indices, device_indices, io_backend)

    # ----------------------------------------------------------------- L3 flat pages

    def _page_shape(self):
        L, P, C = self.layer_num, self.page_size, self.kv_cache_dim
        return {
            "layer_first": (L, P, 1, C),
            "page_first": (P, L, 1, C),
            "page_first_direct": (1, L, P, 1, C),
        }.get(self.layout)

    def _require_no_dcp(self):
        if int(self.dcp_size) != 1:
            raise AssertionError(
                "HiCache L3 storage paths are not yet DCP-aware (per-rank shards need "
                "dcp_rank-scoped keys); --hicache-storage-backend with --dcp-size > 1 should "
                "have been rejected at server start."
            )

    def get_data_page(self, index, flat: bool = True) -> torch.Tensor:
        self._require_no_dcp()
        if self._page_shape() is None:
            raise ValueError(f"Unsupported layout: {self.layout}")
        self._require_bytes()
        index = self._page_slot(index, self.layout == "page_first_direct")
        P = self.page_size
        if self.layout == "layer_first":
            data_page = self.kv_buffer[:, index : index + P]
        elif self.layout == "page_first":
            data_page = self.kv_buffer[index : index + P]
        else:
            data_page = self.kv_buffer[index // P : index // P + 1]
        return data_page.flatten() if flat else data_page

    def get_dummy_flat_data_page(self) -> torch.Tensor:
        return torch.zeros(
            (self.layer_num, self.page_size, 1, self.kv_cache_dim),
            dtype=self.dtype,
            device=self.device,
            pin_memory=_memory.pin_dummy_pages(self.pin_memory),
        ).flatten()

    def set_from_flat_data_page(self, index: int, data_page: torch.Tensor) -> None:
        # SGLang checks DCP only when reading a page; writing one is no less rank-blind.
        self._require_no_dcp()
        shape = self._page_shape()
        if shape is None:
            raise ValueError(f"Unsupported layout: {self.layout}")
        self._require_bytes()
        index = self._page_slot(index, self.layout == "page_first_direct")
        page = self._flat_page_as(data_page, shape)
        P = self.page_size
        if self.layout == "layer_first":
            self.kv_buffer[:, index : index + P] = page
        elif self.layout == "page_first":
            self.kv_buffer[index : index + P] = page
        else:
            self.kv_buffer[index // P : index // P + 1] = page

    # ----------------------------------------------------------------- zero-copy metadata

    def get_page_buffer_meta(self, indices):
        """(pointers, sizes): layer_first gives one pointer per layer per page; the page layouts
        one pointer per page covering all layers."""
        if self.layout not in MLA_LAYOUTS:
            raise ValueError(f"Unsupported layout: {self.layout}")
        self._require_bytes()
        starts = self._meta_page_starts(indices, self.layout == "page_first_direct")
        T, L, S, P = self.token_stride_size, self.layer_num, self.size, self.page_size
        base = self.kv_buffer.data_ptr()
        ptrs: list[int] = []
        if self.layout == "layer_first":
            for t in starts:
                ptrs += [base + t * T + layer * S * T for layer in range(L)]
            size = P * T
        else:
            ptrs = [base + t * L * T for t in starts]
            size = L * P * T
        return ptrs, [size] * len(ptrs)
