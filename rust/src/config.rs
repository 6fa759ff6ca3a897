//! Every environment variable the core reads, parsed here and nowhere else; a bad value is
//! refused with the variable's name, its value and what is allowed (except
//! `HOSTKV_UNREGISTER_TIMEOUT_S`, see there).
//!
//! When each is read is part of its meaning: `HOSTKV_CPU_ENGINE` once per device binding (the
//! engine is chosen when the binding is built); the CUDA tuning and diagnostic switches at their
//! point of use, so a running server can be retuned (and a test can change them) without
//! rebuilding its pools.

use std::time::Duration;

use crate::error::{Error, Result};

/// The engine a binding of CPU device tensors uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CpuEngine {
    /// The validated copy plan (`plan` + `cpu`), the default.
    Plan,
    /// The CUDA kernels' C under the CPU shim (tests; needs the `emulator` feature).
    Emulated,
}

fn var(name: &str) -> Option<String> {
    std::env::var(name).ok()
}

/// `HOSTKV_CPU_ENGINE`: `plan` (default) or `emulated`.
pub fn cpu_engine() -> std::result::Result<CpuEngine, String> {
    let raw = var("HOSTKV_CPU_ENGINE").unwrap_or_default();
    match raw.trim().to_ascii_lowercase().as_str() {
        "" | "plan" => Ok(CpuEngine::Plan),
        "emulated" => Ok(CpuEngine::Emulated),
        other => Err(format!(
            "HOSTKV_CPU_ENGINE must be one of plan, emulated, got '{other}'"
        )),
    }
}

/// The kernels' block quota unless `HOSTKV_BLOCK_QUOTA` says otherwise: 2 (64 warps), SGLang's
/// default, which keeps the copy to a small share of the GPU during a forward pass.
pub const DEFAULT_BLOCK_QUOTA: u32 = 2;

/// `HOSTKV_BLOCK_QUOTA`: an integer in [1, 65535], else 2.
pub fn block_quota() -> Result<u32> {
    match var("HOSTKV_BLOCK_QUOTA") {
        None => Ok(DEFAULT_BLOCK_QUOTA),
        Some(v) => match v.trim().parse::<u32>() {
            Ok(q) if (1..=65_535).contains(&q) => Ok(q),
            _ => Err(Error::unsupported(format!(
                "HOSTKV_BLOCK_QUOTA must be an integer in [1, 65535], got {v:?}"
            ))),
        },
    }
}

/// `HOSTKV_TENSOR_EXTENT`: `auto` (default: a binding reads its device tensors' extents from
/// torch's objects where the offsets could be found) or `python` (every check through Python).
/// Read once per process, when the first tensor is checked.
pub fn tensor_extent_reads() -> Result<bool> {
    let raw = var("HOSTKV_TENSOR_EXTENT").unwrap_or_default();
    match raw.trim().to_ascii_lowercase().as_str() {
        "" | "auto" => Ok(true),
        "python" => Ok(false),
        _ => Err(Error::unsupported(format!(
            "HOSTKV_TENSOR_EXTENT must be one of auto, python, got {raw:?}"
        ))),
    }
}

/// `HOSTKV_DIRECT_BATCH`: `0` forces the direct backend's per-copy path (a diagnostic switch);
/// `1` or unset batches where the driver can.
pub fn direct_batch() -> Result<bool> {
    let raw = var("HOSTKV_DIRECT_BATCH").unwrap_or_default();
    match raw.trim() {
        "" | "1" => Ok(true),
        "0" => Ok(false),
        _ => Err(Error::unsupported(format!(
            "HOSTKV_DIRECT_BATCH must be 0 or 1, got {raw:?}"
        ))),
    }
}

/// `HOSTKV_UNREGISTER_TIMEOUT_S` (seconds, finite, >= 0; default 60): how long unregistering a
/// region waits for transfers still queued on it. An unusable value keeps the default, because
/// this is read while a pool is being destroyed, where an error would leak the region.
pub fn unregister_timeout() -> Duration {
    var("HOSTKV_UNREGISTER_TIMEOUT_S")
        .and_then(|v| v.trim().parse::<f64>().ok())
        .filter(|s| s.is_finite() && *s >= 0.0)
        .map_or(Duration::from_secs(60), Duration::from_secs_f64)
}

