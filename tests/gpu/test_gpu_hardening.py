"""The CUDA path's production guards on a real GPU (issue 12; the CPU-side proofs are in
tests/core/test_cuda_driver.py):

* the copy kernel's resources: 256-thread blocks, <= 64 registers, no local memory, 4 blocks per
  SM, so a copy block never needs (or holds) a whole SM;
* destroy() waits for its own transfers only (not for a long kernel on another stream), and a
  wait that cannot end is a bounded error, the memory still pinned;
* destroy() racing transfers from other threads leaves CUDA healthy (no illegal address);
* direct copies across registration chunk seams; registration capped at the chunk limit;
* two refused bad-index launches are both counted;
* a transfer on a capturing stream is refused, the capture stays usable;
* the first transfer (PTX JIT) releases the GIL;
* one driver library in the process.

Child processes isolate the tests that could leave CUDA broken if the guard failed."""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest
import torch
from hostkv_rs import MHATokenToKVPool, TransferError, _core, get_mha_host_pool_cls
from reference import device_planes, host_planes

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PTX = os.path.join(ROOT, "rust", "kernels", "hostkv_transfer.ptx")


def make_pool(layout="page_first", layers=4, pages=8, page_size=16):
    dp = MHATokenToKVPool(
        pages * page_size, page_size, torch.bfloat16, 4, 32, layers, device="cuda"
    )
    return get_mha_host_pool_cls(dp)(dp, 2.0, 0, page_size, layout), dp


def fill(dp, host_pool, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    for plane in device_planes(dp):
        for t in plane:
            t.copy_(torch.randint(0, 256, t.shape, dtype=torch.uint8, device="cuda", generator=g))
    gh = torch.Generator().manual_seed(seed + 1)
    for p in host_planes(host_pool):
        p.copy_(torch.randint(0, 256, p.shape, dtype=torch.uint8, generator=gh))
    torch.cuda.synchronize()


def sleep_cycles(seconds):
    # torch.cuda._sleep spins for a number of GPU clock cycles; ~2 GHz is an upper bound for the
    # GPUs this runs on, so the kernel lasts at least `seconds`.
    return int(seconds * 2.0e9)


def run_child(code, timeout=180, **env):
    full_env = dict(os.environ)
    full_env.update({k: str(v) for k, v in env.items()})
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        check=False,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=full_env,
        cwd=os.path.dirname(os.path.abspath(__file__)),
    )
    out = done.stdout + done.stderr
    assert done.returncode == 0 and "CHILD OK" in done.stdout, out[-4000:]
    return out


def test_smoke_copy_kernel_resources_leave_room_for_the_forward_pass():
    torch.zeros(1, device="cuda")  # torch's primary context is current on this thread
    cu = ctypes.CDLL("libcuda.so.1")
    with open(PTX, "rb") as f:
        image = f.read() + b"\0"
    mod = ctypes.c_void_p()
    assert cu.cuModuleLoadData(ctypes.byref(mod), image) == 0
    try:
        for name in (b"hkv_transfer", b"hkv_check_indices"):
            fn = ctypes.c_void_p()
            assert cu.cuModuleGetFunction(ctypes.byref(fn), mod, name) == 0

            def attr(a, fn=fn):
                v = ctypes.c_int()
                assert cu.cuFuncGetAttribute(ctypes.byref(v), a, fn) == 0
                return v.value

            max_threads, local_bytes, regs = attr(0), attr(3), attr(4)
            blocks = ctypes.c_int()
            assert (
                cu.cuOccupancyMaxActiveBlocksPerMultiprocessor(
                    ctypes.byref(blocks), fn, 256, ctypes.c_size_t(0)
                )
                == 0
            )
            print(
                f"{name.decode()}: {regs} registers, {local_bytes} B local, max "
                f"{max_threads} threads/block, {blocks.value} blocks/SM at 256 threads"
            )
            assert max_threads == 256, max_threads
            assert local_bytes == 0, "register spills (local memory)"
            assert regs <= 64, regs
            assert blocks.value >= 4, blocks.value
    finally:
        cu.cuModuleUnload(mod)


