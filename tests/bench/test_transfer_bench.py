"""pytest-benchmark suite: host-pool transfers against the core alone, plain torch indexing and one
contiguous copy of the same bytes, per pool kind x layout x backend.

The test command runs it with `--benchmark-disable` (each body runs once, so CI checks that every
case still works); measure with

    cd tests && python -m pytest bench -p no:cacheprovider --benchmark-enable \
        --benchmark-autosave --benchmark-group-by=group --benchmark-columns=min,median,mean,ops

and compare two saved runs with `--benchmark-compare=0001 --benchmark-compare-fail=none`.

Cases (group = kind/layout/backend/case; variants inside a group: pool, core, torch, memmove,
nt):

* load-1page, load-64page: one load_to_device_per_layer call (8 layers, page size 64);
* backup-8L, backup-61L: one backup_from_device_all_layer call of 8 pages;
* row-load, row-backup-61L: page size 1, one token (one layer / all 61 layers): the fixed cost.

`core` is the same call on the pool's Rust core (`HostPool.load/backup`) with the arguments the
pool would pass, so pool - core is the Python glue; `torch` is what a Python pool would write
(`host[h] = dev[d]` per layer and plane, on the pool's own buffer views); the two yardsticks are
one contiguous copy of the same number of bytes on one thread: `memmove` (glibc, ordinary stores)
and `nt` (`_core.stream_copy`, streaming stores). Not torch's `copy_`, which spreads a copy over
its OpenMP pool and stalls on a busy machine.
"""

from __future__ import annotations

import ctypes
import functools

import pytest
import torch
from hostkv_rs import (
    DeepSeekV4PagedHostPool,
    MHATokenToKVPool,
    MLATokenToKVPool,
    _core,
    get_mha_host_pool_cls,
)
from hostkv_rs.pools.mla import MLATokenToKVPoolHost
from hostkv_rs.tools import bench

# The pairs each pool kind serves, from the core (core/test_host_pool.py checks them against the
# contract's matrix written out in reference.py).
PAIRS = {**bench.PAIRS, "v4": _core.supported_pairs("v4_paged")}
# case -> (layers, page size, pages moved, op)
CASES = {
    "load-1page": (8, 64, 1, "load"),
    "load-64page": (8, 64, 64, "load"),
    "backup-8L": (8, 64, 8, "backup"),
    "backup-61L": (61, 64, 8, "backup"),
    "row-load": (8, 1, 1, "load"),
    "row-backup-61L": (61, 1, 1, "backup"),
}
# Llama-3.1-8B (8 KV heads x 128, bf16), MiMo-V2 asymmetric (4 x 192 / 4 x 128), DeepSeek MLA
# (576 x bf16), and a DeepSeek V4 C4-sized page row.
V4_ITEM = 37440
VARIANTS = ("pool", "core", "torch", "memmove", "nt")


def _params():
    for kind, pairs in PAIRS.items():
        for layout, backend in pairs:
            for case in CASES:
                for variant in VARIANTS:
                    yield pytest.param(
                        kind,
                        layout,
                        backend,
                        case,
                        variant,
                        id=f"{kind}-{layout}-{backend}-{case}-{variant}",
                    )


@functools.lru_cache(maxsize=1)
def _world(kind: str, layout: str, layers: int, page_size: int, pages: int):
    """(host pool, device pool, host index tensor, device index tensor); cached, so a group's four
    variants share one pool pair."""
    torch.manual_seed(0)
    device_tokens = (pages + 1) * page_size
    if kind == "v4":
        rows = pages + 1
        dev = [torch.randint(0, 255, (rows, V4_ITEM), dtype=torch.uint8) for _ in range(layers)]
        host = DeepSeekV4PagedHostPool("c4", dev, V4_ITEM, 2 * pages, page_size, layout)
        h = host.alloc(pages * page_size)
        d = torch.arange(page_size, (pages + 1) * page_size)
        return host, dev, h, d
    if kind == "mla":
        dp = MLATokenToKVPool(device_tokens, page_size, torch.bfloat16, 512, 64, layers)
        host = MLATokenToKVPoolHost(dp, 2.0, 0, page_size, layout)
    else:
        heads, head_dim = (8, 128) if kind == "mha" else (4, 192)
        dp = MHATokenToKVPool(
            device_tokens, page_size, torch.bfloat16, heads, head_dim, layers, v_head_dim=128
        )
        host = get_mha_host_pool_cls(dp)(dp, 2.0, 0, page_size, layout)
    for plane in _device_planes(dp):
        for t in plane:
            t.view(torch.uint8).random_()
    h = host.alloc(pages * page_size)
    d = torch.arange(page_size, (pages + 1) * page_size)
    return host, dp, h, d


def _device_planes(dp) -> list[list[torch.Tensor]]:
    if isinstance(dp, list):
        return [dp]
    if hasattr(dp, "kv_buffer"):
        return [dp.kv_buffer]
    return [dp.k_buffer, dp.v_buffer]


