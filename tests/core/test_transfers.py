"""Byte-exact round trips for every pool kind that takes a device pool (MHA, asymmetric MHA, MLA)
x its supported (backend, layout) pairs: a backup of whole pages, then per-layer loads into other
device pages, both pools checked against the contract's layout formulas (reference.py) at page
sizes 1/16/64, bf16 and fp8, int32 and int64 indices; random page sets; and the same round trips
through the emulated CUDA kernels. Pool-specific behaviour stays in pools/test_mha.py, pools/test_mla.py and
pools/test_mha.py; DeepSeek V4 rows are in pools/test_v4_paged.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hostkv_rs import AsymmetricMHATokenToKVPoolHost, MHATokenToKVPoolHost, MLATokenToKVPoolHost
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from reference import (
    ASYM_PAIRS,
    DEVICE_PAGES,
    DTYPES,
    MHA_PAIRS,
    MLA_PAIRS,
    PAGE_SIZES,
    distinct_pages,
    make_asym,
    make_mha,
    make_mla,
    page_tokens,
    round_trip,
)

# kind -> (builder, class it must build, supported (backend, layout) pairs)
KINDS = {
    "mha": (make_mha, MHATokenToKVPoolHost, MHA_PAIRS),
    "asymmetric": (make_asym, AsymmetricMHATokenToKVPoolHost, ASYM_PAIRS),
    "mla": (make_mla, MLATokenToKVPoolHost, MLA_PAIRS),
}
CASES = [
    pytest.param(kind, backend, layout, id=f"{kind}-{backend}-{layout}")
    for kind, (_, _, pairs) in KINDS.items()
    for backend, layout in pairs
]


def make(kind, layout, page_size, dtype, **kwargs):
    builder, cls, _ = KINDS[kind]
    host, dp = builder(layout, page_size, dtype, **kwargs)
    assert type(host) is cls
    return host, dp


@pytest.mark.parametrize("idx_dtype", [torch.int32, torch.int64], ids=["i32", "i64"])
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("page_size", PAGE_SIZES)
@pytest.mark.parametrize(("kind", "backend", "layout"), CASES)
def test_round_trip_pages(kind, backend, layout, page_size, dtype, idx_dtype):
    rng = np.random.default_rng(page_size + len(kind))
    host, dp = make(kind, layout, page_size, dtype)
    host_pages = distinct_pages(rng, 0, host.page_num, 3)
    backup_pages = distinct_pages(rng, 1, DEVICE_PAGES + 1, 3)
    load_pages = np.roll(backup_pages, 1)  # different device pages on the way back
    round_trip(
        host,
        dp,
        backend,
        page_tokens(host_pages, page_size),
        page_tokens(backup_pages, page_size),
        page_tokens(load_pages, page_size),
        idx_dtype,
    )


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
@pytest.mark.parametrize(("kind", "backend", "layout"), CASES)
def test_round_trip_random_page_sets(kind, backend, layout, data):
    page_size = data.draw(st.sampled_from([1, 4, 8, 16]), label="page_size")
    dtype = data.draw(st.sampled_from(list(DTYPES.values())), label="dtype")
    host, dp = make(kind, layout, page_size, dtype, device_pages=6)
    count = data.draw(st.integers(1, 6), label="pages")
    host_pages = data.draw(st.permutations(range(host.page_num)), label="host")[:count]
    backup = data.draw(st.permutations(range(1, 7)), label="backup")[:count]
    load = data.draw(st.permutations(range(1, 7)), label="load")[:count]
    round_trip(
        host,
        dp,
        backend,
        page_tokens(host_pages, page_size),
        page_tokens(backup, page_size),
        page_tokens(load, page_size),
    )


@pytest.mark.parametrize(("kind", "backend", "layout"), CASES)
def test_round_trip_emulated_engine(kind, backend, layout, emulated_engine):
    rng = np.random.default_rng(20 + len(kind))
    host, dp = make(kind, layout, 16, torch.bfloat16)
    pages = distinct_pages(rng, 1, DEVICE_PAGES + 1, 3)
    round_trip(
        host,
        dp,
        backend,
        page_tokens(distinct_pages(rng, 0, host.page_num, 3), 16),
        page_tokens(pages, 16),
        page_tokens(np.roll(pages, 1), 16),
    )
