"""`MLATokenToKVPoolHost`: the host mirror of SGLang's `MLATokenToKVPool` (one latent plane of
`kv_cache_dim` elements per token and layer, in one Rust region)."""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from hostkv_rs import _core
from hostkv_rs.pools.args import (
    as_int,
    device_side_of,
    layer_tensors,
    pool_sequence,
    positive_int,
    required,
    truth,
)
from hostkv_rs.pools.device_side import (
    device_pool_extent,
    layer_key,
    layers_device,
    owned_range,
    ptr_table,
    sharded_host_layer_num,
)
from hostkv_rs.pools.hisparse import HiSparseHostPoolMixin
from hostkv_rs.pools.planes import TokenPlanesPool
from hostkv_rs.sglang.sources import (
    binds_on_transfer,
    cat_tables,
    is_allocation_only,
    is_buffer_info,
    refuses_dcp_l3_pages,
    sglang_release,
)

logger = logging.getLogger(__name__)


class MLATokenToKVPoolHost(HiSparseHostPoolMixin, TokenPlanesPool):
    """Supported (io_backend, layout): kernel + layer_first/page_first/page_unified (page_unified
    from SGLang 0.5.23), direct + layer_first/page_first_direct. `kernel_ascend` serves only the
    Ascend `page_first_kv_split` layout, which this package does not build, so it is refused
    with SGLang's `Unsupported layout: {layout}`.

    `is_dummy=True` sizes the pool from the device pool's geometry alone and runs the slot
    allocator without allocating any bytes (`kv_buffer = data_refs = data_ptrs = None`);
    transfers on it fail SGLang's asserts (a load of a layer this rank does not hold returns
    first, as 0.5.20-0.5.22 do).

    MTP packing: with `mtp_draft_device_pools` the host holds the target's layers followed by one
    layer per draft pool; backups read the packed device layer lists, and a draft load comes with
    `is_draft=True`, `layer_id = target_layer_num + k` and the draft device pool. DCP: slots are
    logical (widened) and transfers translate them to this rank's physical slots; an L3 flat
    page is the rank-local page (0.5.23), refused with SGLang's "not yet DCP-aware" assertion
    under an installed SGLang <= 0.5.22.
    """

    _device_plane_names = ("kv_buffer",)
    _spec_kind = "mla"
    # load/backup pass both index tensors through maybe_dcp_kernel_indices (SGLang §3.4).
    dcp_aware_transfers = True
    _layer_shard_enabled = False
    _is_dummy = False  # a pool built without its constructor holds whatever bytes it was given
    # SGLang 0.5.23's allocation-only pool takes its bytes per token from the allocation, which
    # may count more than the latent rows; None: the latent rows' own.
    _size_per_token = None

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
        override_kv_cache_dim: int | None = None,
        mtp_draft_device_pools: Sequence = (),
        dcp_size: int = 1,
        dcp_rank: int = 0,
        *,
        pool_label: str = "kv",
        is_dummy: bool = False,
        buffer_info=None,
        draft_buffer_infos: Sequence = (),
        device_capacity_tokens=None,
        start_layer=None,
        end_layer=None,
        target_layer_num=None,
        layer_shard_enabled: bool = False,
        host_token_capacity=None,
    ):
        source = self._checked_source(
            device_pool, buffer_info, host_to_device_ratio, host_size, page_size, layout
        )
        mtp_draft_device_pools = pool_sequence("mtp_draft_device_pools", mtp_draft_device_pools)
        draft_buffer_infos = pool_sequence("draft_buffer_infos", draft_buffer_infos)
        if override_kv_cache_dim is not None:
            # SGLang reads it as `override or default`: 0 keeps the default width.
            override_kv_cache_dim = as_int("override_kv_cache_dim", override_kv_cache_dim)
            if override_kv_cache_dim < 0:
                raise ValueError(
                    f"override_kv_cache_dim must be a width in elements, not negative (0 or "
                    f"None: the device pool's), got {override_kv_cache_dim}"
                )
        self.override_kv_cache_dim = override_kv_cache_dim
        self.layout = layout
        if is_buffer_info(source) or is_allocation_only(source):
            # 0.5.23: the draft infos may also come by position (where <= 0.5.22 had the pools).
            drafts = tuple(draft_buffer_infos) or tuple(mtp_draft_device_pools)
            required(
                f"{type(self).__name__} from a buffer info",
                device_capacity_tokens=device_capacity_tokens,
                start_layer=start_layer,
                end_layer=end_layer,
                target_layer_num=target_layer_num,
            )
            with device_side_of(type(self).__name__):
                side = self._from_buffer_info(source, drafts, target_layer_num, layer_shard_enabled)
            is_dummy = is_allocation_only(source)
        else:
            is_dummy = truth("is_dummy", is_dummy)
            with device_side_of(type(self).__name__):
                side = self._from_device_pool(source, mtp_draft_device_pools, is_dummy)
                device_capacity_tokens, start_layer, end_layer = device_pool_extent(source)
            if is_dummy and not device_capacity_tokens:
                # SGLang's dummy init reads `host_capacity_tokens or size`.
                device_capacity_tokens = source.size
        self._is_dummy = truth("is_dummy", is_dummy)
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
            dcp_size=dcp_size,
            dcp_rank=dcp_rank,
            pool_label=pool_label,
            is_dummy=self._is_dummy,
            host_token_capacity=host_token_capacity,
        )
        self.can_use_jit = False
        self._no_write_back_staging("staging_buffer")
        if self._is_dummy:
            self._init_dummy()
            return
        self.device_kv_buffers = side["all_layers"]
        self.device_data_ptrs = side["ptr_table"]
        self._init_device_row_stride(self.device_kv_buffers)
        # Per-layer views (page_first_direct / page_unified: dim 0 is the page, so these are
        # page slabs, as in SGLang).
        view = self.kv_buffer.transpose(0, self._spec.layer_view_dim(False))
        count = min(self.layer_num, view.shape[0])
        self.data_refs = [view[i] for i in range(count)]
        self.data_ptrs = ptr_table(self.data_refs, self._transfer_device)
        if self.mtp_draft_device_pools:
            # SGLang <= 0.5.21 names for the packed target + draft device layers.
            self.packed_device_kv_buffers = list(self.device_kv_buffers)
            self.packed_device_data_ptrs = self.device_data_ptrs
        self._pool_core = self._new_host_pool()
        if side["planes"] is not None:
            self._bind_device_side(side)

    def _from_device_pool(self, dp, drafts, dummy: bool) -> dict:
        """SGLang 0.5.18-0.5.22: geometry from the device pool; under CP layer sharding the host
        holds ceil(L / shard) target layers, the owned ones first. The device layers are read
        only where the release reads them: never for an allocator-only pool, and not before a
        transfer for a pool without `kv_buffer` under SGLang <= 0.5.21 (`binds_on_transfer`)."""
        self.device_pool = dp
        self.mtp_draft_device_pools = tuple(drafts)
        self._captured_pools = (dp, *self.mtp_draft_device_pools)
        self.dtype = dp.store_dtype
        self.kv_lora_rank = dp.kv_lora_rank
        self.qk_rope_head_dim = dp.qk_rope_head_dim
        # Read by L3 stores (FP8 DSA packs K/V into one device buffer); kept for parity.
        self.dsa_kv_cache_store_fp8 = getattr(dp, "dsa_kv_cache_store_fp8", False)
        self.kv_cache_dim = self.override_kv_cache_dim or (
            self.kv_lora_rank + self.qk_rope_head_dim
        )
        self._layer_shard_enabled = bool(getattr(dp, "layer_shard_enabled", False))
        if self._layer_shard_enabled:
            # The host holds ceil(layer_num / shard) layers: a shard of 0 layers divides by zero.
            positive_int("device pool layer_shard_size", dp.layer_shard_size)
        self.target_layer_num = sharded_host_layer_num(dp)
        self.layer_num = self.target_layer_num + len(self.mtp_draft_device_pools)
        if dummy:
            self._captured_pools = ()
            return {}
        start, end = owned_range(dp)
        if not self.mtp_draft_device_pools and not hasattr(dp, "kv_buffer") and binds_on_transfer():
            return self._geometry_only_side(dp, start, end)
        layers = layer_tensors("device pool kv_buffer", dp.kv_buffer)
        if not 0 <= start <= end <= len(layers) or end - start > self.target_layer_num:
            raise ValueError(
                f"device pool has {len(layers)} layers but owns layers [{start}, {end}) (the "
                f"host holds {self.target_layer_num})"
            )
        draft_layers, draft_layer_count = [], 0
        for depth, draft in enumerate(self.mtp_draft_device_pools):
            layers_of_draft = layer_tensors(f"draft[{depth}] kv_buffer", draft.kv_buffer)
            if not layers_of_draft:
                raise ValueError(f"MLA packed draft[{depth}] has no layers")
            draft_layers.append(layers_of_draft[0])
            draft_layer_count += len(layers_of_draft)
        self._packed_layer_count = self.target_layer_num + draft_layer_count
        return {
            "planes": [layers[start:end] + draft_layers],
            "owned": range(start, end),
            "device_layer_num": dp.layer_num,
            "all_layers": tuple(layers + draft_layers),
            "ptr_table": cat_tables(getattr(p, "data_ptrs", None) for p in self._captured_pools),
        }

    def _geometry_only_side(self, dp, start: int, end: int) -> dict:
        """The device side of a pool built from geometry alone (SGLang <= 0.5.21 reads the
        device layers only when a transfer names a pool): nothing is captured."""
        if not 0 <= start <= end or end - start > self.target_layer_num:
            raise ValueError(
                f"device pool owns layers [{start}, {end}) but the host holds "
                f"{self.target_layer_num}"
            )
        self._captured_pools = ()
        self._layer_map = _core.LayerMap(list(range(start, end)), self.target_layer_num)
        return {
            "planes": None,
            "device": torch.device(dp.device),
            "all_layers": (),
            "ptr_table": None,
        }

    def _from_buffer_info(self, info, drafts, target_layer_num, layer_shard_enabled) -> dict:
        """SGLang 0.5.23: an `MLABufferInfo` holding the owned layers (or an `MLAHostAllocation`
        for an allocator-only pool), checked as SGLang does."""
        dummy = is_allocation_only(info)
        self.dtype = info.dtype
        self.kv_lora_rank = info.kv_lora_rank
        self.qk_rope_head_dim = info.qk_rope_head_dim
        self.kv_cache_dim = self.override_kv_cache_dim or (
            info.kv_cache_dim if dummy else self.kv_lora_rank + self.qk_rope_head_dim
        )
        self.dsa_kv_cache_store_fp8 = info.packed_fp8
        self.target_layer_num = as_int("target_layer_num", target_layer_num)
        self._layer_shard_enabled = truth("layer_shard_enabled", layer_shard_enabled)
        if dummy:
            if drafts:
                raise ValueError("Allocator-only MLA does not accept physical draft buffers")
            self.layer_num = self.target_layer_num + int(getattr(info, "draft_layer_num", 0))
            self._size_per_token = as_int("size_per_token", info.size_per_token)
            return {}
        self.layer_num = self.target_layer_num + len(drafts)
        infos = (info, *drafts)
        for index, item in enumerate(infos):
            validate = getattr(item, "validate", None)
            if validate is not None:
                validate()
            if getattr(item, "scales", None) is not None:
                role = "target" if index == 0 else f"draft[{index - 1}]"
                raise ValueError(
                    f"MLA host cache does not support {role} FP4 KV: "
                    "packed payload and separate block scales cannot be restored"
                )
            if index and (item.kv_cache_dim, item.dtype) != (info.kv_cache_dim, info.dtype):
                raise ValueError(
                    f"packed draft KV row {(item.kv_cache_dim, item.dtype)} differs "
                    f"from target KV row {(info.kv_cache_dim, info.dtype)}"
                )
            if index and len(item.layer_indices) != 1:
                raise ValueError(
                    f"MLA packed draft[{index - 1}] must contain one layer, got "
                    f"{item.layer_indices}"
                )
        self._buffer_infos = infos
        layers = [t for item in infos for t in item.buffers]
        return {
            "planes": [layers],
            "owned": tuple(info.layer_indices),
            "device_layer_num": int(info.device_layer_num),
            "all_layers": tuple(layers),
            "ptr_table": cat_tables(item.data_ptrs for item in infos),
        }

    def _init_dummy(self) -> None:
        """The rest of an allocator-only pool (one TP rank keeps the MLA bytes, the others only
        the slots). It owns no bytes, so DCP is only its slot arithmetic: slots are handed out in
        the widened (logical) space, `size`/`page_size` stay per-rank physical."""
        self.token_stride_size = self.kv_cache_dim * self.dtype.itemsize
        self.layout_dim = self.token_stride_size * self.layer_num
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

    # ----------------------------------------------------------------- geometry

    def get_size_per_token(self):
        if self._size_per_token is not None:
            return self._size_per_token
        return self.kv_cache_dim * self.dtype.itemsize * self.layer_num

    def get_ksize_per_token(self):
        return self.get_size_per_token()

    def _make_spec(self, size=None):
        """The pool's geometry in the core (validates the layout with SGLang's text)."""
        return _core.PoolSpec(
            "mla",
            self.layout,
            self.layer_num,
            self._spec_size() if size is None else size,
            self.page_size,
            [self._row_width()],
            self.dtype.itemsize,
            dcp_size=self.dcp_size,
            dcp_rank=self.dcp_rank,
            release=sglang_release(),
        )

    def get_contiguous_buf_infos(self):
        """(per-layer host pointers, `kv_buffer[l].nbytes`, `token_stride_size * page_size`) for
        registering the host pool with a disaggregation transfer engine, as SGLang reports them
        (for the page layouts its per-layer entries are SGLang's: a strided layer view, a page
        slab)."""
        if self._is_dummy:
            return [], [], []
        self._require_bytes()
        return self._pool_core.contiguous_buf_infos()

    # No get_hybrid_pool_buffer: SGLang's MLA pool has none, and its storage backends ask for
    # it (`hasattr`/`getattr`) to tell sidecar pools from KV pools (NIXL's zero-copy choice).

    # ----------------------------------------------------------------- transfers

    _device_pool_geometry = (("dtype", "store_dtype"), ("kv_cache_dim", "kv_cache_dim"))

    def _row_width(self) -> int:
        """`kv_cache_dim`; a pool built by hand may set only `kv_lora_rank` and
        `qk_rope_head_dim`, or neither (SGLang's page methods read only `kv_buffer`, whose last
        dimension is the row in every layout)."""
        width = self.__dict__.get("kv_cache_dim")
        if width is not None:
            return width
        if hasattr(self, "kv_lora_rank") and hasattr(self, "qk_rope_head_dim"):
            return self.kv_lora_rank + self.qk_rope_head_dim
        buffer = self.__dict__.get("kv_buffer")
        if isinstance(buffer, torch.Tensor) and buffer.dim():
            return buffer.shape[-1]
        raise AttributeError(f"{type(self).__name__!r} object has no attribute 'kv_cache_dim'")

    def _device_rows_like(self) -> list:
        return [(self.dtype, (1, self._row_width()))]

    def load_to_device_per_layer(
        self, device_pool, host_indices, device_indices, layer_id, io_backend, *, is_draft=False
    ):
        """Host layer of controller layer `layer_id` -> that device layer; a target layer this
        rank does not hold (layer sharding, or out of range) returns without copying."""
        if self._is_dummy:
            # Built from a device pool (SGLang 0.5.20-0.5.22), a target layer this rank does not
            # hold returns before the dummy check; 0.5.23's allocation-only pool checks first.
            if (
                self.device_pool is not None
                and not truth("is_draft", is_draft)
                and not self._is_device_layer_owned(device_pool, layer_key(layer_id))
            ):
                return
            raise AssertionError("load on a dummy (non-src MLA) host pool")
        self._load_planes(device_pool, host_indices, device_indices, layer_id, io_backend, is_draft)

    def backup_from_device_all_layer(self, device_pool, host_indices, device_indices, io_backend):
        if self._is_dummy:
            raise AssertionError("backup on a dummy (non-src MLA) host pool")
        if self._layer_shard_enabled:
            # SGLang copies one owned layer at a time, through fewer (layout, backend) pairs.
            self._dcp_runs_first(host_indices, device_indices)
            self._spec.check_pair(io_backend, "sharded_backup")
        self._backup_planes(device_pool, host_indices, device_indices, io_backend)

    # ----------------------------------------------------------------- L3 flat pages

    def _check_l3_pages(self) -> None:
        # SGLang <= 0.5.22 asserts in get_data_page only; its set_from_flat_data_page stores the
        # page at physical row `index`, a logical slot (another rank's rows, or past the pool).
        # Refusing both keeps the pair consistent; those releases reject L3 with DCP at start.
        if self.dcp_size > 1 and refuses_dcp_l3_pages():
            raise AssertionError(_DCP_L3_TEXT)


# SGLang <= 0.5.22's assertion in get_data_page (0.5.23 addresses the rank-local page).
_DCP_L3_TEXT = (
    "HiCache L3 storage paths are not yet DCP-aware (per-rank shards need dcp_rank-scoped keys); "
    "--hicache-storage-backend with --dcp-size > 1 should have been rejected at server start."
)
