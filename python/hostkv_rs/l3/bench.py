"""Put / get GB/s through a Mooncake Store on loopback against a plain copy of the same bytes.

    python -m hostkv_rs.l3.bench [--pages 32] [--repeats 3] [--layers 32] [--page-size 64]
                                 [--digest on|off|both]

Starts its own `mooncake_master` on loopback (twice) and measures, per pool layout:

* `put` / `get`: `MooncakeTier.save` / `load` of fresh keys, every check included (existence and
  size queries, one object per page, the proof header's digests), between two host pools;
* `memcpy`: the same page buffers copied pool to pool with one memmove each (what moving the same
  bytes costs without a store);
* `copy_`: one contiguous `torch.Tensor.copy_` of the same byte count (this machine's ceiling);
* `digest`: `hostkv_rs._core.digest` over the same page buffers on one thread (the pass over the
  bytes that the proof adds to every put and get).

Two placements of the store's memory: `in-process` (the saving client holds the store segment:
Mooncake copies with memcpy) and `other process` (a separate storage process holds it and both
clients contribute none: every byte crosses loopback TCP). Best of `--repeats`.

`--digest both` measures every put and get with the proof (`on`: digests computed on save and
verified on load) and without it (`off`: `MooncakeTier(digests=False)`, pages stored bare), in
the same run, alternating which goes first from repeat to repeat, and prints them side by side
with the cost of the proof in percent.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import subprocess
import sys
import time
import uuid

import torch


def _pools(kind: str, layout: str, layers: int, page: int, pages: int):
    from hostkv_rs import (
        MHATokenToKVPool,
        MLATokenToKVPool,
        MLATokenToKVPoolHost,
        get_mha_host_pool_cls,
    )

    def one():
        if kind == "mha":
            dev = MHATokenToKVPool(page, page, torch.bfloat16, 8, 128, layers)
            return get_mha_host_pool_cls(dev)(
                dev, 0, 0, page, layout, host_token_capacity=pages * page
            )
        dev = MLATokenToKVPool(page, page, torch.bfloat16, 512, 64, layers)
        return MLATokenToKVPoolHost(dev, 0, 0, page, layout, host_token_capacity=pages * page)

    return one(), one()


def _spans(pool, slots):
    ptrs, sizes = pool.get_page_buffer_meta(slots)
    return list(zip(ptrs, sizes))


def _check_same(src, dst, slots, what: str) -> None:
    for (a, n), (b, _) in zip(_spans(src, slots), _spans(dst, slots)):
        if ctypes.string_at(a, n) != ctypes.string_at(b, n):
            raise RuntimeError(f"{what}: the loaded bytes differ")
    for b, n in _spans(dst, slots):  # wipe for the next load
        ctypes.memset(b, 0, n)


def _best(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


BENCH_MODEL_ID = "hostkv-rs l3 bench (random bytes)"
MODES = {"on": (True,), "off": (False,), "both": (False, True)}


def _measure(saver, loader, kind, layout, args) -> list[dict]:
    from hostkv_rs.l3 import MooncakeTier

    src, dst = _pools(kind, layout, args.layers, args.page_size, args.pages)
    modes = MODES[args.digest]

    def tier(client, digests):
        return MooncakeTier(
            client.store,
            master=client.master,
            model_id=BENCH_MODEL_ID,
            digests=digests,
            tp_rank=0,
            tp_size=1,
        )

    # per mode: the saver, the loader (another client), the saving client reading back
    tiers = {d: (tier(saver, d), tier(loader, d), tier(saver, d)) for d in modes}
    slots = torch.arange(args.pages * args.page_size)
    for address, nbytes in ((r.address, r.nbytes) for r in src._host_regions):
        t = torch.frombuffer((ctypes.c_char * nbytes).from_address(address), dtype=torch.uint8)
        t.random_(0, 256, generator=torch.Generator().manual_seed(1))
    fmt = None
    best = {d: {"put": float("inf"), "get": float("inf"), "get_own": float("inf")} for d in modes}
    try:
        for repeat in range(args.repeats):
            # alternate which mode goes first: a busy machine's drift then hits both alike
            for digests in modes if repeat % 2 == 0 else modes[::-1]:
                put_tier, get_tier, own = tiers[digests]
                fmt = put_tier.attach(src)
                get_tier.attach(dst)
                times = best[digests]
                keys = [uuid.uuid4().hex for _ in range(args.pages)]
                t0 = time.perf_counter()
                saved = put_tier.save(keys, slots)
                times["put"] = min(times["put"], time.perf_counter() - t0)
                t0 = time.perf_counter()
                loaded = get_tier.load(keys, slots)
                times["get"] = min(times["get"], time.perf_counter() - t0)
                what = f"{kind} {layout} (digests {'on' if digests else 'off'})"
                if not (all(r.status.value == "stored" for r in saved) and all(loaded)):
                    raise RuntimeError(f"{what}: saved {saved[:3]}..., loaded {loaded[:3]}...")
                _check_same(src, dst, slots, what)
                get_tier.detach()
                own.attach(dst)
                t0 = time.perf_counter()
                loaded = own.load(keys, slots)
                times["get_own"] = min(times["get_own"], time.perf_counter() - t0)
                if not all(loaded):
                    raise RuntimeError(f"{what}: loaded {loaded[:3]}... (same client)")
                _check_same(src, dst, slots, f"{what} (same client)")
                own.detach()
                put_tier.remove(keys, force=True)
                put_tier.detach()
        pairs = list(zip(_spans(src, slots), _spans(dst, slots)))
        nbytes = args.pages * fmt.page_bytes

        def memcpy():
            for (a, n), (b, _) in pairs:
                ctypes.memmove(b, a, n)

        from hostkv_rs.l3 import proof
        from hostkv_rs.l3.format import _host_allocations

        memory = proof.PoolBytes(_host_allocations(src))
        ptrs, sizes = src.get_page_buffer_meta(slots)
        per = fmt.buffers_per_page
        pages = [(ptrs[i : i + per], sizes[i : i + per]) for i in range(0, len(ptrs), per)]

        def digest():  # what the proof adds: one hash pass over the same bytes, one thread
            for page in pages:
                proof.page_digest(memory, page, "bench")

        flat_src = torch.empty(nbytes, dtype=torch.uint8).random_(0, 256)
        flat_dst = torch.empty(nbytes, dtype=torch.uint8).zero_()
        copy = _best(lambda: flat_dst.copy_(flat_src), args.repeats)
        plain = _best(memcpy, args.repeats)
        hashing = _best(digest, args.repeats)
    finally:
        for group in tiers.values():
            for t in group:
                t.detach()
        src.destroy()
        dst.destroy()

    def gbps(seconds: float) -> float:
        return round(nbytes / seconds / 1e9, 2)

    return [
        {
            "pool": f"{kind.upper()} {layout}",
            "digest": "on" if digests else "off",
            "page_mib": round(fmt.page_bytes / (1 << 20), 2),
            "buffers_per_page": fmt.buffers_per_page,
            "pages": args.pages,
            "put_gbps": gbps(best[digests]["put"]),
            "get_gbps": gbps(best[digests]["get"]),
            "get_own_gbps": gbps(best[digests]["get_own"]),
            "memcpy_gbps": gbps(plain),
            "copy_gbps": gbps(copy),
            "digest_gbps": gbps(hashing),
        }
        for digests in modes
    ]


CASES = [
    ("mha", "page_first"),
    ("mha", "page_first_direct"),
    ("mha", "layer_first"),
    ("mla", "page_first"),
]


def _serve(master: str, metadata: str, segment: int) -> None:
    """The storage process: hold `segment` bytes of store memory until stdin closes."""
    from hostkv_rs.l3 import MooncakeTier

    tier = MooncakeTier.connect(master, metadata, global_segment_size=segment)
    print("ready", flush=True)
    sys.stdin.read()
    del tier
    os._exit(0)  # skip the client's teardown: the master is about to go


def run(args) -> list[dict]:
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
    from hostkv_rs.l3 import MooncakeTier
    from hostkv_rs.l3.master import LoopbackMaster

    rows = []
    need = 4 * args.pages * args.layers * args.page_size * 8 * 128 * 2 + (256 << 20)
    if args.overlap_mib is not None:
        from hostkv_rs.l3 import mooncake

        mooncake.OVERLAP_BYTES = int(args.overlap_mib * (1 << 20))
    for placement in ("in-process", "other process"):
        with LoopbackMaster.start() as m:
            server = None
            if placement == "other process":
                server = subprocess.Popen(
                    [
                        sys.executable,
                        "-m",
                        "hostkv_rs.l3.bench",
                        "--serve",
                        m.address,
                        m.metadata_server,
                        str(need),
                    ],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    text=True,
                )
                if server.stdout.readline().strip() != "ready":
                    raise RuntimeError("the storage process did not come up")
                saver = MooncakeTier.connect(m.address, m.metadata_server, global_segment_size=0)
            else:
                saver = MooncakeTier.connect(m.address, m.metadata_server, global_segment_size=need)
            loader = MooncakeTier.connect(m.address, m.metadata_server, global_segment_size=0)
            try:
                for kind, layout in CASES:
                    for row in _measure(saver, loader, kind, layout, args):
                        row["store"] = placement
                        rows.append(row)
                        print(json.dumps(row), file=sys.stderr, flush=True)
            finally:
                saver.close()
                loader.close()
                if server is not None:
                    server.stdin.close()
                    server.wait(timeout=30)
    return rows


def markdown(rows: list[dict]) -> str:
    if {r["digest"] for r in rows} == {"on", "off"}:
        return _markdown_side_by_side(rows)
    lines = [
        (
            "| store memory | pool | digest | page | buffers/page | pages | put GB/s | get GB/s "
            "| get GB/s, saving client | memcpy GB/s | copy_ GB/s | digest GB/s |"
        ),
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['store']} | {r['pool']} | {r['digest']} | {r['page_mib']} MiB | "
            f"{r['buffers_per_page']} | {r['pages']} | {r['put_gbps']} | {r['get_gbps']} | "
            f"{r['get_own_gbps']} | {r['memcpy_gbps']} | {r['copy_gbps']} | {r['digest_gbps']} |"
        )
    return "\n".join(lines)


def _cost(off: float, on: float) -> str:
    """How much longer the same bytes took with the proof, in percent."""
    return f"{(off / on - 1) * 100:+.0f}%"


def _markdown_side_by_side(rows: list[dict]) -> str:
    lines = [
        (
            "| store memory | pool | page | put GB/s off / on | cost | get GB/s off / on | cost "
            "| get GB/s, saving client, off / on | cost | memcpy GB/s | digest GB/s |"
        ),
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    by = {(r["store"], r["pool"], r["digest"]): r for r in rows}
    for store, pool in dict.fromkeys((r["store"], r["pool"]) for r in rows):
        off, on = by[(store, pool, "off")], by[(store, pool, "on")]
        cells = []
        for k in ("put_gbps", "get_gbps", "get_own_gbps"):
            cells.append(f"{off[k]} / {on[k]} | {_cost(off[k], on[k])}")
        lines.append(
            f"| {store} | {pool} | {on['page_mib']} MiB | "
            + " | ".join(cells)
            + f" | {on['memcpy_gbps']} | {on['digest_gbps']} |"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m hostkv_rs.l3.bench",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--pages", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--page-size", type=int, default=64)
    parser.add_argument(
        "--digest",
        choices=sorted(MODES),
        default="on",
        help="with the page proof (on, the tier's default), without (off), or both interleaved",
    )
    parser.add_argument(
        "--overlap-mib",
        type=float,
        default=None,
        help="bytes (MiB) the tier moves per store call while it hashes the next ones "
        "(default: the tier's own)",
    )
    parser.add_argument("--json", action="store_true", help="print JSON rows instead of Markdown")
    parser.add_argument(
        "--serve", nargs=3, metavar=("MASTER", "METADATA", "BYTES"), help=argparse.SUPPRESS
    )
    args = parser.parse_args(argv)
    if args.serve:
        _serve(args.serve[0], args.serve[1], int(args.serve[2]))
        return 0
    rows = run(args)
    print(json.dumps(rows, indent=1) if args.json else markdown(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
