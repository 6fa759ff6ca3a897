"""Helpers for the tests against a REAL SGLang release (tests/sglang/).

Everything here is derived from the installed release at import time: its version, its modules,
SGLang's own host-pool classes (captured before any `hostkv_rs.sglang.install()`), and the
signatures of its construction sites. Nothing imports `hostkv_rs` at module level, so a broken
hostkv_rs shows up as failing tests, not as a collection error.

CPU notes (each shim below says why it exists):
* SGLang's own host pools allocate through `pool_host.common.ALLOC_MEMORY_FUNCS`, whose default
  pins with cudaHostRegister; `sglang_cpu_alloc()` swaps in plain zeroed CPU tensors while
  SGLang's classes are built. hostkv_rs pools never read that table.
* SGLang's own pools cannot move bytes on CPU (their copies are sgl_kernel / JIT CUDA kernels);
  only hostkv_rs pools do, through the Rust CPU engine.
* `cpu_shims()`: see its docstring.
"""

from __future__ import annotations

import ast
import contextlib
import importlib
import importlib.metadata
import importlib.util
import inspect
import os
import re
import threading
from functools import cache
from pathlib import Path
from types import SimpleNamespace

import sglang.srt.runtime_context as rc
import torch
from sglang.srt.managers import cache_controller as cc
from sglang.srt.mem_cache import l2_transfer as l2
from sglang.srt.mem_cache import memory_pool as mp
from sglang.srt.mem_cache import memory_pool_host as mph
from sglang.srt.mem_cache.hybrid_cache import hybrid_pool_assembler as asm
from sglang.srt.mem_cache.pool_host import base as ph_base
from sglang.srt.mem_cache.pool_host import common as ph_common
from sglang.srt.mem_cache.pool_host import mha as ph_mha
from sglang.srt.mem_cache.pool_host import mla as ph_mla
from sglang.srt.server_args import ServerArgs

SGLANG_VERSION = importlib.metadata.version("sglang")
REL = tuple(int(x) for x in re.findall(r"\d+", SGLANG_VERSION)[:3])

# The names hostkv_rs replaces at SGLang's construction sites (HostKVCache is NOT replaced: our
# classes are registered with it instead).
REPLACED = (
    "MHATokenToKVPoolHost",
    "AsymmetricMHATokenToKVPoolHost",
    "MLATokenToKVPoolHost",
    "DeepSeekV4PagedHostPool",
    "LogicalHostPool",
    "get_mha_host_pool_cls",
)
_DEFINING = {
    "HostKVCache": ph_base,
    "MHATokenToKVPoolHost": ph_mha,
    "AsymmetricMHATokenToKVPoolHost": ph_mha,
    "get_mha_host_pool_cls": ph_mha,
    "MLATokenToKVPoolHost": ph_mla,
    "DeepSeekV4PagedHostPool": mph,
    "LogicalHostPool": mph,
}
# SGLang's own objects, captured before any install() (conftest imports this module first).
ORIG = {name: getattr(module, name) for name, module in _DEFINING.items()}
ORIG_CLASSES = {
    name: obj
    for name, obj in ORIG.items()
    if isinstance(obj, type) and obj.__module__.startswith("sglang.")
}
# install_first_script.py imports this module after install() on purpose; everywhere else the
# originals must be SGLang's.
if not os.environ.get("HOSTKV_SGLANG_INSTALL_FIRST"):
    for _name, _obj in ORIG.items():
        assert _obj.__module__.startswith("sglang."), (
            f"{_name} is already replaced ({_obj.__module__}): hostkv_rs.sglang.install() ran "
            "before the test harness captured SGLang's classes"
        )

