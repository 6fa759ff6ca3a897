"""The L3 leg of `hostkv-rs demo --l3 mooncake`: the host pages the demo just backed up go to a
Mooncake Store and come back into a second, fresh host pool (another server's), byte for byte.

Without `--l3-master` a `mooncake_master` is started on loopback for the demo and stopped after.
The first pool's client contributes the store's memory (a segment); the second contributes none,
as a server that only reads would.
"""

from __future__ import annotations

import ctypes
import time
import uuid

import torch

DEMO_MODEL_ID = "hostkv-rs demo (random bytes)"


def _page_tensors(pool, slots: torch.Tensor) -> list[torch.Tensor]:
    """Byte tensors over every buffer of the pages at `slots` (zero-copy views)."""
    ptrs, sizes = pool.get_page_buffer_meta(slots)
    return [
        torch.frombuffer((ctypes.c_char * s).from_address(p), dtype=torch.uint8)
        for p, s in zip(ptrs, sizes)
    ]


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB"


def default_metadata(master: str) -> str:
    """The master's embedded HTTP metadata server at its default port."""
    return f"http://{master.rsplit(':', 1)[0]}:8080/metadata"


def preflight(master=None, metadata=None) -> None:
    """What can fail before the demo allocates anything: Mooncake not installed, a given master
    (or its metadata server) not answering."""
    from hostkv_rs.l3 import _native
    from hostkv_rs.l3.mooncake import _import_store_class

    _import_store_class()
    if master is not None:
        _native.probe(master, metadata or default_metadata(master))


def round_trip(host_pool, host_idx: torch.Tensor, make_pool, say, *, master=None, metadata=None):
    """Save the pages of `host_idx` (whole pages) from `host_pool`, load them into a fresh pool
    from `make_pool()`, verify. Returns the number of differing bytes (+ failed pages)."""
    from hostkv_rs.l3 import MooncakeTier, page_format
    from hostkv_rs.l3.master import LoopbackMaster

    fmt = page_format(host_pool)
    P = fmt.slots_per_page
    n = host_idx.numel() // P
    moved = n * fmt.page_bytes
    started = None
    if master is None:
        t0 = time.perf_counter()
        started = LoopbackMaster.start()
        master, metadata = started.address, started.metadata_server
        say(
            f"  l3 master   : mooncake_master on {master} (pid {started.pid}, metadata "
            f"{metadata}), up in {(time.perf_counter() - t0) * 1e3:.0f} ms"
        )
    elif metadata is None:
        metadata = default_metadata(master)
    segment = max(64 << 20, 2 * moved)
    tiers = []
    other = None
    try:
        # the demo's pages are random bytes of no model: it names itself as their producer
        # one process, so one TP rank: rank 0 of 1, said so
        shard = {"model_id": DEMO_MODEL_ID, "tp_rank": 0, "tp_size": 1}
        saver = MooncakeTier.connect(master, metadata, global_segment_size=segment, **shard)
        tiers.append(saver)
        loader = MooncakeTier.connect(master, metadata, global_segment_size=0, **shard)
        tiers.append(loader)
        fmt = saver.attach(host_pool)
        say(
            f"  l3 tier     : key tag {fmt.tag}; {fmt.buffers_per_page} buffer(s) per page, "
            "each object with its digest"
        )
        keys = [f"demo-{uuid.uuid4().hex[:12]}-{i}" for i in range(n)]
        t0 = time.perf_counter()
        saved = saver.save(keys, host_idx)
        put_s = time.perf_counter() - t0
        say(
            f"  l3 put      : {n} pages, {_mib(moved)} in {put_s * 1e3:.2f} ms = "
            f"{moved / put_s / 1e9:.2f} GB/s (zero-copy from the pool's registered memory)"
        )
        other = make_pool()
        slots = other.alloc(n * P)
        if slots is None:
            raise RuntimeError(f"the second host pool has no room for {n} pages")
        slots = slots.clone()
        loader.attach(other)
        t0 = time.perf_counter()
        loaded = loader.load(keys, slots)
        get_s = time.perf_counter() - t0
        say(
            f"  l3 get      : into a fresh {type(other).__name__} (another client), "
            f"{_mib(moved)} in {get_s * 1e3:.2f} ms = {moved / get_s / 1e9:.2f} GB/s"
        )
        a, b = torch.empty(moved, dtype=torch.uint8), torch.zeros(moved, dtype=torch.uint8)
        torch.cat(_page_tensors(host_pool, host_idx), out=a)
        # one thread's memmove: torch's copy_ would wake its OpenMP pool for so few bytes
        t0 = time.perf_counter()
        ctypes.memmove(b.data_ptr(), a.data_ptr(), moved)
        copy_s = time.perf_counter() - t0
        torch.cat(_page_tensors(other, slots), out=b)
        bad = int((a != b).sum())
        failed = sum(not r for r in saved) + sum(not r for r in loaded)
        say(
            f"  l3 verify   : {moved - bad} of {moved} bytes match, {failed} failed page "
            f"operations (a plain copy of the same bytes: {moved / copy_s / 1e9:.2f} GB/s)"
        )
        return bad + failed
    finally:
        for tier in tiers:
            tier.close()
        if other is not None:
            other.destroy()
        if started is not None:
            started.stop()
            started.remove_log()
