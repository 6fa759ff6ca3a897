"""The device side of a host pool: which device layer tensors its transfers touch, and which host
layer each controller layer id maps to.

SGLang 0.5.22+ captures the device buffers when it builds a host pool and ignores the device pool
passed to each transfer; 0.5.23 builds from buffer infos that hold only the layers this rank
owns. Both generations are captured here once, at construction, and checked once, so a transfer
only looks its layer up.

Controller layer ids: a target layer is the device pool's local layer id (a slot of the device
pool); packed MTP draft `i` comes as `device_layer_num + i` with `is_draft=True`. Host layers: the
owned target layers in order, then the drafts at `target_layer_num + i` (under layer sharding
`target_layer_num` may exceed the owned count by one; that host layer stays unused).
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import NamedTuple

import torch

from hostkv_rs import _core
from hostkv_rs._indices import check_storage

# A layer id outside the pools: a TransferError (nothing was copied) that is also the IndexError
# SGLang's `k_buffer[layer_id]` would raise. Defined in Rust, which raises it too.
LayerIndexError = _core.LayerIndexError


class DeviceLayers(NamedTuple):
    """The device side of one core call, as `PoolCore.backup/load` take it."""

    ptrs: list[int]
    rows: int
    device: torch.device


def check_device_layers(
    planes: Sequence[Sequence], item_bytes: Sequence[int], what: str, like: Sequence = ()
):
    """Check per-plane lists of device layer tensors; returns `(ptrs, rows, device)`.

    Every tensor must be a dense layer-first array whose rows are exactly the host item size of
    its plane; all must sit on one CPU or CUDA device. `like`, per plane, is the host's
    `(dtype, (heads, head_dim))`: a tensor of another dtype, or a (rows, heads, dim) tensor with
    another head split, is refused even when its rows have the same byte size (same bytes are
    not the same data). `rows` is the smallest dim 0, so the core's bounds check covers every
    layer. Pointers are plane-major.
    """
    ptrs: list[int] = []
    rows: int | None = None
    device: torch.device | None = None
    for plane, (tensors, want) in enumerate(zip(planes, item_bytes, strict=True)):
        for layer, tensor in enumerate(tensors):
            where = f"{what} plane {plane} layer {layer}"
            if not isinstance(tensor, torch.Tensor):
                raise TypeError(f"{where}: expected a torch.Tensor, got {type(tensor).__name__}")
            if tensor.device.type not in ("cpu", "cuda"):
                raise ValueError(
                    f"{where}: device pools must be on CPU or CUDA, got {tensor.device}"
                )
            if device is None:
                device = tensor.device
            elif tensor.device.type != device.type:
                raise ValueError(
                    f"{where}: device tensors mix {device.type} and {tensor.device.type}"
                )
            elif tensor.device != device:
                # One call runs on one GPU's stream; another GPU's layer is not its memory.
                raise ValueError(f"{where}: device tensors mix {device} and {tensor.device}")
            if tensor.dim() < 1:
                raise ValueError(f"{where}: expected a tensor with a token dimension")
            if not tensor.is_contiguous():
                raise ValueError(f"{where}: device layer tensors must be contiguous")
            check_storage(tensor, where)
            row_bytes = tensor.element_size()
            for extent in tensor.shape[1:]:
                row_bytes *= extent
            if plane < len(like):
                dtype, split = like[plane]
                if tensor.dtype != dtype:
                    raise ValueError(
                        f"{where}: dtype {tensor.dtype} differs from the host pool's {dtype}"
                    )
                if split is not None and tensor.dim() == 3 and tuple(tensor.shape[1:]) != split:
                    raise ValueError(
                        f"{where}: head split {tuple(tensor.shape[1:])} (heads, head_dim) "
                        f"differs from the host pool's {split}"
                    )
            if row_bytes != want:
                raise ValueError(
                    f"{where}: device rows are {row_bytes} bytes but the host pool's item size is "
                    f"{want} bytes (dtype or head geometry differs from the host pool)"
                )
            n = tensor.shape[0]
            rows = n if rows is None else min(rows, n)
            ptrs.append(tensor.data_ptr())
    if device is None:
        raise ValueError(f"{what}: no device layer tensors")
    return ptrs, rows or 0, device


class DeviceSide:
    """Device layer tensors per plane (owned target layers in host order, then one per packed
    draft) with the controller-id -> (host layer, tensor) maps; checked at construction."""

    def __init__(
        self,
        planes: Sequence[Sequence[torch.Tensor]],
        item_bytes: Sequence[int],
        owned_slots: Sequence[int],
        device_layer_num: int,
        target_layer_num: int,
        what: str = "device pool",
        like: Sequence = (),
    ):
        self.planes = tuple(tuple(plane) for plane in planes)
        self.like = tuple(like)
        self.item_bytes = tuple(item_bytes)
        owned = tuple(owned_slots)
        count = len(self.planes[0]) if self.planes else 0
        drafts = count - len(owned)
        if drafts < 0 or any(len(p) != count for p in self.planes):
            raise ValueError(f"{what}: every plane needs one tensor per owned layer and draft")
        if len(owned) > target_layer_num:
            raise ValueError(
                f"{what}: {len(owned)} owned layers do not fit {target_layer_num} host layers"
            )
        # controller layer id -> (host layer, tensor position)
        self.targets = {slot: (k, k) for k, slot in enumerate(owned)}
        self.drafts = {
            device_layer_num + i: (target_layer_num + i, len(owned) + i) for i in range(drafts)
        }
        self.device_layer_num = device_layer_num
        self.host_layer_num = target_layer_num + drafts
        self._what = what
        # Checked on first use, not here: SGLang builds host pools from device pools whose
        # geometry it never compares, and a pool that never transfers must still construct.
        self.ptrs = None
        self.rows = 0
        first = next((t for plane in self.planes for t in plane), None)
        self.device = getattr(first, "device", torch.device("cpu"))
        # One all-layer core call when every host layer has a device layer, in order.
        self.complete = len(owned) == target_layer_num

    def _check(self) -> None:
        count = len(self.planes[0]) if self.planes else 0
        if count:
            self.ptrs, self.rows, self.device = check_device_layers(
                self.planes, self.item_bytes, self._what, self.like
            )
        else:
            self.ptrs, self.rows, self.device = [], 0, torch.device("cpu")
        self._shapes = [t.shape for plane in self.planes for t in plane]

    def _tensor_ptrs(self, position: int) -> list[int]:
        """Plane-major pointers of one tensor position. SGLang reads `data_ptr()` at call time,
        so a device tensor whose storage was swapped (or reshaped) is checked again rather than
        served from the pointers taken at the first check."""
        count = len(self.planes[0])
        flat = [p * count + position for p in range(len(self.planes))]
        if not self._current(flat):
            self._check()
        return [self.ptrs[i] for i in flat]

    def _current(self, flat: Sequence[int]) -> bool:
        if self.ptrs is None:
            return False
        count = len(self.planes[0])
        for i in flat:
            t = self.planes[i // count][i % count]
            if t.data_ptr() != self.ptrs[i] or t.shape != self._shapes[i]:
                return False
        return True

    def load(self, layer_id, is_draft: bool) -> tuple[int, DeviceLayers] | None:
        """(host layer, device layers) of a per-layer load, or None for a target layer this pool
        does not hold (SGLang returns without copying). A draft id outside the packed drafts is
        refused: the controller never sends one."""
        layer_id = layer_key(layer_id)
        if not is_draft:
            entry = self.targets.get(layer_id)
            if entry is None:
                return None
        else:
            entry = self.drafts.get(layer_id)
            if entry is None:
                first = self.device_layer_num
                raise LayerIndexError(
                    f"is_draft layer_id {layer_id} is not a packed MTP draft layer: this host "
                    f"pool holds drafts at layer ids [{first}, {first + len(self.drafts)})"
                )
        host_layer, position = entry
        return host_layer, DeviceLayers(self._tensor_ptrs(position), self.rows, self.device)

    def backup(self) -> list[tuple[int | None, DeviceLayers]]:
        """The core calls of an all-layer backup: one call over every host layer (host layer
        None), or one call per held layer when some host layer has no device layer."""
        if self.complete:
            if not self._current(range(sum(map(len, self.planes)))):
                self._check()
            return [(None, DeviceLayers(list(self.ptrs), self.rows, self.device))]
        entries = sorted({*self.targets.values(), *self.drafts.values()})
        return [
            (host, DeviceLayers(self._tensor_ptrs(pos), self.rows, self.device))
            for host, pos in entries
        ]


def layer_key(layer_id) -> int:
    """A layer id as an int. SGLang compares it with ints (`0 <= layer_id < n`), so a value that
    is not an integer fails there too; a bool is refused rather than read as 0 or 1."""
    if isinstance(layer_id, bool):
        raise TypeError(f"layer_id must be an integer, got {layer_id!r}")
    try:
        return operator.index(layer_id)
    except TypeError:
        raise TypeError(f"layer_id must be an integer, got {layer_id!r}") from None


def owned_range(device_pool) -> tuple[int, int]:
    """`[start, end)` of the local device layers a (possibly layer-sharded) device pool stores."""
    if getattr(device_pool, "layer_shard_enabled", False):
        start, end = device_pool._owned_local_layer_range()
        return int(start), int(end)
    return 0, int(device_pool.layer_num)


def sharded_host_layer_num(device_pool) -> int:
    """Host target layers SGLang allocates for a device pool: ceil(L / shard) when sharded."""
    if getattr(device_pool, "layer_shard_enabled", False):
        shard = int(device_pool.layer_shard_size)
        return (int(device_pool.layer_num) + shard - 1) // shard
    return int(device_pool.layer_num)
