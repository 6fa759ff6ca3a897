"""Where SGLang's releases differ in what a host pool does, ours does what the installed release
does: SGLang's class and ours are built from the same arguments and every outcome is compared.

* What the device-pool constructor reads (0.5.18-0.5.22): a pool built from an object holding
  only the attributes SGLang's constructor asked for (recorded by a forwarding spy) must build
  ours too, with the same geometry. An allocator-only pool (`is_dummy=True`, 0.5.20-0.5.22)
  never reads device layers; up to 0.5.21 a plain pool reads none either.
* Which device layers a transfer moves: up to 0.5.21 those of the pool the call names (a pool
  built from geometry alone binds nothing until then), from 0.5.22 the ones captured at
  construction, whatever the call names. SGLang's copy kernels do not exist on CPU, so the few
  it calls here are stood in for by recorders (the per-layer loads also copy, so bytes compare).
* Allocator-only pools: 0.5.20-0.5.22 return for a layer this rank does not hold before the
  dummy assertion, 0.5.23's allocation-only pool asserts first.
* DCP L3 flat pages: 0.5.23 addresses the rank-local page; up to 0.5.22 get_data_page raises
  the "not yet DCP-aware" AssertionError, and ours refuses set_from_flat_data_page with it too
  (SGLang's stores the page at the logical slot taken as a physical row; it never checks).
"""

from __future__ import annotations

import types

import pytest
import sgl_harness as H
import torch
from sgl_harness import outcome, same_error

DEVICE_POOL_FORM = not H.at_least(0, 5, 23)
HAS_DUMMY = H.at_least(0, 5, 20) and DEVICE_POOL_FORM
BINDS_ON_TRANSFER = not H.at_least(0, 5, 22)
NAMES = {
    "mla": "MLATokenToKVPoolHost",
    "mha": "MHATokenToKVPoolHost",
    "asym": "AsymmetricMHATokenToKVPoolHost",
}
PLANES = {"mla": ("kv_buffer",), "mha": ("k_buffer", "v_buffer"), "asym": ("k_buffer", "v_buffer")}
# Asymmetric MHA serves only the page layouts.
LAYOUTS = {"mla": "layer_first", "mha": "layer_first", "asym": "page_first"}
# What a device pool carries besides its geometry: its layers and their pointer tables.
LAYER_ATTRS = ("kv_buffer", "k_buffer", "v_buffer", "data_ptrs", "k_data_ptrs", "v_data_ptrs")
GEOMETRY = (
    "size",
    "page_num",
    "page_size",
    "size_per_token",
    "layer_num",
    "target_layer_num",
    "logical_size",
    "logical_page_size",
    "dtype",
    "layout",
    "start_layer",
    "end_layer",
    "kv_lora_rank",
    "qk_rope_head_dim",
    "kv_cache_dim",
    "dsa_kv_cache_store_fp8",
    "head_num",
    "head_dim",
    "element_dim",
    "token_stride_size",
    "layout_dim",
    "device_capacity_tokens",
    "dcp_size",
    "dcp_rank",
    "pool_label",
)
P = 16

pytestmark = pytest.mark.skipif(
    not H.at_least(0, 5, 18), reason="hostkv_rs follows SGLang 0.5.18 and later"
)


def _device(kind, **kw):
    if kind == "asym":
        return H.mha_device(page=P, head_dim=16, v_head_dim=8, **kw)
    return H.mla_device(page=P, **kw) if kind == "mla" else H.mha_device(page=P, **kw)


def _theirs(kind, *args, **kwargs):
    with H.sglang_cpu_alloc():
        return H.ORIG[NAMES[kind]](*args, **kwargs)


def _ours(kind, *args, **kwargs):
    import hostkv_rs

    return getattr(hostkv_rs, NAMES[kind])(*args, **kwargs)


def _args(source, kind="mla"):
    # pin_memory=False: SGLang's pinning needs a CUDA driver; it changes nothing compared here.
    return (source, 2.0, 0, P, LAYOUTS[kind], False, "cpu")


