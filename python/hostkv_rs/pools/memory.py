"""Host memory for the pools: how much there is (machine and cgroup), the check that a pool's
allocations fit, and Rust-owned buffers viewed as torch tensors. SGLang's HiCache budget is
`hostkv_rs.sglang.budgets`."""

from __future__ import annotations

import importlib
import logging
from dataclasses import dataclass

import psutil
import torch

from hostkv_rs import _core, _env

logger = logging.getLogger(__name__)

# Largest single cudaHostRegister call, as SGLANG_HICACHE_HOST_REGISTER_CHUNK_GB (default 256 GiB).
_DEFAULT_CHUNK_GB = 256


# ---- how much host memory there is -------------------------------------------------------------

# Where the cgroup hierarchies are mounted and where this process's cgroup is named; module
# attributes so tests can point them at fake trees.
CGROUP_ROOT = "/sys/fs/cgroup"
PROC_SELF_CGROUP = "/proc/self/cgroup"


def gb(nbytes: int) -> str:
    """`nbytes` in decimal GB with two decimals, as SGLang's messages print `x / 1e9:.2f`; a
    count past the float range (a fuzzed size) is printed exactly instead of overflowing."""
    try:
        return f"{nbytes / 1e9:.2f}"
    except OverflowError:
        sign = "-" if nbytes < 0 else ""
        whole, rest = divmod(abs(nbytes), 10**9)
        return f"{sign}{whole}.{rest // 10**7:02d}"


@dataclass(frozen=True)
class HostMemory:
    """Bytes this process can still allocate, and the limit that says so (for messages)."""

    available: int
    source: str


def cgroup_memory_limit() -> HostMemory | None:
    """What the memory cgroup of this process still allows (cgroup v2 the smaller of
    `memory.max` and `memory.high` less `memory.current`, else v1 `memory.limit_in_bytes -
    memory.usage_in_bytes`, the tightest level of the hierarchy, inactive file pages counted as
    free; read by the core), or None without a limit."""
    found = _core.cgroup_memory_limit(CGROUP_ROOT, PROC_SELF_CGROUP)
    return None if found is None else HostMemory(*found)


def available_host_memory() -> HostMemory:
    """Host memory this process can allocate now: the smaller of the machine's available memory
    (psutil, MemAvailable) and what its memory cgroup still allows (a container's limit is not
    in MemAvailable)."""
    machine = HostMemory(psutil.virtual_memory().available, "the machine's available memory")
    limit = cgroup_memory_limit()
    if limit is not None and limit.available < machine.available:
        return limit
    return machine


def check_allocations_fit(what: str, parts: dict[str, int]) -> None:
    """Refuse, before anything is allocated, a pool whose allocations together (`parts`: KV
    bytes, slot tables, staging buffers) exceed the host memory available now. SGLang's budget
    check sees only the KV bytes; a pool of tiny tokens has slot tables many times larger."""
    needed = sum(parts.values())
    limit = available_host_memory()
    if needed > limit.available:
        shown = ", ".join(f"{name} {gb(size)} GB" for name, size in parts.items() if size)
        raise ValueError(
            f"Not enough host memory for {what}: it needs {gb(needed)} GB ({shown}) but "
            f"only {gb(limit.available)} GB is available ({limit.source}). Please reduce "
            f"the size of the hierarchical cache."
        )


def register_chunk_limit_bytes() -> int:
    return _env.register_chunk_gb(_DEFAULT_CHUNK_GB) * 1024**3


def _hugepage_settings() -> tuple[str, str]:
    return _env.hugepage_settings()


def _pinnable(pin_memory: bool, nbytes: int) -> bool:
    """Whether to register `nbytes` of host memory with CUDA: when asked and the core can use
    CUDA. Never leaves a pool silently unpinned next to a GPU the core cannot use (transfers
    would be pageable)."""
    if not (pin_memory and nbytes > 0):
        return False
    if _core.cuda_available():
        return True
    if torch.cuda.is_available():
        raise RuntimeError(
            "pin_memory=True: torch sees a CUDA GPU but the hostkv_rs core cannot use CUDA, so "
            f"the host pool cannot be pinned ({_core.runtime_info()})"
        )
    return False


def registration_device(device=None) -> int | None:
    """The GPU a pool's memory is pinned for: the GPU its device pool names (`cuda:N`), so each
    rank of a multi-GPU server pins for its own GPU whatever thread builds the pool; else torch's
    current device, the one SGLang's `cudaHostRegister` runs on (None before torch initialises
    CUDA: the core then uses the thread's current context, else GPU 0)."""
    try:
        named = torch.device(device) if device is not None else None
    except (TypeError, RuntimeError, ValueError):
        named = None
    if named is not None and named.type == "cuda" and named.index is not None:
        return named.index
    # is_initialized() first: it asks the driver nothing (is_available() may call cuInit).
    if torch.cuda.is_initialized():
        return torch.cuda.current_device()
    return None


def alloc_host_region(
    nbytes: int, pin_memory: bool, registration_granularity: int = 0, device=None
):
    """Allocate `nbytes` of pre-touched host memory in Rust, registered with CUDA (for
    `device`'s GPU, see `registration_device`) when asked and possible. Returns the
    `_core.HostRegion`; it lives as long as any tensor viewing it."""
    size, mode = _hugepage_settings()
    node = _numa_node()
    try:
        region = _core.HostRegion(
            nbytes,
            hugepage=size if mode != "off" else "",
            hugepage_mode=mode if mode != "off" else "prefer",
            numa_node=node,
        )
    except ValueError as exc:
        if node is None or "NUMA node" not in str(exc):
            raise
        # The node came from the environment: say which variable to fix.
        raise ValueError(f"environment variable HOSTKV_NUMA_NODE={node}: {exc}") from None
    _register(region, pin_memory, registration_granularity, device=device)
    return region


