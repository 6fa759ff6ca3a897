"""MHA host pools: `MHATokenToKVPoolHost` (K and V in one Rust region), the asymmetric K/V variant
(two regions) and SGLang's `get_mha_host_pool_cls` factory."""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence

import torch

from hostkv_rs import _core
from hostkv_rs.pools.args import (
    as_int,
    device_side_of,
    layer_tensors,
    pool_sequence,
    required,
)
from hostkv_rs.pools.device_side import (
    device_pool_extent,
    layers_device,
    owned_range,
    ptr_table,
)
from hostkv_rs.pools.planes import TokenPlanesPool
from hostkv_rs.pools.slots import index_list
from hostkv_rs.sglang import handover as _handover
from hostkv_rs.sglang.sources import (
    binds_on_transfer,
    cat_tables,
    device_type_reason,
    is_buffer_info,
    is_mxfp8_device_pool,
    is_mxfp8_scales,
    refuse_unserved,
    scale_layout_value,
    scales_reason,
    sglang_release,
    since,
)

logger = logging.getLogger(__name__)

# (io_backend -> layouts) SGLang serves for symmetric MHA; kernel_ascend needs an Ascend NPU.
_ASYM_FLAT_PAGE_TEXT = (
    "Models with head_dim != v_head_dim do not support the flat-page interface used by HiCache "
    "L3 storage backends {hf3fs, eic, nixl}. Use a backend that does not use this interface "
    "(e.g. mooncake, simm)."
)


