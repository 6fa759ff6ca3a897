"""Put / get GB/s through a Mooncake Store on loopback against a plain copy of the same bytes.

    python -m hostkv_rs.l3.bench [--pages 32] [--repeats 3] [--layers 32] [--page-size 64]

Starts its own `mooncake_master` on loopback (twice) and measures, per pool layout:

* `put` / `get`: `MooncakeTier.save` / `load` of fresh keys, every check included (existence and
  size queries, one object per page), between two host pools;
* `memcpy`: the same page buffers copied pool to pool with one memmove each (what moving the same
  bytes costs without a store);
* `copy_`: one contiguous `torch.Tensor.copy_` of the same byte count (this machine's ceiling).

Two placements of the store's memory: `in-process` (the saving client holds the store segment:
Mooncake copies with memcpy) and `other process` (a separate storage process holds it and both
clients contribute none: every byte crosses loopback TCP). Best of `--repeats`.
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


def _measure(saver, loader, kind, layout, args) -> dict:
    from hostkv_rs.l3 import MooncakeTier

    src, dst = _pools(kind, layout, args.layers, args.page_size, args.pages)
    own = MooncakeTier(saver.store, master=saver.master)  # the saving client reads it back
    slots = torch.arange(args.pages * args.page_size)
    for address, nbytes in ((r.address, r.nbytes) for r in src._host_regions):
        t = torch.frombuffer((ctypes.c_char * nbytes).from_address(address), dtype=torch.uint8)
        t.random_(0, 256, generator=torch.Generator().manual_seed(1))
    saver.attach(src)
    loader.attach(dst)
    fmt = saver.format
    nbytes = args.pages * fmt.page_bytes
    put = get = get_own = float("inf")
    try:
        for _ in range(args.repeats):
            keys = [uuid.uuid4().hex for _ in range(args.pages)]
            t0 = time.perf_counter()
            saved = saver.save(keys, slots)
            put = min(put, time.perf_counter() - t0)
            t0 = time.perf_counter()
            loaded = loader.load(keys, slots)
            get = min(get, time.perf_counter() - t0)
            if not (all(r.status.value == "stored" for r in saved) and all(loaded)):
                raise RuntimeError(f"{kind} {layout}: saved {saved[:3]}..., loaded {loaded[:3]}...")
            _check_same(src, dst, slots, f"{kind} {layout}")
            loader.detach()
            own.attach(dst)
            t0 = time.perf_counter()
            loaded = own.load(keys, slots)
            get_own = min(get_own, time.perf_counter() - t0)
            if not all(loaded):
                raise RuntimeError(f"{kind} {layout}: loaded {loaded[:3]}... (same client)")
            _check_same(src, dst, slots, f"{kind} {layout} (same client)")
            own.detach()
            loader.attach(dst)
            saver.remove(keys, force=True)
        pairs = list(zip(_spans(src, slots), _spans(dst, slots)))

        def memcpy():
            for (a, n), (b, _) in pairs:
                ctypes.memmove(b, a, n)

        flat_src = torch.empty(nbytes, dtype=torch.uint8).random_(0, 256)
        flat_dst = torch.empty(nbytes, dtype=torch.uint8).zero_()
        copy = _best(lambda: flat_dst.copy_(flat_src), args.repeats)
        plain = _best(memcpy, args.repeats)
    finally:
        saver.detach()
        loader.detach()
        own.detach()
        src.destroy()
        dst.destroy()

    def gbps(seconds: float) -> float:
        return round(nbytes / seconds / 1e9, 2)

    return {
        "pool": f"{kind.upper()} {layout}",
        "page_mib": round(fmt.page_bytes / (1 << 20), 2),
        "buffers_per_page": fmt.buffers_per_page,
        "pages": args.pages,
        "put_gbps": gbps(put),
        "get_gbps": gbps(get),
        "get_own_gbps": gbps(get_own),
        "memcpy_gbps": gbps(plain),
        "copy_gbps": gbps(copy),
    }


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
                    row = _measure(saver, loader, kind, layout, args)
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
    lines = [
        (
            "| store memory | pool | page | buffers/page | pages | put GB/s | get GB/s "
            "| get GB/s, saving client | memcpy GB/s | copy_ GB/s |"
        ),
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['store']} | {r['pool']} | {r['page_mib']} MiB | {r['buffers_per_page']} | "
            f"{r['pages']} | {r['put_gbps']} | {r['get_gbps']} | {r['get_own_gbps']} | "
            f"{r['memcpy_gbps']} | "
            f"{r['copy_gbps']} |"
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
