"""SGLang's host-memory budget for HiCache pools: (available - 10 GiB) split over the ranks on
this host, booked against a budget scope when one is active (SGLang 0.5.21+), the
fixed-size capacity agreed over SGLang's pipeline-parallel group, and SGLang's refusal text.

The pools call these with the budget function they look up at call time
(`hostkv_rs.pools.base.host_memory_budget_bytes`, SGLang's name in `pool_host.base`), so a test
that patches that name, or `host_memory_budget_bytes` here, steers every check.
"""

from __future__ import annotations

import importlib
import inspect
import logging
import sys
import types
from contextlib import contextmanager
from contextvars import ContextVar

import torch

from hostkv_rs import _env
from hostkv_rs.pools import memory as _memory
from hostkv_rs.sglang.sources import sglang_release

logger = logging.getLogger(__name__)

# SGLang keeps 10 GiB (binary) of host memory out of every HiCache budget.
HICACHE_HOST_MEMORY_RESERVE_BYTES = 10 * 1024**3


# The SGLang modules whose `host_memory_budget_bytes` its pools call (by name, so a test's patch
# of it there steers them): the KV pools' base, and the module of the V4 pools.
SGLANG_POOL_BASE = "sglang.srt.mem_cache.pool_host.base"
SGLANG_V4_POOLS = "sglang.srt.mem_cache.memory_pool_host"


def ranks_per_host() -> int:
    """Ranks that share this host's memory, as the installed SGLang release counts them: its own
    `ranks_per_host` (0.5.19+: the world group's or the launch world's size // its nnodes), none
    in 0.5.18 (its budget is not split). Without SGLang: world_size // SGLANG_NNODES (or NNODES)
    when torch.distributed runs."""
    base = _sglang_pool_base("ranks_per_host") if sglang_release() is not None else None
    if base is not None:
        sglang_ranks = getattr(base, "ranks_per_host", None)
        if sglang_ranks is None:
            return 1  # 0.5.18: every rank may take the whole host's budget
        return max(int(sglang_ranks()), 1)
    return _ranks_from_environment()


def _sglang_pool_base(why: str):
    """SGLang's pool base module, or None where it does not import (logged for `why`)."""
    try:
        return importlib.import_module(SGLANG_POOL_BASE)
    except ImportError as exc:
        logger.debug("%s: SGLang's pool base does not import (%s)", why, exc)
        return None