class MHATokenToKVPoolHost(TokenPlanesPool):
    """Host mirror of SGLang's `MHATokenToKVPool`: `kv_buffer` is one `(2, ...)` tensor over one
    Rust `HostRegion`; the V half starts `L*S*H*D*e` bytes after the K half.

    Built from a device pool (SGLang 0.5.18-0.5.22: `MHATokenToKVPoolHost(device_pool, ratio,
    host_size, page_size, layout, ..., mtp_draft_device_pools=...)`) or from a buffer info
    (0.5.23: `MHATokenToKVPoolHost(buffer_info, ratio, host_size, page_size, layout, ...,
    device_capacity_tokens=, start_layer=, end_layer=, draft_buffer_infos=...)`). Either way
    the device layers are captured and checked once, here; transfers move them. Under an
    installed SGLang <= 0.5.21 a device pool without K/V layers gives only its geometry, as
    there: each transfer then reads the layers of the pool it names.

    Supported (io_backend, layout): kernel + layer_first/page_first/page_head/page_unified
    (page_unified from SGLang 0.5.23), direct + layer_first/page_first_direct. `kernel_ascend`
    needs an Ascend NPU and is refused: with page_first_direct as `Unsupported IO backend:
    kernel_ascend`, otherwise with SGLang's `Unsupported layout: {layout}`.

    MTP packing: with drafts, the host holds the target's layers followed by one layer per draft;
    a draft load is called with `is_draft=True` and `layer_id = target_layer_num + k`.
    """

    _device_plane_names = ("k_buffer", "v_buffer")

    def __init__(
        self,
        device_pool=None,
        host_to_device_ratio=None,
        host_size=None,
        page_size=None,
        layout=None,
        pin_memory: bool = True,
        device: str = "cpu",
        allocator_type: str = "default",
        *,
        mtp_draft_device_pools: Sequence = (),
        pool_label: str = "kv",
        buffer_info=None,
        device_capacity_tokens=None,
        start_layer=None,
        end_layer=None,
        draft_buffer_infos: Sequence = (),
        write_back_staging=None,
        head_group_num: int = 1,
        host_token_capacity=None,
    ):
        source = self._checked_source(
            device_pool, buffer_info, host_to_device_ratio, host_size, page_size, layout
        )
        mtp_draft_device_pools = pool_sequence("mtp_draft_device_pools", mtp_draft_device_pools)
        draft_buffer_infos = pool_sequence("draft_buffer_infos", draft_buffer_infos)
        if is_buffer_info(source):
            with device_side_of(type(self).__name__):
                side = self._from_buffer_info(source, draft_buffer_infos, pool_label)
            required(
                f"{type(self).__name__} from a buffer info",
                device_capacity_tokens=device_capacity_tokens,
                start_layer=start_layer,
                end_layer=end_layer,
            )
        else:
            with device_side_of(type(self).__name__):
                side = self._from_device_pool(source, mtp_draft_device_pools, pool_label)
                device_capacity_tokens, start_layer, end_layer = device_pool_extent(source)
        if self.v_head_dim != self._v_width():
            raise ValueError(
                f"{type(self).__name__} keeps V rows as wide as K rows, but the device pool has "
                f"head_dim={self.head_dim} and v_head_dim={self.v_head_dim}: build "
                "AsymmetricMHATokenToKVPoolHost for it (get_mha_host_pool_cls picks it)"
            )
        self.head_group_num = head_group_num
        self._transfer_device = layers_device(side)
        super().__init__(
            dtype=self.dtype,
            device_capacity_tokens=device_capacity_tokens,
            size_per_token=self.get_size_per_token(),
            start_layer=start_layer,
            end_layer=end_layer,
            host_to_device_ratio=host_to_device_ratio,
            host_size=host_size,
            page_size=page_size,
            layout=layout,
            pin_memory=pin_memory,
            device=device,
            allocator_type=allocator_type,
            pool_label=pool_label,
            host_token_capacity=host_token_capacity,
        )
        self.device_k_buffers, self.device_v_buffers = side["all_layers"]
        self.device_k_data_ptrs, self.device_v_data_ptrs = side["ptr_tables"]
        self._init_device_row_stride((*self.device_k_buffers, *self.device_v_buffers))
        self.element_dim = self.head_num * self.head_dim
        self.can_use_jit = False
        self._init_data_refs(transpose_direct=is_buffer_info(source))
        self._init_packed_device_tables()
        self._no_write_back_staging("staging_k_buffer", "staging_v_buffer")
        self._pool_core = self._new_host_pool()
        if side["planes"] is not None:
            self._bind_device_side(side)

    # ----------------------------------------------------------------- device side

    @classmethod
    def _source_reason(cls, source) -> str | None:
        # The MHA hand-back column is empty: SGLang's MHA pools refuse the Ascend-only
        # page_first_kv_split with the "Unsupported layout" ValueError ours raise. KV scales
        # are what they serve and ours do not.
        return scales_reason(source) or device_type_reason(source)

    def _from_device_pool(self, dp, drafts, pool_label: str) -> dict:
        """SGLang 0.5.18-0.5.22: geometry from the device pool, layers from it and its drafts
        (under SGLang <= 0.5.21 a pool without K/V layers gives only its geometry, and the layers
        come from the pool each transfer names, as there)."""
        for pool in (dp, *drafts):
            refuse_unserved(scales_reason(pool))
        self.device_pool = dp
        self.mtp_draft_device_pools = tuple(drafts)
        self._captured_pools = (dp, *self.mtp_draft_device_pools)
        self.dtype = dp.store_dtype
        self.head_dim = dp.head_dim
        self.v_head_dim = getattr(dp, "v_head_dim", None) or dp.head_dim
        row_dim = getattr(dp, "row_dim", None)
        # SGLang 0.5.21+: one allocator token may hold several attention rows.
        if row_dim is not None and self.head_dim == self.v_head_dim:
            self.head_num = row_dim // self.head_dim
        else:
            self.head_num = dp.head_num
        self.target_layer_num = dp.layer_num
        self.layer_num = self.target_layer_num + len(self.mtp_draft_device_pools)
        start, end = owned_range(dp)
        planes_given = all(hasattr(dp, name) for name in self._device_plane_names)
        if not self.mtp_draft_device_pools and not planes_given and binds_on_transfer():
            if not 0 <= start <= end <= self.target_layer_num:
                raise ValueError(
                    f"device pool owns layers [{start}, {end}) but claims layer_num={dp.layer_num}"
                )
            self._captured_pools = ()
            self._layer_map = _core.LayerMap(list(range(start, end)), self.target_layer_num)
            return {
                "planes": None,
                "device": torch.device(dp.device),
                "all_layers": ((), ()),
                "ptr_tables": (None, None),
            }
        k_all = layer_tensors("device pool k_buffer", dp.k_buffer)
        v_all = layer_tensors("device pool v_buffer", dp.v_buffer)
        if len(k_all) < end or len(v_all) < end:
            raise ValueError(
                f"device pool has {min(len(k_all), len(v_all))} K/V layers but claims "
                f"layer_num={dp.layer_num}"
            )
        k_drafts, v_drafts, draft_layer_count = [], [], 0
        for depth, draft in enumerate(self.mtp_draft_device_pools):
            k_layers = layer_tensors(f"draft[{depth}] k_buffer", draft.k_buffer)
            v_layers = k_layers and layer_tensors(f"draft[{depth}] v_buffer", draft.v_buffer)
            if not v_layers:
                raise ValueError(f"{pool_label}: packed draft[{depth}] has no layers")
            k_drafts.append(k_layers[0])
            v_drafts.append(v_layers[0])
            draft_layer_count += len(k_layers)
        self._packed_layer_count = self.target_layer_num + draft_layer_count
        return {
            "planes": [k_all[start:end] + k_drafts, v_all[start:end] + v_drafts],
            "owned": range(start, end),
            "device_layer_num": dp.layer_num,
            "all_layers": (tuple(k_all + k_drafts), tuple(v_all + v_drafts)),
            "ptr_tables": (
                cat_tables([getattr(p, "k_data_ptrs", None) for p in self._captured_pools]),
                cat_tables([getattr(p, "v_data_ptrs", None) for p in self._captured_pools]),
            ),
        }

    def _from_buffer_info(self, info, draft_infos, pool_label: str) -> dict:
        """SGLang 0.5.23: an `MHABufferInfo` (and one per packed draft), checked as SGLang does."""
        infos = (info, *draft_infos)
        for item in infos:
            scales = getattr(item, "scales", None)
            if scales is not None and is_mxfp8_scales(scales):
                # SGLang's plain pool would take these and drop the scales.
                refuse_unserved(
                    "MXFP8 KV scales are not mirrored (get_mha_host_pool_cls picks "
                    "SGLang's MHATokenToKVPoolMXFP8Host for them)"
                )
            if scales is not None:
                raise ValueError(
                    f"{pool_label}: MHA host transfers do not support "
                    f"KV scale layout {scale_layout_value(scales)!r}."
                )
            validate = getattr(item, "validate", None)
            if validate is not None:
                validate()
            if getattr(item, "transfer_buffers", None) is None and (
                item.buffers.k_data_ptrs is None or item.buffers.v_data_ptrs is None
            ):
                raise ValueError(f"{pool_label}: MHA host requires existing K/V pointer tables")
        target = (info.head_num, info.head_dim, info.v_head_dim, info.dtype, info.device)
        for depth, draft in enumerate(draft_infos):
            if len(draft.buffers.k) != 1:
                raise ValueError(
                    f"{pool_label}: packed draft[{depth}] has {len(draft.buffers.k)} layers; "
                    f"expected 1"
                )
            geometry = (draft.head_num, draft.head_dim, draft.v_head_dim, draft.dtype, draft.device)
            if geometry != target:
                raise ValueError(
                    f"{pool_label}: packed draft[{depth}] (heads, K width, V width, dtype, "
                    f"device)={geometry}, expected {target}"
                )
        self._buffer_infos = infos
        self.dtype = info.dtype
        self.head_dim = info.head_dim
        self.v_head_dim = info.v_head_dim
        self.head_num = info.head_num
        self.target_layer_num = len(info.buffers.k)
        self.layer_num = self.target_layer_num + len(draft_infos)
        k_all = [t for item in infos for t in item.buffers.k]
        v_all = [t for item in infos for t in item.buffers.v]
        return {
            "planes": [k_all, v_all],
            "owned": range(self.target_layer_num),
            "device_layer_num": self.target_layer_num,
            "all_layers": (tuple(k_all), tuple(v_all)),
            "ptr_tables": (
                cat_tables([item.buffers.k_data_ptrs for item in infos]),
                cat_tables([item.buffers.v_data_ptrs for item in infos]),
            ),
        }

    # ----------------------------------------------------------------- geometry

    def get_size_per_token(self):
        return (
            (self.head_dim + self.v_head_dim)
            * self.head_num
            * self.layer_num
            * (self.dtype.itemsize)
        )

    def get_ksize_per_token(self):
        return self.get_size_per_token() // 2

    _spec_kind = "mha"

    def _make_spec(self, size=None):
        """The pool's geometry in the core (validates the layout with SGLang's text)."""
        return _core.PoolSpec(
            self._spec_kind,
            self.layout,
            self.layer_num,
            self._spec_size() if size is None else size,
            self.page_size,
            [self.head_dim, self._v_width()],
            self.dtype.itemsize,
            head_num=self.head_num,
            head_group_num=getattr(self, "head_group_num", 1),
            release=sglang_release(),
        )

    _device_pool_geometry = (
        ("dtype", "store_dtype"),
        ("head_dim", "head_dim"),
        ("v_head_dim", "v_head_dim"),
    )

    def _v_width(self) -> int:
        """Elements per head of a V row: `head_dim` in this class, whose V rows are K's width
        (SGLang's reads no other, also where a pool built by hand sets `v_head_dim`)."""
        return self.head_dim

    def _device_rows_like(self) -> list:
        return [
            (self.dtype, (self.head_num, self.head_dim)),
            (self.dtype, (self.head_num, self._v_width())),
        ]

    def _init_data_refs(self, transpose_direct: bool):
        dim = self._spec.layer_view_dim(transpose_direct)
        if dim is None:
            # SGLang 0.5.23: no per-component per-layer view exists in the fused page block.
            self.k_data_refs, self.v_data_refs, self.host_kv_data_refs = [], [], []
            self.k_data_ptrs = self.v_data_ptrs = None
            return
        # Per-layer views without copying (`layer_view_dim` says which dim is the layer's).
        # Bounded so a pool with more layers than pages does not fail here.
        k_view, v_view = self.k_buffer.transpose(0, dim), self.v_buffer.transpose(0, dim)
        count = min(self.layer_num, k_view.shape[0])
        self.k_data_refs = [k_view[i] for i in range(count)]
        self.v_data_refs = [v_view[i] for i in range(count)]
        self.host_kv_data_refs = self.k_data_refs + self.v_data_refs
        self.k_data_ptrs = ptr_table(self.k_data_refs, self._transfer_device)
        self.v_data_ptrs = ptr_table(self.v_data_refs, self._transfer_device)

    def _init_packed_device_tables(self):
        """SGLang <= 0.5.21 names for the packed target + draft device layers (with MTP drafts in
        the device-pool form; absent otherwise)."""
        if not self.mtp_draft_device_pools:
            return
        self.packed_device_k_buffers = list(self.device_k_buffers)
        self.packed_device_v_buffers = list(self.device_v_buffers)
        self.packed_device_kv_buffers = self.packed_device_k_buffers + self.packed_device_v_buffers
        self.packed_device_k_data_ptrs = self.device_k_data_ptrs
        self.packed_device_v_data_ptrs = self.device_v_data_ptrs

    @property
    def k_buffer(self):
        return self._live_buffer()[0]

    @property
    def v_buffer(self):
        return self._live_buffer()[1]

    @since(0, 5, 21)
    def get_hybrid_pool_buffer(self):
        return [self.k_buffer, self.v_buffer]

    def get_split_heads_page_buffer_meta(self, indices, split_factor: int):
        """page_head only: per page and per group of H/split_factor heads, a [k, v] pair."""
        split_factor = as_int("split_factor", split_factor)
        self._require_bytes()
        return self._pool_core.split_heads_meta(index_list(indices), split_factor)