class _Spy:
    """Forwards to a device pool and records every attribute asked of it."""

    def __init__(self, pool):
        object.__setattr__(self, "_pool", pool)
        object.__setattr__(self, "_asked", [])

    def __getattr__(self, name):
        self._asked.append(name)
        return getattr(self._pool, name)


def _what_sglang_reads(kind, dev, **kwargs) -> list[str]:
    spy = _Spy(dev)
    _theirs(kind, *_args(spy, kind), **kwargs)
    return list(dict.fromkeys(spy._asked))


def _only(dev, names) -> types.SimpleNamespace:
    """An object holding exactly `names` of `dev`'s attributes (those it has)."""
    return types.SimpleNamespace(**{n: getattr(dev, n) for n in names if hasattr(dev, n)})


def _geometry_of(kind, dev) -> types.SimpleNamespace:
    """What SGLang's constructor reads of `dev`, less its layers and pointer tables, plus the
    sharding flag its transfers read of the pool they were built from."""
    asked = _what_sglang_reads(kind, dev) + ["layer_shard_enabled"]
    return _only(dev, [n for n in asked if n not in LAYER_ATTRS])


def _geometry_diffs(theirs, ours) -> list[str]:
    diffs = []
    for name in GEOMETRY:
        t, o = outcome(lambda name=name: getattr(theirs, name))
        if t == "raise":
            continue
        got = outcome(lambda name=name: getattr(ours, name))
        if got[0] == "raise" or got[1] != o:
            diffs.append(f"{name}: ours {got[1]!r}, SGLang's {o!r}")
    for name in ("kv_buffer", "data_refs", "data_ptrs"):
        t = getattr(theirs, name, "absent")
        if t is None and getattr(ours, name, "absent") is not None:
            diffs.append(f"{name}: SGLang's is None, ours is not")
    return diffs


def _cmp(what, t, o, diffs) -> None:
    """Both raise the same error, or both return."""
    if t[0] == "raise":
        if o[0] != "raise":
            diffs.append(f"{what}: SGLang raises {type(t[1]).__name__}: {t[1]}; ours returns")
        elif (msg := same_error(o[1], t[1])) is not None:
            diffs.append(f"{what}: {msg}")
    elif o[0] == "raise":
        diffs.append(f"{what}: ours raises {type(o[1]).__name__}: {o[1]}; SGLang returns")


def _assert_none(diffs, what):
    assert not diffs, f"{what} ({H.SGLANG_VERSION}):\n  " + "\n  ".join(diffs)


# --------------------------------------------------------------------------- kernel stand-ins


class _Kernels:
    """SGLang's copy kernels for the calls made here (absent on CPU): the per-layer loads copy
    rows as the kernel would, the all-layer backups record their pointer tables."""

    def __init__(self, monkeypatch):
        self.calls: list[tuple[str, dict]] = []
        for module in (H.ph_mla, H.ph_mha):
            for name in (
                "transfer_kv_per_layer_mla",
                "transfer_kv_per_layer",
                "transfer_kv_all_layer_mla",
                "transfer_kv_all_layer",
            ):
                monkeypatch.setattr(module, name, self._kernel(name), raising=False)

    def _kernel(self, name):
        def run(**kwargs):
            self.calls.append((name, kwargs))
            src_idx, dst_idx = kwargs.get("src_indices"), kwargs.get("dst_indices")
            for dst, src in (("dst", "src"), ("dst_k", "src_k"), ("dst_v", "src_v")):
                if dst in kwargs:
                    kwargs[dst][dst_idx.long()] = kwargs[src][src_idx.long()]

        return run

    def backup_tables(self) -> list[list[int]]:
        tables = []
        for _, kwargs in self.calls:
            for key in ("src_layers", "src_k_layers", "src_v_layers"):
                if key in kwargs:
                    tables.append([int(p) for p in kwargs[key].tolist()])
        return tables


def _device_tables(dev) -> list[list[int]]:
    names = ("data_ptrs",) if hasattr(dev, "kv_buffer") else ("k_data_ptrs", "v_data_ptrs")
    return [[int(p) for p in getattr(dev, n).tolist()] for n in names]


def _layers(dev) -> list[torch.Tensor]:
    return [t for name in ("kv_buffer", "k_buffer", "v_buffer") for t in getattr(dev, name, ())]


