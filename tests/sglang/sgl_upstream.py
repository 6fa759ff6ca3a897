"""Shared pieces of the `test_upstream_*.py` modules: SGLang's own CPU host-pool unit tests,
restated in our words and run twice, with SGLang's classes and with ours after `install()`.

`side` (the fixture these modules share, defined here and imported by each) is "sglang" or
"hostkv_rs". Either way a test asks for a class by name through `side.cls(name)`, which reads it
from SGLang's own module at that moment, as SGLang's code would: SGLang's class before
`install()`, ours after it. SGLang's pools allocate as they would (`pin_memory=False` needs no
CUDA driver); the K-only and DSA indexer pools stay SGLang's after `install()` too.

Pools are built with the installed release's constructor form (a device pool up to 0.5.22, its
buffer info plus capacity and layer range in 0.5.23), with `pin_memory=False` on "cpu" as the
upstream tests do.
"""

from __future__ import annotations

import pytest
import sgl_harness as H
import torch

# Where SGLang defines each class a test asks for (the replaced ones and SGLang's own others).
_HOME = {
    "MHATokenToKVPoolHost": H.ph_mha,
    "AsymmetricMHATokenToKVPoolHost": H.ph_mha,
    "MHATokenToKOnlyPoolHost": H.ph_mha,
    "get_mha_host_pool_cls": H.ph_mha,
    "MLATokenToKVPoolHost": H.ph_mla,
    "LogicalHostPool": H.mph,
    "DeepSeekV4PagedHostPool": H.mph,
}
_REPLACED = set(H.REPLACED)
BUFFER_INFO_FORM = H.at_least(0, 5, 23)


class Side:
    def __init__(self, name: str):
        self.name = name
        self.ours = name == "hostkv_rs"

    def cls(self, name: str):
        """SGLang's module attribute `name`, checked to be ours or SGLang's as this side says."""
        obj = getattr(_HOME[name], name)
        if name in _REPLACED:
            want = "hostkv_rs" if self.ours else "sglang."
            assert obj.__module__.startswith(want), (self.name, name, obj.__module__)
        return obj

    def check(self, pool, name: str):
        """`pool` is an instance of this side's class `name`."""
        assert type(pool) is self.cls(name), (self.name, type(pool), name)

    def __repr__(self):
        return self.name


@pytest.fixture(params=["sglang", "hostkv_rs"])
def side(request):
    """Each test runs with SGLang's classes and again with ours after install()."""
    if request.param == "hostkv_rs":
        request.getfixturevalue("installed")
    return Side(request.param)


def requires(condition: bool, why: str):
    """Skip (both sides) where SGLang's own classes of this release cannot pass the scenario."""
    return pytest.mark.skipif(not condition, reason=f"SGLang {H.SGLANG_VERSION}: {why}")


def has(obj, *names: str) -> bool:
    return all(hasattr(obj, n) for n in names)


def _release_form(dev, *, mla: bool, drafts=()):
    """(first positional argument, extra keywords) for a KV host pool over `dev`."""
    if not BUFFER_INFO_FORM:
        return dev, ({"mtp_draft_device_pools": tuple(drafts)} if drafts else {})
    extra = {
        "device_capacity_tokens": dev.size,
        "start_layer": dev.start_layer,
        "end_layer": dev.end_layer,
    }
    if drafts:
        extra["draft_buffer_infos"] = tuple(
            d.get_device_pool_infos()[0].buffer_info for d in drafts
        )
    if mla:
        extra["target_layer_num"] = dev.layer_num
    return dev.get_device_pool_infos()[0].buffer_info, extra


def kv_host(side: Side, name: str, dev, *, layout="layer_first", page=None, ratio=2.0, **kw):
    """The side's `name` pool over device pool `dev`, built as the release's constructor takes it:
    `(source, ratio, host_size=0, page_size, layout, pin_memory=False, device="cpu", ...)`."""
    source, extra = _release_form(
        dev, mla=name == "MLATokenToKVPoolHost", drafts=kw.pop("drafts", ())
    )
    pool = side.cls(name)(
        source, ratio, 0, page or dev.page_size, layout, False, "cpu", **extra, **kw
    )
    side.check(pool, name)
    return pool


def factory_input(dev):
    """What `get_mha_host_pool_cls` takes in this release: the device pool, or (0.5.23) its
    buffer info."""
    return dev.get_device_pool_infos()[0].buffer_info if BUFFER_INFO_FORM else dev


def mha_device(*, size, page, dtype=torch.float16, heads=2, head_dim=4, layers=2, **kw):
    return H.mha_device(
        size=size, page=page, dtype=dtype, heads=heads, head_dim=head_dim, layers=layers, **kw
    )
