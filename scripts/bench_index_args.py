"""Per-call cost of the calls whose index arguments are converted rather than read in place: an
alloc + free of 16 slots, the same with the slots freed as a list, and a 16-row load with list,
numpy and (for comparison: read in place) int64 tensor indices, on a 2-layer layer_first MHA
pool. Median of 7 x 2000 calls, in microseconds.

    PYTHONPATH=python python scripts/bench_index_args.py LABEL
"""

import statistics
import sys
import time

import torch
from hostkv_rs import MHATokenToKVPool, MHATokenToKVPoolHost


def measure() -> list[str]:
    dev = MHATokenToKVPool(4096, 16, torch.float32, head_num=2, head_dim=8, layer_num=2)
    host = MHATokenToKVPoolHost(dev, 2.0, 0, 16, "layer_first")
    h, d = host.alloc(16), torch.arange(16, 32)
    h_list, d_list, h_numpy = h.tolist(), d.tolist(), h.numpy().copy()

    def alloc_free():
        host.free(host.alloc(16))

    def alloc_free_list():
        host.free(host.alloc(16).tolist())

    calls = {
        "alloc+free": alloc_free,
        "alloc+free(list)": alloc_free_list,
        "load(lists)": lambda: host.load_to_device_per_layer(dev, h_list, d_list, 0, "kernel"),
        "load(numpy)": lambda: host.load_to_device_per_layer(dev, h_numpy, d, 0, "kernel"),
        "load(tensors)": lambda: host.load_to_device_per_layer(dev, h, d, 0, "kernel"),
    }
    out = []
    for name, call in calls.items():
        for _ in range(200):
            call()
        runs = []
        for _ in range(7):
            start = time.perf_counter()
            for _ in range(2000):
                call()
            runs.append((time.perf_counter() - start) / 2000 * 1e6)
        out.append(f"{name} {statistics.median(runs):.2f}")
    return out


if __name__ == "__main__":
    torch.set_num_threads(1)
    label = sys.argv[1] if len(sys.argv) > 1 else ""
    print(label, "; ".join(measure()))
