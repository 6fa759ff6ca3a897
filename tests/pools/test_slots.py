"""The slot allocator of host-pool-contract.md §4.1 (`hostkv_rs.pools.slots`), for every pool kind:
FIFO, page-multiple requests, lazy release, double-alloc / double-free detection, one RLock
around everything. The V4 paged and logical pools track their slots too (stricter than SGLang,
whose V4 and logical pools accept double frees)."""

from __future__ import annotations

import re
import threading

import numpy as np
import pytest
import torch
from hostkv_rs import DeepSeekV4PagedHostPool, LogicalHostPool
from hostkv_rs.pools.base import HostKVCache
from reference import make_mha, make_mla

KINDS = ["mla", "mha", "asymmetric_mha", "v4_paged", "logical"]


def make_pool(kind: str):
    """A 36-slot pool of `kind` with page size 4."""
    if kind == "mla":
        return make_mla("layer_first", 4, ratio=2.0, device_pages=4)[0]  # 32 -> 36 slots
    if kind == "mha":
        return make_mha("page_head", 4, ratio=2.0, device_pages=4)[0]
    if kind == "asymmetric_mha":
        return make_mha("page_first", 4, ratio=2.0, device_pages=4, v_head_dim=4)[0]
    if kind == "v4_paged":
        device = [torch.zeros(9, 16, dtype=torch.uint8) for _ in range(2)]
        return DeepSeekV4PagedHostPool("c4", device, 16, 9, 4)
    return LogicalHostPool(36, 4)


@pytest.fixture(params=KINDS)
def pool(request):
    host = make_pool(request.param)
    assert host.size == 36 and host.page_size == 4
    return host


def test_fresh_pool_hands_out_ascending_slots(pool):
    assert pool.available_size() == 36
    assert pool.free_slots.dtype == torch.int64 and pool.free_slots.device.type == "cpu"
    a = pool.alloc(8)
    assert a.tolist() == list(range(8))
    assert a.dtype == torch.int64
    assert pool.alloc(4).tolist() == [8, 9, 10, 11]
    assert pool.available_size() == 24
    assert bool(pool.slot_used[:12].all()) and not bool(pool.slot_used[12:].any())


def test_page_multiple_assert(pool):
    if isinstance(pool, DeepSeekV4PagedHostPool):
        # SGLang's V4 pool rounds a request up to whole slot pages.
        assert pool.alloc(6).tolist() == list(range(8))
        pool.free(torch.arange(8))
    elif isinstance(pool, LogicalHostPool):
        with pytest.raises(ValueError, match="allocation must be page-aligned"):
            pool.alloc(6)
    else:
        with pytest.raises(
            AssertionError,
            match=re.escape("The requested size should be a multiple of the page size."),
        ):
            pool.alloc(6)
    assert pool.available_size() == 36
    with pytest.raises(ValueError, match="must not be negative"):
        pool.alloc(-4)
    with pytest.raises(TypeError):
        pool.alloc(4.0)
    assert pool.alloc(0).numel() == 0


def test_none_when_short(pool):
    assert pool.alloc(40) is None
    assert pool.available_size() == 36
    assert pool.alloc(36).numel() == 36
    assert pool.alloc(4) is None


def test_lazy_release_fifo_order(pool):
    a = pool.alloc(8).clone()
    b = pool.alloc(8).clone()
    rest = pool.alloc(20).clone()
    assert pool.available_size() == 0
    assert pool.free(b) == 8
    assert pool.free(a[4:]) == 4
    # freed chunks wait aside until alloc needs them
    assert pool.num_release_slots == 12 and len(pool.release_slots) == 2
    assert pool.available_size() == 12
    got = pool.alloc(12)
    assert got.tolist() == b.tolist() + a[4:].tolist()  # release order
    assert pool.num_release_slots == 0 and pool.release_slots == []
    pool.free(rest)
    pool.free(got)
    pool.free(a[:4])
    assert pool.available_size() == 36


def test_initial_arange_first_then_released_pages(pool):
    a = pool.alloc(8).clone()
    pool.free(a)
    # 28 never-used slots come before the freed ones
    got = pool.alloc(32)
    assert got.tolist() == list(range(8, 36)) + a[:4].tolist()


def test_single_release_chunk_is_adopted(pool):
    everything = pool.alloc(36).clone()
    pool.free(everything[8:16])
    got = pool.alloc(8)
    assert got.tolist() == list(range(8, 16))


def test_double_free_text_and_nothing_released(pool):
    a = pool.alloc(8).clone()
    pool.free(a[:4])
    with pytest.raises(
        AssertionError,
        match=re.escape("Double-free detected: slots not currently allocated: [0, 1]."),
    ):
        pool.free(torch.tensor([0, 1, 4, 5]))
    assert pool.num_release_slots == 4
    assert bool(pool.slot_used[4:8].all())
    with pytest.raises(
        AssertionError,
        match=re.escape("Double-free detected: slots not currently allocated: [32, 33, 34, 35]."),
    ):
        pool.free(torch.tensor([32, 33, 34, 35]))
    # Every slot is still handed to one owner at a time, and no more than the pool holds.
    assert pool.available_size() == 32
    taken = torch.cat([a[4:], pool.alloc(32)])
    assert taken.unique().numel() == taken.numel() == pool.size
    assert pool.alloc(4) is None


