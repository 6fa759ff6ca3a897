"""The CUDA driver code of the Rust core (rust/src/cuda) run end to end on the CPU against a
stand-in libcuda.so (tests/mock_driver/mock_libcuda.cpp): probe, context binding, pinned
registration and its rollback, PTX module load, kernel launches, staging buffers recycled through
events, the device error record, and the direct backend's batch / per-copy submission for 12.x
and 13.x drivers.

The mock queues work per stream and runs it only when something synchronises, so a host buffer
reused before the queued work ran shows up as wrong bytes; it records protocol violations (a call
without a current context, a released context made current, unregistering memory with work
queued, ...). Each scenario runs in its own process with LD_LIBRARY_PATH pointing at the mock
(cudarc opens `libcuda.so` by name). The expected bytes come from the CPU engine on copies of
the same pools."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# The mock runs the real kernels, so it includes them (and the emulation shim) from the crate.
KERNELS = os.path.join(ROOT, "rust", "kernels")
MOCK_SRC = os.path.join(ROOT, "tests", "mock_driver", "mock_libcuda.cpp")


@pytest.fixture(scope="module")
def mock_dir(tmp_path_factory):
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if not cxx or not os.path.exists(MOCK_SRC):
        pytest.skip("needs a C++ compiler and tests/mock_driver/mock_libcuda.cpp")
    out = tmp_path_factory.mktemp("mock_cuda")
    cmd = [
        cxx, "-std=c++17", "-O1", "-shared", "-fPIC", "-fvisibility=hidden",
        "-I", KERNELS, MOCK_SRC, "-o", str(out / "libcuda.so"), "-ldl",
    ]  # fmt: skip
    done = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    # The name the dynamic loader and torch load the driver by resolves to the same file.
    os.symlink("libcuda.so", out / "libcuda.so.1")
    return str(out)


PRELUDE = r'''
import ctypes, gc, os, sys, threading
import numpy as np
import hostkv_rs
from hostkv_rs import _core

m = ctypes.CDLL("libcuda.so")
for name, res in [("mock_stream_create", ctypes.c_uint64), ("mock_current_ctx", ctypes.c_uint64),
                  ("mock_primary_ctx", ctypes.c_uint64), ("mock_violation_text", ctypes.c_char_p),
                  ("mock_pending_ops", ctypes.c_long), ("mock_registrations", ctypes.c_long),
                  ("mock_counter", ctypes.c_long), ("mock_ctx_created", ctypes.c_long),
                  ("mock_registration_size", ctypes.c_longlong), ("mock_registration_device", ctypes.c_int),
                  ("mock_capture_invalidations", ctypes.c_long)]:
    getattr(m, name).restype = res
m.mock_label.argtypes = [ctypes.c_uint64, ctypes.c_uint64, ctypes.c_int]
m.mock_stream_capture.argtypes = [ctypes.c_uint64, ctypes.c_int]
m.mock_enqueue_hang.argtypes = [ctypes.c_uint64]
m.cuCtxSetCurrent.argtypes = [ctypes.c_uint64]
if os.environ.get("PRELOAD_DRIVER"):
    # Another copy of the driver library, mapped first (as torch's libcuda.so.1 would be).
    ctypes.CDLL(os.environ["PRELOAD_DRIVER"])
assert "Mock GPU" in _core.runtime_info() or os.environ.get("EXPECT_UNAVAILABLE"), \
    _core.runtime_info()

def no_violations():
    assert m.mock_violations() == 0, m.mock_violation_text()

def arr(a, on_device=False):
    return (a.ctypes.data, a.size, a.itemsize, on_device)

class Pool:
    """A registered host pool, device layers labelled as GPU memory, and CPU twins of both."""

    def __init__(self, layout, items, layers=3, rows=32, page=4, heads=1, dev_rows=24,
                 backup=True, device=0, granularity=0, chunk_limit=1 << 30, seed=0):
        self.layout, self.items, self.layers, self.rows = layout, items, layers, rows
        self.page, self.heads, self.dev_rows, self.backup = page, heads, dev_rows, backup
        rng = np.random.default_rng(seed)
        sizes = [_core.HostPool.plane_nbytes(layout, layers, rows, page, i, heads) for i in items]
        self.region = _core.HostRegion(sum(sizes))
        self.region.register_cuda(granularity, chunk_limit)
        self.twin = _core.HostRegion(sum(sizes))
        host = np.frombuffer(self.region, dtype=np.uint8)
        host[:] = rng.integers(0, 256, host.size, dtype=np.uint8)
        np.frombuffer(self.twin, dtype=np.uint8)[:] = host
        offs = np.cumsum([0] + sizes[:-1])
        self.core = self._core(self.region, offs)
        self.core_cpu = self._core(self.twin, offs)
        nlayers = layers if backup else 1
        self.dev = [rng.integers(0, 256, (dev_rows, i), dtype=np.uint8)
                    for i in items for _ in range(nlayers)]
        for d in self.dev:
            m.mock_label(d.ctypes.data, d.nbytes, device)
        self.dev_cpu = [d.copy() for d in self.dev]

    def _core(self, region, offs):
        return _core.HostPool.from_geometry(self.layout, self.layers, self.rows, self.page, self.items,
                              [(region, int(o)) for o in offs], self.heads)

    def run(self, backend, hi, di, stream, layer=0, hi_dev=False, di_dev=False):
        ptrs = [d.ctypes.data for d in self.dev]
        ptrs_cpu = [d.ctypes.data for d in self.dev_cpu]
        h, d = arr(hi, hi_dev), arr(di, di_dev)
        hi_cpu, di_cpu = hi.copy(), di.copy()  # kept alive for the calls below
        hc, dc = arr(hi_cpu), arr(di_cpu)
        if self.backup:
            self.core_cpu.backup(backend, ptrs_cpu, self.dev_rows, hc, dc, "cpu", 0)
            self.core.backup(backend, ptrs, self.dev_rows, h, d, "cuda", stream)
        else:
            self.core_cpu.load(backend, layer, ptrs_cpu, self.dev_rows, hc, dc, "cpu", 0)
            self.core.load(backend, layer, ptrs, self.dev_rows, h, d, "cuda", stream)

    def check(self, what=""):
        got = np.frombuffer(self.region, dtype=np.uint8)
        want = np.frombuffer(self.twin, dtype=np.uint8)
        assert np.array_equal(got, want), f"host bytes differ {what}"
        for k, (g, w) in enumerate(zip(self.dev, self.dev_cpu)):
            assert np.array_equal(g, w), f"device layer buffer {k} differs {what}"

def indices(n, bound, dtype, seed):
    return np.random.default_rng(seed).permutation(bound)[:n].astype(dtype)

def labelled(a, device=0):
    m.mock_label(a.ctypes.data, max(a.nbytes, 1), device)
    return a

def four_workers_beside_a_busy_thread(worker):
    """worker(k) for k in 0..3 on threads of their own, next to a pure-Python thread that never
    releases the GIL on its own; raises with every worker's exception."""
    stop, errors = threading.Event(), []

    def busy():
        n = 0
        while not stop.is_set():
            n += 1

    def guarded(k):
        try:
            worker(k)
        except BaseException as exc:
            errors.append(f"thread {k}: {exc!r}")

    spin = threading.Thread(target=busy)
    spin.start()
    workers = [threading.Thread(target=guarded, args=(k,)) for k in range(4)]
    for t in workers:
        t.start()
    for t in workers:
        t.join()
    stop.set()
    spin.join()
    assert not errors, errors
