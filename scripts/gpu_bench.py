"""Transfer throughput as a share of what the machine's own copy engine does with one contiguous
pinned buffer: a markdown table per geometry x layout x io backend x op, ready for
docs/gpu-results.md.

    python scripts/gpu_bench.py [--device cuda|cpu] [--budget SECONDS] [--out FILE]

The peak is torch's `copy_` of one 1 GiB pinned host buffer to and from the GPU, timed with CUDA
events (best of three). Each transfer is a pool call through SGLang's API (an all-layer backup of
N pages, or a per-layer load of every layer), timed the same way, median of five after one
warm-up. `--device cpu` runs the same calls on CPU device pools with wall-clock timing and a
64 MiB peak: a dry run of the script, not a measurement of anything a GPU does.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch


def timer(device: str):
    """A function timing `fn()` in seconds: CUDA events on the current stream, or wall clock."""
    if device == "cuda":

        def cuda_time(fn) -> float:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3

        return cuda_time

    def wall_time(fn) -> float:
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0

    return wall_time


def peak(device: str, nbytes: int, time_fn) -> dict[str, float]:
    """Bytes per second of one contiguous pinned copy, each direction (best of three)."""
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device == "cuda")
    host.fill_(1)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    out = {}
    for op, dst, src in (("load", dev, host), ("backup", host, dev)):

        def fn(dst=dst, src=src):
            dst.copy_(src, non_blocking=True)

        fn()
        out[op] = nbytes / min(time_fn(fn) for _ in range(3))
    return out


GEOMETRIES = {
    # name: (kind, layers, heads, head_dim or (kv_lora_rank, rope_dim), page_size, pages)
    "mha 32L 8x128 bf16": ("mha", 32, 8, 128, 64, 32),
    "mla 61L 576 bf16": ("mla", 61, 1, (512, 64), 64, 48),
}


def build(kind, layers, heads, dims, page, pages, layout, device):
    from hostkv_rs import (
        MHATokenToKVPool,
        MLATokenToKVPool,
        MLATokenToKVPoolHost,
        get_mha_host_pool_cls,
    )

    size = pages * page
    if kind == "mha":
        dp = MHATokenToKVPool(size, page, torch.bfloat16, heads, dims, layers, device=device)
        host = get_mha_host_pool_cls(dp)(dp, 2.0, 0, page, layout)
    else:
        dp = MLATokenToKVPool(size, page, torch.bfloat16, dims[0], dims[1], layers, device=device)
        host = MLATokenToKVPoolHost(dp, 2.0, 0, page, layout)
    return dp, host


def moved_bytes(host, tokens: int) -> int:
    return host.get_size_per_token() * tokens


def rows(device: str, scale: float, deadline: float, time_fn, peaks):
    from hostkv_rs import _core

    for name, (kind, layers, heads, dims, page, pages) in GEOMETRIES.items():
        pages = max(2, int(pages * scale))
        for layout, backend in _core.supported_pairs(kind):
            for op in ("backup", "load"):
                if time.monotonic() > deadline:
                    yield name, layout, backend, op, None, "budget spent"
                    continue
                try:
                    dp, host = build(kind, layers, heads, dims, page, pages, layout, device)
                    tokens = pages * page
                    gen = torch.Generator().manual_seed(0)
                    host_pages = torch.randperm(host.size // page, generator=gen)[:pages]
                    h = (host_pages[:, None] * page + torch.arange(page)).reshape(-1)
                    # Device slots from 1 page on: SGLang's device pools keep page 0 as padding.
                    d = torch.arange(page, page + tokens)
                    if device == "cuda" and backend == "kernel":
                        # SGLang hands the kernels device-resident indices.
                        h, d = h.to(device), d.to(device)
                    if op == "backup":

                        def call(h=h, d=d, host=host, dp=dp, backend=backend):
                            host.backup_from_device_all_layer(dp, h, d, backend)

                    else:

                        def call(h=h, d=d, host=host, dp=dp, backend=backend):
                            for layer in range(host.layer_num):
                                host.load_to_device_per_layer(dp, h, d, layer, backend)

                    call()
                    secs = statistics.median(time_fn(call) for _ in range(5))
                    rate = moved_bytes(host, h.numel()) / secs
                    yield name, layout, backend, op, rate, f"{100 * rate / peaks[op]:.0f}%"
                except Exception as e:  # noqa: BLE001 (a failed row is reported, the table goes on)
                    yield name, layout, backend, op, None, f"error: {type(e).__name__}: {e}"[:90]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--budget", type=float, default=90.0, help="seconds for the whole table")
    ap.add_argument("--out", help="also write the table to this file")
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_bench: --device cuda but torch sees no GPU", file=sys.stderr)
        return 2
    deadline = time.monotonic() + args.budget
    time_fn = timer(args.device)
    peak_bytes = (1 << 30) if args.device == "cuda" else (64 << 20)
    scale = 1.0 if args.device == "cuda" else 0.125
    peaks = peak(args.device, peak_bytes, time_fn)
    what = "CUDA events" if args.device == "cuda" else "wall clock, CPU dry run"
    lines = [
        (
            f"Peak, one contiguous {peak_bytes >> 20} MiB pinned copy ({what}): "
            f"load {peaks['load'] / 1e9:.1f} GB/s, backup {peaks['backup'] / 1e9:.1f} GB/s"
        ),
        "",
        "| geometry | layout | io backend | op | GB/s | % of peak |",
        "|---|---|---|---|---|---|",
    ]
    out = open(args.out, "w") if args.out else None  # noqa: SIM115 (written row by row)
    if out:
        out.write("\n".join(lines) + "\n")
        out.flush()
    for name, layout, backend, op, rate, note in rows(args.device, scale, deadline, time_fn, peaks):
        gbs = f"{rate / 1e9:.1f}" if rate is not None else "-"
        lines.append(f"| {name} | {layout} | {backend} | {op} | {gbs} | {note} |")
        print(lines[-1], flush=True)
        if out:
            # Row by row: a run stopped at its time limit still leaves the rows it measured.
            out.write(lines[-1] + "\n")
            out.flush()
    if out:
        out.close()
    text = "\n".join(lines)
    print()
    print(text)
    return 1 if "error:" in text else 0


if __name__ == "__main__":
    sys.exit(main())
