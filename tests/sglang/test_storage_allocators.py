"""`--hicache-storage-backend shm | mooncake | mori | tensorcast`: the release's own
`get_allocator_from_storage` picks the host allocator, and a hostkv_rs pool's planes are what
that allocator's `allocate(dims, dtype, "cpu")` returns, adopted by the core (which still checks
and performs every transfer).

* shm: `pool.fd` is the allocator's memfd; another process maps it, reads the bytes a backup
  wrote and writes bytes a load then brings to the device.
* mooncake: the planes are `MooncakeHostMemAllocator` memory (the allocator SGLang's
  standalone Mooncake store requires); skips when Mooncake does not import.
* mori / tensorcast: where the package is missing SGLang warns and falls back (its own
  messages); allocation through their allocators skips with the reason.
"""

from __future__ import annotations

import importlib.util
import inspect
import logging
import mmap
import subprocess
import sys

import pytest
import sgl_harness as H
import torch

PAGE = 16

# Run by the second process: map each (fd, bytes) it inherited, write what it reads to `out`,
# then invert every byte of the mapping in place.
_CHILD = """
import mmap, sys
out, spans = sys.argv[1], [tuple(map(int, s.split(":"))) for s in sys.argv[2:]]
invert = bytes(255 - i for i in range(256))
with open(out, "wb") as f:
    for fd, n in spans:
        mm = mmap.mmap(fd, n)
        data = mm[:n]
        f.write(data)
        mm[:n] = data.translate(invert)
        mm.close()
"""


def _module_missing(name: str) -> str | None:
    try:
        found = importlib.util.find_spec(name) is not None
    except (ImportError, ValueError) as exc:  # a parent package that does not import
        return f"{name} does not import here: {exc}"
    return None if found else f"{name} is not installed in this interpreter"


def _mooncake_missing() -> str | None:
    missing = _module_missing("mooncake")
    if missing is not None:
        return f"{missing} (pip install mooncake-transfer-engine-non-cuda)"
    try:
        from mooncake.store import MooncakeHostMemAllocator  # noqa: F401
    except ImportError as exc:  # its native libraries need libibverbs1 and libnuma1
        return f"Mooncake's MooncakeHostMemAllocator does not import here: {exc}"
    return None


def _device(kind):
    if kind == "mla":
        return H.mla_device(page=PAGE)
    if kind == "asym":
        return H.mha_device(page=PAGE, head_dim=16, v_head_dim=8)
    return H.mha_device(page=PAGE)


def _planes(pool) -> list[torch.Tensor]:
    buffer = pool.kv_buffer
    return list(buffer) if isinstance(buffer, tuple) else [buffer]


def _built(kind, layout, backend, publish, io_backend="kernel"):
    dev = _device(kind)
    publish(
        page_size=PAGE,
        hicache_mem_layout=layout,
        hicache_io_backend=io_backend,
        hicache_storage_backend=backend,
    )
    pool = H.build_kv_host_pool(kv_pool=dev, page_size=PAGE, use_mla=kind == "mla")
    assert H.is_ours(pool), type(pool)
    return dev, pool


def _backup(pool, dev, gen, io_backend="kernel"):
    """Random device bytes, 3 pages of them backed up through SGLang's L2TransferEngine.
    Returns (host slots, device slots, device rows before)."""
    tensors = H.device_planes(dev)
    H.fill_random(tensors, gen)
    saved = H.snapshot(tensors)
    host = pool.alloc(3 * PAGE)
    d_src = H.page_slots([2, 5, 7], PAGE)
    engine = H.l2.L2TransferEngine(io_backend)
    engine.submit_device_to_host([H.l2.L2Transfer(pool, dev, host, d_src)])
    return host, d_src, saved, engine


def _adopted(pool):
    """Every plane is the storage allocator's memory itself (no copy), adopted by the core."""
    owners = pool._host_regions
    assert all(o.hugepage_tier == "adopted" for o in owners), owners
    assert [o.address for o in owners] == [t.data_ptr() for t in _planes(pool)]


# --------------------------------------------------------------------------- shm


SHM_CASES = [
    ("mha", "layer_first"),
    ("mha", "page_first"),
    ("mha", "page_head"),
    ("asym", "page_first"),
    ("mla", "layer_first"),
    ("mla", "page_first"),
]