# Layouts per pool kind that SGLang accepts in every release here (page_unified, 0.5.23 only, is
# compared in test_page_unified.py; the Ascend-only page_first_kv_split is handed to SGLang by
# hostkv_rs, see test_construction).
MHA_PAIRS = [
    ("layer_first", "kernel"),
    ("page_first", "kernel"),
    ("page_head", "kernel"),
    ("layer_first", "direct"),
    ("page_first_direct", "direct"),
]
ASYM_PAIRS = [("page_first", "kernel"), ("page_first_direct", "direct")]
MLA_PAIRS = [
    ("layer_first", "kernel"),
    ("page_first", "kernel"),
    ("layer_first", "direct"),
    ("page_first_direct", "direct"),
]
V4_PAIRS = MLA_PAIRS
ALL_LAYOUTS = ("layer_first", "page_first", "page_first_direct", "page_head")
FP8 = torch.float8_e4m3fn
DTYPES = {"bf16": torch.bfloat16, "fp8": FP8}


# Lines for the end-of-run summary (conftest's pytest_terminal_summary prints them), e.g. the
# attribute lists the AST scan derived, so a reviewer sees them without -s.
REPORT: list[str] = []


def at_least(*version: int) -> bool:
    return REL >= tuple(version)


def module_or_none(name: str):
    """The module if this release has it and it imports on CPU, else None."""
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


def is_ours(obj) -> bool:
    return type(obj).__module__.startswith("hostkv_rs")


def is_sglangs(obj) -> bool:
    return type(obj).__module__.startswith("sglang.")


# --------------------------------------------------------------------------- process state


def publish(**overrides) -> ServerArgs:
    """Publish a fresh ServerArgs in SGLang's runtime context (what a scheduler does at start)."""
    kwargs = {
        "model_path": "dummy",
        "device": "cpu",
        "page_size": 16,
        "hicache_ratio": 2.0,
        "hicache_size": 0,
        "hicache_mem_layout": "layer_first",
        "hicache_io_backend": "kernel",
        "hicache_write_policy": "write_through",
    }
    kwargs.update(overrides)
    rc.reset_context()
    server_args = ServerArgs(**kwargs)
    rc.publish(server_args, role="test")
    _PUBLISHED[0] = server_args
    memory = rc.get_memory()
    for key in ("hicache_mem_layout", "hicache_io_backend", "hicache_ratio", "page_size"):
        if key in kwargs and hasattr(memory, key):
            assert getattr(memory, key) == kwargs[key], (key, getattr(memory, key), kwargs[key])
    return server_args


_PUBLISHED: list = [None]  # the ServerArgs `publish` published last


def site(name: str, **kwargs):
    """Call the assembler function `name` as SGLang does; 0.5.18's take `server_args=` as well
    (0.5.19+ read the published runtime context only)."""
    fn = getattr(asm, name)
    if "server_args" in _params(fn) and "server_args" not in kwargs:
        kwargs["server_args"] = _PUBLISHED[0]
    return fn(**kwargs)


def build_kv_host_pool(**kwargs):
    return site("build_kv_host_pool", **kwargs)


def build_mha_mla_host_pool(**kwargs):
    """The draft-sidecar site `_build_mha_mla_host_pool` (host_token_capacity: 0.5.23+)."""
    return site("_build_mha_mla_host_pool", **kwargs)


def _cpu_zeros(dims, dtype, device, pin_memory=False, allocator=None, **_):
    return torch.zeros(dims, dtype=dtype, device=device)


@contextlib.contextmanager
def sglang_cpu_alloc():
    """Let SGLang's OWN host pools allocate on a machine without CUDA: its default allocator pins
    with cudaHostRegister (`RuntimeError: Found no NVIDIA driver`). Keys: the device-type string
    (MHA/MLA, V4 pools from 0.5.20) and torch.device("cpu") (V4 pools before 0.5.20)."""
    table = ph_common.ALLOC_MEMORY_FUNCS
    keys = ("cpu", torch.device("cpu"))
    saved = {k: table[k] for k in keys if k in table}
    for k in keys:
        table[k] = _cpu_zeros
    try:
        yield
    finally:
        for k in keys:
            table.pop(k, None)
        table.update(saved)


