"""The CUDA kernels (rust/kernels/hostkv_transfer.cu) run on the CPU under the emulation shim,
through `_core.HostPool.backup/load(..., device="cpu", engine="emulated")`, against the CPU
engine (`engine="plan"`) and against the byte formulas of tests/reference.py: every layout and
direction, byte-exact, for odd item sizes, P=1, prime layer counts, block quotas 1/2/7, N=0/1,
int32/int64 indices, and bad device-resident indices (error, nothing written)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hostkv_rs import _core
from reference import host_segments

LAYOUTS = ("layer_first", "page_first", "page_first_direct", "page_head")

pytestmark = pytest.mark.usefixtures("emulation_built")


class Case:
    """Host planes and device layers as plain uint8 tensors (device pointers are host pointers
    under emulation), with distinct random indices."""

    def __init__(
        self,
        layout,
        items,
        *,
        layers=5,
        rows=48,
        page=4,
        heads=1,
        dev_rows=40,
        n=13,
        backup=True,
        host_layer=0,
        seed=0,
        idx_dtype=torch.int64,
    ):
        self.layout, self.items, self.layers, self.rows = layout, list(items), layers, rows
        self.page, self.heads, self.dev_rows, self.n = page, heads, dev_rows, n
        self.backup, self.host_layer = backup, host_layer
        g = torch.Generator().manual_seed(seed)
        self.host = [
            torch.randint(0, 256, (layers * rows * i,), dtype=torch.uint8, generator=g)
            for i in self.items
        ]
        dev_layers = layers if backup else 1
        self.dev = [
            [
                torch.randint(0, 256, (dev_rows, i), dtype=torch.uint8, generator=g)
                for _ in range(dev_layers)
            ]
            for i in self.items
        ]
        rng = np.random.default_rng(seed)
        self.host_idx = torch.from_numpy(rng.permutation(rows)[:n].copy()).to(idx_dtype)
        self.dev_idx = torch.from_numpy(rng.permutation(dev_rows)[:n].copy()).to(idx_dtype)

    def clone(self):
        other = object.__new__(Case)
        other.__dict__.update(self.__dict__)
        other.host = [h.clone() for h in self.host]
        other.dev = [[d.clone() for d in plane] for plane in self.dev]
        return other

    def core(self):
        return _core.HostPool.from_geometry(
            self.layout,
            self.layers,
            self.rows,
            self.page,
            self.items,
            list(self.host),
            self.heads,
        )

    def run(self, engine, host_idx=None, dev_idx=None, on_device=False, backend="kernel"):
        host_idx = self.host_idx if host_idx is None else host_idx
        dev_idx = self.dev_idx if dev_idx is None else dev_idx
        hi = (host_idx.data_ptr(), host_idx.numel(), host_idx.element_size(), on_device)
        di = (dev_idx.data_ptr(), dev_idx.numel(), dev_idx.element_size(), on_device)
        ptrs = [d.data_ptr() for plane in self.dev for d in plane]
        core = self.core()
        if self.backup:
            core.backup(backend, ptrs, self.dev_rows, hi, di, "cpu", 0, engine)
        else:
            core.load(backend, self.host_layer, ptrs, self.dev_rows, hi, di, "cpu", 0, engine)

    def same_as(self, other) -> bool:
        return all(torch.equal(a, b) for a, b in zip(self.host, other.host)) and all(
            torch.equal(a, b) for pa, pb in zip(self.dev, other.dev) for a, b in zip(pa, pb)
        )


def expected(case: Case) -> Case:
    """Independent oracle: apply the contract's byte formulas (tests/reference.py)."""
    out = case.clone()
    tokens = case.host_idx.to(torch.int64).numpy()
    rows = case.dev_idx.to(torch.int64).numpy()
    layers = range(case.layers) if case.backup else [case.host_layer]
    for p, item in enumerate(case.items):
        host = out.host[p]
        for k, layer in enumerate(layers):
            dev = out.dev[p][k].reshape(-1)
            offs, seg, dev_offs = host_segments(
                case.layout, tokens, layer, case.layers, case.rows, case.page, item, case.heads
            )
            for i, d in enumerate(rows):
                for h in range(offs.shape[1]):
                    hs = int(offs[i, h])
                    ds = int(d) * item + int(dev_offs[h])
                    if case.backup:
                        host[hs : hs + seg] = dev[ds : ds + seg]
                    else:
                        dev[ds : ds + seg] = host[hs : hs + seg]
    return out


def check(case: Case, quota: int, monkeypatch):
    monkeypatch.setenv("HOSTKV_BLOCK_QUOTA", str(quota))
    want = expected(case)
    plan = case.clone()
    plan.run("plan")
    got = case.clone()
    got.run("emulated")
    assert plan.same_as(want), "CPU engine disagrees with the oracle"
    assert got.same_as(want), f"emulated kernel differs (quota {quota})"
    if case.n:
        assert not want.same_as(case), "the transfer moved nothing, so the test could not fail"


