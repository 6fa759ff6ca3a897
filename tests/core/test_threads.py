"""Pools used from several threads at once: no deadlock between the core's locks and the GIL, no
lost bytes. SGLang runs loads and write-backs on different threads (and is moving loads onto a
loader thread), so every scenario here is one a server can reach.

Each scenario runs in its own process under a watchdog: a hang is a failed test (with every
thread's stack in the report), never a hung test run. A tiny switch interval makes the GIL change
hands between almost every bytecode, which is what exposes a lock held across a Python call."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

WATCHDOG_S = 120

PRELUDE = r"""
import faulthandler, sys, threading
import torch
from hostkv_rs import MHATokenToKVPool, MHATokenToKVPoolHost, MLATokenToKVPool, MLATokenToKVPoolHost

faulthandler.dump_traceback_later(WATCHDOG - 10, exit=True)
sys.setswitchinterval(SWITCH)

def run_threads(targets):
    errors = []
    def guard(fn):
        def body():
            try:
                fn()
            except BaseException as exc:  # reported by the parent
                errors.append(repr(exc))
        return body
    threads = [threading.Thread(target=guard(fn)) for fn in targets]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors

def run_beside_a_busy_thread(targets):
    # run_threads, next to a pure-Python thread that never releases the GIL on its own
    stop = threading.Event()
    def busy():
        n = 0
        while not stop.is_set():
            n += 1
    spin = threading.Thread(target=busy)
    spin.start()
    try:
        run_threads(targets)
    finally:
        stop.set()
        spin.join()

def alloc_free(host, tokens, rounds):
    def body():
        for _ in range(rounds):
            got = host.alloc(tokens)
            if got is not None:
                host.free(got)
    return body