@contextlib.contextmanager
def cpu_shims():
    """The two CPU shims SGLang's controllers need here, both outside the host pools:

    * 0.5.18-0.5.21 bind `device_module = torch.get_device_module()`, which is `torch.cuda` on a
      CUDA build of torch even without a driver (SGLang 0.5.22 fixed this by checking for an
      accelerator first). Only then, `cache_controller.device_module` and
      `l2_transfer.device_module` become `torch.cpu`, what 0.5.22+ picks on the same machine.
    * `torch.cpu.Stream` has no `synchronize()`; SGLang's L2TransferEngine calls it only on its
      exception path (0.5.21+), where the AttributeError would hide the real error.
    """
    patches = []
    if not torch.cuda.is_available():
        for module in (cc, l2):
            if getattr(module, "device_module", None) is torch.cuda:
                patches.append((module, "device_module", torch.cuda))
                module.device_module = torch.cpu
    added_sync = not hasattr(torch.cpu.Stream, "synchronize")
    if added_sync:
        torch.cpu.Stream.synchronize = lambda self: None
    try:
        yield
    finally:
        for module, name, value in patches:
            setattr(module, name, value)
        if added_sync:
            del torch.cpu.Stream.synchronize


# --------------------------------------------------------------------------- device pools


def mha_device(
    *, size=256, page=16, dtype=torch.bfloat16, heads=2, head_dim=16, v_head_dim=None, layers=2
):
    return mp.MHATokenToKVPool(
        size=size,
        page_size=page,
        dtype=dtype,
        head_num=heads,
        head_dim=head_dim,
        layer_num=layers,
        device="cpu",
        enable_memory_saver=False,
        v_head_dim=v_head_dim,
    )


def mla_device(*, size=256, page=16, dtype=torch.bfloat16, kv_lora_rank=32, rope=16, layers=2):
    return mp.MLATokenToKVPool(
        size=size,
        page_size=page,
        dtype=dtype,
        kv_lora_rank=kv_lora_rank,
        qk_rope_head_dim=rope,
        layer_num=layers,
        device="cpu",
        enable_memory_saver=False,
    )


def layer_sharded(pool, *, shard_size: int, shard_rank: int):
    """Make `pool` a CP layer-sharded device pool the way SGLang's LayerSplitDSATokenToKVPool
    looks to HiCache (`layer_shard_enabled`, `layer_shard_size`, `_owned_local_layer_range`, with
    SGLang's `get_layer_shard_range` split): rank r owns a contiguous range of the layers."""
    n = pool.layer_num
    base, rem = divmod(n, shard_size)
    start = shard_rank * base + min(shard_rank, rem)
    end = start + base + (1 if shard_rank < rem else 0)
    pool.layer_shard_enabled = True
    pool.layer_shard_size = shard_size
    pool.layer_shard_rank = shard_rank
    pool._owned_local_layer_range = lambda: (start, end)
    return pool, (start, end)


V4_PAGE = 256  # SGLang asserts a 256-token SWA page on GPU; the stack is built the same here


def v4_device(*, layers=4, ratios=(0, 4, 128, 4)):
    from sglang.srt.mem_cache.deepseek_v4_memory_pool import DeepSeekV4TokenToKVPool

    extra = {"full_size": 2048} if "full_size" in _params(DeepSeekV4TokenToKVPool) else {}
    return DeepSeekV4TokenToKVPool(
        max_num_reqs=4,
        swa_size=1024,
        c4_size=2048,
        c128_size=2048,
        c4_state_pool_size=8,
        c128_state_pool_size=4,
        page_size=V4_PAGE,
        swa_page_size=V4_PAGE,
        dtype=FP8,
        c4_state_dtype=torch.float32,
        c128_state_dtype=torch.float32,
        qk_nope_head_dim=448,
        qk_rope_head_dim=64,
        indexer_head_dim=128,
        layer_num=layers,
        device="cpu",
        enable_memory_saver=False,
        compression_ratios=list(ratios),
        start_layer=0,
        end_layer=layers,  # exclusive; KVCache's default (layer_num - 1) is inclusive
        **extra,
    )


def _params(callable_) -> set[str]:
    return set(inspect.signature(callable_).parameters)


def device_planes(pool) -> list[torch.Tensor]:
    """Every per-layer device tensor of a device pool whose bytes a host pool mirrors."""
    if hasattr(pool, "k_buffer") and hasattr(pool, "v_buffer"):
        return list(pool.k_buffer) + list(pool.v_buffer)
    return list(pool.kv_buffer)


