"""hostkv_rs.l3: host pool pages to and from a real Mooncake Store on loopback.

The store tests start `mooncake_master` on free 127.0.0.1 ports (one for the session, and their
own for the full-store and master-stopped cases) and stop each by its pid. Without Mooncake they
skip with the reason; the format and destroy-hook tests at the top need no store.
"""

from __future__ import annotations

import copy
import ctypes
import gc
import json
import os
import signal
import subprocess
import sys
import time
import types
import uuid

import pytest
import torch
from hostkv_rs import LogicalHostPool
from hostkv_rs.l3 import PageResult, Status, host_buffers, page_format
from hostkv_rs.pools.base import on_destroy
from mooncake_support import (
    DST_PAGES,
    POOLS,
    SRC_PAGES,
    digest,
    fill,
    mooncake_unavailable,
    page_bytes,
    slots,
    snapshot,
    with_pages,
)
from reference import make_mha, make_mla

SUPPORT = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "mooncake_support.py"
)
MOONCAKE_MISSING = mooncake_unavailable()
needs_mooncake = pytest.mark.skipif(MOONCAKE_MISSING is not None, reason=str(MOONCAKE_MISSING))


# ----------------------------------------------------------------- no store needed


def test_tags_tell_layouts_dtypes_geometries_and_shards_apart():
    tags = {case: page_format(build()).tag for case, build in POOLS.items()}
    assert len(set(tags.values())) == len(tags), tags
    same_bytes = [
        make_mha("page_first", heads=2, head_dim=8)[0],
        make_mha("page_first", heads=1, head_dim=16)[0],
        make_mha("page_first", heads=2, head_dim=8, dtype=torch.float16)[0],
        make_mha("page_first_direct", heads=2, head_dim=8)[0],
    ]
    formats = [page_format(p) for p in same_bytes]
    assert len({f.page_bytes for f in formats}) == 1  # same page size, and yet:
    assert len({f.tag for f in formats}) == len(formats)
    pool = same_bytes[0]
    assert page_format(pool, tp_rank=1, tp_size=2).tag != page_format(pool).tag
    assert page_format(pool, pp_rank=1, pp_size=2).tag != page_format(pool).tag
    assert page_format(pool, namespace="m").tag == "m/" + page_format(pool).tag
    # head_group_num means something only to page_unified: elsewhere it never changes the tag
    grouped = copy.copy(pool)
    for ignored in (3, -1, "two"):
        grouped.head_group_num = ignored
        assert page_format(grouped).tag == page_format(pool).tag
    # MLA latents are the same on every TP rank (shared objects, as in SGLang); DCP ranks are not
    mla = make_mla("layer_first")[0]
    assert page_format(mla, tp_rank=1, tp_size=2).tag == page_format(mla).tag
    dcp = [make_mla("layer_first", dcp_size=2, dcp_rank=r)[0] for r in (0, 1)]
    assert page_format(dcp[0]).tag != page_format(dcp[1]).tag
    # CP layer sharding: which device layers the host layers are
    shard = make_mla("layer_first")[0]
    plain = page_format(shard).tag
    shard._device_side = types.SimpleNamespace(targets=[(5, 0), (6, 1), (7, 2)])
    assert page_format(shard).tag == plain.replace("-pp0of1", "-own5-7-pp0of1")


def test_page_format_sizes_follow_the_pools_page_buffers():
    for case, build in POOLS.items():
        pool = build()
        fmt = page_format(pool)
        ptrs, sizes = pool.get_page_buffer_meta(slots(pool, [1]))
        assert (fmt.page_bytes, fmt.buffers_per_page) == (sum(sizes), len(ptrs)), case
        assert fmt.slots_per_page == pool.page_size * getattr(pool, "dcp_size", 1), case
    # MLA with DCP: one rank-local physical page per logical page (not two)
    pool = POOLS["mla-dcp2-rank1-layer_first"]()
    ptrs, _ = pool.get_page_buffer_meta(slots(pool, [1, 2]))
    assert len(ptrs) == 2 * pool.layer_num


def test_pools_without_bytes_have_no_page_format():
    with pytest.raises(ValueError, match="no KV bytes"):
        page_format(LogicalHostPool(64, 16))
    with pytest.raises(ValueError, match="no KV bytes"):
        page_format(make_mla("layer_first", is_dummy=True)[0])
    pool = make_mha("page_first")[0]
    pool.destroy()
    with pytest.raises(RuntimeError, match="destroyed"):
        page_format(pool)


@pytest.mark.parametrize("case", ["mha-page_first", "mla-layer_first", "v4-page_first"])
def test_destroy_runs_on_destroy_callbacks_once(case):
    pool = POOLS[case]()
    calls = []
    on_destroy(pool, lambda: calls.append(1))
    on_destroy(pool, lambda: 1 / 0)  # logged, does not stop destroy()
    on_destroy(pool, lambda: calls.append(2))
    pool.destroy()
    pool.destroy()
    assert calls == [1, 2]


def test_host_buffers_are_the_pools_regions():
    pool = POOLS["mha-asym-page_first"]()
    assert host_buffers(pool) == [(r.address, r.nbytes) for r in pool._host_regions]
    v4 = POOLS["v4-layer_first"]()
    assert host_buffers(v4) == [(v4._region.address, v4._region.nbytes)]


class _StuckRegistry:
    """A client's registrations as Mooncake keeps them: an overlapping range is refused, and a
    range whose unregistration failed (its master unreachable) stays registered for good."""

    def __init__(self):
        self.ranges: dict[int, int] = {}
        self.down = False

    def register_buffer(self, address, nbytes):
        if any(a < address + nbytes and address < a + n for a, n in self.ranges.items()):
            return -600
        self.ranges[address] = nbytes
        return 0

    def unregister_buffer(self, address):
        if self.down or address not in self.ranges:
            return -600
        del self.ranges[address]
        return 0


def test_a_pool_detached_while_the_master_is_down_says_a_new_client_is_needed(caplog):
    from hostkv_rs.l3 import L3Error
    from hostkv_rs.l3.mooncake import MooncakeTier

    store = _StuckRegistry()
    tier = MooncakeTier(store)
    pool = POOLS["mha-page_first"]()
    tier.attach(pool)
    store.down = True
    with caplog.at_level("WARNING", logger="hostkv_rs.l3.mooncake"):
        tier.detach()
    assert "attached again only through a new client (MooncakeTier.connect)" in caplog.text
    store.down = False
    with pytest.raises(L3Error, match=r"detached while its master was unreachable.*a new client"):
        tier.attach(pool)
    assert not tier.attached
    fresh = MooncakeTier(_StuckRegistry())
    fresh.attach(pool)
    fresh.detach()


@pytest.mark.parametrize("error", [RuntimeError, KeyboardInterrupt])
def test_an_attach_whose_registration_raises_part_way_leaves_nothing_registered(error):
    # An asymmetric pool has two allocations: the client raises (not a return code) on the
    # second. The first must be unregistered, as after a refusing return code, or the client
    # keeps it and refuses the next attach at those addresses.
    from hostkv_rs.l3.mooncake import MooncakeTier

    class Raising(_StuckRegistry):
        def register_buffer(self, address, nbytes):
            if self.ranges:
                raise error("register_buffer failed")
            return super().register_buffer(address, nbytes)

    store = Raising()
    tier = MooncakeTier(store)
    pool = POOLS["mha-asym-page_first"]()
    with pytest.raises(error, match="register_buffer failed"):
        tier.attach(pool)
    assert store.ranges == {} and not tier.attached


def test_missing_mooncake_says_how_to_install_it_from_the_checkout(monkeypatch, capsys):
    from hostkv_rs.l3.mooncake import _import_store_class
    from hostkv_rs.tools import cli

    monkeypatch.setitem(sys.modules, "mooncake.store", None)  # as if not installed
    with pytest.raises(ImportError, match=r'pip install "\.\[mooncake\]"'):
        _import_store_class()
    rc = cli.main(["demo", "--l3", "mooncake", "--layers", "2", "--pages", "2"])
    captured = capsys.readouterr()
    assert rc == 2
    assert 'pip install ".[mooncake]"' in captured.err
    assert "hostkv-rs[mooncake]" not in captured.err
    assert captured.out == ""  # refused before the demo started


