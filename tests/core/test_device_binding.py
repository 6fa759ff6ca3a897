"""The core's device binding (`_core.DeviceBinding`): checked device layers must never serve stale
pointers or shapes, and every device refusal is raised before a byte moves."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from hostkv_rs import (
    MHATokenToKVPool,
    MHATokenToKVPoolHost,
    MLATokenToKVPool,
    MLATokenToKVPoolHost,
    _core,
)


def _pools():
    dev = MHATokenToKVPool(64, 16, torch.bfloat16, head_num=2, head_dim=8, layer_num=3)
    host = MHATokenToKVPoolHost(dev, 2.0, 0, 16, "layer_first")
    return dev, host


def test_repeated_loads_follow_a_tensor_whose_storage_was_swapped():
    dev, host = _pools()
    h = host.alloc(16)
    d = torch.arange(16, 32)
    host.kv_buffer.view(torch.uint8).fill_(7)
    host.load_to_device_per_layer(dev, h, d, 1, "kernel")  # primes the cache
    replacement = torch.zeros_like(dev.k_buffer[1])
    dev.k_buffer[1].set_(replacement)  # same Python object, new memory
    host.load_to_device_per_layer(dev, h, d, 1, "kernel")
    assert torch.equal(replacement.view(torch.uint8)[16:32], host.k_buffer[1][h].view(torch.uint8))


@pytest.mark.parametrize("layout", ["layer_first", "page_first", "page_head"])
def test_a_plan_only_call_checks_everything_and_moves_nothing(layout):
    dev = MHATokenToKVPool(64, 16, torch.bfloat16, head_num=2, head_dim=8, layer_num=3)
    host = MHATokenToKVPoolHost(dev, 2.0, 0, 16, layout)
    binding = host._device_side
    h, d = host.alloc(16), torch.arange(16, 32)
    host.kv_buffer.view(torch.uint8).fill_(7)
    for t in (*dev.k_buffer, *dev.v_buffer):
        t.view(torch.uint8).fill_(1)
    host_before = host.kv_buffer.clone()
    device_before = [t.clone() for t in (*dev.k_buffer, *dev.v_buffer)]
    assert binding.load(1, h, d, "kernel", plan_only=True) is True
    binding.backup(h, d, "kernel", plan_only=True)
    assert torch.equal(host.kv_buffer, host_before)
    for t, before in zip((*dev.k_buffer, *dev.v_buffer), device_before):
        assert torch.equal(t, before)
    # Refused exactly as the call itself is, before anything moves.
    bad = torch.arange(200, 216)
    for plan_only in (True, False):
        with pytest.raises(_core.TransferError, match=r"device index .*out of range"):
            binding.load(1, h, bad, "kernel", plan_only=plan_only)
        with pytest.raises(_core.TransferError, match=r"device index .*out of range"):
            binding.backup(h, bad, "kernel", plan_only=plan_only)
    assert torch.equal(host.kv_buffer, host_before)
    # The same call without plan_only moves the bytes.
    binding.load(1, h, d, "kernel")
    assert bool((dev.k_buffer[1][16:32].view(torch.uint8) == 7).all())


def test_a_reshaped_tensor_is_checked_again():
    dev, host = _pools()
    h = host.alloc(16)
    d = torch.arange(16, 32)
    host.load_to_device_per_layer(dev, h, d, 1, "kernel")
    dev.k_buffer[1].set_(torch.zeros(80, 4, 8, dtype=torch.bfloat16))  # rows no longer match
    with pytest.raises(ValueError, match=r"head split \(4, 8\) \(heads, head_dim\) differs"):
        host.load_to_device_per_layer(dev, h, d, 1, "kernel")


def test_a_new_device_pool_is_not_confused_with_a_dead_one():
    dev, host = _pools()
    h = host.alloc(16)
    d = torch.arange(16, 32)
    host.kv_buffer.view(torch.uint8).fill_(3)
    host.load_to_device_per_layer(dev, h, d, 0, "direct")
    del dev
    dev2 = MHATokenToKVPool(64, 16, torch.bfloat16, head_num=2, head_dim=8, layer_num=3)
    host.load_to_device_per_layer(dev2, h, d, 0, "direct")
    assert bool((dev2.k_buffer[0][16:32].view(torch.uint8) == 3).all())


class _OnDevice(torch.Tensor):
    """A CPU tensor that reports another device, to reach device checks without a GPU."""

    reported = None

    @property
    def device(self):
        return self.reported


def _reporting(tensor: torch.Tensor, device: str) -> torch.Tensor:
    fake = tensor.as_subclass(_OnDevice)
    fake.reported = torch.device(device)
    return fake


def test_device_layers_on_two_gpus_are_refused():
    dev = MLATokenToKVPool(64, 16, torch.bfloat16, 8, 4, 2)
    host = MLATokenToKVPoolHost(dev, 2.0, 0, 16, "layer_first")
    layers = [_reporting(torch.zeros_like(t), f"cuda:{i}") for i, t in enumerate(dev.kv_buffer)]
    binding = _core.DeviceBinding(host._pool_core, [layers], [0, 1], 2, 2)
    with pytest.raises(ValueError, match="mix cuda:0 and cuda:1"):
        binding.backup(torch.arange(16), torch.arange(16), "kernel")


def test_a_binding_refuses_a_layer_map_that_does_not_fit_the_pool():
    dev, host = _pools()
    planes = [list(dev.k_buffer), list(dev.v_buffer)]
    with pytest.raises(ValueError, match="one tensor per owned layer and draft"):
        _core.DeviceBinding(host._pool_core, [planes[0], planes[1][:2]], [0, 1, 2], 3, 3)
    with pytest.raises(ValueError, match="4 owned layers do not fit 3 host layers"):
        _core.DeviceBinding(host._pool_core, [p + p[:1] for p in planes], [0, 1, 2, 3], 4, 3)
    with pytest.raises(ValueError, match="1 planes of device layers for a host pool of 2"):
        _core.DeviceBinding(host._pool_core, planes[:1], [0, 1, 2], 3, 3)


def test_a_destroyed_pool_refuses_transfers_through_its_binding():
    dev, host = _pools()
    idx = torch.arange(16)
    host.destroy()
    with pytest.raises(RuntimeError, match="MHATokenToKVPoolHost has been destroyed"):
        host.load_to_device_per_layer(dev, idx, idx, 0, "kernel")
    with pytest.raises(RuntimeError, match="MHATokenToKVPoolHost has been destroyed"):
        host.backup_from_device_all_layer(dev, idx, idx, "kernel")


# A device layer whose extent shrank after the binding checked it. Each case runs in its own
# process: the bug these guard against corrupts the heap, which must not take the test run down.
_STALE_EXTENT = r"""
import torch
from hostkv_rs import MHATokenToKVPool, MHATokenToKVPoolHost

