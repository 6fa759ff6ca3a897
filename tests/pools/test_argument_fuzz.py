"""Argument fuzzing: every pool constructor argument and public method argument, one at a time,
replaced by a huge, negative, zero, NaN, infinite, bool or wrong-type value. Each call must
either succeed or raise ValueError / TypeError / IndexError (TransferError and PageIndexError
are both), AssertionError where SGLang asserts, or one of SGLang's NotImplementedError /
RuntimeError texts; never OverflowError, ZeroDivisionError, a RuntimeError from torch or an
AttributeError, and never a crash.

Examples per test: HOSTKV_FUZZ_EXAMPLES (default 150; CI has two cores)."""

from __future__ import annotations

import os
import re
import warnings
from contextlib import ExitStack
from unittest import mock

import numpy as np
import pytest
import torch
from hostkv_rs import (
    AsymmetricMHATokenToKVPoolHost,
    DeepSeekV4PagedHostPool,
    LogicalHostPool,
    MHATokenToKVPool,
    MHATokenToKVPoolHost,
    MLATokenToKVPool,
    MLATokenToKVPoolHost,
)
from hostkv_rs.pools import memory as _memory
from hostkv_rs.sglang import budgets as _budgets
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

EXAMPLES = int(os.environ.get("HOSTKV_FUZZ_EXAMPLES", "150"))
SETTINGS = settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    # CI draws the same examples on every run, so a landing never depends on luck; other runs
    # explore new ones (raise the count to search harder).
    derandomize=os.environ.get("CI") == "true",
)

# A refusal of one of these types is a clear answer.
CLEAR = (ValueError, TypeError, IndexError)
# SGLang's own texts of the other exception types the pools raise on purpose.
_ASSERT_TEXTS = (
    r"The requested size should be a multiple of the page size\.",
    r"Double-(free|alloc) detected",
    r"HostTensorAllocator only supports CPU allocations",
    r"HiCache host pool page_size \(\d+\) must be a multiple of dcp_size",
    r"HiCache DCP translation expects runs of whole widened pages",
    r"head_num \(\d+\) must be a multiple of split_factor",
    r"start_pos \(\d+\) must not exceed the allocated length",
    r"load on a dummy|backup on a dummy",
    # SGLang's bare asserts in the page-meta methods, worded by the core.
    r"indices is not a multiple of the (logical )?page size",
    r"get_split_heads_page_buffer_meta requires layout='page_head'",
)
SGLANG_ASSERTS = re.compile("|".join(_ASSERT_TEXTS))
SGLANG_NOT_IMPLEMENTED = re.compile(
    r"hostkv_rs does not serve this host pool|flat-page interface|"
    r"get_split_heads_page_buffer_meta requires layout='page_head'"
)
# SGLang's HiSparse text, and the pools' refusal to serve pages they do not hold (a dummy pool).
STATE_RUNTIME = re.compile(r"HiSparse host mem pool alloc failed|holds no KV bytes")


def _nested(layout, scalars=False):
    # Of 0-d parts, a strided nested tensor is 1-D: it passes the index fast path's shape tests.
    parts = [torch.tensor(1), torch.tensor(2)] if scalars else [torch.arange(3), torch.arange(2)]
    with warnings.catch_warnings():  # nested tensors are a prototype, and say so
        warnings.simplefilter("ignore")
        return torch.nested.nested_tensor(parts, layout=layout)


def _quantized():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # quantized tensors are deprecated
        return torch.quantize_per_tensor(torch.arange(4.0), 1.0, 0, torch.quint8)


