//! The records the kernels report bad device-resident indices through, one pair per CUDA
//! context (see `HkvErrorRecord` / `HkvDeviceRecord` in rust/kernels/hostkv_transfer.cu):
//!
//! * the claim word, the count of refused launches and the abort ring live in device memory, so
//!   every atomic of the protocol is a device-scope atomic (atomics on mapped host memory are not
//!   atomic for the host or for other devices);
//! * the details of the first bad index, the publish flag and a mirror of the count live in
//!   pinned, device-mapped host memory, so the host reads them without synchronising a stream.
//!
//! A refused launch is counted even when an earlier report is still unread: the host reports
//! how many transfers were refused since its last report, with the details of the first one.

use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

use cudarc::driver::sys;

use super::driver::{check, lock_cache, may_block};
use super::params::{refused_message, HkvDeviceRecord, HkvErrorRecord};
use super::probe;
use crate::error::{Error, Result};

struct Record {
    /// Host address of the `HkvErrorRecord` (what the host reads).
    host: usize,
    /// Its device-visible address.
    host_dev: u64,
    /// The `HkvDeviceRecord` in device memory.
    dev: u64,
    /// Refused launches already reported.
    reported: u64,
}

/// Keyed by `probe::ctx_key` (a context's unique id where the driver has one).
/// Against the GIL: a leaf lock in code that never calls Python, so it is never held while the
/// GIL is waited for (design.md, "Locks and the GIL").
static RECORDS: Mutex<Option<HashMap<u64, Record>>> = Mutex::new(None);
/// Serialises the allocation of new records.
static SETUP: Mutex<()> = Mutex::new(());
/// Launch sequence numbers for the abort ring; every launch gets one (0 means "none").
static SEQ: AtomicU64 = AtomicU64::new(1);

pub(crate) fn next_seq() -> u64 {
    loop {
        let s = SEQ.fetch_add(1, Ordering::Relaxed);
        if s != 0 {
            return s;
        }
    }
}

/// Device addresses `(host record, device record)` for kernels in context `ctx` (current on this
/// thread), allocating them on first use. Allocation zeroes the device record on a private
/// stream and waits for that one copy only (never for other work of the context).
pub(crate) fn device_ptrs(ctx: sys::CUcontext) -> Result<(u64, u64)> {
    let key = probe::ctx_key(ctx);
    let find = || {
        let guard = RECORDS.lock().unwrap_or_else(|p| p.into_inner());
        guard
            .as_ref()
            .and_then(|m| m.get(&key))
            .map(|r| (r.host_dev, r.dev))
    };
    if let Some(found) = find() {
        return Ok(found);
    }
    // Allocated outside the map's lock (which `take` needs, maybe with the GIL held); one
    // allocation at a time.
    may_block()?;
    let _setup = lock_cache(&SETUP)?;
    if let Some(found) = find() {
        return Ok(found);
    }
    let r = allocate()?;
    let out = (r.host_dev, r.dev);
    RECORDS
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .get_or_insert_with(HashMap::new)
        .insert(key, r);
    Ok(out)
}

fn allocate() -> Result<Record> {
    let mut p: *mut c_void = std::ptr::null_mut();
    let bytes = std::mem::size_of::<HkvErrorRecord>();
    // SAFETY: valid out-pointers; PORTABLE makes the host record usable from every context,
    // DEVICEMAP lets kernels write it.
    unsafe {
        check(
            sys::cuMemHostAlloc(
                &mut p,
                bytes,
                sys::CU_MEMHOSTALLOC_PORTABLE | sys::CU_MEMHOSTALLOC_DEVICEMAP,
            ),
            "cuMemHostAlloc (error record)",
        )?;
        std::ptr::write_bytes(p.cast::<u8>(), 0, bytes);
    }
    let free_host = |e: Error| {
        // SAFETY: allocated above, never handed out.
        unsafe { sys::cuMemFreeHost(p) };
        e
    };
    let mut host_dev: sys::CUdeviceptr = 0;
    check(
        // SAFETY: `p` is a live cuMemHostAlloc(DEVICEMAP) allocation made in the current
        // context; `host_dev` is a valid out-pointer; flags must be 0.
        unsafe { sys::cuMemHostGetDevicePointer_v2(&mut host_dev, p, 0) },
        "cuMemHostGetDevicePointer (error record)",
    )
    .map_err(free_host)?;
    let dev = probe::device_alloc_zeroed(std::mem::size_of::<HkvDeviceRecord>(), "error record")
        .map_err(free_host)?;
    Ok(Record {
        host: p as usize,
        host_dev,
        dev,
        reported: 0,
    })
}

