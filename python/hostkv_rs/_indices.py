"""Index tensors as the Rust core reads them: contiguous int32/int64 arrays at a known address."""

from __future__ import annotations

import torch

_ACCEPTED = (torch.int32, torch.int64)


def _not_integer(dtype: torch.dtype) -> bool:
    return dtype.is_floating_point or dtype.is_complex or dtype == torch.bool


def storage_holds(tensor: torch.Tensor) -> bool:
    """Whether `tensor`'s storage really holds the elements its shape claims (a storage shrunk
    with `untyped_storage().resize_()` does not, and reading or writing through the tensor's
    address would then leave the allocation)."""
    if tensor.numel() == 0:
        return True
    last = tensor.storage_offset()
    for extent, stride in zip(tensor.shape, tensor.stride()):
        last += (extent - 1) * stride
    return (last + 1) * tensor.element_size() <= tensor.untyped_storage().nbytes()


def check_storage(tensor: torch.Tensor, what: str) -> None:
    if not storage_holds(tensor):
        raise ValueError(
            f"{what}: the tensor's storage holds {tensor.untyped_storage().nbytes()} bytes, "
            f"fewer than its shape {tuple(tensor.shape)} (offset {tensor.storage_offset()}) needs"
        )


def as_index_array(indices, device: torch.device | None = None) -> torch.Tensor:
    """Return a contiguous 1-D int32/int64 tensor holding `indices`, on `device` when given.

    Other integer dtypes are widened to int64; lists and numpy arrays are accepted too (an empty
    list is an empty int64 array). Float, complex and bool values are refused rather than
    truncated, and so are tensors on the meta device, which hold no values. The returned tensor
    must be kept alive until the transfer call returns.
    """
    if (
        isinstance(indices, torch.Tensor)
        and indices.dtype in _ACCEPTED
        and indices.dim() == 1
        and indices.is_contiguous()
        and not indices.is_meta
        and (device is None or (indices.is_cpu and device.type == "cpu"))
    ):
        check_storage(indices, "index tensor")
        return indices  # already what the core reads: the per-call fast path
    if indices is None:
        raise TypeError("index tensors must be integer tensors, got None")
    if not isinstance(indices, torch.Tensor):
        try:
            # No dtype here: asking for int64 would silently truncate 1.5 to 1.
            converted = torch.as_tensor(indices)
        except (TypeError, ValueError, RuntimeError) as exc:
            raise TypeError(
                f"index tensors must be integer tensors, got {type(indices).__name__}: {exc}"
            ) from None
        if converted.numel() == 0 and converted.dtype.is_floating_point:
            converted = converted.to(torch.int64)  # [] defaults to float32
        indices = converted
    if indices.device.type == "meta":
        raise ValueError("index tensors on the meta device hold no values")
    if indices.layout == torch.strided:
        check_storage(indices, "index tensor")
    if indices.layout != torch.strided:
        raise TypeError(f"index tensors must be dense (strided) tensors, got {indices.layout}")
    if indices.dtype not in _ACCEPTED:
        if _not_integer(indices.dtype):
            raise TypeError(f"index tensors must be integer tensors, got {indices.dtype}")
        if indices.dtype == torch.uint64 and indices.numel():
            # Past 2**63 - 1 the int64 the core reads would wrap to a negative index.
            # Same bits as int64: a uint64 past 2**63 - 1 reads negative.
            as_signed = indices.reshape(-1).contiguous().view(torch.int64)
            too_big = as_signed < 0
            if bool(too_big.any()):
                position = int(too_big.nonzero()[0, 0])
                value = int(as_signed[position]) + 2**64
                raise ValueError(
                    f"index {value} at position {position} does not fit in int64 (indices are "
                    f"slots in [0, 2**63))"
                )
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