def byte_rows(t: torch.Tensor) -> torch.Tensor:
    """A layer tensor as (rows, bytes) uint8."""
    return t.contiguous().view(torch.uint8).reshape(t.shape[0], -1)


def fill_random(tensors, gen: torch.Generator) -> None:
    for t in tensors:
        v = t.view(torch.uint8)
        v.copy_(torch.randint(0, 256, v.shape, dtype=torch.uint8, generator=gen))


def snapshot(tensors) -> list[torch.Tensor]:
    return [byte_rows(t).clone() for t in tensors]


def page_slots(pages, page: int) -> torch.Tensor:
    pages = torch.as_tensor(pages, dtype=torch.int64)
    return (pages[:, None] * page + torch.arange(page)[None, :]).reshape(-1)


def pick_pages(n: int, first: int, last: int, gen: torch.Generator, exclude=()) -> list[int]:
    """n distinct random page ids in [first, last), not in `exclude`."""
    pool = [p for p in range(first, last) if p not in set(exclude)]
    perm = torch.randperm(len(pool), generator=gen)[:n].tolist()
    return [pool[i] for i in perm]


# --------------------------------------------------------------------------- controllers


class FakeTokenAllocator:
    """The slice of SGLang's token allocator the HiCache controllers touch: `get_kvcache()`, the
    device pool's `device`, `alloc` (returns the device slots a test queued with `plan`), `free`
    and the transfer-done event hook. Everything else in SGLang's allocator is radix-tree
    bookkeeping that plays no part in moving bytes."""

    def __init__(self, kvcache, *, size_full=None):
        self.kvcache = kvcache
        self.device = "cpu"
        self.page_size = kvcache.page_size
        self.size_full = size_full if size_full is not None else kvcache.size
        self.swa_attn_allocator = SimpleNamespace(alloc=self.alloc, free=self.free)
        self._planned: list[torch.Tensor] = []
        self.events = []

    def get_kvcache(self):
        return self.kvcache

    def plan(self, indices: torch.Tensor) -> None:
        self._planned.append(indices)

    def alloc(self, need_size: int):
        indices = self._planned.pop(0)
        assert len(indices) == need_size, (len(indices), need_size)
        return indices

    def free(self, indices) -> None:
        pass

    def available_size(self):
        return self.kvcache.size

    def set_hicache_transfer_done_event(self, key, event):
        self.events.append(key)


def cache_params(allocator, *, page: int, drafts=()):
    """The fields of SGLang's CacheInitParams the stack builders read (no process groups: the
    controllers keep them only for storage backends and TP syncs, none here)."""
    return SimpleNamespace(
        page_size=page,
        token_to_kv_pool_allocator=allocator,
        mtp_draft_device_pools=tuple(drafts),
        tp_cache_group=None,
        attn_cp_cache_group=None,
        attn_tp_cache_group=None,
        pp_cache_group=None,
    )


def kv_only_stack(kv_pool, *, use_mla: bool, drafts=()):
    """SGLang's `build_kv_only_stack`: host pool group + HybridCacheController."""
    allocator = FakeTokenAllocator(kv_pool)
    params = cache_params(allocator, page=kv_pool.page_size, drafts=drafts)
    group, controller = site(
        "build_kv_only_stack",
        params=params,
        kv_pool=kv_pool,
        full_layer_mapping={i: i for i in range(kv_pool.layer_num)},
        load_cache_event=threading.Event(),
        storage_backend=None,
        use_mla=use_mla,
    )
    return group, controller, allocator


def v4_stack(kvcache):
    """SGLang's `build_deepseek_v4_hicache_stack` (host pool group + HybridCacheController)."""
    allocator = FakeTokenAllocator(kvcache, size_full=2048)
    params = cache_params(allocator, page=V4_PAGE)
    return site(
        "build_deepseek_v4_hicache_stack",
        params=params,
        kvcache=kvcache,
        load_cache_event=threading.Event(),
        storage_backend=None,
    )


def controller_layers(controller) -> int:
    return getattr(controller, "transfer_layer_id_max", None) or controller.layer_num


