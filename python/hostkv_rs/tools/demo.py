"""`hostkv-rs demo`: one HiCache round trip, checked byte for byte.

Random device pages are backed up to a fresh host pool (all layers in one call), the device pool is
wiped, and every layer is loaded back into *different* device pages, one call per layer, as the
controller does. Then three checks:

* the host bytes sit where the contract's buffer shapes say (plain torch indexing of the host views),
  and nothing else in the host pool was written;
* the reloaded device rows equal the original rows;
* no device row outside the load targets was written.
"""

from __future__ import annotations

import math
import sys
import time
from dataclasses import dataclass

from hostkv_rs.tools import torch_baseline
from hostkv_rs.tools.presets import Preset, build_device_pool, host_pool_class


@dataclass
class DemoConfig:
    preset: Preset
    page_size: int
    pages: int
    layout: str
    backend: str
    device: str
    host_ratio: float = 2.0
    seed: int = 0
    # appended to the device-pool line, e.g. to say the page count is a small demo default
    size_note: str = ""
    # --l3 mooncake: also round-trip the backed-up pages through a Mooncake Store (hostkv_rs.l3);
    # l3_master None starts a loopback master for the demo
    l3: str | None = None
    l3_master: str | None = None
    l3_metadata: str | None = None


@dataclass
class DemoResult:
    lines: list[str]
    mismatches: int
    backup_bytes: int
    load_bytes: int
    backup_gbps: float
    load_gbps: float

    @property
    def ok(self) -> bool:
        return self.mismatches == 0


def demo_bytes(cfg: DemoConfig) -> tuple[int, int]:
    """(device pool bytes, host pool bytes) the demo will allocate, as the pools size themselves:
    the device pool has `pages` usable pages plus the padding page; each host pool holds
    int(device tokens x ratio) // page_size + 1 pages (SGLang's rule). --l3 builds a second host
    pool (the loading server's)."""
    p, P = cfg.preset, cfg.page_size
    per_token = p.bytes_per_token()
    device = (cfg.pages + 1) * P * per_token
    host_pools = 2 if cfg.l3 else 1
    host = host_pages(cfg) * P * per_token * host_pools
    return device, host


def host_pages(cfg: DemoConfig) -> int:
    """Pages of each host pool: int(device tokens x ratio) // page_size + 1 (SGLang's rule)."""
    tokens = cfg.pages * cfg.page_size * cfg.host_ratio
    if not math.isfinite(tokens):
        raise ValueError(
            f"--host-ratio {cfg.host_ratio:g} sizes the host pool past any memory "
            f"({cfg.pages} pages of {cfg.page_size} tokens x {cfg.host_ratio:g})"
        )
    return int(tokens) // cfg.page_size + 1