# Values no argument expects (built fresh per example: some are mutable tensors).
_WEIRD_BUILDERS = [
    lambda: 0,
    lambda: -1,
    lambda: 1,
    lambda: 3,
    lambda: 2**31,
    lambda: 2**63 - 1,
    lambda: 2**63,
    lambda: -(2**63),
    lambda: -(2**63) - 1,
    lambda: 2**64,
    lambda: 2**1024,
    lambda: -(2**1024),
    lambda: 0.0,
    lambda: 0.5,
    lambda: -1.5,
    lambda: 1e308,
    lambda: -1e308,
    lambda: 5e-324,
    lambda: float("nan"),
    lambda: float("inf"),
    lambda: float("-inf"),
    lambda: True,
    lambda: False,
    lambda: None,
    lambda: "",
    lambda: "x",
    lambda: "kernel",
    lambda: b"\x01",
    list,
    lambda: [1, 2],
    lambda: [2**70],
    lambda: [1.5],
    lambda: (0,),
    dict,
    lambda: object(),
    lambda: 1 + 2j,
    lambda: np.int64(7),
    lambda: np.float64("nan"),
    lambda: np.arange(8)[::-1],
    lambda: np.arange(4, dtype=np.float32),
    lambda: np.array([2**64 - 1], dtype=np.uint64),
    lambda: torch.tensor(3),
    lambda: torch.tensor(2.5),
    lambda: torch.arange(4),
    lambda: torch.arange(4, dtype=torch.int32),
    lambda: torch.arange(4.0),
    lambda: torch.tensor([True, False]),
    lambda: torch.tensor([-(2**62)] * 4),
    lambda: torch.tensor([2**62] * 4),
    lambda: torch.full((4,), 2**64 - 1, dtype=torch.uint64),
    lambda: torch.zeros(2, 2, dtype=torch.int64),
    lambda: torch.empty(0, dtype=torch.int64),
    lambda: torch.arange(8)[::2],
    lambda: torch.arange(4).to_sparse(),
    lambda: torch.empty(4, dtype=torch.int64, device="meta"),
    lambda: _quantized(),
    lambda: _nested(torch.strided),
    lambda: _nested(torch.jagged),
    lambda: _nested(torch.strided, scalars=True),
    lambda: torch.zeros(4, dtype=torch.complex64),
]
WEIRD = st.sampled_from(range(len(_WEIRD_BUILDERS))).map(lambda i: _WEIRD_BUILDERS[i]())


def _check(call, what):
    try:
        call()
    except CLEAR:
        return
    except AssertionError as exc:
        assert SGLANG_ASSERTS.search(str(exc)), f"{what}: AssertionError {exc}"
    except NotImplementedError as exc:
        assert SGLANG_NOT_IMPLEMENTED.search(str(exc)), f"{what}: NotImplementedError {exc}"
    except RuntimeError as exc:
        assert STATE_RUNTIME.search(str(exc)), f"{what}: RuntimeError {exc}"
    # Anything else (OverflowError, ZeroDivisionError, AttributeError, ...) fails the test.


def _bounded_memory():
    """Patches that keep a fuzzed size from allocating much: a 32 MB budget, 64 MB available."""
    stack = ExitStack()
    stack.enter_context(
        mock.patch.object(_budgets, "host_memory_budget_bytes", lambda *a, **k: 32 << 20)
    )
    stack.enter_context(
        mock.patch.object(
            _memory,
            "available_host_memory",
            lambda: _memory.HostMemory(64 << 20, "the fuzz limit"),
        )
    )
    return stack


# ---- constructors -------------------------------------------------------------------------------


def _mha_device():
    return MHATokenToKVPool(32, 4, torch.bfloat16, 2, 8, 3)


def _mla_device():
    return MLATokenToKVPool(32, 4, torch.bfloat16, 12, 4, 3)


def _v4_buffers():
    return [torch.zeros(8, 64, dtype=torch.uint8) for _ in range(2)]


