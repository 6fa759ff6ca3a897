"""hostkv_rs: drop-in replacements for SGLang's HiCache host KV pools, with a Rust core.

Importing the package never touches CUDA: the core probes the driver only when asked
(`cuda_available()`), and torch.cuda is used only for CUDA device pools.
"""

from hostkv_rs._core import (
    LayerIndexError,
    PageIndexError,
    TransferError,
    cuda_available,
    runtime_info,
)
from hostkv_rs._core import __version__ as __version__

# The pools import torch (seconds); the console script's --help and --version must not wait for
# it, so the pool classes load on first use.
_LAZY = {
    "HostTensorAllocator": "hostkv_rs.pools.memory",
    "HostKVCache": "hostkv_rs.pools.base",
    "AsymmetricMHATokenToKVPoolHost": "hostkv_rs.pools.mha",
    "MHATokenToKVPoolHost": "hostkv_rs.pools.mha",
    "get_mha_host_pool_cls": "hostkv_rs.pools.mha",
    "MLATokenToKVPoolHost": "hostkv_rs.pools.mla",
    "MHATokenToKVPool": "hostkv_rs.tools.device_pools",
    "MLATokenToKVPool": "hostkv_rs.tools.device_pools",
    "DeepSeekV4PagedHostPool": "hostkv_rs.pools.v4_paged",
    "LogicalHostPool": "hostkv_rs.pools.logical",
}


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'hostkv_rs' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_LAZY))


__all__ = [
    "AsymmetricMHATokenToKVPoolHost",
    "DeepSeekV4PagedHostPool",
    "HostKVCache",
    "HostTensorAllocator",
    "LayerIndexError",
    "LogicalHostPool",
    "MHATokenToKVPool",
    "MHATokenToKVPoolHost",
    "MLATokenToKVPool",
    "MLATokenToKVPoolHost",
    "PageIndexError",
    "TransferError",
    "__version__",
    "cuda_available",
    "get_mha_host_pool_cls",
    "runtime_info",
]
