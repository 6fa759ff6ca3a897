"""Shared builders for the host-pool tests: small geometries (prime layer count, 8-byte multiple
item sizes) so the whole suite stays fast on two busy cores."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hostkv_rs import (
    MHATokenToKVPool,
    MLATokenToKVPool,
    MLATokenToKVPoolHost,
    get_mha_host_pool_cls,
)

LAYERS = 5  # prime, so no layer/page/head confusion can cancel out
DTYPES = {"bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn}
PAGE_SIZES = (1, 16, 64)
DEVICE_PAGES = 4  # usable device pages 1..4; page 0 is SGLang's padding page

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


def make_mha(
    layout,
    page_size=16,
    dtype=torch.bfloat16,
    *,
    layers=LAYERS,
    heads=2,
    head_dim=8,
    v_head_dim=None,
    device_pages=DEVICE_PAGES,
    ratio=2.0,
    **kwargs,
):
    """(host pool, device pool); the host class comes from get_mha_host_pool_cls, as in SGLang."""
    dp = MHATokenToKVPool(
        device_pages * page_size,
        page_size,
        dtype,
        heads,
        head_dim,
        layers,
        v_head_dim=v_head_dim,
    )
    cls = get_mha_host_pool_cls(dp)
    return cls(dp, ratio, 0, page_size, layout, **kwargs), dp


def make_asym(layout, page_size=16, dtype=torch.bfloat16, **kwargs):
    kwargs.setdefault("head_dim", 8)
    kwargs.setdefault("v_head_dim", 4)
    return make_mha(layout, page_size, dtype, **kwargs)


def make_mla(
    layout,
    page_size=16,
    dtype=torch.bfloat16,
    *,
    layers=LAYERS,
    kv_lora_rank=12,
    rope=4,
    device_pages=DEVICE_PAGES,
    ratio=2.0,
    **kwargs,
):
    dp = MLATokenToKVPool(device_pages * page_size, page_size, dtype, kv_lora_rank, rope, layers)
    return MLATokenToKVPoolHost(dp, ratio, 0, page_size, layout, **kwargs), dp


def distinct_pages(rng: np.random.Generator, low: int, high: int, count: int) -> np.ndarray:
    """`count` distinct page numbers in [low, high), in random order."""
    return rng.permutation(np.arange(low, high))[:count]


@pytest.fixture
def rng():
    return np.random.default_rng(1234)


_EMULATION_PROBE: dict[str, str | None] = {}


def _emulation_unavailable() -> str | None:
    """Why the core cannot run kernel emulation (None when it can); probed once per session."""
    if "reason" not in _EMULATION_PROBE:
        from hostkv_rs import _core

        region = _core.HostRegion(64)
        core = _core.PoolCore("layer_first", 1, 8, 1, [8], [region.address], 1)
        idx = torch.zeros(1, dtype=torch.int64)
        dev = torch.zeros(8, 8, dtype=torch.uint8)
        arg = (idx.data_ptr(), 1, 8, False)
        try:
            core.backup("kernel", [dev.data_ptr()], 8, arg, arg, "cpu", 0, "emulated")
            _EMULATION_PROBE["reason"] = None
        except ValueError as exc:
            if "emulat" not in str(exc):
                raise
            _EMULATION_PROBE["reason"] = f"the Rust core reports: {exc}"
    return _EMULATION_PROBE["reason"]


@pytest.fixture
def emulated_engine(monkeypatch):
    """Run the pools' CPU transfers through the kernel emulation (HOSTKV_CPU_ENGINE=emulated)."""
    reason = _emulation_unavailable()
    if reason is not None:
        pytest.skip(f"kernel emulation is not built: {reason}")
    monkeypatch.setenv("HOSTKV_CPU_ENGINE", "emulated")
