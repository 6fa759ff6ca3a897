"""Host memory for the pools: the budget check and Rust-owned buffers viewed as torch tensors."""

from __future__ import annotations

import logging
import os
import sys
from contextlib import contextmanager
from contextvars import ContextVar

import psutil
import torch

from hostkv_rs import _core

# SGLang keeps 10 GiB (binary) of host memory out of every HiCache budget.
HICACHE_HOST_MEMORY_RESERVE_BYTES = 10 * 1024**3
# Largest single cudaHostRegister call, as SGLANG_HICACHE_HOST_REGISTER_CHUNK_GB (default 256 GiB).
_DEFAULT_CHUNK_GB = 256


def ranks_per_host() -> int:
    """Ranks that share this host's memory: world_size // nnodes when torch.distributed runs."""
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            nnodes = int(os.environ.get("SGLANG_NNODES", os.environ.get("NNODES", "1")) or 1)
            return max(dist.get_world_size() // max(nnodes, 1), 1)
    except (RuntimeError, ValueError, ImportError) as exc:
        # A half-initialised process group must not break pool construction.
        logging.getLogger(__name__).debug("ranks_per_host: no usable process group (%s)", exc)
    return 1


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


def _sglang_scope_budget(requested_bytes: int) -> int | None:
    """Inside SGLang's own budget scope (0.5.21+ auto-sizing books every host pool of a server
    against one snapshot), book there too, as SGLang's pools do."""
    base = sys.modules.get("sglang.srt.mem_cache.pool_host.base")
    scope = getattr(base, "_host_memory_budget", None)
    if scope is None or scope.get() is None:
        return None
    return base.host_memory_budget_bytes(requested_bytes)


def host_memory_budget_bytes(requested_bytes: int = 0, *, auto_size: bool = False) -> int:
    """Host RAM this rank may claim: (available - 10 GiB) split across the ranks on this host.
    Inside a budget scope (ours or SGLang's) the request is booked against the scope when it
    fits, and the allowance before booking is returned, as SGLang 0.5.21+ does."""
    available = _budget_scope.get()
    if available is not None:
        if requested_bytes <= available:
            _budget_scope.set(available - requested_bytes)
        return available
    booked = _sglang_scope_budget(requested_bytes)
    if booked is not None:
        return booked
    free = psutil.virtual_memory().available - HICACHE_HOST_MEMORY_RESERVE_BYTES
    return free // ranks_per_host()


def register_chunk_limit_bytes() -> int:
    gb = int(os.environ.get("SGLANG_HICACHE_HOST_REGISTER_CHUNK_GB", _DEFAULT_CHUNK_GB))
    return max(gb, 1) * 1024**3


def _hugepage_settings() -> tuple[str, str]:
    size = os.environ.get("SGLANG_HUGEPAGE_SIZE", "").strip()
    mode = os.environ.get("SGLANG_HUGEPAGE_MODE", "").strip().lower()
    if not mode:
        strict = os.environ.get("SGLANG_HUGEPAGE_STRICT", "").strip().lower() in ("1", "true")
        mode = "required" if strict else ("prefer" if size else "off")
    return size, mode


def alloc_host_region(nbytes: int, pin_memory: bool, registration_granularity: int = 0):
    """Allocate `nbytes` of pre-touched host memory in Rust, registered with CUDA when asked and
    possible. Returns the `_core.HostRegion`; it lives as long as any tensor viewing it."""
    size, mode = _hugepage_settings()
    region = _core.HostRegion(
        nbytes,
        hugepage=size if mode != "off" else "",
        hugepage_mode=mode if mode != "off" else "prefer",
        numa_node=_numa_node(),
    )
    if pin_memory and nbytes > 0 and _core.cuda_available():
        if registration_granularity < 0:
            raise ValueError(
                f"registration_granularity_bytes must be positive, got {registration_granularity}"
            )
        region.register_cuda(registration_granularity, register_chunk_limit_bytes())
    elif pin_memory and nbytes > 0 and torch.cuda.is_available():
        # Never leave a pool silently unpinned next to a GPU: transfers would be pageable.
        raise RuntimeError(
            "pin_memory=True: torch sees a CUDA GPU but the hostkv_rs core cannot use CUDA, so "
            f"the host pool cannot be pinned ({_core.runtime_info()})"
        )
    return region


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
    value = os.environ.get("HOSTKV_NUMA_NODE", "").strip()
    return int(value) if value else None


def region_bytes(region) -> torch.Tensor:
    """A 1-D uint8 tensor over the whole region (zero-copy; keeps the region alive)."""
    if region.nbytes == 0:
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer(region, dtype=torch.uint8)


def region_view(region, dtype: torch.dtype, shape, offset: int = 0) -> torch.Tensor:
    """A typed, shaped view of `region` starting `offset` bytes in."""
    nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
    flat = region_bytes(region)
    return flat[offset : offset + nbytes].view(dtype).view(*shape)
