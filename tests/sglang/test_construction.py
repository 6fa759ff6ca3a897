"""After `hostkv_rs.sglang.install()`, SGLang's own construction sites build hostkv_rs pools,
hand what hostkv_rs does not implement to SGLang's own classes (with one log line), and SGLang's
other host pools still construct and pass SGLang's isinstance checks.

The "install() before SGLang's modules are imported" case runs in a subprocess
(install_first_script.py), since module import state is per process.
"""

from __future__ import annotations

import ast
import importlib
import json
import logging
import os
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest
import sgl_harness as H
import torch

HERE = Path(__file__).parent


def _hostkv_records(caplog):
    return [
        r for r in caplog.records if r.name.startswith("hostkv_rs") and r.levelno >= logging.INFO
    ]


# --------------------------------------------------------------------------- sites build ours


@pytest.mark.parametrize(
    "kind,layout",
    [("mha", lay) for lay in dict.fromkeys(lay for lay, _ in H.MHA_PAIRS)]
    + [("asym", lay) for lay in dict.fromkeys(lay for lay, _ in H.ASYM_PAIRS)]
    + [("mla", lay) for lay in dict.fromkeys(lay for lay, _ in H.MLA_PAIRS)],
)
def test_build_kv_host_pool(kind, layout, installed, publish):
    """`build_kv_host_pool` (every release; buffer infos in 0.5.23) builds ours, and ours is an
    instance of SGLang's own classes (registered virtual subclass)."""
    if kind == "mla":
        dev = H.mla_device()
    elif kind == "asym":
        dev = H.mha_device(head_dim=16, v_head_dim=8)
    else:
        dev = H.mha_device()
    publish(page_size=dev.page_size, hicache_mem_layout=layout)
    pool = H.build_kv_host_pool(kv_pool=dev, page_size=dev.page_size, use_mla=kind == "mla")
    assert H.is_ours(pool), type(pool)
    name = {
        "mha": "MHATokenToKVPoolHost",
        "asym": "AsymmetricMHATokenToKVPoolHost",
        "mla": "MLATokenToKVPoolHost",
    }[kind]
    assert type(pool).__name__ == name
    assert isinstance(pool, H.ORIG["HostKVCache"])
    assert isinstance(pool, H.ORIG[name])
    if kind == "asym":
        assert isinstance(pool, H.ORIG["MHATokenToKVPoolHost"])
    assert H.ph_base.HostKVCache is H.ORIG["HostKVCache"], "install() replaced HostKVCache"


@pytest.mark.parametrize("kind", ["mha", "mla"])
def test_kv_only_stack(kind, installed, publish):
    dev = H.mla_device() if kind == "mla" else H.mha_device()
    publish(page_size=dev.page_size, hicache_mem_layout="page_first")
    group, controller, _ = H.kv_only_stack(dev, use_mla=kind == "mla")
    assert H.is_ours(group.anchor_entry.host_pool)
    assert type(group).__module__.startswith("sglang.")
    assert type(controller).__name__ == "HybridCacheController"


@pytest.mark.parametrize("kind", ["mha", "mla"])
def test_draft_sidecar_builder(kind, installed, publish):
    """`_build_mha_mla_host_pool` (the MTP draft sidecar; 0.5.23 sizes it with
    host_token_capacity)."""
    dev = H.mla_device(layers=1) if kind == "mla" else H.mha_device(layers=1)
    publish(page_size=dev.page_size, hicache_mem_layout="page_first")
    kwargs = {
        "pool": dev,
        "host_to_device_ratio": 2.0,
        "page_size": dev.page_size,
        "layout": "page_first",
        "allocator_type": "default",
        "pool_label": "draft",
    }
    if "host_token_capacity" in H._params(H.asm._build_mha_mla_host_pool):
        kwargs["host_token_capacity"] = 2 * dev.size
    pool = H.build_mha_mla_host_pool(**kwargs)
    assert H.is_ours(pool), type(pool)
    if "host_token_capacity" in kwargs:
        assert pool.size == 2 * dev.size