class AsymmetricMHATokenToKVPoolHost(MHATokenToKVPoolHost):
    """MHA with `head_dim != v_head_dim` (MiMo-V2): K and V live in two Rust regions with their own
    item sizes. `token_stride_size` and `layout_dim` are deliberately absent (AttributeError), as
    in SGLang, so code assuming one shared K/V stride fails loudly. Layouts: page_first (kernel)
    and page_first_direct (direct)."""

    def get_ksize_per_token(self):
        return self.head_dim * self.head_num * self.layer_num * self.dtype.itemsize

    _spec_kind = "mha_asymmetric"

    def _v_width(self) -> int:
        return self.v_head_dim

    def get_hybrid_pool_buffer(self):
        # In every release, where SGLang's has it only from 0.5.21: before, its storage
        # backends find no such method and hand the (K, V) tuple kv_buffer on as one tensor
        # (Mooncake's registration then fails on it).
        return [self.k_buffer, self.v_buffer]

    def init_kv_buffer(self):
        # K and V in two allocations, each with its own item size (and registration unit).
        self._spec = self._make_spec()
        return self._allocate(self._spec)

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


def _sglang_mxfp8_host_cls():
    """SGLang's own MXFP8 host pool class (0.5.21+), or None without SGLang. An MXFP8 device pool
    or buffer info comes from a loaded SGLang, so nothing is imported when none is."""
    if "sglang.srt" not in sys.modules:
        return None
    try:
        from sglang.srt.mem_cache.pool_host.mha_mxfp8 import MHATokenToKVPoolMXFP8Host
    except ImportError:
        return None
    return MHATokenToKVPoolMXFP8Host