dev = MHATokenToKVPool(112, 16, torch.bfloat16, head_num=2, head_dim=8, layer_num=3)
host = MHATokenToKVPoolHost(dev, 2.0, 0, 16, "layer_first")
h = host.alloc(32)
host.kv_buffer.view(torch.uint8).fill_(9)
host.load_to_device_per_layer(dev, h, torch.arange(16, 48), 1, "kernel")  # checked and cached
layer = dev.k_buffer[1]
CASE
storage = layer.untyped_storage()
def raw(s):
    return torch.empty(0, dtype=torch.uint8).set_(s)
before = raw(storage).clone()
try:
    host.load_to_device_per_layer(dev, h, ROWS, 1, "kernel")
except (ValueError, IndexError) as exc:
    print("REFUSED", exc)
else:
    print("ACCEPTED")
assert torch.equal(before, raw(storage)), "bytes changed"
print("UNCHANGED")
current = dev.k_buffer[1].untyped_storage()
if current.nbytes() >= 112 * 32 and bool((raw(current)[80 * 32 : 112 * 32] == 9).all()):
    print("NEW STORAGE WRITTEN")
"""


def _child(code: str, extent: str) -> subprocess.CompletedProcess:
    """`code` in a fresh interpreter (a crash there fails a test, not the run) with
    HOSTKV_TENSOR_EXTENT=`extent`."""
    return subprocess.run(
        [sys.executable, "-c", code],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "HOSTKV_TENSOR_EXTENT": extent},
    )


@pytest.mark.parametrize("extent", ["auto", "python"])
@pytest.mark.parametrize(
    ("case", "rows", "refusal"),
    [
        # The storage swapped for another of the same size (same shape, other memory).
        (
            (
                "old = layer.untyped_storage(); layer.set_(torch.zeros_like(layer)); "
                "layer = torch.empty(0, dtype=torch.bfloat16).set_(old)"
            ),
            "torch.arange(80, 112)",
            None,
        ),
        # The same TensorImpl, storage, offset and count, another dtype (`.data =`).
        (
            (
                "layer.data = torch.empty(0, dtype=torch.uint8).set_(layer.untyped_storage(), "
                "0, layer.shape)"
            ),
            "torch.arange(16, 48)",
            "dtype torch.uint8 differs from the host pool's torch.bfloat16",
        ),
        # The tensor resized smaller on its storage: rows 80..111 are past its 32 rows.
        ("layer.resize_(32, 2, 8)", "torch.arange(80, 112)", "out of range"),
        # The storage freed and reallocated smaller (13 rows): the shape no longer fits it.
        (
            "layer.untyped_storage().resize_(0); layer.untyped_storage().resize_(13 * 32)",
            "torch.arange(12, 16)",
            "fewer than its shape",
        ),
        # The storage freed outright.
        ("layer.untyped_storage().resize_(0)", "torch.arange(0, 4)", "fewer than its shape"),
        # Restrided in place: same storage, offset and count, rows no longer packed.
        ("layer.transpose_(1, 2)", "torch.arange(16, 48)", "head split (8, 2)"),
        # Restrided in place to the same shape, each row's elements no longer in order.
        (
            "layer.as_strided_(layer.shape, (16, 1, 2))",
            "torch.arange(16, 48)",
            "must be contiguous",
        ),
    ],
)
def test_a_layer_whose_extent_shrank_is_checked_again_and_never_written_past(
    case, rows, refusal, extent
):
    """Both ways of noticing the change: the tensors' extents read from torch's objects (the
    default, `extent.rs`) and the Python calls (`HOSTKV_TENSOR_EXTENT=python`). A swapped
    storage of the same size is checked again and written (the old one stays unchanged)."""
    script = _STALE_EXTENT.replace("CASE", case).replace("ROWS", rows)
    done = _child(script, extent)
    assert done.returncode == 0, done.stderr[-4000:]
    if refusal is None:
        assert "ACCEPTED" in done.stdout and "UNCHANGED" in done.stdout, done.stdout
        assert "NEW STORAGE WRITTEN" in done.stdout, done.stdout
    else:
        assert "REFUSED" in done.stdout and refusal in done.stdout, done.stdout
        assert "UNCHANGED" in done.stdout


def test_tensor_extents_are_read_from_torch_unless_switched_off():
    """This torch's field offsets are found (so the cases above test the reads, not only the
    Python fallback), and `HOSTKV_TENSOR_EXTENT=python` switches the reads off."""
    found = _core.tensor_extent_layout()
    assert found is not None, f"torch {torch.__version__}: no tensor layout found"
    assert [name for name, _ in found] == [
        "tensor_impl",
        "storage",
        "storage_offset",
        "numel",
        "data",
        "nbytes",
        "dtype",
        "sizes",
        "device",
        "negative",
        "contiguous",
    ]
    code = "from hostkv_rs import _core; print(_core.tensor_extent_layout())"
    done = _child(code, "python")
    assert done.returncode == 0, done.stderr[-4000:]
    assert done.stdout.strip() == "None"
    code = (
        "import torch\n"
        "from hostkv_rs import MHATokenToKVPool, MHATokenToKVPoolHost\n"
        "dev = MHATokenToKVPool(64, 16, torch.bfloat16, head_num=2, head_dim=8, layer_num=2)\n"
        "try:\n"
        "    MHATokenToKVPoolHost(dev, 2.0, 0, 16, 'layer_first')\n"
        "except ValueError as exc:\n"
        "    print('REFUSED', exc)\n"
    )
    # A bad value is refused when the first pool is built (its host storages are read the same
    # way), before any transfer.
    done = _child(code, "fast")
    assert done.returncode == 0, done.stderr[-4000:]
    assert 'REFUSED HOSTKV_TENSOR_EXTENT must be one of auto, python, got "fast"' in done.stdout


def test_tensor_extent_offsets_are_found_in_every_process():
    """The search gives the same offsets in every process, whatever the heap around its probes
    (the negative-view bit was once searched in the flags word too, where another bit also
    differs, and went missing in most processes)."""
    code = "from hostkv_rs import _core; print(_core.tensor_extent_layout())"
    found = {_child(code, "auto").stdout.strip() for _ in range(6)}
    assert len(found) == 1 and "'negative'" in next(iter(found)), found


def test_tensor_extent_offsets_are_found_whatever_the_default_device():
    """The offsets are found on CPU probe tensors even where the process's default device is
    another one (meta here; CUDA on a server that sets it): the same offsets as without it."""
    code = (
        "import torch\n"
        "torch.set_default_device('meta')\n"
        "from hostkv_rs import _core\n"
        "print(_core.tensor_extent_layout())\n"
    )
    done = _child(code, "auto")
    assert done.returncode == 0, done.stderr[-4000:]
    assert done.stdout.strip() == str(_core.tensor_extent_layout())


def test_a_device_pool_handed_to_a_call_without_the_layer_is_refused_by_the_core():
    _dev, host = _pools()
    h = host.alloc(16)
    d = torch.arange(16, 32)
    short = MHATokenToKVPool(64, 16, torch.bfloat16, head_num=2, head_dim=8, layer_num=1)
    before = host.kv_buffer.clone()
    with pytest.raises(
        _core.LayerIndexError, match="layer_id 2 is out of range: the device pool has 1 layers"
    ) as refused:
        host.load_to_device_per_layer(short, h, d, 2, "kernel")
    assert (refused.value.kind, refused.value.layer, refused.value.bound) == (
        "device_layer_out_of_range",
        2,
        1,
    )
    # A backup names every host layer: the first one the short pool lacks is refused.
    with pytest.raises(_core.LayerIndexError, match="layer_id 1 is out of range"):
        host.backup_from_device_all_layer(short, h, d, "kernel")
    assert torch.equal(host.kv_buffer, before)
    assert torch.count_nonzero(short.k_buffer[0]) == 0


def test_the_c4_token_maps_read_only_c4_page_rows():
    _dev, host = _pools()
    planes = [list(_dev.k_buffer), list(_dev.v_buffer)]
    with pytest.raises(ValueError, match="the C4 token maps read a layer_first pool of 37440-byte"):
        _core.DeviceBinding(host._pool_core, planes, [0, 1, 2], 3, 3, index_map=("c4_value",))


def test_index_tensors_read_from_torch_objects_keep_their_offset_width_and_refusals():
    """The index fast path reads a plain index tensor's count, offset and storage from torch's
    objects: views into a larger tensor move exactly their rows, int32 views are read at their
    own width, and a tensor without a storage (sparse) still gets as_index_array's refusal."""
    dev = MHATokenToKVPool(64, 16, torch.bfloat16, head_num=2, head_dim=8, layer_num=2)
    host = MHATokenToKVPoolHost(dev, 2.0, 0, 16, "page_first")
    h = host.alloc(16)
    host.kv_buffer.view(torch.uint8).fill_(7)
    wide = torch.arange(100, dtype=torch.int64)
    narrow = torch.arange(100, dtype=torch.int32)
    host.load_to_device_per_layer(dev, h[2:5], wide[20:23], 1, "kernel")
    host.load_to_device_per_layer(dev, h[5:7], narrow[40:42], 1, "kernel")
    rows = dev.k_buffer[1].reshape(dev.k_buffer[1].shape[0], -1).view(torch.uint8)
    written = (rows == 7).all(dim=1).nonzero().flatten().tolist()
    assert written == [20, 21, 22, 40, 41]
    with pytest.raises(TypeError, match="index tensors must be dense"):
        host.load_to_device_per_layer(dev, h[:3], torch.tensor([1, 2, 3]).to_sparse(), 1, "kernel")
    assert (rows == 7).all(dim=1).nonzero().flatten().tolist() == written