def test_v4_stack(installed, publish, sglang_alloc):
    publish(page_size=H.V4_PAGE, hicache_mem_layout="layer_first")
    group, _ = H.v4_stack(H.v4_device())
    names = {}
    for entry in group.entries:
        pool = entry.host_pool
        names[str(entry.name)] = type(pool).__module__ + "." + type(pool).__name__
        if type(pool).__name__ in ("LogicalHostPool", "DeepSeekV4PagedHostPool"):
            assert H.is_ours(pool), names
        else:  # DeepSeekV4StateHostPool: SGLang's, by design
            assert H.is_sglangs(pool), names
        if type(pool).__name__ == "DeepSeekV4PagedHostPool":
            assert isinstance(pool, H.ORIG["DeepSeekV4PagedHostPool"])
            assert isinstance(pool, H.ORIG["HostKVCache"])
        if type(pool).__name__ == "DeepSeekV4StateHostPool":
            assert isinstance(pool, H.ORIG["HostKVCache"])
    H.REPORT.append(f"V4 stack after install(): {names}")


@pytest.mark.skipif(H.at_least(0, 5, 21), reason="hiradix_cache.py exists up to 0.5.20")
@pytest.mark.parametrize("kind", ["mha", "mla"])
def test_hiradix_cache(kind, installed, publish):
    """HiRadixCache (up to 0.5.20) builds ours and hands it to its HiCacheController; needs a
    process group of one (gloo) for its TP world size."""
    import torch.distributed as dist
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.hiradix_cache import HiRadixCache

    dev = H.mla_device() if kind == "mla" else H.mha_device()
    server_args = publish(
        page_size=dev.page_size, hicache_mem_layout="layer_first", enable_hierarchical_cache=True
    )
    created = not dist.is_initialized()
    if created:
        dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        group = dist.new_group([0], backend="gloo")
        allocator = H.FakeTokenAllocator(dev)
        params = CacheInitParams(
            disable=False,
            req_to_token_pool=None,
            token_to_kv_pool_allocator=allocator,
            page_size=dev.page_size,
            tp_cache_group=group,
        )
        cache_ = HiRadixCache(params, server_args)
        assert H.is_ours(cache_.token_to_kv_pool_host), type(cache_.token_to_kv_pool_host)
        assert cache_.cache_controller.mem_pool_host is cache_.token_to_kv_pool_host
    finally:
        if created:
            dist.destroy_process_group()


@pytest.mark.skipif(not H.at_least(0, 5, 21), reason="HiSparse MHA host: 0.5.21+")
def test_hisparse_mha_stays_sglangs(installed, sglang_alloc):
    """HiSparseMHATokenToKVPoolHost (MiniMax M3) is SGLang's: still SGLang's class, still an
    instance of SGLang's MHA host and HostKVCache, and built from SGLang's own base."""
    pool = H.hisparse_mha()
    assert H.is_sglangs(pool)
    assert isinstance(pool, H.ORIG["MHATokenToKVPoolHost"])
    assert isinstance(pool, H.ORIG["HostKVCache"])
    assert not any(c.__module__.startswith("hostkv_rs") for c in type(pool).__mro__)


# --------------------------------------------------------------------------- handed to SGLang


def _token_scaled_fp8_mha():
    dev = H.mha_device(dtype=H.FP8)
    rows = dev.k_buffer[0].shape[0]
    dev.k_scale_buffer = [torch.ones(rows, dev.head_num) for _ in range(dev.layer_num)]
    dev.v_scale_buffer = [torch.ones(rows, dev.head_num) for _ in range(dev.layer_num)]
    return dev


def _mxfp8_mha():
    return H.mp.MHATokenToKVPoolMXFP8(
        size=512,
        page_size=128,
        dtype=H.FP8,
        head_num=2,
        head_dim=32,
        layer_num=2,
        device="cpu",
        enable_memory_saver=False,
    )


