//! The copy engines behind one trait: the CPU plan, the CUDA kernels' C emulated on the CPU, and
//! the CUDA path (the kernels or, for the direct backend, the copy engine). A device binding
//! picks one when it checks its device tensors; every transfer then runs through it.

use crate::config::CpuEngine;
use crate::error::{CudaError, Error, Result};
use crate::request::{DeviceMemory, TransferRequest};
use crate::{cpu, cuda, plan};

/// Transfers that move more than this run without the caller's lock (in the Python binding, the
/// GIL); smaller ones are cheaper to run than the ~1 us a detach and reattach cost.
pub const UNLOCK_BYTES: u64 = 1 << 20;

/// Lets an engine run long or blocking work without the caller's lock.
pub trait Unlock {
    fn unlocked(&self, work: &mut (dyn FnMut() -> Result<()> + Send)) -> Result<()>;
}

/// For callers that hold no lock (cargo tests, benchmarks).
pub struct NoLock;

impl Unlock for NoLock {
    fn unlocked(&self, work: &mut (dyn FnMut() -> Result<()> + Send)) -> Result<()> {
        work()
    }
}

/// One way to run a transfer. Every implementation checks the whole request (the planner's
/// validation, or the kernel path's) before a byte moves; a refused request moves nothing.
pub trait CopyEngine: Send + Sync {
    /// Where the device side's pointers live.
    fn memory(&self) -> DeviceMemory;
    /// Runs `req`; `stream` is the CUDA stream a GPU engine queues on (torch's current stream),
    /// ignored by the CPU engines.
    fn run(&self, req: &TransferRequest, stream: u64, unlock: &dyn Unlock) -> Result<()>;
}

/// The validated copy plan, executed with memcpy (multi-threaded when large).
pub struct CpuPlan;

impl CopyEngine for CpuPlan {
    fn memory(&self) -> DeviceMemory {
        DeviceMemory::Host
    }

    fn run(&self, req: &TransferRequest, _stream: u64, unlock: &dyn Unlock) -> Result<()> {
        let plan = plan::build(req)?;
        if plan.bytes() > UNLOCK_BYTES {
            unlock.unlocked(&mut || cpu::execute(&plan))
        } else {
            cpu::execute(&plan)
        }
    }
}

/// The CUDA kernels' C run on the CPU under the emulation shim (tests): device pointers are
/// host pointers. Without the `emulator` feature it refuses, saying how to get it.
pub struct EmulatedKernels;

impl CopyEngine for EmulatedKernels {
    fn memory(&self) -> DeviceMemory {
        DeviceMemory::Host
    }

    fn run(&self, req: &TransferRequest, _stream: u64, unlock: &dyn Unlock) -> Result<()> {
        plan::validate(req)?;
        unlock.unlocked(&mut || cuda::emulate(req))
    }
}

/// CUDA: the kernels for the kernel backend, the copy engine for the direct backend, queued on
/// the caller's stream.
pub struct Cuda;

impl CopyEngine for Cuda {
    fn memory(&self) -> DeviceMemory {
        DeviceMemory::Cuda
    }

    fn run(&self, req: &TransferRequest, stream: u64, unlock: &dyn Unlock) -> Result<()> {
        let c = plan::validate(req)?;
        let per_row: u64 = req.geom().item_bytes.iter().map(|&i| i as u64).sum();
        let bytes = (c.len as u64)
            .saturating_mul(c.layer_count)
            .saturating_mul(per_row);
        // Small transfers run under the caller's lock unless they would block (JIT, a staging
        // wait, allocation, an index read-back); then again without it.
        if bytes > UNLOCK_BYTES {
            return unlock.unlocked(&mut || cuda::execute(req, stream));
        }
        match cuda::try_execute(req, stream) {
            Err(Error::Cuda(CudaError::WouldBlock)) => {
                unlock.unlocked(&mut || cuda::execute(req, stream))
            }
            other => other,
        }
    }
}

/// Checks and plans a call exactly as the engine for its memory would, and moves nothing: what a
/// call costs the caller's thread before its first byte moves (on a GPU, the part a copy
/// engine or kernel cannot hide). The CPU engine's plan is built whole; a CUDA call is planned
/// on the device, so its host-side part is the validation.
pub struct PlanOnly(DeviceMemory);

impl CopyEngine for PlanOnly {
    fn memory(&self) -> DeviceMemory {
        self.0
    }

    fn run(&self, req: &TransferRequest, _stream: u64, _unlock: &dyn Unlock) -> Result<()> {
        let host_indices = !(req.host_idx().on_device || req.dev_idx().on_device);
        if self.0 == DeviceMemory::Host && host_indices {
            plan::build(req).map(drop)
        } else {
            plan::validate(req).map(drop)
        }
    }
}

/// The plan-only stand-in for `engine`.
pub fn plan_only(engine: &dyn CopyEngine) -> &'static dyn CopyEngine {
    static HOST: PlanOnly = PlanOnly(DeviceMemory::Host);
    static CUDA: PlanOnly = PlanOnly(DeviceMemory::Cuda);
    match engine.memory() {
        DeviceMemory::Host => &HOST,
        DeviceMemory::Cuda => &CUDA,
    }
}

/// The engine for CPU device tensors.
pub fn for_cpu(choice: CpuEngine) -> &'static dyn CopyEngine {
    match choice {
        CpuEngine::Plan => &CpuPlan,
        CpuEngine::Emulated => &EmulatedKernels,
    }
}

/// The engine for CUDA device tensors.
pub fn for_cuda() -> &'static dyn CopyEngine {
    &Cuda
}