def submit_h2d(engine, transfers, n_layers: int):
    """`L2TransferEngine.submit_host_to_device` under this release's keyword (0.5.18-0.5.20
    `layer_num=`, 0.5.21+ `transfer_layer_id_max=`)."""
    if "transfer_layer_id_max" in _params(engine.submit_host_to_device):
        return engine.submit_host_to_device(transfers, transfer_layer_id_max=n_layers)
    return engine.submit_host_to_device(transfers, layer_num=n_layers)


# --------------------------------------------------------------------------- recorded args


class _Recorder:
    """Stands in for a host-pool class at an SGLang construction site: records the exact
    arguments SGLang passes, builds SGLang's own class with them (CPU allocation patched) and
    returns it, so the site carries on as usual."""

    def __init__(self, name: str, original, calls: list):
        self.__name__ = name
        self._original = original
        self._calls = calls

    def __call__(self, *args, **kwargs):
        call = Call(self.__name__, self._original, args, kwargs)
        self._calls.append(call)  # recorded even when SGLang's constructor raises
        call.pool = _sglang_pool(self._original, args, kwargs)
        return call.pool


def _sglang_pool(cls, args, kwargs):
    """SGLang's own pool on CPU: allocated with `sglang_cpu_alloc`, and `pin_memory` cleared
    afterwards, because SGLang's flat-page helpers call `torch.zeros(..., pin_memory=...)`,
    which needs a CUDA driver. Both only affect where SGLang's bytes live, not their layout."""
    with sglang_cpu_alloc():
        pool = cls(*args, **kwargs)
    if getattr(pool, "pin_memory", False):
        pool.pin_memory = False
    return pool


class Call:
    """One recorded host-pool construction: SGLang's class name, its arguments, and the pool
    SGLang built from them (None when its constructor raised)."""

    def __init__(self, name, cls, args, kwargs):
        self.name, self.cls, self.args, self.kwargs, self.pool = name, cls, args, kwargs, None

    def theirs(self):
        """A fresh SGLang pool from the same arguments."""
        return _sglang_pool(self.cls, self.args, self.kwargs)

    def ours(self):
        import hostkv_rs

        return getattr(hostkv_rs, self.name)(*self.args, **self.kwargs)

    def __repr__(self):
        return f"Call({self.name}, kwargs={sorted(self.kwargs)})"


@contextlib.contextmanager
def recording_sites():
    """While active, SGLang's assembler builds its own classes and records every host-pool
    constructor call as a `Call`."""
    calls: list = []
    saved = {}

    def set_(module, name, value):
        if hasattr(module, name):
            saved.setdefault((module, name), getattr(module, name))
            setattr(module, name, value)

    for name in ("MLATokenToKVPoolHost", "DeepSeekV4PagedHostPool", "LogicalHostPool"):
        set_(asm, name, _Recorder(name, ORIG[name], calls))
    original_get_cls = ORIG["get_mha_host_pool_cls"]

    def get_cls(x):
        cls = original_get_cls(x)
        return _Recorder(cls.__name__, cls, calls)

    set_(asm, "get_mha_host_pool_cls", get_cls)
    try:
        yield calls
    finally:
        for (module, name), value in saved.items():
            setattr(module, name, value)


def recorded_kv_host_call(kv_pool, *, use_mla: bool, layout: str, io_backend="kernel", **extra):
    """The `Call` `build_kv_host_pool` makes for `kv_pool` with `layout` published as
    --hicache-mem-layout. SGLang's constructor may raise (a bad layout): the call is still
    returned, with `pool=None`."""
    publish(
        page_size=kv_pool.page_size,
        hicache_mem_layout=layout,
        hicache_io_backend=io_backend,
        **extra,
    )
    with recording_sites() as calls:
        try:
            build_kv_host_pool(kv_pool=kv_pool, page_size=kv_pool.page_size, use_mla=use_mla)
        except Exception:
            if not calls:
                raise
    assert len(calls) == 1, calls
    return calls[0]


def recorded_v4_calls(kvcache, *, layout: str):
    publish(page_size=V4_PAGE, hicache_mem_layout=layout)
    with recording_sites() as calls:
        v4_stack(kvcache)
    return calls


