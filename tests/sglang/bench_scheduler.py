"""What a HiCache load or backup costs the scheduler thread, side by side: SGLang's own host pool
with its copy kernels replaced by no-ops (only its Python-side preparation runs: attribute and
buffer lookups, argument lists) against hostkv_rs's whole call (validation, plan and the copy on
the CPU engine) and against the same call through the core with `plan_only` (index reads, every
check and the whole plan, no byte moved: the part of a call a GPU's copy cannot hide). Run in an
SGLang release venv, from tests/:

    CUDA_VISIBLE_DEVICES="" PYTHONPATH=../python:sglang <venv>/bin/python sglang/bench_scheduler.py

Per (io backend, layout) and pages per batch (64 tokens a page; MHA, 61 layers, 1 x 128 bf16 so
the bytes stay small on this VM): a per-layer load of every layer and one all-layer backup, each
timed as wall clock and as this thread's CPU time, best of 5, the three variants alternating.
"""

from __future__ import annotations

import importlib.metadata
import sys
import time

import sgl_harness as H
import torch

LAYERS, PAGE, HEADS, HEAD_DIM = 61, 64, 1, 128
PAIRS = (("direct", "page_first_direct"), ("kernel", "page_first"))
PAGES = (1, 16, 64)


def no_op_kernels(pool) -> None:
    """SGLang's copy entry points in the module its pool class calls them from, as no-ops."""
    module = sys.modules[type(pool).__module__]
    for name in list(vars(module)) + [
        "transfer_kv_direct",
        "transfer_kv_per_layer",
        "transfer_kv_per_layer_pf_lf",
        "transfer_kv_per_layer_direct_pf_lf",
        "transfer_kv_all_layer",
        "transfer_kv_all_layer_lf_pf",
        "transfer_kv_all_layer_direct_lf_pf",
    ]:
        if name.startswith(("transfer_kv", "jit_transfer")):
            setattr(module, name, lambda *a, **k: None)
    pool.can_use_jit = False


def timed(fn) -> tuple[float, float]:
    wall, cpu = time.perf_counter(), time.thread_time()
    fn()
    return time.perf_counter() - wall, time.thread_time() - cpu


def main() -> None:
    print(
        f"SGLang {importlib.metadata.version('sglang')}; MHA {LAYERS} layers, {HEADS}x{HEAD_DIM} bf16, page {PAGE}"
    )
    print(
        "| io backend | layout | pages | op | SGLang prep (wall / thread CPU) "
        "| hostkv_rs whole call | hostkv_rs check + plan |"
    )
    print("|---|---|---|---|---|---|---|")
    for backend, layout in PAIRS:
        for pages in PAGES:
            size = (max(PAGES) + 2) * PAGE
            dev = H.mha_device(size=size, page=PAGE, heads=HEADS, head_dim=HEAD_DIM, layers=LAYERS)
            call = H.recorded_kv_host_call(dev, use_mla=False, layout=layout, io_backend=backend)
            theirs, ours = call.theirs(), call.ours()
            no_op_kernels(theirs)
            h = ours.alloc(pages * PAGE)
            theirs.alloc(pages * PAGE)
            d = torch.arange(PAGE, PAGE + pages * PAGE)

            binding = ours._device_side

            def load(pool, dev=dev, h=h, d=d, backend=backend):
                for layer in range(LAYERS):
                    pool.load_to_device_per_layer(dev, h, d, layer, backend)

            def plan_load(_, h=h, d=d, backend=backend, binding=binding):
                for layer in range(LAYERS):
                    binding.load(layer, h, d, backend, plan_only=True)

            def backup(pool, dev=dev, h=h, d=d, backend=backend):
                pool.backup_from_device_all_layer(dev, h, d, backend)

            def plan_backup(_, h=h, d=d, backend=backend, binding=binding):
                binding.backup(h, d, backend, plan_only=True)

            for op, fn, plan in (
                ("load (per layer)", load, plan_load),
                ("backup, all layers", backup, plan_backup),
            ):
                variants = (("theirs", theirs, fn), ("ours", ours, fn), ("plan", ours, plan))
                best = {who: (1e9, 1e9) for who, _, _ in variants}
                for _ in range(5):
                    for who, pool, run in variants:
                        w, c = timed(lambda pool=pool, run=run: run(pool))
                        best[who] = (min(best[who][0], w), min(best[who][1], c))
                per = LAYERS if fn is load else 1
                cell = {
                    k: f"{v[0] / per * 1e6:.1f} / {v[1] / per * 1e6:.1f} us"
                    for k, v in best.items()
                }
                print(
                    f"| {backend} | {layout} | {pages} | {op} | {cell['theirs']} | "
                    f"{cell['ours']} | {cell['plan']} |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