/// `HOSTKV_REGISTER_PARALLEL_BYTES`: regions at least this large register on several threads
/// (lets tests exercise the threaded path on small regions); `default` when unset. Read before a
/// registration pins anything, so a bad value refuses the pool before any memory is pinned.
pub fn register_parallel_bytes(default: usize) -> Result<usize> {
    match var("HOSTKV_REGISTER_PARALLEL_BYTES") {
        None => Ok(default),
        Some(v) if v.trim().is_empty() => Ok(default),
        Some(v) => v.trim().parse::<usize>().map_err(|_| {
            Error::unsupported(format!(
                "HOSTKV_REGISTER_PARALLEL_BYTES must be a byte count (a non-negative integer), \
                 got {v:?}"
            ))
        }),
    }
}

/// `HOSTKV_LOG_REGISTER` (any value): log each registration's size, chunks and speed.
pub fn log_register() -> bool {
    std::env::var_os("HOSTKV_LOG_REGISTER").is_some()
}

#[cfg(test)]
mod tests {
    use super::*;

    // One test, because the process environment is shared by the tests' threads.
    #[test]
    fn each_variable_parses_or_names_itself() {
        std::env::set_var("HOSTKV_CPU_ENGINE", " Emulated ");
        assert_eq!(cpu_engine(), Ok(CpuEngine::Emulated));
        std::env::set_var("HOSTKV_CPU_ENGINE", "warp");
        assert!(cpu_engine().unwrap_err().contains("HOSTKV_CPU_ENGINE"));
        std::env::remove_var("HOSTKV_CPU_ENGINE");
        assert_eq!(cpu_engine(), Ok(CpuEngine::Plan));

        std::env::set_var("HOSTKV_BLOCK_QUOTA", "0");
        assert!(block_quota()
            .unwrap_err()
            .to_string()
            .contains("HOSTKV_BLOCK_QUOTA must be an integer in [1, 65535], got \"0\""));
        std::env::set_var("HOSTKV_BLOCK_QUOTA", "8");
        assert_eq!(block_quota().unwrap(), 8);
        std::env::remove_var("HOSTKV_BLOCK_QUOTA");
        assert_eq!(block_quota().unwrap(), DEFAULT_BLOCK_QUOTA);

        std::env::set_var("HOSTKV_UNREGISTER_TIMEOUT_S", "nan");
        assert_eq!(unregister_timeout(), Duration::from_secs(60));
        std::env::set_var("HOSTKV_UNREGISTER_TIMEOUT_S", "0.5");
        assert_eq!(unregister_timeout(), Duration::from_millis(500));
        std::env::remove_var("HOSTKV_UNREGISTER_TIMEOUT_S");

        std::env::set_var("HOSTKV_DIRECT_BATCH", "0");
        assert!(!direct_batch().unwrap());
        std::env::set_var("HOSTKV_DIRECT_BATCH", "off");
        assert!(direct_batch()
            .unwrap_err()
            .to_string()
            .contains("HOSTKV_DIRECT_BATCH must be 0 or 1, got \"off\""));
        std::env::remove_var("HOSTKV_DIRECT_BATCH");
        assert!(direct_batch().unwrap());

        std::env::set_var("HOSTKV_REGISTER_PARALLEL_BYTES", "abc");
        assert!(register_parallel_bytes(7)
            .unwrap_err()
            .to_string()
            .contains("HOSTKV_REGISTER_PARALLEL_BYTES"));
        std::env::set_var("HOSTKV_REGISTER_PARALLEL_BYTES", " 65536 ");
        assert_eq!(register_parallel_bytes(7).unwrap(), 65536);
        std::env::remove_var("HOSTKV_REGISTER_PARALLEL_BYTES");
        assert_eq!(register_parallel_bytes(7).unwrap(), 7);
    }
}