# (class, positional defaults by name, keyword defaults)
CONSTRUCTORS = {
    "mha": (
        MHATokenToKVPoolHost,
        {
            "device_pool": _mha_device,
            "host_to_device_ratio": lambda: 2.0,
            "host_size": lambda: 0,
            "page_size": lambda: 4,
            "layout": lambda: "page_first",
            "pin_memory": lambda: False,
            "device": lambda: "cpu",
            "allocator_type": lambda: "default",
        },
        {
            "mtp_draft_device_pools": lambda: (),
            "pool_label": lambda: "kv",
            "host_token_capacity": lambda: None,
            "head_group_num": lambda: 1,
        },
    ),
    "asym": (
        AsymmetricMHATokenToKVPoolHost,
        {
            "device_pool": lambda: MHATokenToKVPool(32, 4, torch.bfloat16, 2, 8, 3, v_head_dim=4),
            "host_to_device_ratio": lambda: 2.0,
            "host_size": lambda: 0,
            "page_size": lambda: 4,
            "layout": lambda: "page_first_direct",
            "pin_memory": lambda: False,
        },
        {"host_token_capacity": lambda: None},
    ),
    "mla": (
        MLATokenToKVPoolHost,
        {
            "device_pool": _mla_device,
            "host_to_device_ratio": lambda: 2.0,
            "host_size": lambda: 0,
            "page_size": lambda: 4,
            "layout": lambda: "layer_first",
            "pin_memory": lambda: False,
            "device": lambda: "cpu",
            "allocator_type": lambda: "default",
            "override_kv_cache_dim": lambda: None,
            "mtp_draft_device_pools": lambda: (),
            "dcp_size": lambda: 1,
            "dcp_rank": lambda: 0,
        },
        {
            "pool_label": lambda: "kv",
            "is_dummy": lambda: False,
            "host_token_capacity": lambda: None,
        },
    ),
    "mla_dummy": (
        MLATokenToKVPoolHost,
        {
            "device_pool": _mla_device,
            "host_to_device_ratio": lambda: 2.0,
            "host_size": lambda: 0,
            "page_size": lambda: 4,
            "layout": lambda: "layer_first",
            "pin_memory": lambda: False,
            "device": lambda: "cpu",
        },
        {"is_dummy": lambda: True, "dcp_size": lambda: 1, "host_token_capacity": lambda: None},
    ),
    "v4": (
        DeepSeekV4PagedHostPool,
        {
            "pool_name": lambda: "c4",
            "device_buffers": _v4_buffers,
            "item_bytes": lambda: 64,
            "num_host_pages": lambda: 4,
            "slot_page_size": lambda: 2,
            "layout": lambda: "layer_first",
            "device": lambda: "cpu",
            "pin_memory": lambda: False,
            "allocator_type": lambda: "default",
            "page_aligned_only": lambda: False,
        },
        {},
    ),
    "logical": (
        LogicalHostPool,
        {"size": lambda: 64, "page_size": lambda: 4, "layout": lambda: "layer_first"},
        {},
    ),
}


def _construct(kind: str, replace: dict):
    cls, positional, keywords = CONSTRUCTORS[kind]
    args = [replace[name]() if name in replace else make() for name, make in positional.items()]
    kwargs = {
        name: (replace[name]() if name in replace else make()) for name, make in keywords.items()
    }
    return cls(*args, **kwargs)


@st.composite
def constructor_cases(draw):
    kind = draw(st.sampled_from(sorted(CONSTRUCTORS)))
    _, positional, keywords = CONSTRUCTORS[kind]
    name = draw(st.sampled_from([*positional, *keywords]))
    value = draw(WEIRD)
    return kind, name, value


@SETTINGS
@given(case=constructor_cases())
def test_constructor_arguments_are_refused_clearly(case):
    kind, name, value = case
    with _bounded_memory():
        _check(lambda: _construct(kind, {name: lambda: value}), f"{kind}({name}={value!r})")


# ---- methods ------------------------------------------------------------------------------------


def _pool(kind: str):
    """(pool, device pool or None, the io backend its layout takes) with good arguments."""
    if kind in ("mha", "page_head", "mha_direct"):
        dp = _mha_device()
        layout = {"mha": "page_first", "page_head": "page_head"}.get(kind, "page_first_direct")
        backend = "direct" if kind == "mha_direct" else "kernel"
        return MHATokenToKVPoolHost(dp, 2.0, 0, 4, layout, False), dp, backend
    if kind == "asym":
        dp = MHATokenToKVPool(32, 4, torch.bfloat16, 2, 8, 3, v_head_dim=4)
        pool = AsymmetricMHATokenToKVPoolHost(dp, 2.0, 0, 4, "page_first_direct", False)
        return pool, dp, "direct"
    if kind in ("mla", "mla_page_first", "mla_dummy"):
        dp = _mla_device()
        layout = "page_first" if kind == "mla_page_first" else "layer_first"
        is_dummy = kind == "mla_dummy"
        return MLATokenToKVPoolHost(dp, 2.0, 0, 4, layout, False, is_dummy=is_dummy), dp, "kernel"
    if kind in ("v4", "v4_page_first"):
        layout = "page_first" if kind == "v4_page_first" else "layer_first"
        pool = DeepSeekV4PagedHostPool("c4", _v4_buffers(), 64, 4, 2, layout, pin_memory=False)
        return pool, None, "kernel"
    if kind == "v4_c4":
        dev = [torch.zeros(4, 37440, dtype=torch.uint8) for _ in range(2)]
        pool = DeepSeekV4PagedHostPool("c4", dev, 37440, 2, 64, "layer_first", pin_memory=False)
        return pool, None, "kernel"
    return LogicalHostPool(64, 4), None, "kernel"


