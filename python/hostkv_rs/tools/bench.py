"""`hostkv-rs bench`: host-pool transfers against the two yardsticks that matter.

Every backup/load cell is measured three ways in the same process, on the same bytes:

* the pool (`backup_from_device_all_layer` / `load_to_device_per_layer`),
* plain torch indexing, i.e. what a Python host pool would do (`host[h] = dev[d]` per layer and
  plane, on the pool's own documented buffer views), and
* one contiguous copy of the same number of bytes: one thread's memmove on CPU (torch's copy_
  would spread it over its OpenMP pool, whose workers wait for a scheduler tick each on a busy
  machine), cudaMemcpy on CUDA.

The three are timed interleaved, call by call in rotating order, so a burst of other work on a
shared machine slows all three alike instead of spoiling one of them; each number is the median of
its calls. A copy that measured slower than the pool could possibly beat it (more than the pool's
thread count times faster, see `copy_threads`) is reported, and printed as n/a, rather than turned
into a ratio.

Host-pool creation is an "alloc" row against `torch.empty(n, dtype=torch.uint8).zero_()`.
"""

from __future__ import annotations

import contextlib
import ctypes
import datetime as _dt
import gc
import math
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass, field

from hostkv_rs import _core
from hostkv_rs.tools.bench_report import copy_ratio, size_text
from hostkv_rs.tools.presets import Preset, build_device_pool, host_pool_class
from hostkv_rs.tools.torch_baseline import (
    device_planes,
    host_planes,
    page_tokens,
    place_indices,
    torch_backup,
    torch_load,
)

# (layout, backend) pairs each pool kind serves, from the core's checks (host-pool-contract.md
# §3.2-3.4); bench kinds -> the core's pool kinds.
_CORE_KINDS = {"mha": "mha", "asym": "mha_asymmetric", "mla": "mla"}
PAIRS: dict[str, list[tuple[str, str]]] = {
    kind: _core.supported_pairs(core_kind) for kind, core_kind in _CORE_KINDS.items()
}

# Largest scratch footprint the copy yardstick cycles through (per direction).
_YARDSTICK_FOOTPRINT = 512 << 20
# How many threads the pool may put on one call, so a one-thread copy can be checked as a
# yardstick: the CPU engine splits plans from 1 MiB on across up to 8 threads
# (rust/src/cpu.rs: PARALLEL_THRESHOLD, MAX_THREADS); pre-touch uses one thread per 4 MiB, up to
# 16 (rust/src/host_mem.rs: auto_threads).
_ENGINE_SPLIT_BYTES = 1 << 20
_ENGINE_MAX_THREADS = 8
_PRETOUCH_BYTES_PER_THREAD = 4 << 20
_PRETOUCH_MAX_THREADS = 16
_HEAD_DIM = 128  # MHA bench geometries vary the KV head count at head_dim 128, bf16


@dataclass(frozen=True)
class Matrix:
    """What one bench run measures."""

    mha_item_bytes: tuple[int, ...]
    page_counts: tuple[int, ...]
    include_mla: bool = True
    include_asym: bool = True
    layers: int = 8
    page_size: int = 64
    warmup: int = 1
    repeats: int = 5
    # per-layer load calls are short; time more of them for a stable median
    load_repeats: int = 40
    alloc_repeats: int = 3
    foundation_bytes: int = 64 << 20
    # wall-clock cap of one measurement (all its repeats); at least 3 repeats are always taken
    budget_s: float = 0.25


QUICK = Matrix(mha_item_bytes=(2048,), page_counts=(1, 64), repeats=15, load_repeats=60)
FULL = Matrix(
    mha_item_bytes=(512, 2048, 8192),
    page_counts=(1, 16, 128),
    repeats=25,
    load_repeats=200,
    alloc_repeats=5,
    foundation_bytes=256 << 20,
    budget_s=1.0,
)
# Hidden, for tests on a busy CI box: every code path, a few MiB in all.
TINY = Matrix(
    mha_item_bytes=(2048,),
    page_counts=(1, 4),
    layers=2,
    page_size=16,
    warmup=1,
    repeats=2,
    load_repeats=4,
    alloc_repeats=1,
    foundation_bytes=4 << 20,
)


