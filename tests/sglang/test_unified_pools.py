"""SGLang 0.5.22+'s unified device pools (`unified_memory_pool`): each layer's K and V (or MLA
latent) rows are views of one token-major buffer, a whole entry apart, with other layers' rows,
another sub-pool and padding between them. Our host pools, built from the arguments SGLang's own
construction site passes, report SGLang's row stride and move exactly those rows: nothing else in
the shared buffer changes. (SGLang's own pools move them only with their JIT kernels on a GPU,
and refuse them on a CPU.)"""

from __future__ import annotations

import pytest
import sgl_harness as H
import torch

pytestmark = pytest.mark.skipif(not H.at_least(0, 5, 22), reason="unified pools: SGLang 0.5.22+")

PAGE = 4


def _mha():
    """SGLang's own SWA-hybrid factory: one buffer, a full sub-pool (3 layers, 2 heads x 16)
    growing down and a sliding-window one growing up."""
    U = H.module_or_none("sglang.srt.mem_cache.unified_memory_pool")
    bundle = U.init_unified_swa_pools(
        device="cpu",
        kv_cache_dtype=torch.bfloat16,
        head_num=2,
        head_dim=16,
        v_head_dim=16,
        swa_head_num=1,
        swa_head_dim=16,
        swa_v_head_dim=16,
        page_size=PAGE,
        start_layer=0,
        end_layer=None,
        swa_attention_layer_ids=[1, 3],
        full_attention_layer_ids=[0, 2, 4],
        full_max_total_num_tokens=96,
        swa_max_total_num_tokens=96,
        enable_memory_saver=False,
        need_sort=False,
    )
    return bundle.unified_memory_pool, bundle.token_to_kv_pool.full_kv_pool


def _mla():
    """An MLA sub-pool (112-byte rows x 3 layers in 352-byte entries: 16 bytes of padding each)
    beside a Mamba sub-pool, as SGLang's Mamba hybrid lays them out."""
    U = H.module_or_none("sglang.srt.mem_cache.unified_memory_pool")
    full = U.MLASubPoolSpec(
        name="full",
        layer_num=3,
        kv_lora_rank=32,
        qk_rope_head_dim=24,
        store_dtype=torch.bfloat16,
        grow_direction="down",
    )
    mamba = U.MambaSubPoolSpec(
        name="mamba",
        layer_num=2,
        conv_state_shapes=((4, 3),),
        conv_dtype=torch.bfloat16,
        temporal_state_shape=(2, 4, 4),
        temporal_dtype=torch.float32,
        grow_direction="up",
    )
    shared = U.UnifiedKVPool(
        total_bytes=96 * full.entry_bytes() + 8 * mamba.entry_bytes(),
        sub_pool_specs=[full, mamba],
        device="cpu",
        enable_memory_saver=False,
        page_size=PAGE,
    )
    return shared, U.UnifiedMLATokenToKVPool(
        unified_buffer=shared, sub_pool_name="full", kv_cache_dtype=torch.bfloat16, page_size=PAGE
    )


def _row_bytes(spec, slots, layer) -> torch.Tensor:
    """Positions in the shared buffer of `layer`'s rows (K then V, or the latent) of `slots`,
    from the spec's own arithmetic rather than the views."""
    if hasattr(spec, "k_row_bytes"):
        k, v = spec.k_row_bytes(), spec.v_row_bytes()
        offset, width = layer * (k + v), k + v
    else:
        offset, width = layer * spec.row_bytes(), spec.row_bytes()
    starts = slots.to(torch.int64) * spec.entry_bytes() + offset
    return (starts[:, None] + torch.arange(width)[None, :]).reshape(-1)


@pytest.mark.parametrize("kind", ["mha", "mla"])
@pytest.mark.parametrize(
    "layout, backend",
    [("layer_first", "kernel"), ("page_first", "kernel"), ("layer_first", "direct")],
)
def test_rows_a_stride_apart_round_trip_and_nothing_else_moves(kind, layout, backend):
    shared, dev = _mha() if kind == "mha" else _mla()
    spec, raw = shared.spec("full"), shared._raw
    call = H.recorded_kv_host_call(dev, use_mla=kind == "mla", layout=layout, io_backend=backend)
    host = call.ours()
    stride = (host.device_rows_packed, host.device_row_stride_bytes)
    assert stride == (call.pool.device_rows_packed, call.pool.device_row_stride_bytes)
    assert stride == (False, spec.entry_bytes())
    gen = torch.Generator().manual_seed(7)
    first, last = -(-shared.min_slot_index("full") // PAGE), shared.max_slots("full") // PAGE
    pages = H.pick_pages(6, first, last, gen)
    d, d2 = H.page_slots(pages[:3], PAGE), H.page_slots(pages[3:], PAGE)
    h = host.alloc(d.numel())
    H.fill_random([raw], gen)
    backed_up = raw.clone()
    host.backup_from_device_all_layer(dev, h, d, backend)
    assert torch.equal(raw, backed_up)
    H.fill_random([raw], gen)
    want = raw.clone()
    for layer in range(spec.layer_num):
        host.load_to_device_per_layer(dev, h, d2, layer, backend)
        want[_row_bytes(spec, d2, layer)] = backed_up[_row_bytes(spec, d, layer)]
        assert torch.equal(raw, want), f"layer {layer}"


@pytest.mark.parametrize("kind", ["mha", "mla"])
def test_page_blocks_of_such_rows_are_refused_and_nothing_moves(kind):
    shared, dev = _mha() if kind == "mha" else _mla()
    raw = shared._raw
    call = H.recorded_kv_host_call(
        dev, use_mla=kind == "mla", layout="page_first_direct", io_backend="direct"
    )
    host = call.ours()
    gen = torch.Generator().manual_seed(8)
    H.fill_random([raw], gen)
    before, host_before = raw.clone(), [b.clone() for b in H.buffers_of(host)]
    h, d = host.alloc(PAGE), H.page_slots([10], PAGE)
    with pytest.raises(NotImplementedError, match="steps device rows by the row width"):
        host.backup_from_device_all_layer(dev, h, d, "direct")
    with pytest.raises(NotImplementedError, match="steps device rows by the row width"):
        host.load_to_device_per_layer(dev, h, d, 0, "direct")
    assert torch.equal(raw, before)
    assert all(torch.equal(a, b) for a, b in zip(host_before, H.buffers_of(host)))
