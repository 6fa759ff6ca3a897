"""Faults end cleanly: the host-memory check honours cgroup limits and counts every allocation a
pool makes; index arrays with negative strides are read, not refused; a forked child never
inherits a pool lock another thread held."""

from __future__ import annotations

import os
import signal
import threading
import time
import warnings

import numpy as np
import pytest
import torch
from hostkv_rs import (
    DeepSeekV4PagedHostPool,
    LogicalHostPool,
    MHATokenToKVPool,
    MHATokenToKVPoolHost,
    MLATokenToKVPool,
    MLATokenToKVPoolHost,
)
from hostkv_rs.pools import base, v4_paged
from hostkv_rs.pools import memory as _memory
from hostkv_rs.pools.slots import SLOT_TABLE_BYTES
from hostkv_rs.sglang import budgets as _budgets

GiB = 1024**3


class _VM:
    def __init__(self, available):
        self.available = available


def _machine(monkeypatch, available):
    monkeypatch.setattr(_memory.psutil, "virtual_memory", lambda: _VM(available))


def _write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def _cgroup_v2(tmp_path, monkeypatch, levels, own="/kubepods/pod1"):
    """A fake cgroup v2 tree: `levels` maps a cgroup path to (memory.max, memory.current)."""
    root = tmp_path / "cgroup"
    root.mkdir()
    for path, (limit, usage) in levels.items():
        directory = root / path.strip("/") if path.strip("/") else root
        _write(directory / "memory.max", f"{limit}\n")
        _write(directory / "memory.current", f"{usage}\n")
    (root / own.strip("/")).mkdir(parents=True, exist_ok=True)
    _write(tmp_path / "proc_cgroup", f"0::{own}\n")
    monkeypatch.setattr(_memory, "CGROUP_ROOT", str(root))
    monkeypatch.setattr(_memory, "PROC_SELF_CGROUP", str(tmp_path / "proc_cgroup"))
    return root


def _cgroup_v1(tmp_path, monkeypatch, limit, usage, own="/docker/abc"):
    root = tmp_path / "cgroup"
    directory = root / "memory" / own.strip("/")
    _write(directory / "memory.limit_in_bytes", f"{limit}\n")
    _write(directory / "memory.usage_in_bytes", f"{usage}\n")
    _write(
        tmp_path / "proc_cgroup",
        f"12:pids:/docker/abc\n4:memory:{own}\n1:name=systemd:/docker/abc\n0::/\n",
    )
    monkeypatch.setattr(_memory, "CGROUP_ROOT", str(root))
    monkeypatch.setattr(_memory, "PROC_SELF_CGROUP", str(tmp_path / "proc_cgroup"))
    return directory


@pytest.fixture
def no_cgroup(tmp_path, monkeypatch):
    """The tests' own view of cgroups: none (the machine's may limit memory)."""
    missing = str(tmp_path / "no_such_file")
    monkeypatch.setattr(_memory, "PROC_SELF_CGROUP", missing, raising=False)


# ---- cgroup limits ----------------------------------------------------------------------------


def test_cgroup_v2_limit_is_max_minus_current(tmp_path, monkeypatch):
    root = _cgroup_v2(
        tmp_path,
        monkeypatch,
        {"/": ("max", 10**12), "/kubepods": ("max", 5), "/kubepods/pod1": (30 * GiB, 8 * GiB)},
    )
    limit = _memory.cgroup_memory_limit()
    assert limit.available == 22 * GiB
    assert "cgroup v2" in limit.source and str(root / "kubepods" / "pod1") in limit.source
    assert "memory.max" in limit.source and "memory.current" in limit.source
    _machine(monkeypatch, 100 * GiB)
    assert _memory.available_host_memory() == limit
    assert _budgets.host_memory_budget_bytes() == 12 * GiB
    # The machine's memory is the smaller one: it is used, and said.
    _machine(monkeypatch, 20 * GiB)
    assert _memory.available_host_memory().available == 20 * GiB
    assert _memory.available_host_memory().source == "the machine's available memory"