_INDEX_SHAPES = r"""
import torch
from hostkv_rs import MHATokenToKVPool, MHATokenToKVPoolHost

dev = MHATokenToKVPool(64, 16, torch.bfloat16, head_num=2, head_dim=8, layer_num=2)
host = MHATokenToKVPoolHost(dev, 2.0, 0, 16, "page_first")
h = host.alloc(16)
wide = torch.arange(100)
cases = {
    "strided": wide[20:26:2],
    "one element, odd stride": torch.as_strided(wide, (1,), (5,), 33),
    "flipped copy": wide[40:43].flip(0),
    "negative view": torch._neg_view(torch.arange(-23, -20)),
    "two-dimensional": wide[50:52].view(1, 2),
    "seven-dimensional": wide[54:56].view(1, 1, 1, 1, 1, 1, 2),
    "zero-stride": torch.as_strided(wide, (3,), (0,), 57),
    "int16": torch.arange(60, 63, dtype=torch.int16),
    "float": torch.arange(3.0),
    "uint8": torch.arange(3, dtype=torch.uint8),
    "bool": torch.ones(3, dtype=torch.bool),
    "meta": torch.arange(3, device="meta"),
    "empty": wide[:0],
    "empty strided": wide[:0:3],
    "fresh": torch.arange(64, 67),
    "numpy": wide[20:23].numpy(),
}
for name, d in cases.items():
    dev.k_buffer[1].view(torch.uint8).fill_(0)
    host.kv_buffer.view(torch.uint8).fill_(9)
    n = d.shape[-1] if hasattr(d, "shape") and len(d.shape) else 0
    try:
        host.load_to_device_per_layer(dev, h[:n], d, 1, "kernel")
        rows = dev.k_buffer[1].reshape(dev.k_buffer[1].shape[0], -1).view(torch.uint8)
        print(name, "MOVED", (rows == 9).all(dim=1).nonzero().flatten().tolist())
    except Exception as exc:
        print(name, "REFUSED", type(exc).__name__, exc)
"""