def test_destroy_waits_for_its_own_transfer_not_for_another_stream():
    pool, dp = make_pool()
    fill(dp, pool, 3)
    host = host_planes(pool)  # views that outlive destroy()
    other, side = torch.cuda.Stream(), torch.cuda.Stream()
    with torch.cuda.stream(other):  # stands for an NCCL kernel that takes long (or never ends)
        torch.cuda._sleep(sleep_cycles(4))
    h = torch.arange(32, 64)
    d = torch.arange(64, 96)
    with torch.cuda.stream(side):
        pool.backup_from_device_all_layer(dp, h, d, "kernel")
    t0 = time.monotonic()
    pool.destroy()
    took = time.monotonic() - t0
    assert took < 2.0, f"destroy() waited {took:.1f} s: it waited for another stream's kernel"
    side.synchronize()
    # The backup had finished before the memory was unpinned: the rows are in the host planes.
    for p, plane in enumerate(device_planes(dp)):
        for layer, t in enumerate(plane):
            rows = t[d.cuda()].cpu()
            got = torch.stack([pool_row(host[p], pool, int(r), layer) for r in h])
            assert torch.equal(got, rows), (p, layer)
    other.synchronize()


def pool_row(plane_bytes, pool, row, layer):
    """Bytes of (row, layer) in a page_first host plane."""
    item = pool.token_stride_size
    off = (row * pool.layer_num + layer) * item
    return plane_bytes[off : off + item]


def test_unregister_wait_is_bounded_and_leaves_the_memory_pinned(monkeypatch):
    monkeypatch.setenv("HOSTKV_UNREGISTER_TIMEOUT_S", "0.5")
    pool, dp = make_pool()
    region = pool._host_regions[0]
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        torch.cuda._sleep(sleep_cycles(3))
        pool.backup_from_device_all_layer(dp, torch.arange(16), torch.arange(16), "kernel")
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="timed out after 0.5 s"):
        region.unregister_cuda()
    assert time.monotonic() - t0 < 2.0
    assert region.pinned
    s.synchronize()
    region.unregister_cuda()
    assert not region.pinned


def test_destroy_racing_transfers_leaves_cuda_healthy():
    run_child(
        """
        import threading, time, torch
        from hostkv_rs import MHATokenToKVPool, get_mha_host_pool_cls
        for rnd in range(3):
            dp = MHATokenToKVPool(256, 16, torch.bfloat16, 8, 64, 8, device="cuda")
            pool = get_mha_host_pool_cls(dp)(dp, 2.0, 0, 16, "layer_first")
            errors = []
            def work(k):
                s = torch.cuda.Stream()
                for i in range(40):
                    backend = "kernel" if (i + k) % 2 else "direct"
                    idx = torch.arange(16 * (i % 8), 16 * (i % 8) + 64)
                    try:
                        with torch.cuda.stream(s):
                            pool.backup_from_device_all_layer(dp, idx, idx, backend)
                    except RuntimeError as e:
                        if not any(w in str(e) for w in ("destroyed", "unregistered",
                                                         "not registered", "registered with")):
                            errors.append(str(e))
                s.synchronize()
            ts = [threading.Thread(target=work, args=(k,)) for k in range(3)]
            for t in ts:
                t.start()
            time.sleep(0.002 * (rnd + 1))
            pool.destroy()
            for t in ts:
                t.join()
            assert not errors, errors[:3]
        torch.cuda.synchronize()
        x = torch.ones(1 << 20, device="cuda")
        assert float(x.sum().item()) == float(1 << 20)
        print("CHILD OK")
        """,
    )


