"""Every host pool x layout x backend x direction on a real GPU, byte-exact against the layout
oracle (tests/reference.py): bf16 and fp8, on a side stream and on the legacy default stream,
int32/int64 indices on the CPU and on the GPU, pinned host tensors, and bad device-resident
indices (error reported, nothing written). Also the hazards only a GPU shows: many transfers
queued behind a busy stream (staging buffers must not be reused early), a layer table too long
for the parameter block, a transfer from a thread that never used CUDA, and a pool freed while
a transfer into it is still queued.

Names containing `smoke` form the small subset scripts/gpu_check.sh runs under
compute-sanitizer."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import textwrap
import threading

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
from reference import (
    ASYM_PAIRS,
    DTYPES,
    LAYERS,
    MHA_PAIRS,
    MLA_PAIRS,
    device_planes,
    host_planes,
    plane_items,
    plane_segments,
)

DEVICE_PAGES = 6
V4_PAIRS = [
    ("kernel", "layer_first"),
    ("kernel", "page_first"),
    ("direct", "layer_first"),
    ("direct", "page_first_direct"),
]
STREAMS = ["side", "default"]
IDX = [("cpu", torch.int64), ("cuda", torch.int64), ("cuda", torch.int32), ("cpu", torch.int32)]
IDX_IDS = [f"{d}-{str(t)[6:]}" for d, t in IDX]


def make_mha(layout, page_size, dtype, v_head_dim=None, layers=LAYERS, heads=4, head_dim=24):
    dp = MHATokenToKVPool(
        DEVICE_PAGES * page_size,
        page_size,
        dtype,
        heads,
        head_dim,
        layers,
        device="cuda",
        v_head_dim=v_head_dim,
    )
    return get_mha_host_pool_cls(dp)(dp, 2.0, 0, page_size, layout), dp


def make_mla(layout, page_size, dtype):
    # 328 elements per row: 656 bytes in bf16 (not a multiple of 128, like GLM/DSA FP8 MLA).
    # page_unified moves rows of a multiple of 16 bytes only (SGLang's PageUnifiedLayout): 320.
    latent = 256 if layout == "page_unified" else 264
    dp = MLATokenToKVPool(
        DEVICE_PAGES * page_size, page_size, dtype, latent, 64, LAYERS, device="cuda"
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
    out = [h.copy() for h in host_before]
    d = np.asarray(dev_idx, dtype=np.int64)
    for p, item in enumerate(plane_items(pool)):
        for layer in range(pool.layer_num):
            hb, (offs, seg, row_offs) = plane_segments(pool, p, item, host_idx, layer)
            rows = dev[p][layer][d]
            for s in range(offs.shape[1]):
                cols = row_offs[s] + np.arange(seg)
                out[hb][offs[:, s][:, None] + np.arange(seg)[None, :]] = rows[:, cols]
    return out


def expect_load(pool, host, dev_before, host_idx, dev_idx, layers):
    out = [[t.copy() for t in plane] for plane in dev_before]
    d = np.asarray(dev_idx, dtype=np.int64)
    for p, item in enumerate(plane_items(pool)):
        for layer in layers:
            hb, (offs, seg, row_offs) = plane_segments(pool, p, item, host_idx, layer)
            for s in range(offs.shape[1]):
                cols = row_offs[s] + np.arange(seg)
                out[p][layer][d[:, None], cols[None, :]] = host[hb][
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
    want_dev = expect_load(
        pool, snap_host(pool), dev_before, host_tok, load_tok, range(pool.layer_num)
    )
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
    from hostkv_rs import DeepSeekV4PagedHostPool

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


def test_smoke_round_trip_from_a_thread_that_never_used_cuda():
    # SGLang moves KV from its cache-controller threads; the core binds the device's primary
    # context for the call whatever the thread had current.
    pool, dp = make_mha("layer_first", 16, torch.bfloat16)  # both backends take layer_first
    errors = []

    def worker():
        try:
            round_trip(pool, dp, "kernel", "cpu", torch.int64, "side", seed=21)
            round_trip(pool, dp, "direct", "cpu", torch.int64, "side", seed=22)
        except Exception as exc:  # noqa: BLE001 - re-raised in the main thread
            errors.append(exc)

    t = threading.Thread(target=worker)
    t.start()
    t.join(timeout=120)
    assert not t.is_alive(), "the transfer thread hung"
    if errors:
        raise errors[0]


def test_smoke_queued_transfers_with_cpu_indices_keep_their_own_indices():
    # The stream is held busy while 40 loads queue up: each call's CPU indices go to a staging
    # buffer the kernel reads later, and the caller's tensors are overwritten right away. More
    # calls than staging buffers are kept, so late calls must wait for an event, not reuse one.
    pool, dp = make_mha("page_first", 16, torch.bfloat16)
    fill_random_cuda(dp, 31)
    fill_random_host(pool, 32)
    host = snap_host(pool)
    want = snap_dev(dp)
    rng = np.random.default_rng(33)
    dev_rows = rng.permutation(np.arange(16, (DEVICE_PAGES + 1) * 16))[:80]
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        torch.cuda._sleep(200_000_000)
        for k in range(40):
            host_tok = rng.permutation(pool.size)[:2]
            dev_tok = dev_rows[2 * k : 2 * k + 2]
            layer = k % LAYERS
            want = expect_load(pool, host, want, host_tok, dev_tok, [layer])
            h = torch.as_tensor(host_tok, dtype=torch.int64)
            d = torch.as_tensor(dev_tok, dtype=torch.int32)
            pool.load_to_device_per_layer(dp, h, d, layer, "kernel")
            h.fill_(0)
            d.fill_(0)
    s.synchronize()
    for p, (gp, wp) in enumerate(zip(snap_dev(dp), want)):
        for layer, (g, w) in enumerate(zip(gp, wp)):
            assert_same(g, w, f"device plane {p} layer {layer} after 40 queued loads")
    _core.check_device_errors()


def test_smoke_layer_table_longer_than_the_parameter_block():
    # 2 planes x 131 layers = 262 device layer pointers: more than the 256 carried inline.
    pool, dp = make_mha("page_first", 16, torch.bfloat16, layers=131, heads=1, head_dim=8)
    round_trip(pool, dp, "kernel", "cuda", torch.int64, "side", seed=41)
    round_trip(pool, dp, "kernel", "cpu", torch.int32, "default", seed=42)


@pytest.mark.parametrize("backend,layout", [("kernel", "page_head"), ("direct", "layer_first")])
@pytest.mark.parametrize("where", ["cpu", "cuda"])
def test_smoke_empty_transfer_is_a_no_op(backend, layout, where):
    pool, dp = make_mha(layout, 16, torch.bfloat16)
    fill_random_cuda(dp, 51)
    fill_random_host(pool, 52)
    host_before, dev_before = snap_host(pool), snap_dev(dp)
    empty = torch.zeros(0, dtype=torch.int64, device=where)
    pool.backup_from_device_all_layer(dp, empty, empty, backend)
    pool.load_to_device_per_layer(dp, empty, empty, 0, backend)
    torch.cuda.synchronize()
    for g, w in zip(snap_host(pool), host_before):
        assert_same(g, w, "host after empty transfers")
    for gp, wp in zip(snap_dev(dp), dev_before):
        for g, w in zip(gp, wp):
            assert_same(g, w, "device after empty transfers")
    _core.check_device_errors()


def test_smoke_pool_freed_while_a_transfer_into_it_is_queued():
    # Unpinning or unmapping host memory a queued copy still writes would fault the GPU (and end
    # the process): freeing a pool must wait for that work. Run in a child process so a fault
    # cannot take the rest of the suite down with it.
    code = textwrap.dedent(
        """
        import gc, torch
        from hostkv_rs import MHATokenToKVPool, get_mha_host_pool_cls
        for backend, layout in (("kernel", "page_first"), ("direct", "layer_first")):
            dp = MHATokenToKVPool(64, 16, torch.bfloat16, 4, 24, 5, device="cuda")
            pool = get_mha_host_pool_cls(dp)(dp, 2.0, 0, 16, layout)
            idx = torch.arange(16, 48)
            s = torch.cuda.Stream()
            with torch.cuda.stream(s):
                torch.cuda._sleep(200_000_000)
                pool.backup_from_device_all_layer(dp, idx, idx, backend)
            del pool
            gc.collect()
            s.synchronize()
            torch.cuda.synchronize()
        x = torch.ones(1 << 20, device="cuda")
        assert float(x.sum().item()) == float(1 << 20)
        print("CHILD OK")
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        check=False,
        capture_output=True,
        text=True,
        timeout=180,
        env=dict(os.environ),
    )
    assert done.returncode == 0 and "CHILD OK" in done.stdout, (done.stdout + done.stderr)[-4000:]