# --------------------------------------------------------------------------- introspection


def buffers_of(pool) -> list[torch.Tensor]:
    """The host tensors a pool owns, in order (kv_buffer may be a tensor, tuple or list)."""
    kv = pool.kv_buffer
    if isinstance(kv, torch.Tensor):
        return [kv]
    return list(kv)


def locate(ptr: int, buffers: list[torch.Tensor]):
    """(buffer index, byte offset) of a raw pointer inside one of `buffers`."""
    for i, b in enumerate(buffers):
        base = b.data_ptr()
        if base <= ptr < base + b.numel() * b.element_size():
            return i, ptr - base
    return None, ptr


def outcome(fn):
    """('ok', value) or ('raise', exception)."""
    try:
        return "ok", fn()
    except Exception as exc:  # noqa: BLE001 - the exception IS the observation
        return "raise", exc


def reached_kernel(exc: BaseException) -> bool:
    """SGLang's own pool got past its checks to a copy kernel, which does not exist on CPU:
    the sgl_kernel / JIT names are only imported on CUDA/HIP (NameError), or a lazy import of
    the kernel package fails (ImportError)."""
    return isinstance(exc, (NameError, ImportError))


def same_error(ours: BaseException, theirs: BaseException) -> str | None:
    """None when `ours` matches SGLang's exception: same type or a subclass, and the same text,
    unless SGLang's has none (a bare `assert`), where a message of our own is allowed."""
    if not isinstance(ours, type(theirs)):
        return f"type {type(ours).__name__} is not a {type(theirs).__name__}: {ours}"
    if str(theirs) and str(ours) != str(theirs):
        return f"text {str(ours)!r} != {str(theirs)!r}"
    return None


# --------------------------------------------------------------------------- SGLang's other pools


def hisparse_mha():
    from sglang.srt.mem_cache.pool_host.mha import HiSparseMHATokenToKVPoolHost as Cls

    dev = mha_device(page=16)
    if at_least(0, 5, 23):
        info = dev.get_device_pool_infos()[0].buffer_info
        return Cls(
            info,
            2.0,
            16,
            device_capacity_tokens=dev.size,
            start_layer=dev.start_layer,
            end_layer=dev.end_layer,
        )
    return Cls(dev, 2.0, 16)


def other_sglang_pools():
    """SGLang's own host pools that hostkv_rs leaves alone, built with SGLang's arguments on an
    anchor SGLang's site built (ours after install()). {label: pool}; what this release lacks or
    SGLang itself cannot build on CPU is absent (the second dict says why)."""
    pools, notes = {}, {}

    def attempt(label, fn):
        kind, value = outcome(fn)
        if kind == "ok":
            pools[label] = value
        else:
            notes[label] = f"{type(value).__name__}: {value}"

    publish(page_size=64, hicache_mem_layout="page_first")
    with sglang_cpu_alloc():
        mha = mha_device(page=64, size=512)
        anchor = build_kv_host_pool(kv_pool=mha, page_size=64, use_mla=False)
        konly_dev = mp.MHATokenToKOnlyPool(
            size=512,
            page_size=64,
            dtype=torch.bfloat16,
            head_num=1,
            head_dim=128,
            layer_num=2,
            device="cpu",
            enable_memory_saver=False,
        )
        attempt(
            "K-only (MHATokenToKOnlyPoolHost)",
            lambda: ph_mha.MHATokenToKOnlyPoolHost(konly_dev, anchor, "page_first"),
        )
        dsa = mp.DSATokenToKVPool(
            size=512,
            page_size=64,
            kv_lora_rank=64,
            dtype=torch.bfloat16,
            qk_rope_head_dim=32,
            layer_num=2,
            device="cpu",
            index_head_dim=128,
            enable_memory_saver=False,
            kv_cache_dim=96,
        )
        mla_anchor = build_kv_host_pool(kv_pool=dsa, page_size=64, use_mla=True)

        def dsa_indexer():
            from sglang.srt.mem_cache.pool_host import dsa as dsa_host

            if at_least(0, 5, 22):
                decl = dsa_host.make_dsa_indexer_pool_decl(dsa)
                return dsa_host.DSAIndexerPoolHost(decl=decl, anchor_host=mla_anchor)
            return dsa_host.DSAIndexerPoolHost(dsa, mla_anchor, "page_first")

        attempt("DSA indexer (DSAIndexerPoolHost)", dsa_indexer)
        if at_least(0, 5, 21):
            attempt("HiSparse MHA", hisparse_mha)
        publish(page_size=V4_PAGE, hicache_mem_layout="layer_first")

        def v4_state():
            group, _ = v4_stack(v4_device())
            return next(
                e.host_pool
                for e in group.entries
                if type(e.host_pool).__name__ == "DeepSeekV4StateHostPool"
            )

        attempt("V4 state (DeepSeekV4StateHostPool)", v4_state)
    return pools, notes


