"""Test oracle: the host layouts of host-pool-contract.md §2 written out as byte formulas, and
byte-level views of pools, so tests never ask the code under test where a byte should be."""

from __future__ import annotations

import numpy as np
import torch
from hostkv_rs import (
    MHATokenToKVPool,
    MLATokenToKVPool,
    MLATokenToKVPoolHost,
    get_mha_host_pool_cls,
)

LAYOUTS = ("layer_first", "page_first", "page_first_direct", "page_head", "page_unified")

# Small geometries (prime layer count, 8-byte multiple item sizes) keep the suite fast on two
# busy cores.
LAYERS = 5  # prime, so no layer/page/head confusion can cancel out
DTYPES = {"bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn}
PAGE_SIZES = (1, 16, 64)
DEVICE_PAGES = 4  # usable device pages 1..4; page 0 is SGLang's padding page

MHA_PAIRS = [
    ("kernel", "layer_first"),
    ("kernel", "page_first"),
    ("kernel", "page_head"),
    ("kernel", "page_unified"),
    ("direct", "layer_first"),
    ("direct", "page_first_direct"),
]
ASYM_PAIRS = [("kernel", "page_first"), ("direct", "page_first_direct")]
MLA_PAIRS = [
    ("kernel", "layer_first"),
    ("kernel", "page_first"),
    ("kernel", "page_unified"),
    ("direct", "layer_first"),
    ("direct", "page_first_direct"),
]
V4_PAIRS = [pair for pair in MLA_PAIRS if pair[1] != "page_unified"]


def make_mha(
    layout,
    page_size=16,
    dtype=torch.bfloat16,
    *,
    layers=LAYERS,
    heads=2,
    head_dim=8,
    v_head_dim=None,
    device_pages=DEVICE_PAGES,
    ratio=2.0,
    **kwargs,
):
    """(host pool, device pool); the host class comes from get_mha_host_pool_cls, as in SGLang."""
    dp = MHATokenToKVPool(
        device_pages * page_size,
        page_size,
        dtype,
        heads,
        head_dim,
        layers,
        v_head_dim=v_head_dim,
    )
    cls = get_mha_host_pool_cls(dp)
    return cls(dp, ratio, 0, page_size, layout, **kwargs), dp


def make_asym(layout, page_size=16, dtype=torch.bfloat16, **kwargs):
    kwargs.setdefault("head_dim", 8)
    kwargs.setdefault("v_head_dim", 4)
    return make_mha(layout, page_size, dtype, **kwargs)


def make_mla(
    layout,
    page_size=16,
    dtype=torch.bfloat16,
    *,
    layers=LAYERS,
    kv_lora_rank=12,
    rope=4,
    device_pages=DEVICE_PAGES,
    ratio=2.0,
    **kwargs,
):
    dp = MLATokenToKVPool(device_pages * page_size, page_size, dtype, kv_lora_rank, rope, layers)
    return MLATokenToKVPoolHost(dp, ratio, 0, page_size, layout, **kwargs), dp


def distinct_pages(rng: np.random.Generator, low: int, high: int, count: int) -> np.ndarray:
    """`count` distinct page numbers in [low, high), in random order."""
    return rng.permutation(np.arange(low, high))[:count]


def host_segments(
    layout: str,
    tokens,
    layer: int,
    L: int,
    S: int,
    P: int,
    item: int,
    heads: int,
    component: int = 0,
    components: int = 1,
):
    """Byte offsets inside one plane (a K half, a V buffer, the MLA latent buffer) of token slots
    `tokens` at `layer`, as an (N, segments) array, plus the segment length and each segment's
    byte offset inside the device row. page_head splits a row into `heads` segments. page_unified
    (SGLang 0.5.23's `page_dims`: page, head group, layer, component, slot, heads in group, dim)
    splits it into `heads` head groups; its K and V are `components` of one allocation."""
    t = np.asarray(tokens, dtype=np.int64)
    if layout == "page_unified":
        seg = item // heads
        g = np.arange(heads)
        layer_bytes = components * P * seg
        group_bytes = L * layer_bytes
        off = (
            (t // P)[:, None] * heads * group_bytes
            + g[None, :] * group_bytes
            + layer * layer_bytes
            + component * P * seg
            + (t % P)[:, None] * seg
        )
        return off, seg, g * seg
    if layout == "layer_first":
        off = layer * S * item + t * item
        return off[:, None], item, np.array([0])
    if layout == "page_first":
        off = t * (L * item) + layer * item
        return off[:, None], item, np.array([0])
    if layout == "page_first_direct":
        off = (t // P) * P * L * item + layer * P * item + (t % P) * item
        return off[:, None], item, np.array([0])
    if layout == "page_head":
        seg = item // heads
        h = np.arange(heads)
        off = (
            (t // P)[:, None] * P * L * item
            + h[None, :] * P * L * seg
            + (t % P)[:, None] * L * seg
            + layer * seg
        )
        return off, seg, h * seg
    raise AssertionError(layout)


def host_planes(pool) -> list[torch.Tensor]:
    """The host pool's bytes as one flat uint8 tensor per plane (views, not copies)."""
    buf = pool.kv_buffer
    if isinstance(buf, tuple):  # asymmetric MHA: K and V are separate allocations
        return [b.reshape(-1).view(torch.uint8) for b in buf]
    flat = buf.reshape(-1).view(torch.uint8)
    if hasattr(pool, "kv_cache_dim") or pool.layout == "page_unified":
        return [flat]  # MLA's latent plane; page_unified's one fused allocation
    half = flat.numel() // 2  # MHA: the V half follows the K half
    return [flat[:half], flat[half:]]


def device_planes(device_pool) -> list[list[torch.Tensor]]:
    """Per plane, per layer: the device layer as a (rows, item_bytes) uint8 view."""
    if hasattr(device_pool, "k_buffer"):
        planes = [device_pool.k_buffer, device_pool.v_buffer]
    else:
        planes = [device_pool.kv_buffer]
    return [[t.view(torch.uint8).reshape(t.shape[0], -1) for t in plane] for plane in planes]


def plane_items(pool) -> list[int]:
    """Item bytes per plane from the pool's public geometry attributes."""
    e = pool.dtype.itemsize
    if hasattr(pool, "kv_cache_dim"):
        return [pool.kv_cache_dim * e]
    v_dim = getattr(pool, "v_head_dim", pool.head_dim)
    return [pool.head_num * pool.head_dim * e, pool.head_num * v_dim * e]


def _segments_per_row(pool) -> int:
    if pool.layout == "page_head":
        return pool.head_num
    if pool.layout == "page_unified":
        return getattr(pool, "head_group_num", 1) if not hasattr(pool, "kv_cache_dim") else 1
    return 1


def plane_segments(pool, p: int, item: int, host_idx, layer: int):
    """(host buffer index, host_segments(...)) of plane `p`."""
    unified = pool.layout == "page_unified"
    components = len(plane_items(pool)) if unified else 1
    segs = host_segments(
        pool.layout,
        host_idx,
        layer,
        pool.layer_num,
        pool.size,
        pool.page_size,
        item,
        _segments_per_row(pool),
        p if unified else 0,
        components,
    )
    return (0 if unified else p), segs


def expected_backup(pool, host_before, device_pool, host_idx, dev_idx):
    """Host plane bytes after backing up every layer of `dev_idx` into `host_idx`."""
    out = [np.array(p, copy=True) for p in host_before]
    dev = device_planes(device_pool)
    d = np.asarray(dev_idx, dtype=np.int64)
    for p, item in enumerate(plane_items(pool)):
        for layer in range(pool.layer_num):
            hb, (offs, seg, row_offs) = plane_segments(pool, p, item, host_idx, layer)
            rows = dev[p][layer].numpy()[d]  # (N, item)
            for s in range(offs.shape[1]):
                cols = row_offs[s] + np.arange(seg)
                out[hb][offs[:, s][:, None] + np.arange(seg)[None, :]] = rows[:, cols]
    return out


def expected_load(pool, host_bytes, device_before, host_idx, dev_idx, layer):
    """Device plane bytes (per plane, per layer numpy arrays) after loading host `layer`."""
    out = [[t.copy() for t in plane] for plane in device_before]
    d = np.asarray(dev_idx, dtype=np.int64)
    for p, item in enumerate(plane_items(pool)):
        hb, (offs, seg, row_offs) = plane_segments(pool, p, item, host_idx, layer)
        host = np.asarray(host_bytes[hb])
        for s in range(offs.shape[1]):
            cols = row_offs[s] + np.arange(seg)
            out[p][layer][d[:, None], cols[None, :]] = host[offs[:, s][:, None] + np.arange(seg)]
    return out


def snapshot_device(device_pool) -> list[list[np.ndarray]]:
    return [[t.numpy().copy() for t in plane] for plane in device_planes(device_pool)]


def snapshot_host(pool) -> list[np.ndarray]:
    return [p.numpy().copy() for p in host_planes(pool)]


def fill_random(tensors, rng: np.random.Generator):
    for t in tensors:
        t.copy_(torch.from_numpy(rng.integers(0, 256, size=t.shape, dtype=np.uint8)))


def page_tokens(pages, page_size: int) -> np.ndarray:
    pages = np.asarray(pages, dtype=np.int64)
    return (pages[:, None] * page_size + np.arange(page_size)[None, :]).reshape(-1)


def assert_bytes_equal(actual, expected, what: str):
    actual, expected = np.asarray(actual), np.asarray(expected)
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    if not np.array_equal(actual, expected):
        bad = np.flatnonzero(actual.reshape(-1) != expected.reshape(-1))
        raise AssertionError(
            f"{what}: {bad.size} bytes differ, first at flat offset {bad[0]} "
            f"(got {actual.reshape(-1)[bad[0]]}, want {expected.reshape(-1)[bad[0]]})"
        )


def assert_host_equal(pool, expected, what="host pool"):
    for p, (got, want) in enumerate(zip(snapshot_host(pool), expected, strict=True)):
        assert_bytes_equal(got, want, f"{what} plane {p}")


def assert_device_equal(device_pool, expected, what="device pool"):
    for p, (got_plane, want_plane) in enumerate(
        zip(snapshot_device(device_pool), expected, strict=True)
    ):
        for layer, (got, want) in enumerate(zip(got_plane, want_plane, strict=True)):
            assert_bytes_equal(got, want, f"{what} plane {p} layer {layer}")


def all_device_tensors(device_pool) -> list[torch.Tensor]:
    return [t for plane in device_planes(device_pool) for t in plane]


def round_trip(
    pool, device_pool, backend, host_tokens, dev_backup, dev_load, idx_dtype=torch.int64, seed=0
):
    """Back up every layer of `dev_backup` into `host_tokens`, wipe the device pool, load each
    layer into `dev_load`; after every step compare every byte of both pools with the oracle
    (bytes outside the transfer are random poison and must survive)."""
    rng = np.random.default_rng(seed)
    fill_random(all_device_tensors(device_pool), rng)
    fill_random(host_planes(pool), rng)
    host_before, dev_before = snapshot_host(pool), snapshot_device(device_pool)

    h = torch.as_tensor(np.asarray(host_tokens), dtype=idx_dtype)
    d = torch.as_tensor(np.asarray(dev_backup), dtype=idx_dtype)
    pool.backup_from_device_all_layer(device_pool, h, d, backend)
    want_host = expected_backup(pool, host_before, device_pool, host_tokens, dev_backup)
    assert_host_equal(pool, want_host, "host after backup")
    assert_device_equal(device_pool, dev_before, "device after backup")

    fill_random(all_device_tensors(device_pool), rng)
    want_dev = snapshot_device(device_pool)
    dl = torch.as_tensor(np.asarray(dev_load), dtype=idx_dtype)
    for layer in range(pool.layer_num):
        pool.load_to_device_per_layer(device_pool, h, dl, layer, backend)
        want_dev = expected_load(pool, want_host, want_dev, host_tokens, dev_load, layer)
        assert_device_equal(device_pool, want_dev, f"device after loading layer {layer}")
    assert_host_equal(pool, want_host, "host after loads")