# ---- index maps read by the kernels (DCP shares, C4 token rows) --------------------------------


@pytest.mark.parametrize("where", ["cpu", "cuda"])
@pytest.mark.parametrize("backend,layout", MLA_PAIRS)
def test_smoke_mla_dcp_reads_this_ranks_share_on_the_gpu(backend, layout, where):
    # The kernels (GPU indices) and the direct backend apply `idx[rank::dcp] // dcp` while
    # reading; the result must equal a plain transfer of the translated indices.
    P, dcp, rank = 4, 2, 1
    dp = MLATokenToKVPool(8 * P, P, torch.bfloat16, 264, 64, LAYERS, device="cuda")
    pool = MLATokenToKVPoolHost(dp, 2.0, 0, dcp * P, layout, dcp_size=dcp, dcp_rank=rank)
    fill_random_cuda(dp, 21)
    fill_random_host(pool, 22)
    logical_host = np.concatenate([np.arange(p * dcp * P, (p + 1) * dcp * P) for p in (3, 1)])
    logical_dev = np.concatenate([np.arange(p * dcp * P, (p + 1) * dcp * P) for p in (2, 0)])
    phys_host, phys_dev = logical_host[rank::dcp] // dcp, logical_dev[rank::dcp] // dcp
    host_before, dev_before = snap_host(pool), snap_dev(dp)
    with on_stream("side"):
        pool.backup_from_device_all_layer(
            dp,
            torch.as_tensor(logical_host, device=where),
            torch.as_tensor(logical_dev, device=where),
            backend,
        )
    want = expect_backup(pool, host_before, dev_before, phys_host, phys_dev)
    for p, (g, w) in enumerate(zip(snap_host(pool), want)):
        assert_same(g, w, f"DCP backup plane {p}")
    _core.check_device_errors()


