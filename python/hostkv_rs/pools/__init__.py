"""The drop-in host pools (SGLang's `pool_host` classes) and the helpers they share.

The pool classes are imported from `hostkv_rs` itself (`hostkv_rs.MHATokenToKVPoolHost`, ...);
the modules here hold them: `base` (HostKVCache), `mha`, `mla`, `v4_paged`, `logical`,
`hisparse`, and what they share (`args`, `indices`, `slots`, `device_side`, `memory`).
"""