@cache
def sglang_host_classes():
    """Every class SGLang defines in its host-pool modules that derives from its HostKVCache
    (imported now, so after install() for the in-process test)."""
    root = Path(importlib.util.find_spec("sglang").origin).parent / "srt" / "mem_cache"
    names = ["sglang.srt.mem_cache.memory_pool_host"] + [
        f"sglang.srt.mem_cache.pool_host.{p.stem}"
        for p in sorted((root / "pool_host").glob("*.py"))
        if p.stem != "__init__"
    ]
    found = {
        f"{c.__module__}.{c.__name__}": c
        for c in ORIG_CLASSES.values()
        if issubclass(c, ORIG["HostKVCache"])  # LogicalHostPool is not one
    }
    for name in names:
        module = module_or_none(name)
        if module is None:
            continue
        for value in vars(module).values():
            # by name: in install_first_script.py, HostKVCache may not be SGLang's own
            if (
                isinstance(value, type)
                and value.__module__ == name
                and any(c.__name__ == "HostKVCache" for c in value.__mro__)
            ):
                found[f"{name}.{value.__name__}"] = value
    return found


@cache
def binding_sites():
    """(module, name, how, source) for every module in sglang.srt that binds one of the replaced
    names with `from source import name` and reads it at run time: how = "top" (a module global,
    read at call time: the module's attribute must be ours) or "lazy" (imported inside a
    function: reads source.name at call time). A module that only names the class as a base of
    its own subclass (`class QSAIndexerPoolHost(DeepSeekV4PagedHostPool)`) or in annotations is
    left out: SGLang's subclasses keep SGLang's bases by design."""
    root = Path(importlib.util.find_spec("sglang").origin).parent
    sites = []
    for path in sorted((root / "srt").rglob("*.py")):
        text = path.read_text(errors="replace")
        if not any(name in text for name in REPLACED):
            continue
        tree = ast.parse(text)
        top = {id(n) for n in tree.body}
        static = {id(n) for n in _static_name_uses(tree)}
        runtime = {
            n.id
            for n in ast.walk(tree)
            if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load) and id(n) not in static
        }
        for node in ast.walk(tree):
            if not isinstance(node, ast.ImportFrom) or not node.module:
                continue
            for alias in node.names:
                if (
                    alias.name in REPLACED
                    and alias.asname in (None, alias.name)
                    and alias.name in runtime
                ):
                    module = ".".join(path.relative_to(root.parent).with_suffix("").parts)
                    how = "top" if id(node) in top else "lazy"
                    sites.append((module, alias.name, how, node.module))
    return tuple(sites)


def _static_name_uses(tree):
    """Name nodes in class bases and annotations (not read when SGLang builds a pool)."""
    for node in ast.walk(tree):
        roots = []
        if isinstance(node, ast.ClassDef):
            roots = list(node.bases)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            args = node.args
            every = [*args.posonlyargs, *args.args, *args.kwonlyargs, args.vararg, args.kwarg]
            roots = [a.annotation for a in every if a is not None and a.annotation is not None]
            roots += [node.returns] if node.returns is not None else []
        elif isinstance(node, ast.AnnAssign):
            roots = [node.annotation]
        for root in roots:
            yield from (n for n in ast.walk(root) if isinstance(n, ast.Name))
