"""Support for tests/l3/test_mooncake.py: why Mooncake is unavailable (if it is), one small pool
of every kind and layout, byte helpers, and the worker that the tests run in another process
(`python mooncake_support.py restore|master-stop ...`).

Run as a script, the worker ends with os._exit: a Mooncake client whose master is gone spends
~10 s in its destructor retrying, which a test has no reason to wait for.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
import sys
import time

import torch

# The worker runs this file as a script; tests/ must be importable for reference.py.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from reference import make_mha, make_mla

os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")
os.environ.setdefault("MC_LOG_LEVEL", "ERROR")  # Mooncake logs every client step at INFO


def mooncake_unavailable() -> str | None:
    """None when the Mooncake client imports and `mooncake_master` exists, else why not."""
    try:
        import mooncake.store  # noqa: F401
    except ImportError as exc:
        return (
            f"Mooncake is not usable here ({exc}); `pip install mooncake-transfer-engine-non-cuda` "
            "and `apt-get install libibverbs1 libnuma1` (scripts/test.sh does both where it can)"
        )
    from hostkv_rs.l3.master import master_binary

    if master_binary() is None:
        return "the mooncake_master binary is not installed (it comes with the Mooncake wheel)"
    return None


def _v4(layout: str):
    from hostkv_rs import DeepSeekV4PagedHostPool

    g = torch.Generator().manual_seed(7)
    dev = [torch.randint(0, 256, (7, 656), dtype=torch.uint8, generator=g) for _ in range(3)]
    return DeepSeekV4PagedHostPool("c4_kv", dev, 656, 6, 4, layout=layout)


# Every pool kind and layout: id -> builder of a fresh pool (each has at least 6 pages).
POOLS = {
    "mha-layer_first": lambda: make_mha("layer_first")[0],
    "mha-page_first": lambda: make_mha("page_first")[0],
    "mha-page_first_direct": lambda: make_mha("page_first_direct")[0],
    "mha-page_head": lambda: make_mha("page_head")[0],
    "mha-fp8-page_first": lambda: make_mha("page_first", dtype=torch.float8_e4m3fn)[0],
    "mha-asym-page_first": lambda: make_mha("page_first", v_head_dim=4)[0],
    "mha-asym-page_first_direct": lambda: make_mha("page_first_direct", v_head_dim=4)[0],
    "mla-layer_first": lambda: make_mla("layer_first")[0],
    "mla-page_first": lambda: make_mla("page_first")[0],
    "mla-page_first_direct": lambda: make_mla("page_first_direct")[0],
    "mla-dcp2-rank1-layer_first": lambda: make_mla("layer_first", dcp_size=2, dcp_rank=1)[0],
    "mla-dcp2-rank0-page_first_direct": lambda: make_mla(
        "page_first_direct", dcp_size=2, dcp_rank=0
    )[0],
    "v4-layer_first": lambda: _v4("layer_first"),
    "v4-page_first": lambda: _v4("page_first"),
    "v4-page_first_direct": lambda: _v4("page_first_direct"),
}
SRC_PAGES = [1, 3, 4]
DST_PAGES = [5, 0, 2]


def slots(pool, pages) -> torch.Tensor:
    """Host indices of `pages` (logical pages under DCP), in order."""
    per = pool.page_size * int(getattr(pool, "dcp_size", 1) or 1)
    return torch.cat([torch.arange(p * per, (p + 1) * per) for p in pages])


def page_bytes(pool, page: int) -> bytes:
    ptrs, sizes = pool.get_page_buffer_meta(slots(pool, [page]))
    return b"".join(ctypes.string_at(p, s) for p, s in zip(ptrs, sizes))


def digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _span_tensor(address: int, nbytes: int) -> torch.Tensor:
    return torch.frombuffer((ctypes.c_char * nbytes).from_address(address), dtype=torch.uint8)


def fill(pool, seed: int) -> None:
    """Random bytes over the whole host memory of `pool`."""
    from hostkv_rs.l3 import host_buffers

    g = torch.Generator().manual_seed(seed)
    for address, nbytes in host_buffers(pool):
        _span_tensor(address, nbytes).random_(0, 256, generator=g)


def snapshot(pool) -> list[bytes]:
    from hostkv_rs.l3 import host_buffers

    return [ctypes.string_at(a, n) for a, n in host_buffers(pool)]


def with_pages(pool, before: list[bytes], pages: dict[int, bytes]) -> list[bytes]:
    """`before` with each page's bytes replaced by `pages[page]`: what the pool must hold after
    loading exactly those pages."""
    from hostkv_rs.l3 import host_buffers

    spans = host_buffers(pool)
    out = [bytearray(b) for b in before]
    for page, data in pages.items():
        ptrs, sizes = pool.get_page_buffer_meta(slots(pool, [page]))
        at = 0
        for ptr, size in zip(ptrs, sizes):
            for j, (address, nbytes) in enumerate(spans):
                if address <= ptr and ptr + size <= address + nbytes:
                    out[j][ptr - address : ptr - address + size] = data[at : at + size]
                    break
            else:
                raise AssertionError(f"page buffer {ptr:#x} lies outside the pool's memory")
            at += size
    return [bytes(b) for b in out]


# ----------------------------------------------------------------- worker (another process)

# The worker's clients live until os._exit: a client dropped earlier unmounts in its destructor,
# which takes ~10 s once the master is gone.
_KEEP: list = []


def _restore(master: str, metadata: str, plan: dict) -> dict:
    """A fresh pool per case, loaded by key: page digests and results."""
    from hostkv_rs.l3 import MooncakeTier

    tier = MooncakeTier.connect(master, metadata, global_segment_size=0)
    _KEEP.append(tier)
    out = {}
    for case, keys in plan.items():
        pool = POOLS[case]()
        fill(pool, 99)  # not what was saved
        tier.attach(pool)
        results = tier.load(keys, slots(pool, DST_PAGES))
        out[case] = {
            "results": [r.status.value for r in results],
            "digests": [digest(page_bytes(pool, p)) for p in DST_PAGES],
        }
        pool.destroy()
    return out


def _master_stop(master: str, metadata: str) -> dict:
    """Save, wait until the test stopped the master, then try everything again."""
    from hostkv_rs.l3 import MooncakeTier, StoreUnavailable

    saver = MooncakeTier.connect(master, metadata, global_segment_size=64 << 20)
    loader = MooncakeTier(saver.store, master=master)  # a second pool on the same client
    _KEEP.extend([saver, loader])
    src, dst = POOLS["mha-page_first"](), POOLS["mha-page_first"]()
    fill(src, 1)
    fill(dst, 2)
    saver.attach(src)
    loader.attach(dst)
    keys = ["ms-a", "ms-b", "ms-c"]
    saved = [r.status.value for r in saver.save(keys, slots(src, SRC_PAGES))]
    print(json.dumps({"saved": saved}), flush=True)
    sys.stdin.readline()  # the test stops the master, then writes a line
    before = snapshot(dst)
    out = {}
    for name, call in (
        ("load", lambda: loader.load(keys, slots(dst, DST_PAGES))),
        ("exists", lambda: loader.exists(keys)),
        ("save", lambda: saver.save(["ms-d"], slots(src, [2]))),
    ):
        t0 = time.perf_counter()
        try:
            out[name] = {"returned": repr(call())}
        except StoreUnavailable as exc:
            out[name] = {"error": str(exc)}
        out[name]["seconds"] = round(time.perf_counter() - t0, 3)
    out["dst_unchanged"] = snapshot(dst) == before
    return out


def main(argv: list[str]) -> None:
    command, master, metadata = argv[:3]
    if command == "restore":
        result = _restore(master, metadata, json.loads(sys.stdin.readline()))
    elif command == "master-stop":
        result = _master_stop(master, metadata)
    else:
        raise SystemExit(f"unknown command {command!r}")
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    try:
        main(sys.argv[1:])
    except BaseException as exc:  # noqa: BLE001 - report, then leave without the slow teardown
        import traceback

        traceback.print_exc()
        print(json.dumps({"worker_error": repr(exc)}), flush=True)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
