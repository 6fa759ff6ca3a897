"""Every host pool x layout x backend x direction on a real GPU, byte-exact against the layout
oracle (tests/reference.py): bf16 and fp8, on a side stream and on the legacy default stream,
int32/int64 indices on the CPU and on the GPU, pinned host tensors, and bad device-resident
indices (error reported, nothing written).

Names containing `smoke` form the small subset scripts/gpu_check.sh runs under
compute-sanitizer."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch
from hostkv_rs import (
    MHATokenToKVPool,
    MLATokenToKVPool,
    MLATokenToKVPoolHost,
    TransferError,
    _core,
    get_mha_host_pool_cls,
)
from reference import device_planes, host_planes, host_segments, plane_items

LAYERS = 5
DEVICE_PAGES = 6
DTYPES = {"bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn}
MHA_PAIRS = [
    ("kernel", "layer_first"),
    ("kernel", "page_first"),
    ("kernel", "page_head"),
    ("direct", "layer_first"),
    ("direct", "page_first_direct"),
]
ASYM_PAIRS = [("kernel", "page_first"), ("direct", "page_first_direct")]
MLA_PAIRS = [
    ("kernel", "layer_first"),
    ("kernel", "page_first"),
    ("direct", "layer_first"),
    ("direct", "page_first_direct"),
]
V4_PAIRS = [
    ("kernel", "layer_first"),
    ("kernel", "page_first"),
    ("direct", "layer_first"),
    ("direct", "page_first_direct"),
]
STREAMS = ["side", "default"]
IDX = [("cpu", torch.int64), ("cuda", torch.int64), ("cuda", torch.int32), ("cpu", torch.int32)]
IDX_IDS = [f"{d}-{str(t)[6:]}" for d, t in IDX]


def make_mha(layout, page_size, dtype, v_head_dim=None):
    dp = MHATokenToKVPool(
        DEVICE_PAGES * page_size,
        page_size,
        dtype,
        4,
        24,
        LAYERS,
        device="cuda",
        v_head_dim=v_head_dim,
    )
    return get_mha_host_pool_cls(dp)(dp, 2.0, 0, page_size, layout), dp


def make_mla(layout, page_size, dtype):
    # 328 elements per row: 656 bytes in bf16 (not a multiple of 128, like GLM/DSA FP8 MLA).
    dp = MLATokenToKVPool(
        DEVICE_PAGES * page_size, page_size, dtype, 264, 64, LAYERS, device="cuda"
    )
    return MLATokenToKVPoolHost(dp, 2.0, 0, page_size, layout), dp


@contextlib.contextmanager
def on_stream(kind):
    s = torch.cuda.Stream() if kind == "side" else torch.cuda.default_stream()
    with torch.cuda.stream(s):
        yield s
    s.synchronize()


def fill_random_cuda(dp, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    for plane in device_planes(dp):
        for t in plane:
            t.copy_(torch.randint(0, 256, t.shape, dtype=torch.uint8, device="cuda", generator=g))
    torch.cuda.synchronize()


def fill_random_host(pool, seed):
    g = torch.Generator().manual_seed(seed)
    for p in host_planes(pool):
        p.copy_(torch.randint(0, 256, p.shape, dtype=torch.uint8, generator=g))


def snap_host(pool):
    return [p.numpy().copy() for p in host_planes(pool)]


def snap_dev(dp):
    torch.cuda.synchronize()
    return [[t.cpu().numpy().copy() for t in plane] for plane in device_planes(dp)]


def expect_backup(pool, host_before, dev, host_idx, dev_idx):
    heads = pool.head_num if pool.layout == "page_head" else 1
    out = [h.copy() for h in host_before]
    d = np.asarray(dev_idx, dtype=np.int64)
    for p, item in enumerate(plane_items(pool)):
        for layer in range(pool.layer_num):
            offs, seg, row_offs = host_segments(
                pool.layout, host_idx, layer, pool.layer_num, pool.size, pool.page_size, item, heads
            )
            rows = dev[p][layer][d]
            for s in range(offs.shape[1]):
                cols = row_offs[s] + np.arange(seg)
                out[p][offs[:, s][:, None] + np.arange(seg)[None, :]] = rows[:, cols]
    return out


def expect_load(pool, host, dev_before, host_idx, dev_idx, layers):
    heads = pool.head_num if pool.layout == "page_head" else 1
    out = [[t.copy() for t in plane] for plane in dev_before]
    d = np.asarray(dev_idx, dtype=np.int64)
    for p, item in enumerate(plane_items(pool)):
        for layer in layers:
            offs, seg, row_offs = host_segments(
                pool.layout, host_idx, layer, pool.layer_num, pool.size, pool.page_size, item, heads
            )
            for s in range(offs.shape[1]):
                cols = row_offs[s] + np.arange(seg)
                out[p][layer][d[:, None], cols[None, :]] = host[p][
                    offs[:, s][:, None] + np.arange(seg)
                ]
    return out


def assert_same(got, want, what):
    got, want = np.asarray(got), np.asarray(want)
    if not np.array_equal(got, want):
        bad = np.flatnonzero(got.reshape(-1) != want.reshape(-1))
        raise AssertionError(f"{what}: {bad.size} bytes differ, first at {bad[0]}")


def tokens(pages, page_size):
    pages = np.asarray(pages, dtype=np.int64)
    return (pages[:, None] * page_size + np.arange(page_size)[None, :]).reshape(-1)


def as_idx(values, where, dtype):
    return torch.as_tensor(values, dtype=dtype, device=where)


def round_trip(pool, dp, backend, where, idx_dtype, stream_kind, seed):
    """Backup all layers into host pages, check the host bytes; load every layer back into other
    device pages, check the device bytes; no device error pending afterwards."""
    for buf in host_planes(pool):
        assert buf.is_pinned(), "host pool memory must be registered (is_pinned)"
    rng = np.random.default_rng(seed)
    P = pool.page_size
    host_tok = tokens(rng.permutation(pool.page_num)[:3], P)
    dev_pages = rng.permutation(np.arange(1, DEVICE_PAGES + 1))[:3]
    backup_tok, load_tok = tokens(dev_pages, P), tokens(np.roll(dev_pages, 1), P)

    fill_random_cuda(dp, seed)
    fill_random_host(pool, seed + 1)
    host_before, dev_before = snap_host(pool), snap_dev(dp)
    with on_stream(stream_kind):
        pool.backup_from_device_all_layer(
            dp, as_idx(host_tok, where, idx_dtype), as_idx(backup_tok, where, idx_dtype), backend
        )
    want_host = expect_backup(pool, host_before, dev_before, host_tok, backup_tok)
    for p, (g, w) in enumerate(zip(snap_host(pool), want_host)):
        assert_same(g, w, f"host plane {p} after backup")

    dev_before = snap_dev(dp)
    with on_stream(stream_kind):
        for layer in range(pool.layer_num):
            pool.load_to_device_per_layer(
                dp,
                as_idx(host_tok, where, idx_dtype),
                as_idx(load_tok, where, idx_dtype),
                layer,
                backend,
            )
    want_dev = expect_load(pool, snap_host(pool), dev_before, host_tok, load_tok, range(LAYERS))
    for p, (gp, wp) in enumerate(zip(snap_dev(dp), want_dev)):
        for layer, (g, w) in enumerate(zip(gp, wp)):
            assert_same(g, w, f"device plane {p} layer {layer} after load")
    _core.check_device_errors()


@pytest.mark.parametrize("stream_kind", STREAMS)
@pytest.mark.parametrize("where,idx_dtype", IDX, ids=IDX_IDS)
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("backend,layout", MHA_PAIRS)
def test_mha(backend, layout, page_size, dtype, where, idx_dtype, stream_kind):
    pool, dp = make_mha(layout, page_size, dtype)
    round_trip(pool, dp, backend, where, idx_dtype, stream_kind, seed=page_size)


@pytest.mark.parametrize("stream_kind", STREAMS)
@pytest.mark.parametrize("where,idx_dtype", IDX[:2], ids=IDX_IDS[:2])
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("backend,layout", ASYM_PAIRS)
def test_asymmetric_mha(backend, layout, dtype, where, idx_dtype, stream_kind):
    pool, dp = make_mha(layout, 16, dtype, v_head_dim=8)
    round_trip(pool, dp, backend, where, idx_dtype, stream_kind, seed=3)


@pytest.mark.parametrize("stream_kind", STREAMS)
@pytest.mark.parametrize("where,idx_dtype", IDX[:3], ids=IDX_IDS[:3])
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("backend,layout", MLA_PAIRS)
def test_mla(backend, layout, dtype, where, idx_dtype, stream_kind):
    pool, dp = make_mla(layout, 16, dtype)
    round_trip(pool, dp, backend, where, idx_dtype, stream_kind, seed=5)


@pytest.mark.parametrize("stream_kind", STREAMS)
@pytest.mark.parametrize("where", ["cpu", "cuda"])
@pytest.mark.parametrize("backend,layout", V4_PAIRS)
def test_v4_paged(backend, layout, where, stream_kind):
    from hostkv_rs.v4 import DeepSeekV4PagedHostPool

    L, item, pages, P, dev_pages = 3, 656, 8, 4, 9
    g = torch.Generator(device="cuda").manual_seed(9)
    dev = [
        torch.randint(0, 256, (dev_pages, item), dtype=torch.uint8, device="cuda", generator=g)
        for _ in range(L)
    ]
    pool = DeepSeekV4PagedHostPool("c4_kv", dev, item, pages, P, layout=layout)

    def host_row(r, layer):
        if layout == "layer_first":
            return pool.kv_buffer[layer][r]
        if layout == "page_first":
            return pool.kv_buffer[r, layer]
        return pool.kv_buffer[r, layer, 0]

    bufs = pool.kv_buffer if isinstance(pool.kv_buffer, list) else [pool.kv_buffer]
    assert all(b.is_pinned() for b in bufs)
    host_pages, dev_rows = [5, 0, 3], [7, 2, 4]

    def idx(pages):
        toks = np.concatenate([np.arange(p * P, (p + 1) * P) for p in pages])
        return torch.as_tensor(toks, device=where)

    with on_stream(stream_kind):
        pool.backup_from_device_all_layer(None, idx(host_pages), idx(dev_rows), backend)
    for hp, dr in zip(host_pages, dev_rows):
        for layer in range(L):
            assert torch.equal(host_row(hp, layer), dev[layer][dr].cpu()), (hp, layer)
    for d in dev:
        d.zero_()
    torch.cuda.synchronize()
    with on_stream(stream_kind):
        for layer in range(L):
            pool.load_to_device_per_layer(None, idx(host_pages), idx([1, 8, 6]), layer, backend)
    for hp, dr in zip(host_pages, [1, 8, 6]):
        for layer in range(L):
            assert torch.equal(dev[layer][dr].cpu(), host_row(hp, layer)), (hp, layer)
    assert int(sum(d.count_nonzero() for d in dev)) == sum(
        int(host_row(hp, layer).count_nonzero()) for hp in host_pages for layer in range(L)
    ), "bytes written outside the loaded rows"
    _core.check_device_errors()


@pytest.mark.parametrize("backend,layout", MHA_PAIRS)
def test_smoke_mha_round_trip(backend, layout):
    pool, dp = make_mha(layout, 16, torch.bfloat16)
    round_trip(pool, dp, backend, "cuda", torch.int64, "side", seed=1)


@pytest.mark.parametrize("side", ["host", "device"])
@pytest.mark.parametrize("bad", [-1, 10**6])
@pytest.mark.parametrize("layout", ["layer_first", "page_first", "page_head"])
def test_smoke_bad_gpu_index_reported_and_nothing_written(layout, side, bad):
    pool, dp = make_mha(layout, 16, torch.bfloat16)
    fill_random_cuda(dp, 11)
    fill_random_host(pool, 12)
    host_before, dev_before = snap_host(pool), snap_dev(dp)
    host_tok = torch.arange(16, 32, device="cuda")
    dev_tok = torch.arange(32, 48, device="cuda")
    (host_tok if side == "host" else dev_tok)[7] = bad
    # Device-resident indices are checked by the kernel: the call returns, the error is
    # reported once the stream has run it.
    pool.backup_from_device_all_layer(dp, host_tok, dev_tok, "kernel")
    torch.cuda.synchronize()
    with pytest.raises(TransferError, match=rf"^{side} index {bad} "):
        _core.check_device_errors()
    for p, (g, w) in enumerate(zip(snap_host(pool), host_before)):
        assert_same(g, w, f"host plane {p} after a refused backup")
    _core.check_device_errors()  # reported once, then cleared

    # A pending error is reported by the pool's next call, which then does not run.
    pool.load_to_device_per_layer(dp, host_tok, dev_tok, 0, "kernel")
    torch.cuda.synchronize()
    good = torch.arange(16, 32, device="cuda")
    with pytest.raises(TransferError):
        pool.load_to_device_per_layer(dp, good, good, 1, "kernel")
    torch.cuda.synchronize()
    for p, (gp, wp) in enumerate(zip(snap_dev(dp), dev_before)):
        for layer, (g, w) in enumerate(zip(gp, wp)):
            assert_same(g, w, f"device plane {p} layer {layer} after refused loads")
    _core.check_device_errors()


def test_smoke_block_quota_does_not_change_bytes(monkeypatch):
    results = []
    for quota in ("1", "2", "7", "132"):
        monkeypatch.setenv("HOSTKV_BLOCK_QUOTA", quota)
        pool, dp = make_mha("page_head", 16, torch.bfloat16)
        round_trip(pool, dp, "kernel", "cuda", torch.int64, "side", seed=4)
        results.append([h.copy() for h in snap_host(pool)])
    for r in results[1:]:
        for a, b in zip(results[0], r):
            assert_same(a, b, "host bytes for another block quota")


def test_smoke_runtime_info_names_the_device():
    info = _core.runtime_info()
    assert "CUDA available" in info, info
    assert torch.cuda.get_device_name(0).split()[-1] in info, info
