"""hostkv_rs.l3: host pool pages to and from a distributed KV store (Mooncake Store).

    from hostkv_rs.l3 import MooncakeTier

    tier = MooncakeTier.connect(
        "127.0.0.1:50051",
        "http://127.0.0.1:8080/metadata",
        model_id="meta-llama/Llama-3.1-8B",
        tp_rank=0,  # this process's TP shard (MHA heads differ per rank)
        tp_size=1,
    )
    tier.attach(host_pool)                       # registers the pool's host memory once
    results = tier.save(keys, host_indices)      # one key per page; a PageResult per page
    results = tier.load(keys, other_indices)     # all(results) when every page came back
    tier.detach()                                # also done by host_pool.destroy() and GC

Every stored page carries its proof (`hostkv_rs.l3.proof`): a 64-byte header with the XXH3-128
digest of its key and bytes and of its writer's identity (model_id, else the SGLang server's model
path, plus the format tag), checked on every load. A page that fails is a miss (Status.MISMATCH,
counted in `tier.mismatches`, logged once per kind), is zero-filled in the pool, and its object
is removed.

Needs the optional extra `mooncake`: `pip install ".[mooncake]"` in the hostkv_rs checkout (the
package is not on PyPI; it pulls mooncake-transfer-engine-non-cuda, which also needs the Debian
packages libibverbs1 and libnuma1); the pools and the Rust core never import it.
`hostkv_rs.l3.master.LoopbackMaster` starts a `mooncake_master` on loopback for tests and demos;
it never outlives the process that started it. Mooncake's native log stays quiet unless
HOSTKV_MOONCAKE_LOG is set.
"""

from hostkv_rs.l3.format import FORMAT_VERSION, PageFormat, host_buffers, page_format
from hostkv_rs.l3.mooncake import (
    L3Error,
    MooncakeTier,
    PageResult,
    Status,
    StoreUnavailable,
    code_name,
)

__all__ = [
    "FORMAT_VERSION",
    "L3Error",
    "MooncakeTier",
    "PageFormat",
    "PageResult",
    "Status",
    "StoreUnavailable",
    "code_name",
    "host_buffers",
    "page_format",
]
