"""Our kernel path beside SGLang 0.5.23's default HiCache copy kernel (the TMA-staged kernel at 4
CTAs on sm_90+, SGLang PR #40278), on the same pinned host buffers, device layers and indices,
timed with CUDA events in one run, the two interleaved round by round.

    python scripts/sglang_tma_bench.py [--budget SECONDS] [--out FILE]

Rows: a per-layer load of every layer (host page_first and layer_first) and an all-layer backup
into a layer_first host, at the shape PR #40278 measured (8 layers, 4 KV heads x 64 bf16 = 512 B
rows, 128-token pages) for 2048, 8192 and 32768 tokens per layer. SGLang's kernel is called as
SGLang 0.5.23's `MHATokenToKVPoolHost` calls it, on our pool's own host views (`k_data_refs`,
`k_data_ptrs`), so both move the same bytes between the same memory; after SGLang's call the
moved rows are compared with the source, so a wrong call shows as "bytes differ", not as a
number. Where SGLang's kernels cannot be imported or the TMA kernel is not used (no sm_90, no
JIT toolchain, SGLANG_HICACHE_TMA_TRANSFER=0) one line says why and the exit status is 3: the
comparison is what a GPU run can add, not something this machine must have. Rows are appended
to --out as they are measured, so a run stopped at its time limit keeps them.

On a machine without network access, SGLang and what its kernel module imports come as wheels
(`bash scripts/fetch_sglang_wheels.sh` downloads them into .whl/; docs/cuda.md §5).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
from gpu_bench import timer  # this script's folder is first on sys.path

LAYERS, HEADS, HEAD_DIM, PAGE = 8, 4, 64, 128
TOKENS = (2048, 8192, 32768)


def sglang_kernels():
    """SGLang's HiCache kernel module and whether its TMA kernel serves 512 B rows here, or
    (None, why not)."""
    try:
        import sglang.kernels.ops.kvcache.hicache as hc
    except Exception as exc:  # noqa: BLE001 (any import failure is the reason printed)
        return None, f"SGLang's kernels are not importable here ({type(exc).__name__}: {exc})"
    if not torch.cuda.is_available():
        return None, "no CUDA device"
    row_bytes = HEADS * HEAD_DIM * 2
    try:
        tma = hc.use_hicache_tma_kernel(
            element_size=row_bytes, block_quota=hc.TMA_BLOCK_QUOTA, page_size=PAGE
        )
    except Exception as exc:  # noqa: BLE001
        return None, f"SGLang's TMA kernel check failed ({type(exc).__name__}: {exc})"
    if not tma:
        major, minor = torch.cuda.get_device_capability()
        return None, (
            f"SGLang does not use its TMA kernel here (sm_{major}{minor}; it needs sm_90+, "
            "its JIT build and SGLANG_HICACHE_TMA_TRANSFER on)"
        )
    return hc, None


def pools(tokens: int, layout: str):
    from hostkv_rs import MHATokenToKVPool, MHATokenToKVPoolHost

    # Page 0 of a device pool is SGLang's padding page: one more page than moved.
    dp = MHATokenToKVPool(tokens + PAGE, PAGE, torch.bfloat16, HEADS, HEAD_DIM, LAYERS, "cuda")
    host = MHATokenToKVPoolHost(dp, 2.0, 0, PAGE, layout)
    return dp, host


def indices(host, tokens: int):
    gen = torch.Generator().manual_seed(tokens)
    pages = torch.randperm(host.size // PAGE, generator=gen)[: tokens // PAGE]
    h = (pages[:, None] * PAGE + torch.arange(PAGE)).reshape(-1)
    d = torch.arange(PAGE, PAGE + tokens)
    return h.cuda(), d.cuda()


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.int16), b.view(torch.int16))


def cases(hc, tokens: int):
    """(name, ours, SGLang's, check) per row; check() says whether SGLang's call moved the right
    bytes."""
    for layout in ("page_first", "layer_first"):
        dp, host = pools(tokens, layout)
        h, d = indices(host, tokens)
        for ref in host.k_data_refs + host.v_data_refs:
            ref.view(torch.int16).random_()

        def ours(dp=dp, host=host, h=h, d=d):
            for layer in range(LAYERS):
                host.load_to_device_per_layer(dp, h, d, layer, "kernel")

        def theirs(dp=dp, host=host, h=h, d=d):
            for layer in range(LAYERS):
                hc.transfer_hicache_one_layer(
                    k_cache_dst=dp.k_buffer[layer],
                    v_cache_dst=dp.v_buffer[layer],
                    indices_dst=d,
                    k_cache_src=host.k_data_refs[layer],
                    v_cache_src=host.v_data_refs[layer],
                    indices_src=h,
                    element_dim=HEADS * HEAD_DIM,
                    page_size=PAGE,
                )

        def loaded(dp=dp, host=host, h=h, d=d):
            pairs = ((dp.k_buffer, host.k_data_refs), (dp.v_buffer, host.v_data_refs))
            return all(
                same(device[layer][d].cpu(), hosted[layer][h.cpu()])
                for device, hosted in pairs
                for layer in range(LAYERS)
            )

        yield f"load {layout}", ours, theirs, loaded

    dp, host = pools(tokens, "layer_first")
    h, d = indices(host, tokens)
    for layer in dp.k_buffer + dp.v_buffer:
        layer.view(torch.int16).random_()
    row_bytes = HEADS * HEAD_DIM * 2

    def ours_backup(dp=dp, host=host, h=h, d=d):
        host.backup_from_device_all_layer(dp, h, d, "kernel")

    def theirs_backup(dp=dp, host=host, h=h, d=d):
        hc.transfer_hicache_all_layer(
            k_ptr_dst=host.k_data_ptrs,
            v_ptr_dst=host.v_data_ptrs,
            indices_dst=h,
            k_ptr_src=dp.k_data_ptrs,
            v_ptr_src=dp.v_data_ptrs,
            indices_src=d,
            kv_cache_dst_stride_bytes=row_bytes,
            kv_cache_src_stride_bytes=row_bytes,
            element_size=row_bytes,
            page_size=PAGE,
        )

    def backed_up(dp=dp, host=host, h=h, d=d):
        pairs = ((dp.k_buffer, host.k_data_refs), (dp.v_buffer, host.v_data_refs))
        return all(
            same(hosted[layer][h.cpu()], device[layer][d].cpu())
            for device, hosted in pairs
            for layer in range(LAYERS)
        )

    yield "backup layer_first", ours_backup, theirs_backup, backed_up


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--budget", type=float, default=60.0, help="seconds for the whole table")
    ap.add_argument("--out", help="append the table to this file")
    args = ap.parse_args(argv)
    out = open(args.out, "a") if args.out else None  # noqa: SIM115 (written row by row)
    lines: list[str] = []

    def emit(line: str) -> None:
        lines.append(line)
        print(line, flush=True)
        if out:
            out.write(line + "\n")
            out.flush()

    emit("")
    emit(
        "Beside SGLang 0.5.23's TMA HiCache kernel (4 CTAs; 8 layers, 512 B rows, 128-token "
        "pages; GB/s of KV bytes, CUDA events, median of 5 interleaved rounds):"
    )
    emit("")
    hc, why = sglang_kernels()
    if hc is None:
        emit(f"not run: {why}")
        return 3
    emit("| op | tokens per layer | ours GB/s | SGLang TMA GB/s | ours / SGLang | bytes |")
    emit("|---|---|---|---|---|---|")
    deadline = time.monotonic() + args.budget
    cuda_seconds = timer("cuda")
    for tokens in TOKENS:
        for name, ours, theirs, check in cases(hc, tokens):
            if time.monotonic() > deadline:
                emit(f"| {name} | {tokens} | - | - | - | budget spent |")
                continue
            nbytes = 2 * LAYERS * tokens * HEADS * HEAD_DIM * 2
            theirs()  # JIT build and warm-up
            torch.cuda.synchronize()
            agree = "agree" if check() else "DIFFER"
            ours()
            t_ours, t_theirs = [], []
            for _ in range(5):
                t_ours.append(cuda_seconds(ours))
                t_theirs.append(cuda_seconds(theirs))
            a = nbytes / statistics.median(t_ours) / 1e9
            b = nbytes / statistics.median(t_theirs) / 1e9
            emit(f"| {name} | {tokens} | {a:.1f} | {b:.1f} | {a / b:.2f} | {agree} |")
    if out:
        out.close()
    return 1 if any("DIFFER" in line for line in lines) else 0


if __name__ == "__main__":
    sys.exit(main())
