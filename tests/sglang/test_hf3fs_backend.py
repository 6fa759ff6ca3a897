"""SGLang's own 3FS storage backend (`HiCacheHF3FS` with `use_mock_client=True`, the plain-file
client SGLang's CI uses) over a hostkv_rs pool and over SGLang's pool built from the same
arguments.

The backend reads a host pool through the flat-page interface: `get_dummy_flat_data_page` and
`set_from_flat_data_page` around a file read for layer_first and page_head, and zero-copy views
from `get_data_page(index, flat=False)` for page_first and page_first_direct (an MHA page's K and
V halves as two file pages). Each case saves pages of one pool, loads them into other pages of a
pool of the same bytes, and checks: the same file bytes and results as SGLang's pool, the same
pool bytes afterwards (the pages restored, everything else untouched), and a file written through
one side's pool read back into the other's.

The file-page index (SGLang's metadata service) is a small in-memory one written here, so the
test needs neither the service nor its HTTP dependencies.
"""

from __future__ import annotations

import signal

import pytest
import sgl_harness as H
import torch

hf3fs = pytest.importorskip("sglang.srt.mem_cache.storage.hf3fs.storage_hf3fs")

PAGE = 16
CASES = [
    ("mha", "layer_first", "kernel"),
    ("mha", "page_first", "kernel"),
    ("mha", "page_first_direct", "direct"),
    ("mha", "page_head", "kernel"),
    ("mla", "layer_first", "kernel"),
    ("mla", "page_first", "kernel"),
    ("mla", "page_first_direct", "direct"),
]
SAVED_PAGES, LOADED_PAGES, PARTLY_LOADED_PAGES = [3, 7, 1], [10, 12, 5], [13, 14, 15]
KEYS = ["a", "b", "c"]
FILE_PAGES = 32


class _PageIndex(hf3fs.Hf3fsMetadataInterface):
    """Which file page holds which key: every backend over one file shares one index."""

    def __init__(self):
        self.pages: dict[str, int] = {}
        self.free: list[int] | None = None

    def initialize(self, rank, num_pages, namespace=None):
        if self.free is None:
            self.free = list(range(num_pages))

    def reserve_and_allocate_page_indices(self, rank, keys, namespace=None):
        found = []
        for key, _prefix in keys:
            if key in self.pages:
                found.append((True, self.pages[key]))
            else:
                found.append((False, self.free.pop(0) if self.free else -1))
        return found

    def confirm_write(self, rank, written_keys_to_confirm, pages_to_release, namespace=None):
        self.pages.update(dict(written_keys_to_confirm))
        self.free.extend(pages_to_release)

    def get_page_indices(self, rank, keys, namespace=None):
        return [self.pages.get(key) for key in keys]

    def delete_keys(self, rank, keys, namespace=None):
        for key in keys:
            if key in self.pages:
                self.free.append(self.pages.pop(key))

    def exists(self, rank, keys, namespace=None):
        return [key in self.pages for key in keys]

    def clear(self, rank, namespace=None):
        self.free.extend(self.pages.values())
        self.pages.clear()


def _bytes_per_page(pool) -> int:
    """One file page: a flat page, or half of one for MHA's zero-copy K / V objects."""
    flat = pool.get_dummy_flat_data_page()
    nbytes = flat.numel() * flat.element_size()
    zero_copy_halves = _is_page_first(pool) and not _is_mla(pool)
    return nbytes // 2 if zero_copy_halves else nbytes


def _is_mla(pool) -> bool:
    return "MLA" in type(pool).__name__


def _is_page_first(pool) -> bool:
    """The layouts SGLang's backend reads through zero-copy page views."""
    return pool.layout in ("page_first", "page_first_direct")


def _backend(pool, path, index, bytes_per_page):
    # The constructor installs SIGINT/SIGTERM/SIGQUIT handlers for a server; pytest keeps its own.
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGQUIT)}
    try:
        backend = hf3fs.HiCacheHF3FS(
            rank=0,
            file_path=str(path),
            file_size=FILE_PAGES * bytes_per_page,
            numjobs=1,  # 0.5.18's mock client seeks a shared descriptor: one client, in order
            bytes_per_page=bytes_per_page,
            entries=8,
            client_timeout=5,
            dtype=pool.dtype,
            metadata_client=index,
            is_mla_model=_is_mla(pool),
            is_page_first_layout=_is_page_first(pool),
            use_mock_client=True,
        )
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)
    backend.register_mem_pool_host(pool)
    return backend


def _filled(call, side: str):
    pool = call.theirs() if side == "sglang" else call.ours()
    H.fill_random(H.buffers_of(pool), torch.Generator().manual_seed(1234))
    return pool


def _round_trip(call, saver: str, loader: str, tmp_path, bytes_per_page):
    """Save through a pool of `saver`'s side, load into a pool of `loader`'s side."""
    path = tmp_path / f"{saver}-{loader}" / "hicache.0.bin"
    index = _PageIndex()
    saving_pool = _filled(call, saver)
    saving = _backend(saving_pool, path, index, bytes_per_page)
    loading_pool, loading = saving_pool, saving
    if loader != saver:
        loading_pool = _filled(call, loader)
        loading = _backend(loading_pool, path, index, bytes_per_page)
    seen = {
        "set": saving.batch_set_v1(KEYS, H.page_slots(SAVED_PAGES, PAGE)),
        "set again": saving.batch_set_v1(KEYS, H.page_slots(SAVED_PAGES, PAGE)),
        "exists": saving.batch_exists(["a", "b", "c", "missing"]),
        "file": path.read_bytes(),
        "get": loading.batch_get_v1(KEYS, H.page_slots(LOADED_PAGES, PAGE)),
        "get with a missing key": loading.batch_get_v1(
            ["b", "missing", "c"], H.page_slots(PARTLY_LOADED_PAGES, PAGE)
        ),
        "pool": H.snapshot(H.buffers_of(loading_pool)),
    }
    for backend in {id(saving): saving, id(loading): loading}.values():
        backend.close()
    return seen


def _same(a: dict, b: dict) -> list[str]:
    differ = [key for key in a if key != "pool" and a[key] != b[key]]
    if len(a["pool"]) != len(b["pool"]) or not all(
        torch.equal(x, y) for x, y in zip(a["pool"], b["pool"])
    ):
        differ.append("pool")
    return differ


@pytest.mark.parametrize(("kind", "layout", "io_backend"), CASES)
def test_sglangs_hf3fs_backend_moves_the_same_bytes_through_our_pools(
    kind, layout, io_backend, tmp_path
):
    use_mla = kind == "mla"
    device = (H.mla_device if use_mla else H.mha_device)(size=256, page=PAGE)
    call = H.recorded_kv_host_call(device, use_mla=use_mla, layout=layout, io_backend=io_backend)
    assert H.is_ours(call.ours())
    bytes_per_page = _bytes_per_page(call.theirs())

    reference = _round_trip(call, "sglang", "sglang", tmp_path, bytes_per_page)
    # The case moves bytes at all: SGLang's own pool got its pages back.
    assert reference["get"] == [True, True, True]
    assert any(reference["file"])
    theirs = torch.cat([p.reshape(-1) for p in reference["pool"]])
    before = torch.cat([p.reshape(-1) for p in H.snapshot(H.buffers_of(_filled(call, "sglang")))])
    assert not torch.equal(theirs, before)

    for saver, loader in (("ours", "ours"), ("sglang", "ours"), ("ours", "sglang")):
        seen = _round_trip(call, saver, loader, tmp_path, bytes_per_page)
        assert _same(reference, seen) == [], f"saved by {saver}'s pool, loaded into {loader}'s"
