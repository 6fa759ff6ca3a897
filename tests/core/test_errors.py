"""Every error of host-pool-contract.md §3.6 that applies to the MHA, asymmetric and MLA pools, with
its exact text, and the house rule that a refused call leaves both pools unchanged."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
from hostkv_rs import (
    MHATokenToKVPool,
    MHATokenToKVPoolHost,
    MLATokenToKVPool,
    MLATokenToKVPoolHost,
    PageIndexError,
    TransferError,
)
from reference import (
    LAYERS,
    all_device_tensors,
    assert_device_equal,
    assert_host_equal,
    device_planes,
    fill_random,
    host_planes,
    make_asym,
    make_mha,
    make_mla,
    page_tokens,
    snapshot_device,
    snapshot_host,
)

BACKENDS = ["kernel", "direct", "kernel_ascend", "bogus"]
MHA_LAYOUTS = ["layer_first", "page_first", "page_first_direct", "page_head"]
MLA_LAYOUTS = ["layer_first", "page_first", "page_first_direct"]
ASYM_LAYOUTS = ["page_first", "page_first_direct"]


def mha_error(backend, layout):
    supported = {
        "kernel": ("layer_first", "page_first", "page_head"),
        "direct": ("layer_first", "page_first_direct"),
    }
    if backend in supported:
        return None if layout in supported[backend] else f"Unsupported layout: {layout}"
    if backend == "kernel_ascend":
        # Ascend serves page_first_direct in SGLang; without an NPU the backend is refused.
        if layout == "page_first_direct":
            return "Unsupported IO backend: kernel_ascend"
        return f"Unsupported layout: {layout}"
    return f"Unsupported IO backend: {backend}"


def mla_error(backend, layout):
    supported = {
        "kernel": ("layer_first", "page_first"),
        "direct": ("layer_first", "page_first_direct"),
    }
    if backend in supported:
        return None if layout in supported[backend] else f"Unsupported layout: {layout}"
    if backend == "kernel_ascend":
        return f"Unsupported layout: {layout}"
    return f"Unsupported IO backend: {backend}"


def asym_error(backend, layout):
    if backend == "kernel":
        if layout == "page_first":
            return None
        return (
            "Unsupported layout for models with head_dim != v_head_dim and io_backend='kernel': "
            f"{layout}; expected 'page_first'."
        )
    if backend == "direct":
        if layout == "page_first_direct":
            return None
        return (
            "Unsupported layout for models with head_dim != v_head_dim and io_backend='direct': "
            f"{layout}; expected 'page_first_direct'."
        )
    return (
        f"Unsupported IO backend for models with head_dim != v_head_dim: {backend}; "
        "expected 'kernel' or 'direct'."
    )


CASES = (
    [("mha", b, lay, mha_error(b, lay)) for b in BACKENDS for lay in MHA_LAYOUTS]
    + [("asym", b, lay, asym_error(b, lay)) for b in BACKENDS for lay in ASYM_LAYOUTS]
    + [("mla", b, lay, mla_error(b, lay)) for b in BACKENDS for lay in MLA_LAYOUTS]
)
MAKERS = {"mha": make_mha, "asym": make_asym, "mla": make_mla}


def poisoned(kind, layout, page_size=4):
    host, dp = MAKERS[kind](layout, page_size)
    rng = np.random.default_rng(99)
    fill_random(host_planes(host), rng)
    fill_random(all_device_tensors(dp), rng)
    return host, dp


class Unchanged:
    """Context manager: both pools must hold exactly the same bytes afterwards."""

    def __init__(self, host, dp):
        self.host, self.dp = host, dp

    def __enter__(self):
        self.h, self.d = snapshot_host(self.host), snapshot_device(self.dp)

    def __exit__(self, *exc):
        assert_host_equal(self.host, self.h, "host after a refused call")
        assert_device_equal(self.dp, self.d, "device after a refused call")
        return False


@pytest.mark.parametrize(
    "kind,backend,layout,text", [c for c in CASES if c[3] is not None], ids=lambda v: str(v)[:24]
)
def test_unsupported_pairs(kind, backend, layout, text):
    host, dp = poisoned(kind, layout)
    h, d = torch.arange(4), torch.arange(4, 8)
    with Unchanged(host, dp):
        with pytest.raises(ValueError, match=re.escape(text) + "$"):
            host.load_to_device_per_layer(dp, h, d, 0, backend)
        with pytest.raises(ValueError, match=re.escape(text) + "$"):
            host.backup_from_device_all_layer(dp, h, d, backend)


def test_unsupported_layout_at_construction():
    dp = MHATokenToKVPool(32, 4, torch.bfloat16, 2, 8, LAYERS)
    with pytest.raises(ValueError, match=re.escape("Unsupported layout: page_last") + "$"):
        MHATokenToKVPoolHost(dp, 2.0, 0, 4, "page_last")
    mla = MLATokenToKVPool(32, 4, torch.bfloat16, 12, 4, LAYERS)
    with pytest.raises(ValueError, match=re.escape("Unsupported layout: page_head") + "$"):
        MLATokenToKVPoolHost(mla, 2.0, 0, 4, "page_head")
    for layout in ("layer_first", "page_head"):
        with pytest.raises(
            ValueError,
            match=re.escape(
                f"Unsupported layout for models with head_dim != v_head_dim: {layout}; "
                "expected 'page_first' or 'page_first_direct'."
            ),
        ):
            make_asym(layout, 4)


@pytest.mark.parametrize("kind", ["mha", "asym", "mla"])
def test_page_buffer_meta_needs_whole_pages(kind):
    layout = "page_first_direct"
    host, _ = MAKERS[kind](layout, 4)
    with pytest.raises(AssertionError):
        host.get_page_buffer_meta(torch.arange(6))
    with pytest.raises(ValueError, match="first slot of a page"):
        host.get_page_buffer_meta(torch.arange(2, 6))
    with pytest.raises(ValueError, match="does not fit"):
        host.get_page_buffer_meta(torch.arange(host.size, host.size + 4))


def test_split_heads_asserts():
    host, _ = make_mha("page_first", 4)
    with pytest.raises(AssertionError):
        host.get_split_heads_page_buffer_meta(torch.arange(4), 1)
    ph, _ = make_mha("page_head", 4, heads=2)
    with pytest.raises(AssertionError):
        ph.get_split_heads_page_buffer_meta(torch.arange(4), 3)
    with pytest.raises(AssertionError):
        ph.get_split_heads_page_buffer_meta(torch.arange(5), 2)


def test_flat_page_errors_leave_pool_unchanged():
    host, dp = poisoned("mha", "layer_first")
    with Unchanged(host, dp):
        with pytest.raises(ValueError, match="elements"):
            host.set_from_flat_data_page(0, torch.zeros(3, dtype=host.dtype))
        with pytest.raises(IndexError):
            host.set_from_flat_data_page(host.size - 2, host.get_dummy_flat_data_page())
        with pytest.raises(IndexError):
            host.get_data_page(-4)
    mla, mdp = poisoned("mla", "page_first_direct")
    with Unchanged(mla, mdp), pytest.raises(IndexError):
        mla.set_from_flat_data_page(mla.size, mla.get_dummy_flat_data_page())


def _bad_transfers(host, dp, backend):
    """(description, call) pairs that must raise before any byte moves."""
    P = host.page_size
    good_h = torch.tensor(page_tokens([1], P))
    good_d = torch.tensor(page_tokens([2], P))
    rows = dp.size + dp.page_size
    return [
        (
            "host slot out of range",
            lambda op: op(torch.tensor(page_tokens([host.page_num], P)), good_d),
        ),
        ("negative host slot", lambda op: op(good_h - 2 * P, good_d)),
        ("device row out of range", lambda op: op(good_h, good_d + rows)),
        ("negative device row", lambda op: op(good_h, good_d - 3 * P)),
        ("length mismatch", lambda op: op(good_h, good_d[:-1] if P > 1 else torch.arange(1, 3))),
        (
            "last page runs past the device",
            lambda op: op(good_h, torch.arange(rows - P + 1, rows + 1)),
        ),
    ]


@pytest.mark.parametrize(
    "kind,backend,layout",
    [
        ("mha", "kernel", "layer_first"),
        ("mha", "kernel", "page_head"),
        ("mha", "direct", "page_first_direct"),
        ("asym", "kernel", "page_first"),
        ("asym", "direct", "page_first_direct"),
        ("mla", "direct", "layer_first"),
        ("mla", "kernel", "page_first"),
    ],
)
def test_bad_indices_raise_transfer_error_and_change_nothing(kind, backend, layout):
    host, dp = poisoned(kind, layout)

    def backup(h, d):
        host.backup_from_device_all_layer(dp, h, d, backend)

    def load(h, d):
        host.load_to_device_per_layer(dp, h, d, LAYERS - 1, backend)

    assert issubclass(TransferError, ValueError)
    for what, call in _bad_transfers(host, dp, backend):
        for op in (backup, load):
            with Unchanged(host, dp), pytest.raises(TransferError):
                call(op)
                pytest.fail(f"{what}: accepted by {op.__name__}")


def test_direct_page_copies_need_whole_pages():
    host, dp = poisoned("mha", "page_first_direct")
    with Unchanged(host, dp), pytest.raises(TransferError):
        host.backup_from_device_all_layer(dp, torch.arange(0, 6), torch.arange(4, 10), "direct")


@pytest.mark.parametrize("layer_id", [-1, LAYERS, 10**6])
def test_a_layer_the_pool_does_not_hold_is_skipped(layer_id):
    # SGLang returns without copying for a layer outside the pool (0.5.23: `not 0 <= layer_id <
    # target_layer_num`; earlier releases: not in the owned range), whatever else is passed.
    host, dp = poisoned("mha", "page_first")
    idx = torch.arange(4)
    with Unchanged(host, dp):
        assert host.load_to_device_per_layer(dp, idx, idx + 4, layer_id, "kernel") is None
        host.load_to_device_per_layer(dp, idx, idx + 4, layer_id, "no-such-backend")
    with pytest.raises(TypeError, match="layer_id must be an integer"):
        host.load_to_device_per_layer(dp, idx, idx + 4, 1.0, "kernel")


class _IndexRaises:
    """An integer-like argument whose `__index__` raises `error`."""

    def __init__(self, error):
        self.error = error

    def __index__(self):
        raise self.error


@pytest.mark.parametrize("error", [KeyboardInterrupt, SystemExit, MemoryError, ValueError])
def test_what_an_arguments_index_raises_passes_through(error):
    # A Ctrl-C (or any error of its own) raised while an integer argument is read reaches the
    # caller as itself, as `operator.index` lets it, not as "must be an integer".
    from hostkv_rs import DeepSeekV4PagedHostPool

    host, dp = poisoned("mha", "page_first")
    idx = torch.arange(4)
    v4 = DeepSeekV4PagedHostPool("c4", [torch.zeros(8, 16, dtype=torch.uint8)], 16, 4, 4)
    calls = (
        lambda bad: host.load_to_device_per_layer(dp, idx, idx + 4, bad, "kernel"),
        lambda bad: host.get_data_page(bad),
        lambda bad: host.set_from_flat_data_page(bad, host.get_data_page(0)),
        lambda bad: v4.load_to_device_per_layer(None, idx, idx + 4, bad, "kernel"),
    )
    for call in calls:
        with Unchanged(host, dp), pytest.raises(error):
            call(_IndexRaises(error))
    with pytest.raises(TypeError, match="layer_id must be an integer"):
        host.load_to_device_per_layer(dp, idx, idx + 4, _IndexRaises(TypeError), "kernel")
    with pytest.raises(TypeError, match="index must be an integer, got <object"):
        host.get_data_page(object())

    class NotAnInt:
        def __index__(self):
            return 1.5  # noqa: PLE0305 (the point of the test)

    with pytest.raises(TypeError, match="layer_id must be an integer"):
        host.load_to_device_per_layer(dp, idx, idx + 4, NotAnInt(), "kernel")


@pytest.mark.parametrize(
    "kind,layout,backend",
    [
        ("mha", "layer_first", "kernel"),
        ("mha", "page_first", "kernel"),
        ("mha", "page_first_direct", "direct"),
        ("mla", "page_first", "kernel"),
    ],
)
def test_an_index_array_in_the_memory_a_transfer_writes_is_refused(kind, layout, backend):
    # The engines read an index array more than once: one stored in the bytes the call writes
    # was rewritten under them (rows outside the listed ones written, or a refusal part-way).
    host, dp = poisoned(kind, layout)
    n = 8
    hv, dv = host.alloc(n), torch.arange(4, 4 + n)
    first_plane = device_planes(dp)[0]

    def stored_in(tensor, values):
        # The last n int64 words of `tensor`'s bytes hold `values` (rows no call lists).
        words = tensor.view(-1).view(torch.uint8)[-8 * n :].view(torch.int64)
        words.copy_(values)
        return words

    di = stored_in(first_plane[1], dv)
    with Unchanged(host, dp), pytest.raises(TransferError, match="device index array lies in"):
        host.load_to_device_per_layer(dp, hv, di, 1, backend)
    hi = stored_in(host_planes(host)[-1], hv)
    with Unchanged(host, dp), pytest.raises(TransferError, match="host index array lies in"):
        host.backup_from_device_all_layer(dp, hi, dv, backend)
    # In memory the call reads but does not write, an index array is fine.
    host.load_to_device_per_layer(dp, hv, stored_in(first_plane[2], dv), 1, backend)
    host.backup_from_device_all_layer(dp, hv, di, backend)


def test_float_indices_are_refused():
    host, dp = poisoned("mla", "layer_first")
    with Unchanged(host, dp), pytest.raises(TypeError):
        host.backup_from_device_all_layer(dp, torch.arange(4.0), torch.arange(4), "kernel")


def test_device_pool_geometry_mismatch():
    host, _ = poisoned("mha", "layer_first")
    other_dtype = MHATokenToKVPool(16, 4, torch.float32, 2, 8, LAYERS)
    other_heads = MHATokenToKVPool(16, 4, torch.bfloat16, 1, 8, LAYERS)
    fewer_layers = MHATokenToKVPool(16, 4, torch.bfloat16, 2, 8, LAYERS - 1)
    idx = torch.arange(4)
    for dp, text in (
        (
            other_dtype,
            (
                "device pool store_dtype=torch.float32 differs from the host pool's "
                "dtype=torch.bfloat16"
            ),
        ),
        (other_heads, "head split (1, 8) (heads, head_dim) differs from the host pool's (2, 8)"),
    ):
        with Unchanged(host, dp), pytest.raises(ValueError, match=re.escape(text)):
            host.backup_from_device_all_layer(dp, idx, idx + 4, "kernel")
        with Unchanged(host, dp), pytest.raises(ValueError, match=re.escape(text)):
            host.load_to_device_per_layer(dp, idx, idx + 4, 0, "kernel")
    with Unchanged(host, fewer_layers), pytest.raises(TransferError, match="layers"):
        host.backup_from_device_all_layer(fewer_layers, idx, idx + 4, "kernel")


@pytest.mark.parametrize("what", ["dtype", "head split"])
def test_same_bytes_is_not_the_same_data(what):
    # A device pool whose rows have the host's byte size but hold other data: fp16 instead of
    # bf16, or 4 heads of 8 instead of 2 heads of 16.
    dp = MHATokenToKVPool(16, 4, torch.bfloat16, 2, 16, LAYERS)
    host = MHATokenToKVPoolHost(dp, 2.0, 0, 4, "page_first")
    if what == "dtype":
        other = MHATokenToKVPool(16, 4, torch.float16, 2, 16, LAYERS)
        text = "store_dtype=torch.float16 differs from the host pool's dtype=torch.bfloat16"
    else:
        other = MHATokenToKVPool(16, 4, torch.bfloat16, 4, 8, LAYERS)
        text = "head_dim=8 differs from the host pool's head_dim=16"
    idx = torch.arange(4)
    with Unchanged(host, other), pytest.raises(ValueError, match=re.escape(text)):
        host.load_to_device_per_layer(other, idx, idx + 4, 0, "kernel")
    with Unchanged(host, other), pytest.raises(ValueError, match=re.escape(text)):
        host.backup_from_device_all_layer(other, idx, idx + 4, "kernel")
    # Tensors alone (no pool attributes to compare): the dtype and the head split of the rows.
    bare = type("Bare", (), {})()
    bare.k_buffer, bare.v_buffer = other.k_buffer, other.v_buffer
    tensor_text = "dtype torch.float16 differs" if what == "dtype" else "head split (4, 8)"
    with Unchanged(host, other), pytest.raises(ValueError, match=re.escape(tensor_text)):
        host.load_to_device_per_layer(bare, idx, idx + 4, 0, "kernel")


def test_one_strided_device_layer_among_packed_ones_is_refused():
    # Strided rows are moved where every layer shares the stride (SGLang's unified pools);
    # SGLang refuses a mix when the pool is built.
    host, dp = poisoned("mla", "layer_first")
    wide = torch.zeros(dp.kv_buffer[0].shape[0], 1, 2 * dp.kv_cache_dim, dtype=torch.bfloat16)
    dp.kv_buffer[0] = wide[..., : dp.kv_cache_dim]
    with pytest.raises(NotImplementedError, match="do not share one row stride"):
        MLATokenToKVPoolHost(dp, 2.0, 0, 4, "layer_first")
    # A layer restrided that way after the pool was built: refused at the transfer.
    captured = host.device_kv_buffers[0]
    captured.set_(
        wide.untyped_storage(), 0, captured.shape, (2 * dp.kv_cache_dim, dp.kv_cache_dim, 1)
    )
    idx = torch.arange(4)
    with Unchanged(host, dp), pytest.raises(NotImplementedError, match="do not share one row"):
        host.load_to_device_per_layer(dp, idx, idx + 4, 0, "kernel")


def test_device_layers_are_the_ones_captured_at_construction():
    # SGLang 0.5.22+ keeps the device buffers it was built with; a list entry replaced later
    # is not read (the captured tensor stays alive and is the one moved).
    host, dp = poisoned("mla", "layer_first")
    captured = dp.kv_buffer[0]
    dp.kv_buffer[0] = torch.full_like(captured, 3.0)
    h, d = host.alloc(4), torch.arange(4, 8)
    host.load_to_device_per_layer(dp, h, d, 0, "kernel")
    assert torch.equal(captured[4:8], host.kv_buffer[0][h])
    assert bool((dp.kv_buffer[0] == 3.0).all())


# ---- every refusal names the parameter and the value (hardening) ------------------------------


def _dev():
    return MHATokenToKVPool(64, 16, torch.bfloat16, head_num=2, head_dim=8, layer_num=2)


@pytest.mark.parametrize(
    ("ratio", "host_size", "error", "text"),
    [
        (2.0, float("inf"), ValueError, "host_size must be a finite number of GB"),
        (2.0, float("nan"), ValueError, "host_size must be a finite number of GB"),
        (
            2.0,
            True,
            TypeError,
            "host_size must be a finite number of GB (0: use the ratio), got True",
        ),
        (
            float("inf"),
            0,
            ValueError,
            "host_to_device_ratio must be a finite non-negative number, got inf",
        ),
        (
            float("nan"),
            0,
            ValueError,
            "host_to_device_ratio must be a finite non-negative number, got nan",
        ),
        ("2", 0, TypeError, "host_to_device_ratio must be a finite non-negative number, got '2'"),
        (True, 0, TypeError, "host_to_device_ratio must be a finite non-negative number, got True"),
        (
            -1.0,
            0,
            ValueError,
            "host_to_device_ratio must be a finite non-negative number, got -1.0",
        ),
        (None, 0, TypeError, "needs host_to_device_ratio (got None)"),
    ],
)
def test_sizing_arguments_are_refused_by_name(ratio, host_size, error, text):
    with pytest.raises(error, match=re.escape(text)):
        MHATokenToKVPoolHost(_dev(), ratio, host_size, 16, "page_first")


def test_bad_index_tensors_are_refused_by_what_they_are():
    dp = _dev()
    host = MHATokenToKVPoolHost(dp, 2.0, 0, 16, "page_first")
    h, d = host.alloc(16), torch.arange(16, 32)
    with Unchanged(host, dp):
        with pytest.raises(
            TypeError, match="must be dense \\(strided\\) tensors, got torch.sparse_coo"
        ):
            host.load_to_device_per_layer(dp, h.to_sparse(), d, 0, "kernel")
        big = torch.full((16,), 2**64 - 1, dtype=torch.uint64)
        with pytest.raises(
            ValueError, match="index 18446744073709551615 at position 0 does not fit"
        ):
            host.load_to_device_per_layer(dp, big, d, 0, "kernel")
    with pytest.raises(TypeError, match="device_pool"):
        MHATokenToKVPoolHost(None, 2.0, 0, 16, "page_first")


def test_core_arguments_name_the_parameter():
    from hostkv_rs import _core

    with pytest.raises(
        ValueError, match=re.escape("nbytes must lie in [0, 2**63), got 18446744073709551616")
    ):
        _core.HostRegion(2**64)
    with pytest.raises(TypeError, match="nbytes must be an integer, got True"):
        _core.HostRegion(True)
    with pytest.raises(ValueError, match="pretouch_threads must lie in \\[0, 4096\\].*got -1"):
        _core.HostRegion(64, pretouch_threads=-1)
    with pytest.raises(ValueError, match=re.escape("item_bytes must be positive")):
        _core.HostPool.from_geometry("layer_first", 1, 4, 1, [0], [_core.HostRegion(64)])


def test_v4_device_buffers_must_be_tensors():
    from hostkv_rs import DeepSeekV4PagedHostPool

    with pytest.raises(
        TypeError, match=re.escape("c4: device_buffers[0] must be a torch.Tensor, got int")
    ):
        DeepSeekV4PagedHostPool("c4", [1, 2], 16, 4, 4)


def test_a_destroyed_pool_says_so():
    host = MHATokenToKVPoolHost(_dev(), 2.0, 0, 16, "page_first")
    host.destroy()
    with pytest.raises(RuntimeError, match="has been destroyed: its KV buffers are gone"):
        host.k_buffer  # noqa: B018


def test_page_block_copies_refuse_pages_that_are_not_whole_runs():
    host, dp = poisoned("mha", "page_first_direct")
    h = torch.arange(4)
    with (
        Unchanged(host, dp),
        pytest.raises(TransferError, match=re.escape("page 0: device index 6")),
    ):
        host.load_to_device_per_layer(dp, h, torch.tensor([7, 6, 5, 4]), 0, "direct")
    with Unchanged(host, dp), pytest.raises(TransferError, match="does not start a page"):
        host.backup_from_device_all_layer(dp, torch.arange(1, 5), torch.arange(4, 8), "direct")


# ---- a tensor's storage must hold what its shape claims (hardening) ---------------------------


def _shrink(tensor: torch.Tensor) -> torch.Tensor:
    tensor.untyped_storage().resize_(64)
    return tensor


@pytest.mark.parametrize("op", ["load", "backup"])
def test_a_device_layer_with_a_shrunk_storage_is_refused(op):
    host, dp = poisoned("mla", "layer_first")
    idx = torch.arange(4)
    host_before = snapshot_host(host)
    _shrink(dp.kv_buffer[0])
    with pytest.raises(ValueError, match="storage holds 64 bytes, fewer than its shape"):
        if op == "load":
            host.load_to_device_per_layer(dp, idx, idx + 4, 0, "kernel")
        else:
            host.backup_from_device_all_layer(dp, idx, idx + 4, "kernel")
    assert_host_equal(host, host_before, "host after a refused transfer")


def test_an_index_tensor_with_a_shrunk_storage_is_refused():
    host, dp = poisoned("mha", "page_first")
    h = _shrink(torch.arange(4096)[:16])  # 64 bytes hold 8 of its 16 int64 values
    with Unchanged(host, dp), pytest.raises(ValueError, match="index tensor: the tensor's storage"):
        host.load_to_device_per_layer(dp, h, torch.arange(8, 24), 0, "kernel")


def test_a_flat_page_with_a_shrunk_storage_is_refused():
    host, _ = poisoned("mla", "page_first")
    page = _shrink(torch.zeros(host.get_dummy_flat_data_page().numel(), dtype=host.dtype))
    before = snapshot_host(host)
    with pytest.raises(ValueError, match="flat data page: the tensor's storage holds 64 bytes"):
        host.set_from_flat_data_page(0, page)
    assert_host_equal(host, before, "host after a refused page write")


def test_a_v4_device_buffer_with_a_shrunk_storage_is_refused():
    from hostkv_rs import DeepSeekV4PagedHostPool

    dev = [torch.zeros(8, 128, dtype=torch.uint8) for _ in range(2)]
    _shrink(dev[1])
    with pytest.raises(ValueError, match="c4: device buffer 1: the tensor's storage holds 64"):
        DeepSeekV4PagedHostPool("c4", dev, 128, 4, 2)


# ---- structured refusals: the fields a caller can act on --------------------------------------


def test_out_of_range_index_names_side_position_value_and_bound():
    host, dp = poisoned("mha", "page_first")
    h = torch.arange(16)
    h[5] = host.size + 3
    with Unchanged(host, dp), pytest.raises(TransferError) as info:
        host.backup_from_device_all_layer(dp, h, torch.arange(16, 32), "kernel")
    e = info.value
    assert (e.kind, e.side, e.position, e.value, e.bound) == (
        "out_of_range",
        "host",
        5,
        host.size + 3,
        host.size,
    ), vars(e)
    assert isinstance(e, ValueError) and isinstance(e, RuntimeError)

    d = torch.arange(16, 32)
    d[2] = -4
    with Unchanged(host, dp), pytest.raises(TransferError) as info:
        host.load_to_device_per_layer(dp, torch.arange(16), d, 0, "kernel")
    e = info.value
    assert (e.kind, e.side, e.position, e.value) == ("negative", "device", 2, -4), vars(e)


def test_length_mismatch_keeps_sglangs_text_and_carries_both_lengths():
    host, dp = poisoned("mha", "layer_first")
    with Unchanged(host, dp), pytest.raises(TransferError) as info:
        host.backup_from_device_all_layer(dp, torch.arange(16), torch.arange(8), "kernel")
    e = info.value
    assert str(e) == "Source and destination indices must have the same length"
    assert (e.kind, e.host_len, e.device_len) == ("length_mismatch", 16, 8)


def test_broken_page_run_names_the_page_and_the_index():
    host, dp = poisoned("mha", "page_first_direct")
    with Unchanged(host, dp), pytest.raises(TransferError) as info:
        host.load_to_device_per_layer(dp, torch.arange(4), torch.tensor([7, 6, 5, 4]), 0, "direct")
    e = info.value
    assert (e.kind, e.page, e.side, e.position, e.value) == (
        "page_run_broken",
        0,
        "device",
        1,
        6,
    ), vars(e)


def test_index_errors_are_transfer_errors_and_index_errors():
    import hostkv_rs
    from hostkv_rs import _core

    for cls in (hostkv_rs.LayerIndexError, hostkv_rs.PageIndexError):
        assert issubclass(cls, TransferError) and issubclass(cls, IndexError), cls.__mro__
        assert cls.__module__ == "hostkv_rs._core"
    assert hostkv_rs.LayerIndexError is _core.LayerIndexError
    host, _ = poisoned("mha", "page_first")
    with pytest.raises(hostkv_rs.PageIndexError):
        host.get_data_page(host.size + 16)


# ---- values past what the core or a float holds: clear errors, never OverflowError -------------


@pytest.mark.parametrize("kind", ["mha", "mla", "v4"])
@pytest.mark.parametrize(
    "index", [2**63, 2**64, -(2**63) - 1, 2**1024], ids=["2**63", "2**64", "-2**63-1", "2**1024"]
)
def test_a_huge_page_index_is_an_index_error_naming_it(kind, index):
    from hostkv_rs import DeepSeekV4PagedHostPool, PageIndexError

    if kind == "v4":
        dev = [torch.zeros(8, 16, dtype=torch.uint8)]
        host = DeepSeekV4PagedHostPool("c4", dev, 16, 4, 2, pin_memory=False)
    else:
        host, _ = MAKERS[kind]("page_first", 4)
    text = f"page index {index} is out of range: the host pool has {host.size} slots"
    with pytest.raises(PageIndexError, match=re.escape(text)) as exc:
        host.get_data_page(index)
    assert exc.value.kind == "page_out_of_range"
    with pytest.raises(IndexError, match=re.escape(text)):
        host.set_from_flat_data_page(index=index, data_page=host.get_dummy_flat_data_page())


def test_every_transfer_error_has_a_kind_even_raised_without_fields():
    from hostkv_rs import LayerIndexError, PageIndexError, TransferError, _core

    assert TransferError("x").kind == "other"
    assert LayerIndexError("x").kind == "layer_out_of_range"
    assert PageIndexError("x").kind == "page_out_of_range"
    from hostkv_rs import DeepSeekV4PagedHostPool

    dev = [torch.zeros(8, 16, dtype=torch.uint8)]
    host = DeepSeekV4PagedHostPool("c4", dev, 16, 4, 2, pin_memory=False)
    with pytest.raises(LayerIndexError) as exc:  # raised by the pool's Python, not the core
        host.load_to_device_per_layer(None, torch.arange(4), torch.arange(4), 99, "direct")
    assert exc.value.kind == "layer_out_of_range"
    assert issubclass(_core.PageIndexError, TransferError)


@pytest.mark.parametrize(
    ("ratio", "host_size", "text"),
    [
        (
            2.0,
            2**1024,
            (
                "host_size must be a finite number of GB (0: use the ratio), got "
                "179769313486... (309 digits)"
            ),
        ),
        (
            2**1024,
            0,
            (
                "host_to_device_ratio must be a finite non-negative number, got "
                "179769313486... (309 digits)"
            ),
        ),
        (2.0, 1e300, "host_size=1e+300 is too large: the size in bytes exceeds the float range"),
        (
            1e307,
            0,
            "host_to_device_ratio=1e+307 is too large: the host token count exceeds the float range",
        ),
    ],
    ids=["host_size=2**1024", "ratio=2**1024", "host_size=1e300", "ratio=1e307"],
)
def test_sizes_past_the_float_range_are_value_errors(ratio, host_size, text):
    with pytest.raises(ValueError, match=re.escape(text)):
        MHATokenToKVPoolHost(_dev(), ratio, host_size, 16, "page_first")


def _quantized_indices():
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # quantized tensors are deprecated
        return torch.quantize_per_tensor(torch.arange(16.0), 1.0, 0, torch.quint8)


def test_a_quantized_index_tensor_is_refused_by_its_dtype():
    host, dp = poisoned("mha", "page_first")
    q = _quantized_indices()
    text = "index tensors must be integer tensors, got torch.quint8"
    with Unchanged(host, dp):
        with pytest.raises(TypeError, match=re.escape(text)):
            host.load_to_device_per_layer(dp, q, torch.arange(16), 0, "kernel")
        with pytest.raises(TypeError, match=re.escape(text)):
            host.backup_from_device_all_layer(dp, torch.arange(16), q, "kernel")
    with pytest.raises(TypeError, match=re.escape(text)):
        host.free(q)
    with pytest.raises(TypeError, match=re.escape(text)):
        host.get_page_buffer_meta(q)


def test_an_index_list_past_int64_names_the_value():
    host, _ = poisoned("mha", "page_first")
    with pytest.raises(ValueError, match=re.escape(f"index {2**70} does not fit in int64")):
        host.free([1, 2**70])


@pytest.mark.parametrize("shard", [0, -1])
def test_a_layer_sharded_mla_pool_with_an_empty_shard(shard):
    dp = MLATokenToKVPool(64, 16, torch.bfloat16, 12, 4, LAYERS)
    dp.layer_shard_enabled = True
    dp.layer_shard_size = shard
    dp._owned_local_layer_range = lambda: (0, LAYERS)
    with pytest.raises(
        ValueError, match=re.escape(f"device pool layer_shard_size must be positive, got {shard}")
    ):
        MLATokenToKVPoolHost(dp, 2.0, 0, 16, "layer_first")


def test_a_logical_pool_whose_slot_tables_cannot_fit_is_refused_by_name():
    from hostkv_rs import LogicalHostPool

    with pytest.raises(
        ValueError,
        match=re.escape("Not enough host memory for LogicalHostPool(size=68719476736): it needs"),
    ):
        LogicalHostPool(2**36, 64)


@pytest.mark.parametrize("split_factor", [-1, 0])
def test_split_factor_must_be_positive(split_factor):
    host, _ = make_mha("page_head", 4, heads=2)
    text = f"split_factor must be positive, got {split_factor}"
    with pytest.raises(ValueError, match=re.escape(text)):
        host.get_split_heads_page_buffer_meta(torch.arange(4), split_factor)
    with pytest.raises(ValueError, match=re.escape(text)):
        host.get_page_buffer_element_size(split_factor)


@pytest.mark.parametrize("split_factor", [-1, 0, 2**70])
def test_the_layout_is_refused_before_the_split_factor_is_read(split_factor):
    """SGLang asserts page_head first: another layout gets that AssertionError whatever the
    split (its page_head pools then fail on a bad one, where ours raise the ValueError above)."""
    host, _ = make_mha("layer_first", 4, heads=2)
    text = "get_split_heads_page_buffer_meta requires layout='page_head', got layer_first"
    with pytest.raises(AssertionError, match=re.escape(text)):
        host.get_split_heads_page_buffer_meta(torch.arange(4), split_factor)
    with pytest.raises(AssertionError, match=re.escape(text)):
        host.get_page_buffer_element_size(split_factor)


def test_a_split_factor_past_u64_is_sglangs_assert():
    host, _ = make_mha("page_head", 4, heads=2)
    with pytest.raises(AssertionError, match=re.escape(f"split_factor ({2**64})")):
        host.get_split_heads_page_buffer_meta(torch.arange(4), 2**64)


def test_pools_without_a_head_split_take_split_factor_one_only():
    host, _ = make_mla("page_first", 4)
    assert host.get_page_buffer_element_size(1) == host.get_page_buffer_element_size()
    with pytest.raises(
        ValueError, match="MLATokenToKVPoolHost has no head split: split_factor must be 1, got 2"
    ) as e:
        host.get_page_buffer_element_size(2)
    assert isinstance(e.value, AttributeError)  # what SGLang's MLA pool raises there


@pytest.mark.parametrize("index", [2**63, -(2**63) - 1, 2**70])
def test_a_page_index_no_slot_number_reaches_is_a_page_index_error(index):
    dev = MHATokenToKVPool(64, 16, torch.bfloat16, head_num=2, head_dim=8, layer_num=3)
    host = MHATokenToKVPoolHost(dev, 2.0, 0, 16, "layer_first")
    with pytest.raises(
        PageIndexError,
        match=f"page index {index} is out of range: the host pool has {host.size} slots",
    ):
        host.get_data_page(index)