# 3, 12 and 66 bytes take the kernel's 1-, 4- and 2-byte paths (not a multiple of 8).
ITEMS = [(12,), (656,), (3,), (66,), (16, 24)]


@pytest.mark.parametrize("layout", ["layer_first", "page_first", "page_first_direct"])
@pytest.mark.parametrize("items", ITEMS, ids=lambda i: "x".join(map(str, i)))
@pytest.mark.parametrize("backup", [True, False], ids=["backup", "load"])
@pytest.mark.parametrize("quota", [1, 2, 7])
def test_layouts_match_plan_and_oracle(layout, items, backup, quota, monkeypatch):
    case = Case(layout, items, backup=backup, host_layer=4, seed=len(items) * 31 + quota)
    check(case, quota, monkeypatch)


# Heads of 4, 82, 1, 22 and 2 bytes: the 4-, 2- and 1-byte copy paths as well as the wide ones.
@pytest.mark.parametrize(
    "items,heads", [((12,), 3), ((656,), 8), ((3,), 3), ((66,), 3), ((6,), 3), ((64, 32), 4)]
)
@pytest.mark.parametrize("backup", [True, False], ids=["backup", "load"])
@pytest.mark.parametrize("quota", [1, 2, 7])
def test_page_head_matches_plan_and_oracle(items, heads, backup, quota, monkeypatch):
    case = Case("page_head", items, heads=heads, backup=backup, host_layer=2, seed=heads + quota)
    check(case, quota, monkeypatch)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("n", [0, 1])
@pytest.mark.parametrize("idx_dtype", [torch.int32, torch.int64], ids=["i32", "i64"])
@pytest.mark.parametrize("backup", [True, False], ids=["backup", "load"])
def test_tiny_transfers_and_index_widths(layout, n, idx_dtype, backup, monkeypatch):
    heads = 2 if layout == "page_head" else 1
    case = Case(layout, (24, 8), heads=heads, n=n, idx_dtype=idx_dtype, backup=backup, host_layer=1)
    check(case, 2, monkeypatch)


@pytest.mark.parametrize("layout", ["layer_first", "page_first", "page_first_direct"])
def test_page_size_one_prime_layers(layout, monkeypatch):
    # DeepSeek V4 page rows: one plane, P=1, odd row size, 7 layers.
    for backup in (True, False):
        case = Case(
            layout,
            (1000,),
            layers=7,
            rows=17,
            page=1,
            dev_rows=23,
            n=9,
            backup=backup,
            host_layer=6,
            seed=7,
        )
        check(case, 7, monkeypatch)


def test_sixty_one_layers(monkeypatch):
    case = Case("page_first", (128, 64), layers=61, rows=32, dev_rows=32, n=32, seed=61)
    check(case, 2, monkeypatch)


@pytest.mark.parametrize("side,bad", [("device", 40), ("device", -1), ("host", 48), ("host", -3)])
@pytest.mark.parametrize("idx_dtype", [torch.int32, torch.int64], ids=["i32", "i64"])
def test_bad_device_resident_index_sets_error_and_writes_nothing(side, bad, idx_dtype):
    # on_device=True: under emulation the arrays stand for GPU memory, which only the kernel
    # reads, so the kernel's own bounds check is what catches the bad value.
    case = Case("page_first", (32,), backup=(side == "host"), idx_dtype=idx_dtype, seed=3)
    host_idx = case.host_idx.clone()
    dev_idx = case.dev_idx.clone()
    (host_idx if side == "host" else dev_idx)[case.n // 2] = bad
    before = case.clone()
    with pytest.raises(_core.TransferError, match=rf"^{side} index {bad} "):
        case.run("emulated", host_idx, dev_idx, on_device=True)
    assert case.same_as(before), "a refused transfer wrote bytes"
    _core.check_device_errors()  # the emulated error was reported at once, nothing pending


def test_device_resident_valid_indices_copy_like_the_plan():
    case = Case("page_head", (48,), heads=2, seed=11)
    want = case.clone()
    want.run("plan")
    got = case.clone()
    got.run("emulated", on_device=True)
    assert got.same_as(want)


def test_host_resident_bad_index_is_refused_before_the_kernel():
    case = Case("layer_first", (8,), seed=5)
    host_idx = case.host_idx.clone()
    host_idx[0] = case.rows
    before = case.clone()
    with pytest.raises(_core.TransferError, match="out of range"):
        case.run("emulated", host_idx=host_idx)
    assert case.same_as(before)


@pytest.mark.parametrize("value", ["0", "-2", "many", "70000"])
def test_block_quota_env_is_validated(value, monkeypatch):
    monkeypatch.setenv("HOSTKV_BLOCK_QUOTA", value)
    case = Case("page_first", (16,), seed=1)
    with pytest.raises(ValueError, match="HOSTKV_BLOCK_QUOTA"):
        case.run("emulated")


def test_no_cuda_here_is_reported_not_crashed():
    info = _core.runtime_info()
    assert "CUDA available" in info or "CUDA unavailable" in info
    if not _core.cuda_available():
        _core.check_device_errors()
