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
from hostkv_rs._memory import HostTensorAllocator
from hostkv_rs.base import HostKVCache
from hostkv_rs.mha import (
    AsymmetricMHATokenToKVPoolHost,
    MHATokenToKVPoolHost,
    get_mha_host_pool_cls,
)
from hostkv_rs.mla import MLATokenToKVPoolHost
from hostkv_rs.tools.device_pools import MHATokenToKVPool, MLATokenToKVPool
from hostkv_rs.v4 import DeepSeekV4PagedHostPool, LogicalHostPool

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
