"""HostKVCache's constructor sequence (host-pool-contract.md §1.2-§1.4): sizing, the warning and
success logs, the memory budget check, and the arguments SGLang's call sites pass."""

from __future__ import annotations

import contextlib
import inspect
import logging
import re
import subprocess
import sys
import threading

import pytest
import torch
from hostkv_rs import (
    DeepSeekV4PagedHostPool,
    HostKVCache,
    LogicalHostPool,
    MHATokenToKVPool,
    MHATokenToKVPoolHost,
    MLATokenToKVPool,
    MLATokenToKVPoolHost,
)
from hostkv_rs.pools import memory as _memory
from hostkv_rs.sglang import budgets as _budgets
from reference import LAYERS, make_mha, make_mla

GB = 1e9


def test_is_abstract():
    with pytest.raises(TypeError):
        HostKVCache(None, 1.0, 0, 1, "layer_first", True, "cpu")


def test_ratio_sizing_adds_one_page_unconditionally():
    # 100000 device tokens x 2.0 = 200000 tokens -> 3125 pages of 64 + 1 = 3126 pages.
    dp = MHATokenToKVPool(100000, 64, torch.uint8, 1, 8, 1)
    host = MHATokenToKVPoolHost(dp, 2.0, 0, 64, "layer_first")
    assert host.page_num == 3126
    assert host.size == 200064
    assert host.free_slots.numel() == 200064
    # An unaligned size rounds down, then gains the page as well.
    host = MHATokenToKVPoolHost(dp, 0.00101, 0, 64, "layer_first")  # 101 tokens
    assert (host.page_num, host.size) == (2, 128)