def test_index_tensors_torch_reads_and_python_agree_on_every_shape():
    """The index fast path reads dtype, dimensions, strides and device from torch's objects;
    every index the reads do not take (strided, several dimensions, zero stride, other dtypes,
    meta) must end exactly as it does when Python is asked: the same rows, or the same
    refusal."""
    fast, slow = _child(_INDEX_SHAPES, "auto"), _child(_INDEX_SHAPES, "python")
    assert fast.returncode == 0 and slow.returncode == 0, fast.stderr[-3000:] + slow.stderr[-3000:]
    assert fast.stdout == slow.stdout
    for line in (
        "strided MOVED [20, 22, 24]",
        "one element, odd stride MOVED [33]",
        "flipped copy MOVED [40, 41, 42]",
        "negative view MOVED [21, 22, 23]",
        "seven-dimensional MOVED [54, 55]",
        "meta REFUSED ValueError index tensors on the meta device hold no values",
        "float REFUSED TypeError index tensors must be integer tensors, got torch.float32",
    ):
        assert line in fast.stdout.splitlines(), fast.stdout


_COPY_ON_WRITE = r"""
import torch
from hostkv_rs import MHATokenToKVPool, MHATokenToKVPoolHost

dev = MHATokenToKVPool(112, 16, torch.bfloat16, head_num=2, head_dim=8, layer_num=3)
host = MHATokenToKVPoolHost(dev, 2.0, 0, 16, "layer_first")
h, d = host.alloc(32), torch.arange(16, 48)
host.load_to_device_per_layer(dev, h, d, 1, "kernel")  # checked and cached
host.kv_buffer.view(torch.uint8).fill_(5)
clone = torch._lazy_clone(dev.k_buffer[1])  # the layer's storage is now shared copy-on-write
before = clone.clone()
host.load_to_device_per_layer(dev, h, d, 1, "kernel")
assert torch.equal(clone, before), "the copy-on-write clone was written"
assert bool((dev.k_buffer[1][16:48].view(torch.uint8) == 5).all()), "the layer was not written"
print("OK")
"""