HANDOFFS = {
    # what: (device pool factory, use_mla, layout, io_backend, min release)
    "MHA fp8 with per-token scales": (_token_scaled_fp8_mha, False, "page_first", "kernel", None),
    # 0.5.18-0.5.20 have no MXFP8 host pool: their MHA host pool is built, without the scales.
    "MXFP8 MHA": (_mxfp8_mha, False, "page_first", "kernel", None),
    "MLA page_first_kv_split": (H.mla_device, True, "page_first_kv_split", "kernel", None),
    "MHA kernel_ascend": (H.mha_device, False, "page_first_direct", "kernel_ascend", None),
    "MLA kernel_ascend": (H.mla_device, True, "page_first_kv_split", "kernel_ascend", None),
}


@pytest.mark.parametrize("what", list(HANDOFFS))
def test_handed_to_sglang(what, hk, hk_log, publish):
    """What hostkv_rs does not implement is built by SGLang's own class at SGLang's own site,
    exactly as without hostkv_rs (same class, or the same error), with one hostkv_rs log line
    saying so."""
    factory, use_mla, layout, io_backend, since = HANDOFFS[what]
    if since is not None and not H.at_least(*since):
        pytest.skip(f"{what}: SGLang {'.'.join(map(str, since))}+")
    import hostkv_rs.sglang as shim

    def build():
        dev = factory()
        publish(page_size=dev.page_size, hicache_mem_layout=layout, hicache_io_backend=io_backend)
        with H.sglang_cpu_alloc():
            return H.build_kv_host_pool(kv_pool=dev, page_size=dev.page_size, use_mla=use_mla)

    without = H.outcome(build)
    name = "MLATokenToKVPoolHost" if use_mla else "MHATokenToKVPoolHost"
    shim.install()
    try:
        hk_log.clear()
        with_ = H.outcome(build)
        lines = _hostkv_records(hk_log)
        # SGLang's code checks pools against the name its module now holds (ours): the pool
        # SGLang's class built passes, as it does without hostkv_rs.
        now = getattr(H.ph_mla if use_mla else H.ph_mha, name)
        # Asked twice: a "no" cached by the first answer must not hide the second.
        passes = with_[0] != "ok" or (isinstance(with_[1], now) and isinstance(with_[1], now))
    finally:
        shim.uninstall()
    assert passes, f"{what}: isinstance(pool, {name}) is False once {name} is hostkv_rs's"
    if without[0] == "raise":
        assert with_[0] == "raise", f"{what}: SGLang raises {without[1]!r}, ours built {with_[1]}"
        assert (msg := H.same_error(with_[1], without[1])) is None, f"{what}: {msg}"
    else:
        assert with_[0] == "ok", f"{what}: SGLang builds it, with hostkv_rs: {with_[1]!r}"
        assert type(with_[1]) is type(without[1]), f"{what}: {type(with_[1])}"
    assert len(lines) == 1, (
        f"{what}: expected one hostkv_rs log line saying SGLang's class is used, got "
        f"{[r.getMessage() for r in lines]}"
    )
    H.REPORT.append(f"hand-off {what}: {lines[0].getMessage()}")


def test_sglangs_own_classes_keep_passing_checks_against_the_names_install_replaces():
    """A pool of SGLang's own class (a hand-over, or one built before install()) passes
    isinstance against each name SGLang's modules hold once install() puts ours there, and
    uninstall() takes every such answer back (also where a base class cached it)."""
    import hostkv_rs
    import hostkv_rs.sglang as shim

    replaced = {
        name: cls
        for name, cls in H.ORIG_CLASSES.items()
        if name != "HostKVCache" and isinstance(getattr(hostkv_rs, name, None), type)
    }
    assert "LogicalHostPool" in replaced and "MLATokenToKVPoolHost" in replaced
    theirs = {name: cls.__new__(cls) for name, cls in replaced.items()}
    shim.install()
    try:
        for name, original in replaced.items():
            now = getattr(H._DEFINING[name], name)
            assert now is getattr(hostkv_rs, name), name
            for _ in range(3):  # answers ABCMeta caches must not change the next one
                assert issubclass(original, now), name
                assert isinstance(theirs[name], now), name
        assert isinstance(theirs["MHATokenToKVPoolHost"], hostkv_rs.HostKVCache)
    finally:
        shim.uninstall()
    for name, original in replaced.items():
        ours = getattr(hostkv_rs, name)
        for _ in range(2):
            assert not issubclass(original, ours), name
            assert not isinstance(theirs[name], ours), name
            assert not isinstance(theirs[name], hostkv_rs.HostKVCache), name