def test_duplicate_slot_in_one_free_is_a_double_free(pool):
    pool.alloc(8)
    with pytest.raises(
        AssertionError,
        match=re.escape("Double-free detected: slots not currently allocated: [5]."),
    ):
        pool.free(torch.tensor([4, 5, 5, 6]))
    assert pool.num_release_slots == 0 and bool(pool.slot_used[:8].all())


def test_double_alloc_text(pool):
    # Corrupt the free list (a slot handed out twice) the way a caller bug would.
    pool.alloc(4)
    pool.free_slots = torch.cat([torch.tensor([2, 3, 4, 5]), pool.free_slots[4:]])
    before = pool.free_slots.clone()
    with pytest.raises(
        AssertionError,
        match=re.escape("Double-alloc detected: slots already allocated: [2, 3]."),
    ):
        pool.alloc(4)
    assert torch.equal(pool.free_slots, before)


def test_free_accepts_any_integer_tensor_and_returns_count(pool):
    if isinstance(pool, LogicalHostPool):
        pytest.skip("the logical pool frees whole pages only (pools/test_logical.py)")
    pool.alloc(12)
    assert pool.free(torch.tensor([0, 1], dtype=torch.int32)) == 2
    assert pool.free(torch.tensor([[2, 3], [4, 5]])) == 4
    assert pool.free([6, 7]) == 2
    assert pool.free(torch.empty(0, dtype=torch.int64)) == 0
    with pytest.raises(TypeError):
        pool.free(torch.tensor([8.0]))
    with pytest.raises(ValueError, match=r"must lie in \[0, 36\)") as e:
        pool.free(torch.tensor([-1]))
    # Also what SGLang's free raises for a negative slot (its double-free assert).
    assert isinstance(e.value, AssertionError) and isinstance(e.value, IndexError)
    with pytest.raises(ValueError, match=r"must lie in \[0, 36\)") as e:
        pool.free(torch.tensor([36]))
    assert isinstance(e.value, IndexError) and not isinstance(e.value, AssertionError)
    assert pool.available_size() == 36 - 12 + 8


@pytest.mark.parametrize(
    "single", [lambda: torch.tensor(0), lambda: 0, lambda: np.int64(0), lambda: np.array(0)]
)
def test_a_single_slot_not_in_a_sequence_is_refused_and_changes_nothing(pool, single):
    # SGLang's pools take len() of what they free: a TypeError there (after part of the free,
    # in some releases); refused here before anything.
    pool.alloc(4)
    free_before = pool.free_slots.clone()
    with pytest.raises(TypeError, match="indices must be a sequence, got"):
        pool.free(single())
    assert pool.available_size() == 32 and torch.equal(pool.free_slots, free_before)
    assert pool.free(torch.tensor([0, 1, 2, 3])) == 4  # slot 0 was still allocated


def test_free_keeps_its_own_copy(pool):
    idx = pool.alloc(8).clone()
    pool.free(idx)
    idx.fill_(0)  # the caller reuses its tensor
    assert pool.alloc(36).tolist()[-8:] == list(range(8))


def test_clear_resets_everything(pool):
    pool.alloc(8)
    pool.free(pool.alloc(4))
    pool.clear()
    assert pool.available_size() == 36
    assert pool.alloc(4).tolist() == [0, 1, 2, 3]
    assert pool.release_slots == [] and pool.num_release_slots == 0


@pytest.mark.parametrize("kind", KINDS)
def test_slots_taken_under_inference_mode_are_freed_outside_it(kind):
    # SGLang's scheduler loop runs under torch.inference_mode(); the cache controller's threads
    # do not. A pool built or cleared in that mode still frees and hands out slots outside it.
    with torch.inference_mode():
        pool = make_pool(kind)
        first = pool.alloc(8)
    assert not pool.slot_used.is_inference() and not pool.free_slots.is_inference()
    pool.free(pool.alloc(4))
    pool.free(first)
    with torch.inference_mode():
        pool.clear()
        first = pool.alloc(8)
    assert not pool.slot_used.is_inference()
    second = pool.alloc(4)
    pool.free(first)
    pool.free(second)
    assert pool.available_size() == 36
    with torch.inference_mode():
        assert pool.alloc(36).numel() == 36


