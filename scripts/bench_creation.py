"""Host-memory creation, 64 MiB .. 8 GiB: a HostRegion (mmap + parallel MADV_POPULATE_WRITE
pre-touch: the kernel zeroes each page once, on its fault) against torch.empty(n).zero_(),
alternating which goes first each round; GB/s and the per-round ratio.

    PYTHONPATH=python python scripts/bench_creation.py [ROUNDS]
"""

import gc
import sys
import time

import torch
from hostkv_rs import _core

torch.set_num_threads(2)
sizes = [64 << 20, 256 << 20, 1 << 30, 4 << 30, 8 << 30]
rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 3
for n in sizes:
    ours, theirs = [], []
    for r in range(rounds):
        for variant in ("ours", "torch") if r % 2 == 0 else ("torch", "ours"):
            gc.collect()
            t = time.perf_counter()
            if variant == "ours":
                x = _core.HostRegion(n)
            else:
                x = torch.empty(n, dtype=torch.uint8).zero_()
            dt = time.perf_counter() - t
            (ours if variant == "ours" else theirs).append(n / dt / 1e9)
            del x
    tier = _core.HostRegion(n).hugepage_tier
    ratios = sorted(o / t for o, t in zip(ours, theirs))
    print(
        f"{n >> 20:5d} MiB tier={tier}: HostRegion {min(ours):.1f}-{max(ours):.1f} GB/s, "
        f"torch.empty().zero_() {min(theirs):.1f}-{max(theirs):.1f} GB/s, "
        f"per-round ratio min {ratios[0]:.2f} median {ratios[len(ratios) // 2]:.2f}",
        flush=True,
    )