def test_host_size_is_decimal_gb_with_floor_division(monkeypatch):
    monkeypatch.setattr(_budgets, "host_memory_budget_bytes", lambda: 1 << 40)
    dp = MHATokenToKVPool(64, 16, torch.bfloat16, 3, 7, LAYERS)
    size_per_token = 2 * LAYERS * 3 * 7 * 2  # 420 bytes
    host = MHATokenToKVPoolHost(dp, 123.0, 0.001, 16, "layer_first")  # 1e6 bytes
    tokens = int(0.001 * 1e9 // size_per_token)  # 2380
    assert host.page_num == tokens // 16 + 1
    assert host.size == (tokens // 16 + 1) * 16
    assert host.size_per_token == size_per_token


@pytest.mark.parametrize("make", [make_mha, make_mla], ids=["mha", "mla"])
@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
def test_a_pool_built_under_inference_mode_is_written_outside_it(make, layout):
    # A storage backend's thread (not in inference mode) writes pages of a pool a scheduler
    # built in inference mode: the pool's memory is a normal tensor, which torch lets it update.
    with torch.inference_mode():
        host, device = make(layout, 4)
        page = host.get_data_page(0)
    buffers = host.kv_buffer if isinstance(host.kv_buffer, (list, tuple)) else [host.kv_buffer]
    assert not any(b.is_inference() for b in buffers)
    host.set_from_flat_data_page(0, torch.ones_like(page))
    assert torch.equal(host.get_data_page(0), torch.ones_like(page))
    slots = host.alloc(4)
    host.backup_from_device_all_layer(device, slots, torch.arange(4, 8), "kernel")


def test_a_pool_is_built_in_the_callers_grad_mode():
    # Leaving inference mode must not turn grad mode on (torch.inference_mode(False) alone
    # does), nor change anything for a caller not in inference mode.
    seen = []

    class Spy(MHATokenToKVPoolHost):
        def init_kv_buffer(self):
            seen.append((torch.is_grad_enabled(), torch.is_inference_mode_enabled()))
            return super().init_kv_buffer()

    def grad_in_inference_mode():
        with torch.inference_mode(), torch.enable_grad():
            yield

    device = make_mha("page_first", 4)[1]
    modes = (
        torch.inference_mode,
        contextlib.contextmanager(grad_in_inference_mode),
        torch.no_grad,
        torch.enable_grad,
    )
    for mode in modes:
        with mode():
            Spy(device, 2.0, 0, 4, "page_first", pin_memory=False, device="cpu")
    assert seen == [(False, False), (True, False), (False, False), (True, False)]


@pytest.mark.parametrize(
    "cls", [MHATokenToKVPoolHost, MLATokenToKVPoolHost, DeepSeekV4PagedHostPool, LogicalHostPool]
)
def test_a_pool_classs_signature_is_its_constructors(cls):
    # What inspect (help(), IDEs, code that filters keywords by signature) shows is the
    # constructor's own parameter list, not a wrapper's (*args, **kwargs).
    params = list(inspect.signature(cls).parameters)
    assert params == [p for p in inspect.signature(cls.__init__).parameters][1:]
    assert "args" not in params


def test_start_end_layer_and_attributes():
    dp = MHATokenToKVPool(64, 16, torch.bfloat16, 2, 8, LAYERS, start_layer=3, end_layer=7)
    host = MHATokenToKVPoolHost(dp, 2.0, 0, 16, "layer_first", pool_label="draft")
    assert (host.start_layer, host.end_layer) == (3, 7)
    assert host.pool_label == "draft"
    assert host.device_pool is dp
    assert host.layout == "layer_first" and host.pin_memory is True and host.device == "cpu"
    assert host.fd is None
    assert isinstance(host.lock, type(threading.RLock()))
    assert host.mem_state.dtype == torch.uint8 and host.mem_state.numel() == host.size


def test_smaller_than_device_warning_text(caplog):
    dp = MHATokenToKVPool(64, 16, torch.bfloat16, 2, 8, LAYERS)
    with caplog.at_level(logging.WARNING, logger="hostkv_rs"):
        MHATokenToKVPoolHost(dp, 0.5, 0, 16, "layer_first")
    want = (
        "HiCache kv host pool (48 tokens) is smaller than the device pool (64 tokens);"
        "L2 cache effectiveness is reduced."
        "Consider increasing --hicache-ratio (or --hicache-size) for higher L2 cache hit rate."
    )
    assert want in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="hostkv_rs"):
        make_mha("layer_first", 16, ratio=2.0)
    assert "is smaller than the device pool" not in caplog.text


def test_success_log(caplog):
    with caplog.at_level(logging.INFO, logger="hostkv_rs"):
        host, _ = make_mla("layer_first", 16, pool_label="draft")
    gb = host.size * host.size_per_token / GB
    assert (
        f"Allocating draft hierarchical KV host pool: {host.size} tokens, {gb:.2f} GB host "
        f"memory." in caplog.text
    )


def test_memory_check_text(monkeypatch):
    dp = MHATokenToKVPool(64, 16, torch.bfloat16, 2, 8, LAYERS)
    requested = 144 * (2 * LAYERS * 2 * 8 * 2)  # 144 tokens x 320 bytes = 46080
    monkeypatch.setattr(_budgets, "host_memory_budget_bytes", lambda: requested - 1)
    allocations = []
    real_alloc = _memory.alloc_host_region
    monkeypatch.setattr(
        _memory,
        "alloc_host_region",
        lambda *args, **kwargs: allocations.append(args) or real_alloc(*args, **kwargs),
    )
    want = (
        f"Not enough host memory available. Requesting {requested / 1e9:.2f} GB but only have "
        f"{(requested - 1) / 1e9:.2f} GB free. Please reduce the size of the hierarchical cache."
    )
    with pytest.raises(ValueError, match=re.escape(want)):
        MHATokenToKVPoolHost(dp, 2.0, 0, 16, "layer_first")
    assert allocations == []  # refused before any allocation
    MHATokenToKVPoolHost(dp, 2.0, 0, 10, "layer_first")  # 70 tokens fit
    assert len(allocations) == 1


def test_memory_check_uses_the_budget_exactly(monkeypatch):
    dp = MLATokenToKVPool(64, 16, torch.bfloat16, 12, 4, LAYERS)
    requested = 144 * 16 * 2 * LAYERS
    monkeypatch.setattr(_budgets, "host_memory_budget_bytes", lambda: requested)
    MLATokenToKVPoolHost(dp, 2.0, 0, 16, "layer_first")  # exactly fits
    monkeypatch.setattr(_budgets, "host_memory_budget_bytes", lambda: 5)
    with pytest.raises(ValueError, match="Not enough host memory available"):
        MLATokenToKVPoolHost(dp, 2.0, 0, 16, "layer_first")


def test_a_pool_refused_after_its_budget_was_booked_gives_it_back(monkeypatch):
    # Inside a budget scope the pool is booked by SGLang's check; hostkv_rs's own check that
    # every allocation fits the memory there is now comes after it. A pool refused there is
    # never built, so the scope must still hold its bytes for the next pool. (V4 pools book
    # nothing, in SGLang and here.)
    budget = 10**9
    dp = MLATokenToKVPool(64, 16, torch.bfloat16, 12, 4, LAYERS)
    with _budgets.host_memory_budget_scope(budget):
        monkeypatch.setattr(
            _memory, "available_host_memory", lambda: _memory.HostMemory(0, "nothing left")
        )
        with pytest.raises(ValueError, match="Not enough host memory for"):
            MLATokenToKVPoolHost(dp, 0, 0.001, 16, "page_first")
        assert _budgets._budget_scope.get() == budget
        monkeypatch.undo()
        pool = MLATokenToKVPoolHost(dp, 0, 0.001, 16, "page_first")
        assert _budgets._budget_scope.get() == budget - pool.size * pool.size_per_token


def test_budget_formula(monkeypatch, tmp_path):
    class VM:
        available = 50 * 1024**3

    monkeypatch.setattr(_memory.psutil, "virtual_memory", lambda: VM)
    # The machine running the tests may sit in a memory cgroup (core/test_faults.py covers those).
    monkeypatch.setattr(_memory, "PROC_SELF_CGROUP", str(tmp_path / "none"))
    assert _budgets.host_memory_budget_bytes() == 40 * 1024**3
    monkeypatch.setattr(_budgets, "ranks_per_host", lambda: 4)
    assert _budgets.host_memory_budget_bytes() == 10 * 1024**3


def test_mla_dcp_and_mtp_arguments_are_accepted():
    dp = MLATokenToKVPool(64, 16, torch.bfloat16, 12, 4, LAYERS)
    host = MLATokenToKVPoolHost(
        dp, 2.0, 0, 16, "layer_first", True, "cpu", "default", None, (), 1, 0, pool_label="x"
    )
    assert host.dcp_size == 1 and host.dcp_rank == 0
    # MLA translates DCP slots in its transfers (pools/test_mla.py covers it).
    dcp = MLATokenToKVPoolHost(dp, 2.0, 0, 16, "layer_first", dcp_size=2)
    assert (dcp.dcp_size, dcp.page_size, dcp.logical_page_size) == (2, 8, 16)
    # MLA packs MTP draft layers (pools/test_mla.py covers it).
    mtp = MLATokenToKVPoolHost(dp, 2.0, 0, 16, "layer_first", mtp_draft_device_pools=(dp,))
    assert (mtp.target_layer_num, mtp.layer_num) == (LAYERS, LAYERS + 1)


def test_dcp_page_size_assert_text():
    dp = MLATokenToKVPool(64, 16, torch.bfloat16, 12, 4, LAYERS)
    with pytest.raises(
        AssertionError,
        match=re.escape(
            "HiCache host pool page_size (16) must be a multiple of dcp_size (3); expected the "
            "widened page from the DCP paged allocator."
        ),
    ):
        MLATokenToKVPoolHost(dp, 2.0, 0, 16, "layer_first", dcp_size=3)


def test_maybe_dcp_kernel_indices():
    host, _ = make_mla("layer_first", 16)
    idx = torch.arange(8)
    assert host.maybe_dcp_kernel_indices(idx) is idx
    # The translation itself, on a pool object posing as rank 1 of 2.
    host.dcp_size, host.dcp_rank = 2, 1
    assert host.maybe_dcp_kernel_indices(idx).tolist() == [0, 1, 2, 3]
    with pytest.raises(
        AssertionError,
        match=re.escape(
            "HiCache DCP translation expects runs of whole widened pages; got 7 logical slots "
            "with dcp_size=2."
        ),
    ):
        host.maybe_dcp_kernel_indices(torch.arange(7))


def test_bad_constructor_arguments():
    dp = MHATokenToKVPool(64, 16, torch.bfloat16, 2, 8, LAYERS)
    with pytest.raises(ValueError, match="page_size must be positive"):
        MHATokenToKVPoolHost(dp, 2.0, 0, 0, "layer_first")
    with pytest.raises(TypeError, match="page_size"):
        MHATokenToKVPoolHost(dp, 2.0, 0, 1.5, "layer_first")
    with pytest.raises(
        ValueError, match="host_to_device_ratio must be a finite non-negative number, got -1.0"
    ):
        MHATokenToKVPoolHost(dp, -1.0, 0, 16, "layer_first")
    with pytest.raises(
        AssertionError,
        match=re.escape("HostTensorAllocator only supports CPU allocations; got device='cuda'"),
    ):
        MHATokenToKVPoolHost(dp, 2.0, 0, 16, "layer_first", device="cuda")
    # None, read as SGLang reads it: the allocator's assert for device, `if pin_memory:` for pinning.
    with pytest.raises(
        AssertionError,
        match=re.escape("HostTensorAllocator only supports CPU allocations; got device=None"),
    ):
        MHATokenToKVPoolHost(dp, 2.0, 0, 16, "layer_first", device=None)
    unpinned = MHATokenToKVPoolHost(dp, 2.0, 0, 16, "layer_first", pin_memory=None)
    assert unpinned.pin_memory is None and not unpinned.kv_buffer.is_pinned()


def test_a_negative_device_capacity_that_sizes_no_page_is_refused_not_built_empty():
    dp = MHATokenToKVPool(64, 16, torch.bfloat16, 2, 8, LAYERS)
    dp.size = -1
    with pytest.raises(ValueError, match=r"device_capacity_tokens \(-1\) sizes the host pool"):
        MHATokenToKVPoolHost(dp, 2.0, 0, 16, "layer_first")
    # As in SGLang: ratio 0 still gives the one extra page.
    assert MHATokenToKVPoolHost(dp, 0.0, 0, 16, "layer_first").size == 16


def test_storage_allocator_type_warns(caplog):
    with caplog.at_level(logging.WARNING, logger="hostkv_rs"):
        host, _ = make_mha("page_first", 16, allocator_type="mooncake")
    assert "'mooncake' storage allocator is not used" in caplog.text
    assert isinstance(host.allocator, _memory.HostTensorAllocator) and host.fd is None


def test_an_unknown_cpu_engine_is_refused_at_the_first_transfer(monkeypatch):
    # The core reads HOSTKV_CPU_ENGINE when it binds the device side.
    monkeypatch.setenv("HOSTKV_CPU_ENGINE", "warp")
    host, dp = make_mha("layer_first", 16)
    idx = torch.arange(16)
    with pytest.raises(ValueError, match="HOSTKV_CPU_ENGINE"):
        host.backup_from_device_all_layer(dp, idx, idx + 16, "kernel")


def test_import_does_not_touch_cuda():
    import subprocess
    import sys

    code = (
        "import sys, hostkv_rs, hostkv_rs.sglang; "
        "import torch; assert not torch.cuda.is_initialized(); "
        "print('ok')"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def _shard(dp, shard_size: int, owned: tuple[int, int]):
    """A device pool under CP layer sharding, as SGLang's layer-split pools expose it."""
    dp.layer_shard_enabled = True
    dp.layer_shard_size = shard_size
    dp._owned_local_layer_range = lambda: owned
    return dp


@pytest.mark.parametrize(
    ("backend", "layout"),
    [("kernel", "layer_first"), ("kernel", "page_first"), ("direct", "layer_first")],
)
def test_layer_sharded_mla_holds_its_owned_layers(layout, backend):
    # 5 device layers over 2 shards: this rank owns layers [3, 5); the host holds ceil(5/2) = 3
    # target layers (the last one unused), as SGLang sizes it.
    dp = _shard(MLATokenToKVPool(64, 16, torch.bfloat16, 12, 4, 5), 2, (3, 5))
    host = MLATokenToKVPoolHost(dp, 2.0, 0, 16, layout)
    assert (host.target_layer_num, host.layer_num) == (3, 3)
    for layer in dp.kv_buffer:
        layer.view(torch.uint8).random_(generator=torch.Generator().manual_seed(7))
    h, d = host.alloc(32), torch.arange(16, 48)
    host.backup_from_device_all_layer(dp, h, d, backend)
    expected = [dp.kv_buffer[i][16:48].view(torch.uint8).clone() for i in range(5)]
    for layer in dp.kv_buffer:
        layer.zero_()
    for layer_id in range(5):  # the controller walks every device layer
        host.load_to_device_per_layer(dp, h, d, layer_id, backend)
    for i in range(5):
        got = dp.kv_buffer[i][16:48].view(torch.uint8)
        if i in (3, 4):
            assert torch.equal(got, expected[i]), f"owned layer {i}"
        else:
            assert not bool(got.any()), f"layer {i} is not this rank's"


def test_layer_sharded_mla_backup_refusals_are_sglangs():
    dp = _shard(MLATokenToKVPool(64, 16, torch.bfloat16, 12, 4, 5), 2, (3, 5))
    idx = torch.arange(16)
    host = MLATokenToKVPoolHost(dp, 2.0, 0, 16, "page_first_direct")
    with pytest.raises(
        ValueError,
        match="Layer-sharded direct HiCache backup only supports layer_first layout, got "
        "page_first_direct",
    ):
        host.backup_from_device_all_layer(dp, idx, idx, "direct")
    with pytest.raises(
        ValueError, match="Layer-sharded HiCache backup does not support layout: page_first_direct"
    ):
        host.backup_from_device_all_layer(dp, idx, idx, "kernel")
    with pytest.raises(
        ValueError, match="Layer-sharded HiCache backup does not support IO backend: kernel_ascend"
    ):
        host.backup_from_device_all_layer(dp, idx, idx, "kernel_ascend")


def test_layer_sharded_mha_skips_layers_it_does_not_own():
    dp = _shard(MHATokenToKVPool(64, 16, torch.bfloat16, 2, 8, 4), 2, (2, 4))
    host = MHATokenToKVPoolHost(dp, 2.0, 0, 16, "page_first")
    h, d = host.alloc(16), torch.arange(16, 32)
    for layer in dp.k_buffer + dp.v_buffer:
        layer.view(torch.uint8).fill_(9)
    host.backup_from_device_all_layer(dp, h, d, "kernel")
    for layer in dp.k_buffer + dp.v_buffer:
        layer.zero_()
    for layer_id in range(4):
        host.load_to_device_per_layer(dp, h, d, layer_id, "kernel")
    for i in range(4):
        filled = bool((dp.k_buffer[i][16:32].view(torch.uint8) == 9).all())
        assert filled == (i >= 2), i


# ---- HOSTKV_PAGE_DIGEST: backups digest the pages they write, loads verify them


def _digest_pool(kind: str, layout: str):
    if kind == "mha":
        dev = MHATokenToKVPool(64, 4, torch.bfloat16, head_num=2, head_dim=8, layer_num=3)
        return dev, MHATokenToKVPoolHost(dev, 2.0, 0, 4, layout), dev.k_buffer
    dev = MLATokenToKVPool(64, 4, torch.bfloat16, kv_lora_rank=8, qk_rope_head_dim=4, layer_num=3)
    return dev, MLATokenToKVPoolHost(dev, 2.0, 0, 4, layout), dev.kv_buffer


def _backed_up_digest_pool(monkeypatch, kind: str, layout: str, backend: str = "kernel"):
    """A watched pool whose slots `h` (two pages) hold a backup of random device rows `d`."""
    monkeypatch.setenv("HOSTKV_PAGE_DIGEST", "1")
    dev, host, layers = _digest_pool(kind, layout)
    for t in layers:
        t.normal_()
    h, d = host.alloc(8), torch.arange(4, 12)
    host.backup_from_device_all_layer(dev, h, d, backend)
    return dev, host, layers, h, d


@pytest.mark.parametrize(
    "kind, layout",
    [
        ("mha", "layer_first"),
        ("mha", "page_first"),
        ("mha", "page_head"),
        ("mha", "page_first_direct"),
        ("mla", "layer_first"),
        ("mla", "page_first_direct"),
    ],
)
def test_page_digests_refuse_a_load_of_a_page_changed_since_its_backup(monkeypatch, kind, layout):
    backend = "direct" if layout == "page_first_direct" else "kernel"
    dev, host, layers, h, d = _backed_up_digest_pool(monkeypatch, kind, layout, backend)
    host.load_to_device_per_layer(dev, h, d, 1, backend)  # unchanged: loads
    page = host.get_data_page(int(h[4]), flat=False)
    page[(0,) * page.dim()] += 1  # one element of the page's first row, in host memory
    before = [t.clone() for t in layers]
    # A batch is verified at its first load (layer after layer share one index tensor): this is
    # the next batch, with its own.
    h = h.clone()
    with pytest.raises(RuntimeError, match=r"host page \d+ \(slots \[\d+, \d+\)\) changed since"):
        host.load_to_device_per_layer(dev, h, d, 1, backend)
    assert all(torch.equal(t, b) for t, b in zip(layers, before)), "a refused load moved bytes"
    host.load_to_device_per_layer(dev, h[:4], d[:4], 1, backend)  # the other page still loads
    # A new backup of the page, or a flat page written over it, is the page's new content.
    host.backup_from_device_all_layer(dev, h, d, backend)
    host.load_to_device_per_layer(dev, h, d, 1, backend)
    flat = torch.zeros(host.get_dummy_flat_data_page().numel(), dtype=torch.bfloat16)
    host.set_from_flat_data_page(int(h[4]), flat)
    host.load_to_device_per_layer(dev, h, d, 1, backend)
    host.set_from_flat_data_page(data_page=flat + 1, index=int(h[4]))  # by name, either order
    host.load_to_device_per_layer(dev, h.clone(), d, 1, backend)
    # The layers of one batch after the first are not hashed again.
    host.backup_from_device_all_layer(dev, h, d, backend)
    host.load_to_device_per_layer(dev, h, d, 0, backend)
    host.get_data_page(int(h[4]), flat=False)[(0,) * page.dim()] += 1
    host.load_to_device_per_layer(dev, h, d, 1, backend)
    with pytest.raises(RuntimeError, match="changed since its backup"):
        host.load_to_device_per_layer(dev, h.clone(), d, 0, backend)
    # Pages handed out by address (page metadata) are forgotten until their next backup.
    host.get_page_buffer_meta(h)
    host.load_to_device_per_layer(dev, h.clone(), d, 0, backend)
    host.backup_from_device_all_layer(dev, h, d, backend)
    host.get_data_page(int(h[4]), flat=False)[(0,) * page.dim()] += 1
    with pytest.raises(RuntimeError, match="changed since its backup"):
        host.load_to_device_per_layer(dev, h.clone(), d, 0, backend)
    # The same index tensor rewritten in place (torch's version counter moves) is verified again.
    host.backup_from_device_all_layer(dev, h, d, backend)
    host.load_to_device_per_layer(dev, h, d, 0, backend)
    host.get_data_page(int(h[4]), flat=False)[(0,) * page.dim()] += 1
    h.copy_(h.clone())
    with pytest.raises(RuntimeError, match="changed since its backup"):
        host.load_to_device_per_layer(dev, h, d, 1, backend)


@pytest.mark.parametrize("kind, layout", [("mha", "page_first"), ("mla", "layer_first")])
def test_page_digests_forget_a_page_handed_to_a_new_owner(monkeypatch, kind, layout):
    # SGLang's zero-copy storage loads (EIC, HF3FS) write a prefetched page into the
    # `get_data_page` views of slots just allocated, and PD decode writes at the addresses
    # `get_contiguous_buf_infos` registered once: the slots' earlier backup says nothing then.
    dev, host, layers, h, d = _backed_up_digest_pool(monkeypatch, kind, layout)
    host.free(h)
    host.alloc(host.available_size() - 8)  # what is left after the eight just freed
    again = host.alloc(8)
    assert sorted(again.tolist()) == sorted(h.tolist())
    for slot in again[:: host.page_size].tolist():
        host.get_data_page(slot, flat=False).fill_(3)  # the storage backend fills the page
    host.load_to_device_per_layer(dev, again, d, 1, "kernel")
    assert all(bool((layers[1][i] == 3).all()) for i in d.tolist())
    # Backed up again by the new owner: checked again.
    host.backup_from_device_all_layer(dev, again, d, "kernel")
    host.get_data_page(int(again[0]), flat=False)[(0,) * layers[0].dim()] += 1
    with pytest.raises(RuntimeError, match="changed since its backup"):
        host.load_to_device_per_layer(dev, again.clone(), d, 1, "kernel")


@pytest.mark.parametrize("kind, layout", [("mha", "layer_first"), ("mla", "page_first")])
def test_page_digests_forget_both_pages_a_flat_page_inside_a_page_covers(monkeypatch, kind, layout):
    # A slot-major layout takes the page's slots from any start (SGLang slices
    # `index:index + page_size`): a start inside a page writes into the next page as well.
    dev, host, layers, h, d = _backed_up_digest_pool(monkeypatch, kind, layout)
    flat = torch.ones(host.get_dummy_flat_data_page().numel(), dtype=torch.bfloat16)
    host.set_from_flat_data_page(int(h[1]), flat)  # slots h[1]..h[4]: pages 0 and 1 of `h`
    host.load_to_device_per_layer(dev, h, d, 1, "kernel")
    assert all(bool((layers[1][i] == 1).all()) for i in d[1:5].tolist())


@pytest.mark.parametrize("dcp_rank", [0, 1])
def test_page_digests_under_dcp_cover_the_rows_this_rank_moves(monkeypatch, dcp_rank):
    # The logical slots of a DCP transfer are every rank's; this rank moves its share
    # (`idx[rank::size] // size`, device slots too), and only the pages of that share are
    # digested and verified.
    monkeypatch.setenv("HOSTKV_PAGE_DIGEST", "1")
    dev = MLATokenToKVPool(48, 4, torch.bfloat16, kv_lora_rank=8, qk_rope_head_dim=4, layer_num=3)
    for t in dev.kv_buffer:
        t.normal_()
    host = MLATokenToKVPoolHost(dev, 2.0, 0, 8, "layer_first", dcp_size=2, dcp_rank=dcp_rank)
    last = torch.arange(host.logical_size - 8, host.logical_size)  # the last widened page
    host.backup_from_device_all_layer(dev, last, torch.arange(8), "kernel")
    host.load_to_device_per_layer(dev, last, torch.arange(8), 0, "kernel")
    # A run reaching one slot past the pool: this rank's share stays inside it and is moved,
    # whatever the other rank's slot.
    edge = [host.logical_size - 1, host.logical_size]  # position dcp_rank: inside the pool
    edge = torch.tensor(edge if dcp_rank == 0 else edge[::-1])
    host.backup_from_device_all_layer(dev, edge, torch.tensor([10, 12]), "kernel")
    host.load_to_device_per_layer(dev, last.clone(), torch.arange(8), 0, "kernel")
    row = int(last[-1]) // 2
    host.kv_buffer[1, row] += 1  # a host row of that page, written behind the pool's back
    with pytest.raises(RuntimeError, match="changed since its backup"):
        host.load_to_device_per_layer(dev, last.clone(), torch.arange(8), 0, "kernel")


def test_page_digests_are_off_by_default_and_a_bad_value_names_the_variable(monkeypatch):
    dev, host, _ = _digest_pool("mha", "page_first")
    assert not host._pool_core.watches_pages
    h, d = host.alloc(4), torch.arange(4, 8)
    host.backup_from_device_all_layer(dev, h, d, "kernel")
    host.get_data_page(int(h[0]), flat=False)[(0,) * 5] += 1
    host.load_to_device_per_layer(dev, h, d, 1, "kernel")  # not checked: loads what is there
    monkeypatch.setenv("HOSTKV_PAGE_DIGEST", "maybe")
    with pytest.raises(ValueError, match="HOSTKV_PAGE_DIGEST='maybe'"):
        _digest_pool("mha", "page_first")


# A flat page set while a torch-function mode (the caller's Python) frees the pool's memory as
# the page is read: the pool's view used to be made before, and the copy wrote freed memory.
_FLAT_PAGE_FREES = r"""
import torch
from torch.overrides import TorchFunctionMode
from hostkv_rs import DeepSeekV4PagedHostPool, MLATokenToKVPool, MLATokenToKVPoolHost
from hostkv_rs.pools import base, v4_paged


class Alloc:  # a storage backend's allocator: plain torch memory, which resize_ frees
    def allocate(self, dims, dtype, device):
        return torch.zeros(dims, dtype=dtype)


base.get_allocator_from_storage = v4_paged.get_allocator_from_storage = lambda *a, **k: Alloc()
if "KIND" == "v4":
    dev = [torch.zeros(64, 656, dtype=torch.uint8) for _ in range(4)]
    host = DeepSeekV4PagedHostPool("c4_kv", dev, 656, 4096, 4, allocator_type="shm")
    storage, index = host._flat.untyped_storage(), 5
else:
    dev = MLATokenToKVPool(
        4096, 16, torch.bfloat16, layer_num=4, kv_lora_rank=96, qk_rope_head_dim=32
    )
    host = MLATokenToKVPoolHost(dev, 2.0, 0, 16, "page_first", allocator_type="shm")
    storage, index = host.kv_buffer.untyped_storage(), 100
page = host.get_data_page(index).clone().fill_(7)


class Frees(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") == "reshape" and storage.nbytes():
            storage.resize_(0)
        return func(*args, **(kwargs or {}))


try:
    with Frees():
        host.set_from_flat_data_page(index, page)
except RuntimeError as exc:
    print("REFUSED", exc)
else:
    print("ACCEPTED")
"""


@pytest.mark.parametrize("kind", ["mla", "v4"])
def test_a_flat_page_set_never_writes_memory_freed_while_the_page_was_read(kind):
    done = subprocess.run(
        [sys.executable, "-c", _FLAT_PAGE_FREES.replace("KIND", kind)],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    assert "REFUSED" in done.stdout and "out of bounds for storage of size 0" in done.stdout


@pytest.mark.parametrize("make", [make_mha, make_mla])
def test_a_page_call_that_meets_destroy_midway_gets_the_destroyed_pools_error(make, monkeypatch):
    """destroy() on another thread may clear `kv_buffer` between a page call's first look and
    the view it makes: the call reads the buffer once and says the pool holds no bytes."""
    host, _ = make("page_first", 4)
    page = host.get_data_page(0).clone()
    real = type(host)._page_geometry

    def geometry_then_destroy(self, index):
        geometry = real(self, index)
        self.destroy()
        return geometry

    monkeypatch.setattr(type(host), "_page_geometry", geometry_then_destroy)
    with pytest.raises(RuntimeError, match="holds no KV bytes"):
        host.get_data_page(0)
    host, _ = make("page_first", 4)
    with pytest.raises(RuntimeError, match="holds no KV bytes"):
        host.set_from_flat_data_page(0, page)


def _host_and_another_device_pool(kind, layers, P):
    """A page_first host pool of `kind` and a second device pool of the same geometry, which
    transfers name instead of the one the host pool was built from."""

    def device():
        if kind == "mha":
            return MHATokenToKVPool(16, P, torch.bfloat16, 2, 8, layers)
        return MLATokenToKVPool(16, P, torch.bfloat16, 12, 4, layers)

    host_cls = MHATokenToKVPoolHost if kind == "mha" else MLATokenToKVPoolHost
    return host_cls(device(), 2.0, 0, P, "page_first"), device()


@pytest.mark.parametrize("kind", ["mha", "mla"])
def test_transfers_naming_another_device_pool_reuse_one_binding_per_layer(kind):
    # SGLang <= 0.5.21 (and no SGLang) reads the device pool a transfer names. A server's
    # per-layer loads of a 12-layer model, round after round, must reuse their bindings: no
    # new binding and nothing left in weakref's registry per call; the cache goes with the pool.
    import gc
    import weakref

    layers, P = 12, 4
    host, other = _host_and_another_device_pool(kind, layers, P)
    h, d = host.alloc(P), torch.arange(P, 2 * P)

    def a_round(pool):
        host.backup_from_device_all_layer(pool, h, d, "kernel")
        for layer in range(layers):
            host.load_to_device_per_layer(pool, h, d, layer, "kernel")

    a_round(other)
    bindings = dict(host._foreign_bindings[id(other)][1])
    assert len(bindings) == layers + 1
    registry = len(weakref.finalize._registry)
    for _ in range(5):
        a_round(other)
    assert len(weakref.finalize._registry) == registry
    cached = host._foreign_bindings[id(other)][1]
    assert cached.keys() == bindings.keys()
    assert all(cached[key] is binding for key, binding in bindings.items())
    del other, cached, bindings
    gc.collect()
    assert len(host._foreign_bindings) == 0


@pytest.mark.parametrize("kind", ["mha", "mla"])
def test_replaced_layers_of_another_device_pool_are_not_kept_alive(kind):
    # A device pool named by transfers whose layer tensors are replaced between rounds: the
    # bindings over the old tensors go (each held every layer of its pool: a server's old KV
    # generations stayed alive until 512 bindings had piled up), the new ones move the bytes.
    import gc
    import weakref

    layers, P = 4, 4
    host, other = _host_and_another_device_pool(kind, layers, P)
    names = ("k_buffer", "v_buffer") if kind == "mha" else ("kv_buffer",)
    h, d = host.alloc(P), torch.arange(P, 2 * P)
    old = []
    for generation in range(1, 4):
        for name in names:
            fresh = [torch.full_like(t, generation) for t in getattr(other, name)]
            setattr(other, name, fresh)
            old.append(weakref.ref(fresh[0]))
        host.backup_from_device_all_layer(other, h, d, "kernel")
        for layer in range(layers):
            for name in names:
                getattr(other, name)[layer].zero_()
            host.load_to_device_per_layer(other, h, d, layer, "kernel")
            for name in names:
                rows = getattr(other, name)[layer][d]
                assert torch.equal(rows, torch.full_like(rows, generation))
        gc.collect()
        alive = [r() is not None for r in old]
        assert alive == [False] * (len(old) - len(names)) + [True] * len(names), generation
        assert len(host._foreign_bindings[id(other)][1]) == layers + 1


class _EqualPool(MHATokenToKVPool):
    """A device pool class whose instances all compare equal (and hash alike)."""

    def __eq__(self, other):
        return True

    def __hash__(self):
        return 0


def test_device_pools_that_compare_equal_keep_bindings_of_their_own():
    # Bindings are kept per device pool by identity: one that dies takes its bindings, and so
    # its device memory, with it, whatever its __eq__ says about a live one.
    import gc
    import weakref

    host = MHATokenToKVPoolHost(
        MHATokenToKVPool(16, 4, torch.bfloat16, 2, 8, 2), 2.0, 0, 4, "page_first"
    )
    h, d = host.alloc(4), torch.arange(4, 8)
    first, second = (_EqualPool(16, 4, torch.bfloat16, 2, 8, 2) for _ in range(2))
    for pool in (first, second):
        host.load_to_device_per_layer(pool, h, d, 0, "kernel")
    assert len(host._foreign_bindings) == 2
    # Host pools that go first leave nothing behind either (no global finalizer per pair).
    registry = len(weakref.finalize._registry)
    for _ in range(3):
        passing = MHATokenToKVPoolHost(
            MHATokenToKVPool(16, 4, torch.bfloat16, 2, 8, 2), 2.0, 0, 4, "page_first"
        )
        passing.load_to_device_per_layer(first, passing.alloc(4), d, 0, "kernel")
        del passing
    gc.collect()
    assert len(weakref.finalize._registry) == registry
    layer = weakref.ref(second.k_buffer[0])
    del second, pool
    gc.collect()
    assert layer() is None
    assert list(host._foreign_bindings) == [id(first)]