def test_everything_runs_under_the_one_rlock(pool):
    entered = threading.Event()
    release = threading.Event()
    result = {}

    def hold():
        with pool.lock:
            entered.set()
            release.wait(5)

    holder = threading.Thread(target=hold)
    holder.start()
    entered.wait(5)
    worker = threading.Thread(target=lambda: result.setdefault("a", pool.alloc(4)))
    worker.start()
    worker.join(0.2)
    assert worker.is_alive()  # blocked on the lock
    release.set()
    worker.join(5)
    holder.join(5)
    assert result["a"].tolist() == [0, 1, 2, 3]
    with pool.lock:  # re-entrant
        assert pool.alloc(4) is not None


def test_multithreaded_alloc_free_stress():
    host, _ = make_mha("layer_first", 4, ratio=4.0, device_pages=16)  # 260 slots
    total = host.size
    errors = []
    seen_lock = threading.Lock()
    owned: set[int] = set()

    def worker(seed):
        gen = torch.Generator().manual_seed(seed)
        held = []
        try:
            for _ in range(300):
                if held and torch.rand(1, generator=gen).item() < 0.5:
                    chunk = held.pop(int(torch.randint(len(held), (1,), generator=gen)))
                    with seen_lock:
                        owned.difference_update(chunk.tolist())
                    assert host.free(chunk) == chunk.numel()
                else:
                    n = 4 * int(torch.randint(1, 4, (1,), generator=gen))
                    got = host.alloc(n)
                    if got is None:
                        continue
                    got = got.clone()
                    with seen_lock:
                        overlap = owned.intersection(got.tolist())
                        assert not overlap, f"slots handed out twice: {sorted(overlap)}"
                        owned.update(got.tolist())
                    held.append(got)
            for chunk in held:
                with seen_lock:
                    owned.difference_update(chunk.tolist())
                host.free(chunk)
        except (AssertionError, ValueError, TypeError, IndexError, RuntimeError) as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    assert host.available_size() == total
    assert not bool(host.slot_used.any())
    everything = host.alloc(total)
    assert sorted(everything.tolist()) == list(range(total))


class BarePool(HostKVCache):
    """A pool that skips HostKVCache.__init__ (like SGLang's V4 paged pool)."""

    def __init__(self, size, page_size):
        self.size = size
        self.page_size = page_size
        self.clear()

    def get_size_per_token(self):
        return 1

    def init_kv_buffer(self):
        return None

    # SGLang's other abstract methods; the allocator never calls them.
    load_to_device_per_layer = backup_from_device_all_layer = None
    get_data_page = get_dummy_flat_data_page = set_from_flat_data_page = None


def test_allocator_works_for_subclasses_that_skip_init():
    pool = BarePool(16, 4)
    assert isinstance(pool.lock, type(threading.RLock()))
    assert pool.alloc(8).tolist() == list(range(8))
    with pytest.raises(AssertionError):
        pool.alloc(3)
    assert pool.free(torch.arange(4)) == 4
    assert pool.available_size() == 12
    pool.destroy()
    pool.destroy()
    assert pool.kv_buffer is None


def test_a_huge_double_free_message_is_capped():
    pool = BarePool(1 << 20, 4)
    with pytest.raises(AssertionError) as info:
        pool.free(torch.arange(1 << 20))
    text = str(info.value)
    assert text.startswith("Double-free detected: slots not currently allocated: [0, 1, 2,")
    assert text.endswith(f", ...] ({(1 << 20)} slots).") and len(text) < 400


def test_slots_put_back_after_a_failed_call_are_handed_out_next(pool):
    """`_untake_slots` undoes the allocation that returned the slots, even one that merged
    parked chunks first: the next allocation is the one the pool would have made without it."""
    first = pool.alloc(8)
    pool.free(first[:4].clone())
    pool.free(first[4:].clone())  # two chunks parked on the release list
    expected = torch.cat([pool.free_slots, *pool.release_slots]).tolist()
    generation = pool._slot_generation
    taken = pool.alloc(36)
    assert taken is not None
    pool._untake_slots(taken, generation)
    assert pool.available_size() == 36 and not bool(pool.slot_used.any())
    assert pool.alloc(36).tolist() == expected


def test_slots_put_back_after_a_clear_on_another_thread_are_not_doubled(pool):
    """A clear() (or a free of them) between the allocation and its undo already put the slots
    back: the undo leaves them alone rather than listing them twice."""
    generation = pool._slot_generation
    taken = pool.alloc(8).clone()
    pool.free(taken[:4].clone())
    pool._untake_slots(taken, generation)  # the freed four are not put back twice
    assert pool.available_size() == 36
    assert sorted(torch.cat([pool.free_slots, *pool.release_slots]).tolist()) == list(range(36))
    # After a clear() the slots may have a new owner: the undo leaves them alone.
    generation = pool._slot_generation
    taken = pool.alloc(8).clone()
    pool.clear()
    again = pool.alloc(8).clone()
    assert set(again.tolist()) & set(taken.tolist())  # some have a new owner
    pool._untake_slots(taken, generation)
    assert pool.available_size() == 28 and bool(pool.slot_used[again].all())
    listed = torch.cat([pool.free_slots, *pool.release_slots]).tolist()
    assert len(listed) == len(set(listed)) == 28