# --------------------------------------------------------------------------- SGLang's other pools


def test_sglang_classes_keep_sglang_bases(installed):
    """No SGLang host-pool class inherits from a hostkv_rs class (that would make SGLang's pools
    run our code with SGLang's constructor arguments)."""
    bad = {
        name: [c.__module__ + "." + c.__name__ for c in cls.__mro__]
        for name, cls in H.sglang_host_classes().items()
        if any(c.__module__.startswith("hostkv_rs") for c in cls.__mro__)
    }
    assert H.sglang_host_classes(), "found no SGLang host pool classes"
    assert not bad, bad


def test_other_pools_after_import(installed):
    pools, notes = H.other_sglang_pools()
    H.REPORT.append(
        f"SGLang's other pools built after install(): {sorted(pools)}; not on CPU: {notes}"
    )
    assert pools, notes
    for label, pool in pools.items():
        assert H.is_sglangs(pool), f"{label}: {type(pool)}"
        assert isinstance(pool, H.ORIG["HostKVCache"]), label


def test_install_before_import():
    """The same, in a fresh interpreter where install() runs before any SGLang module is
    imported (install_first_script.py prints its findings as JSON)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(HERE)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])
    )
    proc = subprocess.run(
        [sys.executable, str(HERE / "install_first_script.py")],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        cwd=str(HERE.parent),
        check=False,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    assert proc.returncode == 0 and lines, (
        f"install_first_script.py failed (rc={proc.returncode}):\n{proc.stdout[-3000:]}\n"
        f"{proc.stderr[-6000:]}"
    )
    result = json.loads(lines[-1])
    H.REPORT.append(f"install() before import: {json.dumps(result, sort_keys=True)[:2000]}")
    failures = {k: v for k, v in result["checks"].items() if v is not True}
    assert not failures, json.dumps(failures, indent=1)


# --------------------------------------------------------------------------- every site by name


def test_every_binding_site_patched(installed):
    """Every loaded (or CPU-importable) SGLang module that bound a replaced name at import time
    now holds ours; every module a lazy import reads holds ours."""
    import hostkv_rs

    problems, checked, skipped = [], 0, []
    for module_name, name, how, source in H.binding_sites():
        target = (source if how == "lazy" else module_name).removesuffix(".__init__")
        module = sys.modules.get(target) or H.module_or_none(target)
        if module is None:
            skipped.append(target)
            continue
        if not hasattr(module, name):
            continue  # a TYPE_CHECKING-only import
        checked += 1
        if getattr(module, name) is not getattr(hostkv_rs, name):
            problems.append(f"{target}.{name} ({how} import in {module_name})")
    H.REPORT.append(
        f"binding sites: {checked} checked, not importable on CPU: {sorted(set(skipped))}"
    )
    assert checked >= 8
    assert not problems, problems


# --------------------------------------------------------------------------- isinstance sites


@cache
def _isinstance_sites():
    """(module, class name, how, source module) for every isinstance / issubclass check in
    sglang.srt against a host-pool class (a class SGLang defines in its host-pool modules)."""
    classes = {cls.__name__ for cls in H.sglang_host_classes().values()}
    classes |= {"LogicalHostPool", "HostKVCache", "MHATokenToKVPoolHost"}
    root = Path(importlib.util.find_spec("sglang").origin).parent
    sites = set()
    for path in sorted((root / "srt").rglob("*.py")):
        text = path.read_text(errors="replace")
        if "isinstance(" not in text and "issubclass(" not in text:
            continue
        if not any(c in text for c in classes):
            continue
        tree = ast.parse(text)
        imported = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module:
                for alias in node.names:
                    imported.setdefault(alias.asname or alias.name, (node.module, alias.name))
        module = ".".join(path.relative_to(root.parent).with_suffix("").parts)
        for node in ast.walk(tree):
            if not (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id in ("isinstance", "issubclass")
                and len(node.args) == 2
            ):
                continue
            arg = node.args[1]
            for elt in arg.elts if isinstance(arg, ast.Tuple) else [arg]:
                if isinstance(elt, ast.Name) and elt.id in classes:
                    source = imported.get(elt.id, (module, elt.id))
                    sites.add((module, elt.id, source[0], source[1]))
    return sorted(sites)


def _resolve(module_name, local, source_module, source_name):
    """The class an isinstance site reads at call time: the module global if the module bound
    it, else the source module's attribute (a lazy import)."""
    module = sys.modules.get(module_name) or H.module_or_none(module_name)
    if module is not None and isinstance(getattr(module, local, None), type):
        return getattr(module, local)
    source = H.module_or_none(source_module)
    return getattr(source, source_name, None) if source is not None else None


