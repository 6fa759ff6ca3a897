"""`TokenPlanesPool` (pools/planes.py): what the MHA and MLA pools share, run on both kinds and
every layout with flat pages."""

from __future__ import annotations

import warnings

import pytest
import torch
from hostkv_rs.pools.args import FlatPageError
from hostkv_rs.pools.planes import TokenPlanesPool
from reference import make_mha, make_mla

CASES = [
    (make, layout)
    for make in (make_mha, make_mla)
    for layout in ("layer_first", "page_first", "page_first_direct")
]


def _ids(case):
    make, layout = case
    return f"{make.__name__[5:]}-{layout}"


@pytest.fixture(params=CASES, ids=[_ids(c) for c in CASES])
def host(request):
    make, layout = request.param
    pool, _ = make(layout, 4)
    assert isinstance(pool, TokenPlanesPool)
    return pool


def test_a_flat_page_round_trips_and_touches_no_other_page(host):
    index = 2 * host.page_size
    before = host.get_data_page(index + host.page_size).clone()
    page = torch.arange(host.get_dummy_flat_data_page().numel()).to(host.dtype)
    host.set_from_flat_data_page(index, page)
    assert torch.equal(host.get_data_page(index), page)
    assert host.get_data_page(index, flat=False).numel() == page.numel()
    assert torch.equal(host.get_data_page(index + host.page_size), before)


def test_a_flat_page_of_another_size_is_refused_and_changes_nothing(host):
    index = host.page_size
    before = host.get_data_page(index).clone()
    short = torch.ones(host.get_dummy_flat_data_page().numel() - 1, dtype=host.dtype)
    with pytest.raises(FlatPageError) as e:
        host.set_from_flat_data_page(index, short)
    assert isinstance(e.value, ValueError) and isinstance(e.value, RuntimeError)
    assert torch.equal(host.get_data_page(index), before)


def test_page_metadata_points_into_the_pool(host):
    pointers, sizes = host.get_page_buffer_meta(torch.arange(2 * host.page_size))
    start = host.kv_buffer.data_ptr()
    end = start + host.kv_buffer.numel() * host.kv_buffer.element_size()
    assert len(pointers) == len(sizes) > 0
    assert all(start <= p and p + s <= end for p, s in zip(pointers, sizes))
    assert host.get_page_buffer_element_size() == sizes[0]


def test_the_pair_check_and_the_stride_question(host):
    backend = "direct" if host.layout == "page_first_direct" else "kernel"
    host._check_io(backend)
    with pytest.raises(ValueError):
        host._check_io("no_such_backend")
    assert isinstance(host.is_stride_page_aligned(), bool)
    if host.layout == "layer_first":
        # SGLang answers False for it without reading the argument.
        assert host.is_stride_page_aligned(0) is False
        assert host.is_stride_page_aligned("x") is False
    else:
        with pytest.raises(ValueError, match="page_size_bytes"):
            host.is_stride_page_aligned(0)


def _hand_built(host, buffer):
    """The pool as SGLang's unit tests build one: `__new__`, then SGLang's attributes by hand."""
    pool = type(host).__new__(type(host))
    names = ["layout", "page_size", "layer_num", "dtype", "size", "device", "pin_memory"]
    names += ["head_num", "head_dim"] if hasattr(host, "head_num") else ["kv_cache_dim"]
    for name in names:
        setattr(pool, name, getattr(host, name))
    pool.kv_buffer = buffer
    return pool


def test_a_pool_built_with_new_reads_its_hand_set_buffer_as_the_built_one(host):
    host.set_from_flat_data_page(
        host.page_size, torch.arange(host.get_dummy_flat_data_page().numel()).to(host.dtype)
    )
    copy = host.kv_buffer.clone()
    pool = _hand_built(host, copy)
    index = host.page_size
    assert torch.equal(pool.get_data_page(index), host.get_data_page(index))
    assert pool.get_dummy_flat_data_page().shape == host.get_dummy_flat_data_page().shape
    indices = torch.arange(2 * host.page_size)
    ours, theirs = pool.get_page_buffer_meta(indices), host.get_page_buffer_meta(indices)
    assert [p - copy.data_ptr() for p in ours[0]] == [
        p - host.kv_buffer.data_ptr() for p in theirs[0]
    ]
    assert ours[1] == theirs[1]
    page = -torch.ones(host.get_dummy_flat_data_page().numel(), dtype=host.dtype)
    pool.set_from_flat_data_page(2 * host.page_size, page)
    assert torch.equal(pool.get_data_page(2 * host.page_size), page)
    assert not torch.equal(host.get_data_page(2 * host.page_size), page)


def test_a_pool_built_with_new_follows_a_hand_set_buffer_set_again(host):
    pool = _hand_built(host, host.kv_buffer.clone())
    pool.get_page_buffer_meta(torch.arange(host.page_size))
    pool.kv_buffer = again = host.kv_buffer.clone()
    pointers, sizes = pool.get_page_buffer_meta(torch.arange(host.page_size))
    start = again.data_ptr()
    end = start + again.numel() * again.element_size()
    assert all(start <= p and p + n <= end for p, n in zip(pointers, sizes))


