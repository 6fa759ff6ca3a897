"""Index tensors as the Rust core reads them: contiguous int32/int64 arrays at a known address."""

from __future__ import annotations

import torch

_ACCEPTED = (torch.int32, torch.int64)


def as_index_array(indices, device: torch.device | None = None) -> torch.Tensor:
    """Return a contiguous 1-D int32/int64 tensor holding `indices`, on `device` when given.

    Other integer dtypes are widened to int64; lists and numpy arrays are accepted too. The
    returned tensor must be kept alive until the transfer call returns.
    """
    if not isinstance(indices, torch.Tensor):
        indices = torch.as_tensor(indices, dtype=torch.int64)
    if indices.dtype not in _ACCEPTED:
        if indices.dtype.is_floating_point or indices.dtype == torch.bool:
            raise TypeError(f"index tensors must be integer tensors, got {indices.dtype}")
        indices = indices.to(torch.int64)
    if device is not None and indices.device != device:
        indices = indices.to(device)
    indices = indices.reshape(-1)
    if not indices.is_contiguous():
        indices = indices.contiguous()
    return indices


def index_arg(indices: torch.Tensor) -> tuple[int, int, int, bool]:
    """`(address, length, itemsize, on_device)` of a tensor from `as_index_array`, as the core
    takes it."""
    return (indices.data_ptr(), indices.numel(), indices.element_size(), indices.is_cuda)