def _nbytes(dp, pages: int, page_size: int, layers_moved: int) -> int:
    row = sum(t[0].nbytes for plane in _device_planes(dp) for t in plane[:1])
    # A V4 device row is a whole slot page; elsewhere a row is one token.
    rows = pages if isinstance(dp, list) else pages * page_size
    return row * rows * layers_moved


def _torch_ops(host, dp, layout: str, h, d, page_size: int, op: str):
    """What a Python pool would write: per plane and layer, one advanced-indexing copy between
    the device layer and the pool's own buffer view (in place on both sides)."""
    planes = _device_planes(dp)
    if isinstance(host, DeepSeekV4PagedHostPool):
        rows_h, rows_d = h[::page_size] // page_size, d[::page_size] // page_size
        buf = host.kv_buffer

        def host_index(layer):
            if layout == "layer_first":
                return buf[layer], (rows_h,)
            if layout == "page_first":
                return buf, (rows_h, layer)
            return buf, (rows_h, layer, 0)

        pairs = [(host_index(l), planes[0][l], rows_d) for l in range(len(planes[0]))]
    else:
        names = ("kv_buffer",) if hasattr(dp, "kv_buffer") else ("k_buffer", "v_buffer")
        hp, hr = h // page_size, h % page_size
        pairs = []
        for c, (name, plane) in enumerate(zip(names, planes)):
            buf = host.kv_buffer if name == "kv_buffer" else getattr(host, name)
            for layer in range(len(plane)):
                if layout == "page_unified" and name == "kv_buffer":  # MLA (Pn, L, P, D)
                    index = (buf, (hp, layer, hr))
                elif layout == "page_unified":  # (Pn, G, L, 2, P, H/G, D)
                    index = (host.kv_buffer, (hp, slice(None), layer, c, hr))
                elif layout == "layer_first":
                    index = (buf[layer], (h,))
                elif layout == "page_first":
                    index = (buf, (h, layer))
                elif layout == "page_first_direct":
                    index = (buf, (hp, layer, hr))
                else:  # page_head [pages, heads, P, L, D]
                    index = (buf, (hp, slice(None), hr, layer))
                pairs.append((index, plane[layer], d))
    if op == "load":
        pairs = pairs[: len(planes)] if len(planes) == 1 else [pairs[0], pairs[len(pairs) // 2]]

        def fn():
            for (hbuf, hidx), dev, didx in pairs:
                dev[didx] = hbuf[hidx].reshape(dev[didx].shape)
    else:

        def fn():
            for (hbuf, hidx), dev, didx in pairs:
                hbuf[hidx] = dev[didx].reshape(hbuf[hidx].shape)

    return fn


def _call(host, dp, h, d, backend, op, core: bool):
    if op == "load":
        if core:
            return _core_call(host, dp, h, d, backend, "load")
        return lambda: host.load_to_device_per_layer(dp, h, d, 0, backend)
    if core:
        return _core_call(host, dp, h, d, backend, "backup")
    return lambda: host.backup_from_device_all_layer(dp, h, d, backend)


def _core_call(host, dp, h, d, backend, op):
    """The pool's Rust core called directly with the arguments the pool passes it."""
    if isinstance(host, DeepSeekV4PagedHostPool):
        pytest.skip("the V4 pool reaches its cores only through its device bindings")
    core = host._pool_core
    # (address, length, itemsize, on_device): how the raw entry points take an index array.
    h32, d32 = ((t.data_ptr(), t.numel(), t.element_size(), t.is_cuda) for t in (h, d))
    planes = [list(getattr(dp, name)) for name in host._device_plane_names]
    rows = min(t.shape[0] for plane in planes for t in plane)
    if op == "load":
        ptrs = [plane[0].data_ptr() for plane in planes]
        return lambda: core.load(backend, 0, ptrs, rows, h32, d32, "cpu", 0)
    ptrs = [t.data_ptr() for plane in planes for t in plane]
    return lambda: core.backup(backend, ptrs, rows, h32, d32, "cpu", 0)


@pytest.mark.parametrize(("kind", "layout", "backend", "case", "variant"), list(_params()))
def test_transfer(benchmark, kind, layout, backend, case, variant):
    layers, page_size, pages, op = CASES[case]
    if kind == "v4" and page_size == 1:
        pytest.skip("V4 rows are whole slot pages; page size 1 is the same call as 1 page")
    host, dp, h, d = _world(kind, layout, layers, page_size, pages)
    benchmark.group = f"{kind}/{layout}/{backend}/{case}"
    layers_moved = layers if op == "backup" else 1
    benchmark.extra_info["bytes"] = _nbytes(dp, pages, page_size, layers_moved)
    if variant in ("pool", "core"):
        fn = _call(host, dp, h, d, backend, op, core=variant == "core")
    elif variant == "torch":
        fn = _torch_ops(host, dp, layout, h, d, page_size, op)
    else:
        n = benchmark.extra_info["bytes"]
        src, dst = torch.ones(n, dtype=torch.uint8), torch.zeros(n, dtype=torch.uint8)
        if variant == "memmove":
            fn = functools.partial(ctypes.memmove, dst.data_ptr(), src.data_ptr(), n)
        else:
            fn = functools.partial(_core.stream_copy, dst.numpy(), src.numpy())

    benchmark(fn)