@pytest.mark.parametrize("kind,layout", SHM_CASES, ids=[f"{k}-{lay}" for k, lay in SHM_CASES])
def test_shm_fd_maps_the_pool_in_another_process(kind, layout, installed, publish, gen, tmp_path):
    dev, pool = _built(kind, layout, "shm", publish)
    allocator = pool.allocator
    assert type(allocator) is H.ph_common.ShmHostTensorAllocator
    planes = _planes(pool)
    # One memfd per plane allocation (SGLang's asymmetric pool allocates K and V apart); pool.fd
    # is the first, as SGLang's pools read it.
    assert len(allocator.fds) == len(planes)
    assert pool.fd is not None and pool.fd == allocator.fds[0] == allocator.fd
    _adopted(pool)

    host, d_src, saved, engine = _backup(pool, dev, gen)
    before = [H.byte_rows(t.reshape(-1, 1)).clone() for t in planes]
    assert any(b.any() for b in before), "the backup wrote nothing"

    out = tmp_path / "seen.bin"
    spans = [f"{fd}:{t.nbytes}" for fd, t in zip(allocator.fds, planes, strict=True)]
    subprocess.run(
        [sys.executable, "-c", _CHILD, str(out), *spans],
        pass_fds=tuple(allocator.fds),
        check=True,
        timeout=120,
    )
    seen = torch.frombuffer(bytearray(out.read_bytes()), dtype=torch.uint8)
    assert torch.equal(seen, torch.cat([b.reshape(-1) for b in before])), (
        "the other process read other bytes than the backup wrote"
    )
    # It inverted every byte in place: this process sees it, and a load moves it to the device.
    for plane, b in zip(planes, before, strict=True):
        assert torch.equal(H.byte_rows(plane.reshape(-1, 1)), 255 - b)
    tensors = H.device_planes(dev)
    d_dst = H.page_slots([3, 9, 11], PAGE)
    H.submit_h2d(engine, [H.l2.L2Transfer(pool, dev, host, d_dst)], dev.layer_num)
    for i, (t, rows) in enumerate(zip(tensors, saved, strict=True)):
        assert torch.equal(H.byte_rows(t)[d_dst], 255 - rows[d_src]), f"device tensor {i}"


@pytest.mark.parametrize("layout", ["layer_first", "page_first", "page_first_direct"])
def test_shm_v4_paged_pool(layout, installed, publish):
    """The DeepSeek V4 paged pool takes SGLang's shm allocator as well: one allocation in the
    core's layout (SGLang makes one per layer for layer_first), whose memfd maps every row."""
    from sglang.srt.mem_cache.memory_pool_host import DeepSeekV4PagedHostPool

    publish(page_size=PAGE, hicache_storage_backend="shm")
    L, pages, item = 3, 6, 40
    dev = [torch.randint(0, 256, (7, item), dtype=torch.uint8) for _ in range(L)]
    pool = DeepSeekV4PagedHostPool(
        "c4_kv", dev, item, pages, 1, layout=layout, allocator_type="shm"
    )
    assert H.is_ours(pool), type(pool)
    assert type(pool.allocator) is H.ph_common.ShmHostTensorAllocator
    assert pool.fd == pool.allocator.fd and len(pool.allocator.fds) == 1
    assert pool._region.hugepage_tier == "adopted"
    backend = "direct" if layout == "page_first_direct" else "kernel"
    pool.backup_from_device_all_layer(None, torch.tensor([4]), torch.tensor([2]), backend)
    mm = mmap.mmap(pool.fd, L * pages * item)
    try:
        seen = torch.frombuffer(bytearray(mm[:]), dtype=torch.uint8)
    finally:
        mm.close()
    rows = seen.view(L, pages, item) if layout == "layer_first" else seen.view(pages, L, item)
    for layer in range(L):
        row = rows[layer, 4] if layout == "layer_first" else rows[4, layer]
        assert torch.equal(row, dev[layer][2]), f"layer {layer}"


# --------------------------------------------------------------------------- mooncake


@pytest.mark.skipif(_mooncake_missing() is not None, reason=str(_mooncake_missing()))
@pytest.mark.parametrize("kind,layout", [("mha", "page_first"), ("mla", "page_first_direct")])
def test_mooncake_allocator_owns_the_planes(kind, layout, installed, publish, gen):
    from sglang.srt.mem_cache.storage.mooncake_store.mooncake_store import (
        MooncakeHostTensorAllocator,
    )

    io_backend = "direct" if layout.endswith("direct") else "kernel"
    dev, pool = _built(kind, layout, "mooncake", publish, io_backend)
    # SGLang's standalone Mooncake store accepts only this allocator's pools.
    assert isinstance(pool.allocator, MooncakeHostTensorAllocator)
    assert pool.fd is None
    _adopted(pool)
    assert pool.kv_buffer.data_ptr() == pool.allocator.ptr
    host, d_src, saved, engine = _backup(pool, dev, gen, io_backend)
    tensors = H.device_planes(dev)
    H.fill_random(tensors, gen)
    d_dst = H.page_slots([3, 9, 11], PAGE)
    H.submit_h2d(engine, [H.l2.L2Transfer(pool, dev, host, d_dst)], dev.layer_num)
    for i, (t, rows) in enumerate(zip(tensors, saved, strict=True)):
        assert torch.equal(H.byte_rows(t)[d_dst], rows[d_src]), f"device tensor {i}"