@pytest.mark.parametrize("backend", ["direct", "kernel"])
def test_copies_across_registration_chunk_seams(backend):
    L, S, P, item = 4, 512, 16, 80  # 160 KiB per layer: several 64 KiB chunks per layer
    nbytes = _core.HostPool.plane_nbytes("layer_first", L, S, P, item)
    region = _core.HostRegion(nbytes)
    region.register_cuda(0, 64 << 10)  # no granularity: capped, page-aligned chunks
    ranges = region.registered_ranges
    assert len(ranges) > 2 and max(n for _, n in ranges) <= 64 << 10, ranges
    assert torch.frombuffer(region, dtype=torch.uint8).is_pinned()
    core = _core.HostPool.from_geometry("layer_first", L, S, P, [item], [region])
    dev = [torch.randint(0, 256, (S, item), dtype=torch.uint8, device="cuda") for _ in range(L)]
    host = np.frombuffer(region, dtype=np.uint8).reshape(L, S, item)
    host[:] = 0
    hi = torch.arange(0, S)  # one run per layer, across every seam
    di = torch.arange(0, S)
    stream = torch.cuda.current_stream().cuda_stream
    core.backup(
        backend,
        [t.data_ptr() for t in dev],
        S,
        (hi.data_ptr(), S, 8, False),
        (di.data_ptr(), S, 8, False),
        "cuda",
        stream,
    )
    torch.cuda.synchronize()
    for layer in range(L):
        assert np.array_equal(host[layer], dev[layer].cpu().numpy()), layer
    for t in dev:
        t.zero_()
    for layer in range(L):
        core.load(
            backend,
            layer,
            [dev[layer].data_ptr()],
            S,
            (hi.data_ptr(), S, 8, False),
            (di.data_ptr(), S, 8, False),
            "cuda",
            stream,
        )
    torch.cuda.synchronize()
    for layer in range(L):
        assert np.array_equal(host[layer], dev[layer].cpu().numpy()), layer
    _core.check_device_errors()
    region.unregister_cuda()


def test_smoke_two_refused_launches_are_both_counted():
    pool, dp = make_pool("page_first")
    host_before = [p.numpy().copy() for p in host_planes(pool)]
    h = torch.arange(16, 32, device="cuda")
    bad1 = torch.arange(32, 48, device="cuda")
    bad1[3] = 10**6
    bad2 = torch.arange(32, 48, device="cuda")
    bad2[5] = -2
    torch.cuda.synchronize()
    # Both queued behind a busy stream: the second runs while the first report is unread.
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        torch.cuda._sleep(sleep_cycles(0.2))
        pool.backup_from_device_all_layer(dp, h, bad1, "kernel")
        pool.backup_from_device_all_layer(dp, h, bad2, "kernel")
    torch.cuda.synchronize()
    with pytest.raises(TransferError, match=r"^device index 1000000 .*2 CUDA transfers were"):
        _core.check_device_errors()
    _core.check_device_errors()
    for g, w in zip(host_planes(pool), host_before):
        assert np.array_equal(g.numpy(), w), "a refused backup wrote host bytes"


def test_transfer_on_a_capturing_stream_is_refused():
    run_child(
        """
        import torch
        from hostkv_rs import MHATokenToKVPool, get_mha_host_pool_cls
        dp = MHATokenToKVPool(128, 16, torch.bfloat16, 4, 32, 2, device="cuda")
        pool = get_mha_host_pool_cls(dp)(dp, 2.0, 0, 16, "page_first")
        h, d = torch.arange(16), torch.arange(16, 32)
        x = torch.zeros(4, device="cuda")
        g, s = torch.cuda.CUDAGraph(), torch.cuda.Stream()
        try:
            with torch.cuda.graph(g, stream=s):
                x.add_(1)
                pool.load_to_device_per_layer(dp, h, d, 0, "kernel")
        except RuntimeError as e:
            assert "capturing a CUDA graph" in str(e), e
        else:
            raise AssertionError("a transfer was captured into a CUDA graph")
        torch.cuda.synchronize()
        pool.load_to_device_per_layer(dp, h, d, 0, "kernel")  # outside the capture: fine
        torch.cuda.synchronize()
        print("CHILD OK")
        """,
    )


def test_first_transfer_releases_the_gil():
    run_child(
        """
        import threading, time, torch
        from hostkv_rs import MHATokenToKVPool, get_mha_host_pool_cls
        dp = MHATokenToKVPool(128, 16, torch.bfloat16, 4, 32, 2, device="cuda")
        pool = get_mha_host_pool_cls(dp)(dp, 2.0, 0, 16, "page_first")
        torch.cuda.synchronize()
        ticks, stop = [0], [False]
        def ticker():
            while not stop[0]:
                ticks[0] += 1
        t = threading.Thread(target=ticker); t.start()
        time.sleep(0.05)
        before = ticks[0]
        t0 = time.monotonic()
        pool.load_to_device_per_layer(dp, torch.arange(16), torch.arange(16), 0, "kernel")
        took = time.monotonic() - t0
        during = ticks[0] - before
        stop[0] = True; t.join()
        torch.cuda.synchronize()
        print(f"first transfer (PTX JIT) took {took * 1e3:.1f} ms; ticker ran {during} times")
        assert during > 0 or took < 0.02, "the first transfer held the GIL while it blocked"
        print("CHILD OK")
        """,
        CUDA_CACHE_DISABLE=1,
    )


