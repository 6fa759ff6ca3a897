"""`TokenPlanesPool`: what the MHA and MLA host pools share. Their bytes are the core's token
planes (`_core.HostPool` over one `_core.PoolSpec`), so L3 flat pages, page metadata, the
(layout, io_backend) check and the stride question are the same calls for both; only the
constructor forms and the geometry attributes SGLang names differ."""

from __future__ import annotations

import torch

from hostkv_rs import _core
from hostkv_rs.pools import memory as _memory
from hostkv_rs.pools.args import as_int, positive_int, required, truth
from hostkv_rs.pools.base import HostKVCache
from hostkv_rs.pools.slots import index_list
from hostkv_rs.sglang.sources import (
    device_source,
    device_type_reason,
    page_unified_layout,
    refuse_unserved,
)


class _HandSetAttribute:
    """A pool's spec (`_spec`) or core (`_pool_core`) where the pool has none of its own: an
    allocation-only pool's spec, and both for a pool built without its constructor (as SGLang's
    unit tests build them, with `__new__` and attributes set by hand), derived from its
    attributes at each read so that a `kv_buffer` set again is the one read. A non-data
    descriptor: a constructed pool's own value is read without it."""

    def __init__(self, core: bool):
        self.core = core

    def __set_name__(self, owner, name: str) -> None:
        self.name = name

    def __get__(self, pool, owner=None):
        if pool is None:
            return self
        spec, allocations = pool._hand_set_geometry()
        if not self.core:
            return spec
        if allocations is None:
            raise AttributeError(f"{type(pool).__name__!r} object has no attribute {self.name!r}")
        return _core.HostPool(spec, allocations)


class TokenPlanesPool(HostKVCache):
    """A KV host pool whose bytes are token planes in the core (MHA, asymmetric MHA, MLA)."""

    def _checked_source(self, device_pool, buffer_info, ratio, host_size, page_size, layout):
        """The device pool or buffer info the pool is built from, once SGLang's required
        arguments are present and hostkv_rs serves the layout and the device type."""
        source = device_source(device_pool, buffer_info)
        required(
            type(self).__name__,
            host_to_device_ratio=ratio,
            host_size=host_size,
            page_size=page_size,
        )
        if not isinstance(layout, str):
            _core.check_layout(self._spec_kind, layout)  # SGLang's text, showing it (None, 5)
        refuse_unserved(self._layout_reason(layout) or device_type_reason(source))
        return source

    def _make_spec(self, size=None):
        """The pool's geometry in the core for `size` tokens (default: the pool's)."""
        raise NotImplementedError()

    def _spec_size(self) -> int:
        """`size`, or for a pool built by hand without it (SGLang's page methods never read
        it) the tokens its `kv_buffer` holds: `page_num` whole pages, else the buffer's
        elements over one page's of the same geometry."""
        size = self.__dict__.get("size")
        if size is not None:
            return size
        page_num = self.__dict__.get("page_num")
        if page_num is not None:
            return page_num * self.page_size
        buffer = self.__dict__.get("kv_buffer")
        if buffer is None:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute 'size'")
        first = buffer[0] if isinstance(buffer, tuple) and buffer else buffer
        one_page = torch.Size(self._make_spec(self.page_size).allocation_shapes[0]).numel()
        numel = first.numel() if isinstance(first, torch.Tensor) else 0
        return self.page_size * (numel // one_page) if one_page else 0

    def _hand_set_geometry(self):
        """(spec, allocations or None) of a pool without a spec of its own, from its attributes
        as they are now: SGLang's geometry attributes and `kv_buffer`, whose tensors must be
        what that geometry allocates (page views and the core read them in that shape)."""
        spec = self._make_spec()
        buffer = self.__dict__.get("kv_buffer")
        if buffer is None:
            return spec, None
        shapes = [tuple(shape) for shape in spec.allocation_shapes]
        allocations = list(buffer) if len(shapes) > 1 and isinstance(buffer, tuple) else [buffer]
        got = [
            (tuple(t.shape), t.dtype, t.is_contiguous())
            if isinstance(t, torch.Tensor)
            else type(t).__name__
            for t in allocations
        ]
        expected = [(shape, self.dtype, True) for shape in shapes]
        if got != expected:
            raise ValueError(
                f"{type(self).__name__}.kv_buffer holds (shape, dtype, contiguous) {got}; its "
                f"attributes describe {expected}"
            )
        return spec, allocations

    # Looked up only where the instance has none: a class-level `__getattr__` would slow every
    # attribute read of every pool.
    _spec = _HandSetAttribute(core=False)
    _pool_core = _HandSetAttribute(core=True)

    def init_kv_buffer(self):
        self._spec = spec = self._make_spec()
        self.token_stride_size = spec.item_bytes[0]
        self.layout_dim = self.token_stride_size * self.layer_num
        if spec.page_unified_layout is not None:
            self.page_unified_layout = page_unified_layout(spec.page_unified_layout)
        return self._allocate(spec)

    def is_stride_page_aligned(self, page_size_bytes: int = 4096) -> bool:
        # A pool without bytes has no page to align (and one built by hand may not have the
        # geometry a spec needs); nor has a layout without page strides, SGLang's answer there
        # given without reading the argument.
        if getattr(self, "kv_buffer", None) is None or not self._spec.page_strided:
            return False
        page_size_bytes = positive_int("page_size_bytes", page_size_bytes)
        return self._pool_core.is_stride_page_aligned(page_size_bytes)

    def _check_io(self, io_backend):
        self._spec.check_pair(io_backend)

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

    def _check_l3_pages(self) -> None:
        """Refuse L3 page access where the release does (MLA with DCP under SGLang <= 0.5.22)."""

    def get_data_page(self, index, flat: bool = True) -> torch.Tensor:
        self._check_l3_pages()
        self._require_bytes()
        data_page = self._page_view(index)
        return data_page.flatten() if truth("flat", flat) else data_page

    def get_dummy_flat_data_page(self) -> torch.Tensor:
        return torch.zeros(
            self._spec.dummy_page_shape,  # an allocator-only (dummy) pool's too
            dtype=self.dtype,
            device=self.device,
            pin_memory=_memory.pin_dummy_pages(self.pin_memory),
        ).flatten()

    def set_from_flat_data_page(self, index: int, data_page: torch.Tensor) -> None:
        """Store one flat page, read with this layout's own element order (see §4.4)."""
        self._check_l3_pages()
        self._require_bytes()
        geometry = self._page_geometry(index)  # the layout's refusal comes first, as SGLang's
        index = as_int("index", index)
        self._write_page(geometry, self._flat_page_as(data_page, geometry[1]))
        self._pool_core.forget_flat_page(index)  # HOSTKV_PAGE_DIGEST: written by other means

    def get_page_buffer_meta(self, indices):
        """(pointers, sizes) per page: layer_first gives one entry per layer (MHA: k, v) of each
        page; the page layouts one entry (MHA: a [k, v] pair) covering every layer. With DCP
        (MLA), `indices` are logical (widened) slots and each logical page maps to this rank's
        one physical page (SGLang 0.5.23)."""
        self._require_bytes()
        return self._pool_core.page_meta(index_list(indices))