"""


def _run(body: str, switch: float = 1e-6) -> None:
    script = PRELUDE.replace("WATCHDOG", str(WATCHDOG_S)).replace("SWITCH", repr(switch))
    script += textwrap.dedent(body) + "\nprint('ROUNDS-DONE')\n"
    try:
        done = subprocess.run(
            [sys.executable, "-c", script],
            check=False,
            capture_output=True,
            text=True,
            timeout=WATCHDOG_S,
            env={**os.environ, "PYTHONFAULTHANDLER": "1"},
        )
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"hung past the {WATCHDOG_S}s watchdog:\n{exc.stderr}")
    assert done.returncode == 0 and "ROUNDS-DONE" in done.stdout, (
        f"rc={done.returncode}\n{done.stdout[-4000:]}\n{done.stderr[-8000:]}"
    )


def test_first_use_of_a_binding_by_two_threads_at_once():
    # A fresh pool per round: both threads reach the binding's first full check together.
    _run(
        """
        for _ in range(1000):
            dev = MHATokenToKVPool(64, 16, torch.bfloat16, head_num=2, head_dim=8, layer_num=3)
            host = MHATokenToKVPoolHost(dev, 2.0, 0, 16, "layer_first")
            h = host.alloc(16)
            d = torch.arange(16, 32)
            gate = threading.Barrier(2)
            def load():
                gate.wait()
                for layer in range(3):
                    host.load_to_device_per_layer(dev, h, d, layer, "kernel")
            def backup():
                gate.wait()
                host.backup_from_device_all_layer(dev, h, d, "direct")
            run_threads([load, backup])
        """
    )


@pytest.mark.parametrize("switch", [1e-6, 5e-3])
def test_recheck_after_a_storage_swap_from_two_threads(switch):
    # Every round swaps a layer's storage, so every transfer after it runs the full check again.
    _run(
        """
        dev = MLATokenToKVPool(128, 16, torch.bfloat16, kv_lora_rank=12, qk_rope_head_dim=4,
                               layer_num=4)
        host = MLATokenToKVPoolHost(dev, 2.0, 0, 16, "page_first")
        h = host.alloc(32)
        d = torch.arange(16, 48)
        for r in range(2000):
            dev.kv_buffer[r % 4].set_(torch.zeros_like(dev.kv_buffer[r % 4]))
            gate = threading.Barrier(2)
            def load():
                gate.wait()
                host.load_to_device_per_layer(dev, h, d, r % 4, "kernel")
            def backup():
                gate.wait()
                host.backup_from_device_all_layer(dev, h, d, "kernel")
            run_threads([load, backup])
        """,
        switch=switch,
    )


@pytest.mark.parametrize(
    ("pool", "layout"),
    [
        ("mha", "layer_first"),
        ("mha", "page_first"),
        ("mha", "page_head"),
        ("mha", "page_unified"),
        ("asym", "page_first"),
        ("asym", "page_first_direct"),
        ("mla", "page_first_direct"),
    ],
)
def test_loads_backups_flat_pages_and_alloc_free_from_five_threads(pool, layout):
    # Two transfer threads on slots of their own, one flat-page thread (where the pool has flat
    # pages: page_unified and asymmetric pools refuse them, as SGLang's do), one alloc/free
    # thread and one busy pure-Python thread; every byte each transfer thread moved is checked.
    _five_threads(pool, layout)


@pytest.mark.parametrize(("pool", "layout"), [("mha", "page_first"), ("mla", "page_first_direct")])
def test_five_threads_with_the_page_digest_check(pool, layout):
    # The same, with HOSTKV_PAGE_DIGEST: backups record digests and loads verify them under the
    # core's page-watch locks (hashing without the GIL), while flat pages forget theirs.
    _five_threads(pool, layout, digest=True)


def _five_threads(pool: str, layout: str, digest: bool = False) -> None:
    _run(
        f"""
        import os
        if {digest!r}:
            os.environ["HOSTKV_PAGE_DIGEST"] = "1"
        from hostkv_rs import get_mha_host_pool_cls
        P, L = 16, 4
        if {pool!r} in ("mha", "asym"):
            v_dim = 4 if {pool!r} == "asym" else None
            dev = MHATokenToKVPool(512, P, torch.bfloat16, head_num=2, head_dim=8, layer_num=L,
                                   v_head_dim=v_dim)
            host = get_mha_host_pool_cls(dev)(dev, 2.0, 0, P, {layout!r})
            assert (type(host).__name__ == "AsymmetricMHATokenToKVPoolHost") == (v_dim is not None)
            planes = [dev.k_buffer, dev.v_buffer]
        else:
            dev = MLATokenToKVPool(512, P, torch.bfloat16, kv_lora_rank=12, qk_rope_head_dim=4,
                                   layer_num=L)
            host = MLATokenToKVPoolHost(dev, 2.0, 0, P, {layout!r})
            planes = [dev.kv_buffer]
        assert host._pool_core.watches_pages == {digest!r}
        backend = "direct" if {layout!r} == "page_first_direct" else "kernel"
        ROUNDS = 400

        def mover(first_row, seed):
            h = host.alloc(2 * P)
            d = torch.arange(first_row, first_row + 2 * P)
            def body():
                g = torch.Generator().manual_seed(seed)
                for r in range(ROUNDS):
                    want = []
                    for plane in planes:
                        for layer in range(L):
                            rows = plane[layer][d]
                            rows.view(torch.int16).copy_(torch.randint(
                                -30000, 30000, rows.shape, generator=g, dtype=torch.int16))
                            plane[layer][d] = rows
                            want.append(rows.clone())
                    host.backup_from_device_all_layer(dev, h, d, backend)
                    for plane in planes:
                        for layer in range(L):
                            plane[layer][d] = 0
                    for layer in range(L):
                        host.load_to_device_per_layer(dev, h, d, layer, backend)
                    got = [plane[layer][d] for plane in planes for layer in range(L)]
                    for a, b in zip(want, got):
                        assert torch.equal(a.view(torch.int16), b.view(torch.int16)), r
            return body

        def flat_pages():
            h = host.alloc(P)
            for r in range(ROUNDS):
                page = host.get_data_page(int(h[0]), flat=True).clone()
                page.view(torch.uint8).fill_(r % 251)
                host.set_from_flat_data_page(int(h[0]), page)
                back = host.get_data_page(int(h[0]), flat=True)
                assert torch.equal(back.view(torch.uint8), page.view(torch.uint8)), r

        flat = {layout!r} != "page_unified" and {pool!r} != "asym"
        pages = [flat_pages] if flat else []
        run_beside_a_busy_thread(
            [mover(32, 1), mover(160, 2), *pages, alloc_free(host, P, ROUNDS * 4)]
        )
        """
    )


@pytest.mark.parametrize(
    ("layout", "backend"), [("layer_first", "kernel"), ("page_first_direct", "direct")]
)
def test_v4_page_rows_from_four_threads(layout, backend):
    # DeepSeek V4 page rows: two transfer threads on pages of their own, one alloc/free thread
    # and one busy pure-Python thread, on one pool; every byte each transfer thread moved is
    # checked.
    _run(
        f"""
        from hostkv_rs import DeepSeekV4PagedHostPool
        L, P, ITEM, DEV_PAGES = 3, 4, 656, 16
        dev = [torch.zeros(DEV_PAGES, ITEM, dtype=torch.uint8) for _ in range(L)]
        host = DeepSeekV4PagedHostPool("c4_kv", dev, ITEM, 16, P, layout={layout!r})
        ROUNDS = 300

        def mover(first_page, seed):
            h = host.alloc(2 * P)
            pages = [first_page, first_page + 1]
            d = torch.cat([torch.arange(p * P, (p + 1) * P) for p in pages])
            def body():
                g = torch.Generator().manual_seed(seed)
                for r in range(ROUNDS):
                    want = []
                    for layer in range(L):
                        rows = torch.randint(0, 256, (2, ITEM), generator=g, dtype=torch.uint8)
                        dev[layer][pages] = rows
                        want.append(rows)
                    host.backup_from_device_all_layer(None, h, d, {backend!r})
                    for layer in range(L):
                        dev[layer][pages] = 0
                    for layer in range(L):
                        host.load_to_device_per_layer(None, h, d, layer, {backend!r})
                    for layer in range(L):
                        assert torch.equal(dev[layer][pages], want[layer]), (r, layer)
            return body

        run_beside_a_busy_thread([mover(2, 1), mover(9, 2), alloc_free(host, P, ROUNDS * 4)])
        """
    )


def test_clear_available_size_and_attach_race_alloc_and_free():
    # clear() on one thread while two others alloc and free (a V4 pool's clear ran without the
    # pool's lock: its free list ended up with slots twice, or slots also in use); a logical
    # pool's available_size read between a free's merge steps (it counted released slots
    # twice); two threads attaching V4 scale buffers (both attached, the core holding one
    # thread's, the pool showing the other's).
    _run(
        """
        from hostkv_rs import DeepSeekV4PagedHostPool, LogicalHostPool

        P = 4
        def checked(pool):
            size = pool.slot_used.numel()
            free = torch.cat([pool.free_slots, *pool.release_slots]).tolist()
            assert len(free) == len(set(free)), "a slot twice in the free list"
            assert not pool.slot_used[free].any(), "a free slot marked used"
            assert pool.available_size() + int(pool.slot_used.sum()) == size

        v4 = DeepSeekV4PagedHostPool(
            "c4_kv", [torch.zeros(16, 64, dtype=torch.uint8)] * 2, 64, 16, P
        )
        for _ in range(60):
            def worker():
                held = []
                for i in range(30):
                    got = v4.alloc(P * (1 + i % 2))
                    if got is not None:
                        got = got.clone()
                        assert got.unique().numel() == got.numel(), got.tolist()
                        held.append(got)
                    if len(held) > 2:
                        try:
                            v4.free(held.pop(0))
                        except AssertionError as exc:  # freed by the clear() since: refused
                            assert "Double-free" in str(exc), exc
            def clearer():
                for _ in range(6):
                    v4.clear()
            run_threads([worker, worker, clearer])
            checked(v4)
            v4.clear()

        logical = LogicalHostPool(64, P)
        stop = threading.Event()
        def churn():
            for _ in range(3000):
                logical.free(logical.alloc(P))
            stop.set()
        def reader():
            while not stop.is_set():
                seen = logical.available_size()
                assert 0 <= seen <= 64, seen
        run_threads([churn, reader, reader])
        checked(logical)

        for _ in range(100):
            pool = DeepSeekV4PagedHostPool(
                "c4_kv", [torch.zeros(6, 48, dtype=torch.uint8)] * 2, 48, 5, 2
            )
            outcomes = []
            def attach(value):
                def body():
                    scales = [torch.full((6, 8), value, dtype=torch.uint8)] * 2
                    try:
                        pool.attach_scale_buffers(scales, 8)
                        outcomes.append(value)
                    except RuntimeError as exc:
                        assert "already attached" in str(exc), exc
                return body
            run_threads([attach(1), attach(2)])
            assert len(outcomes) == 1, outcomes
            assert int(pool.scale_device_buffers[0][0, 0]) == outcomes[0]
            assert list(pool._pool.spec.item_bytes) == [48, 8]
        """
    )
