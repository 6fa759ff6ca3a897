"""Old import path of the reference device pools, kept for code written against it: they live in
`hostkv_rs.tools.device_pools` (and are exported as `hostkv_rs.MHATokenToKVPool` /
`hostkv_rs.MLATokenToKVPool`)."""

from hostkv_rs.tools.device_pools import MHATokenToKVPool, MLATokenToKVPool, store_dtype_for

__all__ = ["MHATokenToKVPool", "MLATokenToKVPool", "store_dtype_for"]