def test_cgroup_v2_parent_limit_binds_too(tmp_path, monkeypatch):
    root = _cgroup_v2(
        tmp_path,
        monkeypatch,
        {"/kubepods": (12 * GiB, 10 * GiB), "/kubepods/pod1": (30 * GiB, 1 * GiB)},
    )
    limit = _memory.cgroup_memory_limit()
    assert limit.available == 2 * GiB
    assert str(root / "kubepods") + ":" in limit.source


def test_cgroup_v2_inactive_file_cache_is_reclaimable(tmp_path, monkeypatch):
    root = _cgroup_v2(tmp_path, monkeypatch, {"/kubepods/pod1": (30 * GiB, 20 * GiB)})
    _write(root / "kubepods" / "pod1" / "memory.stat", f"anon 1\ninactive_file {6 * GiB}\n")
    limit = _memory.cgroup_memory_limit()
    assert limit.available == 16 * GiB
    assert "inactive file cache" in limit.source


def test_cgroup_v2_namespace_root(tmp_path, monkeypatch):
    # Inside a cgroup namespace the process sees its own cgroup as "/", the mount itself.
    _cgroup_v2(tmp_path, monkeypatch, {"/": (4 * GiB, 1 * GiB)}, own="/")
    assert _memory.cgroup_memory_limit().available == 3 * GiB


def test_cgroup_v2_path_outside_the_mount_reads_the_mount(tmp_path, monkeypatch):
    root = _cgroup_v2(tmp_path, monkeypatch, {"/": (4 * GiB, 1 * GiB)}, own="/")
    _write(tmp_path / "proc_cgroup", "0::/system.slice/docker-abc.scope\n")
    assert _memory.cgroup_memory_limit().available == 3 * GiB
    _write(tmp_path / "proc_cgroup", "0::/../../elsewhere\n")
    assert _memory.cgroup_memory_limit().available == 3 * GiB
    assert str(root) in _memory.cgroup_memory_limit().source


def test_no_cgroup_limit(tmp_path, monkeypatch):
    _cgroup_v2(tmp_path, monkeypatch, {"/kubepods/pod1": ("max", 5 * GiB)})
    assert _memory.cgroup_memory_limit() is None
    _machine(monkeypatch, 7 * GiB)
    assert _memory.available_host_memory() == _memory.HostMemory(
        7 * GiB, "the machine's available memory"
    )


def test_cgroup_v1_limit_is_limit_minus_usage(tmp_path, monkeypatch):
    directory = _cgroup_v1(tmp_path, monkeypatch, 16 * GiB, 4 * GiB)
    limit = _memory.cgroup_memory_limit()
    assert limit.available == 12 * GiB
    assert "cgroup v1" in limit.source and str(directory) in limit.source
    assert "memory.limit_in_bytes" in limit.source and "memory.usage_in_bytes" in limit.source
    _machine(monkeypatch, 64 * GiB)
    assert _budgets.host_memory_budget_bytes() == 2 * GiB


def test_cgroup_v1_unlimited_leaves_the_machine(tmp_path, monkeypatch):
    _cgroup_v1(tmp_path, monkeypatch, 9223372036854771712, 4 * GiB)  # v1's "no limit"
    _machine(monkeypatch, 64 * GiB)
    assert _memory.available_host_memory().source == "the machine's available memory"


def test_cgroup_v1_total_inactive_file_is_reclaimable(tmp_path, monkeypatch):
    directory = _cgroup_v1(tmp_path, monkeypatch, 16 * GiB, 12 * GiB)
    _write(directory / "memory.stat", f"cache 1\ntotal_inactive_file {4 * GiB}\n")
    assert _memory.cgroup_memory_limit().available == 8 * GiB


