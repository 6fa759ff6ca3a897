"""What runs around the drop-in pools rather than inside SGLang: the `hostkv-rs` CLI, the demo,
the benchmark, model presets and the reference device pools (torch stand-ins for SGLang's
`MHATokenToKVPool` / `MLATokenToKVPool`, used by the demo, the benchmarks and the tests)."""