@pytest.mark.parametrize("extent", ["auto", "python"])
@pytest.mark.skipif(not hasattr(torch, "_lazy_clone"), reason="this torch has no _lazy_clone")
def test_a_layer_whose_storage_turned_copy_on_write_is_checked_again(extent):
    """A copy-on-write clone shares the layer's allocation under a new deleter: the binding
    sees the storage's allocation change and asks torch for the address again (which gives the
    layer its own copy), so the clone keeps its bytes."""
    done = _child(_COPY_ON_WRITE, extent)
    assert done.returncode == 0 and "OK" in done.stdout, done.stderr[-4000:]


_NO_MEMORY_INDEX = r"""
import torch
from hostkv_rs import MHATokenToKVPool, MHATokenToKVPoolHost

dev = MHATokenToKVPool(64, 16, torch.bfloat16, head_num=2, head_dim=8, layer_num=2)
host = MHATokenToKVPoolHost(dev, 2.0, 0, 16, "page_first")
h = host.alloc(16)[:3]


def load(d):
    host.load_to_device_per_layer(dev, h, d, 1, "kernel")
    return d


try:
    torch.func.functionalize(load)(torch.arange(100)[30:33])
except ValueError as exc:
    print("REFUSED", exc)
"""


@pytest.mark.parametrize("extent", ["auto", "python"])
def test_an_index_tensor_without_memory_is_refused_not_read(extent):
    """Inside torch.func.functionalize an index tensor is a torch.Tensor whose storage has no
    memory: refused by name (it used to be read at its offset from address 0, a crash; hence
    its own process)."""
    done = _child(_NO_MEMORY_INDEX, extent)
    assert done.returncode == 0, done.stderr[-4000:]
    assert "REFUSED index tensor: the tensor's storage has no memory" in done.stdout, done.stdout