def test_the_refusal_says_which_limit_it_used(tmp_path, monkeypatch):
    # 11 GiB left in the cgroup, far more on the machine: the budget is 1 GiB, set by the cgroup.
    _cgroup_v2(tmp_path, monkeypatch, {"/kubepods/pod1": (20 * GiB, 9 * GiB)})
    _machine(monkeypatch, 500 * GiB)
    dp = MHATokenToKVPool(16, 4, torch.bfloat16, 1, 8, 2)
    with pytest.raises(ValueError) as info:
        MHATokenToKVPoolHost(dp, 2.0, 2.0, 4, "page_first", False)  # 2 GB
    text = str(info.value)
    assert text.startswith(
        "Not enough host memory available. Requesting 2.00 GB but only have 1.07 GB free. "
        "Please reduce the size of the hierarchical cache. The budget is cgroup v2 limit "
    ), text
    assert "memory.max 21.47 GB - memory.current 9.66 GB, 11.81 GB, less the 10 GiB reserve" in text
    buffers = [torch.zeros(2, 1000, dtype=torch.uint8)]
    with pytest.raises(ValueError, match=r"only have 1\.07 GB free\. The budget is cgroup v2"):
        DeepSeekV4PagedHostPool("c4", buffers, 1000, 2_000_000, 4)


def test_a_patched_budget_keeps_sglangs_exact_text(monkeypatch):
    monkeypatch.setattr(base, "host_memory_budget_bytes", lambda: 5)
    dp = MHATokenToKVPool(16, 4, torch.bfloat16, 1, 8, 2)
    with pytest.raises(ValueError) as info:
        MHATokenToKVPoolHost(dp, 2.0, 0, 4, "page_first", False)
    assert str(info.value).endswith("Please reduce the size of the hierarchical cache.")


# ---- every allocation counts ------------------------------------------------------------------


def _one_byte_tokens(ratio=100.0, **kwargs):
    """An MLA pool of one-byte tokens: its slot tables dwarf its KV bytes."""
    dp = MLATokenToKVPool(64, 4, torch.uint8, 1, 0, 1)
    return MLATokenToKVPoolHost(dp, ratio, 0, 4, "layer_first", False, **kwargs)


def test_slot_tables_count_against_the_memory_there_is(monkeypatch, no_cgroup):
    monkeypatch.setattr(base, "host_memory_budget_bytes", lambda: 1 << 50)
    slots = 6404  # 64 x 100 tokens + one page
    kv, tables = slots, slots * (SLOT_TABLE_BYTES + 1)
    _machine(monkeypatch, kv + tables - 1)
    allocations = []
    real_alloc = _memory.alloc_host_region
    monkeypatch.setattr(
        _memory,
        "alloc_host_region",
        lambda *args, **kwargs: allocations.append(args) or real_alloc(*args, **kwargs),
    )
    with pytest.raises(ValueError) as info:
        _one_byte_tokens()
    assert allocations == []  # refused before anything was allocated
    assert str(info.value) == (
        "Not enough host memory for MLATokenToKVPoolHost (kv): it needs 0.00 GB (KV buffer "
        "0.00 GB, slot tables 0.00 GB) but only 0.00 GB is available (the machine's available "
        "memory). Please reduce the size of the hierarchical cache."
    )
    _machine(monkeypatch, kv + tables)
    assert _one_byte_tokens().size == slots


def test_a_pool_of_billions_of_one_byte_tokens_is_refused_up_front(monkeypatch, no_cgroup):
    # 3.6 G tokens of one byte: 3.6 GB of KV bytes pass SGLang's check; the slot tables
    # (25 bytes per slot, 90 GB) do not fit a 64 GB machine, and torch's allocator must never be
    # the one to say so.
    monkeypatch.setattr(base, "host_memory_budget_bytes", lambda: 50 * GiB)
    _machine(monkeypatch, 64 * GiB)

    def no_allocation(*args, **kwargs):
        pytest.fail("a pool that cannot fit started allocating")

    monkeypatch.setattr(_memory, "alloc_host_region", no_allocation)
    monkeypatch.setattr(base.SlotFreeList, "_reset_free_list", no_allocation)
    with pytest.raises(ValueError, match=r"it needs 9\d\.\d\d GB \(KV buffer 3\.60 GB, slot"):
        _one_byte_tokens(host_token_capacity=3_600_000_000)


def test_an_allocator_only_pool_counts_its_slot_tables(monkeypatch, no_cgroup):
    _machine(monkeypatch, 10_000)
    with pytest.raises(ValueError, match=r"slot tables 0\.00 GB\) but only 0\.00 GB"):
        _one_byte_tokens(is_dummy=True)