'''


def run_scenario(mock_dir, body, **env):
    """Run PRELUDE + body in a fresh interpreter against the mock driver; returns its stdout."""
    import hostkv_rs

    pkg_root = os.path.dirname(os.path.dirname(os.path.abspath(hostkv_rs.__file__)))
    child_env = dict(os.environ)
    child_env["LD_LIBRARY_PATH"] = mock_dir
    child_env["PYTHONPATH"] = os.pathsep.join(
        [pkg_root] + [p for p in child_env.get("PYTHONPATH", "").split(os.pathsep) if p]
    )
    for k in list(child_env):
        if k.startswith(("MOCK_", "HOSTKV_")):
            del child_env[k]
    child_env.update({k: str(v) for k, v in env.items()})
    script = PRELUDE + textwrap.dedent(body) + "\nno_violations()\nprint('SCENARIO OK')\n"
    done = subprocess.run(
        [sys.executable, "-c", script],
        check=False,
        env=child_env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    out = done.stdout + done.stderr
    assert done.returncode == 0 and "SCENARIO OK" in done.stdout, out[-6000:]
    return done.stdout


def test_kernel_path_every_layout_direction_width_and_residency(mock_dir):
    run_scenario(
        mock_dir,
        """
        s = m.mock_stream_create(0)
        cases = [("layer_first", [40, 12], 1), ("page_first", [48, 24], 1),
                 ("page_first_direct", [16], 1), ("page_head", [48, 24], 2),
                 ("page_head", [656], 8)]
        seed = 0
        for layout, items, heads in cases:
            for backup in (True, False):
                for dtype in (np.int32, np.int64):
                    for hi_dev, di_dev in ((False, False), (True, True), (False, True)):
                        seed += 1
                        pool = Pool(layout, items, heads=heads, backup=backup, seed=seed)
                        hi = indices(9, pool.rows, dtype, seed)
                        di = indices(9, pool.dev_rows, dtype, seed + 1000)
                        if hi_dev:
                            labelled(hi)
                        if di_dev:
                            labelled(di)
                        pool.run("kernel", hi, di, s, layer=2, hi_dev=hi_dev, di_dev=di_dev)
                        assert m.mock_current_ctx() == 0, "the call left a context bound"
                        assert m.mock_pending_ops() > 0, "nothing was queued"
                        # Host-resident indices were copied at the call: scribbling over them
                        # now must not change what the queued kernel moves.
                        if not hi_dev:
                            hi[:] = -5
                        if not di_dev:
                            di[:] = 10**6
                        m.mock_sync_all()
                        pool.check(f"{layout} backup={backup} {dtype} {hi_dev}/{di_dev}")
        _core.check_device_errors()
        """,
    )


def test_queued_launches_never_overwrite_staging_a_kernel_still_reads(mock_dir):
    # 80 launches queue up before anything runs (more than the 32 staging buffers kept per
    # context, so later calls must wait for an event); 131 layers x 2 planes also put the
    # device layer table in staging memory.
    run_scenario(
        mock_dir,
        """
        s = m.mock_stream_create(0)
        pool = Pool("page_first", [16, 8], layers=131, rows=96, dev_rows=96, backup=True)
        for k in range(40):
            hi = indices(5, pool.rows, np.int64, k)
            di = indices(5, pool.dev_rows, np.int32, k + 500)
            pool.run("kernel", hi, di, s)
            hi[:] = 0
            di[:] = 0
        loads = Pool("layer_first", [24], layers=5, rows=64, dev_rows=64, backup=False)
        for k in range(40):
            hi = indices(7, loads.rows, np.int32, k)
            di = indices(7, loads.dev_rows, np.int64, k + 99)
            loads.run("kernel", hi, di, s, layer=k % 5)
            hi[:] = 0
            di[:] = 0
        assert m.mock_pending_ops() > 0
        m.mock_sync_all()
        pool.check("after 40 queued backups")
        loads.check("after 40 queued loads")
        assert m.mock_counter(0) == 80
        """,
    )


@pytest.mark.parametrize(
    "version,env,stream,counter",
    [
        (13000, {}, "side", 3),  # cuMemcpyBatchAsync_v2 (13.0 ABI)
        (12080, {}, "side", 2),  # cuMemcpyBatchAsync with failIdx (12.8 ABI)
        (12060, {}, "side", 1),  # no batch API: one cuMemcpyAsync per copy
        (13000, {}, "legacy", 1),  # the batch API refuses the legacy stream
        (13000, {"HOSTKV_DIRECT_BATCH": "0"}, "side", 1),
        (12080, {"MOCK_BATCH_UNSUPPORTED": "1"}, "side", 1),  # NOT_SUPPORTED -> per copy
    ],
)
def test_direct_backend_picks_the_batch_abi_at_run_time(mock_dir, version, env, stream, counter):
    run_scenario(
        mock_dir,
        f"""
        s = m.mock_stream_create(0) if "{stream}" == "side" else 0
        for layout in ("layer_first", "page_first_direct"):
            for backup in (True, False):
                pool = Pool(layout, [40, 24], backup=backup, rows=32, dev_rows=24, page=4)
                pages_h = np.array([5, 0, 3]); pages_d = np.array([2, 4, 1])
                hi = (pages_h[:, None] * 4 + np.arange(4)).reshape(-1)
                di = (pages_d[:, None] * 4 + np.arange(4)).reshape(-1)
                pool.run("direct", hi, di, s, layer=1)
                hi[:] = 0; di[:] = 0
                m.mock_sync_all()
                pool.check(f"{{layout}} backup={{backup}}")
                # GPU-resident indices are read back first (a blocking copy).
                hi = labelled((pages_h[:, None] * 4 + np.arange(4)).reshape(-1))
                di = labelled((pages_d[:, None] * 4 + np.arange(4)).reshape(-1))
                pool.run("direct", hi, di, s, layer=1, hi_dev=True, di_dev=True)
                m.mock_sync_all()
                pool.check(f"{{layout}} backup={{backup}} GPU-resident indices")
        assert m.mock_counter(4) == 8, m.mock_counter(4)  # 2 index arrays x 4 calls
        used = [m.mock_counter(k) for k in (1, 2, 3)]
        if os.environ.get("MOCK_BATCH_UNSUPPORTED"):
            # Asked once; after NOT_SUPPORTED every call copies one by one.
            assert used[1] == 1 and used[2] == 0 and used[0] > 0, used
        else:
            assert used[{counter} - 1] > 0 and sum(used) == used[{counter} - 1], used
        assert m.mock_counter(0) == 0
        """,
        MOCK_CUDA_VERSION=version,
        **env,
    )


def test_context_is_the_pointers_device_and_the_threads_context_is_restored(mock_dir):
    run_scenario(
        mock_dir,
        """
        # The thread's current context is device 0's (as torch leaves it), the pool is on GPU 1.
        c0 = ctypes.c_uint64()
        assert m.cuDevicePrimaryCtxRetain(ctypes.byref(c0), 0) == 0
        assert m.cuCtxSetCurrent(c0.value) == 0
        s1 = m.mock_stream_create(1)
        for backend, layout in (("kernel", "page_first"), ("direct", "page_first_direct")):
            pool = Pool(layout, [32], device=1, backup=False)
            hi = np.arange(8); di = np.arange(8, 16)
            pool.run(backend, hi, di, s1, layer=1)
            assert m.mock_current_ctx() == c0.value, "the caller's context was replaced"
            if backend == "kernel":
                assert m.mock_last_launch_device() == 1
            m.mock_sync_all()
            pool.check(backend)

        # A thread that never touched CUDA: bound for the call, unbound afterwards.
        pool = Pool("page_head", [48], heads=2, device=1)
        seen = {}
        def worker():
            pool.run("kernel", np.arange(4), np.arange(4, 8), s1)
            seen["ctx"] = m.mock_current_ctx()
        t = threading.Thread(target=worker); t.start(); t.join()
        assert seen == {"ctx": 0}, seen
        m.mock_sync_all()
        pool.check("from a fresh thread")

        # Device layers on two GPUs: refused before anything is queued.
        mixed = Pool("page_first", [16], device=1)
        labelled(mixed.dev[1], 0)
        before = m.mock_counter(0)
        try:
            mixed.run("kernel", np.arange(3), np.arange(3), s1)
        except _core.TransferError as e:
            assert "same device" in str(e), e
        else:
            raise AssertionError("mixed devices were accepted")
        # GPU-resident indices on the other GPU: refused too.
        ok = Pool("page_first", [16], device=1)
        try:
            ok.run("kernel", labelled(np.arange(3), 0), labelled(np.arange(3), 0), s1,
                   hi_dev=True, di_dev=True)
        except _core.TransferError as e:
            assert "index array" in str(e), e
        else:
            raise AssertionError("indices on another GPU were accepted")
        assert m.mock_counter(0) == before and m.mock_current_ctx() == c0.value
        # A stream of another device is the driver's to refuse; the error is reported.
        s0 = m.mock_stream_create(0)
        try:
            ok.run("kernel", np.arange(3), np.arange(3), s0)
        except RuntimeError as e:
            assert "cuMemcpyHtoDAsync" in str(e) or "cuLaunchKernel" in str(e), e
        else:
            raise AssertionError("a foreign stream was accepted")
        assert m.mock_current_ctx() == c0.value
        """,
        MOCK_DEVICES=2,
    )


def test_bad_gpu_index_reported_after_the_stream_ran_and_nothing_written(mock_dir):
    run_scenario(
        mock_dir,
        """
        s = m.mock_stream_create(0)
        pool = Pool("page_first", [32, 16], backup=True)
        before = np.frombuffer(pool.region, dtype=np.uint8).copy()
        hi = labelled(np.arange(6)); di = labelled(np.array([0, 1, 2, 99, 4, 5]))
        pool.core.backup("kernel", [d.ctypes.data for d in pool.dev], pool.dev_rows,
                         arr(hi, True), arr(di, True), "cuda", s)
        _core.check_device_errors()  # nothing has run yet: nothing to report
        m.mock_sync_all()
        try:
            _core.check_device_errors()
        except _core.TransferError as e:
            assert str(e).startswith("device index 99 "), e
        else:
            raise AssertionError("the bad index was not reported")
        _core.check_device_errors()  # reported once
        assert np.array_equal(np.frombuffer(pool.region, dtype=np.uint8), before)

        # Reported by the next transfer call, which then does not run.
        pool.core.backup("kernel", [d.ctypes.data for d in pool.dev], pool.dev_rows,
                         arr(hi, True), arr(di, True), "cuda", s)
        m.mock_sync_all()
        launches = m.mock_counter(0)
        good = np.arange(3)
        try:
            pool.run("kernel", good, good, s)
        except _core.TransferError as e:
            assert "device index 99" in str(e), e
        else:
            raise AssertionError("the pending error was not reported")
        assert m.mock_counter(0) == launches
        _core.check_device_errors()
        """,
    )


def test_registration_rollback_parallel_threads_and_unregister_after_queued_work(mock_dir):
    run_scenario(
        mock_dir,
        """
        g = 4096 * 3
        region = _core.HostRegion(5 * g)
        try:
            region.register_cuda(g, g)  # five chunks; the mock fails the third
        except RuntimeError as e:
            text = str(e)
            assert text.startswith("cudaHostRegister failed (rc=2, ") and \\
                f"at offset={2 * g} size={g} (total={5 * g}, chunk_limit={g})" in text, text
        else:
            raise AssertionError("a failed chunk was not reported")
        assert m.mock_registrations() == 0 and not region.pinned

        # Threads (forced on a small region): each binds the context before registering.
        os.environ["HOSTKV_REGISTER_PARALLEL_BYTES"] = "1"
        region.register_cuda(g, g)
        assert m.mock_registrations() == 5 and region.registered_ranges == [
            (region.address + k * g, g) for k in range(5)]
        region.unregister_cuda()
        assert m.mock_registrations() == 0

        # Unregistering, or dropping, a pool waits for the work queued on it (the mock records
        # a violation if memory is unpinned with copies still queued).
        s = m.mock_stream_create(0)
        unit = 4 * 3 * 64  # one page of all layers: no copy unit straddles two chunks
        pool = Pool("page_first", [64], granularity=unit, chunk_limit=unit, backup=True)
        assert m.mock_registrations() > 1
        pool.run("kernel", np.arange(5), np.arange(5), s)
        assert m.mock_pending_ops() > 0
        pool.region.unregister_cuda()
        assert m.mock_pending_ops() == 0 and m.mock_registrations() == 0
        pool.check("after unregister")
        pool2 = Pool("layer_first", [64], backup=True)
        pool2.run("direct", np.arange(8), np.arange(8), s)  # whole pages of 4 (direct)
        del pool2
        gc.collect()
        assert m.mock_pending_ops() == 0 and m.mock_registrations() == 0
        """,
        MOCK_FAIL_REGISTER_AT=3,
        MOCK_PROGRESS_ON_QUERY=1,
    )


def test_empty_transfer_launches_nothing(mock_dir):
    run_scenario(
        mock_dir,
        """
        s = m.mock_stream_create(0)
        for backend, layout in (("kernel", "page_head"), ("direct", "layer_first")):
            pool = Pool(layout, [32], heads=2 if layout == "page_head" else 1)
            e = np.zeros(0, dtype=np.int64)
            pool.run(backend, e, e, s)
        assert m.mock_pending_ops() == 0 and m.mock_counter(0) == 0
        """,
    )


def test_driver_refusals_are_exceptions_not_crashes(mock_dir):
    run_scenario(
        mock_dir,
        """
        assert not _core.cuda_available()
        info = _core.runtime_info()
        assert "cuInit failed: CUDA_ERROR_NO_DEVICE (rc=100)" in info, info
        region = _core.HostRegion(4096)
        try:
            region.register_cuda()
        except RuntimeError as e:
            assert "CUDA is not available" in str(e), e
        else:
            raise AssertionError("registered without CUDA")
        _core.check_device_errors()
        """,
        MOCK_INIT_RC=100,
        EXPECT_UNAVAILABLE=1,
    )
    run_scenario(
        mock_dir,
        """
        pool = Pool("page_first", [16])
        try:
            pool.run("kernel", np.arange(2), np.arange(2), m.mock_stream_create(0))
        except RuntimeError as e:
            text = str(e)
            assert "mock ptxas: rejected the module" in text and "driver version 13000" in text
        else:
            raise AssertionError("a JIT failure was not reported")
        assert m.mock_current_ctx() == 0
        """,
        MOCK_JIT_FAIL=1,
    )


def test_a_jit_failure_under_lazy_loading_still_reports_its_log(mock_dir):
    # With lazy module loading the library loads and the JIT runs at cuKernelGetFunction, which
    # takes no log buffers: the error then carries the log of an eager compile of the same PTX.
    run_scenario(
        mock_dir,
        """
        pool = Pool("page_first", [16])
        try:
            pool.run("kernel", np.arange(4), np.arange(4), m.mock_stream_create(0))
        except RuntimeError as e:
            text = str(e)
            assert "cuKernelGetFunction (hkv_check_indices)" in text, text
            assert "mock ptxas: rejected the module" in text, text
        else:
            raise AssertionError("a lazy JIT failure was not reported")
        """,
        MOCK_LAZY_JIT_FAIL=1,
    )


def test_forked_child_does_not_touch_cuda(mock_dir):
    run_scenario(
        mock_dir,
        """
        pool = Pool("page_first", [16])
        regs = m.mock_registrations()
        pid = os.fork()
        if pid == 0:
            ok = (not _core.cuda_available()) and "spawn" in _core.runtime_info()
            # The registration is the parent's: the child sees none, and undoing it is a no-op
            # that takes no lock a parent thread could have held at the fork.
            region = pool.region
            ok = ok and not region.pinned and region.registered_ranges == []
            region.unregister_cuda()
            try:
                region.register_cuda()
                ok = False
            except RuntimeError as e:
                ok = ok and "forked child" in str(e)
            del pool, region
            gc.collect()
            # The parent's registrations are not the child's to undo.
            ok = ok and m.mock_registrations() == regs
            os._exit(0 if ok else 1)
        _, status = os.waitpid(pid, 0)
        assert status == 0, status
        assert _core.cuda_available()
        """,
    )


# ---------------------------------------------------------------- issue 12: production hardening
# Each test below fails against the code before the fix (noted per test) and passes after it.


def test_unpinning_waits_only_for_its_own_work_bounded_and_without_the_gil(mock_dir):
    # Before: destroy()/GC called cuCtxSynchronize on every active context (waits for an NCCL
    # kernel that never ends; illegal while another thread captures a graph), with the GIL held
    # on garbage collection, and could not time out.
    run_scenario(
        mock_dir,
        """
        import time
        s, nccl, cap = (m.mock_stream_create(0) for _ in range(3))
        m.mock_enqueue_hang(nccl)       # an NCCL kernel spinning on a dead peer
        m.mock_stream_capture(cap, 1)   # another thread captures a CUDA graph meanwhile
        pool = Pool("page_first", [64], backup=True)
        pool.run("kernel", np.arange(5), np.arange(5), s)
        pool.region.unregister_cuda()   # waits for this pool's transfer only
        assert not pool.region.pinned and m.mock_registrations() == 0
        pool.check("the queued backup finished before the memory was unpinned")

        # Garbage collection of a pinned pool with work queued: same wait, GIL released (the
        # mock flags blocking calls made with the GIL held).
        gone = Pool("layer_first", [32], backup=False)
        gone.run("kernel", np.arange(4), np.arange(4), s, layer=1)
        del gone
        gc.collect()
        assert m.mock_registrations() == 0

        # Work that cannot finish (queued behind a hung kernel): a bounded wait, a clear error,
        # and the memory stays pinned (and mapped) instead of being freed under the DMA.
        stuck_stream = m.mock_stream_create(0)
        m.mock_enqueue_hang(stuck_stream)
        stuck = Pool("page_first", [64], backup=True)
        stuck.run("kernel", np.arange(3), np.arange(3), stuck_stream)
        t0 = time.monotonic()
        try:
            stuck.region.unregister_cuda()
        except RuntimeError as e:
            assert "timed out after 0.5 s" in str(e) and "stays pinned" in str(e), e
        else:
            raise AssertionError("a wait that cannot end returned")
        assert time.monotonic() - t0 < 10
        assert stuck.region.pinned and m.mock_registrations() == 1
        m.mock_unhang()                 # the peer came back
        stuck.region.unregister_cuda()
        assert not stuck.region.pinned and m.mock_registrations() == 0
        m.mock_stream_capture(cap, 0)
        """,
        MOCK_PROGRESS_ON_QUERY=1,
        HOSTKV_UNREGISTER_TIMEOUT_S=0.5,
    )


def test_destroy_racing_transfers_never_unpins_under_queued_work(mock_dir):
    # Before: a transfer that had passed its checks could enqueue after destroy() drained and
    # unpinned the region; the mock then sees a kernel or copy touch unregistered memory (a
    # sticky illegal-address error on a GPU).
    run_scenario(
        mock_dir,
        """
        import random, time
        for rnd in range(3):
            pool = Pool("layer_first", [4096, 4096], layers=4, rows=128, dev_rows=128,
                        backup=True, seed=rnd)
            streams = [m.mock_stream_create(0) for _ in range(3)]
            refused, errors = [], []

            def transfers(k):
                rng = random.Random(k)
                for i in range(12):
                    backend = "kernel" if (i + k) % 2 else "direct"
                    start = rng.randrange(0, 64) // 4 * 4
                    idx = np.arange(start, start + 64)
                    try:
                        pool.run(backend, idx, idx, streams[k])
                    except RuntimeError as e:
                        text = str(e)
                        if "being unregistered" in text or "not registered" in text or \\
                                "needs host memory registered" in text:
                            refused.append(text)
                        else:
                            errors.append(text)

            def destroy():
                time.sleep(0.01 + 0.01 * rnd)
                pool.region.unregister_cuda()

            ts = [threading.Thread(target=transfers, args=(k,)) for k in range(3)]
            ts.append(threading.Thread(target=destroy))
            for t in ts:
                t.start()
            for t in ts:
                t.join()
            assert not errors, errors[:3]
            assert not pool.region.pinned
            m.mock_sync_all()
            no_violations()
        """,
        MOCK_PROGRESS_ON_QUERY=1,
        MOCK_ENQUEUE_DELAY_US=3000,
    )


def test_direct_copies_never_span_two_registration_chunks(mock_dir):
    # Before: a coalesced run crossing a chunk seam went to the driver as one copy, which the
    # driver (and the mock) rejects.
    run_scenario(
        mock_dir,
        """
        s = m.mock_stream_create(0)
        for backup in (True, False):
            # 16 KiB in 4 KiB chunks: every layer's run of 64 rows crosses a seam somewhere.
            pool = Pool("layer_first", [40, 24], layers=4, rows=64, dev_rows=64, page=4,
                        backup=backup, granularity=4096, chunk_limit=4096)
            assert m.mock_registrations() > 2
            hi = np.arange(64); di = np.arange(64)
            pool.run("direct", hi, di, s, layer=1)
            hi2 = np.arange(16, 48); di2 = np.arange(0, 32)
            pool.run("direct", hi2, di2, s, layer=2)
            m.mock_sync_all()
            pool.check(f"backup={backup}")
            pool.region.unregister_cuda()
        assert m.mock_counter(9) == 0, "a copy spanning two registrations reached the driver"

        # One host layer, device -> host (a layer-sharded pool), on both backends.
        pool = Pool("layer_first", [40, 24], layers=4, rows=64, dev_rows=64, backup=True,
                    granularity=4096, chunk_limit=4096)
        hi = np.arange(64); di = np.arange(64)
        for backend, layer in (("direct", 1), ("kernel", 2)):
            ptrs = [pool.dev[p * 4 + layer].ctypes.data for p in range(2)]
            ptrs_cpu = [pool.dev_cpu[p * 4 + layer].ctypes.data for p in range(2)]
            pool.core_cpu.backup(backend, ptrs_cpu, 64, arr(hi), arr(di), "cpu", 0,
                                 host_layer=layer)
            pool.core.backup(backend, ptrs, 64, arr(hi), arr(di), "cuda", s, host_layer=layer)
        m.mock_sync_all()
        pool.check("one host layer backed up")
        assert m.mock_counter(9) == 0
        """,
        MOCK_PROGRESS_ON_QUERY=1,
    )


@pytest.mark.parametrize("batch", ["1", "0"])
def test_direct_copies_never_span_two_registration_chunks_per_copy_path(mock_dir, batch):
    run_scenario(
        mock_dir,
        """
        s = m.mock_stream_create(0)
        pool = Pool("layer_first", [40], layers=4, rows=64, dev_rows=64, backup=True,
                    granularity=4096, chunk_limit=4096)
        pool.run("direct", np.arange(64), np.arange(64), s)
        m.mock_sync_all()
        pool.check()
        assert m.mock_counter(9) == 0
        """,
        HOSTKV_DIRECT_BATCH=batch,
    )


def test_registration_is_chunked_at_the_limit_and_retried_by_halving(mock_dir):
    # Before: granularity 0 registered the whole region in one call (no limit) and a refused
    # chunk failed the pool at once.
    run_scenario(
        mock_dir,
        """
        region = _core.HostRegion((1 << 20) + 3 * 4096)
        region.register_cuda(0, 1 << 30)   # the mock refuses registrations over 300000 bytes
        sizes = [n for _, n in region.registered_ranges]
        assert len(sizes) > 1 and max(sizes) <= 300000, sizes
        assert sum(sizes) == region.nbytes
        assert all((b - region.address) % 4096 == 0 for b, _ in region.registered_ranges)
        assert m.mock_registrations() == len(sizes)
        region.unregister_cuda()

        capped = _core.HostRegion(1 << 20)
        capped.register_cuda(0, 64 << 10)  # no granularity given: chunks still capped
        assert [n for _, n in capped.registered_ranges] == [64 << 10] * 16
        capped.unregister_cuda()

        # Halving stops at one copy unit; then the contract's error, everything rolled back.
        unit = 400000
        big = _core.HostRegion((1 << 20) + 3 * 4096)
        try:
            big.register_cuda(unit, 1 << 30)
        except RuntimeError as e:
            text = str(e)
            assert text.startswith("cudaHostRegister failed (rc=2, ") and \\
                f"at offset=0 size={unit} (total={big.nbytes}, chunk_limit=" in text, text
        else:
            raise AssertionError("a copy unit the driver refuses was accepted")
        assert m.mock_registrations() == 0 and not big.pinned
        """,
        MOCK_REGISTER_MAX_BYTES=300000,
    )


def test_reading_a_region_during_another_threads_registration_leaves_the_gil_free(mock_dir):
    # Before: `pinned` / `registered_ranges` waited for the range lock, which a registration
    # holds throughout, with the GIL held, so every Python thread stopped until it ended.
    run_scenario(
        mock_dir,
        """
        import threading, time
        region = _core.HostRegion(1 << 20)
        pinning = threading.Thread(target=region.register_cuda, args=(0, 64 << 10))
        pinning.start()
        while m.mock_registrations() == 0:      # the registration holds the range lock now
            time.sleep(0.001)
        ticks = []
        def tick():
            end = time.monotonic() + 0.4
            while time.monotonic() < end:
                ticks.append(time.monotonic())
                time.sleep(0.001)
            ticks.append(time.monotonic())
        ticker = threading.Thread(target=tick)
        ticker.start()
        time.sleep(0.02)
        waited = time.monotonic()
        pinned = region.pinned                  # waits for the registration to end
        waited = time.monotonic() - waited
        ticker.join()
        pinning.join()
        assert pinned and waited > 0.2, (pinned, waited)
        gaps = [b - a for a, b in zip(ticks, ticks[1:])]
        assert max(gaps) < 0.15, max(gaps)      # the ticker kept running meanwhile
        assert region.registered_ranges and "pinned=True" in repr(region)
        region.unregister_cuda()
        """,
        MOCK_REGISTER_DELAY_US=40000,
    )


def test_unregistration_runs_on_the_device_the_range_was_registered_on(mock_dir):
    # Before: a thread with no current context unregistered with GPU 0's primary context,
    # creating a context on GPU 0 (on every rank of an 8-GPU node).
    run_scenario(
        mock_dir,
        """
        c1 = ctypes.c_uint64()
        assert m.cuDevicePrimaryCtxRetain(ctypes.byref(c1), 1) == 0
        assert m.cuCtxSetCurrent(c1.value) == 0        # torch.cuda.set_device(1)
        s1 = m.mock_stream_create(1)
        pool = Pool("page_first", [32], device=1, backup=True)
        pool.run("kernel", np.arange(4), np.arange(4), s1)
        m.mock_sync_all()
        assert m.cuCtxSetCurrent(0) == 0
        done = {}
        def destroy():                                  # a thread that never touched CUDA
            pool.region.unregister_cuda()
            done["ctx"] = m.mock_current_ctx()
        t = threading.Thread(target=destroy); t.start(); t.join()
        assert done == {"ctx": 0} and m.mock_registrations() == 0
        assert m.mock_ctx_created(0) == 0, "a context was created on GPU 0"
        """,
        MOCK_DEVICES=2,
    )


def test_staged_indices_reach_the_kernels_from_device_memory(mock_dir):
    # Before: the kernels read host-resident indices (and long layer tables) from mapped pinned
    # memory, every warp over PCIe.
    run_scenario(
        mock_dir,
        """
        s = m.mock_stream_create(0)
        pool = Pool("page_first", [16, 8], layers=131, rows=64, dev_rows=64, backup=True)
        for k in range(3):
            hi = indices(7, pool.rows, np.int64, k); di = indices(7, pool.dev_rows, np.int32, k)
            pool.run("kernel", hi, di, s)
            hi[:] = 0; di[:] = 0
        m.mock_sync_all()
        pool.check()
        assert m.mock_counter(7) == 3, m.mock_counter(7)  # one async copy per call
        assert m.mock_counter(6) == 0, "a kernel read indices or a layer table from host memory"
        """,
    )


def test_a_second_driver_library_in_the_process_is_refused(mock_dir, tmp_path):
    # Before: cudarc's libcuda.so (e.g. a toolkit stub) was used next to torch's libcuda.so.1.
    other = tmp_path / "other"
    other.mkdir()
    shutil.copy(os.path.join(mock_dir, "libcuda.so"), other / "libcuda.so.1")
    run_scenario(
        mock_dir,
        """
        assert not _core.cuda_available()
        info = _core.runtime_info()
        assert "two different CUDA driver libraries" in info and "libcuda.so.1" in info, info
        region = _core.HostRegion(4096)
        try:
            region.register_cuda()
        except RuntimeError as e:
            assert "two different CUDA driver libraries" in str(e), e
        else:
            raise AssertionError("registered through a second driver")
        """,
        PRELOAD_DRIVER=str(other / "libcuda.so.1"),
        EXPECT_UNAVAILABLE=1,
    )


def test_pin_memory_with_a_gpu_the_core_cannot_use_raises(monkeypatch):
    # Before: the pool was silently left unpinned.
    import torch
    from hostkv_rs import _core
    from hostkv_rs.pools import memory as _memory

    if _core.cuda_available():
        pytest.skip("the core can use CUDA here")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(RuntimeError, match="pin_memory=True"):
        _memory.alloc_host_region(4096, pin_memory=True)
    region = _memory.alloc_host_region(4096, pin_memory=False)
    assert not region.pinned


def test_every_refused_launch_is_counted_and_reported(mock_dir):
    # Before: a bad-index launch that ran while an earlier report was unread was not recorded,
    # so its transfer (which wrote nothing) looked successful.
    run_scenario(
        mock_dir,
        """
        s = m.mock_stream_create(0)
        pool = Pool("page_first", [32, 16], backup=True)
        before = np.frombuffer(pool.region, dtype=np.uint8).copy()
        ptrs = [d.ctypes.data for d in pool.dev]
        hi = labelled(np.arange(6))
        bad1 = labelled(np.array([0, 1, 2, 99, 4, 5]))
        bad2 = labelled(np.array([0, -3, 2, 3, 4, 5]))
        # Both queued before either runs: the second runs while the first report is unread.
        pool.core.backup("kernel", ptrs, pool.dev_rows, arr(hi, True), arr(bad1, True), "cuda", s)
        pool.core.backup("kernel", ptrs, pool.dev_rows, arr(hi, True), arr(bad2, True), "cuda", s)
        m.mock_sync_all()
        try:
            _core.check_device_errors()
        except _core.TransferError as e:
            text = str(e)
            assert text.startswith("device index 99 ") and "2 CUDA transfers were refused" in text, text
        else:
            raise AssertionError("the bad indices were not reported")
        _core.check_device_errors()           # reported once
        assert np.array_equal(np.frombuffer(pool.region, dtype=np.uint8), before)
        # The next one is reported on its own, by the next transfer call (which does not run).
        pool.core.backup("kernel", ptrs, pool.dev_rows, arr(hi, True), arr(bad2, True), "cuda", s)
        m.mock_sync_all()
        launches = m.mock_counter(0)
        try:
            pool.run("kernel", np.arange(3), np.arange(3), s)
        except _core.TransferError as e:
            assert str(e).startswith("device index -3 ") and "transfers were" not in str(e), e
        else:
            raise AssertionError("the pending error was not reported")
        assert m.mock_counter(0) == launches
        _core.check_device_errors()
        """,
    )


def test_kernels_survive_a_primary_context_reset(mock_dir):
    # Before: per-context function handles from cuModuleGetFunction went stale when the primary
    # context was reset, and the next launch failed (invalid handle).
    run_scenario(
        mock_dir,
        """
        s = m.mock_stream_create(0)
        pool = Pool("page_head", [48], heads=2, backup=True)
        pool.run("kernel", np.arange(4), np.arange(4, 8), s)
        m.mock_sync_all()
        pool.check("before the reset")
        assert m.cuDevicePrimaryCtxReset_v2(0) == 0
        pool.run("kernel", labelled(np.arange(8, 12)), labelled(np.arange(4)), s,
                 hi_dev=True, di_dev=True)
        m.mock_sync_all()
        pool.check("after the reset")
        _core.check_device_errors()
        """,
    )


def test_transfers_on_a_capturing_stream_are_refused(mock_dir):
    # Before: the copies were captured into the graph (replayed later, after their staging
    # buffers and checks were recycled), with no error.
    run_scenario(
        mock_dir,
        """
        s = m.mock_stream_create(0)
        m.mock_stream_capture(s, 1)
        for backend, layout in (("kernel", "page_first"), ("direct", "layer_first")):
            pool = Pool(layout, [32])
            try:
                pool.run(backend, np.arange(8), np.arange(8), s)
            except RuntimeError as e:
                assert f"CUDA stream {s:#x} is capturing a CUDA graph" in str(e), e
            else:
                raise AssertionError(f"{backend}: a capturing stream was accepted")
            try:                       # the legacy stream, while another stream captures
                pool.run(backend, np.arange(8), np.arange(8), 0)
            except RuntimeError as e:
                assert "CUDA_ERROR_STREAM_CAPTURE_IMPLICIT" in str(e), e
            else:
                raise AssertionError(f"{backend}: the legacy stream was used during a capture")
        assert m.mock_counter(8) == 0 and m.mock_pending_ops() == 0
        m.mock_stream_capture(s, 0)
        """,
    )


def test_nothing_blocks_with_the_gil_held(mock_dir):
    # The mock flags every blocking driver call (JIT, pinning, allocation, waits, pageable copies)
    # made by a thread holding the GIL. Before: the first small transfer JIT-compiled with the
    # GIL held, staging waits and index read-backs too.
    run_scenario(
        mock_dir,
        """
        s = m.mock_stream_create(0)
        pool = Pool("page_first", [16], layers=2, rows=64, dev_rows=64, backup=False)
        for k in range(40):                # more than the 32 staging buffers: waits happen
            hi = indices(3, pool.rows, np.int64, k); di = indices(3, pool.dev_rows, np.int64, k)
            pool.run("kernel", hi, di, s, layer=k % 2)
        direct = Pool("layer_first", [16], backup=True)
        direct.run("direct", labelled(np.arange(8)), labelled(np.arange(8)), s,
                   hi_dev=True, di_dev=True)
        m.mock_sync_all()
        pool.check(); direct.check()
        """,
    )


def test_direct_backend_refuses_pageable_host_memory(mock_dir):
    # Before: it ran a synchronous copy from pageable memory (with the GIL held).
    run_scenario(
        mock_dir,
        """
        s = m.mock_stream_create(0)
        pool = Pool("layer_first", [32], backup=True)
        pool.region.unregister_cuda()
        try:
            pool.run("direct", np.arange(8), np.arange(8), s)
        except RuntimeError as e:
            assert "needs host memory registered with CUDA" in str(e), e
        else:
            raise AssertionError("a pageable host pool was copied synchronously")
        assert m.mock_counter(5) == 0 and m.mock_pending_ops() == 0
        """,
    )


def test_four_threads_and_a_busy_one_share_the_driver_without_deadlock_or_lost_bytes(mock_dir):
    # Loads and backups on four threads at once (each its own registered pool, device layers and
    # stream; kernel and direct), next to a pure-Python thread that never releases the GIL on
    # its own, under a tiny switch interval: every call must finish (a watchdog ends the
    # scenario otherwise) and every byte must match the CPU engine's twin.
    run_scenario(
        mock_dir,
        """
        import faulthandler
        faulthandler.dump_traceback_later(200, exit=True)
        sys.setswitchinterval(1e-5)

        def worker(k):
            s = m.mock_stream_create(0)
            for r in range(1000):
                layout, backend = [("layer_first", "kernel"), ("page_first", "kernel"),
                                   ("layer_first", "direct"),
                                   ("page_first_direct", "direct")][(k + r) % 4]
                backup = (r % 2 == 0)
                pool = Pool(layout, [16, 8] if backend == "kernel" else [16], backup=backup,
                            seed=1000 * k + r)
                n = pool.page * 2
                hi = (np.arange(n) + pool.page * (r % 4)).astype(np.int64)
                di = (np.arange(n) + pool.page).astype(np.int64)
                pool.run(backend, hi, di, s, layer=1)
                m.mock_sync_all()
                pool.check(f"thread {k} round {r} {layout}/{backend}")

        four_workers_beside_a_busy_thread(worker)
        _core.check_device_errors()
        """,
    )


def test_four_threads_share_one_pool_without_deadlock_or_lost_bytes(mock_dir):
    # One registered pool, as a server has one per device pool: four threads back up and load
    # their own rows of it at once (kernel and direct, each thread its own stream), next to a
    # busy pure-Python thread, under a tiny switch interval; the pool and device bytes must
    # equal the CPU engine's twin afterwards.
    run_scenario(
        mock_dir,
        """
        import faulthandler
        faulthandler.dump_traceback_later(200, exit=True)
        sys.setswitchinterval(1e-5)
        pool = Pool("layer_first", [16], layers=3, rows=64, page=4, dev_rows=32)
        ptrs = [d.ctypes.data for d in pool.dev]
        ptrs_cpu = [d.ctypes.data for d in pool.dev_cpu]

        def worker(k):
            s = m.mock_stream_create(0)
            rng = np.random.default_rng(k)
            hi = (np.arange(8) + 8 * k + 16).astype(np.int64)
            di = (np.arange(8) + 8 * k).astype(np.int64)
            h, d = arr(hi), arr(di)
            for r in range(1000):
                backend = ("kernel", "direct")[r % 2]
                if r % 3 == 0:
                    for dev, twin in zip(pool.dev, pool.dev_cpu):
                        fresh = rng.integers(0, 256, (8, 16), dtype=np.uint8)
                        dev[di] = fresh
                        twin[di] = fresh
                    pool.core_cpu.backup(backend, ptrs_cpu, 32, h, d, "cpu", 0)
                    pool.core.backup(backend, ptrs, 32, h, d, "cuda", s)
                else:
                    layer = (r // 3) % 3
                    pool.core_cpu.load(backend, layer, [ptrs_cpu[layer]], 32, h, d, "cpu", 0)
                    pool.core.load(backend, layer, [ptrs[layer]], 32, h, d, "cuda", s)
                m.mock_sync_all()
                # this thread's rows, every round: its host rows of every layer, its device rows
                got = np.frombuffer(pool.region, dtype=np.uint8).reshape(3, 64, 16)[:, hi]
                want = np.frombuffer(pool.twin, dtype=np.uint8).reshape(3, 64, 16)[:, hi]
                assert np.array_equal(got, want), f"thread {k} round {r}: host rows"
                for l, (dev, twin) in enumerate(zip(pool.dev, pool.dev_cpu)):
                    assert np.array_equal(dev[di], twin[di]), f"thread {k} round {r}: layer {l}"

        four_workers_beside_a_busy_thread(worker)
        m.mock_sync_all()
        pool.check("after four threads")
        _core.check_device_errors()
        """,
    )


def test_adopted_memory_is_registered_by_the_core_moved_by_direct_and_freed_by_its_owner(mock_dir):
    # A storage backend's segment (SGLang's shm or Mooncake allocator): the core registers it,
    # the direct backend finds that registration (it refuses memory CUDA does not know), the
    # unpin waits for queued work, and the core never frees memory it does not own; a timed-out
    # unpin keeps the owner alive for good.
    run_scenario(
        mock_dir,
        """
        import time
        import torch
        layers, rows, page, item = 3, 32, 4, 64
        nbytes = _core.HostPool.plane_nbytes("page_first_direct", layers, rows, page, item)
        owner = torch.zeros(nbytes, dtype=torch.uint8)
        region = _core.HostRegion.adopt(owner)
        assert region.hugepage_tier == "adopted" and region.nbytes == nbytes
        assert region.address == owner.data_ptr() and not region.pinned
        region.register_cuda(0)
        assert region.pinned and m.mock_registrations() >= 1
        core = _core.HostPool.from_geometry("page_first_direct", layers, rows, page, [item], [region])
        s = m.mock_stream_create(0)
        dev = [labelled(np.random.default_rng(l).integers(0, 256, (24, item), dtype=np.uint8))
               for l in range(layers)]
        hi, di = np.arange(4, 12), np.arange(8, 16)
        core.backup("direct", [d.ctypes.data for d in dev], 24, arr(hi), arr(di), "cuda", s)
        region.unregister_cuda()  # waits for the queued backup
        assert not region.pinned and m.mock_registrations() == 0
        host = owner.numpy().reshape(rows // page, layers, page, item)
        for l in range(layers):
            assert np.array_equal(host[1:3, l].reshape(8, item), dev[l][8:16]), l

        # Unpinned adopted memory is refused by the direct backend, as any unregistered memory.
        try:
            core.backup("direct", [d.ctypes.data for d in dev], 24, arr(hi), arr(di), "cuda", s)
        except (RuntimeError, ValueError) as e:
            assert "regist" in str(e), e
        else:
            raise AssertionError("direct copied from memory CUDA does not know")
        del core

        # Dropping the region frees nothing: the owner's bytes are still there.
        del region
        gc.collect()
        assert np.array_equal(owner.numpy().reshape(rows // page, layers, page, item)[1:3, 0]
                              .reshape(8, item), dev[0][8:16])

        # An unpin that times out (work stuck behind a hung kernel) keeps the owner alive.
        stuck_owner = torch.zeros(nbytes, dtype=torch.uint8)
        stuck = _core.HostRegion.adopt(stuck_owner)
        stuck.register_cuda(0)
        hang = m.mock_stream_create(0)
        m.mock_enqueue_hang(hang)
        stuck_core = _core.HostPool.from_geometry("page_first_direct", layers, rows, page, [item], [stuck])
        stuck_core.backup("kernel", [d.ctypes.data for d in dev], 24, arr(hi), arr(di), "cuda", hang)
        del stuck_core, stuck_owner
        t0 = time.monotonic()
        del stuck
        gc.collect()
        assert time.monotonic() - t0 < 5, "the drop waited twice"
        assert m.mock_registrations() == 1
        m.mock_unhang()
        try:
            _core.HostRegion.adopt(_core.HostRegion(64))
        except TypeError as e:
            assert "not a HostRegion" in str(e)
        else:
            raise AssertionError("adopted a HostRegion")
        """,
        MOCK_PROGRESS_ON_QUERY=1,
        HOSTKV_UNREGISTER_TIMEOUT_S=0.5,
    )


def test_registration_uses_the_named_device_not_gpu_0(mock_dir):
    # A rank pinning its pool from a thread with no current context: the pool's GPU (torch's
    # current device, as SGLang's cudaHostRegister uses) registers it; GPU 0's context is never
    # created. Without a device the old fallback (GPU 0) still applies.
    run_scenario(
        mock_dir,
        """
        assert m.mock_current_ctx() == 0
        region = _core.HostRegion(1 << 16)
        region.register_cuda(0, 1 << 30, device=1)
        assert m.mock_registration_device(0) == 1
        assert m.mock_ctx_created(0) == 0, "a context was created on GPU 0"
        region.unregister_cuda()
        assert m.mock_ctx_created(0) == 0
        try:
            region.register_cuda(0, 1 << 30, device=5)
        except (RuntimeError, ValueError) as e:
            assert "cuDeviceGet" in str(e) or "device" in str(e), e
        else:
            raise AssertionError("registered on a GPU that does not exist")
        fallback = _core.HostRegion(1 << 16)
        fallback.register_cuda()
        assert m.mock_registration_device(0) == 0
        fallback.unregister_cuda()
        """,
        MOCK_DEVICES=2,
    )


def test_a_pool_pins_for_the_gpu_its_device_pool_names(mock_dir):
    # Rank 1 of a server builds its host pool from a thread with no current context and torch
    # not yet initialised: the pool registers for its device pool's GPU, never GPU 0.
    run_scenario(
        mock_dir,
        """
        import torch
        from hostkv_rs import MHATokenToKVPool, MHATokenToKVPoolHost
        from hostkv_rs.pools import memory
        assert memory.registration_device("cuda:1") == 1
        assert memory.registration_device(torch.device("cuda", 3)) == 3
        assert memory.registration_device("cpu") is None
        assert memory.registration_device("not a device") is None
        assert m.mock_current_ctx() == 0
        dev = MHATokenToKVPool(64, 16, torch.bfloat16, head_num=2, head_dim=8, layer_num=2)
        dev.device = "cuda:1"
        host = MHATokenToKVPoolHost(dev, 2.0, 0, 16, "layer_first", pin_memory=True)
        assert all(r.pinned for r in host._host_regions)
        assert m.mock_registration_device(0) == 1
        assert m.mock_ctx_created(0) == 0, "a context was created on GPU 0"
        host.destroy()
        """,
        MOCK_DEVICES=2,
    )


def test_a_storage_allocators_memory_is_pinned_by_the_pool_once(mock_dir):
    # What a pool does with a storage backend's allocator (SGLang's shm, Mooncake, ...) and
    # pin_memory: memory the allocator left pageable is registered by the core, for the device
    # pool's GPU, and unpinned at destroy; memory it pinned itself is never registered again.
    run_scenario(
        mock_dir,
        """
        import torch
        from hostkv_rs.pools import memory

        class Pageable:
            def allocate(self, dims, dtype, device):
                assert device == "cpu"
                return torch.zeros(dims, dtype=dtype)

        class PinnedTensor(torch.Tensor):
            def is_pinned(self, *args, **kwargs):
                return True

        class PinsItself(Pageable):
            def allocate(self, dims, dtype, device):
                return torch.Tensor._make_subclass(PinnedTensor, super().allocate(dims, dtype, device))

        tensor, region = memory.alloc_pool_memory(
            Pageable(), torch.bfloat16, (4, 256), True, 512, device="cuda:1")
        assert region.hugepage_tier == "adopted" and region.address == tensor.data_ptr()
        assert region.pinned and m.mock_registrations() == 1
        assert m.mock_registration_device(0) == 1
        tensor2, region2 = memory.alloc_pool_memory(
            PinsItself(), torch.bfloat16, (4, 256), True, 512, device="cuda:1")
        assert not region2.pinned and m.mock_registrations() == 1, "registered twice"
        region.unregister_cuda()
        assert not region.pinned and m.mock_registrations() == 0
        """,
        MOCK_DEVICES=2,
    )


def test_a_global_capture_on_another_stream_is_never_invalidated(mock_dir):
    # torch captures CUDA graphs in global mode: while one runs, a "potentially unsafe" call
    # (allocation, pinning, event queries and waits) from a thread outside relaxed mode fails and
    # invalidates the capture. Every entry point that makes such calls runs in relaxed mode, and
    # the thread's own mode is restored after each.
    run_scenario(
        mock_dir,
        """
        cap, s = m.mock_stream_create(0), m.mock_stream_create(0)
        m.mock_stream_capture(cap, 1)   # someone else's graph, global mode
        pool = Pool("layer_first", [64], backup=True)           # registration: pinning
        pool.run("kernel", np.arange(8), np.arange(8), s)       # JIT, staging, error record
        pool.run("direct", np.arange(8), np.arange(8), s)
        _core.check_device_errors()                             # event queries
        pool.region.unregister_cuda()                           # waits on our events
        big = _core.HostRegion(1 << 20)
        big.register_cuda(0, 64 << 10)  # 16 chunks pinned by helper threads (threshold lowered)
        big.unregister_cuda()
        assert m.mock_capture_invalidations() == 0
        assert m.mock_thread_capture_mode() == 0, "the thread's capture mode was not restored"
        m.mock_stream_capture(cap, 0)
        pool.check("while another stream captured")
        """,
        MOCK_PROGRESS_ON_QUERY=1,
        HOSTKV_REGISTER_PARALLEL_BYTES=1 << 16,
    )


def test_an_unpin_the_driver_makes_wait_for_someone_elses_kernel_is_bounded(mock_dir):
    # Some drivers make cuMemHostUnregister wait for all work on the device, not only work that
    # touches the range: an NCCL kernel spinning on a dead peer would then hang destroy(). The
    # call runs on a helper thread under the same bounded wait: destroy() returns an error after
    # the timeout, the memory stays pinned and mapped, and the helper finishes the unpin when the
    # driver returns.
    run_scenario(
        mock_dir,
        """
        import time
        s, nccl = m.mock_stream_create(0), m.mock_stream_create(0)
        pool = Pool("page_first", [64], backup=True)
        pool.run("kernel", np.arange(5), np.arange(5), s)
        m.mock_enqueue_hang(nccl)       # nothing to do with this pool
        t0 = time.monotonic()
        try:
            pool.region.unregister_cuda()
        except RuntimeError as e:
            assert "cuMemHostUnregister has not returned" in str(e), e
            assert "stays pinned and mapped" in str(e), e
        else:
            raise AssertionError("an unpin the driver blocks returned success")
        assert time.monotonic() - t0 < 5, "the unpin was not bounded"
        assert pool.region.pinned
        # A second try while the helper is still blocked in the driver: bounded too, no second
        # cuMemHostUnregister of the same range.
        try:
            pool.region.unregister_cuda()
        except RuntimeError:
            pass
        m.mock_unhang()                 # the peer came back: the driver returns
        deadline = time.monotonic() + 5
        while m.mock_registrations() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert m.mock_registrations() == 0, "the helper did not finish the unpin"
        pool.region.unregister_cuda()   # now a no-op that clears the region's record
        assert not pool.region.pinned
        pool.check("the backup landed before the late unpin")
        """,
        MOCK_PROGRESS_ON_QUERY=1,
        MOCK_UNREGISTER_WAITS_ALL=1,
        HOSTKV_UNREGISTER_TIMEOUT_S=0.5,
    )


def test_an_unpin_after_an_unrecorded_event_waits_for_the_device_but_boundedly(mock_dir):
    # When no event could be recorded behind a transfer into a region, unpinning it waits for
    # all work of the device instead (cuCtxSynchronize), which a kernel spinning on a dead peer
    # holds forever. That wait is bounded like the others: destroy() gets an error after the
    # timeout and the memory stays pinned and mapped; once the device drains, it unpins.
    out = run_scenario(
        mock_dir,
        """
        import time
        s, nccl = m.mock_stream_create(0), m.mock_stream_create(0)
        pool = Pool("page_first", [64], backup=True)
        try:
            pool.run("kernel", np.arange(5), np.arange(5), s)
        except RuntimeError as e:
            print("transfer:", e)
        m.mock_enqueue_hang(nccl)       # someone else's kernel, never finishing
        t0 = time.monotonic()
        try:
            pool.region.unregister_cuda()
        except RuntimeError as e:
            assert "wait for all work of device 0 has not returned" in str(e), e
            assert "stays pinned and mapped" in str(e), e
        else:
            raise AssertionError("an unpin behind a hung device wait returned success")
        assert time.monotonic() - t0 < 5, "the device-wide wait was not bounded"
        assert pool.region.pinned
        m.mock_unhang()                 # the peer came back
        deadline = time.monotonic() + 5
        while pool.region.pinned and time.monotonic() < deadline:
            try:
                pool.region.unregister_cuda()
            except RuntimeError:
                time.sleep(0.05)
        assert not pool.region.pinned, "the region was not unpinned once the device drained"
        """,
        MOCK_EVENT_RECORD_FAIL=1,
        MOCK_SYNC_WAITS_ALL=1,
        MOCK_PROGRESS_ON_QUERY=1,
        HOSTKV_UNREGISTER_TIMEOUT_S=0.5,
    )
    print(out)


def test_a_libcuda_so_that_is_not_the_system_driver_is_refused_before_anything_loads_it(
    mock_dir, tmp_path
):
    # cudarc tries libcuda.so before libcuda.so.1; where the first is a different file (a toolkit
    # stub, a compat copy) the process would run two drivers once torch loads libcuda.so.1. It is
    # refused at the probe, before torch has loaded anything.
    shadowed = tmp_path / "shadowed"
    shadowed.mkdir()
    shutil.copy(os.path.join(mock_dir, "libcuda.so"), shadowed / "libcuda.so")
    shutil.copy(os.path.join(mock_dir, "libcuda.so"), shadowed / "libcuda.so.1")
    run_scenario(
        str(shadowed),
        """
        assert not _core.cuda_available()
        info = _core.runtime_info()
        assert "libcuda.so.1, the driver the CUDA runtime and torch load" in info, info
        assert str(os.path.join(os.environ["LD_LIBRARY_PATH"], "libcuda.so.1")) in info, info
        """,
        EXPECT_UNAVAILABLE=1,
    )
