"""The DeepSeek V4 host pools under one import path: the paged page-row pool (`v4_paged`) and
the byte-less logical anchor pool (`logical`)."""

from hostkv_rs.pools.logical import LogicalHostPool
from hostkv_rs.pools.v4_paged import DeepSeekV4PagedHostPool, PageIndexError

__all__ = ["DeepSeekV4PagedHostPool", "LogicalHostPool", "PageIndexError"]
