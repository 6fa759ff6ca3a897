"""What one stored page is: its byte format tag, its size, and the host memory behind it.

A page object in a store is a 64-byte proof header (`hostkv_rs.l3.proof`) followed by the
concatenation of the pool's own page buffers, in the order `pool.get_page_buffer_meta()` lists
them (one object per page, whatever the layout). That byte order and the bytes' meaning depend on
the pool kind, layout, dtype (the dtype the bytes encode, not the one they are stored as: fp8 is
stored as uint8), geometry and page size, and a page belongs to one TP / PP / DCP shard and one
model, so every store key carries a tag naming all of them: a pool of another layout, geometry or
model computes other keys and misses instead of loading bytes it would misread. The header then
proves, on every load, that the object is what this tag's writer stored.
"""

from __future__ import annotations

import importlib
import logging
import sys
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)

# Bump when the meaning of a stored page changes (its byte order, the header or the tag grammar).
FORMAT_VERSION = "hkv3"
NO_MODEL = "mnone"  # the tag's model field when no model identity is known


@dataclass(frozen=True)
class PageFormat:
    """One page of one pool as a store sees it."""

    tag: str  # goes into every key
    page_bytes: int  # bytes of one page in the pool
    buffers_per_page: int  # entries of get_page_buffer_meta per page (1: one contiguous buffer)
    slots_per_page: int  # host indices naming one page (the logical page under DCP)
    object_bytes: int = 0  # exact size of a stored page object (page + proof header)
    identity: str = ""  # what the header's identity digest is of: model identity and tag
    model_id: str | None = None  # the model identity the tag and header carry, when known
    dtype_known: bool = True  # False: bytes of an unnamed dtype (uint8 storage, no device dtype)
    tp_known: bool = True  # False: a TP-sharded pool's pages whose TP rank nobody named


def _dtype_name(dtype) -> str:
    return str(dtype).removeprefix("torch.")


def sglang_server_args():
    """The running SGLang server's ServerArgs when SGLang is already imported in this process
    and has published them (0.5.23 `runtime_context.get_server_args`, older
    `server_args.get_global_server_args`), else None. Never imports SGLang itself: a process
    that is not an SGLang server has no server args to find."""
    if "sglang" not in sys.modules:
        return None
    for module, getter in (
        ("sglang.srt.runtime_context", "get_server_args"),
        ("sglang.srt.server_args", "get_global_server_args"),
    ):
        try:
            args = getattr(importlib.import_module(module), getter)()
        except (ImportError, AttributeError, LookupError, RuntimeError, ValueError) as exc:
            # not published yet, a retired accessor, another SGLang release
            logger.debug("no SGLang server args from %s.%s(): %s", module, getter, exc)
            continue
        if args is not None:
            return args
    return None


def sglang_model_identity() -> str | None:
    """The weights an SGLang server runs, as the L3 model identity: its model path, plus the
    revision and on-the-fly weight quantization when set (both change the KV values)."""
    args = sglang_server_args()
    path = getattr(args, "model_path", None) if args is not None else None
    if not path or str(path).lower() in ("none", "dummy"):
        return None
    identity = str(path)
    revision = getattr(args, "revision", None)
    if revision:
        identity += f"@{revision}"
    quantization = getattr(args, "quantization", None)
    if quantization:
        identity += f"+{quantization}"
    return identity


# SGLang's --kv-cache-dtype spellings, as torch dtype names ("auto": the model's dtype).
_SGLANG_KV_DTYPES = {
    "fp8_e4m3": "float8_e4m3fn",
    "fp8_e5m2": "float8_e5m2",
    "bf16": "bfloat16",
    "fp16": "float16",
}


def _kv_dtype(pool, kv_dtype) -> tuple[str, bool]:
    """(name of the dtype the pool's bytes encode, whether that is known). `kv_dtype` names it
    where the pool cannot say; one that contradicts what the pool says is refused (a bf16 pool
    tagged float16 would load a float16 pool's pages as hits)."""
    own, known = _pool_kv_dtype(pool)
    given = _dtype_name(kv_dtype) if kv_dtype is not None else "auto"
    given = _SGLANG_KV_DTYPES.get(given, given)
    if given == "auto":
        return own, known
    if known and given != own:
        raise ValueError(
            f"kv_dtype={given} contradicts the dtype {type(pool).__name__}'s bytes encode "
            f"({own}); kv_dtype only names it for a pool that cannot say (uint8-stored fp8)"
        )
    return given, True