def _ranks_from_environment() -> int:
    try:
        import torch.distributed as dist

        distributed = dist.is_available() and dist.is_initialized()
        world = dist.get_world_size() if distributed else 1
    except (RuntimeError, ValueError, ImportError) as exc:
        # A half-initialised process group must not break pool construction.
        logger.debug("ranks_per_host: no usable process group (%s)", exc)
        return 1
    if world <= 1:
        return 1
    # Outside the try: a bad SGLANG_NNODES is the user's to fix, not a missing process group.
    return max(world // _env.nnodes(), 1)


_budget_scope: ContextVar[int | None] = ContextVar("hostkv_host_memory_budget", default=None)


@contextmanager
def host_memory_budget_scope(budget_bytes: int):
    """Book every pool built inside against one budget instead of re-reading psutil (SGLang
    0.5.21+ `host_memory_budget_scope`)."""
    token = _budget_scope.set(budget_bytes)
    try:
        yield
    finally:
        _budget_scope.reset(token)


@contextmanager
def unbooked_on_failure():
    """A refusal raised inside puts the budget scopes (ours, and SGLang's where it has one) back
    as they were on entry: hostkv_rs's own allocation check runs after SGLang's budget check has
    booked the pool, and a pool refused there is never built (SGLang's own refusal books
    nothing, so restoring after it changes nothing)."""
    _, theirs = _sglang_scope()
    bookings = [(var, var.get()) for var in (_budget_scope, theirs) if var is not None]
    try:
        yield
    except BaseException:
        for var, value in bookings:
            if value is not None:
                var.set(value)
        raise


def _sglang_scope():
    """SGLang's pool base module, when imported, and its budget scope variable (0.5.21+), else
    None for either."""
    base = sys.modules.get(SGLANG_POOL_BASE)
    return base, getattr(base, "_host_memory_budget", None)


def _sglang_scope_budget(requested_bytes: int) -> int | None:
    """Inside SGLang's own budget scope (0.5.21+ auto-sizing books every host pool of a server
    against one snapshot), book there too, as SGLang's pools do."""
    base, scope = _sglang_scope()
    if scope is None or scope.get() is None:
        return None
    return base.host_memory_budget_bytes(requested_bytes)


def host_memory_budget_bytes(requested_bytes: int = 0, *, auto_size: bool = False) -> int:
    """Host RAM this rank may claim: (available - 10 GiB) split across the ranks on this host,
    where available is the smaller of the machine's and its memory cgroup's. Inside a budget
    scope (ours or SGLang's) the request is booked against the scope when it fits, and the
    allowance before booking is returned, as SGLang 0.5.21+ does."""
    return host_memory_budget(requested_bytes, auto_size=auto_size)[0]


def host_memory_budget(requested_bytes: int = 0, *, auto_size: bool = False) -> tuple[int, str]:
    """`host_memory_budget_bytes` and the words saying where it came from (for a refusal)."""
    available = _budget_scope.get()
    if available is not None:
        if requested_bytes <= available:
            _budget_scope.set(available - requested_bytes)
        return available, "the budget left in host_memory_budget_scope"
    booked = _sglang_scope_budget(requested_bytes)
    if booked is not None:
        return booked, "the budget left in SGLang's host memory budget scope"
    memory = _sglang_available_memory(auto_size) or _memory.available_host_memory()
    ranks = ranks_per_host()
    budget = (memory.available - HICACHE_HOST_MEMORY_RESERVE_BYTES) // ranks
    source = f"{memory.source}, {_memory.gb(memory.available)} GB, less the 10 GiB reserve" + (
        f", split over {ranks} ranks on this host" if ranks > 1 else ""
    )
    return budget, source


def _sglang_available_memory(auto_size: bool) -> _memory.HostMemory | None:
    """The available memory SGLang 0.5.21+ budgets from, where it is loaded: its own
    `available_host_memory_bytes` (the machine's, bounded by the cgroup hierarchy it finds in
    `/proc/self/mountinfo`, with its release's page-cache credit, `memory.high` and headroom
    log), so our pool's budget is the one SGLang's would get. None before 0.5.21 (psutil alone
    there; ours also honours the cgroup limit) and without SGLang."""
    release = sglang_release()
    if release is None or release < (0, 5, 21):
        return None
    base = _sglang_pool_base("available memory")
    available = getattr(base, "available_host_memory_bytes", None)
    if available is None:
        return None
    try:
        keywords = inspect.signature(available).parameters
    except (TypeError, ValueError):
        keywords = {}
    # 0.5.22+: auto-sizing refuses to guess when the cgroup cannot be read; a pool's check
    # falls back to the machine's figure with a warning.
    if "allow_cgroup_fallback" in keywords:
        nbytes = available(allow_cgroup_fallback=not auto_size)
    else:
        nbytes = available()
    return _memory.HostMemory(
        int(nbytes), "the available memory SGLang reads (the machine's, bounded by its cgroup)"
    )


# The unpatched budget, so a check knows when it may say where the budget came from (tests and
# SGLang's own tests patch `host_memory_budget_bytes` with plain functions).
default_budget_bytes = host_memory_budget_bytes


def call_budget(budget, requested_bytes: int = 0, *, auto_size: bool = False) -> int:
    """Call a budget function, the one here or one patched in with SGLang <= 0.5.20's
    signature (no arguments)."""
    if _takes_arguments(budget):
        return budget(requested_bytes, auto_size=auto_size)
    return budget()


def budget_and_source(
    budget, default, requested_bytes: int = 0, sglang_module: str = SGLANG_POOL_BASE
) -> tuple[int, str | None]:
    """The host budget (booked like `host_memory_budget_bytes`) and where it came from, or None
    for the source when a caller patched a budget function (its figure is all there is).
    `budget` is the pool module's function at call time, `default` its unpatched one;
    `sglang_module` the SGLang module whose `host_memory_budget_bytes` SGLang's own pool of
    this kind calls (a patch of it counts too: SGLang's own tests patch it there)."""
    # The module global is read at call time, so a patched `host_memory_budget_bytes` counts.
    if budget is default and host_memory_budget_bytes is default_budget_bytes:
        theirs = sglang_patched_budget(sglang_module)
        if theirs is None:
            return host_memory_budget(requested_bytes)
        # Called as SGLang's pool of the installed release calls it: with the request from
        # 0.5.21 (MHA and MLA), without one before and for V4.
        release = sglang_release()
        with_request = sglang_module == SGLANG_POOL_BASE and (
            release is None or release >= (0, 5, 21)
        )
        return (theirs(requested_bytes) if with_request else theirs()), None
    return (budget(requested_bytes) if _takes_arguments(budget) else budget()), None


def sglang_patched_budget(module_name: str = SGLANG_POOL_BASE):
    """SGLang's `host_memory_budget_bytes` as its module `module_name` holds it, where a caller
    patched it, or patched the available-memory function it reads; None while both are
    SGLang's own (ours then computes the same budget, and says where it came from)."""
    module = sys.modules.get(module_name)
    budget = getattr(module, "host_memory_budget_bytes", None)
    if budget is None:
        return None
    available = getattr(sys.modules.get(SGLANG_POOL_BASE), "available_host_memory_bytes", None)
    for func, name in (
        (budget, "host_memory_budget_bytes"),
        (available, "available_host_memory_bytes"),
    ):
        if func is not None and not _is_sglangs(func, name):
            return budget
    return None


def _is_sglangs(func, name: str) -> bool:
    """Whether `func` is SGLang's own function `name`: a plain function defined in SGLang, not
    a mock (even one that wraps it) or a stand-in made with `functools.wraps` (which copies the
    name and module, and leaves `__wrapped__`)."""
    return (
        isinstance(func, types.FunctionType)
        and not hasattr(func, "__wrapped__")
        and func.__qualname__ == name
        and str(func.__module__).startswith("sglang.")
    )


def budget_source_text(source: str | None) -> str:
    """The sentence a memory refusal appends after SGLang's text: which limit set the budget."""
    return f" The budget is {source}." if source else ""


def _takes_arguments(func) -> bool:
    try:
        return bool(inspect.signature(func).parameters)
    except (TypeError, ValueError):
        return True


def check_host_memory(requested_bytes: int, available_bytes: int, source: str | None) -> None:
    """SGLang's ValueError when `requested_bytes` exceeds the host budget."""
    if requested_bytes > available_bytes:
        raise ValueError(
            f"Not enough host memory available. Requesting {_memory.gb(requested_bytes)} GB but "
            f"only have {_memory.gb(available_bytes)} GB free. Please reduce the size of the "
            f"hierarchical cache.{budget_source_text(source)}"
        )


def sync_fixed_hicache_size(size: int, host_size) -> int:
    """MIN-reduce a fixed-size (`--hicache-size`) token capacity over SGLang's PP group, so every
    pipeline stage exposes the same host capacity. A no-op outside a distributed SGLang run."""
    if host_size <= 0:
        return size
    try:
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            return size
        from sglang.srt.distributed.parallel_state import get_pp_group

        pp_group = get_pp_group()
    except (ImportError, AssertionError):
        return size
    if pp_group.world_size <= 1:
        return size
    # A size past int64 cannot fit any host; the memory check refuses it after the reduce.
    tensor = torch.tensor(min(size, 2**63 - 1), dtype=torch.int64)
    dist.all_reduce(tensor, op=dist.ReduceOp.MIN, group=pp_group.cpu_group)
    synced = int(tensor.item())
    if synced == 2**63 - 1:
        synced = size
    if synced != size:
        logger.info("Sync fixed-size HiCache host token capacity from %d to %d.", size, synced)
    return synced