# --------------------------------------------------------------------------- mori, tensorcast


def _umbp_missing() -> str | None:
    missing = _module_missing("mori")
    if missing is not None:
        return f"mori is not installed here ({missing}); UMBPHostTensorAllocator needs mori.umbp"
    try:
        import mori.umbp  # noqa: F401
    except ImportError as exc:
        return f"mori.umbp does not import (mori built without BUILD_UMBP=ON?): {exc}"
    return None


@pytest.mark.skipif(_umbp_missing() is not None, reason=str(_umbp_missing()))
def test_mori_allocator_owns_the_planes(installed, publish):
    from sglang.srt.mem_cache.storage.umbp.umbp_host_allocator import UMBPHostTensorAllocator

    _, pool = _built("mha", "page_first", "mori", publish)
    assert isinstance(pool.allocator, UMBPHostTensorAllocator)
    _adopted(pool)


@pytest.mark.skipif(_umbp_missing() is None, reason="mori.umbp is installed here")
def test_mori_missing_falls_back_as_sglang_does(installed, publish, hk, caplog):
    """SGLang warns (its own text) and uses its default allocator; ours is the default here."""
    caplog.set_level(logging.WARNING)
    _, pool = _built("mha", "page_first", "mori", publish)
    assert "UMBPHostTensorAllocator unavailable" in caplog.text
    assert type(pool.allocator) is hk.HostTensorAllocator and pool.fd is None
    assert pool._host_regions[0].hugepage_tier != "adopted"


# The release maps `tensorcast` to TensorCast's allocator (0.5.21+), else to the default one.
_KNOWS_TENSORCAST = "tensorcast" in inspect.getsource(H.ph_common.get_allocator_from_storage)


def _tensorcast_missing() -> str | None:
    missing = _module_missing("tensorcast")
    if missing is not None:
        # Not installed by the test command: PyPI has no tensorcast distribution this machine
        # can install (`pip download tensorcast`: "No matching distribution", 2026-12-06).
        return (
            f"TensorCast is not installed here ({missing}); PyPI offers no tensorcast build for "
            "this platform, and SGLang needs a TensorCast daemon on a CUDA backend besides"
        )
    return None


@pytest.mark.skipif(
    not _KNOWS_TENSORCAST, reason="get_allocator_from_storage knows tensorcast from 0.5.21"
)
def test_tensorcast_without_config_raises_sglangs_error(installed, publish):
    publish(page_size=PAGE, hicache_storage_backend="tensorcast")
    kind, expected = H.outcome(lambda: H.ph_common.get_allocator_from_storage("tensorcast"))
    assert kind == "raise" and isinstance(expected, ValueError), expected
    with pytest.raises(ValueError) as ours:
        H.build_kv_host_pool(kv_pool=_device("mha"), page_size=PAGE, use_mla=False)
    assert str(ours.value) == str(expected)


@pytest.mark.skipif(_KNOWS_TENSORCAST, reason="0.5.21+ map tensorcast to its allocator")
def test_tensorcast_is_the_default_allocator_before_0_5_21(installed, publish, hk):
    _, pool = _built("mha", "page_first", "tensorcast", publish)
    assert type(pool.allocator) is hk.HostTensorAllocator


@pytest.mark.skip(
    reason=_tensorcast_missing()
    or "TensorCast allocates from a running TensorCast daemon's Session on a CUDA backend "
    "(SGLang refuses it elsewhere); these tests start no daemon"
)
def test_tensorcast_allocator_owns_the_planes():
    """Placeholder for a TensorCast Session's allocator: the same adoption as shm and Mooncake
    (`TensorcastHostTensorAllocator.allocate` returns the Session's CPU tensor)."""


# --------------------------------------------------------------------------- checks


def test_default_backend_keeps_rust_memory(installed, publish, hk):
    _, pool = _built("mha", "page_first", None, publish)
    assert type(pool.allocator) is hk.HostTensorAllocator and pool.fd is None
    assert pool._host_regions[0].hugepage_tier != "adopted"


class _WrongDtype:
    def allocate(self, dims, dtype, device):
        return torch.zeros(dims, dtype=torch.float32 if dtype != torch.float32 else torch.int32)


def test_a_storage_allocation_of_the_wrong_kind_is_refused(installed, publish, monkeypatch):
    from hostkv_rs.pools import base

    monkeypatch.setattr(base, "get_allocator_from_storage", lambda *a, **k: _WrongDtype())
    publish(page_size=PAGE, hicache_mem_layout="page_first")
    with pytest.raises(ValueError, match=r"_WrongDtype\.allocate\(.*returned a cpu torch\.float32"):
        H.build_kv_host_pool(kv_pool=_device("mha"), page_size=PAGE, use_mla=False)
