"""Per-call time of a per-layer load that names a device pool other than the one the host pool
was built from (the path SGLang <= 0.5.21 and pools without SGLang take: the named pool's layers
are read), 12 layers loaded round-robin as a server's per-layer loop does. Prints the best of 5
rounds of 6000 calls, in microseconds per call.

    PYTHONPATH=python python scripts/bench_foreign_pool.py
"""

from __future__ import annotations

import time

import torch
from hostkv_rs import MHATokenToKVPool, MHATokenToKVPoolHost

LAYERS, PAGE, CALLS, ROUNDS = 12, 4, 6000, 5


def main() -> None:
    built = MHATokenToKVPool(16, PAGE, torch.bfloat16, 2, 8, LAYERS)
    host = MHATokenToKVPoolHost(built, 2.0, 0, PAGE, "page_first")
    other = MHATokenToKVPool(16, PAGE, torch.bfloat16, 2, 8, LAYERS)
    h, d = host.alloc(PAGE), torch.arange(PAGE, 2 * PAGE)
    for i in range(2 * LAYERS):
        host.load_to_device_per_layer(other, h, d, i % LAYERS, "kernel")
    best = float("inf")
    for _ in range(ROUNDS):
        start = time.perf_counter()
        for i in range(CALLS):
            host.load_to_device_per_layer(other, h, d, i % LAYERS, "kernel")
        best = min(best, (time.perf_counter() - start) / CALLS)
    print(f"{best * 1e6:.2f} us per call")


if __name__ == "__main__":
    main()
