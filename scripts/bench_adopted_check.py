"""Per-call cost of a pool over a storage backend's tensors against one over hostkv_rs's regions
(both check their storages on every call): a 1-row load and a 61-layer 1-row backup through an
MHA pool, interleaved, median of 7 rounds of 2000 calls."""

import statistics
import time

import torch
from hostkv_rs import MHATokenToKVPool, MHATokenToKVPoolHost
from hostkv_rs.pools import base


class Alloc:
    def allocate(self, dims, dtype, device):
        return torch.zeros(dims, dtype=dtype)


def pool(adopted):
    orig = base.get_allocator_from_storage
    if adopted:
        base.get_allocator_from_storage = lambda *a, **k: Alloc()
    try:
        dev = MHATokenToKVPool(1024, 1, torch.bfloat16, head_num=8, head_dim=128, layer_num=61)
        host = MHATokenToKVPoolHost(
            dev, 2.0, 0, 1, "layer_first", allocator_type="shm" if adopted else "default"
        )
    finally:
        base.get_allocator_from_storage = orig
    assert (host._host_regions[0].hugepage_tier == "adopted") == adopted
    return host, dev


pools = {name: pool(name == "adopted") for name in ("regions", "adopted")}
h, d = torch.tensor([5]), torch.tensor([7])
res = {(n, op): [] for n in pools for op in ("load", "backup")}


def call(host, dev, op):
    if op == "load":
        return lambda: host.load_to_device_per_layer(dev, h, d, 3, "kernel")
    return lambda: host.backup_from_device_all_layer(dev, h, d, "kernel")


for _ in range(7):
    for n, (host, dev) in pools.items():
        for op in ("load", "backup"):
            f = call(host, dev, op)
            t = time.perf_counter()
            for _ in range(2000):
                f()
            res[(n, op)].append((time.perf_counter() - t) / 2000 * 1e6)
for k, v in res.items():
    print(k, f"median {statistics.median(v):.2f} us  min {min(v):.2f}")
