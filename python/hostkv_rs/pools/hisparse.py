"""SGLang's `HiSparseHostPoolMixin` (pool_host/hisparse.py): request rows of host slots that grow
one page at a time, for the MLA and DeepSeek V4 paged host pools.

The pool supplies `page_size` and `alloc(n)` (None when short). Everything a refused call could
get wrong is checked before any slot is taken, so a refusal leaves the pool and the row alone.
"""

from __future__ import annotations

import logging

import torch

from hostkv_rs import _core
from hostkv_rs.pools.args import RequestRowError, as_int
from hostkv_rs.pools.base import _pool_lock

logger = logging.getLogger(__name__)

# Request tables hold slots and lengths (-1 marks an empty entry), as SGLang's int64 ones do.
_TABLE_DTYPES = (torch.int64, torch.int32)


def _table(name: str, table, dims: int) -> torch.Tensor:
    """A request table argument: a tensor of `dims` dimensions, refused by name otherwise."""
    if not isinstance(table, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(table).__name__}")
    if table.layout != torch.strided:
        raise TypeError(f"{name} must be a dense (strided) tensor, got {table.layout}")
    _core.refuse_nested(table, name)
    if table.is_meta:
        raise ValueError(f"{name} is on the meta device, which holds no values")
    if table.dtype not in _TABLE_DTYPES:
        raise TypeError(f"{name} must be an int64 or int32 tensor, got {table.dtype}")
    if table.dim() != dims:
        raise ValueError(f"{name} must have {dims} dimensions, got shape {tuple(table.shape)}")
    return table


def _alloc_failed(num_new_pages: int, req_pool_idx: int, start_pos: int, num_tokens: int):
    """SGLang's log line and error for a request row the pool has too few pages for."""
    logger.error(
        "HiSparse: host mem pool alloc failed for %d host pages "
        "(req_pool_idx=%d, start_pos=%d, num_tokens=%d)",
        num_new_pages,
        req_pool_idx,
        start_pos,
        num_tokens,
    )
    return RuntimeError(f"HiSparse host mem pool alloc failed for {num_new_pages} pages")


