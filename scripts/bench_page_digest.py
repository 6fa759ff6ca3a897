"""What HOSTKV_PAGE_DIGEST costs: a 61-layer MHA page_first pool (8 x 128 bf16, pages of 64
tokens), an all-layer backup of 16 pages and a per-layer load of every layer, with the check off
and on, alternating, best of 5 rounds of 5 calls each.

    PYTHONPATH=python python scripts/bench_page_digest.py
"""

import os
import time

import torch
from hostkv_rs import MHATokenToKVPool, MHATokenToKVPoolHost

LAYERS, PAGE, PAGES = 61, 64, 16


def pool(digest: bool):
    os.environ["HOSTKV_PAGE_DIGEST"] = "1" if digest else "0"
    dev = MHATokenToKVPool(
        (PAGES + 2) * PAGE, PAGE, torch.bfloat16, head_num=8, head_dim=128, layer_num=LAYERS
    )
    return dev, MHATokenToKVPoolHost(dev, 2.0, 0, PAGE, "page_first")


def rounds(dev, host, h, d) -> tuple[float, float]:
    best_b = best_l = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        host.backup_from_device_all_layer(dev, h, d, "kernel")
        best_b = min(best_b, time.perf_counter() - t)
        t = time.perf_counter()
        for layer in range(LAYERS):
            host.load_to_device_per_layer(dev, h, d, layer, "kernel")
        best_l = min(best_l, time.perf_counter() - t)
    return best_b, best_l


if __name__ == "__main__":
    sides = {flag: pool(flag) for flag in (False, True)}
    idx = {
        flag: (host.alloc(PAGES * PAGE), torch.arange(PAGE, PAGE + PAGES * PAGE))
        for flag, (_, host) in sides.items()
    }
    for r in range(3):
        for flag, (dev, host) in sides.items():
            b, l_ = rounds(dev, host, *idx[flag])
            print(
                f"round {r} digest={'on ' if flag else 'off'}: backup {b * 1e3:.2f} ms, "
                f"load of {LAYERS} layers {l_ * 1e3:.2f} ms",
                flush=True,
            )