def _pool_kv_dtype(pool) -> tuple[str, bool]:
    """What the pool itself says its bytes encode. fp8 caches are stored as uint8 (SGLang's
    store_dtype), so the storage dtype cannot tell e4m3fn from e5m2; the device pool's `dtype`
    can (SGLang <= 0.5.22), else the server's --kv-cache-dtype (0.5.23's buffer infos carry
    only the storage dtype)."""
    stored = pool.dtype
    meaning = getattr(getattr(pool, "device_pool", None), "dtype", None)
    if isinstance(meaning, torch.dtype):
        return _dtype_name(meaning), True
    if stored != torch.uint8 or hasattr(pool, "item_bytes"):  # V4 rows: pool_name says it
        return _dtype_name(stored), True
    args = sglang_server_args()
    wanted = str(getattr(args, "kv_cache_dtype", "") or "") if args is not None else ""
    if wanted and wanted != "auto":
        return _SGLANG_KV_DTYPES.get(wanted, wanted), True
    return _dtype_name(stored), False


def _kind_and_geometry(pool) -> tuple[str, list[str], bool]:
    """(kind, geometry fields, sharded by TP). MLA latents and V4 rows are the same on every TP
    rank (SGLang shares them across ranks too); MHA heads are split across TP ranks."""
    if hasattr(pool, "item_bytes") and hasattr(pool, "pool_name"):
        name = str(pool.pool_name).replace(":", "_").replace("/", "_")
        geometry = [f"I{int(pool.item_bytes)}"]
        scale = int(getattr(pool, "scale_item_bytes", 0) or 0)
        if scale:
            geometry.append(f"S{scale}")
        return f"v4.{name}", geometry, False
    if hasattr(pool, "kv_cache_dim"):
        # kv_cache_dim alone is the sum: latent 12 + rope 4 and latent 8 + rope 8 are both 16
        geometry = [f"C{int(pool.kv_cache_dim)}"]
        for field, name in (("kv_lora_rank", "lora"), ("qk_rope_head_dim", "rope")):
            value = getattr(pool, field, None)
            if value is not None:
                geometry.append(f"{name}{int(value)}")
        if getattr(pool, "dsa_kv_cache_store_fp8", False):
            geometry.append("dsafp8")  # K/V packed with their scales in one row
        return "mla", geometry, False
    if hasattr(pool, "head_num") and hasattr(pool, "head_dim"):
        head_dim = int(pool.head_dim)
        v_head_dim = int(getattr(pool, "v_head_dim", None) or head_dim)
        kind = "mha" if v_head_dim == head_dim else "mha.asym"
        geometry = [f"H{int(pool.head_num)}", f"D{head_dim}", f"V{v_head_dim}"]
        # Only page_unified groups heads (its layout says how many); every other layout ignores
        # head_group_num, so two such pools store the same bytes whatever value they were given.
        unified = getattr(pool, "page_unified_layout", None)
        groups = int(unified.head_group_num) if unified is not None else 1
        if groups != 1:
            geometry.append(f"G{groups}")
        return kind, geometry, True
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


def model_field(model_id: str | None) -> str:
    """The tag's model field: a 64-bit digest of the identity (a model path can be long and hold
    any character; the header carries the full identity's 128-bit digest)."""
    if model_id is None:
        return NO_MODEL
    from hostkv_rs.l3.proof import text_digest

    return f"m{text_digest(model_id) & ((1 << 64) - 1):016x}"


def _shard(what: str, rank, size) -> tuple[int, int]:
    """(rank, size) of a TP or PP shard as ints, or ValueError naming both."""
    try:
        r, n = int(rank), int(size)
    except (TypeError, ValueError, OverflowError):
        r, n = -1, 0
    if not 0 <= r < n:
        raise ValueError(
            f"{what}_rank={rank} and {what}_size={size} must name a shard together, with "
            f"0 <= {what}_rank < {what}_size"
        )
    return r, n