class HiSparseHostPoolMixin:
    def _round_up_to_page_size(self, size: int) -> int:
        return (size + self.page_size - 1) // self.page_size * self.page_size

    def alloc_page(self, num_pages: int) -> torch.Tensor | None:
        """`num_pages` whole pages of token slots, or None when the pool is short."""
        num_pages = as_int("num_pages", num_pages)
        if num_pages < 0:
            raise ValueError(f"num_pages must not be negative, got {num_pages}")
        return self.alloc(num_pages * self.page_size)

    def alloc_paged_token_slots(
        self,
        req_to_host_pool: torch.Tensor,
        req_to_host_pool_allocated_len: torch.Tensor,
        req_pool_idx: int,
        start_pos: int,
        num_tokens: int,
    ) -> torch.Tensor:
        """Grow request row `req_pool_idx` page by page until it covers `start_pos + num_tokens`
        and return that row's token slots `[start_pos, start_pos + num_tokens)`."""
        tables = (
            ("req_to_host_pool", req_to_host_pool, 2),
            ("req_to_host_pool_allocated_len", req_to_host_pool_allocated_len, 1),
        )
        for name, table, dims in tables:
            _table(name, table, dims)
        device = req_to_host_pool.device
        num_tokens = as_int("num_tokens", num_tokens)
        if num_tokens <= 0:
            return torch.empty((0,), dtype=torch.int64, device=device)
        req_pool_idx = as_int("req_pool_idx", req_pool_idx)
        start_pos = as_int("start_pos", start_pos)
        if start_pos < 0:
            raise ValueError(f"start_pos must not be negative, got {start_pos}")
        rows, width = req_to_host_pool.shape[0], req_to_host_pool.shape[1]
        rows = min(rows, req_to_host_pool_allocated_len.shape[0])
        if not 0 <= req_pool_idx < rows:
            raise IndexError(f"req_pool_idx {req_pool_idx} is outside the {rows} request rows")

        allocated_len = int(req_to_host_pool_allocated_len[req_pool_idx])
        end_pos = start_pos + num_tokens
        page_end = self._round_up_to_page_size(end_pos)
        # SGLang: a bare `assert start_pos <= allocated_len`.
        if start_pos > allocated_len:
            raise AssertionError(
                f"start_pos ({start_pos}) must not exceed the allocated length ({allocated_len})"
            )
        num_new_pages = max(page_end - allocated_len, 0) // self.page_size
        need = num_new_pages * self.page_size
        # SGLang takes the pages before it writes the row: a pool too short fails first, after
        # the allocator's own page-multiple assert (DCP pools take whole widened pages).
        if need and need % self.logical_page_size == 0 and self.available_size() < need:
            raise _alloc_failed(num_new_pages, req_pool_idx, start_pos, num_tokens)
        # SGLang would take the slots and then fail to store them (leaking them); refuse first.
        if page_end > width:
            raise RequestRowError(
                f"request row holds {width} host slots but {page_end} are needed "
                f"(start_pos={start_pos}, num_tokens={num_tokens})"
            )

        # The row grows by whole pages from its end; an end inside a page would take slots that
        # do not fit the row's gap.
        if page_end > allocated_len and allocated_len % self.page_size != 0:
            raise RequestRowError(
                f"request row {req_pool_idx} has an allocated length of {allocated_len}, not a "
                f"multiple of the page size {self.page_size}"
            )
        if page_end > allocated_len:
            for name, table, _ in tables:
                # torch writes an inference tensor outside inference mode and then raises:
                # refused before any slot is taken (a call that writes nothing reads them).
                if table.is_inference() and not torch.is_inference_mode_enabled():
                    raise RuntimeError(
                        f"{name} is an inference tensor, which torch does not update in place "
                        f"outside inference mode"
                    )
            with _pool_lock(self):  # no clear() between the slots and their generation
                host_locs = self.alloc_page(num_new_pages)
                generation = self._slot_generation
            if host_locs is None:  # another thread took the pages since the check above
                raise _alloc_failed(num_new_pages, req_pool_idx, start_pos, num_tokens)
            row = before = None
            try:
                row = req_to_host_pool[req_pool_idx, allocated_len:page_end]
                before = row.clone()
                row.copy_(host_locs.to(device=device, non_blocking=True))
                req_to_host_pool_allocated_len[req_pool_idx] = page_end
            except BaseException:
                # A table torch would not read or write: put the row back and the slots at the
                # head of the free list, as if this call had not been made.
                try:
                    if before is not None and not torch.equal(row, before):
                        row.copy_(before)
                finally:
                    self._untake(host_locs, generation)
                raise

        return req_to_host_pool[req_pool_idx, start_pos:end_pos]

    def allocated_host_indices(
        self, req_to_host_pool: torch.Tensor, req_pool_idx: int, allocated_len: int
    ) -> torch.Tensor:
        """The row's non-negative host slots up to its page-rounded allocated length."""
        _table("req_to_host_pool", req_to_host_pool, 2)
        req_pool_idx = as_int("req_pool_idx", req_pool_idx)
        allocated_len = as_int("allocated_len", allocated_len)
        if allocated_len < 0:
            raise ValueError(f"allocated_len must not be negative, got {allocated_len}")
        if not -req_to_host_pool.shape[0] <= req_pool_idx < req_to_host_pool.shape[0]:
            raise IndexError(
                f"req_pool_idx {req_pool_idx} is outside the {req_to_host_pool.shape[0]} request "
                f"rows"
            )
        host_len = min(self._round_up_to_page_size(allocated_len), req_to_host_pool.shape[1])
        host_indices = req_to_host_pool[req_pool_idx, :host_len]
        return host_indices[host_indices >= 0]