def _host_rows(pool, kind, layer, slots) -> list[torch.Tensor]:
    if kind == "mla":
        return [pool.kv_buffer[layer][slots]]
    return [pool.k_buffer[layer][slots], pool.v_buffer[layer][slots]]


def _device_rows(dev, kind, layer, slots) -> list[torch.Tensor]:
    if kind == "mla":
        return [dev.kv_buffer[layer][slots]]
    return [dev.k_buffer[layer][slots], dev.v_buffer[layer][slots]]


def _fill(dev, seed):
    gen = torch.Generator()
    gen.manual_seed(seed)
    H.fill_random(_layers(dev), gen)


def _same_host_bytes(theirs, ours, seed=7):
    gen = torch.Generator()
    gen.manual_seed(seed)
    H.fill_random(H.buffers_of(theirs), gen)
    for o, t in zip(H.buffers_of(ours), H.buffers_of(theirs)):
        o.copy_(t)


def _which(rows, candidates) -> str:
    """Which candidate's rows `rows` are (by bytes)."""
    for name, want in candidates.items():
        if all(torch.equal(H.byte_rows(r), H.byte_rows(w)) for r, w in zip(rows, want)):
            return name
    return "neither"


# --------------------------------------------------------------------------- release detection


def test_pools_follow_the_installed_release(hk, installed):
    """The release ours follow is the installed one, before and after install()."""
    from hostkv_rs import sglang as shim
    from hostkv_rs.sglang import sources as _sources

    assert _sources.sglang_release() == H.REL[:3]
    shim.uninstall()
    assert _sources.sglang_release() == H.REL[:3]
    shim.install()


# --------------------------------------------------------------------------- construction


@pytest.mark.parametrize("kind", ["mha", "mla"])
def test_page_unified_exists_from_0_5_23(kind, hk):
    """page_unified came with 0.5.23: an older release refuses it at construction with its own
    "Unsupported layout" text, and so do ours when that release is installed."""
    if kind == "mla":
        dev = H.mla_device(size=64, page=4, layers=2)
    else:
        dev = H.mha_device(size=64, page=4, heads=2, head_dim=8, layers=2)
    with H.cpu_shims():
        call = H.recorded_kv_host_call(dev, use_mla=kind == "mla", layout="page_first")
        args = list(call.args)
        args[4] = "page_unified"
        unified = H.Call(call.name, call.cls, tuple(args), call.kwargs)
        theirs, ours = outcome(unified.theirs), outcome(unified.ours)
    if H.at_least(0, 5, 23):
        assert (theirs[0], ours[0]) == ("ok", "ok"), (theirs, ours)
    else:
        assert theirs[0] == "raise" and ours[0] == "raise", (theirs, ours)
        assert str(theirs[1]) == "Unsupported layout: page_unified", theirs
        assert same_error(ours[1], theirs[1]) is None, (ours, theirs)


@pytest.mark.skipif(not DEVICE_POOL_FORM, reason="device-pool constructors: SGLang <= 0.5.22")
@pytest.mark.parametrize(
    ("kind", "dummy"),
    [("mla", False), ("mha", False), ("asym", False), pytest.param("mla", True, id="mla-dummy")],
)
def test_built_from_what_sglang_reads(kind, dummy, hk):
    """An object with only the attributes SGLang's constructor asks for builds ours as well,
    with the same geometry; the release decides whether those include the device layers."""
    if dummy and not HAS_DUMMY:
        pytest.skip("is_dummy: SGLang 0.5.20-0.5.22")
    kwargs = {"is_dummy": True} if dummy else {}
    dev = _device(kind)
    asked = _what_sglang_reads(kind, dev, **kwargs)
    reads_layers = any(name in asked for name in PLANES[kind])
    assert reads_layers == (not dummy and not BINDS_ON_TRANSFER), asked
    source = _only(dev, asked)
    theirs = _theirs(kind, *_args(source, kind), **kwargs)
    ours = outcome(lambda: _ours(kind, *_args(source, kind), **kwargs))
    assert ours[0] == "ok", f"SGLang builds from {asked}; ours: {ours[1]!r}"
    _assert_none(_geometry_diffs(theirs, ours[1]), f"{kind} from {sorted(asked)}")


