//! What a launch reads besides the pools: host-resident index arrays (validated, then staged) and
//! device layer tables too long for the parameter block. Each buffer is a pair: a pinned host
//! buffer the CPU fills, and a device scratch buffer of the same size that one async copy on the
//! launch's stream fills from it, so the kernels read the indices from device memory (not every
//! warp over PCIe). A pair is reused only after the event recorded behind the launch that read
//! it (and behind that copy) has completed.

use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::Mutex;

use cudarc::driver::sys;

use super::driver::{check, lock_cache, may_block, Cu};
use super::probe;
use crate::error::{Error, Result};

const MIN_BLOCK: usize = 64 << 10;
/// Beyond this many buffers per context, wait for one instead of allocating another.
const MAX_BLOCKS: usize = 32;

struct Block {
    host: usize,
    /// Device scratch of `cap` bytes.
    dev: u64,
    cap: usize,
    event: usize,
    /// Handed out and not yet released.
    leased: bool,
    /// An event was recorded behind its last use.
    pending: bool,
}

/// Keyed by `probe::ctx_key`.
/// Against the GIL: a leaf lock in code that never calls Python, so it is never held while the
/// GIL is waited for (design.md, "Locks and the GIL").
static POOLS: Mutex<Option<HashMap<u64, Vec<Block>>>> = Mutex::new(None);

/// A staging pair held for one launch.
pub(crate) struct Lease {
    ctx: u64,
    index: usize,
    /// Host buffer the caller fills.
    pub host: *mut u8,
    /// Device scratch the kernels read, once `upload` has been enqueued.
    pub dev: u64,
}

fn free_now(b: &Block) -> Result<bool> {
    if !b.pending {
        return Ok(true);
    }
    // SAFETY: a live event of this context.
    let rc = unsafe { sys::cuEventQuery(b.event as sys::CUevent) };
    match rc {
        Cu::CUDA_SUCCESS => Ok(true),
        Cu::CUDA_ERROR_NOT_READY => Ok(false),
        other => check(other, "cuEventQuery (staging)").map(|_| false),
    }
}

fn allocate(bytes: usize) -> Result<Block> {
    may_block()?;
    let cap = bytes.max(MIN_BLOCK).next_power_of_two();
    let mut p: *mut c_void = std::ptr::null_mut();
    // SAFETY: valid out-pointers throughout; the allocations are freed on error, else only with
    // the process.
    unsafe {
        check(
            sys::cuMemHostAlloc(
                &mut p,
                cap,
                sys::CU_MEMHOSTALLOC_PORTABLE | sys::CU_MEMHOSTALLOC_DEVICEMAP,
            ),
            "cuMemHostAlloc (staging)",
        )?;
        let mut dev: sys::CUdeviceptr = 0;
        let mut ev: sys::CUevent = std::ptr::null_mut();
        let r = check(sys::cuMemAlloc_v2(&mut dev, cap), "cuMemAlloc (staging)").and_then(|_| {
            check(
                sys::cuEventCreate(
                    &mut ev,
                    sys::CUevent_flags_enum::CU_EVENT_DISABLE_TIMING as u32,
                ),
                "cuEventCreate (staging)",
            )
        });
        if let Err(e) = r {
            if dev != 0 {
                sys::cuMemFree_v2(dev);
            }
            sys::cuMemFreeHost(p);
            return Err(e);
        }
        Ok(Block {
            host: p as usize,
            dev,
            cap,
            event: ev as usize,
            leased: true,
            pending: false,
        })
    }
}

fn lease_of(key: u64, index: usize, b: &mut Block) -> Lease {
    b.leased = true;
    b.pending = false;
    Lease {
        ctx: key,
        index,
        host: b.host as *mut u8,
        dev: b.dev,
    }
}

/// A pair of at least `bytes` usable from context `ctx` (current on this thread). May wait for
/// an event or allocate (`driver::may_block`).
pub(crate) fn acquire(ctx: sys::CUcontext, bytes: usize) -> Result<Lease> {
    let key = probe::ctx_key(ctx);
    let mut guard = lock_cache(&POOLS)?;
    let pool = guard
        .get_or_insert_with(HashMap::new)
        .entry(key)
        .or_default();
    let mut waitable = None;
    for (i, b) in pool.iter_mut().enumerate() {
        if b.leased || b.cap < bytes {
            continue;
        }
        if free_now(b)? {
            return Ok(lease_of(key, i, b));
        }
        waitable.get_or_insert(i);
    }
    if let (Some(i), true) = (waitable, pool.len() >= MAX_BLOCKS) {
        may_block()?;
        let b = &mut pool[i];
        let event = b.event;
        b.leased = true;
        // Wait without holding the pool lock: other threads may use the other buffers.
        drop(guard);
        // SAFETY: a live event of this context.
        let r = check(
            unsafe { sys::cuEventSynchronize(event as sys::CUevent) },
            "cuEventSynchronize (staging)",
        );
        let mut guard = POOLS.lock().unwrap_or_else(|p| p.into_inner());
        // Pools and their buffers are never removed.
        let Some(b) = guard
            .as_mut()
            .and_then(|m| m.get_mut(&key))
            .and_then(|pool| pool.get_mut(i))
        else {
            return Err(Error::cuda("staging buffer lost while waiting for it"));
        };
        if let Err(e) = r {
            b.leased = false;
            return Err(e);
        }
        return Ok(lease_of(key, i, b));
    }
    // Allocate without holding the pool lock (`release` needs it after every launch).
    may_block()?;
    drop(guard);
    let b = allocate(bytes)?;
    let mut guard = POOLS.lock().unwrap_or_else(|p| p.into_inner());
    let pool = guard
        .get_or_insert_with(HashMap::new)
        .entry(key)
        .or_default();
    let lease = Lease {
        ctx: key,
        index: pool.len(),
        host: b.host as *mut u8,
        dev: b.dev,
    };
    pool.push(b);
    Ok(lease)
}

/// Enqueues the copy of the first `bytes` of the host buffer into the device scratch on
/// `stream` (from pinned memory: truly asynchronous).
pub(crate) fn upload(lease: &Lease, bytes: usize, stream: sys::CUstream) -> Result<()> {
    // SAFETY: both buffers hold at least `bytes`; the host buffer stays untouched until the
    // event recorded behind the launches (release) has completed.
    check(
        unsafe { sys::cuMemcpyHtoDAsync_v2(lease.dev, lease.host as *const c_void, bytes, stream) },
        "cuMemcpyHtoDAsync (staged indices)",
    )
}

/// Gives the pair back. With `stream`, it stays busy until the work enqueued so far on that
/// stream has finished; without (nothing was enqueued), it is free at once.
pub(crate) fn release(lease: Lease, stream: Option<sys::CUstream>) -> Result<()> {
    let mut guard = POOLS.lock().unwrap_or_else(|p| p.into_inner());
    let Some(b) = guard
        .as_mut()
        .and_then(|m| m.get_mut(&lease.ctx))
        .and_then(|pool| pool.get_mut(lease.index))
    else {
        return Ok(());
    };
    b.leased = false;
    b.pending = false;
    if let Some(s) = stream {
        // SAFETY: a live event of this context and the caller's stream.
        let r = check(
            unsafe { sys::cuEventRecord(b.event as sys::CUevent, s) },
            "cuEventRecord (staging)",
        );
        if r.is_err() {
            // Nobody can tell when the launch stops reading it: never hand this buffer out
            // again rather than risk overwriting indices a kernel still reads.
            b.leased = true;
        } else {
            b.pending = true;
        }
        r?;
    }
    Ok(())
}
