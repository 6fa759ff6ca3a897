"""Per-call cost of DeepSeek V4 paged transfers (a layer_first C4 pool, 61 layers, CPU device
buffers): best of 7 x 500 calls of a one-page load of one layer, a one-page backup of every layer,
and the same for one token (the C4 token path).

    PYTHONPATH=python python scripts/bench_v4_percall.py LABEL
"""

import sys
import timeit

import torch
from hostkv_rs import DeepSeekV4PagedHostPool, _core

LAYERS, PAGES = 61, 8


def measure() -> list[str]:
    row = _core.C4_ROW_BYTES
    dev = [torch.zeros((PAGES, row), dtype=torch.uint8) for _ in range(LAYERS)]
    host = DeepSeekV4PagedHostPool("c4", dev, row, PAGES, 64, "layer_first")
    page_h, page_d = torch.arange(64, 128), torch.arange(128, 192)
    tok_h, tok_d = torch.tensor([70]), torch.tensor([130])
    calls = {
        "page load": lambda: host.load_to_device_per_layer(None, page_h, page_d, 3, "kernel"),
        "page backup": lambda: host.backup_from_device_all_layer(None, page_h, page_d, "kernel"),
        "token load": lambda: host.load_to_device_per_layer(None, tok_h, tok_d, 3, "kernel"),
        "token backup": lambda: host.backup_from_device_all_layer(None, tok_h, tok_d, "kernel"),
    }
    out = []
    for name, call in calls.items():
        call()
        best = min(timeit.repeat(call, number=500, repeat=7)) / 500 * 1e6
        out.append(f"{name}: {best:.2f} us")
    return out


if __name__ == "__main__":
    print(sys.argv[1] if len(sys.argv) > 1 else "", "; ".join(measure()), flush=True)
