"""Host slot bookkeeping: SGLang's lazy-release free list with an ownership map, so a slot is
never handed to two owners and a double or foreign free is refused before anything is released.
Used by every pool (`HostKVCache`, the V4 paged pool and the logical pool)."""

from __future__ import annotations

import numpy as np
import torch

from hostkv_rs import _core
from hostkv_rs.pools.args import NegativeSlotError, SlotRangeError
from hostkv_rs.pools.tensor_mode import outside_inference_mode

_CPU = torch.device("cpu")

# Host bytes per slot that the bookkeeping below can hold at once, for the host-memory check: the
# int64 free list, the int64 chunks parked on the release list and the int64 list `torch.cat`
# builds when it merges them (a view of the first keeps its whole storage alive until then), and
# the one-byte ownership map.
SLOT_TABLE_BYTES = 3 * 8 + 1


def slot_table_bytes(slots: int) -> int:
    """Peak host bytes of the free list and ownership map of a pool of `slots` slots."""
    return slots * SLOT_TABLE_BYTES


def slots_in_pool(indices, size: int, what: str) -> torch.Tensor:
    """`indices` as a CPU int64 tensor of slots in `[0, size)` that the pool owns: a copy, since
    the caller may keep writing to what it passed (a tensor, or a numpy array that
    the conversion only wraps) after the slots sit on a release list."""
    refuse_single_slot(indices, what)
    slots = _core.as_index_array(indices, _CPU).to(torch.int64)
    if slots.numel():
        lo, hi = int(slots.min()), int(slots.max())
        if lo < 0 or hi >= size:
            error = NegativeSlotError if lo < 0 else SlotRangeError
            raise error(f"{what}: indices must lie in [0, {size}), got min={lo}, max={hi}")
    return slots.clone()


def refuse_single_slot(indices, what: str) -> None:
    """TypeError for one slot not in a sequence (a 0-d tensor or array, a number). SGLang's pools
    take len() of what they free: a TypeError there too, raised (in some releases) after part of
    the free was done; refused here before anything. So is a nested tensor, whose len() fails
    inside torch."""
    if isinstance(indices, torch.Tensor):
        _core.refuse_nested(indices, what)
        single = indices.dim() == 0
    elif isinstance(indices, np.ndarray):
        single = indices.ndim == 0
    else:
        single = isinstance(indices, (int, float, np.generic))
    if single:
        raise TypeError(f"{what}: indices must be a sequence, got {indices!r}")


def index_list(indices) -> list[int]:
    """Index values as a list of ints, for the core's page arithmetic."""
    return _core.as_index_array(indices, _CPU).tolist()


def slot_list_text(slots: torch.Tensor, limit: int = 32) -> str:
    """A list of slots for an error message: SGLang's `[a, b, ...]` text, capped at `limit`
    entries (a million-slot free must not build megabytes of text)."""
    if slots.numel() <= limit:
        return str(slots.tolist())
    head = ", ".join(map(str, slots[:limit].tolist()))
    return f"[{head}, ...] ({slots.numel()} slots)"


class SlotFreeList:
    """SGLang's lazy-release free list: `alloc` takes from the front of `free_slots`, `free`
    parks chunks on `release_slots`, merged only when `free_slots` runs short (one torch.cat per
    merge, not per free; #30658). `slot_used` marks what is allocated, so a slot is never handed
    to two owners and a double or foreign free is refused before anything is released."""

    # Counts the resets (`clear()`): an undo of an allocation made before one has nothing to
    # undo, the slots were reclaimed, and possibly handed out again.
    _slot_generation = 0

    @outside_inference_mode  # alloc and free update the ownership map in place
    def _reset_free_list(self, n: int) -> None:
        self._slot_generation += 1
        self.free_slots = torch.arange(n, dtype=torch.int64)
        self.release_slots = []
        self.num_release_slots = 0
        self.slot_used = torch.zeros(n, dtype=torch.bool)

    def available_size(self):
        return len(self.free_slots) + self.num_release_slots

    def _merge_release_slots(self):
        if self.num_release_slots == 0:
            return
        if len(self.free_slots) == 0 and len(self.release_slots) == 1:
            self.free_slots = self.release_slots[0]
        else:
            self.free_slots = torch.cat([self.free_slots, *self.release_slots])
        self.release_slots = []
        self.num_release_slots = 0

    def _take_slots(self, need_size: int) -> torch.Tensor | None:
        """The first `need_size` free slots (a view of the free list, as in SGLang), marked
        used, or None when the pool is short."""
        if need_size > self.available_size():
            return None
        if need_size > len(self.free_slots):
            self._merge_release_slots()
        selected = self.free_slots[:need_size]
        already = self.slot_used[selected]
        if bool(already.any()):
            raise AssertionError(
                f"Double-alloc detected: slots already allocated: "
                f"{slot_list_text(selected[already])}."
            )
        self.free_slots = self.free_slots[need_size:]
        self.slot_used[selected] = True
        return selected

    def _untake_slots(self, slots: torch.Tensor, generation: int) -> None:
        """Undo the `_take_slots` that returned `slots` while the free list was at
        `generation`: they go back to the head of the free list, so the pool hands them out
        next, as if that call had not been made. Nothing after a `clear()` in between (the
        slots were reclaimed, and may have a new owner), and only those still allocated."""
        if generation != self._slot_generation:
            return
        slots = slots[self.slot_used[slots]]
        self.slot_used[slots] = False
        self.free_slots = torch.cat([slots, self.free_slots])

    def _release_slots(self, slots: torch.Tensor) -> None:
        """Give back `slots` (CPU int64, in range): all must be allocated and distinct, or
        nothing is released (AssertionError, as SGLang's double-free detection)."""
        if slots.numel() == 0:
            return
        used = self.slot_used[slots]
        if not bool(used.all()):
            raise AssertionError(
                f"Double-free detected: slots not currently allocated: "
                f"{slot_list_text(slots[~used])}."
            )
        unique, counts = torch.unique(slots, return_counts=True)
        if bool((counts > 1).any()):
            raise AssertionError(
                f"Double-free detected: slots not currently allocated: "
                f"{slot_list_text(unique[counts > 1])}."
            )
        self.slot_used[slots] = False
        self.release_slots.append(slots)
        self.num_release_slots += slots.numel()