def get_mha_host_pool_cls(device_pool=None, *, buffer_info=None) -> type:
    """The host pool class SGLang builds for an MHA device pool (<= 0.5.22) or an
    `MHABufferInfo` (0.5.23, whose parameter is named `buffer_info`; either name takes either):
    asymmetric when `head_dim != v_head_dim`, SGLang's own MXFP8 host pool for MXFP8 scales
    (hostkv_rs does not mirror scales; one log line says so) from 0.5.21, which brought it."""
    if (device_pool is None) == (buffer_info is None):
        given = "both" if device_pool is not None else "neither"
        raise TypeError(
            "get_mha_host_pool_cls() takes one device pool or buffer info (device_pool or "
            f"buffer_info), got {given}"
        )
    device_pool = buffer_info if device_pool is None else device_pool
    asymmetric = device_pool.head_dim != getattr(device_pool, "v_head_dim", device_pool.head_dim)
    if is_buffer_info(device_pool):
        scales = getattr(device_pool, "scales", None)
        mxfp8 = scales is not None and is_mxfp8_scales(scales)
    else:
        mxfp8 = is_mxfp8_device_pool(device_pool)
    release = sglang_release()
    if mxfp8 and release is not None and release < (0, 5, 21):
        # No MXFP8 host pool before 0.5.21: SGLang picks by K/V widths alone there, and the
        # pool it builds mirrors K and V without their scales (install() hands it that pool).
        mxfp8 = False
    if mxfp8:
        if asymmetric:
            raise NotImplementedError(
                "MXFP8 HiCache does not support asymmetric K/V head dimensions yet."
            )
        original = _sglang_mxfp8_host_cls()
        if original is None:
            raise NotImplementedError(
                "hostkv_rs does not implement the MXFP8 host pool (MHATokenToKVPoolMXFP8Host): its "
                "scale buffers are not mirrored, and SGLang's own class is not installed"
            )
        _handover.log_handover(
            "an MXFP8 MHA host pool", original, "MXFP8 KV scales are not mirrored"
        )
        return original
    if asymmetric:
        return AsymmetricMHATokenToKVPoolHost
    return MHATokenToKVPoolHost
