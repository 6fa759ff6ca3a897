"""Per-call time of an all-layer backup of a DCP MLA pool (dcp_size=2) under SGLang 0.5.19's
rules (whole widened pages asserted before the io backend is read), 8 slots, best of 5 x 2000.

    PYTHONPATH=python python scripts/bench_dcp_backup.py
"""

from __future__ import annotations

import timeit

import torch
from hostkv_rs import MLATokenToKVPool, MLATokenToKVPoolHost
from hostkv_rs.sglang import sources


def main() -> None:
    sources.sglang_release = lambda: (0, 5, 19)
    dev = MLATokenToKVPool(
        64, 4, torch.bfloat16, kv_lora_rank=512, qk_rope_head_dim=64, layer_num=4
    )
    host = MLATokenToKVPoolHost(dev, 2.0, 0, 8, "page_first", dcp_size=2, dcp_rank=0)
    idx = torch.arange(8)

    def call():
        host.backup_from_device_all_layer(dev, idx, idx, "kernel")

    best = min(timeit.repeat(call, number=2000, repeat=5)) / 2000
    print(f"{best * 1e6:.2f} us per DCP backup")


if __name__ == "__main__":
    main()
