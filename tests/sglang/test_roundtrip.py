"""Byte-exact round trips through SGLang's OWN transfer machinery with hostkv_rs pools.

Each test builds the host pool through SGLang's construction path (after install()), fills the
device pool with random bytes, backs up random whole pages into host slots from `host_pool.alloc`,
poisons the whole device pool, loads the pages back into different device pages and compares
the byte views with torch.equal: the loaded pages must equal what was backed up, every other
device row must still hold the poison.

Drivers:
* `L2TransferEngine.submit_device_to_host` / `submit_host_to_device` (all layers), as the
  controllers call them;
* SGLang's `HybridCacheController` from `build_kv_only_stack` (`write`, `load`,
  `start_loading`), MTP draft packing included;
* SGLang's base `HiCacheController` (what HiRadixCache uses up to 0.5.20).

DeepSeek V4: the stack's controller also drives SGLang's own `DeepSeekV4StateHostPool` entries,
which hostkv_rs deliberately leaves to SGLang and which cannot copy on CPU (sgl_kernel /
JIT CUDA kernels), so V4 round trips go through the same L2TransferEngine with the stack's own
pool entries and layer mappers (what `HybridCacheController._l2_transfers` hands the engine).
"""

from __future__ import annotations

import threading

import pytest
import sgl_harness as H
import torch

PAGES = 4  # pages moved per round trip
SIZE = 256  # device tokens
LAYERS = 2


def _cases(pairs, dtypes=("bf16", "fp8"), pages=(1, 16)):
    return [
        pytest.param(layout, backend, dtype, page, id=f"{layout}-{backend}-{dtype}-p{page}")
        for layout, backend in pairs
        for dtype in dtypes
        for page in pages
    ]


def _device(kind, dtype, page, layers=LAYERS):
    if kind == "mha":
        return H.mha_device(size=SIZE, page=page, dtype=H.DTYPES[dtype], layers=layers)
    if kind == "asym":
        return H.mha_device(
            size=SIZE, page=page, dtype=H.DTYPES[dtype], head_dim=16, v_head_dim=8, layers=layers
        )
    return H.mla_device(size=SIZE, page=page, dtype=H.DTYPES[dtype], layers=layers)


