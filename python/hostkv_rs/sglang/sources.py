"""What SGLang hands a host pool to mirror: a device pool (0.5.18-0.5.22) or a buffer info
(0.5.23's `MHABufferInfo` / `MLABufferInfo`), what in either hostkv_rs does not serve, and which
release's semantics the pools follow where releases differ."""

from __future__ import annotations

import functools
import importlib.metadata
import re
import sys

import torch


def sglang_release() -> tuple[int, int, int] | None:
    """The SGLang release whose semantics the pools follow where releases differ: the one
    install() found, else the installed distribution's (a pool behaves the same before and after
    install()), else None (no SGLang: the newest release's behaviour, 0.5.23)."""
    from hostkv_rs import sglang as shim

    found = shim.release()
    parsed = _release_tuple(found.version) if found is not None else None
    return parsed if parsed is not None else _distribution_release()


class since:
    """A pool method SGLang added in `release`: on an older installed release it is absent (an
    AttributeError, so `hasattr` is False), as SGLang's own pool there has none. SGLang's
    storage backends ask for some by name and take another path without them."""

    def __init__(self, *release: int):
        self.release = release

    def __call__(self, func):
        self.func = func
        self.__doc__ = func.__doc__
        return self

    def __set_name__(self, owner, name: str) -> None:
        self.name = name

    def __get__(self, obj, owner=None):
        found = sglang_release()
        if found is not None and found < self.release:
            added = ".".join(map(str, self.release))
            raise AttributeError(
                f"{(owner or type(obj)).__name__!r} object has no attribute {self.name!r} "
                f"(SGLang {'.'.join(map(str, found))} has none; it came in {added})"
            )
        return self.func.__get__(obj, owner)


def hicache_device_kernels() -> bool:
    """Whether SGLang's platform has its HiCache device kernels (0.5.22+ asks before making the
    V4 write-back staging buffer): CUDA and ROCm. SGLang's own answer where it imports, else
    whether torch sees a GPU."""
    try:
        from sglang.srt.platforms import current_platform

        return bool(current_platform.capabilities.hicache_device_kernels)
    except (ImportError, AttributeError):
        return torch.cuda.is_available()


@functools.cache
def _distribution_release() -> tuple[int, int, int] | None:
    try:
        version = importlib.metadata.version("sglang")
    except (importlib.metadata.PackageNotFoundError, ValueError):
        return None
    return _release_tuple(version)


def _release_tuple(version) -> tuple[int, int, int] | None:
    numbers = re.findall(r"\d+", str(version))
    if len(numbers) < 3:
        return None  # a stand-in or unknown version: the newest release's behaviour
    major, minor, patch = (int(n) for n in numbers[:3])
    return major, minor, patch


def binds_on_transfer() -> bool:
    """SGLang <= 0.5.21 reads only the geometry of the device pool a host pool is built from; its
    transfers read the layers of the pool each call is given. 0.5.22 reads the layers at
    construction, and without SGLang so do ours."""
    release = sglang_release()
    return release is not None and release < (0, 5, 22)


def ignores_transfer_device_pool() -> bool:
    """SGLang 0.5.22+ moves the device layers it captured and ignores the device pool a transfer
    names; without SGLang ours read a pool other than the captured ones, as <= 0.5.21 does."""
    release = sglang_release()
    return release is not None and release >= (0, 5, 22)


def dcp_whole_pages_only() -> bool:
    """SGLang <= 0.5.19 asserts that a DCP transfer names whole widened pages; 0.5.20+ slices
    the rank's share of any run."""
    release = sglang_release()
    return release is not None and release < (0, 5, 20)


def refuses_dcp_l3_pages() -> bool:
    """SGLang <= 0.5.22 has no DCP-aware L3 flat pages (0.5.23 addresses the rank-local page)."""
    release = sglang_release()
    return release is not None and release < (0, 5, 23)


def is_buffer_info(obj) -> bool:
    """A 0.5.23 buffer info: `buffers` but none of a device pool's per-layer lists."""
    return (
        hasattr(obj, "buffers") and not hasattr(obj, "k_buffer") and not hasattr(obj, "kv_buffer")
    )


def is_allocation_only(obj) -> bool:
    """0.5.23 `MLAHostAllocation`: the geometry of an allocator-only (dummy) MLA pool."""
    return (
        hasattr(obj, "size_per_token")
        and hasattr(obj, "kv_cache_dim")
        and not hasattr(obj, "buffers")
        and not hasattr(obj, "kv_buffer")
    )