def bench_presets(matrix: Matrix, dtype: str = "bf16") -> list[Preset]:
    out = []
    for item in matrix.mha_item_bytes:
        heads = max(item // (_HEAD_DIM * 2), 1)
        out.append(
            Preset(
                name=f"mha-{item}",
                kind="mha",
                layers=matrix.layers,
                heads=heads,
                head_dim=_HEAD_DIM,
                v_head_dim=_HEAD_DIM,
                dtype=dtype,
            )
        )
    if matrix.include_asym:
        # MiMo-V2 full-attention geometry: K 4 x 192, V 4 x 128
        out.append(
            Preset(
                name="asym-mimo",
                kind="asym",
                layers=matrix.layers,
                heads=4,
                head_dim=192,
                v_head_dim=128,
                dtype=dtype,
            )
        )
    if matrix.include_mla:
        # DeepSeek-V3 latent: 512 + 64
        out.append(
            Preset(
                name="mla-deepseek",
                kind="mla",
                layers=matrix.layers,
                kv_lora_rank=512,
                qk_rope_head_dim=64,
                dtype=dtype,
            )
        )
    return out


# ---------------------------------------------------------------------------------------------
# Timing


class Timer:
    def __init__(self, device: str, budget_s: float = math.inf):
        import torch

        self._sync = torch.cuda.synchronize if device != "cpu" else (lambda: None)
        self.budget_s = budget_s

    def each(self, fn, calls: int, warmup: int, min_calls: int = 3) -> list[float]:
        """Seconds of each call of `fn(i)` (synchronised per call on a GPU)."""
        return self.interleaved({"fn": fn}, calls, warmup, min_calls)["fn"]

    def interleaved(
        self, fns: dict, calls: int, warmup: int, min_calls: int = 3, release=None
    ) -> dict[str, list[float]]:
        """Seconds of each call of every `fns[name](i)`, the functions taking turns call by call
        in rotating order (synchronised per call on a GPU): up to `calls` rounds, fewer (but at
        least `min_calls`) once the time budget of one measurement per function is spent, so slow
        baselines do not dominate a run while short calls still get many samples. `release`, if
        given, gets each call's return value outside the timed span (to free what it made)."""
        names = list(fns)
        for i in range(warmup):
            for name in names:
                out = fns[name](i)
                if release is not None:
                    release(out)
        self._sync()
        times: dict[str, list[float]] = {name: [] for name in names}
        clock = time.perf_counter
        spent = 0.0
        budget = self.budget_s * len(names)
        for i in range(calls):
            shift = i % len(names)
            for name in names[shift:] + names[:shift]:
                t0 = clock()
                out = fns[name](i)
                self._sync()
                dt = clock() - t0
                if release is not None:
                    release(out)
                del out
                times[name].append(dt)
                spent += dt
            if spent > budget and i + 1 >= min_calls:
                break
        return times


def pool_threads(device: str, op: str, nbytes: int) -> int:
    """The most threads the pool may use on one `op` call of `nbytes` (1 on CUDA, where one
    cudaMemcpy is the ceiling of a transfer)."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    if op == "alloc":
        return max(1, min(cpus, _PRETOUCH_MAX_THREADS, nbytes // _PRETOUCH_BYTES_PER_THREAD))
    if device != "cpu" or nbytes < _ENGINE_SPLIT_BYTES:
        return 1
    return max(1, min(cpus, _ENGINE_MAX_THREADS))


def median(xs: list[float]) -> float:
    return statistics.median(xs)


def _gbps(nbytes: int, seconds: float) -> float:
    # perf_counter resolves well below 1 ns on Linux; the floor only keeps JSON finite
    return nbytes / max(seconds, 1e-9) / 1e9


class Progress:
    """A one-line stderr bar; silent unless stderr is a terminal."""

    def __init__(self, total: int, enabled: bool):
        self.total = max(total, 1)
        self.done = 0
        self.enabled = enabled
        self.start = time.perf_counter()

    def step(self, label: str) -> None:
        self.done += 1
        if not self.enabled:
            return
        width = 28
        filled = int(width * self.done / self.total)
        elapsed = time.perf_counter() - self.start
        bar = "#" * filled + "." * (width - filled)
        sys.stderr.write(f"\r[{bar}] {self.done}/{self.total} {elapsed:5.1f}s {label[:60]:<60}")
        sys.stderr.flush()

    def close(self) -> None:
        if self.enabled:
            sys.stderr.write("\n")
            sys.stderr.flush()


# ---------------------------------------------------------------------------------------------
# Measurements


@dataclass
class Context:
    matrix: Matrix
    device: str
    timer: Timer
    deadline: float
    truncated: bool = False
    results: list[dict] = field(default_factory=list)
    foundation: list[dict] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    _scratch: dict = field(default_factory=dict)

    def out_of_time(self) -> bool:
        if time.perf_counter() > self.deadline:
            self.truncated = True
        return self.truncated

    def scratch(self, nbytes: int):
        """Two contiguous buffers of `nbytes` for the copy yardstick (backup: device -> host,
        load: host -> device), kept across cells and grown when needed."""
        import torch

        cur = self._scratch.get("n", 0)
        if cur < nbytes:
            self._scratch.clear()
            gc.collect()
            pin = self.device != "cpu"
            host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
            host.fill_(1)
            dev = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
            dev.fill_(2)
            self._scratch.update(n=nbytes, host=host, dev=dev)
        return self._scratch["host"][:nbytes], self._scratch["dev"][:nbytes]

    def _copy_buffers(self, nbytes: int, direction: str, slots: int):
        """(source, destination, slots) of a copy yardstick: the scratch buffers for `slots`
        copies of `nbytes` (capped where the footprint is far beyond any cache), oriented by
        `direction`."""
        slots = max(1, min(slots, _YARDSTICK_FOOTPRINT // max(nbytes, 1)))
        host, dev = self.scratch(nbytes * slots)
        src_all, dst_all = (dev, host) if direction == "d2h" else (host, dev)
        return src_all, dst_all, slots

    def copy_fn(self, nbytes: int, direction: str, slots: int = 1):
        """One contiguous copy of `nbytes` as `fn(i)`: memmove on this thread for a CPU run,
        cudaMemcpy (torch copy_ between pinned host memory and the GPU) for CUDA. Call i uses
        slot i % `slots` of the scratch buffers, so a yardstick for per-layer loads (which cycle
        through the layers) has the same memory footprint, and the same cache misses, as the loads
        themselves; the slot count is capped where the footprint is far beyond any cache anyway."""
        src_all, dst_all, slots = self._copy_buffers(nbytes, direction, slots)
        if self.device == "cpu":
            src_ptr, dst_ptr = src_all.data_ptr(), dst_all.data_ptr()
            memmove = ctypes.memmove

            def copy(i):
                lo = (i % slots) * nbytes
                memmove(dst_ptr + lo, src_ptr + lo, nbytes)

            return copy

        def copy_cuda(i):
            lo = (i % slots) * nbytes
            dst_all[lo : lo + nbytes].copy_(src_all[lo : lo + nbytes], non_blocking=True)

        return copy_cuda

    def nt_fn(self, nbytes: int, direction: str, slots: int = 1):
        """The same copy as `copy_fn` with streaming (non-temporal) stores on one thread
        (`_core.stream_copy`), or None on CUDA: the yardstick for a copy that skips the
        read-for-ownership pass ordinary stores pay."""
        if self.device != "cpu":
            return None
        from hostkv_rs import _core

        src_all, dst_all, slots = self._copy_buffers(nbytes, direction, slots)
        src_np, dst_np = src_all.numpy(), dst_all.numpy()

        def copy(i):
            lo = (i % slots) * nbytes
            _core.stream_copy(dst_np[lo : lo + nbytes], src_np[lo : lo + nbytes])

        return copy

    def copy_yardstick(self) -> str:
        return "one-thread memmove" if self.device == "cpu" else "cudaMemcpy (torch copy_)"


def _per_round(times: dict[str, list[float]], name: str) -> dict | None:
    """The pool's speed over yardstick `name`'s, round by round (each round times every variant
    back to back): min and median, or None without that yardstick."""
    if name not in times or not times[name]:
        return None
    ratios = sorted(y / p for p, y in zip(times["pool"], times[name]) if p > 0)
    return {"min": ratios[0], "median": median(ratios), "rounds": len(ratios)} if ratios else None


def _row(
    ctx,
    preset,
    layout,
    backend,
    op,
    pages,
    nbytes,
    secs,
    torch_secs,
    memcpy_secs,
    page_size,
    times=None,
):
    items = preset.plane_item_bytes()
    row = {
        "pool": preset.kind,
        "layout": layout,
        "backend": backend,
        "op": op,
        "item_bytes": items[0],
        "plane_item_bytes": items,
        "layers": preset.layers,
        "page_size": page_size,
        "pages": pages,
        "bytes": nbytes,
        "gbps": _gbps(nbytes, secs),
        "torch_gbps": _gbps(nbytes, torch_secs),
        "memcpy_gbps": _gbps(nbytes, memcpy_secs),
        "us_per_call": secs * 1e6,
        "torch_us_per_call": torch_secs * 1e6,
        "memcpy_us_per_call": memcpy_secs * 1e6,
        "copy_yardstick": (
            "one-thread memset of faulted memory" if op == "alloc" else ctx.copy_yardstick()
        ),
        "copy_threads": pool_threads(ctx.device, op, nbytes),
    }
    if times is not None:
        rounds = _per_round(times, "copy")
        if rounds is not None:
            row["copy_ratio_rounds"] = rounds
        nt = _per_round(times, "nt")
        if nt is not None:
            row["nt_gbps"] = _gbps(nbytes, median(times["nt"]))
            row["nt_ratio_rounds"] = nt
    row["copy_consistent"] = copy_ratio(row) is not None
    return row


def _release(obj) -> None:
    """Free what a timed creation made, outside the timed span, so only creation (mmap + page
    faults / pre-touch) is measured."""
    _destroy(obj)
    gc.collect()


def measure_alloc(ctx: Context, preset: Preset, device_pool, cls, layout: str) -> dict:
    import torch

    m = ctx.matrix
    probe = cls(device_pool, 1.0, 0, m.page_size, layout, pin_memory=True, device="cpu")
    nbytes = int(probe.size) * int(probe.size_per_token)
    host_pages = int(probe.size) // m.page_size
    _destroy(probe)
    del probe
    gc.collect()
    # ceiling: the same bytes written by one thread into memory that is already faulted in
    faulted = torch.empty(nbytes, dtype=torch.uint8)
    faulted.zero_()
    ptr = faulted.data_ptr()
    times = ctx.timer.interleaved(
        {
            "pool": lambda _i: cls(
                device_pool, 1.0, 0, m.page_size, layout, pin_memory=True, device="cpu"
            ),
            "torch": lambda _i: torch.empty(nbytes, dtype=torch.uint8).zero_(),
            "fill": lambda _i: ctypes.memset(ptr, 3, nbytes),
        },
        m.alloc_repeats,
        0,
        min_calls=1,
        release=_release,
    )
    del faulted
    return _row(
        ctx,
        preset,
        layout,
        "-",
        "alloc",
        host_pages,
        nbytes,
        median(times["pool"]),
        median(times["torch"]),
        median(times["fill"]),
        m.page_size,
    )


def measure_cell(ctx, preset, device_pool, host_pool, layout, backend, pages, rng):
    """Backup (all layers) and load (one layer per call) of `pages` random device pages."""
    import torch

    m = ctx.matrix
    P = m.page_size
    dev_pages_total = int(device_pool.size) // P
    dev_pages = torch.randperm(dev_pages_total, generator=rng)[:pages] + 1  # page 0 is padding
    host_idx = host_pool.alloc(pages * P)
    if host_idx is None:
        raise RuntimeError(f"host pool has no room for {pages} pages")
    host_idx = host_idx.clone()
    dev_idx = page_tokens(dev_pages, P)
    if backend == "direct" and layout == "layer_first":
        # the controller sorts host indices (and permutes device ones) so runs coalesce
        order = torch.argsort(host_idx)
        host_idx, dev_idx = host_idx[order], dev_idx[order]

    dplanes = device_planes(device_pool, preset.kind)
    hplanes = host_planes(host_pool, preset.kind)
    tokens = pages * P
    row_bytes = sum(preset.plane_item_bytes())
    L = preset.layers

    # backup
    h_b, d_b = place_indices(host_pool, backend, layout, "backup", host_idx, dev_idx, ctx.device)
    h_t, d_t = host_idx.cpu(), dev_idx.to(ctx.device)
    nbytes = tokens * row_bytes * L
    fns = {
        "pool": lambda _i: host_pool.backup_from_device_all_layer(device_pool, h_b, d_b, backend),
        "torch": lambda _i: torch_backup(dplanes, hplanes, layout, P, h_t, d_t),
        "copy": ctx.copy_fn(nbytes, "d2h"),
    }
    _with_nt(fns, ctx.nt_fn(nbytes, "d2h"))
    times = ctx.timer.interleaved(fns, m.repeats, m.warmup)
    ctx.results.append(
        _row(ctx, preset, layout, backend, "backup", pages, nbytes, *_medians(times), P, times)
    )

    # load, one layer per call, cycling through the layers
    h_l, d_l = place_indices(host_pool, backend, layout, "load", host_idx, dev_idx, ctx.device)
    nbytes = tokens * row_bytes
    fns = {
        "pool": lambda i: host_pool.load_to_device_per_layer(device_pool, h_l, d_l, i % L, backend),
        "torch": lambda i: torch_load(dplanes, hplanes, layout, P, h_t, d_t, i % L),
        "copy": ctx.copy_fn(nbytes, "h2d", slots=L),
    }
    _with_nt(fns, ctx.nt_fn(nbytes, "h2d", slots=L))
    times = ctx.timer.interleaved(fns, m.load_repeats, m.warmup)
    ctx.results.append(
        _row(ctx, preset, layout, backend, "load", pages, nbytes, *_medians(times), P, times)
    )
    host_pool.free(host_idx)


def _with_nt(fns: dict, nt) -> None:
    if nt is not None:
        fns["nt"] = nt


def _medians(times: dict[str, list[float]]) -> tuple[float, float, float]:
    return median(times["pool"]), median(times["torch"]), median(times["copy"])


def _foundation_gather(ctx: Context, item: int) -> dict:
    """The CPU engine gathering `item`-byte rows in random order (one layer, kernel plan) vs one
    contiguous copy of the same bytes."""
    import torch

    from hostkv_rs import _core

    m = ctx.matrix
    rows = max(m.foundation_bytes // item, 1)
    nbytes = rows * item
    gen = torch.Generator().manual_seed(item)
    src = torch.empty(nbytes, dtype=torch.uint8)
    src.random_(0, 256, generator=gen)
    dst = torch.zeros(nbytes, dtype=torch.uint8)
    core = _core.HostPool.from_geometry("layer_first", 1, rows, 1, [item], [src])
    h_idx = torch.randperm(rows, generator=gen)
    d_idx = torch.randperm(rows, generator=gen)
    h_arg = (h_idx.data_ptr(), rows, 8, False)
    d_arg = (d_idx.data_ptr(), rows, 8, False)
    dst_ptrs = [dst.data_ptr()]

    def gather(_i):
        core.load("kernel", 0, dst_ptrs, rows, h_arg, d_arg, "cpu", 0)

    # the copy goes into a buffer of its own: `dst` is checked after the timings
    copy_dst = torch.empty_like(dst).zero_()
    src_ptr, copy_ptr = src.data_ptr(), copy_dst.data_ptr()
    times = ctx.timer.interleaved(
        {"pool": gather, "copy": lambda _i: ctypes.memmove(copy_ptr, src_ptr, nbytes)},
        m.repeats,
        m.warmup,
    )
    secs, copy_secs = median(times["pool"]), median(times["copy"])
    if not dst.view(rows, item)[d_idx].equal(src.view(rows, item)[h_idx]):
        raise RuntimeError(f"CPU engine gather of {item}-byte items produced wrong bytes")
    return {
        "what": f"cpu engine gather, {size_text(item)} items",
        "item_bytes": item,
        "bytes": nbytes,
        "gbps": _gbps(nbytes, secs),
        "memcpy_gbps": _gbps(nbytes, copy_secs),
        "copy_threads": pool_threads("cpu", "load", nbytes),
        "us_per_call": secs * 1e6,
    }


def _foundation_core_calls(ctx: Context) -> list[dict]:
    """One page through `HostPool` directly, with arguments prepared once: what a one-page call
    costs without the Python pool around it. Same geometry as the MHA layer_first/kernel cells
    (first MHA item size), so the gap to their pages=1 rows is the pool's Python overhead."""
    import torch

    from hostkv_rs import _core

    m = ctx.matrix
    item, L, P = m.mha_item_bytes[0], m.layers, m.page_size
    rows = 4 * P
    host = [torch.zeros(L * rows * item, dtype=torch.uint8) for _ in range(2)]
    dev = [[torch.zeros(rows * item, dtype=torch.uint8) for _ in range(L)] for _ in range(2)]
    core = _core.HostPool.from_geometry("layer_first", L, rows, P, [item, item], host)
    h_idx = torch.arange(P, 2 * P, dtype=torch.int64)
    d_idx = torch.arange(2 * P, 3 * P, dtype=torch.int64)
    h_arg = (h_idx.data_ptr(), P, 8, False)
    d_arg = (d_idx.data_ptr(), P, 8, False)
    all_ptrs = [t.data_ptr() for plane in dev for t in plane]
    out = []
    for op in ("load", "backup"):
        if op == "load":
            ptrs = [dev[0][0].data_ptr(), dev[1][0].data_ptr()]

            def call(_i, ptrs=ptrs):
                core.load("kernel", 0, ptrs, rows, h_arg, d_arg, "cpu", 0)

            nbytes = 2 * P * item
        else:

            def call(_i):
                core.backup("kernel", all_ptrs, rows, h_arg, d_arg, "cpu", 0)

            nbytes = 2 * P * item * L
        times = ctx.timer.interleaved(
            {"pool": call, "copy": ctx.copy_fn(nbytes, "h2d" if op == "load" else "d2h")},
            m.load_repeats,
            m.warmup,
        )
        secs, copy_secs = median(times["pool"]), median(times["copy"])
        out.append(
            {
                "what": f"HostPool.{op}, 1 page, layer_first/kernel",
                "op": op,
                "item_bytes": item,
                "bytes": nbytes,
                "gbps": _gbps(nbytes, secs),
                "memcpy_gbps": _gbps(nbytes, copy_secs),
                "copy_threads": pool_threads("cpu", op, nbytes),
                "us_per_call": secs * 1e6,
            }
        )
    return out


def raw_calls_available() -> bool:
    """Whether this build has the raw HostPool.load/backup the engine rows time: the release wheel
    leaves them out (cargo feature raw-calls), and the bench then runs without those rows."""
    return hasattr(_core.HostPool, "load") and hasattr(_core.HostPool, "backup")


def measure_foundation(ctx: Context) -> None:
    """Engine-level numbers with no pool in between: gathers of 2 KiB and 128 KiB items vs one
    copy of the same bytes, and HostRegion allocation + pre-touch vs torch.empty().zero_()."""
    import torch

    from hostkv_rs import _core

    if raw_calls_available():
        for item in (2048, 128 << 10):
            ctx.foundation.append(_foundation_gather(ctx, item))
            gc.collect()
        if ctx.matrix.mha_item_bytes:
            ctx.foundation.extend(_foundation_core_calls(ctx))
    else:
        ctx.notes.append(
            "no engine gather / HostPool rows: this build has no raw HostPool.load/backup "
            "(cargo feature raw-calls; the release wheel leaves them out)"
        )
    m = ctx.matrix
    nbytes = m.foundation_bytes
    times = ctx.timer.interleaved(
        {
            "pool": lambda _i: _core.HostRegion(nbytes),
            "torch": lambda _i: torch.empty(nbytes, dtype=torch.uint8).zero_(),
        },
        m.alloc_repeats,
        0,
        min_calls=1,
        release=_release,
    )
    secs, torch_secs = median(times["pool"]), median(times["torch"])
    ctx.foundation.append(
        {
            "what": "HostRegion alloc + pre-touch",
            "item_bytes": 0,
            "bytes": nbytes,
            "gbps": _gbps(nbytes, secs),
            "torch_gbps": _gbps(nbytes, torch_secs),
            "us_per_call": secs * 1e6,
        }
    )


def _cells(matrix: Matrix, presets: list[Preset]) -> int:
    n = 0
    for p in presets:
        n += 1 + len(PAIRS[p.kind]) * len(matrix.page_counts)
    return n + 1


def memory_needed(matrix: Matrix) -> tuple[int, int]:
    """(device bytes, host bytes) the largest preset of `matrix` holds at once: its device pool
    (with the padding page) and the copy yardstick's device buffer; two host pools' worth (ratio
    1: tokens // page_size + 1 pages, SGLang's rule; the allocation timing holds a faulted buffer
    of that size while it builds the next pool) and the yardstick's host buffer."""
    per_token = max(p.bytes_per_token() for p in bench_presets(matrix))
    page, tokens = matrix.page_size, max(matrix.page_counts) * matrix.page_size
    moved = tokens * per_token
    device = (tokens + page) * per_token + moved
    host = 2 * (tokens // page + 1) * page * per_token + moved
    return device, host


def check_memory(matrix: Matrix, device: str) -> None:
    """Refuse, before anything is allocated, a matrix this machine cannot hold: otherwise torch's
    allocator fails deep inside a device pool, or the machine swaps until the OOM killer ends
    the process, instead of an error that says what was asked for and what there is."""
    from hostkv_rs.tools.demo import refuse_unless_memory_fits

    dev, host = memory_needed(matrix)
    refuse_unless_memory_fits(
        device,
        dev,
        host,
        for_what=" for the benchmark",
        device_side="its device side",
        host_side="its host side",
        host_verb="needs",
        hint="; lower --layers or --page-size, or pick a smaller matrix (--quick, --tiny)",
    )


def run(matrix: Matrix, *, device: str, max_seconds: float, progress: bool, seed: int = 0) -> dict:
    import torch

    check_memory(matrix, device)
    presets = bench_presets(matrix)
    load1 = os.getloadavg()[0]
    cpus = os.cpu_count() or 1
    if load1 > 0.5 * cpus:
        # torch's OpenMP workers then wait for a scheduler tick per parallel region (4-8 ms),
        # which makes the torch and copy yardsticks, not the pool, look slow
        print(
            f"warning: this machine is busy (load average {load1:.1f} on {cpus} CPUs); "
            "the numbers will be noisy, torch's multi-threaded ops most of all",
            file=sys.stderr,
        )
    ctx = Context(
        matrix=matrix,
        device=device,
        timer=Timer(device, matrix.budget_s),
        deadline=time.perf_counter() + max_seconds,
    )
    bar = Progress(_cells(matrix, presets), progress)
    rng = torch.Generator().manual_seed(seed)
    device_pages = max(matrix.page_counts)
    try:
        for preset in presets:
            if ctx.out_of_time():
                break
            device_pool = build_device_pool(
                preset, device_pages * matrix.page_size, matrix.page_size, device
            )
            first_layout = PAIRS[preset.kind][0][0]
            cls = host_pool_class(device_pool, preset.kind)
            ctx.results.append(measure_alloc(ctx, preset, device_pool, cls, first_layout))
            bar.step(f"{preset.name} alloc")
            for layout in dict.fromkeys(lay for lay, _ in PAIRS[preset.kind]):
                if ctx.out_of_time():
                    break
                host_pool = cls(
                    device_pool, 1.0, 0, matrix.page_size, layout, pin_memory=True, device="cpu"
                )
                for lay, backend in PAIRS[preset.kind]:
                    if lay != layout:
                        continue
                    for pages in matrix.page_counts:
                        if ctx.out_of_time():
                            break
                        measure_cell(
                            ctx, preset, device_pool, host_pool, layout, backend, pages, rng
                        )
                        bar.step(f"{preset.name} {layout}/{backend} x{pages}")
                _destroy(host_pool)
                del host_pool
                gc.collect()
            del device_pool
            gc.collect()
        if not ctx.out_of_time() and device == "cpu":
            measure_foundation(ctx)
            bar.step("foundation")
    finally:
        bar.close()
    return {
        "tool": "hostkv-rs bench",
        "date": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "device": device,
        "machine": machine_info(),
        "matrix": {
            "layers": matrix.layers,
            "page_size": matrix.page_size,
            "mha_item_bytes": list(matrix.mha_item_bytes),
            "page_counts": list(matrix.page_counts),
            "repeats": matrix.repeats,
            "load_repeats": matrix.load_repeats,
        },
        "loadavg_after": [round(x, 2) for x in os.getloadavg()],
        "truncated": ctx.truncated,
        "results": ctx.results,
        "foundation": ctx.foundation,
        "notes": ctx.notes,
    }


_ROW_KEY = ("pool", "layout", "backend", "op", "item_bytes", "pages")
_FOUNDATION_KEY = ("what",)


def _best_rows(runs: list[list[dict]], key: tuple[str, ...]) -> list[dict]:
    """Rows of several runs merged by `key`, each measurement at its best run: the highest GB/s
    and the lowest time per call (order of the first run). Other work on the machine only ever
    adds time, so the best of several medians is the closest to an undisturbed one."""
    merged: dict[tuple, list[dict]] = {}
    for rows in runs:
        for row in rows:
            merged.setdefault(tuple(row[k] for k in key), []).append(row)
    out = []
    for group in merged.values():
        row = dict(group[0])
        for name, value in group[0].items():
            if isinstance(value, float):
                pick = max if name.endswith("gbps") else min
                row[name] = pick(g[name] for g in group)
        row["runs"] = len(group)
        out.append(row)
    return out


def run_many(matrix: Matrix, runs: int, **kwargs) -> dict:
    """`runs` complete runs of the matrix, merged with `_best_rows` (a burst of other work on a
    shared machine then spoils one run's sample of a row, not the table)."""
    reports = [run(matrix, **kwargs) for _ in range(max(runs, 1))]
    if len(reports) == 1:
        return reports[0]
    out = dict(reports[-1])
    out["machine"] = reports[0]["machine"]
    out["runs"] = len(reports)
    out["truncated"] = any(r["truncated"] for r in reports)
    out["results"] = _best_rows([r["results"] for r in reports], _ROW_KEY)
    out["foundation"] = _best_rows([r["foundation"] for r in reports], _FOUNDATION_KEY)
    for row in out["results"]:  # the best copy and the best pool may come from other runs
        row["copy_consistent"] = copy_ratio(row) is not None
    return out


def _destroy(pool) -> None:
    destroy = getattr(pool, "destroy", None)
    if destroy is not None:
        destroy()


def machine_info() -> dict:
    import torch

    info = {
        # other work on the machine skews every number; the load average says how busy it was
        "loadavg": [round(x, 2) for x in os.getloadavg()],
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
    }
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    with contextlib.suppress(Exception):
        from hostkv_rs import _core

        info["core"] = _core.runtime_info()
    return info