def _plan(host_pool, page, gen, n_pages=PAGES, rows=SIZE):
    """(host slots, backup device slots, load device slots) as whole pages. Host slots come
    from host_pool.alloc after a first allocation, page order shuffled; device pages are random,
    the load pages differ from the backup pages."""
    head = host_pool.alloc(page)  # so the pages moved do not start at host slot 0
    assert head is not None
    host = host_pool.alloc(n_pages * page)
    assert host is not None, "host pool too small for the test"
    host = host.clone().reshape(n_pages, page)[torch.randperm(n_pages, generator=gen)].reshape(-1)
    first = 1  # device page 0 is SGLang's padding page
    backup_pages = H.pick_pages(n_pages, first, rows // page, gen)
    load_pages = H.pick_pages(n_pages, first, rows // page, gen, exclude=backup_pages)
    return host, H.page_slots(backup_pages, page), H.page_slots(load_pages, page)


def _controller_order(io_backend, layout, host, dev):
    """The index order SGLang's controller hands the engine (direct + layer_first sorts the host
    indices and permutes the device ones with them)."""
    if io_backend == "direct" and layout == "layer_first":
        host, order = host.sort()
        dev = dev.index_select(0, order)
    return host, dev


def _check_loaded(tensors, saved, poison, src, dst, what):
    for i, (t, before, poisoned) in enumerate(zip(tensors, saved, poison, strict=True)):
        now = H.byte_rows(t)
        assert torch.equal(now[dst], before[src]), f"{what}: tensor {i}: loaded rows differ"
        keep = torch.ones(now.shape[0], dtype=torch.bool)
        keep[dst] = False
        assert torch.equal(now[keep], poisoned[keep]), f"{what}: tensor {i}: other rows changed"


def _engine_round_trip(host_pool, device_pool, layout, io_backend, gen, n_layers):
    tensors = H.device_planes(device_pool)
    H.fill_random(tensors, gen)
    saved = H.snapshot(tensors)
    host, d_src, d_dst = _plan(host_pool, device_pool.page_size, gen)
    h_b, d_b = _controller_order(io_backend, layout, host, d_src)
    engine = H.l2.L2TransferEngine(io_backend)
    engine.submit_device_to_host([H.l2.L2Transfer(host_pool, device_pool, h_b, d_b)])
    H.fill_random(tensors, gen)
    poison = H.snapshot(tensors)
    h_l, d_l = _controller_order(io_backend, layout, host, d_dst)
    H.submit_h2d(engine, [H.l2.L2Transfer(host_pool, device_pool, h_l, d_l)], n_layers)
    # host[i] was written from d_src[i] and read into d_dst[i]
    _check_loaded(tensors, saved, poison, d_src, d_dst, f"{layout}/{io_backend}")


def _built(kind, dtype, page, layout, io_backend, publish):
    device_pool = _device(kind, dtype, page)
    publish(page_size=page, hicache_mem_layout=layout, hicache_io_backend=io_backend)
    host_pool = H.build_kv_host_pool(kv_pool=device_pool, page_size=page, use_mla=(kind == "mla"))
    assert H.is_ours(host_pool), f"SGLang built {type(host_pool)} after install()"
    return device_pool, host_pool


# --------------------------------------------------------------------------- L2TransferEngine


@pytest.mark.parametrize("layout,io_backend,dtype,page", _cases(H.MHA_PAIRS))
def test_engine_mha(layout, io_backend, dtype, page, installed, publish, gen):
    dev, host = _built("mha", dtype, page, layout, io_backend, publish)
    _engine_round_trip(host, dev, layout, io_backend, gen, dev.layer_num)


@pytest.mark.parametrize("layout,io_backend,dtype,page", _cases(H.ASYM_PAIRS))
def test_engine_asymmetric_mha(layout, io_backend, dtype, page, installed, publish, gen):
    dev, host = _built("asym", dtype, page, layout, io_backend, publish)
    assert type(host).__name__ == "AsymmetricMHATokenToKVPoolHost"
    _engine_round_trip(host, dev, layout, io_backend, gen, dev.layer_num)


@pytest.mark.parametrize("layout,io_backend,dtype,page", _cases(H.MLA_PAIRS))
def test_engine_mla(layout, io_backend, dtype, page, installed, publish, gen):
    dev, host = _built("mla", dtype, page, layout, io_backend, publish)
    _engine_round_trip(host, dev, layout, io_backend, gen, dev.layer_num)


@pytest.mark.parametrize(
    "layout,io_backend", [("layer_first", "kernel"), ("layer_first", "direct")], ids=str
)
@pytest.mark.parametrize("shard_rank", [0, 1])
def test_engine_mla_layer_sharded(layout, io_backend, shard_rank, installed, publish, gen):
    """CP layer sharding: the host pool holds the owned layers only; the engine walks every
    device layer; owned ones come back byte-exact, the others are left alone (SGLang returns
    silently for a non-owned, non-draft layer)."""
    dev, (start, end) = H.layer_sharded(H.mla_device(layers=4), shard_size=2, shard_rank=shard_rank)
    publish(page_size=dev.page_size, hicache_mem_layout=layout, hicache_io_backend=io_backend)
    host_pool = H.build_kv_host_pool(kv_pool=dev, page_size=dev.page_size, use_mla=True)
    assert H.is_ours(host_pool)
    assert host_pool.layer_num == end - start
    owned = list(dev.kv_buffer[start:end])
    others = list(dev.kv_buffer[:start]) + list(dev.kv_buffer[end:])
    H.fill_random(owned + others, gen)
    saved = H.snapshot(owned)
    host, d_src, d_dst = _plan(host_pool, dev.page_size, gen)
    h_b, d_b = _controller_order(io_backend, layout, host, d_src)
    engine = H.l2.L2TransferEngine(io_backend)
    engine.submit_device_to_host([H.l2.L2Transfer(host_pool, dev, h_b, d_b)])
    H.fill_random(owned + others, gen)
    poison, poison_others = H.snapshot(owned), H.snapshot(others)
    h_l, d_l = _controller_order(io_backend, layout, host, d_dst)
    H.submit_h2d(engine, [H.l2.L2Transfer(host_pool, dev, h_l, d_l)], dev.layer_num)
    _check_loaded(owned, saved, poison, d_src, d_dst, f"sharded {layout}/{io_backend}")
    for t, before in zip(others, poison_others, strict=True):
        assert torch.equal(H.byte_rows(t), before), "a layer this rank does not own was written"


@pytest.mark.parametrize("layout,io_backend", H.MLA_PAIRS, ids=str)
@pytest.mark.parametrize("dcp_rank", [0, 1])
def test_engine_mla_dcp(layout, io_backend, dcp_rank, installed, publish, gen):
    """Decode context parallelism (dcp_size=2), built by build_kv_host_pool under SGLang's DCP
    parallel state: the engine hands the pool widened logical slots; this rank's rows are
    `logical[rank::2] // 2` on both sides."""
    dcp, page = 2, 16  # widened page; 8 physical rows per rank
    dev = H.mla_device(page=page)
    publish(page_size=page, hicache_mem_layout=layout, hicache_io_backend=io_backend)
    with H.rc.get_parallel().override(dcp_enabled=True, attn_dcp_size=dcp, attn_dcp_rank=dcp_rank):
        host_pool = H.build_kv_host_pool(kv_pool=dev, page_size=page, use_mla=True)
    assert H.is_ours(host_pool)
    assert (host_pool.dcp_size, host_pool.dcp_rank) == (dcp, dcp_rank)
    tensors = list(dev.kv_buffer)
    H.fill_random(tensors, gen)
    saved = H.snapshot(tensors)
    host, d_src, d_dst = _plan(host_pool, page, gen, rows=dev.size * dcp)

    def local(x):
        return x[dcp_rank::dcp] // dcp

    engine = H.l2.L2TransferEngine(io_backend)
    h_b, d_b = _controller_order(io_backend, layout, host, d_src)
    engine.submit_device_to_host([H.l2.L2Transfer(host_pool, dev, h_b, d_b)])
    H.fill_random(tensors, gen)
    poison = H.snapshot(tensors)
    h_l, d_l = _controller_order(io_backend, layout, host, d_dst)
    H.submit_h2d(engine, [H.l2.L2Transfer(host_pool, dev, h_l, d_l)], dev.layer_num)
    _check_loaded(tensors, saved, poison, local(d_src), local(d_dst), f"dcp {layout}/{io_backend}")


# --------------------------------------------------------------------------- controllers


def _controller_round_trip(controller, allocator, planes, gen, *, layout, io_backend, page):
    """write() -> poison -> load() + start_loading() through SGLang's controller. `planes` are
    the device tensors whose rows must come back (target pool, plus draft pools if packed)."""
    H.fill_random(planes, gen)
    saved = H.snapshot(planes)
    # The controller allocates the host slots itself (write -> host_pool.alloc); device page 0
    # is SGLang's padding page.
    rows = allocator.kvcache.size
    src_pages = H.pick_pages(PAGES, 1, rows // page, gen)
    dst_pages = H.pick_pages(PAGES, 1, rows // page, gen, exclude=src_pages)
    d_src, d_dst = H.page_slots(src_pages, page), H.page_slots(dst_pages, page)
    host = controller.write(d_src)
    assert host is not None, "controller.write found no host space"
    host = host.clone()
    assert controller.ack_write_queue, "write() queued no transfer"
    H.fill_random(planes, gen)
    poison = H.snapshot(planes)
    allocator.plan(d_dst)
    got = controller.load(host)
    assert torch.equal(got, d_dst)
    controller.start_loading()
    assert controller.ack_load_queue, "start_loading() submitted nothing"
    _check_loaded(planes, saved, poison, d_src, d_dst, f"controller {layout}/{io_backend}")


@pytest.mark.parametrize("kind", ["mha", "asym", "mla"])
@pytest.mark.parametrize("page", [1, 16])
def test_hybrid_controller(kind, page, installed, publish, gen):
    pairs = {"mha": H.MHA_PAIRS, "asym": H.ASYM_PAIRS, "mla": H.MLA_PAIRS}[kind]
    for layout, io_backend in pairs:
        for dtype in ("bf16", "fp8"):
            _stack_round_trip(kind, dtype, page, layout, io_backend, publish, gen)


def _stack_round_trip(kind, dtype, page, layout, io_backend, publish, gen):
    """A round trip through SGLang's hybrid controller of a KV-only stack SGLang builds."""
    dev = _device(kind, dtype, page)
    publish(page_size=page, hicache_mem_layout=layout, hicache_io_backend=io_backend)
    group, controller, allocator = H.kv_only_stack(dev, use_mla=(kind == "mla"))
    assert type(controller).__module__.startswith("sglang.")
    assert H.is_ours(group.anchor_entry.host_pool)
    _controller_round_trip(
        controller,
        allocator,
        H.device_planes(dev),
        gen,
        layout=f"{layout}/{dtype}",
        io_backend=io_backend,
        page=page,
    )


@pytest.mark.parametrize(
    "kind,layout,io_backend",
    [
        ("mha", "page_first", "kernel"),
        ("asym", "page_first", "kernel"),
        ("mla", "page_first_direct", "direct"),
    ],
)
def test_backups_and_loads_from_two_threads_through_sglangs_engine(
    kind, layout, io_backend, installed, publish, gen
):
    """SGLang writes back and loads on different threads (and is moving loads onto a loader
    thread, its PR #38472): here one thread backs pages up and another loads other pages, each
    through SGLang's own L2 transfer engine, over one pool SGLang built, at once and many times,
    with the GIL changing hands between almost every bytecode. No hang, and each round's bytes
    checked by the thread that moved them (each round moves other bytes than the last)."""
    import sys

    page, rounds = 8, 100
    dev, host = _built(kind, "bf16", page, layout, io_backend, publish)
    tensors = H.device_planes(dev)
    H.fill_random(tensors, gen)
    saved = H.snapshot(tensors)

    def rows(*pages):
        return H.page_slots(list(pages), page)

    # backup thread: device pages 1-3 or 4-6 into its host slots, read back into 16-18
    backup_srcs, backup_check = (rows(1, 2, 3), rows(4, 5, 6)), rows(16, 17, 18)
    # load thread: host slots holding pages 7-9 or 10-12, loaded into 13-15
    load_srcs, load_dst = (rows(7, 8, 9), rows(10, 11, 12)), rows(13, 14, 15)
    h_backup = host.alloc(3 * page)
    h_loads = [host.alloc(3 * page), host.alloc(3 * page)]
    setup = H.l2.L2TransferEngine(io_backend)
    for h, src in zip(h_loads, load_srcs):
        setup.submit_device_to_host([H.l2.L2Transfer(host, dev, h, src)])
    errors = []

    def same(dst, src, what):
        for i, (t, was) in enumerate(zip(tensors, saved, strict=True)):
            assert torch.equal(H.byte_rows(t)[dst], was[src]), f"tensor {i}: {what}"

    def backups():
        engine = H.l2.L2TransferEngine(io_backend)
        for r in range(rounds):
            src = backup_srcs[r % 2]
            engine.submit_device_to_host([H.l2.L2Transfer(host, dev, h_backup, src)])
            H.submit_h2d(
                engine, [H.l2.L2Transfer(host, dev, h_backup, backup_check)], dev.layer_num
            )
            same(backup_check, src, f"backup round {r}")

    def loads():
        engine = H.l2.L2TransferEngine(io_backend)
        for r in range(rounds):
            h, src = h_loads[r % 2], load_srcs[r % 2]
            H.submit_h2d(engine, [H.l2.L2Transfer(host, dev, h, load_dst)], dev.layer_num)
            same(load_dst, src, f"load round {r}")

    def guarded(fn):
        def body():
            try:
                fn()
            except BaseException as exc:  # noqa: BLE001 (reported below)
                errors.append(repr(exc))

        return body

    before = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    try:
        threads = [threading.Thread(target=guarded(f), daemon=True) for f in (backups, loads)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=300)
    finally:
        sys.setswitchinterval(before)
    assert not any(t.is_alive() for t in threads), "a backup or load thread hung"
    assert not errors, errors
    untouched = torch.ones(saved[0].shape[0], dtype=torch.bool)
    untouched[torch.cat([backup_check, load_dst])] = False
    for i, (t, was) in enumerate(zip(tensors, saved, strict=True)):
        assert torch.equal(H.byte_rows(t)[untouched], was[untouched]), f"tensor {i}: other rows"


@pytest.mark.skipif(not H.at_least(0, 5, 23), reason="page_unified: SGLang 0.5.23+")
@pytest.mark.parametrize("kind", ["mha", "mla"])
@pytest.mark.parametrize("page", [1, 16])
def test_page_unified_through_sglangs_engine_and_controller(kind, page, installed, publish, gen):
    """page_unified moves on the kernel backend only (0.5.23's controller refuses direct):
    SGLang's construction path builds ours for it, and SGLang's L2 transfer engine and hybrid
    controller move whole pages through it byte-exact."""
    for dtype in ("bf16", "fp8"):
        dev, host = _built(kind, dtype, page, "page_unified", "kernel", publish)
        assert host.layout == "page_unified"
        _engine_round_trip(host, dev, "page_unified", "kernel", gen, dev.layer_num)
        _stack_round_trip(kind, dtype, page, "page_unified", "kernel", publish, gen)


@pytest.mark.parametrize("kind", ["mha", "mla"])
@pytest.mark.parametrize("n_drafts", [1, 2])
def test_hybrid_controller_mtp_drafts(kind, n_drafts, installed, publish, gen):
    """MTP draft packing: the host pool holds the target layers plus one layer per draft pool;
    backup reads all of them, and the controller's draft transfers (is_draft=True) load each
    draft pool's layer back."""
    page = 16
    pairs = H.MHA_PAIRS if kind == "mha" else H.MLA_PAIRS
    for layout, io_backend in pairs:
        dev = _device(kind, "bf16", page)
        drafts = [_device(kind, "bf16", page, layers=1) for _ in range(n_drafts)]
        publish(page_size=page, hicache_mem_layout=layout, hicache_io_backend=io_backend)
        group, controller, allocator = H.kv_only_stack(dev, use_mla=(kind == "mla"), drafts=drafts)
        host_pool = group.anchor_entry.host_pool
        assert H.is_ours(host_pool)
        assert host_pool.layer_num == dev.layer_num + n_drafts
        planes = H.device_planes(dev) + [t for d in drafts for t in H.device_planes(d)]
        _controller_round_trip(
            controller,
            allocator,
            planes,
            gen,
            layout=layout,
            io_backend=io_backend,
            page=page,
        )


@pytest.mark.parametrize("kind", ["mha", "mla"])
def test_base_hicache_controller(kind, installed, publish, gen):
    """SGLang's base HiCacheController (HiRadixCache's, up to 0.5.20) over a pool SGLang built."""
    page = 16
    pairs = H.MHA_PAIRS if kind == "mha" else H.MLA_PAIRS
    for layout, io_backend in pairs:
        dev, host = _built(kind, "bf16", page, layout, io_backend, publish)
        allocator = H.FakeTokenAllocator(dev)
        controller = H.cc.HiCacheController(
            allocator,
            host,
            page,
            None,
            load_cache_event=threading.Event(),
            io_backend=io_backend,
            write_policy="write_through",
        )
        _controller_round_trip(
            controller,
            allocator,
            H.device_planes(dev),
            gen,
            layout=layout,
            io_backend=io_backend,
            page=page,
        )


# --------------------------------------------------------------------------- DeepSeek V4


def _v4_paged_entries(group):
    return [e for e in group.entries if type(e.host_pool).__name__ == "DeepSeekV4PagedHostPool"]


@pytest.mark.parametrize("layout,io_backend", H.V4_PAIRS, ids=lambda x: str(x))
def test_v4_stack(layout, io_backend, installed, publish, sglang_alloc, gen):
    """Every DeepSeekV4PagedHostPool of SGLang's V4 stack (SWA, C4, C4 indexer, C128) round-trips
    whole pages through the L2TransferEngine with the stack's layer mappers; the KV anchor is
    our LogicalHostPool, the state pools stay SGLang's (`sglang_alloc`: only they need it)."""
    publish(page_size=H.V4_PAGE, hicache_mem_layout=layout, hicache_io_backend=io_backend)
    kv = H.v4_device()  # reads the published ServerArgs
    group, controller = H.v4_stack(kv)
    anchor = group.anchor_entry
    assert type(anchor.host_pool).__name__ == "LogicalHostPool" and H.is_ours(anchor.host_pool)
    for entry in group.entries:
        name = type(entry.host_pool).__name__
        if name in ("LogicalHostPool", "DeepSeekV4PagedHostPool"):
            assert H.is_ours(entry.host_pool), f"{entry.name}: {type(entry.host_pool)}"
        else:
            assert H.is_sglangs(entry.host_pool), f"{entry.name}: {type(entry.host_pool)}"
            assert isinstance(entry.host_pool, H.ORIG["HostKVCache"])
    paged = _v4_paged_entries(group)
    assert paged, "the V4 stack built no paged pools"
    n_layers = H.controller_layers(controller)
    engine = H.l2.L2TransferEngine(io_backend)

    for entry in paged:
        host_pool, device_pool = entry.host_pool, entry.device_pool
        tensors = list(host_pool.device_buffers)
        slot = host_pool.slot_page_size
        rows = min(t.shape[0] for t in tensors)
        n = min(2, rows - 1)
        H.fill_random(tensors, gen)
        saved = H.snapshot(tensors)
        host = host_pool.alloc(n * slot)
        assert host is not None
        src_rows = H.pick_pages(n, 0, rows, gen)
        dst_rows = H.pick_pages(n, 0, rows, gen, exclude=src_rows)
        d_src, d_dst = H.page_slots(src_rows, slot), H.page_slots(dst_rows, slot)
        anchor_host = (
            anchor.host_pool.alloc(n * slot) if slot == anchor.host_pool.page_size else None
        )
        transfers = [
            H.l2.L2Transfer(host_pool, device_pool, host, d_src, layer_mapper=entry.layer_mapper)
        ]
        if anchor_host is not None:
            transfers.insert(
                0,
                H.l2.L2Transfer(
                    anchor.host_pool, anchor.device_pool, anchor_host, d_src, anchor.layer_mapper
                ),
            )
        engine.submit_device_to_host(transfers)
        H.fill_random(tensors, gen)
        poison = H.snapshot(tensors)
        transfers = [t._replace(device_indices=d_dst) for t in transfers]
        H.submit_h2d(engine, transfers, n_layers)
        _check_loaded(tensors, saved, poison, src_rows, dst_rows, f"V4 {entry.name}")


def _hisparse_c4_pool(publish):
    """The DSV4 HiSparse C4 host pool, built at the HiSparse coordinator's site (its module
    global, ours after install()) with the coordinator's arguments, over a C4 device pool
    (64 compressed tokens per 37440-byte row)."""
    from sglang.srt.managers import hisparse_coordinator

    publish(page_size=H.V4_PAGE, hicache_mem_layout="layer_first")
    c4 = H.v4_device().c4_kv_pool
    page = c4.page_size
    host_pool = hisparse_coordinator.DeepSeekV4PagedHostPool(
        pool_name="dsv4_hisparse_c4",
        device_buffers=c4.kv_buffer,
        item_bytes=c4.bytes_per_page_padded,
        num_host_pages=(2048 // 4 + page - 1) // page,
        slot_page_size=page,
        layout="layer_first",
    )
    assert H.is_ours(host_pool)
    return c4, host_pool


def _check_tokens(src_rows, dst_rows, src_tokens, dst_tokens, what):
    """SGLang's DSV4 token kernel layout: token t of a row: value (576 B) at t%64*576, scale
    (8 B) at 64*576 + t%64*8, row t//64."""
    value, scale = 576, 8
    for layer, (src, dst) in enumerate(zip(src_rows, dst_rows, strict=True)):
        for t, u in zip(src_tokens.tolist(), dst_tokens.tolist(), strict=True):
            a, b = src[t // 64], dst[u // 64]
            v_a, v_b = t % 64 * value, u % 64 * value
            assert torch.equal(b[v_b : v_b + value], a[v_a : v_a + value]), (what, layer, t, u)
            s_a, s_b = 64 * value + t % 64 * scale, 64 * value + u % 64 * scale
            assert torch.equal(b[s_b : s_b + scale], a[s_a : s_a + scale]), (what, layer, t, u)


@pytest.mark.parametrize("io_backend", ["kernel", "direct"])
def test_v4_token_round_trip(io_backend, installed, publish, gen):
    """Token-granular V4 transfers (a count that is not a whole slot page takes SGLang's DSV4
    token kernel, whatever the backend): backup through backup_from_device_all_layer, load back
    layer by layer into other device tokens."""
    c4, host_pool = _hisparse_c4_pool(publish)
    tensors = list(c4.kv_buffer)
    H.fill_random(tensors, gen)
    saved = H.snapshot(tensors)
    src = torch.tensor([3, 64, 65, 130], dtype=torch.int64)
    dst = torch.tensor([5, 66, 200, 7], dtype=torch.int64)
    host = torch.tensor([1, 2, 70, 200], dtype=torch.int64)
    host_pool.backup_from_device_all_layer(c4, host, src, io_backend)
    host_rows = [H.byte_rows(b) for b in H.buffers_of(host_pool)]
    _check_tokens(saved, host_rows, src, host, "backup")
    H.fill_random(tensors, gen)
    for layer in range(host_pool.layer_num):
        host_pool.load_to_device_per_layer(c4, host, dst, layer, io_backend)
    _check_tokens(saved, H.snapshot(tensors), src, dst, "load")


@pytest.mark.skipif(not H.at_least(0, 5, 23), reason="backup_tokens_...: 0.5.23+")
def test_v4_token_backup(installed, publish, gen):
    """0.5.23's `backup_tokens_from_device_all_layer` (HiSparse decode backups: "a multiple of
    the page size must not be mistaken for whole pages"): 64 tokens, all layers."""
    c4, host_pool = _hisparse_c4_pool(publish)
    tensors = list(c4.kv_buffer)
    H.fill_random(tensors, gen)
    saved = H.snapshot(tensors)
    tokens = torch.randperm(36 * 64, generator=gen)[:64]
    host = torch.randperm(host_pool.size, generator=gen)[:64]
    host_pool.backup_tokens_from_device_all_layer(host, tokens)
    _check_tokens(saved, [H.byte_rows(b) for b in H.buffers_of(host_pool)], tokens, host, "tokens")
