"""Per-call cost of one-row transfers on a 61-layer page_first pool (MHA 8 x 128 bf16, MLA 576
bf16): best of 7 x 2000 calls of a 1-row load and of a 61-layer 1-row backup.

    PYTHONPATH=python python scripts/bench_percall.py LABEL
"""

import sys
import timeit

import torch
from hostkv_rs import (
    MHATokenToKVPool,
    MHATokenToKVPoolHost,
    MLATokenToKVPool,
    MLATokenToKVPoolHost,
)


def pools(kind: str, layers: int):
    if kind == "mha":
        dev = MHATokenToKVPool(1024, 64, torch.bfloat16, head_num=8, head_dim=128, layer_num=layers)
        return dev, MHATokenToKVPoolHost(dev, 2.0, 0, 64, "page_first")
    dev = MLATokenToKVPool(
        1024, 64, torch.bfloat16, kv_lora_rank=512, qk_rope_head_dim=64, layer_num=layers
    )
    return dev, MLATokenToKVPoolHost(dev, 2.0, 0, 64, "page_first")


def measure(kind: str) -> list[str]:
    dev, host = pools(kind, 61)
    h, d = host.alloc(64)[:1].clone(), torch.tensor([5])
    calls = {
        "1-row load": lambda: host.load_to_device_per_layer(dev, h, d, 3, "kernel"),
        "61-layer 1-row backup": lambda: host.backup_from_device_all_layer(dev, h, d, "kernel"),
    }
    out = []
    for name, call in calls.items():
        call()
        best = min(timeit.repeat(call, number=2000, repeat=7)) / 2000 * 1e6
        out.append(f"{kind} {name}: {best:.2f} us")
    return out


if __name__ == "__main__":
    torch.set_num_threads(1)
    label = sys.argv[1] if len(sys.argv) > 1 else ""
    print(label, "; ".join(measure("mha") + measure("mla")))