@pytest.mark.skipif(not DEVICE_POOL_FORM, reason="device-pool constructors: SGLang <= 0.5.22")
@pytest.mark.parametrize("kind", ["mla", "mha", "asym"])
def test_geometry_only_device_pool(kind, hk):
    """A device pool without layers: SGLang <= 0.5.21 builds from it, 0.5.22 reads the layers
    at construction and fails (AttributeError; ours a TypeError naming the same attribute)."""
    dev = _device(kind)
    source = _geometry_of(kind, dev)
    t = outcome(lambda: _theirs(kind, *_args(source, kind)))
    o = outcome(lambda: _ours(kind, *_args(source, kind)))
    if t[0] == "ok":
        assert o[0] == "ok", f"SGLang builds from a geometry-only pool, ours: {o[1]!r}"
        _assert_none(_geometry_diffs(t[1], o[1]), kind)
        assert o[1]._device_side is None, "a geometry-only pool captured device layers"
        return
    assert not BINDS_ON_TRANSFER, f"SGLang {H.SGLANG_VERSION} refuses: {t[1]!r}"
    assert isinstance(t[1], AttributeError), t[1]
    assert o[0] == "raise" and isinstance(o[1], (TypeError, AttributeError)), o
    missing = next(n for n in PLANES[kind] if n in str(t[1]))
    assert missing in str(o[1]), (str(o[1]), str(t[1]))


# --------------------------------------------------------------------------- transfers


@pytest.mark.skipif(not BINDS_ON_TRANSFER, reason="geometry-only construction: SGLang <= 0.5.21")
@pytest.mark.parametrize("kind", ["mla", "mha"])
def test_geometry_only_pool_moves_the_named_pools_layers(kind, hk, monkeypatch):
    """Built from geometry alone, each transfer reads the device pool it names: a load writes
    that pool's layer, a backup reads its pointer tables (SGLang) or rows (ours); naming the
    geometry-only pool itself is SGLang's AttributeError; an unheld layer returns silently."""
    dev = _device(kind)
    source = _geometry_of(kind, dev)
    theirs, ours = _theirs(kind, *_args(source, kind)), _ours(kind, *_args(source, kind))
    _same_host_bytes(theirs, ours)
    kernels = _Kernels(monkeypatch)
    t_dev, o_dev = _device(kind), _device(kind)
    host, slots = torch.arange(P, 3 * P), torch.arange(4 * P, 6 * P)
    diffs = []
    for layer in (0, 1, 7):
        _cmp(
            f"load layer {layer}",
            outcome(
                lambda layer=layer: theirs.load_to_device_per_layer(
                    t_dev, host, slots, layer, "kernel"
                )
            ),
            outcome(
                lambda layer=layer: ours.load_to_device_per_layer(
                    o_dev, host, slots, layer, "kernel"
                )
            ),
            diffs,
        )
    for t, o in zip(_layers(t_dev), _layers(o_dev)):
        if not torch.equal(H.byte_rows(t), H.byte_rows(o)):
            diffs.append("the loads left different device bytes")
    assert any(H.byte_rows(t).any() for t in _layers(o_dev)), "nothing was loaded"
    _cmp(
        "load naming the geometry-only pool",
        outcome(lambda: theirs.load_to_device_per_layer(source, host, slots, 0, "kernel")),
        outcome(lambda: ours.load_to_device_per_layer(source, host, slots, 0, "kernel")),
        diffs,
    )
    _fill(t_dev, 3)
    _fill(o_dev, 3)
    kernels.calls.clear()
    t = outcome(lambda: theirs.backup_from_device_all_layer(t_dev, host, slots, "kernel"))
    o = outcome(lambda: ours.backup_from_device_all_layer(o_dev, host, slots, "kernel"))
    _cmp("backup", t, o, diffs)
    if kernels.backup_tables() != _device_tables(t_dev):
        diffs.append("SGLang's backup did not read the pool it was given (check the stand-in)")
    for layer in range(ours.layer_num):
        got = _which(
            _host_rows(ours, kind, layer, host), {"given": _device_rows(o_dev, kind, layer, slots)}
        )
        if got != "given":
            diffs.append(f"ours backed up layer {layer} from {got}")
    _assert_none(diffs, kind)


