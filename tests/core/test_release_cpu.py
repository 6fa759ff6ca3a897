"""Which SGLang release the pools follow where releases differ, and the MHA side of it (the MLA
side is in pools/test_mla.py; tests/sglang/test_release_semantics.py compares each release's
own classes with ours)."""

from __future__ import annotations

import re
import types

import numpy as np
import pytest
import torch
from hostkv_rs import MHATokenToKVPool, MHATokenToKVPoolHost
from hostkv_rs.sglang import sources as _sources
from reference import fill_random, host_planes


@pytest.fixture
def release(monkeypatch):
    """release((0, 5, 21)): the pools follow that SGLang release, as if it were installed."""

    def follow(version):
        monkeypatch.setattr(_sources, "sglang_release", lambda: version)

    return follow


def _same_bytes(a, b) -> bool:
    # Random bytes hold NaNs, which torch.equal never finds equal.
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def _device():
    return MHATokenToKVPool(64, 4, torch.bfloat16, head_num=2, head_dim=8, layer_num=2)


def _geometry_of(dp):
    """An MHA device pool without its layers and pointer tables."""
    gone = {"k_buffer", "v_buffer", "k_data_ptrs", "v_data_ptrs"}
    names = ("size", "page_size", "store_dtype", "head_num", "head_dim", "layer_num")
    return types.SimpleNamespace(
        **{n: getattr(dp, n) for n in names if n not in gone},
        start_layer=0,
        end_layer=dp.layer_num,
        device="cpu",
    )


@pytest.mark.parametrize(
    ("version", "parsed"),
    [("0.5.23", (0, 5, 23)), ("0.5.21.post1", (0, 5, 21)), ("unknown", None), ("1.0", None)],
)
def test_release_versions(version, parsed, monkeypatch):
    from hostkv_rs import sglang as shim

    assert _sources._release_tuple(version) == parsed
    # What install() found wins; a version it could not read falls back to the distribution's.
    monkeypatch.setattr(shim, "release", lambda: shim.Release(version, "device_pool"))
    monkeypatch.setattr(_sources, "_distribution_release", lambda: (0, 5, 19))
    assert _sources.sglang_release() == (parsed or (0, 5, 19))


def test_without_sglang_a_geometry_only_mha_pool_is_refused():
    assert _sources.sglang_release() is None
    with pytest.raises(TypeError, match="k_buffer"):
        MHATokenToKVPoolHost(_geometry_of(_device()), 2.0, 0, 4, "layer_first")


def test_geometry_only_mha_pool_moves_the_layers_each_transfer_names(release):
    release((0, 5, 21))
    full = _device()
    host = MHATokenToKVPoolHost(_geometry_of(full), 2.0, 0, 4, "layer_first")
    assert host._device_side is None
    assert (host.device_k_buffers, host.device_v_buffers) == ((), ())
    fill_random(
        [t.view(torch.uint8) for t in (*full.k_buffer, *full.v_buffer)], np.random.default_rng(2)
    )
    h, d = host.alloc(8), torch.arange(4, 12)
    host.backup_from_device_all_layer(full, h, d, "direct")
    for layer in range(2):
        assert _same_bytes(host.k_buffer[layer][h], full.k_buffer[layer][d])
        assert _same_bytes(host.v_buffer[layer][h], full.v_buffer[layer][d])
    other = _device()
    host.load_to_device_per_layer(other, h, d, 1, "kernel")
    assert _same_bytes(other.v_buffer[1][d], full.v_buffer[1][d])
    assert not other.k_buffer[0].any()
    with pytest.raises(AttributeError, match="k_buffer"):
        host.load_to_device_per_layer(None, h, d, 0, "kernel")
    with pytest.raises(ValueError, match=re.escape("Unsupported IO backend: gds")):
        host.backup_from_device_all_layer(other, h, d, "gds")


@pytest.mark.parametrize(("version", "moved"), [((0, 5, 21), "named"), ((0, 5, 22), "built")])
def test_mha_transfer_naming_another_device_pool(version, moved, release):
    release(version)
    built, named = _device(), _device()
    host = MHATokenToKVPoolHost(built, 2.0, 0, 4, "page_first")
    fill_random(host_planes(host), np.random.default_rng(4))
    fill_random(
        [t.view(torch.uint8) for t in (*named.k_buffer, *named.v_buffer)], np.random.default_rng(5)
    )
    h, d = host.alloc(8), torch.arange(4, 12)
    host.backup_from_device_all_layer(named, h, d, "kernel")
    source = named if moved == "named" else built
    assert _same_bytes(host.k_buffer[:, 1][h], source.k_buffer[1][d])