def test_probe_fails_fast_in_one_line_naming_the_address():
    from hostkv_rs.l3 import StoreUnavailable, _native
    from hostkv_rs.l3.master import free_port

    nobody = f"127.0.0.1:{free_port()}"
    t0 = time.perf_counter()
    with pytest.raises(StoreUnavailable) as caught:
        _native.probe(nobody, "http://127.0.0.1:1/metadata", timeout=2.0)
    assert time.perf_counter() - t0 < 5
    text = str(caught.value)
    assert f"Mooncake master {nobody} does not answer" in text and "\n" not in text
    metadata_down = pytest.raises(StoreUnavailable, match="server http://127.0.0.1:1/metadata")
    with metadata_down, _answering_rpc() as port:
        _native.probe(f"127.0.0.1:{port}", "http://127.0.0.1:1/metadata", timeout=2.0)
    with _answering_rpc() as port, _listening() as http:  # both answer
        _native.probe(f"127.0.0.1:{port}", f"http://127.0.0.1:{http}/metadata", timeout=2.0)
        _native.probe(f"127.0.0.1:{port}", "P2PHANDSHAKE")
        # The master's HTTP port given as its RPC port answers TCP, and Mooncake's setup would
        # then wait forever: refused by name before any connection.
        with pytest.raises(StoreUnavailable, match="is the metadata server's HTTP port"):
            _native.probe(f"127.0.0.1:{http}", f"http://127.0.0.1:{http}/metadata")


@pytest.mark.parametrize(
    "master", [":::", "127.0.0.1:-1", "127.0.0.1:99999", "127.0.0.1:", ":50051"]
)
def test_a_master_address_that_is_not_host_port_is_refused_by_name(master):
    # No probe can check such an address, and Mooncake's setup against it waited for good.
    from hostkv_rs.l3 import StoreUnavailable, _native

    with pytest.raises(StoreUnavailable, match="is not HOST:PORT with a port in"):
        _native.probe(master, "P2PHANDSHAKE", timeout=1.0)
    with pytest.raises(StoreUnavailable, match="is not HOST:PORT with a port in"):
        _native.refuse_metadata_port_as_master(master, "http://127.0.0.1:1/metadata")


def test_probe_refuses_an_open_port_that_is_not_a_masters_rpc_port():
    # Mooncake's setup against such a port waits for an RPC reply forever, holding the GIL: the
    # probe asks the port an RPC question first and refuses what does not answer as a master.
    from hostkv_rs.l3 import StoreUnavailable, _native

    with _listening() as silent:
        t0 = time.perf_counter()
        with pytest.raises(StoreUnavailable, match="sent no Mooncake RPC reply within 1 s"):
            _native.probe(f"127.0.0.1:{silent}", "P2PHANDSHAKE", timeout=1.0)
        assert time.perf_counter() - t0 < 4
    with _answering(b"HTTP/1.1 400 Bad Request\r\n\r\n") as http:
        with pytest.raises(StoreUnavailable, match="not as a Mooncake master's RPC port") as caught:
            _native.probe(f"127.0.0.1:{http}", "P2PHANDSHAKE", timeout=2.0)
        assert f"Mooncake master 127.0.0.1:{http} does not answer" in str(caught.value)
    hung_up = pytest.raises(StoreUnavailable, match="closed the connection without a Mooncake RPC")
    with _answering(b"") as closing, hung_up:  # accepts, then hangs up
        _native.probe(f"127.0.0.1:{closing}", "P2PHANDSHAKE", timeout=2.0)