def test_a_pool_built_with_new_refuses_what_it_cannot_move_by_name(host):
    pool = _hand_built(host, host.kv_buffer.clone())
    backend = "direct" if host.layout == "page_first_direct" else "kernel"
    with pytest.raises(RuntimeError, match="built without its constructor"):
        pool.load_to_device_per_layer(None, torch.arange(4), torch.arange(4), 0, backend)
    # A (layout, backend) pair SGLang's pool refuses is refused first, with its text.
    other = "kernel" if backend == "direct" else "direct"
    if host.layout != "layer_first":
        with pytest.raises(ValueError) as refused:
            pool.load_to_device_per_layer(None, torch.arange(4), torch.arange(4), 0, other)
        assert not isinstance(refused.value, RuntimeError)
    for odd in [(host.kv_buffer.clone(),), [host.kv_buffer.clone()]]:
        pool.kv_buffer = odd
        with pytest.raises(ValueError, match="kv_buffer holds"):
            pool.get_data_page(0)


@pytest.mark.parametrize("change", ["smaller", "a view", "another dtype", "not contiguous"])
def test_a_pool_built_with_new_refuses_a_hand_set_buffer_its_geometry_does_not_describe(
    host, change
):
    buffer = host.kv_buffer.clone()
    if change == "smaller":
        buffer = buffer.flatten()[: buffer.numel() // 2].clone()
    elif change == "a view":
        buffer = buffer[..., :1]  # a view of another shape
    elif change == "not contiguous":
        buffer = buffer.transpose(0, 1).contiguous().transpose(0, 1)
    else:
        buffer = buffer.to(torch.float64 if host.dtype != torch.float64 else torch.float32)
    pool = _hand_built(host, buffer)
    with pytest.raises(ValueError, match="kv_buffer holds"):
        pool.get_data_page(0)
    with pytest.raises(ValueError, match="kv_buffer holds"):
        pool.get_page_buffer_meta(torch.arange(host.page_size))
    if host.layout != "layer_first":
        # A (layout, backend) pair SGLang refuses is still refused first, with its text, before
        # the buffer is read (SGLang's asymmetric unit test sets a dtype its buffers do not have).
        other = "kernel" if host.layout == "page_first_direct" else "direct"
        indices = torch.arange(host.page_size)
        for transfer in (
            lambda: pool.load_to_device_per_layer(None, indices, indices, 0, other),
            lambda: pool.backup_from_device_all_layer(None, indices, indices, other),
        ):
            with pytest.raises(ValueError) as refused:
                transfer()
            assert "kv_buffer holds" not in str(refused.value)
            assert "expected" in str(refused.value) or "Unsupported" in str(refused.value)


def test_a_pool_built_with_new_without_a_buffer_still_gives_its_dummy_page(host):
    pool = _hand_built(host, None)
    assert pool.get_dummy_flat_data_page().shape == host.get_dummy_flat_data_page().shape
    del pool.size  # nor the geometry a spec needs: no bytes, no page to align
    assert pool.is_stride_page_aligned() is False
    assert not hasattr(pool, "_pool_core")  # no bytes, so no core


@pytest.mark.parametrize("known", ["page_num", "the buffer alone"])
def test_a_pool_built_with_new_without_size_counts_it_from_what_it_was_given(host, known):
    """SGLang's page methods never read `size` (its unit tests set `page_num`, or only a
    buffer), and MLA's never read `kv_cache_dim`: ours count them from what is set."""
    indices = torch.arange(2 * host.page_size)
    pool = _hand_built(host, host.kv_buffer.clone())
    del pool.size
    if known == "page_num":
        pool.page_num = host.size // host.page_size
    if hasattr(host, "head_num"):
        pool.v_head_dim = 2 * host.head_dim  # SGLang's symmetric pool reads no V width
    else:
        del pool.kv_cache_dim
    theirs = host.get_page_buffer_meta(indices)
    ours = pool.get_page_buffer_meta(indices)
    assert [p - pool.kv_buffer.data_ptr() for p in ours[0]] == [
        p - host.kv_buffer.data_ptr() for p in theirs[0]
    ]
    assert ours[1] == theirs[1]
    assert torch.equal(pool.get_data_page(host.page_size), host.get_data_page(host.page_size))
    assert pool.is_stride_page_aligned() == host.is_stride_page_aligned()


def test_a_page_read_from_the_pool_is_written_over_the_page_it_overlaps(host):
    """`get_data_page` at a token index that is not a page start is a view of the pool that
    overlaps the page at the next page start; writing it there moves the bytes it held, where
    torch's `copy_` alone refuses overlapping memory with a RuntimeError."""
    step = max(host.page_size // 2, 1)
    for index in range(0, 4 * host.page_size, step):
        host.get_data_page(index, flat=False).view(torch.uint8).random_(0, 256)
    source = host.get_data_page(host.page_size + step)
    want = source.contiguous().view(torch.uint8).clone()
    host.set_from_flat_data_page(2 * host.page_size, source)
    # Bytes, not values: random bytes include NaNs, which never compare equal.
    assert torch.equal(host.get_data_page(2 * host.page_size).contiguous().view(torch.uint8), want)


def test_a_quantized_flat_page_is_refused_by_type_and_changes_nothing(host):
    index = host.page_size
    before = host.get_data_page(index).clone()
    n = host.get_dummy_flat_data_page().numel()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torch deprecates quantized tensors
        quantized = torch.quantize_per_tensor(torch.ones(n), 0.5, 0, torch.quint8)
    with pytest.raises(TypeError, match="flat data page: expected a tensor of plain values"):
        host.set_from_flat_data_page(index, quantized)
    assert torch.equal(host.get_data_page(index), before)
