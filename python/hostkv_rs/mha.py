"""MHA host pools: `MHATokenToKVPoolHost` (K and V in one Rust region), the asymmetric K/V variant
(two regions) and SGLang's `get_mha_host_pool_cls` factory."""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from hostkv_rs import _core, _memory
from hostkv_rs.base import HostKVCache, as_int, check_io_pair, ptr_table

logger = logging.getLogger(__name__)

MHA_LAYOUTS = ("layer_first", "page_first", "page_first_direct", "page_head")
# (io_backend -> layouts) SGLang serves for symmetric MHA; kernel_ascend needs an Ascend NPU.
_SUPPORTED = {
    "kernel": ("layer_first", "page_first", "page_head"),
    "direct": ("layer_first", "page_first_direct"),
}
_PAGE_MAJOR = ("page_first_direct", "page_head")

_ASYM_FLAT_PAGE_TEXT = (
    "Models with head_dim != v_head_dim do not support the flat-page interface used by HiCache "
    "L3 storage backends {hf3fs, eic, nixl}. Use a backend that does not use this interface "
    "(e.g. mooncake, simm)."
)


class MHATokenToKVPoolHost(HostKVCache):
    """Host mirror of SGLang's `MHATokenToKVPool`: `kv_buffer` is one `(2, ...)` tensor over one
    Rust `HostRegion`; the V half starts `L*S*H*D*e` bytes after the K half.

    Supported (io_backend, layout): kernel + layer_first/page_first/page_head, direct +
    layer_first/page_first_direct. `kernel_ascend` needs an Ascend NPU and is refused: with
    page_first_direct as `Unsupported IO backend: kernel_ascend`, otherwise with SGLang's
    `Unsupported layout: {layout}`.

    MTP packing: with `mtp_draft_device_pools`, the host holds the target's layers followed by one
    layer per draft pool; backups read the packed device layer lists, and a draft load is called
    with `is_draft=True`, `layer_id = target_layer_num + k` and the draft device pool.
    """

    _device_plane_names = ("k_buffer", "v_buffer")

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
        *,
        mtp_draft_device_pools: Sequence = (),
        pool_label: str = "kv",
    ):
        # MTP packing (G-Aug26): each draft pool's layer is appended after the target's layers.
        self.mtp_draft_device_pools = tuple(mtp_draft_device_pools)
        super().__init__(
            device_pool,
            host_to_device_ratio,
            host_size,
            page_size,
            layout,
            pin_memory,
            device,
            allocator_type,
            pool_label=pool_label,
        )
        self.element_dim = self.head_num * self.head_dim
        self.can_use_jit = False
        self._init_data_refs()
        self._init_packed_device_tables()
        self._no_write_back_staging("staging_k_buffer", "staging_v_buffer")
        self._pool_core = _core.PoolCore(
            self.layout,
            self.layer_num,
            self.size,
            self.page_size,
            self._plane_item_bytes(),
            self._plane_addrs(),
            self.head_num if self.layout == "page_head" else 1,
        )

    # ----------------------------------------------------------------- geometry

    def get_size_per_token(self):
        dp = self.device_pool
        self.head_num = dp.head_num
        self.head_dim = dp.head_dim
        self.target_layer_num = dp.layer_num
        self.layer_num = self.target_layer_num + len(self.mtp_draft_device_pools)
        return self.head_dim * self.head_num * self.layer_num * self.dtype.itemsize * 2

    def get_ksize_per_token(self):
        return self.get_size_per_token() // 2

    def _buffer_dims(self, head_dim: int, layout: str):
        L, S, P, Pn, H = self.layer_num, self.size, self.page_size, self.page_num, self.head_num
        if layout == "layer_first":
            return (L, S, H, head_dim)
        if layout == "page_first":
            return (S, L, H, head_dim)
        if layout == "page_first_direct":
            return (Pn, L, P, H, head_dim)
        if layout == "page_head":
            return (Pn, H, P, L, head_dim)
        return None

    def init_kv_buffer(self):
        dims = self._buffer_dims(self.head_dim, self.layout)
        if dims is None:
            raise ValueError(f"Unsupported layout: {self.layout}")
        self.token_stride_size = self.head_num * self.head_dim * self.dtype.itemsize
        self.layout_dim = self.token_stride_size * self.layer_num
        half = self.layer_num * self.size * self.token_stride_size
        # A chunked cudaHostRegister must not split one page-first copy unit.
        granularity = (
            self.page_size * self.layout_dim
            if self.layout in ("page_first", "page_first_direct")
            else 0
        )
        region = _memory.alloc_host_region(2 * half, self.pin_memory, granularity)
        self._host_regions = [region]
        return _memory.region_view(region, self.dtype, (2, *dims))

    def _plane_item_bytes(self) -> list[int]:
        return [self.token_stride_size, self.token_stride_size]

    def _plane_addrs(self) -> list[int]:
        base = self.kv_buffer.data_ptr()
        return [base, base + self.layer_num * self.size * self.token_stride_size]

    def _init_data_refs(self):
        if self.layout == "page_first":
            # Strided per-layer views (row pitch = layout_dim) without copying.
            k_view, v_view = self.k_buffer.transpose(0, 1), self.v_buffer.transpose(0, 1)
        else:
            # For page-major layouts dim 0 is the page, so these views are not per-layer; SGLang
            # builds them anyway and never reads them. Bounded so a pool with more layers than
            # pages does not fail here.
            k_view, v_view = self.k_buffer, self.v_buffer
        count = min(self.layer_num, k_view.shape[0])
        self.k_data_refs = [k_view[i] for i in range(count)]
        self.v_data_refs = [v_view[i] for i in range(count)]
        self.host_kv_data_refs = self.k_data_refs + self.v_data_refs
        self.k_data_ptrs = ptr_table(self.k_data_refs, self.device_pool.device)
        self.v_data_ptrs = ptr_table(self.v_data_refs, self.device_pool.device)

    def _init_packed_device_tables(self):
        """With MTP drafts, backups read the target pool's layers followed by every draft pool's
        (SGLang's packed_device_* tables); without drafts these attributes do not exist."""
        if not self.mtp_draft_device_pools:
            return
        self.packed_device_k_buffers = self._packed_device_layers("k_buffer")
        self.packed_device_v_buffers = self._packed_device_layers("v_buffer")
        self.packed_device_kv_buffers = self.packed_device_k_buffers + self.packed_device_v_buffers
        device = self.device_pool.device
        self.packed_device_k_data_ptrs = ptr_table(self.packed_device_k_buffers, device)
        self.packed_device_v_data_ptrs = ptr_table(self.packed_device_v_buffers, device)

    @property
    def k_buffer(self):
        return self.kv_buffer[0]

    @property
    def v_buffer(self):
        return self.kv_buffer[1]

    def get_hybrid_pool_buffer(self):
        return [self.k_buffer, self.v_buffer]

    def _page_bytes(self, head_dim: int) -> int:
        return self.page_size * self.layer_num * self.head_num * head_dim * self.dtype.itemsize

    def is_stride_page_aligned(self, page_size_bytes: int = 4096) -> bool:
        if self.kv_buffer is None or self.layout not in _PAGE_MAJOR + ("page_first",):
            return False
        return (
            self.kv_buffer.data_ptr() % page_size_bytes == 0
            and self._page_bytes(self.head_dim) % page_size_bytes == 0
        )

    # ----------------------------------------------------------------- transfers

    def _check_io(self, io_backend: str):
        check_io_pair(io_backend, self.layout, _SUPPORTED, ascend_layouts=("page_first_direct",))

    def load_to_device_per_layer(
        self, device_pool, host_indices, device_indices, layer_id, io_backend, *, is_draft=False
    ):
        """Copy host layer `layer_id` of `host_indices` into device layer `layer_id` at
        `device_indices` (work is enqueued on torch's current stream for a CUDA device pool)."""
        self._load_planes(device_pool, host_indices, device_indices, layer_id, io_backend, is_draft)

    def backup_from_device_all_layer(self, device_pool, host_indices, device_indices, io_backend):
        """Copy every layer of `device_indices` (device) into `host_indices` (host)."""
        self._backup_planes(device_pool, host_indices, device_indices, io_backend)

    # ----------------------------------------------------------------- L3 flat pages

    def get_data_page(self, index, flat: bool = True) -> torch.Tensor:
        if self.layout not in MHA_LAYOUTS:
            raise ValueError(f"Unsupported layout: {self.layout}")
        self._require_bytes()
        index = self._page_slot(index, self.layout in _PAGE_MAJOR)
        P = self.page_size
        if self.layout == "layer_first":
            data_page = self.kv_buffer[:, :, index : index + P]
        elif self.layout == "page_first":
            data_page = self.kv_buffer[:, index : index + P]
        else:
            page = index // P
            data_page = self.kv_buffer[:, page : page + 1]
        return data_page.flatten() if flat else data_page

    def get_dummy_flat_data_page(self) -> torch.Tensor:
        return torch.zeros(
            (2, self.layer_num, self.page_size, self.head_num, self.head_dim),
            dtype=self.dtype,
            device=self.device,
            pin_memory=_memory.pin_dummy_pages(self.pin_memory),
        ).flatten()

    def set_from_flat_data_page(self, index: int, data_page: torch.Tensor) -> None:
        """Store one flat page, read with this layout's own element order (see §4.4)."""
        L, P, H, D = self.layer_num, self.page_size, self.head_num, self.head_dim
        shapes = {
            "layer_first": (2, L, P, H, D),
            "page_first": (2, P, L, H, D),
            "page_first_direct": (2, 1, L, P, H, D),
            "page_head": (2, 1, H, P, L, D),
        }
        if self.layout not in shapes:
            raise ValueError(f"Unsupported layout: {self.layout}")
        self._require_bytes()
        index = self._page_slot(index, self.layout in _PAGE_MAJOR)
        page = self._flat_page_as(data_page, shapes[self.layout])
        if self.layout == "layer_first":
            self.kv_buffer[:, :, index : index + P] = page
        elif self.layout == "page_first":
            self.kv_buffer[:, index : index + P] = page
        else:
            self.kv_buffer[:, index // P : index // P + 1] = page

    # ----------------------------------------------------------------- zero-copy metadata

    def get_page_buffer_meta(self, indices):
        """(pointers, sizes) per page: layer_first gives k(l), v(l) for every layer l; the page
        layouts give one [k, v] pair covering the whole page."""
        if self.layout not in MHA_LAYOUTS:
            raise ValueError(f"Unsupported layout: {self.layout}")
        self._require_bytes()
        starts = self._meta_page_starts(indices, self.layout in _PAGE_MAJOR)
        T, L, S, P = self.token_stride_size, self.layer_num, self.size, self.page_size
        base = self.kv_buffer.data_ptr()
        v_offset = L * S * T
        ptrs: list[int] = []
        if self.layout == "layer_first":
            for t in starts:
                for layer in range(L):
                    k_ptr = base + t * T + layer * S * T
                    ptrs += [k_ptr, k_ptr + v_offset]
            size = P * T
        else:
            for t in starts:
                k_ptr = base + t * L * T
                ptrs += [k_ptr, k_ptr + v_offset]
            size = L * P * T
        return ptrs, [size] * len(ptrs)

    def get_split_heads_page_buffer_meta(self, indices, split_factor: int):
        """page_head only: per page and per group of H/split_factor heads, a [k, v] pair."""
        if self.layout != "page_head":
            raise AssertionError(
                f"get_split_heads_page_buffer_meta requires layout='page_head', got {self.layout}"
            )
        split_factor = as_int("split_factor", split_factor)
        if split_factor <= 0 or self.head_num % split_factor != 0:
            raise AssertionError(
                f"head_num ({self.head_num}) must be a multiple of split_factor ({split_factor})"
            )
        self._require_bytes()
        starts = self._meta_page_starts(indices, self.layout in _PAGE_MAJOR)
        L, S, P, H, D, e = (
            self.layer_num,
            self.size,
            self.page_size,
            self.head_num,
            self.head_dim,
            self.dtype.itemsize,
        )
        base = self.kv_buffer.data_ptr()
        v_offset = L * S * H * D * e
        ptrs: list[int] = []
        for t in starts:
            for head in range(0, H, H // split_factor):
                k_ptr = base + t * L * H * D * e + head * P * L * D * e
                ptrs += [k_ptr, k_ptr + v_offset]
        size = L * P * H * D * e // split_factor
        return ptrs, [size] * len(ptrs)


class AsymmetricMHATokenToKVPoolHost(MHATokenToKVPoolHost):
    """MHA with `head_dim != v_head_dim` (MiMo-V2): K and V live in two Rust regions with their own
    item sizes. `token_stride_size` and `layout_dim` are deliberately absent (AttributeError), as
    in SGLang, so code assuming one shared K/V stride fails loudly. Layouts: page_first (kernel)
    and page_first_direct (direct)."""

    def get_size_per_token(self):
        dp = self.device_pool
        self.head_num = dp.head_num
        self.head_dim = dp.head_dim
        self.v_head_dim = dp.v_head_dim
        self.target_layer_num = dp.layer_num
        self.layer_num = self.target_layer_num + len(self.mtp_draft_device_pools)
        return (
            (self.head_dim + self.v_head_dim)
            * self.head_num
            * self.layer_num
            * (self.dtype.itemsize)
        )

    def get_ksize_per_token(self):
        return self.head_dim * self.head_num * self.layer_num * self.dtype.itemsize

    def init_kv_buffer(self):
        if self.layout not in ("page_first", "page_first_direct"):
            raise ValueError(
                f"Unsupported layout for models with head_dim != v_head_dim: {self.layout}; "
                f"expected 'page_first' or 'page_first_direct'."
            )
        buffers, regions = [], []
        for head_dim in (self.head_dim, self.v_head_dim):
            dims = self._buffer_dims(head_dim, self.layout)
            item = self.head_num * head_dim * self.dtype.itemsize
            nbytes = self.size * self.layer_num * item
            region = _memory.alloc_host_region(
                nbytes, self.pin_memory, self.page_size * self.layer_num * item
            )
            regions.append(region)
            buffers.append(_memory.region_view(region, self.dtype, dims))
        self._host_regions = regions
        return tuple(buffers)

    def _k_token_stride_size(self) -> int:
        return self.head_num * self.head_dim * self.dtype.itemsize

    def _v_token_stride_size(self) -> int:
        return self.head_num * self.v_head_dim * self.dtype.itemsize

    def _k_layout_dim(self) -> int:
        return self._k_token_stride_size() * self.layer_num

    def _v_layout_dim(self) -> int:
        return self._v_token_stride_size() * self.layer_num

    def _plane_item_bytes(self) -> list[int]:
        return [self._k_token_stride_size(), self._v_token_stride_size()]

    def _plane_addrs(self) -> list[int]:
        return [self.k_buffer.data_ptr(), self.v_buffer.data_ptr()]

    def is_stride_page_aligned(self, page_size_bytes: int = 4096) -> bool:
        if self.kv_buffer is None or self.layout not in ("page_first", "page_first_direct"):
            return False
        return (
            self.k_buffer.data_ptr() % page_size_bytes == 0
            and self.v_buffer.data_ptr() % page_size_bytes == 0
            and self._page_bytes(self.head_dim) % page_size_bytes == 0
            and self._page_bytes(self.v_head_dim) % page_size_bytes == 0
        )

    def _check_io(self, io_backend: str):
        if io_backend == "kernel":
            if self.layout != "page_first":
                raise ValueError(
                    f"Unsupported layout for models with head_dim != v_head_dim and "
                    f"io_backend='kernel': {self.layout}; expected 'page_first'."
                )
        elif io_backend == "direct":
            if self.layout != "page_first_direct":
                raise ValueError(
                    f"Unsupported layout for models with head_dim != v_head_dim and "
                    f"io_backend='direct': {self.layout}; expected 'page_first_direct'."
                )
        else:
            raise ValueError(
                f"Unsupported IO backend for models with head_dim != v_head_dim: {io_backend}; "
                f"expected 'kernel' or 'direct'."
            )

    def get_data_page(self, index, flat: bool = True) -> torch.Tensor:
        raise NotImplementedError(_ASYM_FLAT_PAGE_TEXT)

    def get_dummy_flat_data_page(self) -> torch.Tensor:
        raise NotImplementedError(_ASYM_FLAT_PAGE_TEXT)

    def set_from_flat_data_page(self, index: int, data_page: torch.Tensor) -> None:
        raise NotImplementedError(_ASYM_FLAT_PAGE_TEXT)

    def get_split_heads_page_buffer_meta(self, indices, split_factor: int):
        raise NotImplementedError(
            "get_split_heads_page_buffer_meta requires layout='page_head', which is not "
            "supported for models with head_dim != v_head_dim."
        )

    def get_page_buffer_meta(self, indices):
        """Per page [k, v], each from its own buffer: K `L*P*H*D*e` bytes, V `L*P*H*Dv*e`."""
        if self.layout not in ("page_first", "page_first_direct"):
            raise ValueError(
                f"Unsupported layout for models with head_dim != v_head_dim: {self.layout}"
            )
        self._require_bytes()
        starts = self._meta_page_starts(indices, self.layout in _PAGE_MAJOR)
        P = self.page_size
        k_base, v_base = self.k_buffer.data_ptr(), self.v_buffer.data_ptr()
        k_page, v_page = self._page_bytes(self.head_dim), self._page_bytes(self.v_head_dim)
        ptrs: list[int] = []
        sizes: list[int] = []
        for t in starts:
            # page_first addresses by token (t*LD); page_first_direct by page (page*P*LD). Both
            # name the same byte when t starts a page.
            if self.layout == "page_first_direct":
                k_off, v_off = (t // P) * k_page, (t // P) * v_page
            else:
                k_off, v_off = t * self._k_layout_dim(), t * self._v_layout_dim()
            ptrs += [k_base + k_off, v_base + v_off]
            sizes += [k_page, v_page]
        return ptrs, sizes


def _is_mxfp8_device_pool(device_pool) -> bool:
    """SGLang picks the MXFP8 host pool for `MHATokenToKVPoolMXFP8` device pools; recognise that
    class by name anywhere in the MRO, or a pool whose `is_mxfp8` attribute is True (`is True`, so
    a mock's auto-created attribute does not count)."""
    if getattr(device_pool, "is_mxfp8", False) is True:
        return True
    return any(cls.__name__ == "MHATokenToKVPoolMXFP8" for cls in type(device_pool).__mro__)


def get_mha_host_pool_cls(device_pool) -> type:
    """The host pool class SGLang builds for an MHA device pool."""
    asymmetric = device_pool.head_dim != getattr(device_pool, "v_head_dim", device_pool.head_dim)
    if _is_mxfp8_device_pool(device_pool):
        if asymmetric:
            raise NotImplementedError(
                "MXFP8 HiCache does not support asymmetric K/V head dimensions yet."
            )
        raise NotImplementedError(
            "hostkv_rs does not implement the MXFP8 host pool (MHATokenToKVPoolMXFP8Host): its "
            "scale buffers are not mirrored"
        )
    if asymmetric:
        return AsymmetricMHATokenToKVPoolHost
    return MHATokenToKVPoolHost
