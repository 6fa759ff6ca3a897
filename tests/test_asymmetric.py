"""AsymmetricMHATokenToKVPoolHost (head_dim != v_head_dim) against host-pool-contract.md §2.2,
§3.3, §4.4, §4.5 and the factory of §1.1 (the page round trips of every pool kind are in
test_transfers.py)."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
from hostkv_rs import (
    AsymmetricMHATokenToKVPoolHost,
    MHATokenToKVPool,
    MHATokenToKVPoolHost,
    get_mha_host_pool_cls,
)
from reference import (
    DEVICE_PAGES,
    LAYERS,
    make_asym,
    page_tokens,
    round_trip,
)

FLAT_TEXT = (
    "Models with head_dim != v_head_dim do not support the flat-page interface used by HiCache "
    "L3 storage backends {hf3fs, eic, nixl}. Use a backend that does not use this interface "
    "(e.g. mooncake, simm)."
)


def test_kernel_page_first_scattered_tokens():
    rng = np.random.default_rng(5)
    host, dp = make_asym("page_first", 16, torch.bfloat16)
    n = 19
    rows = DEVICE_PAGES * 16 + 16
    round_trip(
        host,
        dp,
        "kernel",
        rng.permutation(host.size)[:n],
        rng.permutation(np.arange(1, rows))[:n],
        rng.permutation(np.arange(1, rows))[:n],
    )


def test_factory_picks_the_class():
    sym = MHATokenToKVPool(32, 16, torch.bfloat16, 2, 8, 3)
    asym = MHATokenToKVPool(32, 16, torch.bfloat16, 2, 8, 3, v_head_dim=4)
    assert get_mha_host_pool_cls(sym) is MHATokenToKVPoolHost
    assert get_mha_host_pool_cls(asym) is AsymmetricMHATokenToKVPoolHost


class MHATokenToKVPoolMXFP8(MHATokenToKVPool):
    """Stand-in for SGLang's MXFP8 device pool class (recognised by class name)."""


def test_factory_mxfp8():
    asym = MHATokenToKVPoolMXFP8(32, 16, torch.bfloat16, 2, 8, 3, v_head_dim=4)
    with pytest.raises(
        NotImplementedError,
        match=re.escape("MXFP8 HiCache does not support asymmetric K/V head dimensions yet."),
    ):
        get_mha_host_pool_cls(asym)
    sym = MHATokenToKVPoolMXFP8(32, 16, torch.bfloat16, 2, 8, 3)
    with pytest.raises(NotImplementedError, match="MXFP8"):
        get_mha_host_pool_cls(sym)
    flagged = MHATokenToKVPool(32, 16, torch.bfloat16, 2, 8, 3)
    flagged.is_mxfp8 = True
    with pytest.raises(NotImplementedError, match="MXFP8"):
        get_mha_host_pool_cls(flagged)


@pytest.mark.parametrize("layout", ["page_first", "page_first_direct"])
def test_geometry_two_buffers_no_shared_stride(layout):
    P, H, D, Dv, e = 4, 2, 8, 4, 2
    host, _ = make_asym(layout, P, torch.bfloat16, heads=H, head_dim=D, v_head_dim=Dv)
    L, S, Pn = LAYERS, host.size, host.page_num
    assert isinstance(host.kv_buffer, tuple) and len(host.kv_buffer) == 2
    k, v = host.kv_buffer
    assert host.k_buffer is k and host.v_buffer is v
    if layout == "page_first":
        assert k.shape == (S, L, H, D) and v.shape == (S, L, H, Dv)
    else:
        assert k.shape == (Pn, L, P, H, D) and v.shape == (Pn, L, P, H, Dv)
    assert host.size_per_token == (D + Dv) * H * L * e
    assert host.get_ksize_per_token() == D * H * L * e
    for name in ("token_stride_size", "layout_dim"):
        with pytest.raises(AttributeError):
            getattr(host, name)
    assert host.get_hybrid_pool_buffer() == [k, v]


@pytest.mark.parametrize("layout", ["page_first", "page_first_direct"])
def test_get_page_buffer_meta(layout):
    P, H, D, Dv, e = 4, 2, 8, 4, 2
    host, _ = make_asym(layout, P, torch.bfloat16, heads=H, head_dim=D, v_head_dim=Dv)
    L = LAYERS
    kb, vb = host.k_buffer.data_ptr(), host.v_buffer.data_ptr()
    pages = [4, 1]
    ptrs, sizes = host.get_page_buffer_meta(torch.tensor(page_tokens(pages, P)))
    want = []
    for p in pages:
        want += [kb + p * L * P * H * D * e, vb + p * L * P * H * Dv * e]
    assert ptrs == want
    assert sizes == [L * P * H * D * e, L * P * H * Dv * e] * 2


def test_flat_pages_and_split_heads_are_refused():
    host, _ = make_asym("page_first", 4, torch.bfloat16)
    for call in (
        lambda: host.get_data_page(0),
        lambda: host.get_dummy_flat_data_page(),
        lambda: host.set_from_flat_data_page(0, torch.zeros(1)),
    ):
        with pytest.raises(NotImplementedError, match=re.escape(FLAT_TEXT)):
            call()
    with pytest.raises(
        NotImplementedError,
        match=re.escape(
            "get_split_heads_page_buffer_meta requires layout='page_head', which is not "
            "supported for models with head_dim != v_head_dim."
        ),
    ):
        host.get_split_heads_page_buffer_meta(torch.arange(4), 1)


def test_is_stride_page_aligned_checks_both_buffers():
    host, _ = make_asym(
        "page_first_direct", 64, torch.bfloat16, heads=2, head_dim=32, v_head_dim=16
    )
    # K page 64*5*2*32*2 = 40960 = 10*4096, V page 20480 = 5*4096
    assert host.is_stride_page_aligned() is True
    odd, _ = make_asym("page_first_direct", 64, torch.bfloat16, heads=2, head_dim=32, v_head_dim=4)
    # V page 64*5*2*4*2 = 5120, not a multiple of 4096
    assert odd.is_stride_page_aligned() is False
