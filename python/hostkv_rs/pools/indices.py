"""Index tensors as the Rust core reads them: contiguous int32/int64 arrays at a known address."""

from __future__ import annotations

import numpy as np
import torch

_ACCEPTED = (torch.int32, torch.int64)
# Integer dtypes widened to int64. Anything else (floats, bool, complex, and the quantized and
# bit-packed dtypes, which `Tensor.to(torch.int64)` cannot even convert) is refused by name.
_WIDENED = (torch.uint8, torch.int8, torch.int16, torch.uint16, torch.uint32, torch.uint64)


def _numpy_readable(array: np.ndarray) -> np.ndarray:
    """`array` in a form `torch.as_tensor` takes: it refuses negative strides (`a[::-1]`) and
    non-native byte order, and warns on a read-only array; a copy fixes each."""
    if not array.dtype.isnative:
        array = array.astype(array.dtype.newbyteorder("="))
    if any(stride < 0 for stride in array.strides) or not array.flags.writeable:
        array = np.array(array, order="C")
    return array


def _first_past_int64(values):
    """The first int outside int64 in nested lists/tuples (for the refusal's text)."""
    stack = [values]
    while stack:
        value = stack.pop()
        if isinstance(value, (list, tuple)):
            stack.extend(reversed(value))
        elif isinstance(value, int) and not -(2**63) <= value < 2**63:
            return value
    return "(a value)"


def as_tensor(indices) -> torch.Tensor:
    """`indices` (a tensor, numpy array, list, ...) as a tensor of its own dtype, or TypeError /
    ValueError naming what it is. No dtype is forced: int64 would truncate 1.5 to 1."""
    if isinstance(indices, torch.Tensor):
        return indices
    if indices is None:
        raise TypeError("index tensors must be integer tensors, got None")
    if isinstance(indices, np.ndarray):
        indices = _numpy_readable(indices)
    try:
        converted = torch.as_tensor(indices)
    except (TypeError, ValueError, RuntimeError) as exc:
        if "Overflow" in str(exc):
            # torch's words for a Python int outside int64 ("Overflow when unpacking long").
            raise ValueError(
                f"index {_first_past_int64(indices)} does not fit in int64 (indices are slots "
                f"in [0, 2**63))"
            ) from None
        raise TypeError(
            f"index tensors must be integer tensors, got {type(indices).__name__}: {exc}"
        ) from None
    if converted.numel() == 0 and converted.dtype.is_floating_point:
        converted = converted.to(torch.int64)  # [] defaults to float32
    return converted


def check_page_values(tensor: torch.Tensor, what: str) -> None:
    """`check_storage` for a page of values written into a pool."""
    if tensor.is_quantized:
        # Its storage holds integer codes, not the values (torch refuses to copy it raw).
        raise TypeError(f"{what}: expected a tensor of plain values, got quantized {tensor.dtype}")
    check_storage(tensor, what)


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


def _storage_data(tensor: torch.Tensor) -> int:
    """The address of the tensor's storage, 0 where it has none to read (torch raises for a
    functionalized tensor's)."""
    try:
        return tensor.untyped_storage().data_ptr()
    except RuntimeError:
        return 0


def refuse_nested(tensor: torch.Tensor, what: str) -> None:
    if tensor.is_nested:
        # Its rows live in separate buffers, and torch's own size and alias calls fail on it
        # with internal errors.
        raise TypeError(f"{what}: expected a dense (strided) tensor, got a nested tensor")


def element_count(indices) -> int | None:
    """How many indices SGLang counts in `indices`: a tensor's or array's elements, a
    sequence's entries; None for anything else (no count to check)."""
    if isinstance(indices, torch.Tensor):
        return indices.numel()
    if isinstance(indices, np.ndarray):
        return indices.size
    try:
        return len(indices)
    except TypeError:
        return None


def layer_tensors(what: str, layers) -> list:
    """Per-layer tensors as a list. A nested tensor is refused by name: iterating one fails
    inside torch ("NestedTensorImpl doesn't support sizes")."""
    if isinstance(layers, torch.Tensor):
        refuse_nested(layers, what)
    return list(layers)


def check_storage(tensor: torch.Tensor, what: str) -> None:
    refuse_nested(tensor, what)
    _check_dense_storage(tensor, what)


def _check_dense_storage(tensor: torch.Tensor, what: str) -> None:
    if tensor.layout != torch.strided:
        # A sparse or nested tensor has no one storage at an address to read.
        raise TypeError(f"{what}: expected a dense (strided) tensor, got {tensor.layout}")
    try:
        holds = storage_holds(tensor)
    except RuntimeError:
        # A nested tensor (one of 0-d parts is 1-D, strided and a plain torch.Tensor, so it
        # reaches the per-call fast path) has no sizes to read: say so, at no cost otherwise.
        refuse_nested(tensor, what)
        raise
    if not holds:
        raise ValueError(
            f"{what}: the tensor's storage holds {tensor.untyped_storage().nbytes()} bytes, "
            f"fewer than its shape {tuple(tensor.shape)} (offset {tensor.storage_offset()}) needs"
        )
    if tensor.numel() and tensor.device.type != "meta" and _storage_data(tensor) == 0:
        raise ValueError(
            f"{what}: the tensor's storage has no memory to read or write (a functionalized or "
            f"fake tensor?)"
        )


def plain_tensor(tensor: torch.Tensor, what: str = "tensor") -> torch.Tensor:
    """`tensor` as a plain `torch.Tensor` whose methods only torch answers, for reading its
    values through its address. A subclass's own methods (or its `__torch_function__`), and an
    attribute set on the object itself (`t.data_ptr = ...`), could report an address or a shape
    its storage does not have, and the core would read there. The alias (made with subclass
    overrides off) shares the storage, sizes and offset."""
    if type(tensor) is torch.Tensor and not tensor.__dict__:
        return tensor
    refuse_nested(tensor, what)
    with torch._C.DisableTorchFunctionSubclass():
        return torch.Tensor.as_subclass(tensor, torch.Tensor)


def as_index_array(indices, device: torch.device | None = None) -> torch.Tensor:
    """Return a contiguous 1-D int32/int64 tensor holding `indices`, on `device` when given.

    Other integer dtypes are widened to int64; lists and numpy arrays are accepted too (an empty
    list is an empty int64 array). Float, complex and bool values are refused rather than
    truncated, and so are tensors on the meta device, which hold no values. The returned tensor
    must be kept alive until the transfer call returns.
    """
    if isinstance(indices, torch.Tensor):
        indices = plain_tensor(indices, "index tensor")
    if (
        isinstance(indices, torch.Tensor)
        and indices.dtype in _ACCEPTED
        and indices.dim() == 1
        and indices.is_contiguous()
        and not indices.is_meta
        and not indices.is_neg()
        and (device is None or (indices.is_cpu and device.type == "cpu"))
    ):
        _check_dense_storage(indices, "index tensor")
        return indices  # already what the core reads: the per-call fast path
    indices = as_tensor(indices)
    if indices.device.type == "meta":
        raise ValueError("index tensors on the meta device hold no values")
    # A negative view (torch._neg_view) stores the values un-negated: read what it says.
    indices = indices.resolve_neg()
    if indices.layout == torch.strided:
        check_storage(indices, "index tensor")
    if indices.layout != torch.strided:
        raise TypeError(f"index tensors must be dense (strided) tensors, got {indices.layout}")
    if indices.dtype not in _ACCEPTED:
        if indices.dtype not in _WIDENED:
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