@pytest.mark.parametrize("kind", ["mla", "mha"])
def test_which_device_pool_a_transfer_moves(kind, hk, monkeypatch):
    """A transfer naming a device pool other than the one the host pool was built from: up to
    0.5.21 it moves the named pool's layers, from 0.5.22 the captured ones."""
    built = {side: _device(kind) for side in ("theirs", "ours")}
    named = {side: _device(kind) for side in ("theirs", "ours")}
    calls = {
        side: H.recorded_kv_host_call(built[side], use_mla=kind == "mla", layout="layer_first")
        for side in ("theirs", "ours")
    }
    theirs, ours = calls["theirs"].pool, calls["ours"].ours()
    _same_host_bytes(theirs, ours)
    kernels = _Kernels(monkeypatch)
    host, slots = torch.arange(P, 3 * P), torch.arange(4 * P, 6 * P)
    diffs = []
    _cmp(
        "load",
        outcome(lambda: theirs.load_to_device_per_layer(named["theirs"], host, slots, 0, "kernel")),
        outcome(lambda: ours.load_to_device_per_layer(named["ours"], host, slots, 0, "kernel")),
        diffs,
    )
    for which in (built, named):
        for t, o in zip(_layers(which["theirs"]), _layers(which["ours"])):
            if not torch.equal(H.byte_rows(t), H.byte_rows(o)):
                diffs.append("the load wrote a different device pool than SGLang's")
    for seed, pools in ((3, built), (4, named)):
        for dev in pools.values():
            _fill(dev, seed)
    kernels.calls.clear()
    _cmp(
        "backup",
        outcome(
            lambda: theirs.backup_from_device_all_layer(named["theirs"], host, slots, "kernel")
        ),
        outcome(lambda: ours.backup_from_device_all_layer(named["ours"], host, slots, "kernel")),
        diffs,
    )
    tables = kernels.backup_tables()
    sglang_read = (
        "named"
        if tables == _device_tables(named["theirs"])
        else "built"
        if tables == _device_tables(built["theirs"])
        else f"neither ({len(tables)} tables)"
    )
    expected = "named" if BINDS_ON_TRANSFER else "built"
    assert sglang_read == expected, f"SGLang {H.SGLANG_VERSION} backed up the {sglang_read} pool"
    for layer in range(ours.layer_num):
        got = _which(
            _host_rows(ours, kind, layer, host),
            {
                "named": _device_rows(named["ours"], kind, layer, slots),
                "built": _device_rows(built["ours"], kind, layer, slots),
            },
        )
        if got != sglang_read:
            diffs.append(
                f"ours backed up layer {layer} from the {got} pool, SGLang the {sglang_read}"
            )
    _assert_none(diffs, kind)


# --------------------------------------------------------------------------- allocator-only pools


def _dummy_transfers(theirs, ours, dev, diffs):
    idx = torch.arange(P)
    for layer in (0, dev.layer_num + 3):
        _cmp(
            f"load layer {layer}",
            outcome(
                lambda layer=layer: theirs.load_to_device_per_layer(
                    dev, idx, idx + P, layer, "kernel"
                )
            ),
            outcome(
                lambda layer=layer: ours.load_to_device_per_layer(
                    dev, idx, idx + P, layer, "kernel"
                )
            ),
            diffs,
        )
    _cmp(
        "backup",
        outcome(lambda: theirs.backup_from_device_all_layer(dev, idx, idx + P, "kernel")),
        outcome(lambda: ours.backup_from_device_all_layer(dev, idx, idx + P, "kernel")),
        diffs,
    )
    _cmp(
        "get_contiguous_buf_infos",
        outcome(theirs.get_contiguous_buf_infos),
        outcome(ours.get_contiguous_buf_infos),
        diffs,
    )
    if theirs.get_contiguous_buf_infos() != ours.get_contiguous_buf_infos():
        diffs.append("get_contiguous_buf_infos differs")
    t_slots, o_slots = (
        theirs.alloc(2 * theirs.logical_page_size),
        ours.alloc(2 * ours.logical_page_size),
    )
    if t_slots.tolist() != o_slots.tolist():
        diffs.append(f"alloc: ours {o_slots.tolist()[:8]}..., SGLang's {t_slots.tolist()[:8]}...")
    if theirs.free(t_slots) != ours.free(o_slots):
        diffs.append("free counts differ")


