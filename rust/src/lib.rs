//! hostkv_rs core: host memory, layout arithmetic, transfer plans and the engines that run them.

pub mod cgroup;
pub mod config;
pub mod cpu;
pub mod cuda;
pub mod digest;
pub mod engine;
pub mod error;
pub mod fork;
pub mod host_mem;
pub mod index_map;
pub mod index_scan;
pub mod layer_map;
pub mod layout;
pub mod plan;
#[cfg(any(test, feature = "fuzz"))]
pub mod plan_fuzz;
pub mod pool;
pub mod request;
pub mod support;

#[cfg(feature = "python")]
mod python;

pub use error::{Error, Result};