class _Lying(torch.Tensor):
    """A subclass whose `data_ptr()` names memory it does not own (`_LIE_AT`), and which says
    it starts where its storage does."""

    def data_ptr(self):
        return _LIE_AT.data_ptr()

    def storage_offset(self):
        return 0


_LIE_AT = torch.zeros(4096, dtype=torch.uint8)


def test_a_device_layer_of_a_tensor_subclass_is_refused_before_its_methods_are_trusted():
    """The binding writes through a device layer's pointer: a subclass could report one it does
    not own (this one made a load write 512 bytes into another tensor)."""
    dev = MHATokenToKVPool(64, 16, torch.bfloat16, head_num=2, head_dim=8, layer_num=3)
    dev.k_buffer[1] = dev.k_buffer[1].as_subclass(_Lying)
    host = MHATokenToKVPoolHost(dev, 2.0, 0, 16, "layer_first")
    _LIE_AT.zero_()
    h, d = host.alloc(16), torch.arange(16, 32)
    host.kv_buffer.fill_(1)
    with pytest.raises(TypeError, match="expected a plain torch.Tensor, got the subclass _Lying"):
        host.load_to_device_per_layer(dev, h, d, 1, "kernel")
    assert not _LIE_AT.any()
    # The plain tensor over the same memory is served.
    dev.k_buffer[1] = dev.k_buffer[1].as_subclass(torch.Tensor)
    host = MHATokenToKVPoolHost(dev, 2.0, 0, 16, "layer_first")
    host.load_to_device_per_layer(dev, h, d, 1, "kernel")


def test_an_index_tensor_subclass_is_read_from_its_storage_not_its_methods():
    """A subclass's own methods used to say where the indices were read from (here the start
    of their storage, so the load wrote device rows 0..15 instead of the listed 16..31)."""
    dev, host = _pools()
    h = host.alloc(16)
    host.kv_buffer.view(torch.uint8).fill_(7)
    for t in (*dev.k_buffer, *dev.v_buffer):
        t.zero_()
    d = torch.arange(32)[16:].as_subclass(_Lying)
    host.load_to_device_per_layer(dev, h, d, 1, "kernel")
    for t in (dev.k_buffer[1], dev.v_buffer[1]):
        rows = t.view(torch.uint8).view(t.shape[0], -1)
        assert (rows[16:32] == 7).all()
        assert not rows[:16].any() and not rows[32:].any()
    host.backup_from_device_all_layer(dev, h.as_subclass(_Lying), d, "kernel")
    assert (host.k_buffer.view(torch.uint8) != 0).any()


def test_host_memory_given_as_a_tensor_subclass_is_read_from_its_storage():
    """A plane or a region adopted from a subclass takes the address torch holds for it, not
    the one its methods report."""
    owner = torch.arange(64, dtype=torch.uint8).as_subclass(_Lying)
    region = _core.HostRegion.adopt(owner)
    assert region.address == owner.untyped_storage().data_ptr() != _LIE_AT.data_ptr()
    with pytest.raises(TypeError, match="a CPU torch tensor"):
        _core.HostRegion.adopt(object())