def test_v4_slot_tables_and_staging_count(monkeypatch, no_cgroup):
    monkeypatch.setattr(base, "host_memory_budget_bytes", lambda: 1 << 50)
    monkeypatch.setattr(v4_paged, "sglang_release", lambda: (0, 5, 21))  # a CPU staging buffer
    buffers = [torch.zeros(4, 8, dtype=torch.uint8)]
    rows, tables, staging = 100 * 8, 100 * 16 * SLOT_TABLE_BYTES, 64 * 8
    _machine(monkeypatch, rows + tables + staging - 1)
    with pytest.raises(ValueError, match="Not enough host memory for V4 paged pool c4: it needs"):
        DeepSeekV4PagedHostPool("c4", buffers, 8, 100, 16, "page_first", pin_memory=False)
    _machine(monkeypatch, rows + tables + staging)
    DeepSeekV4PagedHostPool("c4", buffers, 8, 100, 16, "page_first", pin_memory=False)


def test_a_logical_pool_too_large_for_its_slot_tables(no_cgroup):
    with pytest.raises(ValueError, match=r"Not enough host memory for LogicalHostPool\(size="):
        LogicalHostPool(2**36, 64)


# ---- negative-stride numpy index arrays ---------------------------------------------------------


def _mha():
    dp = MHATokenToKVPool(32, 4, torch.bfloat16, 2, 8, 3)
    return MHATokenToKVPoolHost(dp, 2.0, 0, 4, "page_first", False), dp


def test_negative_stride_numpy_indices_are_read(no_cgroup):
    host, dp = _mha()
    for layer in dp.k_buffer + dp.v_buffer:
        layer.view(torch.uint8).random_(generator=torch.Generator().manual_seed(3))
    slots = host.alloc(8).clone()
    h = slots.numpy()[::-1]
    d = np.arange(4, 12, dtype=np.int64)[::-1]
    assert h.strides[0] < 0 and d.strides[0] < 0
    host.backup_from_device_all_layer(dp, h, d, "kernel")
    want = [dp.k_buffer[layer][torch.from_numpy(d.copy())] for layer in range(3)]
    got = [host.k_buffer[:, layer][torch.from_numpy(h.copy())] for layer in range(3)]
    for layer in range(3):
        assert torch.equal(got[layer], want[layer]), layer
    for layer in dp.k_buffer:
        layer.zero_()
    host.load_to_device_per_layer(dp, h, d, 1, "kernel")
    assert torch.equal(dp.k_buffer[1][torch.from_numpy(d.copy())], want[1])
    page = np.arange(0, 4, dtype=np.int64)[::-1][::-1][::-1].copy()[::-1]
    assert host.get_page_buffer_meta(page) == host.get_page_buffer_meta(torch.arange(4))
    assert host.free(h) == 8
    assert host.available_size() == host.size


def test_negative_stride_numpy_indices_for_v4_and_logical_pools(no_cgroup):
    buffers = [torch.arange(6 * 8, dtype=torch.uint8).view(6, 8) for _ in range(2)]
    pool = DeepSeekV4PagedHostPool("c4", buffers, 8, 4, 1, "layer_first", pin_memory=False)
    pool.backup_from_device_all_layer(
        None, np.arange(4, dtype=np.int64)[::-1], np.arange(2, 6, dtype=np.int64)[::-1], "kernel"
    )
    assert torch.equal(pool.kv_buffer[0], buffers[0][2:6])
    slots = pool.alloc(4)
    assert pool.free(slots.numpy()[::-1]) == 4
    logical = LogicalHostPool(16, 4)
    got = logical.alloc(8)
    assert logical.free(got.numpy()[::-1]) == 8
    assert logical.available_size() == 16


def test_other_numpy_index_arrays_are_read(no_cgroup):
    host, dp = _mha()
    slots = host.alloc(4)
    big_endian = slots.numpy().astype(">i8")
    read_only = np.arange(4, 8)
    read_only.setflags(write=False)
    host.backup_from_device_all_layer(dp, big_endian, read_only, "kernel")
    assert host.free(big_endian) == 4