def source_pages(cfg: DemoConfig) -> int:
    """Device pages the demo backs up: half of them (one when there is one); the host pool
    takes two pages per source page (it backs up into a random half)."""
    return max(cfg.pages // 2, 1)


def gb_text(n: int) -> str:
    return f"{n / 1e9:.2f} GB ({n:,} bytes)"


def available_memory() -> tuple[int, str]:
    """(bytes this process can allocate now, where that figure comes from): the host pools' own
    measure where the package has one (it also counts a container's memory cgroup), else
    psutil's available memory."""
    from hostkv_rs.pools import memory as _memory

    measure = getattr(_memory, "available_host_memory", None)
    if measure is not None:
        memory = measure()
        return int(memory.available), str(memory.source)
    import psutil

    return int(psutil.virtual_memory().available), "psutil's available memory"


def check_memory(cfg: DemoConfig) -> None:
    """Refuse, before anything is allocated, a demo this machine cannot hold: otherwise torch's
    allocator fails deep inside the device pool (or the OOM killer ends the process) instead of
    an error that says what was asked for and what there is."""
    device, host = demo_bytes(cfg)
    room, wanted = host_pages(cfg), 2 * source_pages(cfg)
    if room < wanted:
        raise ValueError(
            f"--host-ratio {cfg.host_ratio:g} gives the host pool {room} pages, fewer than the "
            f"{wanted} the demo backs up into; raise --host-ratio"
        )
    one = not cfg.l3
    refuse_unless_memory_fits(
        cfg.device,
        device,
        host,
        for_what="",
        device_side="the device pool",
        host_side="the host pool" if one else "the host pools",
        host_verb="needs" if one else "need",
        hint="; lower --pages, --page-size, --layers or --host-ratio",
    )


def refuse_unless_memory_fits(
    device: str,
    device_bytes: int,
    host_bytes: int,
    *,
    for_what: str,
    device_side: str,
    host_side: str,
    host_verb: str,
    hint: str,
) -> None:
    """ValueError naming the sizes unless `device_bytes` fit the device (on cpu: with the host
    side, in host memory) and `host_bytes` plus SGLang's HiCache reserve fit host memory; the
    demo's and the benchmark's check before they allocate."""
    from hostkv_rs.sglang.budgets import HICACHE_HOST_MEMORY_RESERVE_BYTES as reserve

    available, source = available_memory()
    keeps = (
        f"the host pool's memory check keeps {reserve / 2**30:.0f} GiB ({reserve:,} bytes, "
        "SGLang's HiCache reserve)"
    )
    if device == "cpu":
        if device_bytes + host_bytes + reserve > available:
            raise ValueError(
                f"not enough memory{for_what}: {device_side} (on cpu) needs "
                f"{gb_text(device_bytes)} and {host_side} {gb_text(host_bytes)}, but "
                f"{gb_text(available)} is available ({source}), and {keeps} out of what "
                f"{device_side} leaves{hint}"
            )
        return
    import torch

    free, _total = torch.cuda.mem_get_info()
    if device_bytes > free:
        raise ValueError(
            f"not enough GPU memory{for_what}: {device_side} needs {gb_text(device_bytes)}, but "
            f"torch.cuda.mem_get_info() reports {gb_text(free)} free{hint}"
        )
    if host_bytes + reserve > available:
        raise ValueError(
            f"not enough host memory{for_what}: {host_side} {host_verb} {gb_text(host_bytes)}, "
            f"but {gb_text(available)} is available ({source}), and {keeps} out of it{hint}"
        )


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB"


def _sync(device: str) -> None:
    if device != "cpu":
        import torch

        torch.cuda.synchronize()


def _u8_rows(t):
    """Byte view `(rows, bytes_per_row)` of a tensor whose first dim is rows."""
    import torch

    return t.reshape(t.shape[0], -1).view(torch.uint8)


def _choose_pages(cfg: DemoConfig, gen):
    """Source and target device pages (1-based: page 0 is the device pool's padding page), as many
    as fit disjointly; with a single page the target is the source page."""
    import torch

    n = source_pages(cfg)
    order = torch.randperm(cfg.pages, generator=gen) + 1
    src = order[:n]
    dst = order[n : 2 * n] if cfg.pages >= 2 else src.clone()
    return src, dst


def run_demo(cfg: DemoConfig, out=None) -> DemoResult:
    import torch

    out = out or sys.stdout
    p = cfg.preset
    P = cfg.page_size
    if cfg.pages < 1:
        raise ValueError(f"--pages must be >= 1, got {cfg.pages}")
    if P < 1:
        raise ValueError(f"--page-size must be >= 1, got {P}")
    gen = torch.Generator().manual_seed(cfg.seed)
    lines: list[str] = []

    def say(s: str) -> None:
        lines.append(s)
        print(s, file=out, flush=True)

    check_memory(cfg)
    if cfg.l3 == "mooncake":
        from hostkv_rs.l3.demo import preflight

        preflight(cfg.l3_master, cfg.l3_metadata)
    say(f"hostkv-rs demo: {p.name} ({p.describe()}) on {cfg.device}")
    device_pool = build_device_pool(p, cfg.pages * P, P, cfg.device)
    dplanes = torch_baseline.device_planes(device_pool, p.kind)
    for i, layers in enumerate(dplanes):
        dgen = torch.Generator(device=cfg.device).manual_seed((cfg.seed * 31 + i) % 2**64)
        for t in layers:
            t.view(torch.uint8).random_(0, 256, generator=dgen)
    items = p.plane_item_bytes()
    device_bytes = sum(t.numel() * t.element_size() for layers in dplanes for t in layers)
    say(
        f"  device pool : {cfg.pages} pages x {P} tokens (+1 padding page), "
        f"{' + '.join(map(str, items))} B/token/layer, {_mib(device_bytes)}{cfg.size_note}"
    )

    cls = host_pool_class(device_pool, p.kind)
    t0 = time.perf_counter()
    host_pool = cls(device_pool, cfg.host_ratio, 0, P, cfg.layout, pin_memory=True, device="cpu")
    alloc_s = time.perf_counter() - t0
    host_bytes = int(host_pool.size) * int(host_pool.size_per_token)
    say(
        f"  host pool   : {cls.__name__}, layout {cfg.layout}, {int(host_pool.size)} tokens, "
        f"{_mib(host_bytes)}, created (incl. pre-touch) in {alloc_s * 1e3:.1f} ms"
    )

    src_pages, dst_pages = _choose_pages(cfg, gen)
    n = len(src_pages)
    slots = host_pool.alloc(2 * n * P)
    if slots is None:
        raise RuntimeError(f"host pool has no room for {2 * n} pages")
    host_pages = slots.clone().view(-1, P)[torch.randperm(2 * n, generator=gen)[:n]]
    host_idx = host_pages.reshape(-1)
    src_idx = torch_baseline.page_tokens(src_pages, P)
    dst_idx = torch_baseline.page_tokens(dst_pages, P)
    if cfg.backend == "direct" and cfg.layout == "layer_first":
        # the controller sorts host indices (device indices follow) so runs coalesce
        order = torch.argsort(host_idx)
        host_idx, src_idx, dst_idx = host_idx[order], src_idx[order], dst_idx[order]

    expected = [
        [_u8_rows(layer)[src_idx.to(layer.device)].clone() for layer in pl] for pl in dplanes
    ]
    tokens = n * P
    moved = tokens * sum(items) * p.layers

    h_b, d_b = torch_baseline.place_indices(
        host_pool, cfg.backend, cfg.layout, "backup", host_idx, src_idx, cfg.device
    )
    _sync(cfg.device)
    t0 = time.perf_counter()
    host_pool.backup_from_device_all_layer(device_pool, h_b, d_b, cfg.backend)
    _sync(cfg.device)
    backup_s = time.perf_counter() - t0
    say(
        f"  backup      : {n} pages ({tokens} tokens) x {p.layers} layers, {_mib(moved)} in "
        f"{backup_s * 1e3:.2f} ms = {moved / backup_s / 1e9:.2f} GB/s ({cfg.backend})"
    )

    host_bad, host_stray = _check_host(host_pool, p.kind, cfg.layout, P, host_idx, expected)

    for layers in dplanes:
        for t in layers:
            t.zero_()
    h_l, d_l = torch_baseline.place_indices(
        host_pool, cfg.backend, cfg.layout, "load", host_idx, dst_idx, cfg.device
    )
    _sync(cfg.device)
    t0 = time.perf_counter()
    for layer in range(p.layers):
        host_pool.load_to_device_per_layer(device_pool, h_l, d_l, layer, cfg.backend)
    _sync(cfg.device)
    load_s = time.perf_counter() - t0
    say(
        f"  load        : into {n} other device pages, {p.layers} per-layer calls, {_mib(moved)} in "
        f"{load_s * 1e3:.2f} ms = {moved / load_s / 1e9:.2f} GB/s "
        f"({load_s / p.layers * 1e6:.1f} us per call)"
    )

    say(
        "  note        : these GB/s are one cold call each on a few pages (no warmup: the "
        "engine's first use, cold caches and per-call overhead weigh on so few bytes); "
        "`hostkv-rs bench` reports warmed-up medians of many calls, so expect more there"
    )
    dev_bad, dev_stray = _check_device(dplanes, dst_idx, expected)
    say(
        f"  verify host : {_verdict(host_bad, moved)} at the {cfg.layout} offsets; "
        f"{host_stray} stray bytes elsewhere"
    )
    say(
        f"  verify load : {_verdict(dev_bad, moved)} in the target rows; "
        f"{dev_stray} stray bytes elsewhere"
    )
    mismatches = host_bad + host_stray + dev_bad + dev_stray
    if cfg.l3 == "mooncake":  # --l3 mooncake (hostkv_rs.l3.demo)
        from hostkv_rs.l3.demo import round_trip

        mismatches += round_trip(
            host_pool,
            host_idx,
            lambda: cls(
                device_pool, cfg.host_ratio, 0, P, cfg.layout, pin_memory=True, device="cpu"
            ),
            say,
            master=cfg.l3_master,
            metadata=cfg.l3_metadata,
        )
    say(
        "  result      : verified OK"
        if mismatches == 0
        else f"  result      : MISMATCH ({mismatches} bad bytes)"
    )
    host_pool.free(slots)
    destroy = getattr(host_pool, "destroy", None)
    if destroy is not None:
        destroy()
    return DemoResult(lines, mismatches, moved, moved, moved / backup_s / 1e9, moved / load_s / 1e9)


def _verdict(bad: int, total: int) -> str:
    return f"{total} bytes match" if bad == 0 else f"{bad} of {total} bytes DIFFER"


def _check_host(host_pool, kind, layout, page_size, host_idx, expected) -> tuple[int, int]:
    """(differing bytes at the expected host offsets, non-zero bytes anywhere else)."""
    import torch

    hplanes = torch_baseline.host_planes(host_pool, kind)
    hi = torch_baseline.host_index(layout, host_idx, page_size)
    bad = stray = 0
    for plane, exp_layers in zip(hplanes, expected, strict=True):
        scratch = plane.clone()
        for layer, exp in enumerate(exp_layers):
            view = torch_baseline.host_layer_view(scratch, layout, layer)
            got = _u8_rows(view[hi].contiguous())
            bad += int((got != exp.cpu()).sum())
            view[hi] = torch.zeros((), dtype=view.dtype)
        stray += int(scratch.view(-1).view(torch.uint8).count_nonzero())
    return bad, stray


def _check_device(dplanes, dst_idx, expected) -> tuple[int, int]:
    """(differing bytes in the load targets, non-zero bytes outside them)."""
    import torch

    bad = stray = 0
    for layers, exp_layers in zip(dplanes, expected, strict=True):
        for layer, exp in zip(layers, exp_layers, strict=True):
            idx = dst_idx.to(layer.device)
            rows = _u8_rows(layer)
            bad += int((rows[idx] != exp).sum())
            mask = torch.ones(rows.shape[0], dtype=torch.bool, device=layer.device)
            mask[idx] = False
            stray += int(rows[mask].count_nonzero())
    return bad, stray
