"""The core's conversion of index arguments and its storage checks (`rust/src/python/indices.rs`),
called directly; the pools' paths through them are in test_errors.py and test_device_binding.py."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from hostkv_rs import _core

CPU = torch.device("cpu")


@pytest.mark.parametrize(
    "given",
    [
        [3, 1, 2],
        (3, 1, 2),
        np.array([3, 1, 2]),
        np.array([3, 1, 2], dtype=">i8"),  # not native byte order
        np.array([2, 1, 3])[::-1],  # negative stride
        torch.tensor([3, 1, 2], dtype=torch.int16),  # widened
        torch.tensor([[3, 1], [2, 0]]),  # flattened
        torch.tensor([3, 9, 1, 9, 2])[::2],  # strided
        torch._neg_view(torch.tensor([-3, -1, -2])),  # a negative view reads as its values
    ],
)
def test_what_converts_reads_as_its_values(given):
    expected = np.asarray(given.tolist() if hasattr(given, "tolist") else given).ravel().tolist()
    out = _core.as_index_array(given, CPU)
    assert out.dtype in (torch.int32, torch.int64)
    assert out.dim() == 1 and out.is_contiguous() and not out.is_neg()
    assert out.tolist() == expected


def test_a_ready_tensor_is_returned_as_is():
    """The per-call fast path: a contiguous 1-D int64/int32 CPU tensor is read in place."""
    for dtype in (torch.int64, torch.int32):
        given = torch.arange(4, dtype=dtype)
        assert _core.as_index_array(given, CPU) is given
        assert _core.as_index_array(given) is given


def test_an_empty_list_is_an_empty_int64_array():
    out = _core.as_index_array([], CPU)
    assert out.dtype == torch.int64 and out.numel() == 0


@pytest.mark.parametrize(
    ("given", "error", "text"),
    [
        (None, TypeError, "index tensors must be integer tensors, got None"),
        ([1.5, 2], TypeError, "index tensors must be integer tensors, got torch.float32"),
        (torch.ones(2, dtype=torch.bool), TypeError, "got torch.bool"),
        (np.array([1, "a"], dtype=object), TypeError, "got ndarray"),
        ([1, 2**64], ValueError, r"index 18446744073709551616 does not fit in int64"),
        (
            torch.tensor([1, 2**63 + 5], dtype=torch.uint64),
            ValueError,
            r"index 9223372036854775813 at position 1 does not fit in int64",
        ),
        (
            torch.empty(3, dtype=torch.int64, device="meta"),
            ValueError,
            "index tensors on the meta device hold no values",
        ),
        (
            torch.arange(4).to_sparse(),
            TypeError,
            "index tensors must be dense \\(strided\\) tensors, got torch.sparse_coo",
        ),
    ],
)
def test_what_is_refused_is_named(given, error, text):
    with pytest.raises(error, match=text):
        _core.as_index_array(given, CPU)


def test_a_subclass_is_read_as_the_plain_tensor_over_its_storage():
    class Lying(torch.Tensor):
        def data_ptr(self):
            return 0

    given = torch.tensor([5, 6, 7]).as_subclass(Lying)
    out = _core.as_index_array(given, CPU)
    assert type(out) is torch.Tensor and out.tolist() == [5, 6, 7]
    assert out.untyped_storage().data_ptr() == torch.Tensor.data_ptr(given)


def test_as_tensor_keeps_the_dtype():
    """Nothing is truncated: floats stay floats, for the caller's own refusal."""
    assert _core.as_tensor([1.5]).dtype == torch.float32
    assert _core.as_tensor([]).dtype == torch.int64
    given = torch.tensor([1], dtype=torch.uint8)
    assert _core.as_tensor(given) is given


def test_a_storage_shrunk_under_a_tensor_is_refused():
    tensor = torch.arange(8)
    tensor.untyped_storage().resize_(16)
    with pytest.raises(ValueError, match=r"page: the tensor's storage holds 16 bytes, fewer than"):
        _core.check_storage(tensor, "page")
    with pytest.raises(ValueError, match="index tensor: the tensor's storage holds 16 bytes"):
        _core.as_index_array(tensor, CPU)


def test_nested_sparse_and_quantized_tensors_are_named():
    nested = torch.nested.nested_tensor([torch.arange(3), torch.arange(2)], layout=torch.jagged)
    with pytest.raises(
        TypeError, match="rows: expected a dense \\(strided\\) tensor, got a nested"
    ):
        _core.refuse_nested(nested, "rows")
    with pytest.raises(TypeError, match="got torch.sparse_coo"):
        _core.check_storage(torch.ones(3).to_sparse(), "rows")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # quantized tensors are deprecated
        quantized = torch.quantize_per_tensor(torch.ones(4), 0.1, 0, torch.qint8)
    with pytest.raises(TypeError, match="page: expected a tensor of plain values, got quantized"):
        _core.check_page_values(quantized, "page")
    _core.check_page_values(torch.ones(4), "page")  # plain values pass


def test_a_nested_tensor_of_scalars_is_refused_not_read_as_a_row():
    """Its parts are 0-d, so it looks like one strided int64 row; its storage is not one."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # the strided nested layout is a prototype
        nested = torch.nested.nested_tensor([torch.tensor(5), torch.tensor(6)])
    for device in (None, CPU):
        with pytest.raises(TypeError, match="index tensor: expected a dense \\(strided\\) tensor"):
            _core.as_index_array(nested, device)


def test_a_view_past_any_byte_count_is_not_held():
    """Only a meta tensor can claim one; the count of bytes it needs overflows 128 bits."""
    huge = torch.empty(0, dtype=torch.complex128, device="meta")
    huge = huge.as_strided((2**62,), (2**63 - 1,))
    with pytest.raises(ValueError, match="w: the tensor's storage holds 0 bytes"):
        _core.check_storage(huge, "w")


def test_a_device_given_as_a_string_is_honoured():
    out = _core.as_index_array(torch.arange(4)[::2], "cpu")
    assert out.tolist() == [0, 2] and out.is_contiguous()
    ready = torch.arange(3)
    assert _core.as_index_array(ready, "cpu").tolist() == [0, 1, 2]