def page_format(
    pool,
    *,
    namespace: str = "",
    tp_rank: int | None = None,
    tp_size: int | None = None,
    pp_rank: int = 0,
    pp_size: int = 1,
    model_id: str | None = None,
    kv_dtype=None,
    digests: bool = True,
) -> PageFormat:
    """The format of `pool`'s pages. `model_id` names the weights that produced them (None: the
    SGLang server's model path when SGLang runs in this process, else no identity); `kv_dtype`
    (a torch dtype or its name) overrides the dtype the bytes encode when the pool cannot say.
    `tp_rank`/`tp_size` (None: rank 0 of 1, and `tp_known` False for a pool whose heads TP
    splits) name this TP shard. `digests=False` is the proof-less format the benchmark measures
    against (its own tag).
    Raises ValueError for a pool without bytes (a logical anchor, an allocator-only pool) and
    RuntimeError for a destroyed one."""
    from hostkv_rs.l3.proof import HEADER_BYTES

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
    dtype, dtype_known = _kv_dtype(pool, kv_dtype)
    if model_id is None:
        model_id = sglang_model_identity()
    elif not str(model_id):
        raise ValueError("model_id must be a non-empty string (or None)")
    else:
        model_id = str(model_id)
    layers = int(pool.layer_num)
    target = int(getattr(pool, "target_layer_num", layers) or layers)
    start = int(getattr(pool, "start_layer", 0) or 0)
    fields = [
        FORMAT_VERSION,
        kind,
        str(pool.layout),
        dtype,
        # layer count (+ packed MTP draft layers) and which model layers they are (PP / sharding)
        f"L{target}" + (f"+{layers - target}" if layers != target else "") + f"@{start}",
        f"P{page_size}",
        *geometry,
    ]
    label = getattr(pool, "pool_label", "kv") or "kv"
    if label != "kv":  # e.g. a hybrid model's SWA pool beside its full-attention pool
        fields.append("lbl" + str(label).replace("-", "_").replace("/", "_"))
    owned = _owned_device_layers(pool)
    if owned is not None:
        fields.append(owned)
    tp_named = tp_rank is not None or tp_size is not None
    rank, size = _shard("tp", tp_rank, tp_size) if tp_named else (0, 1)
    if tp_sharded:
        fields.append(f"tp{rank}of{size}")
    fields.append("pp{}of{}".format(*_shard("pp", pp_rank, pp_size)))
    if dcp_size != 1:
        fields.append(f"dcp{dcp_rank}of{dcp_size}")
    own_tag = getattr(pool, "storage_format_tag", None)
    if own_tag:
        fields.append(str(own_tag))
    fields.append(model_field(model_id))
    if not digests:
        fields.append("raw")
    tag = "-".join(fields)
    if namespace is None:
        namespace = ""  # no prefix, as an empty namespace
    if not isinstance(namespace, str):
        raise TypeError(f"namespace must be a string, got {type(namespace).__name__}")
    if namespace:
        tag = f"{namespace}/{tag}"
    page_bytes = sum(int(s) for s in sizes)
    return PageFormat(
        tag,
        page_bytes,
        len(ptrs),
        slots_per_page,
        object_bytes=page_bytes + (HEADER_BYTES if digests else 0),
        identity=f"{model_id or ''}\n{tag}",
        model_id=model_id,
        dtype_known=dtype_known,
        tp_known=tp_named or not tp_sharded,
    )


def host_buffers(pool) -> list[tuple[int, int]]:
    """(address, bytes) of every host allocation behind `pool`'s pages, each listed once: the
    Rust regions of a hostkv_rs pool, else the tensors a SGLang pool reports."""
    return [(address, nbytes) for address, nbytes, _owner in _host_allocations(pool)]


def _host_allocations(pool) -> list[tuple[int, int, object]]:
    """(address, bytes, owner) of each host allocation, the owner being the HostRegion or
    tensor whose bytes they are (what `proof.PoolBytes` views, so hashing never starts from a
    bare address)."""
    regions = list(getattr(pool, "_host_regions", None) or ())
    for name in ("_region", "_scale_region"):  # DeepSeek V4 paged pools
        region = getattr(pool, name, None)
        if region is not None:
            regions.append(region)
    spans = [(int(r.address), int(r.nbytes), r) for r in regions]
    if not spans:
        get_buffers = getattr(pool, "get_hybrid_pool_buffer", None)
        tensors = get_buffers() if get_buffers is not None else [getattr(pool, "kv_buffer", None)]
        for t in tensors:
            if isinstance(t, torch.Tensor):
                spans.append((t.data_ptr(), t.numel() * t.element_size(), t))
    seen: set[int] = set()
    unique = []
    for address, nbytes, owner in spans:
        if nbytes > 0 and address not in seen:
            seen.add(address)
            unique.append((address, nbytes, owner))
    return unique