@pytest.mark.skipif(not HAS_DUMMY, reason="is_dummy: SGLang 0.5.20-0.5.22")
@pytest.mark.parametrize("dcp", [1, 2])
def test_dummy_pool(dcp, hk):
    """`is_dummy=True`: the same geometry, no bytes, and the same outcomes: a load of a layer
    this rank does not hold returns before the dummy assertion."""
    dev = _device("mla")
    kwargs = {"is_dummy": True, "dcp_size": dcp, "dcp_rank": dcp - 1}
    theirs = _theirs("mla", *_args(dev), **kwargs)
    ours = _ours("mla", *_args(dev), **kwargs)
    diffs = _geometry_diffs(theirs, ours)
    _dummy_transfers(theirs, ours, dev, diffs)
    _assert_none(diffs, f"dummy MLA dcp={dcp}")


@pytest.mark.skipif(DEVICE_POOL_FORM, reason="MLAHostAllocation: SGLang 0.5.23+")
def test_allocation_only_pool(hk):
    """0.5.23's allocation-only MLA pool asserts before it looks at the layer."""
    dev = _device("mla")
    allocation = H.ph_mla.MLAHostAllocation(
        dtype=dev.store_dtype,
        kv_lora_rank=dev.kv_lora_rank,
        qk_rope_head_dim=dev.qk_rope_head_dim,
        kv_cache_dim=dev.kv_cache_dim,
        size_per_token=dev.kv_cache_dim * dev.store_dtype.itemsize * dev.layer_num,
    )
    kwargs = {
        "device_capacity_tokens": dev.size,
        "start_layer": dev.start_layer,
        "end_layer": dev.end_layer,
        "target_layer_num": dev.layer_num,
    }
    theirs = _theirs("mla", allocation, 2.0, 0, P, "layer_first", False, "cpu", **kwargs)
    ours = _ours("mla", allocation, 2.0, 0, P, "layer_first", False, "cpu", **kwargs)
    diffs = _geometry_diffs(theirs, ours)
    _dummy_transfers(theirs, ours, dev, diffs)
    _assert_none(diffs, "allocation-only MLA")


# --------------------------------------------------------------------------- DCP flat pages


@pytest.mark.parametrize("layout", sorted({layout for layout, _ in H.MLA_PAIRS}))
def test_dcp_flat_pages(layout, hk):
    """dcp_size=2: get_data_page is 0.5.23's rank-local page, or the "not yet DCP-aware"
    AssertionError up to 0.5.22; set_from_flat_data_page follows get_data_page in ours."""
    dev = _device("mla")
    call = H.recorded_kv_host_call(dev, use_mla=True, layout=layout)
    dcp = H.Call(call.name, call.cls, call.args, dict(call.kwargs, dcp_size=2, dcp_rank=1))
    theirs, ours = dcp.theirs(), dcp.ours()
    start = ours.logical_page_size
    t_page = outcome(lambda: theirs.get_data_page(start))
    o_page = outcome(lambda: ours.get_data_page(start))
    diffs = []
    _cmp(f"get_data_page({start})", t_page, o_page, diffs)
    page = torch.arange(ours.get_dummy_flat_data_page().numel(), dtype=torch.float32)
    page = page.to(ours.dtype) if ours.dtype.is_floating_point else page.to(torch.uint8)
    o_set = outcome(lambda: ours.set_from_flat_data_page(start, page.clone()))
    if H.at_least(0, 5, 23):
        assert t_page[0] == "ok", t_page
        _cmp(
            "set_from_flat_data_page",
            outcome(lambda: theirs.set_from_flat_data_page(start, page.clone())),
            o_set,
            diffs,
        )
        for t, o in zip(H.buffers_of(theirs), H.buffers_of(ours)):
            if not torch.equal(H.byte_rows(t), H.byte_rows(o)):
                diffs.append("set_from_flat_data_page stored different bytes")
    else:
        assert t_page[0] == "raise" and isinstance(t_page[1], AssertionError), t_page
        assert "not yet DCP-aware" in str(t_page[1])
        _cmp("set_from_flat_data_page (get_data_page's refusal)", t_page, o_set, diffs)
    _assert_none(diffs, f"MLA dcp {layout}")