/// Reports (and acknowledges) bad indices recorded by kernels in any context, once published.
pub(crate) fn take() -> Result<()> {
    let mut guard = RECORDS.lock().unwrap_or_else(|p| p.into_inner());
    let Some(map) = guard.as_mut() else {
        return Ok(());
    };
    for r in map.values_mut() {
        // SAFETY: the host record lives for the whole process.
        if let Some(msg) = unsafe { consume(r.host as *mut HkvErrorRecord, &mut r.reported) } {
            return Err(Error::transfer(msg));
        }
    }
    Ok(())
}

/// What the host has to report from one record, if anything; acknowledges a published record so
/// the next bad index can claim a new one. `reported` counts refused launches already reported.
/// Callers serialise (one lock), so two threads never report the same record.
///
/// # Safety
/// `host` points at a live, 8-byte aligned record that kernels may be writing concurrently.
pub(crate) unsafe fn consume(host: *mut HkvErrorRecord, reported: &mut u64) -> Option<String> {
    // SAFETY: the caller's promise: `host` is a live, 8-byte aligned record for this call. Its
    // `u64` fields are shared with kernels, so they are only read or written here through
    // `AtomicU64` (same size and alignment as `u64`) or volatile reads, never through `&u64`.
    let (flag, ack, aborted) = unsafe {
        let cell = |p: *const u64| &*(p as *const AtomicU64);
        (
            cell(std::ptr::addr_of!((*host).flag)),
            cell(std::ptr::addr_of!((*host).ack)),
            cell(std::ptr::addr_of!((*host).aborted)),
        )
    };
    // `flag` is read with acquire ordering, so the fields a kernel wrote before publishing the
    // record (fields, system fence, then flag) are read whole.
    let published = flag.load(Ordering::Acquire);
    let acked = ack.load(Ordering::Relaxed);
    if published > acked {
        // SAFETY: fields of the live record (the caller's promise), read volatile: the kernel
        // wrote them before publishing `flag`, which was read with acquire ordering.
        let (side, value, bound) = unsafe {
            (
                std::ptr::addr_of!((*host).side).read_volatile(),
                std::ptr::addr_of!((*host).value).read_volatile(),
                std::ptr::addr_of!((*host).bound).read_volatile(),
            )
        };
        let count = aborted.load(Ordering::Acquire);
        // The publisher counts itself after publishing: at least one refusal is this record.
        let refused = count.saturating_sub(*reported).max(1);
        *reported = (*reported + refused).max(count);
        ack.store(published, Ordering::Release);
        return Some(refused_message(Some((side, value, bound)), refused));
    }
    let count = aborted.load(Ordering::Acquire);
    if count > *reported {
        let refused = count - *reported;
        *reported = count;
        return Some(refused_message(None, refused));
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_published_record_is_reported_once_with_the_refusals_counted() {
        let mut rec = Box::new(HkvErrorRecord {
            flag: 0,
            value: 77,
            bound: 10,
            side: 1,
            aborted: 0,
            ack: 0,
        });
        // The record is ours alone here (no kernel writes it): `consume` through a unique
        // reference.
        fn take(rec: &mut HkvErrorRecord, reported: &mut u64) -> Option<String> {
            // SAFETY: `rec` is a live, aligned record that nothing else accesses during the call.
            unsafe { consume(rec, reported) }
        }
        let mut reported = 0;
        assert!(take(&mut rec, &mut reported).is_none());
        // Published (generation 1) and counted; a second launch was refused before the host
        // read anything.
        rec.flag = 1;
        rec.aborted = 2;
        let msg = take(&mut rec, &mut reported).unwrap();
        assert!(
            msg.starts_with("device index 77 ") && msg.contains("[0, 10)"),
            "{msg}"
        );
        assert!(msg.contains("2 CUDA transfers were refused"), "{msg}");
        assert_eq!((rec.ack, reported), (1, 2));
        assert!(take(&mut rec, &mut reported).is_none());
        // A launch refused while no record could be claimed is still reported, without details.
        rec.aborted = 3;
        let msg = take(&mut rec, &mut reported).unwrap();
        assert!(msg.starts_with("1 CUDA transfer(s) were refused"), "{msg}");
        assert!(take(&mut rec, &mut reported).is_none());
        // The publisher counts itself after publishing: a record seen before its count is
        // still one refusal, and the late count is not reported twice.
        rec.flag = 2;
        let msg = take(&mut rec, &mut reported).unwrap();
        assert!(msg.starts_with("device index 77 ") && !msg.contains("transfers were"));
        rec.aborted = 4;
        assert!(take(&mut rec, &mut reported).is_none());
    }
}