def device_source(device_pool, buffer_info):
    """The one device source a pool was given, by position or as `device_pool=` (<= 0.5.22) or
    `buffer_info=` (0.5.23)."""
    if device_pool is not None and buffer_info is not None:
        raise TypeError("pass either a device pool or a buffer info, not both")
    source = device_pool if device_pool is not None else buffer_info
    if source is None:
        raise TypeError(
            "device_pool must be a device pool (SGLang <= 0.5.22) or a buffer info (SGLang "
            "0.5.23), got None"
        )
    return source


def arg(args: tuple, kwargs: dict, position: int, name: str):
    """A constructor argument given by position or keyword (None when absent)."""
    if len(args) > position:
        return args[position]
    return kwargs.get(name)


def scale_layout_value(scales) -> str:
    layout = getattr(scales, "layout", None)
    return str(getattr(layout, "value", layout))


def is_mxfp8_scales(scales) -> bool:
    return scale_layout_value(scales) == "mxfp8_interleaved"


def is_mxfp8_device_pool(device_pool) -> bool:
    """SGLang picks the MXFP8 host pool for `MHATokenToKVPoolMXFP8` device pools; recognise that
    class by name anywhere in the MRO, or a pool whose `is_mxfp8` attribute is True (`is True`, so
    a mock's auto-created attribute does not count)."""
    if getattr(device_pool, "is_mxfp8", False) is True:
        return True
    return any(cls.__name__ == "MHATokenToKVPoolMXFP8" for cls in type(device_pool).__mro__)


def scales_reason(source) -> str | None:
    """Why a source carries bytes hostkv_rs does not mirror (KV scales), or None."""
    if is_buffer_info(source):
        scales = getattr(source, "scales", None)
        if scales is not None:
            return f"KV scales ({scale_layout_value(scales)} layout) are not mirrored"
        return None
    if is_mxfp8_device_pool(source):
        return "MXFP8 KV scales are not mirrored"
    if isinstance(getattr(source, "k_scale_buffer", None), (list, tuple)):
        return "KV scale buffers are not mirrored"
    return None


def device_type_reason(source) -> str | None:
    """Why a source lives where hostkv_rs does not copy (an NPU, a split Ascend buffer), or
    None."""
    if getattr(source, "transfer_buffers", None) is not None:
        return "relocatable (NPU) transfer buffers"
    buffers = getattr(source, "buffers", None) if is_buffer_info(source) else None
    split = buffers is not None and not isinstance(buffers, (tuple, list))
    if split and not hasattr(buffers, "k_data_ptrs"):
        return "split MLA buffers (Ascend page_first_kv_split)"
    device = getattr(source, "device", None)
    if device is None:
        return None
    try:
        kind = torch.device(device).type
    except (TypeError, RuntimeError):
        return None
    if kind not in ("cpu", "cuda", "meta"):
        return f"device type {kind!r}"
    return None


def sglang_io_backend() -> str | None:
    """The HiCache io backend the running SGLang server was started with (`--hicache-io-backend`,
    published in its runtime context), or None outside a server. Host pools are built before
    any transfer names its backend, so this is how a construction learns it."""
    context = sys.modules.get("sglang.srt.runtime_context")
    if context is None:
        return None
    try:
        return getattr(context.get_memory(), "hicache_io_backend", None)
    except Exception:  # noqa: BLE001 - nothing published (not a server, or a test)
        return None


def io_backend_reason() -> str | None:
    """kernel_ascend moves bytes with Ascend NPU kernels, which hostkv_rs does not have."""
    if sglang_io_backend() == "kernel_ascend":
        return "the kernel_ascend io backend (Ascend NPU) is not implemented by hostkv_rs"
    return None


def refuse_unserved(reason: str | None) -> None:
    if reason is not None:
        raise NotImplementedError(
            f"hostkv_rs does not serve this host pool: {reason}. With SGLang installed, "
            f"hostkv_rs.sglang.install() hands it to SGLang's own class."
        )


def page_unified_layout(ours):
    """SGLang's own `PageUnifiedLayout` (0.5.23+) with the fields of `ours` where SGLang is
    loaded: a frozen msgspec struct, which pickles, encodes and compares as SGLang's code
    expects. Ours (the same fields and methods) without SGLang."""
    if "sglang.srt" not in sys.modules:
        return ours
    try:
        from sglang.srt.mem_cache.pool_host.page_unified import PageUnifiedLayout
    except ImportError:
        return ours
    fields = ("page_size", "layer_num", "head_num", "head_group_num", "head_dim", "itemsize")
    return PageUnifiedLayout(**{name: getattr(ours, name) for name in fields}, is_mla=ours.is_mla)


def cat_tables(tables):
    """SGLang's packed pointer table: the given uint64 tables concatenated (None if any is
    missing, e.g. an NPU pool)."""
    tables = list(tables)
    if not tables or any(t is None for t in tables):
        return None
    return tables[0] if len(tables) == 1 else torch.cat(tables)
