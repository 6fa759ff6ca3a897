//! Small pinned, device-mapped host buffers for what a launch reads besides the pools: host-
//! resident index arrays (validated, then copied here so the kernel can read them) and device
//! layer tables too long for the parameter block. A buffer is reused only after the event
//! recorded behind the launch that read it has completed.

use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::Mutex;

use cudarc::driver::sys;

use super::driver::{check, Cu};
use crate::error::Result;

const MIN_BLOCK: usize = 64 << 10;
/// Beyond this many buffers per context, wait for one instead of allocating another.
const MAX_BLOCKS: usize = 32;

struct Block {
    host: usize,
    dev: u64,
    cap: usize,
    event: usize,
    /// Handed out and not yet released.
    leased: bool,
    /// An event was recorded behind its last use.
    pending: bool,
}

static POOLS: Mutex<Option<HashMap<usize, Vec<Block>>>> = Mutex::new(None);

/// A staging buffer held for one launch.
pub(crate) struct Lease {
    ctx: usize,
    index: usize,
    pub host: *mut u8,
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
    let cap = bytes.max(MIN_BLOCK).next_power_of_two();
    let mut p: *mut c_void = std::ptr::null_mut();
    // SAFETY: valid out-pointers throughout; the allocation is freed only with the process.
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
        let r = check(
            sys::cuMemHostGetDevicePointer_v2(&mut dev, p, 0),
            "cuMemHostGetDevicePointer (staging)",
        )
        .and_then(|_| {
            check(
                sys::cuEventCreate(
                    &mut ev,
                    sys::CUevent_flags_enum::CU_EVENT_DISABLE_TIMING as u32,
                ),
                "cuEventCreate (staging)",
            )
        });
        if let Err(e) = r {
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

/// A buffer of at least `bytes` usable from context `ctx` (current on this thread).
pub(crate) fn acquire(ctx: sys::CUcontext, bytes: usize) -> Result<Lease> {
    let mut guard = POOLS.lock().unwrap_or_else(|p| p.into_inner());
    let pool = guard
        .get_or_insert_with(HashMap::new)
        .entry(ctx as usize)
        .or_default();
    let mut waitable = None;
    for (i, b) in pool.iter_mut().enumerate() {
        if b.leased || b.cap < bytes {
            continue;
        }
        if free_now(b)? {
            b.leased = true;
            b.pending = false;
            return Ok(Lease {
                ctx: ctx as usize,
                index: i,
                host: b.host as *mut u8,
                dev: b.dev,
            });
        }
        waitable.get_or_insert(i);
    }
    if let (Some(i), true) = (waitable, pool.len() >= MAX_BLOCKS) {
        let b = &mut pool[i];
        // SAFETY: a live event of this context.
        check(
            unsafe { sys::cuEventSynchronize(b.event as sys::CUevent) },
            "cuEventSynchronize (staging)",
        )?;
        b.leased = true;
        b.pending = false;
        return Ok(Lease {
            ctx: ctx as usize,
            index: i,
            host: b.host as *mut u8,
            dev: b.dev,
        });
    }
    let b = allocate(bytes)?;
    let lease = Lease {
        ctx: ctx as usize,
        index: pool.len(),
        host: b.host as *mut u8,
        dev: b.dev,
    };
    pool.push(b);
    Ok(lease)
}

/// Gives the buffer back. With `stream`, it stays busy until the work enqueued so far on that
/// stream has finished; without (nothing was launched), it is free at once.
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
