//! The planner under libFuzzer: `cargo +nightly fuzz run plan` (see fuzz/README.md).
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| hostkv_rs::plan_fuzz::one_input(data));