def test_isinstance_sites(hk, publish, sglang_alloc):
    """Every isinstance / issubclass check SGLang makes with a host-pool class gives, after
    install(), the same answer for our pool as SGLang's own class gives for SGLang's equivalent
    pool, and for SGLang's own other pools the answer SGLang's own class gives."""
    import hostkv_rs.sglang as shim

    sites = _isinstance_sites()
    assert sites, "no isinstance sites found"
    zoo = []  # (label, SGLang's pool, ours)
    for kind, dev, use_mla, layout in (
        ("MHA", H.mha_device(), False, "page_first"),
        ("AsymMHA", H.mha_device(head_dim=16, v_head_dim=8), False, "page_first"),
        ("MLA", H.mla_device(), True, "page_first"),
    ):
        call = H.recorded_kv_host_call(dev, use_mla=use_mla, layout=layout)
        zoo.append((kind, call.pool, call.ours()))
    for call in H.recorded_v4_calls(_published_v4(publish), layout="layer_first")[:2]:
        zoo.append((call.name, call.pool, call.ours()))
    shim.install()
    try:
        others, _ = H.other_sglang_pools()
        problems, checked = [], 0
        for module_name, local, source_module, source_name in sites:
            cls = _resolve(module_name, local, source_module, source_name)
            orig = _orig_class(source_name)
            if cls is None or orig is None:
                continue
            checked += 1
            for label, theirs, ours in zoo:
                want = isinstance(theirs, orig)
                if isinstance(ours, cls) != want:
                    problems.append(
                        f"{module_name}: isinstance(<our {label}>, {local}) is {not want}, "
                        f"SGLang's {label} gives {want}"
                    )
            for label, pool in others.items():
                want = isinstance(pool, orig)
                if isinstance(pool, cls) != want:
                    problems.append(
                        f"{module_name}: isinstance(<SGLang's {label}>, {local}) is {not want}, "
                        f"SGLang's own {source_name} gives {want}"
                    )
    finally:
        shim.uninstall()
    H.REPORT.append(f"isinstance sites: {len(sites)} found, {checked} importable on CPU")
    assert not problems, "\n".join(problems)


def _published_v4(publish):
    publish(page_size=H.V4_PAGE, hicache_mem_layout="layer_first")
    return H.v4_device()


def _orig_class(name):
    """SGLang's own class of that name as it was before install()."""
    if name in H.ORIG:
        return H.ORIG[name]
    for cls in H.sglang_host_classes().values():
        if cls.__name__ == name:
            return cls
    return None