@pytest.mark.parametrize("where", ["cpu", "cuda"])
@pytest.mark.parametrize("backend", ["kernel", "direct"])
def test_smoke_v4_c4_token_rows_on_the_gpu(backend, where):
    # Token-granular V4 transfers: the core maps each token to its 576-byte value row and 8-byte
    # scale row inside the C4 page row (index maps c4_value / c4_scale).
    from hostkv_rs import DeepSeekV4PagedHostPool

    L, pages, P, row = 2, 3, _core.C4_PAGE_TOKENS, _core.C4_ROW_BYTES
    value, scale = _core.C4_VALUE_BYTES, _core.C4_SCALE_BYTES
    g = torch.Generator(device="cuda").manual_seed(5)
    dev = [
        torch.randint(0, 256, (pages, row), dtype=torch.uint8, device="cuda", generator=g)
        for _ in range(L)
    ]
    pool = DeepSeekV4PagedHostPool("c4_kv", dev, row, pages, P)
    h, d = [3, 70, 100], [5, 64, 127]
    with on_stream("side"):
        pool.backup_from_device_all_layer(
            None, torch.tensor(h, device=where), torch.tensor(d, device=where), backend
        )
    for layer in range(L):
        host, device = pool.kv_buffer[layer], dev[layer].cpu()
        for th, td in zip(h, d):
            for off, n in ((0, value), (P * value, scale)):
                unit = value if n == value else scale
                hs = (th // P, off + (th % P) * unit)
                ds = (td // P, off + (td % P) * unit)
                assert torch.equal(
                    host[hs[0], hs[1] : hs[1] + n], device[ds[0], ds[1] : ds[1] + n]
                ), (layer, th, td, n)
    _core.check_device_errors()


def test_gpu_indices_freed_on_another_stream_are_not_reused_before_the_kernel_reads_them():
    """The kernel reads device-resident indices in place, after the call returns: the binding
    records the transfer's stream on them (`record_stream`), so freeing them on the stream they
    were made on cannot hand their memory to a new tensor before the queued kernel has read
    them."""
    pool, dp = make_mha("page_first", 16, torch.bfloat16)
    fill_random_cuda(dp, 21)
    fill_random_host(pool, 22)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        host_tok = torch.arange(16, 32, device="cuda")
        dev_tok = torch.arange(32, 48, device="cuda")
    side.synchronize()
    before, host_before = snap_dev(dp), snap_host(pool)
    torch.cuda._sleep(200_000_000)  # the kernel queues behind this on the current stream
    pool.backup_from_device_all_layer(dp, host_tok, dev_tok, "kernel")
    with torch.cuda.stream(side):
        del host_tok, dev_tok
        # Without the recorded stream this allocation would take the freed index memory and
        # overwrite it before the kernel runs.
        junk = torch.full((64,), 10**6, dtype=torch.int64, device="cuda")
    torch.cuda.synchronize()
    _core.check_device_errors()  # no bad index was read
    want = expect_backup(pool, host_before, before, list(range(16, 32)), list(range(32, 48)))
    for p, (g, w) in enumerate(zip(snap_host(pool), want)):
        assert_same(g, w, f"host plane {p}")
    del junk


@pytest.mark.parametrize(
    "backend,layout",
    [
        ("kernel", "layer_first"),
        ("kernel", "page_first"),
        ("direct", "layer_first"),
    ],
)
def test_strided_device_rows_round_trip_on_the_gpu(backend, layout):
    # SGLang 0.5.22+'s unified pools: each CUDA layer a view of one token-major buffer (every
    # layer's K and V row of a token, then spare elements); our kernels and the copy engine step
    # device rows by that stride and leave the rest of each entry alone.
    pool, dp = make_mha(layout, 16, torch.bfloat16)
    rows, row, pad = dp.k_buffer[0].shape[0], 4 * 24, 8
    gen = torch.Generator(device="cuda").manual_seed(5)
    entries = torch.randn(rows, LAYERS * 2 * row + pad, device="cuda", generator=gen)
    entries = entries.to(torch.bfloat16)
    views = [entries[:, i * row : (i + 1) * row].view(rows, 4, 24) for i in range(2 * LAYERS)]
    dp.k_buffer, dp.v_buffer = views[0::2], views[1::2]
    host = type(pool)(dp, 2.0, 0, 16, layout)
    assert not host.device_rows_packed
    h, d = host.alloc(32), torch.arange(16, 48, device="cuda")
    host.backup_from_device_all_layer(dp, h, d, backend)
    want = entries.clone()
    d2 = torch.arange(48, 80, device="cuda")
    want[d2, : LAYERS * 2 * row] = entries[d, : LAYERS * 2 * row]
    for layer in range(LAYERS):
        host.load_to_device_per_layer(dp, h, d2, layer, backend)
    torch.cuda.synchronize()
    _core.check_device_errors()
    assert torch.equal(entries, want)
