"""Strided device rows (SGLang 0.5.22+'s unified pools: per-layer views of one token-major
buffer) against packed per-layer device tensors, on the CPU engine: one 61-layer MHA page_first
pool (8 x 128 bf16, page 64) over each, the same host and device slots, variants interleaved.
Prints per round the best-of-5 time of each call and the strided / packed ratio.

    PYTHONPATH=python python scripts/bench_strided.py [ROUNDS]
"""

import sys
import timeit
import types

import torch
from hostkv_rs import MHATokenToKVPool, MHATokenToKVPoolHost

LAYERS, HEADS, DIM, PAGE, TOKENS = 61, 8, 128, 64, 1024


def strided_pool():
    """A device pool whose token t holds every layer's K and V row, as a unified pool's entry."""
    row = HEADS * DIM
    entries = torch.zeros(TOKENS + PAGE, LAYERS * 2 * row, dtype=torch.bfloat16)
    k = [entries[:, 2 * l * row :][:, :row].view(-1, HEADS, DIM) for l in range(LAYERS)]
    v = [entries[:, (2 * l + 1) * row :][:, :row].view(-1, HEADS, DIM) for l in range(LAYERS)]
    return types.SimpleNamespace(
        size=TOKENS,
        page_size=PAGE,
        dtype=torch.bfloat16,
        store_dtype=torch.bfloat16,
        device="cpu",
        layer_num=LAYERS,
        start_layer=0,
        end_layer=LAYERS - 1,
        head_num=HEADS,
        head_dim=DIM,
        v_head_dim=DIM,
        k_buffer=k,
        v_buffer=v,
        k_data_ptrs=torch.tensor([t.data_ptr() for t in k], dtype=torch.uint64),
        v_data_ptrs=torch.tensor([t.data_ptr() for t in v], dtype=torch.uint64),
        entries=entries,
    )


def calls(dev):
    host = MHATokenToKVPoolHost(dev, 2.0, 0, PAGE, "page_first")
    slots = host.alloc(8 * PAGE)
    one, page, pages = slots[:1].clone(), slots[:PAGE].clone(), slots.clone()
    d1, dpage, dpages = torch.tensor([5]), torch.arange(PAGE, 2 * PAGE), torch.arange(8 * PAGE)
    return {
        "1-row load": (lambda: host.load_to_device_per_layer(dev, one, d1, 3, "kernel"), 2000),
        "61-layer 1-row backup": (
            lambda: host.backup_from_device_all_layer(dev, one, d1, "kernel"),
            2000,
        ),
        "1-page load": (lambda: host.load_to_device_per_layer(dev, page, dpage, 3, "kernel"), 200),
        "8-page 61-layer backup": (
            lambda: host.backup_from_device_all_layer(dev, pages, dpages, "kernel"),
            5,
        ),
    }


def main(rounds: int) -> None:
    torch.set_num_threads(1)
    packed = MHATokenToKVPool(TOKENS, PAGE, torch.bfloat16, HEADS, DIM, LAYERS)
    variants = {"packed": calls(packed), "strided": calls(strided_pool())}
    for r in range(rounds):
        line = []
        for name in variants["packed"]:
            best = {}
            for variant, table in variants.items():
                call, number = table[name]
                call()
                best[variant] = min(timeit.repeat(call, number=number, repeat=5)) / number * 1e6
            ratio = best["strided"] / best["packed"]
            line.append(
                f"{name}: packed {best['packed']:.2f} us, strided {best['strided']:.2f} us "
                f"(x{ratio:.2f})"
            )
        print(f"round {r}: " + "; ".join(line), flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 3)