@needs_mooncake
def test_connect_to_an_open_port_that_is_not_a_master_ends_in_a_clear_error(tmp_path):
    # Without the RPC question this call never returned (Mooncake's setup waits with the GIL
    # held, so no Python deadline can end it): run it in a child with a watchdog.
    script = tmp_path / "connect.py"
    script.write_text(
        "import socket, sys\n"
        "from hostkv_rs.l3 import MooncakeTier, StoreUnavailable\n"
        "s = socket.socket(); s.bind(('127.0.0.1', 0)); s.listen(4)\n"
        "port = s.getsockname()[1]\n"
        "try:\n"
        "    MooncakeTier.connect(f'127.0.0.1:{port}', 'P2PHANDSHAKE', probe_timeout=1.0)\n"
        "except StoreUnavailable as exc:\n"
        "    print('refused:', exc)\n"
        "    sys.exit(0)\n"
        "sys.exit(3)\n"
    )
    done = subprocess.run(
        [sys.executable, str(script)], check=False, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "sent no Mooncake RPC reply within 1 s" in done.stdout


@needs_mooncake
def test_the_metadata_port_given_as_the_master_is_refused_with_the_probe_off():
    # The check is on the text alone: connect makes it without the probe too (Mooncake's setup
    # would wait forever on that port, holding the GIL).
    from hostkv_rs.l3 import MooncakeTier, StoreUnavailable

    with _listening() as http, pytest.raises(StoreUnavailable, match="metadata server's HTTP"):
        MooncakeTier.connect(
            f"127.0.0.1:{http}", f"http://127.0.0.1:{http}/metadata", probe_timeout=None
        )


def _listening():
    import contextlib
    import socket

    @contextlib.contextmanager
    def server():
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        sock.listen(4)
        try:
            yield sock.getsockname()[1]
        finally:
            sock.close()

    return server()


def _answering(reply: bytes):
    """A loopback port that accepts connections, reads what comes, sends `reply` and hangs up."""
    import contextlib
    import socket
    import threading

    @contextlib.contextmanager
    def server():
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        sock.listen(4)
        sock.settimeout(0.2)
        stop = threading.Event()

        def serve():
            while not stop.is_set():
                try:
                    conn, _ = sock.accept()
                except OSError:
                    continue
                with conn:
                    conn.settimeout(1.0)
                    try:
                        conn.recv(64)
                        conn.sendall(reply)
                    except OSError:
                        pass

        thread = threading.Thread(target=serve, daemon=True)
        thread.start()
        try:
            yield sock.getsockname()[1]
        finally:
            stop.set()
            thread.join(5)
            sock.close()

    return server()


def _answering_rpc():
    """A port that answers as a Mooncake master's RPC port does: a coro_rpc error reply (magic 21,
    a 16-byte header) to any request."""
    import struct

    return _answering(struct.pack("<BBBBIII", 21, 0, 11, 0, 1, 0, 0))


NOISE = (
    "WARNING: Logging before InitGoogleLogging() is written to STDERR\n"
    "E1201 21:23:05.880000 18256 transfer_metadata_plugin.cpp:292] GET "
    "http://127.0.0.1:38267/metadata?key=mooncake%2Fram%2F127.0.0.1%3A14217 http=404 body: "
    "metadata not found\n"
)
REAL = "E1201 21:29:34.597780 31958 master_client.cpp:361] Client not available\n"


def test_native_stderr_filter_drops_only_the_known_noise(capfd, monkeypatch):
    from hostkv_rs.l3 import _native

    monkeypatch.delenv(_native.LOG_ENV, raising=False)
    with _native.filtered_stderr():
        os.write(2, (NOISE + REAL).encode())
    assert capfd.readouterr().err == REAL
    monkeypatch.setenv(_native.LOG_ENV, "1")  # the user asked for Mooncake's own logging
    with _native.filtered_stderr():
        os.write(2, (NOISE + REAL).encode())
    assert capfd.readouterr().err == NOISE + REAL


def test_mooncake_log_level_defaults_to_error_unless_asked(monkeypatch):
    from hostkv_rs.l3 import _native

    for env, expected in (
        ({}, "ERROR"),
        ({"MC_LOG_LEVEL": "INFO"}, "INFO"),  # the user's own setting wins
        ({_native.LOG_ENV: "info"}, "INFO"),
        ({_native.LOG_ENV: "1"}, None),  # Mooncake's default
    ):
        monkeypatch.delenv("MC_LOG_LEVEL", raising=False)
        monkeypatch.delenv(_native.LOG_ENV, raising=False)
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        _native.quiet_logging_env()
        assert os.environ.get("MC_LOG_LEVEL") == expected, env


def test_tags_tell_fp8_variants_mla_splits_and_models_apart():
    e4m3, e5m2 = (
        make_mha("page_first", dtype=d)[0] for d in (torch.float8_e4m3fn, torch.float8_e5m2)
    )
    assert e4m3.dtype == e5m2.dtype == torch.uint8  # the storage dtype cannot tell them apart
    tags = {page_format(e4m3).tag, page_format(e5m2).tag}
    assert len(tags) == 2 and {"float8_e4m3fn", "float8_e5m2"} <= {
        field for tag in tags for field in tag.split("-")
    }
    splits = [make_mla("page_first", kv_lora_rank=r, rope=q)[0] for r, q in ((12, 4), (8, 8))]
    assert splits[0].kv_cache_dim == splits[1].kv_cache_dim  # same bytes per token, and yet:
    formats = [page_format(p) for p in splits]
    assert formats[0].page_bytes == formats[1].page_bytes
    assert formats[0].tag != formats[1].tag
    assert "-lora12-rope4-" in formats[0].tag and "-lora8-rope8-" in formats[1].tag
    pool = splits[0]
    by_model = {m: page_format(pool, model_id=m) for m in ("org/a", "org/b")}
    assert by_model["org/a"].tag != by_model["org/b"].tag != page_format(pool).tag
    assert page_format(pool).tag.endswith("-mnone") and page_format(pool).model_id is None
    assert by_model["org/a"].identity != by_model["org/b"].identity
    assert page_format(pool, model_id="org/a").tag == by_model["org/a"].tag  # deterministic
    # a dtype the caller names for a uint8 pool that cannot say (0.5.23 buffer infos)
    e4m3.device_pool = types.SimpleNamespace()
    assert page_format(e4m3).dtype_known is False
    assert page_format(e4m3, kv_dtype=torch.float8_e5m2).tag == page_format(e5m2).tag
    with pytest.raises(ValueError, match="model_id"):
        page_format(pool, model_id="")


def test_the_sglang_servers_model_path_and_kv_dtype_name_the_pages(monkeypatch):
    args = types.SimpleNamespace(
        model_path="org/llama", revision="r1", quantization=None, kv_cache_dtype="fp8_e5m2"
    )
    context = types.ModuleType("sglang.srt.runtime_context")
    context.get_server_args = lambda: args
    for name in ("sglang", "sglang.srt"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "sglang.srt.runtime_context", context)
    pool = make_mha("page_first", dtype=torch.float8_e5m2)[0]
    fmt = page_format(pool)
    assert fmt.model_id == "org/llama@r1"
    assert fmt.tag == page_format(pool, model_id="org/llama@r1").tag
    assert page_format(pool, model_id="other").model_id == "other"  # the caller's wins
    pool.device_pool = types.SimpleNamespace()  # a buffer info's pool: only uint8 is known
    assert page_format(pool).tag == fmt.tag and page_format(pool).dtype_known
    args.model_path = None  # not published: no identity, no error
    assert page_format(pool).model_id is None


def test_the_proof_header_round_trips_and_names_each_failure():
    from hostkv_rs.l3 import proof

    headers = proof.Headers(2)
    ours = proof.text_digest("model\ntag").to_bytes(16, "little")
    proof.encode(headers.view, 64, 4096, ours, 12345)
    assert proof.decode(headers.view, 64, 4096, ours) == (None, 12345)
    assert proof.decode(headers.view, 64, 4096, bytes(16)) == (proof.IDENTITY, None)
    assert proof.decode(headers.view, 64, 4095, ours)[0] == proof.FOREIGN
    assert proof.decode(headers.view, 0, 4096, ours)[0] == proof.FOREIGN  # zeros: not ours
    for at in (0, 9, 17, 30, 45, 60):  # any damaged byte: never a proof of something else
        damaged = proof.Headers(1)
        damaged.array[:] = headers.array[64:]
        damaged.array[at] ^= 0x10
        kind, digest = proof.decode(damaged.view, 0, 4096, ours)
        assert kind is not None or digest != 12345, at
    with pytest.raises(IndexError):
        headers.slot(2)


def test_page_digests_read_only_the_pools_own_memory():
    from hostkv_rs.l3 import proof
    from hostkv_rs.l3.format import _host_allocations

    pool = POOLS["mha-layer_first"]()
    fill(pool, 4)
    memory = proof.PoolBytes(_host_allocations(pool))
    ptrs, sizes = pool.get_page_buffer_meta(slots(pool, [2]))
    pieces = memory.pieces((ptrs, sizes))
    assert b"".join(p.tobytes() for p in pieces) == page_bytes(pool, 2)
    from hostkv_rs import _core

    key = "k2@tag"
    want = _core.digest([len(key).to_bytes(8, "little") + key.encode() + page_bytes(pool, 2)])
    assert proof.page_digest(memory, (ptrs, sizes), key) == want
    assert proof.page_digest(memory, (ptrs, sizes), "k3@tag") != want  # the key is proven too
    memory.check(ptrs, sizes)
    end = host_buffers(pool)[-1]
    for ptr, size in ((end[0] + end[1] - 8, 16), (host_buffers(pool)[0][0] - 64, 16)):
        with pytest.raises(ValueError, match="outside the pool's host memory"):
            memory.piece(ptr, size)
        with pytest.raises(ValueError, match="outside the pool's host memory"):
            memory.check([*ptrs, ptr], [*sizes, size])
        with pytest.raises(ValueError, match="outside the pool's host memory"):
            memory.pieces(([*ptrs, ptr], [*sizes, size]))
    # A buffer whose end wraps past 2**64 (its start past every allocation) is outside too.
    wraps = (2**64 - 16, 32)
    with pytest.raises(ValueError, match="outside the pool's host memory"):
        memory.check([*ptrs, wraps[0]], [*sizes, wraps[1]])
    with pytest.raises(ValueError, match="outside the pool's host memory"):
        memory.piece(*wraps)
    for ptr, size in ((-1, 16), (ptrs[0], 2**63)):
        with pytest.raises(ValueError, match=r"addresses in \[0, 2\*\*64\)"):
            memory.check([ptr], [size])


# ----------------------------------------------------------------- a real store


_SESSION_MASTERS: set[int] = set()  # stopped when the session ends, not by a test


@pytest.fixture(scope="session")
def master():
    from hostkv_rs.l3.master import LoopbackMaster

    m = LoopbackMaster.start()
    _SESSION_MASTERS.add(m.pid)
    yield m
    m.stop()
    m.remove_log()


@pytest.fixture(scope="session")
def clients(master):
    """Two clients as two servers would have: `a` contributes a 256 MiB segment, `b` none."""
    from hostkv_rs.l3 import MooncakeTier

    a = MooncakeTier.connect(master.address, master.metadata_server, global_segment_size=256 << 20)
    b = MooncakeTier.connect(master.address, master.metadata_server, global_segment_size=0)
    yield a, b
    a.close()
    b.close()


@pytest.fixture
def tiers(clients):
    a, b = clients
    yield a, b
    a.detach()
    b.detach()


def fresh_keys(n: int) -> list[str]:
    base = uuid.uuid4().hex
    return [f"{base}-{i}" for i in range(n)]


def statuses(results) -> list[str]:
    assert all(isinstance(r, PageResult) for r in results)
    return [r.status.value for r in results]


@needs_mooncake
@pytest.mark.parametrize("case", list(POOLS))
def test_every_pool_round_trips_byte_exact(tiers, case):
    a, b = tiers
    src, dst = POOLS[case](), POOLS[case]()
    fill(src, 1)
    fill(dst, 2)
    a.attach(src)
    b.attach(dst)
    keys = fresh_keys(len(SRC_PAGES))
    assert statuses(a.save(keys, slots(src, SRC_PAGES))) == ["stored"] * 3
    assert statuses(a.save(keys, slots(src, SRC_PAGES))) == ["skipped"] * 3
    assert b.exists(keys) == [True] * 3

    before = snapshot(dst)
    missing = "never-saved-" + keys[0]
    got = b.load(
        [keys[0], missing, keys[1], keys[2]], slots(dst, [DST_PAGES[0], 3, *DST_PAGES[1:]])
    )
    assert statuses(got) == ["loaded", "missing", "loaded", "loaded"]
    want = {d: page_bytes(src, s) for s, d in zip(SRC_PAGES, DST_PAGES)}
    assert snapshot(dst) == with_pages(dst, before, want), "bytes outside the loaded pages moved"
    for s, d in zip(SRC_PAGES, DST_PAGES):
        assert page_bytes(dst, d) == page_bytes(src, s)
        if not case.startswith("mha-asym"):  # the asymmetric pool has no flat pages (SGLang)
            as_bytes = [
                p.get_data_page(slots(p, [g])[0].item()).view(torch.uint8)
                for p, g in ((src, s), (dst, d))
            ]
            assert torch.equal(*as_bytes)


@needs_mooncake
def test_a_fresh_pool_in_another_process_restores_by_key(tiers, master):
    a, _ = tiers
    plan, expected = {}, {}
    for case, build in POOLS.items():
        src = build()
        fill(src, 5)
        a.attach(src)
        keys = fresh_keys(len(SRC_PAGES))
        assert all(a.save(keys, slots(src, SRC_PAGES)))
        a.detach()
        plan[case] = keys
        expected[case] = [digest(page_bytes(src, p)) for p in SRC_PAGES]
    worker = subprocess.run(
        [sys.executable, SUPPORT, "restore", master.address, master.metadata_server],
        input=json.dumps(plan) + "\n",
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert worker.returncode == 0, worker.stdout[-2000:] + worker.stderr[-4000:]
    report = json.loads(worker.stdout.strip().splitlines()[-1])
    for case in POOLS:
        assert report[case]["results"] == ["loaded"] * 3, case
        assert report[case]["digests"] == expected[case], case


@needs_mooncake
@pytest.mark.parametrize(
    "saver,loader",
    [
        ("mha-page_first", "mha-page_first_direct"),  # same bytes per page, another order
        ("mha-page_first_direct", "mha-page_head"),
        ("mla-page_first", "mla-page_first_direct"),
        ("mla-dcp2-rank1-layer_first", "mla-layer_first"),
        ("v4-page_first", "v4-page_first_direct"),
    ],
)
def test_another_layout_misses_instead_of_loading_wrong_bytes(tiers, saver, loader):
    a, b = tiers
    src, dst = POOLS[saver](), POOLS[loader]()
    fill(src, 1)
    fill(dst, 2)
    a.attach(src)
    b.attach(dst)
    keys = fresh_keys(2)
    assert all(a.save(keys, slots(src, [1, 2])))
    before = snapshot(dst)
    assert b.exists(keys) == [False, False]
    assert statuses(b.load(keys, slots(dst, [3, 4]))) == ["missing", "missing"]
    assert snapshot(dst) == before


@needs_mooncake
@pytest.mark.parametrize(
    "other",
    [
        {"heads": 1, "head_dim": 16},  # same page bytes, other heads
        {"dtype": torch.float16},  # same page bytes, other dtype
        {"layers": 4},
    ],
)
def test_another_geometry_or_shard_misses(tiers, other):
    a, b = tiers
    src = make_mha("page_first")[0]
    dst = make_mha("page_first", **other)[0]
    fill(src, 1)
    a.attach(src)
    b.attach(dst)
    keys = fresh_keys(1)
    assert all(a.save(keys, slots(src, [1])))
    assert statuses(b.load(keys, slots(dst, [2]))) == ["missing"]


@needs_mooncake
def test_another_tp_rank_misses(clients, master):
    from hostkv_rs.l3 import MooncakeTier

    a, _ = clients
    rank1 = MooncakeTier(a.store, tp_rank=1, tp_size=2)
    src, dst = POOLS["mha-page_head"](), POOLS["mha-page_head"]()
    try:
        a.attach(src)
        keys = fresh_keys(1)
        assert all(a.save(keys, slots(src, [1])))
        a.detach()
        rank1.attach(dst)
        assert statuses(rank1.load(keys, slots(dst, [1]))) == ["missing"]
    finally:
        a.detach()
        rank1.detach()


@needs_mooncake
@pytest.mark.parametrize("case", ["mha-page_first", "mha-layer_first", "mla-page_first_direct"])
def test_an_object_of_the_wrong_size_is_no_hit_and_is_replaced_on_save(tiers, case):
    a, b = tiers
    src, dst = POOLS[case](), POOLS[case]()
    fill(src, 1)
    fill(dst, 2)
    a.attach(src)
    b.attach(dst)
    short, long_ = fresh_keys(2)
    page = a.format.page_bytes
    assert a.store.put(a.key(short), b"x" * (page - 1)) == 0
    assert a.store.put(a.key(long_), b"y" * (page + 8)) == 0
    before = snapshot(dst)
    assert b.exists([short, long_]) == [False, False]
    got = b.load([short, long_], slots(dst, [3, 4]))
    assert statuses(got) == ["wrong_size", "wrong_size"]
    assert snapshot(dst) == before, "a wrong-size object touched the pool"
    # saving the real pages replaces the bad objects
    assert statuses(a.save([short, long_], slots(src, [1, 2]))) == ["stored", "stored"]
    assert all(b.load([short, long_], slots(dst, [3, 4])))
    assert page_bytes(dst, 3) == page_bytes(src, 1)
    assert page_bytes(dst, 4) == page_bytes(src, 2)


@needs_mooncake
def test_remove_reports_each_page(tiers):
    a, b = tiers
    src, dst = POOLS["mla-layer_first"](), POOLS["mla-layer_first"]()
    a.attach(src)
    b.attach(dst)
    keys = fresh_keys(2)
    assert all(a.save(keys, slots(src, [1, 2])))
    assert all(b.load(keys, slots(dst, [1, 2])))  # a read leases the objects for a while
    assert statuses(a.remove(keys)) == ["busy", "busy"]
    assert statuses(a.remove([*keys, "nope-" + keys[0]], force=True)) == [
        "removed",
        "removed",
        "missing",
    ]
    assert b.exists(keys) == [False, False]
    assert statuses(b.load(keys, slots(dst, [3, 4]))) == ["missing", "missing"]


@needs_mooncake
def test_a_full_store_reports_full_pages_and_keeps_the_rest_exact():
    from hostkv_rs.l3 import MooncakeTier
    from hostkv_rs.l3.master import LoopbackMaster

    def big():  # 2 MiB pages, 17 of them
        return make_mha("page_first", 64, heads=8, head_dim=128, layers=8, device_pages=8)[0]

    src, dst = big(), big()
    fill(src, 1)
    fill(dst, 2)
    # the client's segment is the whole store: 16 MiB (Mooncake's minimum), < 8 pages
    with (
        LoopbackMaster.start() as m,
        MooncakeTier.connect(m.address, m.metadata_server, global_segment_size=16 << 20) as t,
    ):
        t.attach(src)
        pages = list(range(16))
        keys = fresh_keys(len(pages))
        saved = t.save(keys, slots(src, pages))
        kinds = set(statuses(saved))
        assert kinds <= {"stored", "full"}, saved
        assert "full" in kinds and "stored" in kinds, saved
        assert all(r.code == -200 for r in saved if r.status is Status.FULL)
        t.detach()
        t.attach(dst)
        before = snapshot(dst)
        got = t.load(keys, slots(dst, pages))
        loaded = {p: page_bytes(src, p) for p, r in zip(pages, got) if r}
        for r, s in zip(got, saved):
            assert r.status in (Status.LOADED, Status.MISSING), got  # evicted at most
            assert not (r.status is Status.LOADED and s.status is Status.FULL)
        assert loaded, got
        assert snapshot(dst) == with_pages(dst, before, loaded)


@needs_mooncake
def test_master_stopped_mid_run_gives_a_clear_error_and_leaves_the_pool_unchanged():
    from hostkv_rs.l3.master import LoopbackMaster

    m = LoopbackMaster.start()
    worker = subprocess.Popen(
        [sys.executable, SUPPORT, "master-stop", m.address, m.metadata_server],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        first = json.loads(worker.stdout.readline() or "{}")
        assert first.get("saved") == ["stored"] * 3, first
        m.stop()  # by its pid, SIGTERM
        assert not m.running()
        worker.stdin.write("go\n")
        worker.stdin.flush()
        out, err = worker.communicate(timeout=120)
    finally:
        if worker.poll() is None:
            worker.kill()
        m.stop()
        m.remove_log()
    assert worker.returncode == 0, out[-2000:] + err[-4000:]
    report = json.loads(out.strip().splitlines()[-1])
    for op in ("load", "exists", "save"):
        assert "error" in report[op], (op, report[op])
        assert "did not answer" in report[op]["error"] and m.address in report[op]["error"]
    assert report["dst_unchanged"] is True


@needs_mooncake
def test_attach_destroy_attach_at_the_same_addresses_100_times(clients):
    a, _ = clients
    first = None
    reused = 0
    keys = fresh_keys(1)
    for i in range(100):
        pool = make_mha("page_first")[0]
        address = host_buffers(pool)[0][0]
        first = address if first is None else first
        reused += address == first
        a.attach(pool)
        results = a.save(keys, slots(pool, [1]))
        assert statuses(results) == ["stored" if i == 0 else "skipped"]
        assert all(a.load(keys, slots(pool, [2])))
        if i % 2:
            pool.destroy()  # detaches through the destroy hook
            assert not a.attached
        del pool  # even iterations: garbage collection detaches
        gc.collect()
        assert not a.attached
    assert reused >= 10, f"the allocator reused the first address only {reused} times"


@needs_mooncake
def test_without_detaching_the_next_pool_at_the_same_addresses_is_refused(clients):
    """The hazard the tier's detach hooks exist for, shown on the raw client."""
    a, _ = clients
    pool = make_mha("page_first")[0]
    address, nbytes = host_buffers(pool)[0]
    assert a.store.register_buffer(address, nbytes) == 0
    del pool
    gc.collect()
    again = make_mha("page_first")[0]
    try:
        if host_buffers(again)[0][0] != address:
            pytest.skip("the allocator placed the next pool elsewhere this time")
        assert a.store.register_buffer(*host_buffers(again)[0]) != 0
    finally:
        a.store.unregister_buffer(address)
    a.attach(again)  # fine once the stale registration is gone
    a.detach()


@needs_mooncake
def test_attach_refuses_a_second_pool_and_operations_need_one(tiers):
    a, _ = tiers
    from hostkv_rs.l3 import L3Error

    with pytest.raises(L3Error, match="no pool is attached"):
        a.load(["k"], torch.arange(16))
    a.attach(POOLS["mha-page_first"]())  # a temporary: collected at once, which detaches
    gc.collect()
    assert not a.attached
    pool = POOLS["mha-page_first"]()
    a.attach(pool)
    with pytest.raises(L3Error, match="already has a pool attached"):
        a.attach(POOLS["mla-page_first"]())
    with pytest.raises(ValueError, match="host indices"):
        a.save(["k"], torch.arange(8))
    with pytest.raises(ValueError, match="whole pages"):
        a.save(["k"], torch.arange(16).flip(0))
    a.detach()
    with pytest.raises(ValueError, match="no KV bytes"):
        a.attach(LogicalHostPool(64, 16))


@needs_mooncake
def test_large_batches_are_split_and_stay_exact(clients):
    from hostkv_rs.l3 import MooncakeTier

    a, b = clients
    small_a = MooncakeTier(a.store, max_batch_bytes=1)  # one page per store call
    src, dst = POOLS["mha-layer_first"](), POOLS["mha-layer_first"]()
    fill(src, 3)
    try:
        small_a.attach(src)
        b.attach(dst)
        keys = fresh_keys(4)
        t0 = time.perf_counter()
        assert statuses(small_a.save(keys, slots(src, [1, 2, 3, 4]))) == ["stored"] * 4
        assert all(b.load(keys, slots(dst, [5, 6, 7, 8])))
        assert time.perf_counter() - t0 < 30
        for s, d in zip([1, 2, 3, 4], [5, 6, 7, 8]):
            assert page_bytes(dst, d) == page_bytes(src, s)
    finally:
        small_a.detach()
        b.detach()


def test_load_runs_cover_the_batch_in_order_and_end_in_one_page(monkeypatch):
    from hostkv_rs.l3 import mooncake

    monkeypatch.setattr(mooncake, "OVERLAP_BYTES", 4 << 20)
    runs = mooncake.MooncakeTier._groups
    idx = list(range(100, 132))
    # 32 pages of 1 MiB: runs of 4 pages, the last one split in halves down to one page
    got = runs(idx, 1 << 20)
    assert [x for run in got for x in run] == idx
    assert [len(run) for run in got] == [4] * 7 + [2, 1, 1]
    # pages larger than a run: one page a run
    assert [len(run) for run in runs(idx[:5], 16 << 20)] == [1] * 5
    # a batch under SPLIT_BYTES is one store call
    assert runs(idx[:3], 1 << 20) == [idx[:3]]


@needs_mooncake
def test_pages_hashed_out_of_step_with_the_store_save_and_load_whole(make_tier, monkeypatch):
    """The save puts whatever run of pages is already hashed, the load splits its batch. Here
    three hashing threads finish the first page last: the first put waits for it, then takes
    runs of the pages already hashed (two a run at most here); every page still lands whole,
    once, in order, behind its own proof, and a small batch stays one store call."""
    import concurrent.futures
    import threading

    from hostkv_rs.l3 import mooncake, proof

    page = POOLS["mha-page_first"]()
    monkeypatch.setattr(mooncake, "OVERLAP_BYTES", 2 * page_format(page).object_bytes)
    monkeypatch.setattr(mooncake, "SPLIT_BYTES", 1)
    real, first = proof.page_digest, threading.Event()

    def first_page_last(memory, pages, key):
        if not first.is_set():
            first.set()
            time.sleep(0.2)  # the other threads hash every later page meanwhile
        return real(memory, pages, key)

    hashers = concurrent.futures.ThreadPoolExecutor(max_workers=3)
    monkeypatch.setattr(proof, "page_digest", first_page_last)
    monkeypatch.setattr(proof, "hasher", lambda: hashers)
    src, dst = page, POOLS["mha-page_first"]()
    a, b = make_tier("a"), make_tier("b")
    fill(src, 5)
    fill(dst, 6)
    a.attach(src)
    b.attach(dst)
    runs = []
    put_group = a._put_group
    monkeypatch.setattr(
        a,
        "_put_group",
        lambda op, group, results: runs.append(list(group)) or put_group(op, group, results),
    )
    pages = [1, 3, 4, 0, 2]
    keys = fresh_keys(len(pages))
    try:
        assert statuses(a.save(keys, slots(src, pages))) == ["stored"] * len(pages)
        assert runs == [[0, 1], [2, 3], [4]], runs
        got = b.load(keys, slots(dst, [5, 6, 7, 2, 0]))
        assert statuses(got) == ["loaded"] * len(pages)
        for s, d in zip(pages, [5, 6, 7, 2, 0]):
            assert page_bytes(dst, d) == page_bytes(src, s)
        assert b.mismatches == {}
        # a batch under SPLIT_BYTES is one store call, whatever the hashes' pace
        monkeypatch.setattr(mooncake, "SPLIT_BYTES", 8 << 20)
        runs.clear()
        first.clear()
        assert statuses(a.save(fresh_keys(3), slots(src, [1, 3, 4]))) == ["stored"] * 3
        assert [len(run) for run in runs] == [3]
    finally:
        hashers.shutdown()


@needs_mooncake
@pytest.mark.parametrize("preset", ["llama-3.1-8b", "deepseek-v3"])
def test_demo_l3_mooncake_round_trips_and_verifies_every_byte(capsys, preset):
    from hostkv_rs.tools import cli

    rc = cli.main(["demo", "--preset", preset, "--l3", "mooncake", "--layers", "3", "--pages", "4"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "l3 master   : mooncake_master on 127.0.0.1:" in out
    assert "l3 put      : 2 pages" in out and "GB/s" in out
    verify = next(line for line in out.splitlines() if "l3 verify" in line)
    assert ", 0 failed page operations" in verify
    moved = int(verify.split(" of ")[1].split()[0])
    assert verify.split(":")[1].split()[0] == str(moved) and moved > 0
    assert out.rstrip().endswith("result      : verified OK")


@needs_mooncake
def test_connect_to_a_master_that_does_not_answer_fails_in_seconds():
    from hostkv_rs.l3 import MooncakeTier, StoreUnavailable
    from hostkv_rs.l3.master import free_port

    nobody, metadata = f"127.0.0.1:{free_port()}", f"http://127.0.0.1:{free_port()}/metadata"
    t0 = time.perf_counter()
    with pytest.raises(StoreUnavailable, match=f"Mooncake master {nobody} does not answer"):
        MooncakeTier.connect(nobody, metadata, global_segment_size=0)
    assert time.perf_counter() - t0 < 10  # Mooncake's own retries take ~100 s


@needs_mooncake
def test_demo_with_a_wrong_master_fails_fast_in_one_line(capsys):
    from hostkv_rs.l3.master import free_port
    from hostkv_rs.tools import cli

    nobody = f"127.0.0.1:{free_port()}"
    t0 = time.perf_counter()
    rc = cli.main(["demo", "--l3", "mooncake", "--l3-master", nobody, "--layers", "2"])
    captured = capsys.readouterr()
    assert time.perf_counter() - t0 < 10
    assert rc == 2
    assert captured.err.count("\n") == 1, captured.err
    assert captured.err.startswith(f"hostkv-rs demo: error: Mooncake master {nobody} does not")
    assert captured.out == ""  # nothing allocated or printed before the check


@needs_mooncake
def test_a_client_setup_prints_nothing_unless_asked(capfd, monkeypatch, master):
    from hostkv_rs.l3 import MooncakeTier, _native

    monkeypatch.delenv(_native.LOG_ENV, raising=False)
    tier = MooncakeTier.connect(master.address, master.metadata_server, global_segment_size=0)
    tier.close()
    quiet = capfd.readouterr().err
    assert "metadata not found" not in quiet and "InitGoogleLogging" not in quiet, quiet
    monkeypatch.setenv(_native.LOG_ENV, "error")
    tier = MooncakeTier.connect(master.address, master.metadata_server, global_segment_size=0)
    tier.close()
    assert "http=404 body: metadata not found" in capfd.readouterr().err


@needs_mooncake
def test_demo_l3_mooncake_is_quiet_when_it_works():
    env = {k: v for k, v in os.environ.items() if k not in ("MC_LOG_LEVEL", "HOSTKV_MOONCAKE_LOG")}
    env.setdefault("OMP_NUM_THREADS", "2")
    proc = subprocess.run(
        [sys.executable, "-m", "hostkv_rs", "demo", "--l3", "mooncake", "--layers", "2"],
        capture_output=True,
        text=True,
        timeout=180,
        env=env,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "result      : verified OK" in proc.stdout
    assert proc.stderr == ""


@pytest.fixture
def make_tier(clients):
    """Fresh tiers (counters at zero) over the session's clients: `make_tier("a" | "b", ...)`."""
    from hostkv_rs.l3 import MooncakeTier

    made = []

    def make(which: str, **kwargs):
        client = dict(zip("ab", clients))[which]
        tier = MooncakeTier(client.store, master=client.master, **kwargs)
        made.append(tier)
        return tier

    yield make
    for tier in made:
        tier.detach()


def _round(make_tier, saver_pool, loader_pool, saver_kwargs=None, loader_kwargs=None, n=2):
    """Save pages 1.. of `saver_pool` through client a, load them through client b into pages
    3.. of `loader_pool`: (keys, load statuses, loader tier)."""
    a = make_tier("a", **(saver_kwargs or {}))
    b = make_tier("b", **(loader_kwargs or {}))
    fill(saver_pool, 1)
    fill(loader_pool, 2)
    a.attach(saver_pool)
    b.attach(loader_pool)
    keys = fresh_keys(n)
    assert statuses(a.save(keys, slots(saver_pool, range(1, 1 + n)))) == ["stored"] * n
    before = snapshot(loader_pool)
    got = statuses(b.load(keys, slots(loader_pool, range(3, 3 + n))))
    return keys, got, b, before


@needs_mooncake
def test_fp8_e4m3fn_and_e5m2_pools_miss_each_other(make_tier):
    pair = (torch.float8_e4m3fn, torch.float8_e5m2)
    for saver, loader in (pair, pair[::-1]):
        src, dst = (make_mha("page_first", dtype=d)[0] for d in (saver, loader))
        _keys, got, _b, before = _round(make_tier, src, dst)
        assert got == ["missing", "missing"], (saver, loader)
        assert snapshot(dst) == before


@needs_mooncake
def test_mla_latent_and_rope_splits_of_the_same_width_miss_each_other(make_tier):
    splits = ((12, 4), (8, 8))
    for saver, loader in (splits, splits[::-1]):
        src = make_mla("layer_first", kv_lora_rank=saver[0], rope=saver[1])[0]
        dst = make_mla("layer_first", kv_lora_rank=loader[0], rope=loader[1])[0]
        assert page_format(src).page_bytes == page_format(dst).page_bytes
        _keys, got, _b, before = _round(make_tier, src, dst)
        assert got == ["missing", "missing"], (saver, loader)
        assert snapshot(dst) == before


@needs_mooncake
def test_pools_of_two_models_miss_each_other(make_tier):
    src, dst = POOLS["mha-page_first"](), POOLS["mha-page_first"]()
    _keys, got, b, before = _round(
        make_tier, src, dst, {"model_id": "org/model-a"}, {"model_id": "org/model-b"}
    )
    assert got == ["missing", "missing"]
    assert snapshot(dst) == before
    assert sum(b.mismatches.values()) == 0  # other keys: a plain miss, not a failed proof
    # the same model id: hits, byte-exact
    src, dst = POOLS["mha-page_first"](), POOLS["mha-page_first"]()
    _keys, got, _b, _ = _round(make_tier, src, dst, {"model_id": "m"}, {"model_id": "m"})
    assert got == ["loaded", "loaded"]
    assert page_bytes(dst, 3) == page_bytes(src, 1) and page_bytes(dst, 4) == page_bytes(src, 2)


def _raw_object(tier, key: str) -> bytearray:
    data = tier.store.get(tier.key(key))
    assert len(data) == tier.format.object_bytes
    return bytearray(data)


def _replace_raw(tier, key: str, data: bytes) -> None:
    """Put `data` under the tier's store key for `key` with a raw Mooncake call."""
    store_key = tier.key(key)
    tier.store.remove(store_key, True)
    assert tier.store.put(store_key, bytes(data)) == 0


@needs_mooncake
@pytest.mark.parametrize("case", ["mha-layer_first", "mla-page_first", "v4-page_first_direct"])
def test_a_foreign_object_of_the_right_size_is_a_counted_miss_and_the_page_is_zeroed(
    make_tier, case, caplog
):
    dst = POOLS[case]()
    fill(dst, 2)
    b = make_tier("b")
    b.attach(dst)
    keys = fresh_keys(2)
    size = b.format.object_bytes
    for k, byte in zip(keys, (b"x", b"\0")):
        assert b.store.put(b.key(k), byte * size) == 0
    assert b.exists(keys) == [True, True]  # the right size: only the proof tells
    before = snapshot(dst)
    with caplog.at_level("WARNING", logger="hostkv_rs.l3.mooncake"):
        got = b.load(keys, slots(dst, [3, 4]))
    assert statuses(got) == ["mismatch", "mismatch"] and not any(got)
    assert "zero-filled" in got[0].detail
    assert b.mismatches == {"foreign": 2}
    zero = bytes(b.format.page_bytes)
    assert snapshot(dst) == with_pages(dst, before, {3: zero, 4: zero})
    warned = [r for r in caplog.records if r.levelname == "WARNING" and "proof" in r.getMessage()]
    assert len(warned) == 1, [r.getMessage() for r in warned]  # once per tier and kind
    # the load removed them: the real pages are stored afresh
    assert b.exists(keys) == [False, False]
    src = POOLS[case]()
    fill(src, 5)
    a = make_tier("a")
    a.attach(src)
    assert statuses(a.save(keys, slots(src, [1, 2]))) == ["stored", "stored"]
    assert a.mismatches == {}
    assert all(b.load(keys, slots(dst, [3, 4])))
    assert page_bytes(dst, 3) == page_bytes(src, 1) and page_bytes(dst, 4) == page_bytes(src, 2)
    # one that a save finds first is replaced there (found, counted)
    (third,) = fresh_keys(1)
    assert a.store.put(a.key(third), b"x" * size) == 0
    assert statuses(a.save([third], slots(src, [3]))) == ["stored"]
    assert a.mismatches == {"foreign": 1}
    assert all(b.load([third], slots(dst, [5]))) and page_bytes(dst, 5) == page_bytes(src, 3)


@needs_mooncake
@pytest.mark.parametrize(
    "case", ["mha-page_first", "mha-layer_first", "mla-dcp2-rank1-layer_first"]
)
def test_a_corrupted_stored_object_is_a_miss(make_tier, case):
    src, dst = POOLS[case](), POOLS[case]()
    keys, got, b, before = _round(make_tier, src, dst, n=3)
    assert got == ["loaded"] * 3
    fmt = b.format
    header = 64
    page = _raw_object(b, keys[0])
    page[header + fmt.page_bytes - 1] ^= 0x01  # the page's last byte
    _replace_raw(b, keys[0], page)
    head = _raw_object(b, keys[1])
    head[45] ^= 0x80  # inside the stored digest
    _replace_raw(b, keys[1], head)
    fill(dst, 3)
    before = snapshot(dst)
    got = b.load(keys, slots(dst, [3, 4, 5]))
    assert statuses(got) == ["mismatch", "mismatch", "loaded"]
    assert b.mismatches == {"digest": 1, "foreign": 1}
    zero = bytes(fmt.page_bytes)
    want = with_pages(dst, before, {3: zero, 4: zero, 5: page_bytes(src, 3)})
    assert snapshot(dst) == want


@needs_mooncake
def test_an_object_of_another_identity_under_our_key_is_a_miss(make_tier):
    src, dst = POOLS["mla-page_first"](), POOLS["mla-page_first"]()
    keys, got, loader, _ = _round(make_tier, src, dst, {"model_id": "x"}, {"model_id": "x"}, n=1)
    assert got == ["loaded"]
    loader.detach()
    theirs = make_tier("a", model_id="x")
    their_pool = POOLS["mla-page_first"]()
    theirs.attach(their_pool)
    ours = make_tier("b", model_id="y")
    ours.attach(dst)
    # a well-formed object for model x copied under model y's key
    _replace_raw(ours, keys[0], _raw_object(theirs, keys[0]))
    got = ours.load(keys, slots(dst, [2]))
    assert statuses(got) == ["mismatch"] and ours.mismatches == {"identity": 1}
    assert page_bytes(dst, 2) == bytes(ours.format.page_bytes)


@needs_mooncake
def test_a_key_listed_twice_in_one_save_is_refused_and_nothing_is_stored(make_tier):
    pool = POOLS["mha-page_first"]()
    a = make_tier("a")
    a.attach(pool)
    k1, k2 = fresh_keys(2)
    with pytest.raises(ValueError, match=f"key '{k1}' is listed twice in one save"):
        a.save([k1, k2, k1], slots(pool, [1, 2, 3]))
    assert a.exists([k1, k2]) == [False, False]
    # A key that is not UTF-8 text (a lone surrogate) is refused by name in every operation.
    bad = k2 + "\udc80"
    for call in (
        lambda: a.save([k1, bad], slots(pool, [1, 2])),
        lambda: a.load([k1, bad], slots(pool, [1, 2])),
        lambda: a.exists([k1, bad]),
    ):
        with pytest.raises(ValueError, match="at position 1 is not UTF-8 text"):
            call()
    assert a.exists([k1, k2]) == [False, False]


@needs_mooncake
def test_a_key_or_a_page_listed_twice_in_one_load_is_refused_and_nothing_moves(make_tier):
    # Mooncake fills only one destination of a key named twice in one get and reports both.
    src, dst = POOLS["mha-page_first"](), POOLS["mha-page_first"]()
    keys, got, b, _ = _round(make_tier, src, dst, n=2)
    assert got == ["loaded", "loaded"]
    fill(dst, 7)
    before = snapshot(dst)
    with pytest.raises(ValueError, match=f"key '{keys[0]}' is listed twice in one load"):
        b.load([keys[0], keys[0]], slots(dst, [3, 4]))
    first = int(slots(dst, [3])[0])
    with pytest.raises(ValueError, match=f"page at host slot {first} is listed twice in one load"):
        b.load(keys, slots(dst, [3, 3]))
    # two runs that start inside pages overlap them: refused for every operation
    shifted = slots(dst, [3, 4]) + 1
    for call in (lambda: b.load(keys, shifted), lambda: b.save(fresh_keys(2), shifted)):
        with pytest.raises(ValueError, match="starting on a page boundary"):
            call()
    assert snapshot(dst) == before and sum(b.mismatches.values()) == 0
    assert b.exists(keys) == [True, True]


@needs_mooncake
def test_a_failed_object_is_removed_on_load_so_the_next_save_repairs_it(make_tier):
    # A corrupted body under an intact header: a save that finds its own digest in the header
    # would skip the page for good; the load that finds it removes it.
    src, dst = POOLS["mla-page_first"](), POOLS["mla-page_first"]()
    keys, got, b, _ = _round(make_tier, src, dst, n=1)
    assert got == ["loaded"]
    body = _raw_object(b, keys[0])
    body[-1] ^= 0x01
    _replace_raw(b, keys[0], body)
    assert statuses(b.load(keys, slots(dst, [3]))) == ["mismatch"]
    assert b.mismatches == {"digest": 1} and b.exists(keys) == [False]
    again = POOLS["mla-page_first"]()  # the same page again, from another pool of the writer's
    fill(again, 1)
    assert page_bytes(again, 1) == page_bytes(src, 1)
    saver = make_tier("a")
    saver.attach(again)
    assert statuses(saver.save(keys, slots(again, [1]))) == ["stored"]
    assert statuses(b.load(keys, slots(dst, [3]))) == ["loaded"]
    assert page_bytes(dst, 3) == page_bytes(src, 1)


@needs_mooncake
def test_an_intact_object_under_another_key_is_a_miss(make_tier):
    # The proof covers the object's key: a whole, well-formed page object of the same writer
    # copied under another key proves nothing about that key's page.
    src, dst = POOLS["mha-layer_first"](), POOLS["mha-layer_first"]()
    keys, got, b, _ = _round(make_tier, src, dst, n=2)
    assert got == ["loaded", "loaded"]
    _replace_raw(b, keys[1], _raw_object(b, keys[0]))
    got = b.load(keys, slots(dst, [3, 4]))
    assert statuses(got) == ["loaded", "mismatch"] and b.mismatches == {"digest": 1}
    assert page_bytes(dst, 3) == page_bytes(src, 1)
    assert page_bytes(dst, 4) == bytes(b.format.page_bytes)


def test_kv_dtype_names_only_what_the_pool_cannot_say():
    bf16 = make_mha("page_first", dtype=torch.bfloat16)[0]
    with pytest.raises(ValueError, match=r"kv_dtype=float16 contradicts .* \(bfloat16\)"):
        page_format(bf16, kv_dtype=torch.float16)
    # the same dtype in torch's or SGLang's --kv-cache-dtype spelling, or "auto": the same pages
    for same in (torch.bfloat16, "bfloat16", "bf16", "auto"):
        assert page_format(bf16, kv_dtype=same).tag == page_format(bf16).tag, same
    fp8 = make_mha("page_first", dtype=torch.float8_e4m3fn)[0]
    assert page_format(fp8, kv_dtype="fp8_e4m3").tag == page_format(fp8).tag
    with pytest.raises(ValueError, match="kv_dtype=float8_e5m2 contradicts"):
        page_format(fp8, kv_dtype="fp8_e5m2")


def test_a_page_format_knows_whether_its_tp_rank_was_named():
    assert not page_format(POOLS["mha-page_first"]()).tp_known
    assert page_format(POOLS["mha-page_first"](), tp_rank=0, tp_size=1).tp_known
    assert page_format(POOLS["mla-page_first"]()).tp_known  # latents are the same on every rank
    # unnamed is rank 0 of 1, as before
    assert (
        page_format(POOLS["mha-page_first"]()).tag
        == page_format(POOLS["mha-page_first"](), tp_rank=0, tp_size=1).tag
    )
    for rank, size in ((1, None), (None, 2), (2, 2), (-1, 2), ("x", 2), (0, float("inf"))):
        with pytest.raises(ValueError, match="tp_rank=.* must name a shard together"):
            page_format(POOLS["mha-page_first"](), tp_rank=rank, tp_size=size)


def test_pp_rank_and_namespace_are_checked_like_tp_rank():
    pool = POOLS["mha-page_first"]()
    assert "-pp1of2-" in page_format(pool, pp_rank=1, pp_size=2).tag
    for rank, size in ((-1, 1), (0, 0), (2, 2), (None, 1), (0, float("nan"))):
        with pytest.raises(ValueError, match="pp_rank=.* must name a shard together"):
            page_format(pool, pp_rank=rank, pp_size=size)
    with pytest.raises(TypeError, match="namespace must be a string, got object"):
        page_format(pool, namespace=object())
    assert page_format(pool, namespace=None).tag == page_format(pool).tag  # no prefix


def _attach_warnings(make_tier, caplog, case: str, **named) -> list[str]:
    """The tier's warnings while one unnamed tier attaches two `case` pools in turn and a tier
    given `named` attaches a third."""
    tier = make_tier("a")
    with caplog.at_level("WARNING", logger="hostkv_rs.l3.mooncake"):
        for _ in range(2):
            tier.attach(POOLS[case]())
            tier.detach()
        make_tier("a", **named).attach(POOLS[case]())
    return [r.getMessage() for r in caplog.records]


@needs_mooncake
def test_an_mha_pool_without_a_tp_rank_says_so_once(make_tier, caplog):
    logged = _attach_warnings(make_tier, caplog, "mha-page_first", tp_rank=0, tp_size=1)
    said = [m for m in logged if "carry no TP rank" in m]
    assert len(said) == 1 and "tp_rank=" in said[0]


@needs_mooncake
def test_a_second_writer_with_other_bytes_is_reported_not_skipped(make_tier, caplog):
    case = "mha-page_first_direct"
    first, second, dst = POOLS[case](), POOLS[case](), POOLS[case]()
    fill(first, 1)
    fill(second, 2)
    a, b, reader = make_tier("a"), make_tier("b"), make_tier("b")
    a.attach(first)
    b.attach(second)
    keys = fresh_keys(3)
    assert statuses(a.save(keys, slots(first, [1, 2, 3]))) == ["stored"] * 3
    # the second writer: one page the same as the first's, two with other bytes
    for (address, _n), data in zip(
        host_buffers(second), with_pages(second, snapshot(second), {2: page_bytes(first, 2)})
    ):
        ctypes.memmove(address, data, len(data))
    with caplog.at_level("WARNING", logger="hostkv_rs.l3.mooncake"):
        got = b.save(keys, slots(second, [1, 2, 3]))
        again = b.save(keys[:1], slots(second, [1]))
    assert statuses(got) == ["conflict", "skipped", "conflict"] and not got[0]
    assert statuses(again) == ["conflict"]
    assert b.second_writers == 3 and a.second_writers == 0
    warned = [r for r in caplog.records if "another writer" in r.getMessage()]
    assert len(warned) == 1
    assert warned[0].levelname == "WARNING" and keys[0] in warned[0].getMessage()
    # the first writer's pages are kept, whole
    reader.attach(dst)
    assert all(reader.load(keys, slots(dst, [4, 5, 6])))
    for s, d in zip([1, 2, 3], [4, 5, 6]):
        assert page_bytes(dst, d) == page_bytes(first, s)


@needs_mooncake
def test_pages_without_proof_never_mix_with_proven_ones(make_tier):
    src, dst = POOLS["mha-layer_first"](), POOLS["mha-layer_first"]()
    keys, got, _b, _ = _round(make_tier, src, dst, {"digests": False}, {"digests": False})
    assert got == ["loaded", "loaded"]  # the bare format round trips (what the bench compares)
    for d, s in zip([3, 4], [1, 2]):
        assert page_bytes(dst, d) == page_bytes(src, s)
    proven = make_tier("b")
    other = POOLS["mha-layer_first"]()
    proven.attach(other)
    assert statuses(proven.load(keys, slots(other, [1, 2]))) == ["missing", "missing"]


@needs_mooncake
def test_a_tier_without_a_model_identity_says_so_once(make_tier, caplog):
    logged = _attach_warnings(make_tier, caplog, "mla-page_first", model_id="org/m")
    said = [m for m in logged if "no model identity" in m]
    assert len(said) == 1 and "model_id=" in said[0]


# ----------------------------------------------------------------- no master left behind


def _gone(pid: int) -> bool:
    """No such process, or a zombie (dead, waiting for whoever inherited it to reap it)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except (FileNotFoundError, ProcessLookupError):
        return True
    return stat.rsplit(")", 1)[1].split()[0] == "Z"


def _wait_gone(pid: int, timeout: float = 15.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if _gone(pid):
            return True
        time.sleep(0.05)
    return _gone(pid)


def _reap(pid: int, log_path: str) -> None:
    """Test cleanup for a master a failing test left behind: that one pid, then its log."""
    if not _gone(pid):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    try:
        os.unlink(log_path)
    except OSError:
        pass


_STARTER = """
import sys, time
from hostkv_rs.l3.master import LoopbackMaster
m = LoopbackMaster.start()
print(m.pid, m.log_path, flush=True)
if sys.argv[1] == "sleep":
    time.sleep(600)
"""


def _start_in_child(mode: str) -> tuple[subprocess.Popen, int, str]:
    child = subprocess.Popen(
        [sys.executable, "-c", _STARTER, mode],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    line = child.stdout.readline().split()
    if len(line) != 2:
        child.kill()
        _out, err = child.communicate()
        pytest.fail(f"the child did not start a master: {err[-2000:]}")
    return child, int(line[0]), line[1]


@needs_mooncake
def test_a_master_dies_with_its_parent_when_that_is_killed():
    child, pid, log = _start_in_child("sleep")
    try:
        assert not _gone(pid)
        os.kill(child.pid, signal.SIGKILL)  # no atexit, no finally: only the kernel can help
        child.wait(timeout=30)
        assert _wait_gone(pid), f"mooncake_master {pid} outlived its SIGKILLed parent"
    finally:
        if child.poll() is None:
            child.kill()
        child.communicate()  # reaps it and closes the pipes
        _reap(pid, log)


@needs_mooncake
def test_a_master_never_stopped_is_stopped_when_its_process_exits():
    child, pid, log = _start_in_child("exit")
    try:
        _out, err = child.communicate(timeout=60)
        assert child.returncode == 0, err[-2000:]
        assert _wait_gone(pid), f"mooncake_master {pid} outlived the process that started it"
        assert not os.path.exists(log)
    finally:
        if child.poll() is None:
            child.kill()
            child.communicate()
        _reap(pid, log)


@needs_mooncake
def test_a_master_whose_ports_another_process_holds_is_never_returned(monkeypatch):
    # The ports accept (someone else listens there) while this master fails to bind and exits:
    # start() must not hand back a dead master.
    import socket

    from hostkv_rs.l3 import master as m

    held = []
    for _ in range(3):
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        held.append(sock)
    ports = [sock.getsockname()[1] for sock in held]
    monkeypatch.setattr(m, "_distinct_free_ports", lambda n: ports[:n])
    try:
        with pytest.raises(m.MasterError, match="did not come up") as e:
            m.LoopbackMaster.start(timeout=10)
        # It exited (the ports were taken), which is what the error says, not a timeout.
        assert "exited with code" in str(e.value) and "within" not in str(e.value)
    finally:
        for sock in held:
            sock.close()


@needs_mooncake
def test_stopped_masters_leave_no_process():
    from hostkv_rs.l3 import master as master_mod
    from hostkv_rs.l3.master import LoopbackMaster

    with LoopbackMaster.start() as a:
        b = LoopbackMaster.start()
        assert {a, b} <= master_mod._LIVE
        b.stop()
        b.remove_log()
    for m in (a, b):
        assert _gone(m.pid) and m not in master_mod._LIVE


def test_no_master_started_by_these_tests_is_left_running():
    """Runs last in this file: every master the tests above started was stopped (the session
    master, when there is one, ends with the session)."""
    from hostkv_rs.l3 import master as master_mod

    left = [m.pid for m in master_mod._LIVE if m.pid not in _SESSION_MASTERS]
    assert left == [], f"mooncake_master processes still running: {left}"


class _DiskReplica:
    """A replica descriptor of an object offloaded to disk: `object_size` its size, or None for
    one whose descriptor gives no size (a local-disk replica)."""

    def __init__(self, object_size):
        self.object_size = object_size

    def is_memory_replica(self):
        return False

    def is_disk_replica(self):
        return self.object_size is not None

    def get_disk_descriptor(self):
        return self


class _DiskOnlyStore:
    """The session's store, but every object it finds is described as a disk replica."""

    def __init__(self, store, object_size):
        self._store, self._size = store, object_size

    def batch_get_replica_desc(self, keys):
        found = self._store.batch_get_replica_desc(keys)
        return {key: [_DiskReplica(self._size)] for key, replicas in found.items() if replicas}

    def __getattr__(self, name):
        return getattr(self._store, name)


@needs_mooncake
@pytest.mark.parametrize("sized", [True, False])
def test_a_page_offloaded_to_disk_is_found_skipped_on_save_and_loaded(make_tier, sized):
    # Mooncake may keep an object only on disk (SSD offload, DFS): its descriptor states the
    # size there, or none; either way it is the page, not an object of the wrong size to remove.
    src, dst = POOLS["mla-page_first"](), POOLS["mla-page_first"]()
    keys, got, b, _ = _round(make_tier, src, dst, n=2)
    assert got == ["loaded", "loaded"]
    fill(dst, 2)
    size = b._require_pool()[1].object_bytes if sized else None
    b.store = _DiskOnlyStore(b.store, size)
    assert b.exists(keys) == [True, True]
    assert statuses(b.load(keys, slots(dst, [3, 4]))) == ["loaded", "loaded"]
    assert page_bytes(dst, 3) == page_bytes(src, 1)
    assert page_bytes(dst, 4) == page_bytes(src, 2)
    b.detach()
    b.attach(src)
    assert statuses(b.save(keys, slots(src, [1, 2]))) == ["skipped", "skipped"]
    assert b.mismatches == {} and b.second_writers == 0


@needs_mooncake
def test_an_unsized_object_that_is_no_page_is_removed_on_load_so_a_save_repairs_it(make_tier):
    # A local-disk replica states no size: the object is fetched, and one that turns out not to
    # be a page object (here a short one) is removed, as save removes a wrong-size object.
    src, dst = POOLS["mla-page_first"](), POOLS["mla-page_first"]()
    keys, got, b, _ = _round(make_tier, src, dst, n=1)
    assert got == ["loaded"]
    _replace_raw(b, keys[0], bytes(_raw_object(b, keys[0])[:-8]))
    store = b.store
    b.store = _DiskOnlyStore(store, None)
    assert b.exists(keys) == [True]
    assert statuses(b.load(keys, slots(dst, [3]))) == ["failed"]
    b.store = store
    assert list(store.batch_is_exist([b.key(keys[0])])) == [0], "the object was kept"
    again = POOLS["mla-page_first"]()  # the same page, from another pool of the writer's
    fill(again, 1)
    saver = make_tier("a")
    saver.attach(again)
    assert statuses(saver.save(keys, slots(again, [1]))) == ["stored"]
    assert statuses(b.load(keys, slots(dst, [3]))) == ["loaded"]
    assert page_bytes(dst, 3) == page_bytes(src, 1)