# Python code the caller controls, run while a transfer reads its arguments: an attribute set on
# a plain tensor object (which shadows the method of that name), and an index array whose
# conversion frees a device layer. Each in its own process: both used to end in a write to
# memory the call did not own (a crash, or another tensor's bytes changed).
_HOOKS = r"""
import numpy as np
import torch
from hostkv_rs import MHATokenToKVPool, MHATokenToKVPoolHost

victim = torch.zeros(1 << 16, dtype=torch.uint8)
dev = MHATokenToKVPool(4096, 16, torch.float32, head_num=2, head_dim=8, layer_num=2)
if "CASE" == "attribute":
    for t in (*dev.k_buffer, *dev.v_buffer):
        t.data_ptr = lambda: victim.data_ptr()
        t.is_contiguous = lambda *a, **k: True
host = MHATokenToKVPoolHost(dev, 2.0, 0, 16, "layer_first")
h = host.alloc(64)
host.kv_buffer.fill_(7)
rows = torch.arange(64, 128)
mode = None
if "CASE" == "mode":
    from torch.overrides import TorchFunctionMode

    class Lying(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            if func is torch.Tensor.data_ptr and args and args[0] is dev.k_buffer[0]:
                return victim.data_ptr()
            return func(*args, **(kwargs or {}))

    mode = Lying()
    mode.__enter__()
if "CASE" == "conversion":
    host.load_to_device_per_layer(dev, h, rows, 0, "kernel")  # checked and cached

    class Frees(np.ndarray):
        @property
        def flags(self):
            dev.k_buffer[0].untyped_storage().resize_(0)
            return np.ndarray.flags.__get__(self)

    rows = rows.numpy().view(Frees)
try:
    host.load_to_device_per_layer(dev, h, rows, 0, "kernel")
except ValueError as exc:
    print("REFUSED", exc)
else:
    print("ACCEPTED", bool((dev.k_buffer[0][64:128] == 7).all()))
if mode is not None:
    mode.__exit__(None, None, None)
print("VICTIM", int(victim.count_nonzero()))
"""


@pytest.mark.parametrize("extent", ["auto", "python"])
@pytest.mark.parametrize(
    ("case", "outcome"),
    [
        ("attribute", "ACCEPTED True"),
        ("conversion", "REFUSED device pool plane 0 layer 0: the tensor's storage holds 0 bytes"),
        ("mode", "ACCEPTED True"),
    ],
)
def test_caller_code_run_during_a_call_cannot_choose_or_free_what_it_writes(case, outcome, extent):
    """Facts are asked of torch through the types' methods with torch-function modes off, and
    the device pointers are read after the index arrays (whose conversion may run Python)."""
    done = _child(_HOOKS.replace("CASE", case), extent)
    assert done.returncode == 0, done.stderr[-4000:]
    assert outcome in done.stdout and "VICTIM 0" in done.stdout, done.stdout


def test_a_negative_view_device_layer_is_refused():
    """Its bytes are the un-negated values: copying them would load -x where the host has x."""
    dev = MHATokenToKVPool(64, 16, torch.float32, head_num=2, head_dim=8, layer_num=2)
    dev.k_buffer[0] = torch._neg_view(dev.k_buffer[0])
    host = MHATokenToKVPoolHost(dev, 2.0, 0, 16, "layer_first")
    h, d = host.alloc(16), torch.arange(16, 32)
    with pytest.raises(ValueError, match="a negative or conjugate view cannot be a device layer"):
        host.load_to_device_per_layer(dev, h, d, 0, "kernel")
    with pytest.raises(ValueError, match="a negative or conjugate view cannot be a device layer"):
        host.backup_from_device_all_layer(dev, h, d, "kernel")


# Python the caller does not call itself, run by the interpreter: a storage deleter (a buffer
# owner's __del__) run when the binding lets go of the storage its last check held. It used to
# end in a write to freed memory. (Finalizers run during the checks: `_COLLECTIONS` below.)
_DELETER = r"""
import torch
from hostkv_rs import MHATokenToKVPool, MHATokenToKVPoolHost

N = 1 << 16
dev = MHATokenToKVPool(N, 16, torch.float32, head_num=2, head_dim=8, layer_num=2)
fired, victims = [], []

class Owner(bytearray):
    def __del__(self):
        # Whether the call's copy has already landed in the layer it is about to free.
        fired.append(bool((dev.k_buffer[0][64:128] == 7).all()))
        dev.k_buffer[0].untyped_storage().resize_(0)
        victims.append(torch.zeros(N * 16))  # likely at the address just freed

base = torch.frombuffer(Owner(N * 64), dtype=torch.float32)
dev.k_buffer[0] = torch.empty(0).set_(base.untyped_storage(), 0, (N, 2, 8), (16, 8, 1))
del base
host = MHATokenToKVPoolHost(dev, 2.0, 0, 16, "layer_first")
h = host.alloc(64)
host.kv_buffer.fill_(7)
rows = torch.arange(64, 128)
host.load_to_device_per_layer(dev, h, rows, 0, "kernel")  # checked and cached
dev.k_buffer[0].set_(torch.zeros(N, 2, 8))  # the next call checks every layer again
try:
    host.load_to_device_per_layer(dev, h, rows, 0, "kernel")
except ValueError as exc:
    print("REFUSED", exc)
else:
    print("ACCEPTED")
print("FIRED", fired, "VICTIM", int(victims[0].count_nonzero()) if victims else None)
"""


