"""What one stored page is: its byte format tag, its size, and the host memory behind it.

A page object in a store is the concatenation of the pool's own page buffers, in the order
`pool.get_page_buffer_meta()` lists them (one object per page, whatever the layout). That byte
order depends on the pool kind, layout, dtype and geometry, and a page belongs to one TP / PP / DCP
shard, so every store key carries a tag naming all of them: a pool of another layout or geometry
computes other keys and misses instead of loading bytes it would misread.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Bump when the meaning of a stored page changes (its byte order or the tag grammar).
FORMAT_VERSION = "hkv1"


@dataclass(frozen=True)
class PageFormat:
    """One page of one pool as a store sees it."""

    tag: str  # goes into every key
    page_bytes: int  # exact size of a stored page object
    buffers_per_page: int  # entries of get_page_buffer_meta per page (1: one contiguous buffer)
    slots_per_page: int  # host indices naming one page (the logical page under DCP)


def _dtype_name(dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _kind_and_geometry(pool) -> tuple[str, list[str], bool]:
    """(kind, geometry fields, sharded by TP). MLA latents and V4 rows are the same on every TP
    rank (SGLang shares them across ranks too); MHA heads are split across TP ranks."""
    if hasattr(pool, "item_bytes") and hasattr(pool, "pool_name"):
        name = str(pool.pool_name).replace(":", "_").replace("/", "_")
        return f"v4.{name}", [f"I{int(pool.item_bytes)}"], False
    if hasattr(pool, "kv_cache_dim"):
        return "mla", [f"C{int(pool.kv_cache_dim)}"], False
    if hasattr(pool, "head_num") and hasattr(pool, "head_dim"):
        head_dim = int(pool.head_dim)
        v_head_dim = int(getattr(pool, "v_head_dim", None) or head_dim)
        kind = "mha" if v_head_dim == head_dim else "mha.asym"
        return kind, [f"H{int(pool.head_num)}", f"D{head_dim}", f"V{v_head_dim}"], True
    raise TypeError(
        f"{type(pool).__name__} is not a host KV pool this tier knows (MHA, MLA or DeepSeek V4 "
        "paged); it cannot name its pages"
    )


def _owned_device_layers(pool) -> str | None:
    """Which device layers the host layers are, when not simply the first ones (CP layer
    sharding: each rank holds another slice of the model's layers)."""
    side = getattr(pool, "_device_side", None)
    owned = sorted(int(slot) for slot, _ in (getattr(side, "targets", None) or ()))
    if not owned or owned == list(range(len(owned))):
        return None
    if owned == list(range(owned[0], owned[-1] + 1)):
        return f"own{owned[0]}-{owned[-1]}"
    return "own" + ".".join(map(str, owned))


def page_format(
    pool,
    *,
    namespace: str = "",
    tp_rank: int = 0,
    tp_size: int = 1,
    pp_rank: int = 0,
    pp_size: int = 1,
) -> PageFormat:
    """The format of `pool`'s pages. Raises ValueError for a pool without bytes (a logical
    anchor, an allocator-only pool) and RuntimeError for a destroyed one."""
    if getattr(pool, "_destroyed", False):
        raise RuntimeError(f"{type(pool).__name__} has been destroyed; it has no pages")
    page_size = int(pool.page_size)
    dcp_size = int(getattr(pool, "dcp_size", 1) or 1)
    dcp_rank = int(getattr(pool, "dcp_rank", 0) or 0)
    slots_per_page = page_size * dcp_size
    if getattr(pool, "kv_buffer", None) is None:
        raise ValueError(
            f"{type(pool).__name__} holds no KV bytes (a logical anchor or an allocator-only "
            "pool); it has no pages to store"
        )
    kind, geometry, tp_sharded = _kind_and_geometry(pool)
    meta = pool.get_page_buffer_meta(torch.arange(slots_per_page, dtype=torch.int64))
    if meta is None:
        raise ValueError(f"{type(pool).__name__} has no page buffers; it has no pages to store")
    ptrs, sizes = meta
    if not ptrs or len(ptrs) != len(sizes) or any(int(s) <= 0 for s in sizes):
        raise ValueError(
            f"{type(pool).__name__}.get_page_buffer_meta returned {len(ptrs)} pointers and "
            f"{len(sizes)} sizes for one page"
        )
    layers = int(pool.layer_num)
    target = int(getattr(pool, "target_layer_num", layers) or layers)
    start = int(getattr(pool, "start_layer", 0) or 0)
    fields = [
        FORMAT_VERSION,
        kind,
        str(pool.layout),
        _dtype_name(pool.dtype),
        # layer count (+ packed MTP draft layers) and which model layers they are (PP / sharding)
        f"L{target}" + (f"+{layers - target}" if layers != target else "") + f"@{start}",
        f"P{page_size}",
        *geometry,
    ]
    owned = _owned_device_layers(pool)
    if owned is not None:
        fields.append(owned)
    if tp_sharded:
        fields.append(f"tp{int(tp_rank)}of{int(tp_size)}")
    fields.append(f"pp{int(pp_rank)}of{int(pp_size)}")
    if dcp_size != 1:
        fields.append(f"dcp{dcp_rank}of{dcp_size}")
    own_tag = getattr(pool, "storage_format_tag", None)
    if own_tag:
        fields.append(str(own_tag))
    tag = "-".join(fields)
    if namespace:
        tag = f"{namespace}/{tag}"
    return PageFormat(tag, sum(int(s) for s in sizes), len(ptrs), slots_per_page)


def host_buffers(pool) -> list[tuple[int, int]]:
    """(address, bytes) of every host allocation behind `pool`'s pages, each listed once: the
    Rust regions of a hostkv_rs pool, else the tensors a SGLang pool reports."""
    regions = list(getattr(pool, "_host_regions", None) or ())
    for name in ("_region", "_scale_region"):  # DeepSeek V4 paged pools
        region = getattr(pool, name, None)
        if region is not None:
            regions.append(region)
    spans = [(int(r.address), int(r.nbytes)) for r in regions]
    if not spans:
        get_buffers = getattr(pool, "get_hybrid_pool_buffer", None)
        tensors = get_buffers() if get_buffers is not None else [getattr(pool, "kv_buffer", None)]
        for t in tensors:
            if isinstance(t, torch.Tensor):
                spans.append((t.data_ptr(), t.numel() * t.element_size()))
    seen: set[int] = set()
    unique = []
    for address, nbytes in spans:
        if nbytes > 0 and address not in seen:
            seen.add(address)
            unique.append((address, nbytes))
    return unique