# ---- what SGLang's storage backends ask of a pool by name, and the host budget's rank split


def test_mha_get_hybrid_pool_buffer_exists_from_0_5_21(hk):
    """SGLang's MHA pool has `get_hybrid_pool_buffer` from 0.5.21; its storage backends ask
    for it by name (Mooncake counts the buffers it returns, NIXL picks zero-copy by it), so ours
    has it exactly where SGLang's has it."""
    H.publish(page_size=16)
    call = H.recorded_kv_host_call(H.mha_device(page=16), use_mla=False, layout="layer_first")
    theirs, ours = call.theirs(), call.ours()
    assert hasattr(theirs, "get_hybrid_pool_buffer") == H.at_least(0, 5, 21)
    assert hasattr(ours, "get_hybrid_pool_buffer") == hasattr(theirs, "get_hybrid_pool_buffer")
    if H.at_least(0, 5, 21):
        got = ours.get_hybrid_pool_buffer()
        assert [b.data_ptr() for b in got] == [ours.k_buffer.data_ptr(), ours.v_buffer.data_ptr()]
    # The asymmetric pool keeps its (K, V) list in every release: SGLang's before 0.5.21 has
    # none, and its storage backends then take the tuple kv_buffer for one tensor.
    asym = H.recorded_kv_host_call(
        H.mha_device(page=16, head_dim=16, v_head_dim=8), use_mla=False, layout="page_first"
    ).ours()
    assert [b.data_ptr() for b in asym.get_hybrid_pool_buffer()] == [
        asym.k_buffer.data_ptr(),
        asym.v_buffer.data_ptr(),
    ]


@pytest.mark.parametrize("sglang_says", [1, 3])
def test_the_host_budget_is_split_as_the_release_splits_it(hk, monkeypatch, sglang_says):
    """0.5.18 never splits the host budget over co-located ranks; 0.5.19+ split it by SGLang's
    own `ranks_per_host` (the world group's or launch world's size over its node count), which
    ours asks rather than counting again."""
    from hostkv_rs.sglang import budgets
    from sglang.srt.mem_cache.pool_host import base as ph_base

    if hasattr(ph_base, "ranks_per_host"):
        monkeypatch.setattr(ph_base, "ranks_per_host", lambda: sglang_says)
        assert budgets.ranks_per_host() == sglang_says
    else:
        monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
        monkeypatch.setattr(torch.distributed, "get_world_size", lambda *a, **k: 8)
        assert budgets.ranks_per_host() == 1


def test_sglangs_budget_scope_gets_back_a_pool_refused_after_booking(hk, monkeypatch):
    # SGLang 0.5.21+ auto-sizing books every host pool of a server against its own scope; a
    # pool hostkv_rs refuses after SGLang's check booked it (its own check that the allocations
    # fit the memory there is now) gives the booking back, since no pool was built.
    import hostkv_rs.sglang as shim
    from hostkv_rs.pools import memory as _memory

    base = H.module_or_none("sglang.srt.mem_cache.pool_host.base")
    scope = getattr(base, "host_memory_budget_scope", None)
    if scope is None:
        pytest.skip(f"SGLang {H.SGLANG_VERSION}: no host memory budget scope")
    shim.install()
    try:
        dp = hk.MLATokenToKVPool(64, 16, torch.bfloat16, 12, 4, 2)
        with scope(10**9):
            monkeypatch.setattr(
                _memory, "available_host_memory", lambda: _memory.HostMemory(0, "nothing left")
            )
            with pytest.raises(ValueError, match="Not enough host memory for"):
                hk.MLATokenToKVPoolHost(dp, 0, 0.001, 16, "page_first")
            assert base._host_memory_budget.get() == 10**9
    finally:
        shim.uninstall()