def _flat_page(pool):
    try:
        return pool.get_dummy_flat_data_page()
    except NotImplementedError:  # SGLang's asymmetric pools have no flat pages
        return torch.zeros(1)


def _methods(pool, dp, backend):
    """name -> list of argument builders (good values) for the public methods of `pool`."""
    P = pool.page_size
    h = lambda: torch.arange(P)
    d = lambda: torch.arange(P, 2 * P)
    rows = lambda: torch.full((2, 64), -1, dtype=torch.int64)
    lens = lambda: torch.zeros(2, dtype=torch.int64)
    methods = {
        "alloc": [lambda: P],
        "free": [h],
        "available_size": [],
        "clear": [],
        "get_data_page": [lambda: 0, lambda: True],
        "set_from_flat_data_page": [lambda: 0, lambda: _flat_page(pool)],
        "get_page_buffer_meta": [h],
        "get_page_buffer_element_size": [lambda: 1],
        "load_to_device_per_layer": [lambda: dp, h, d, lambda: 0, lambda: backend],
        "backup_from_device_all_layer": [lambda: dp, h, d, lambda: backend],
        "load_to_device_per_layer_physical": [lambda: dp, h, d, lambda: 0, lambda: backend],
        "backup_from_device_all_layer_physical": [lambda: dp, h, d, lambda: backend],
        "prepare_transfer_indices": [h, d, lambda: backend],
        "get_contiguous_buf_infos": [],
        "get_hybrid_pool_buffer": [],
        "get_dummy_flat_data_page": [],
        "is_stride_page_aligned": [lambda: 4096],
    }
    if hasattr(pool, "maybe_dcp_kernel_indices"):
        methods["maybe_dcp_kernel_indices"] = [h]
    if hasattr(pool, "get_split_heads_page_buffer_meta"):
        methods["get_split_heads_page_buffer_meta"] = [h, lambda: 2]
    if hasattr(pool, "alloc_page"):
        methods["alloc_page"] = [lambda: 1]
        methods["alloc_paged_token_slots"] = [rows, lens, lambda: 0, lambda: 0, lambda: P]
        methods["allocated_host_indices"] = [rows, lambda: 0, lambda: P]
    if isinstance(pool, DeepSeekV4PagedHostPool):
        methods["backup_tokens_from_device_all_layer"] = [h, d]
        methods["attach_scale_buffers"] = [
            lambda: [torch.zeros(8, 8, dtype=torch.uint8) for _ in range(pool.layer_num)],
            lambda: 8,
        ]
    return {name: args for name, args in methods.items() if hasattr(pool, name)}


POOL_KINDS = [
    "mha",
    "page_head",
    "mha_direct",
    "asym",
    "mla",
    "mla_page_first",
    "mla_dummy",
    "v4",
    "v4_page_first",
    "v4_c4",
    "logical",
]


@st.composite
def method_cases(draw):
    kind = draw(st.sampled_from(POOL_KINDS))
    pool, dp, backend = _pool(kind)
    methods = _methods(pool, dp, backend)
    name = draw(st.sampled_from(sorted(methods)))
    builders = methods[name]
    position = draw(st.integers(0, len(builders))) if builders else None
    value = draw(WEIRD)
    return kind, pool, name, builders, position, value


@SETTINGS
@given(case=method_cases())
def test_method_arguments_are_refused_clearly(case):
    kind, pool, name, builders, position, value = case
    args = [make() for make in builders]
    if position is not None and position < len(args):
        args[position] = value
    with _bounded_memory():
        _check(lambda: getattr(pool, name)(*args), f"{kind}.{name}({args!r})")


@pytest.mark.parametrize("kind", POOL_KINDS)
def test_every_method_takes_its_good_arguments(kind):
    # The fuzz's baseline: with nothing replaced, each call succeeds or is one of SGLang's
    # refusals (e.g. a dummy pool's transfers), so a fuzzed failure is the fuzzed value's.
    pool, dp, backend = _pool(kind)
    for name, builders in _methods(pool, dp, backend).items():
        args = [make() for make in builders]
        _check(lambda name=name, args=args: getattr(pool, name)(*args), f"{kind}.{name}")
