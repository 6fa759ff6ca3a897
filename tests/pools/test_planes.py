"""`TokenPlanesPool` (pools/planes.py): what the MHA and MLA pools share, run on both kinds and
every layout with flat pages."""

from __future__ import annotations

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
    with pytest.raises(ValueError, match="page_size_bytes"):
        host.is_stride_page_aligned(0)