def test_smoke_one_driver_library_in_the_process():
    torch.zeros(1, device="cuda")
    assert _core.cuda_available(), _core.runtime_info()
    files = set()
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split()
            if len(parts) >= 6 and os.path.basename(parts[5]).startswith("libcuda.so"):
                st = os.stat(parts[5])
                files.add((st.st_dev, st.st_ino))
    assert len(files) == 1, f"{len(files)} different libcuda files are mapped"


def test_pinned_pool_unregisters_from_a_thread_that_never_used_cuda():
    pool, dp = make_pool()
    pool.backup_from_device_all_layer(dp, torch.arange(16), torch.arange(16), "kernel")
    region = pool._host_regions[0]
    done = []
    t = threading.Thread(target=lambda: done.append(region.unregister_cuda()))
    t.start()
    t.join(timeout=60)
    assert done == [None] and not region.pinned
    torch.cuda.synchronize()


@pytest.mark.parametrize("layout", ["layer_first", "page_first", "page_first_direct", "page_head"])
@pytest.mark.parametrize("item", [3, 12, 66])
def test_smoke_items_that_are_not_a_multiple_of_8_through_the_raw_kernel_path(layout, item):
    """The kernel's 1-, 4- and 2-byte copy paths (3-, 12- and 66-byte items), both directions,
    against the CPU engine on the same indices: byte-exact, and nothing outside the rows."""
    L, S, P, dev_rows = 3, 64, 4, 48
    heads = 3 if layout == "page_head" and item % 3 == 0 else 1
    nbytes = _core.HostPool.plane_nbytes(layout, L, S, P, item)
    region = _core.HostRegion(nbytes)
    region.register_cuda(0)
    host = np.frombuffer(region, dtype=np.uint8)
    core = _core.HostPool.from_geometry(layout, L, S, P, [item], [region], heads)
    g = torch.Generator().manual_seed(item)
    dev_cpu = [
        torch.randint(0, 256, (dev_rows, item), dtype=torch.uint8, generator=g) for _ in range(L)
    ]
    dev = [t.cuda() for t in dev_cpu]
    host[:] = 0
    # Whole pages (page_first_direct reads the first index of each page), shuffled.
    pages = [5, 1, 12, 7]
    hi = torch.tensor([p * P + t for p in pages for t in range(P)])
    di = torch.tensor([q * P + t for q in [9, 0, 4, 2] for t in range(P)])
    args = lambda idx: (idx.data_ptr(), idx.numel(), 8, False)
    stream = torch.cuda.current_stream().cuda_stream
    core.backup("kernel", [t.data_ptr() for t in dev], dev_rows, args(hi), args(di), "cuda", stream)
    torch.cuda.synchronize()
    _core.check_device_errors()
    # The same backup by the CPU engine into a second host plane is the oracle.
    want = torch.zeros(nbytes, dtype=torch.uint8)
    ref = _core.HostPool.from_geometry(layout, L, S, P, [item], [want], heads)
    ref.backup("kernel", [t.data_ptr() for t in dev_cpu], dev_rows, args(hi), args(di), "cpu", 0)
    assert np.array_equal(host, want.numpy()), "GPU backup differs from the CPU engine"
    assert want.count_nonzero() > 0, "nothing moved, so the test could not fail"
    for t in dev:
        t.zero_()
    for layer in range(L):
        core.load(
            "kernel", layer, [dev[layer].data_ptr()], dev_rows, args(hi), args(di), "cuda", stream
        )
    torch.cuda.synchronize()
    _core.check_device_errors()
    rows = di.view(-1)
    for layer in range(L):
        got = dev[layer].cpu()
        assert torch.equal(got[rows], dev_cpu[layer][rows]), (layout, item, layer)
        others = torch.ones(dev_rows, dtype=torch.bool)
        others[rows] = False
        assert got[others].count_nonzero() == 0, "bytes written outside the loaded rows"
    region.unregister_cuda()