def _register(
    region, pin_memory: bool, granularity: int, pinned_already: bool = False, device=None
) -> None:
    """Register `region` with CUDA when asked and possible (see `_pinnable`), in chunks that do
    not split a copy unit of `granularity` bytes (0: none), for `registration_device(device)`;
    memory pinned already (by its own allocator) is not registered a second time."""
    if not _pinnable(pin_memory, region.nbytes) or pinned_already:
        return
    if granularity < 0:
        raise ValueError(f"registration_granularity_bytes must be positive, got {granularity}")
    region.register_cuda(granularity, register_chunk_limit_bytes(), registration_device(device))


def is_storage_allocator(allocator) -> bool:
    """Whether `allocator` is a storage backend's (SGLang's shm, Mooncake, mori, TensorCast
    allocators), whose memory the pool adopts, rather than hostkv_rs's Rust-backed default."""
    return allocator is not None and not isinstance(allocator, HostTensorAllocator)


def alloc_pool_memory(
    allocator, dtype: torch.dtype, shape, pin_memory: bool, granularity: int, device=None
):
    """A pool's host memory of `shape` and `dtype`: (the tensor the pool views, the
    `_core.HostRegion` that owns or adopts it). The default allocator gives a Rust region and a
    view of it. A storage allocator's own `allocate(dims, dtype, "cpu")` gives the tensor, which
    `HostRegion.adopt` wraps (keeping it alive, freeing nothing). With `pin_memory` the core
    registers either with CUDA (chunked without splitting a copy unit of `granularity` bytes,
    0: none), so transfers find the registration, both io backends move the bytes, and
    `destroy()` unpins after the transfers queued on it; memory its allocator already pinned
    is not registered a second time (the core then does not know it, and the direct backend
    refuses it). `device` is the device pool's device: its GPU is the one registered for."""
    dims = tuple(int(d) for d in shape)
    if not is_storage_allocator(allocator):
        nbytes = torch.Size(dims).numel() * dtype.itemsize
        region = alloc_host_region(nbytes, pin_memory, granularity, device)
        return region_view(region, dtype, dims), region
    tensor = allocator.allocate(dims, dtype, "cpu")
    name = type(allocator).__name__
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name}.allocate returned a {type(tensor).__name__}, not a tensor")
    if tensor.device.type != "cpu" or tensor.dtype != dtype or tuple(tensor.shape) != dims:
        raise ValueError(
            f"{name}.allocate({dims}, {dtype}, 'cpu') returned a {tensor.device} {tensor.dtype} "
            f"tensor of shape {tuple(tensor.shape)}"
        )
    if not tensor.is_contiguous():
        raise ValueError(f"{name}.allocate returned a non-contiguous tensor")
    region = _core.HostRegion.adopt(tensor)
    _register(region, pin_memory, granularity, pinned_already=tensor.is_pinned(), device=device)
    return tensor, region


# Where SGLang defines `get_allocator_from_storage`.
_SGLANG_ALLOCATOR_MODULES = (
    "sglang.srt.mem_cache.pool_host.common",  # 0.5.19+
    "sglang.srt.mem_cache.memory_pool_host",  # before pool_host/ existed
)


def sglang_allocator_module():
    """The installed SGLang release's module with `get_allocator_from_storage`, or None when
    SGLang cannot be imported here."""
    for name in _SGLANG_ALLOCATOR_MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError as exc:
            logger.debug("no SGLang allocator module %s (%s)", name, exc)
            continue
        if hasattr(module, "get_allocator_from_storage"):
            return module
    return None


class HostTensorAllocator:
    """SGLang's default host allocator (`pool.allocator`), backed by a Rust `HostRegion`:
    pre-touched anonymous memory, hugepages per SGLANG_HUGEPAGE_SIZE/MODE. It owns no file
    descriptor, so `pool.fd` is None."""

    def allocate(self, dims, dtype: torch.dtype, device="cpu") -> torch.Tensor:
        if str(device) != "cpu":
            raise AssertionError(
                f"HostTensorAllocator only supports CPU allocations; got device={device!r}"
            )
        nbytes = torch.Size(dims).numel() * torch.empty((), dtype=dtype).element_size()
        return region_view(alloc_host_region(nbytes, pin_memory=False), dtype, dims)


def pin_dummy_pages(pin_memory: bool) -> bool:
    """Whether L3 dummy pages may be pinned: torch.zeros(pin_memory=True) needs a CUDA runtime, so
    a CPU-only process keeps pageable pages."""
    return bool(pin_memory) and _core.cuda_available() and torch.cuda.is_available()


def _numa_node() -> int | None:
    return _env.numa_node()


def region_bytes(region) -> torch.Tensor:
    """A 1-D uint8 tensor over the whole region (zero-copy; keeps it alive)."""
    if region.nbytes == 0:
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer(region, dtype=torch.uint8)


def region_view(region, dtype: torch.dtype, shape) -> torch.Tensor:
    """A typed, shaped view of the start of `region`."""
    nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
    return region_bytes(region)[:nbytes].view(dtype).view(*shape)
