//! The process-wide error record the kernels write a bad device-resident index into: pinned,
//! device-mapped host memory, so the host reads it without synchronising the stream.

use std::ffi::c_void;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

use cudarc::driver::sys;

use super::driver::check;
use super::params::{bad_index_message, HkvErrorRecord, FLAG_PUBLISHED};
use crate::error::{Error, Result};

struct Record {
    host: usize,
}

static RECORD: Mutex<Option<Record>> = Mutex::new(None);
/// Launch sequence numbers for the abort ring; 0 means "no index check for this launch".
static SEQ: AtomicU64 = AtomicU64::new(1);

pub(crate) fn next_seq() -> u64 {
    SEQ.fetch_add(1, Ordering::Relaxed)
}

fn host_ptr() -> Result<*mut HkvErrorRecord> {
    let mut guard = RECORD.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(r) = guard.as_ref() {
        return Ok(r.host as *mut HkvErrorRecord);
    }
    let mut p: *mut c_void = std::ptr::null_mut();
    let bytes = std::mem::size_of::<HkvErrorRecord>();
    // SAFETY: valid out-pointer; PORTABLE makes the record usable from every context, DEVICEMAP
    // lets kernels write it.
    check(
        unsafe {
            sys::cuMemHostAlloc(
                &mut p,
                bytes,
                sys::CU_MEMHOSTALLOC_PORTABLE | sys::CU_MEMHOSTALLOC_DEVICEMAP,
            )
        },
        "cuMemHostAlloc (error record)",
    )?;
    // SAFETY: freshly allocated, `bytes` long.
    unsafe { std::ptr::write_bytes(p.cast::<u8>(), 0, bytes) };
    *guard = Some(Record { host: p as usize });
    Ok(p.cast())
}

/// Device address of the record in the current context.
pub(crate) fn device_ptr() -> Result<u64> {
    let host = host_ptr()?;
    let mut d: sys::CUdeviceptr = 0;
    // SAFETY: `host` is a live cuMemHostAlloc(DEVICEMAP) allocation.
    check(
        unsafe { sys::cuMemHostGetDevicePointer_v2(&mut d, host.cast(), 0) },
        "cuMemHostGetDevicePointer (error record)",
    )?;
    Ok(d)
}

/// Reports (and clears) a bad index recorded by a kernel, once the kernel has published it.
pub(crate) fn take() -> Result<()> {
    let host = {
        let guard = RECORD.lock().unwrap_or_else(|p| p.into_inner());
        match guard.as_ref() {
            None => return Ok(()),
            Some(r) => r.host as *mut HkvErrorRecord,
        }
    };
    // SAFETY: the record lives for the whole process.
    unsafe { take_from(host) }
}

/// # Safety
/// `host` points at a live, 8-byte aligned record that kernels may be writing concurrently.
unsafe fn take_from(host: *mut HkvErrorRecord) -> Result<()> {
    // `flag` is read with acquire ordering, so the fields a kernel wrote before publishing the
    // record (fields, system fence, then flag = PUBLISHED) are read whole.
    let flag = &*(std::ptr::addr_of!((*host).flag) as *const AtomicU64);
    if flag.load(Ordering::Acquire) != FLAG_PUBLISHED {
        // 0: nothing to report; CLAIMED: a kernel is still filling it in (reported later).
        return Ok(());
    }
    let side = std::ptr::addr_of!((*host).side).read_volatile();
    let value = std::ptr::addr_of!((*host).value).read_volatile();
    let bound = std::ptr::addr_of!((*host).bound).read_volatile();
    // Only one caller reports a given record (two Python threads may ask at once).
    if flag
        .compare_exchange(FLAG_PUBLISHED, 0, Ordering::AcqRel, Ordering::Acquire)
        .is_err()
    {
        return Ok(());
    }
    Err(Error::InvalidTransfer(bad_index_message(
        side, value, bound,
    )))
}

#[cfg(test)]
mod tests {
    use super::super::params::ABORT_RING;
    use super::*;

    #[test]
    fn only_a_published_record_is_reported_and_only_once() {
        let mut rec = Box::new(HkvErrorRecord {
            flag: 1,
            value: 77,
            bound: 10,
            side: 1,
            abort_ring: [0; ABORT_RING],
        });
        let p: *mut HkvErrorRecord = &mut *rec;
        // Claimed by a kernel that has not finished writing: not reported, not cleared.
        assert!(unsafe { take_from(p) }.is_ok());
        assert_eq!(unsafe { (*p).flag }, 1);
        unsafe { (*p).flag = FLAG_PUBLISHED };
        let e = unsafe { take_from(p) }.unwrap_err();
        assert!(matches!(e, Error::InvalidTransfer(_)));
        assert!(
            e.to_string().starts_with("device index 77 ") && e.to_string().contains("[0, 10)"),
            "{e}"
        );
        assert_eq!(unsafe { (*p).flag }, 0);
        assert!(unsafe { take_from(p) }.is_ok());
    }
}
