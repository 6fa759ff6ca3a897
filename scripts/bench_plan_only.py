"""What checking and planning one call costs the caller's thread, with no byte moved
(`DeviceBinding.load/backup(plan_only=True)`): MHA, 61 layers, 1 x 128 bf16, 64 pages of 64
tokens, a per-layer load and an all-layer backup, for each (layout, io backend) given.

    PYTHONPATH=python python scripts/bench_plan_only.py [LAYOUT BACKEND ...]
"""

import sys
import time

import torch
from hostkv_rs import MHATokenToKVPool, MHATokenToKVPoolHost

LAYERS, PAGE, PAGES = 61, 64, 64
PAIRS = ("page_first_direct", "direct", "page_first", "kernel", "layer_first", "direct")


def measure(layout: str, backend: str, calls: int = 20000) -> str:
    dev = MHATokenToKVPool(
        (PAGES + 2) * PAGE, PAGE, torch.bfloat16, head_num=1, head_dim=128, layer_num=LAYERS
    )
    host = MHATokenToKVPoolHost(dev, 2.0, 0, PAGE, layout)
    binding = host._device_side
    h, d = host.alloc(PAGES * PAGE), torch.arange(PAGE, PAGE + PAGES * PAGE)
    start = time.perf_counter()
    for i in range(calls):
        binding.load(i % LAYERS, h, d, backend, plan_only=True)
    load = (time.perf_counter() - start) / calls
    start = time.perf_counter()
    for _ in range(calls // 20):
        binding.backup(h, d, backend, plan_only=True)
    backup = (time.perf_counter() - start) / (calls // 20)
    return f"{layout} + {backend}: load {load * 1e6:.2f} us, backup {backup * 1e6:.2f} us"


if __name__ == "__main__":
    args = sys.argv[1:] or list(PAIRS)
    for layout, backend in zip(args[::2], args[1::2], strict=True):
        print(measure(layout, backend), flush=True)