# ---- fork ---------------------------------------------------------------------------------------


def _fork_and_run(child, timeout=60.0) -> int:
    """Run `child()` in a forked child, which must exit within `timeout` seconds; returns its
    exit status (a hung child is killed and fails the test)."""
    with warnings.catch_warnings():
        # Python 3.12+ warns that forking a multi-threaded process may deadlock: the point here.
        warnings.simplefilter("ignore", DeprecationWarning)
        pid = os.fork()
    if pid == 0:  # the child: never return into pytest
        status = 1
        try:
            signal.alarm(int(timeout))  # a watchdog the child cannot forget
            status = 0 if child() else 2
        finally:
            os._exit(status)
    deadline = time.monotonic() + timeout + 5
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return status
        time.sleep(0.05)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    pytest.fail("the forked child hung")


def _holding(lock):
    """A thread that holds `lock` until told to let go."""
    held, release = threading.Event(), threading.Event()

    def hold():
        with lock:
            held.set()
            release.wait()

    thread = threading.Thread(target=hold, daemon=True)
    thread.start()
    assert held.wait(10)
    return thread, release


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
@pytest.mark.parametrize("kind", ["mha", "mla", "v4", "logical"])
def test_a_forked_child_never_inherits_a_held_pool_lock(kind, no_cgroup):
    if kind == "mha":
        pool, _ = _mha()
    elif kind == "mla":
        pool, _ = _one_byte_tokens(ratio=1.0), None
    elif kind == "v4":
        buffers = [torch.zeros(4, 8, dtype=torch.uint8)]
        pool = DeepSeekV4PagedHostPool("c4", buffers, 8, 4, 2, pin_memory=False)
    else:
        pool = LogicalHostPool(16, 4)
    thread, release = _holding(pool.lock)
    try:

        def child():
            got = pool.alloc(pool.page_size)
            return got is not None and pool.free(got) == got.numel()

        status = _fork_and_run(child, timeout=20)
    finally:
        release.set()
        thread.join(10)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, (
        f"child status {status:#x}: it could not alloc/free (a held lock came along)"
    )
    # The parent still has its own lock, and it works.
    assert pool.alloc(pool.page_size) is not None


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_fork_during_alloc_in_another_thread(no_cgroup):
    # A thread sits inside alloc (holding the lock) while the main thread forks.
    host, _ = _mha()
    inside, leave = threading.Event(), threading.Event()
    real_take = host._take_slots

    def slow_take(n):
        inside.set()
        leave.wait()
        return real_take(n)

    host._take_slots = slow_take
    thread = threading.Thread(target=lambda: host.alloc(4), daemon=True)
    thread.start()
    assert inside.wait(10)
    try:

        def child():
            host._take_slots = real_take
            got = host.alloc(4)
            return got is not None and host.free(got) == 4

        status = _fork_and_run(child, timeout=20)
    finally:
        leave.set()
        thread.join(10)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, f"child status {status:#x}"


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_forked_child_moves_bytes_through_the_bindings_it_inherits(no_cgroup):
    # The core's binding locks come along into the child; a free one is taken there as usual (a
    # held one is refused, never waited on: rust/src/fork.rs's cargo test).
    host, dp = _mha()
    slots = host.alloc(8).clone()
    dev_rows = torch.arange(4, 12)
    for layer in dp.k_buffer + dp.v_buffer:
        layer.view(torch.uint8).random_(generator=torch.Generator().manual_seed(5))
    host.backup_from_device_all_layer(dp, slots, dev_rows, "kernel")  # checks the binding

    def child():
        for layer in dp.k_buffer + dp.v_buffer:
            layer.zero_()
        host.load_to_device_per_layer(dp, slots, dev_rows, 1, "kernel")
        host.backup_from_device_all_layer(dp, slots, dev_rows, "kernel")
        loaded = dp.k_buffer[1][dev_rows].view(torch.uint8)
        return bool(loaded.any()) and torch.equal(loaded, host.k_buffer[slots, 1].view(torch.uint8))

    status = _fork_and_run(child, timeout=30)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, f"child status {status:#x}"