@pytest.mark.parametrize("extent", ["auto", "python"])
def test_a_storage_deleter_run_after_the_copy_never_frees_what_it_writes(extent):
    """A call keeps every state it replaced alive until its copy is done: the buffer owner's
    `__del__`, run when the binding lets go of the storage its last check held, finds the copy
    landed and frees memory nothing writes to any more."""
    done = _child(_DELETER, extent)
    assert done.returncode == 0, done.stderr[-4000:]
    assert "ACCEPTED" in done.stdout and "FIRED [True] VICTIM 0" in done.stdout, done.stdout


# A finalizer that frees a device layer or the index tensor at the Nth garbage collection inside
# a load, for every N the call reaches: the call's checks allocate Python objects, so each
# collection runs Python (this finalizer) between two of them.
_COLLECTIONS = r"""
import gc
import torch
from hostkv_rs import MHATokenToKVPool, MHATokenToKVPoolHost

N = 1 << 16
dev = MHATokenToKVPool(N, 16, torch.float32, head_num=2, head_dim=8, layer_num=2)
host = MHATokenToKVPoolHost(dev, 2.0, 0, 16, "layer_first")
h = host.alloc(64)
host.kv_buffer.fill_(7)
state = {"armed": False, "seen": 0, "at": 0, "fired": False}
victims = []


class Bomb:
    # Garbage that makes itself again: its finalizer runs at every collection.
    def __init__(self):
        self.me = self

    def __del__(self):
        if state["armed"] and not state["fired"]:
            state["seen"] += 1
            if state["seen"] == state["at"]:
                state["fired"] = True
                target = dev.k_buffer[0] if "CASE" == "layer" else rows
                target.untyped_storage().resize_(0)
                victims.append(torch.zeros(N * 16))  # likely at the address just freed
        Bomb()


Bomb()
for at in range(1, 200):
    rows = torch.arange(64, 128)
    dev.k_buffer[0].set_(torch.zeros(N, 2, 8))  # new storage: the call checks every layer again
    state.update(armed=True, seen=0, at=at, fired=False)
    victims.clear()
    gc.set_threshold(1, 1, 1)
    try:
        host.load_to_device_per_layer(dev, h, rows, 0, "kernel")
        outcome = "ACCEPTED"
    except ValueError as exc:
        outcome = f"REFUSED {exc}"
    finally:
        gc.set_threshold(700, 10, 10)
        state["armed"] = False
    if not state["fired"]:
        break
    print("AT", at, "VICTIM", int(victims[0].count_nonzero()), outcome)
print("POINTS", at - 1)
"""


@pytest.mark.parametrize("case", ["layer", "index"])
def test_python_run_at_any_collection_during_a_call_never_frees_what_it_writes(case):
    """A call ends with a check that runs no Python (every touched tensor and host storage still
    as this call checked it, read from torch's objects): whichever collection inside the call
    frees a device layer or the index tensor, the call refuses and writes nothing there. (Without
    torch's offsets, `HOSTKV_TENSOR_EXTENT=python`, that last check cannot be made without
    Python: such a finalizer is then outside what the call vouches for, as the README says.)"""
    done = _child(_COLLECTIONS.replace("CASE", case), "auto")
    assert done.returncode == 0, done.stderr[-4000:]
    lines = done.stdout.splitlines()
    points = int(lines[-1].removeprefix("POINTS "))
    # Several collections run inside one call, so the scan reaches past its first checks.
    assert points >= 3, done.stdout
    for line in lines[:-1]:
        assert " VICTIM 0 REFUSED " in line, done.stdout
