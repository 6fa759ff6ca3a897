//! Pinning host memory: `cuMemHostRegister(PORTABLE | DEVICEMAP)` in chunks that never split a
//! copy unit (each chunk is a whole multiple of the granularity), in parallel threads for large
//! regions, rolled back completely when any chunk fails.

use std::sync::Mutex;
use std::time::Instant;

use cudarc::driver::sys;

use super::driver::{as_void, code, error_string};
use super::probe;
use crate::error::{Error, Result};

/// Regions at least this large are registered from several threads (pinning is dominated by
/// the kernel walking and locking pages, which scales with threads).
const PARALLEL_BYTES: usize = 4 << 30;
const MAX_THREADS: usize = 8;

/// Chunk boundaries `(offset, size)` for `len` bytes.
pub(crate) fn chunks(
    len: usize,
    granularity: usize,
    chunk_limit: usize,
) -> Result<Vec<(usize, usize)>> {
    if granularity == 0 {
        // Legacy behaviour: one registration of the whole buffer.
        return Ok(if len == 0 { Vec::new() } else { vec![(0, len)] });
    }
    if granularity > chunk_limit {
        return Err(Error::Unsupported(format!(
            "Host registration granularity exceeds the configured chunk limit: \
             granularity={granularity}, chunk_limit={chunk_limit}"
        )));
    }
    let chunk = chunk_limit / granularity * granularity;
    let mut out = Vec::with_capacity(len.div_ceil(chunk));
    let mut off = 0;
    while off < len {
        let size = chunk.min(len - off);
        out.push((off, size));
        off += size;
    }
    Ok(out)
}

fn register_one(ptr: u64, size: usize) -> i32 {
    let flags = sys::CU_MEMHOSTREGISTER_PORTABLE | sys::CU_MEMHOSTREGISTER_DEVICEMAP;
    // SAFETY: the caller owns `[ptr, ptr+size)` (a live mapping) for the registration's life.
    code(unsafe { sys::cuMemHostRegister_v2(as_void(ptr), size, flags) })
}

fn unregister_one(ptr: u64) {
    // SAFETY: `ptr` is the base of a range this module registered.
    let _ = unsafe { sys::cuMemHostUnregister(as_void(ptr)) };
}

type Share<'a> = Mutex<Option<(usize, &'a mut [i32])>>;

fn take_share<'a>(cell: &Share<'a>) -> Option<(usize, &'a mut [i32])> {
    // Taking a share cannot panic halfway, so a poisoned lock still holds valid data.
    cell.lock().unwrap_or_else(|p| p.into_inner()).take()
}

/// Registers every chunk; returns each chunk's result code, in chunk order, and the number of
/// threads used. `ctx` is current on the calling thread; helper threads make it current too.
/// `PARALLEL_BYTES`, or `HOSTKV_REGISTER_PARALLEL_BYTES` (lets tests exercise the threaded path
/// on small regions).
fn parallel_bytes() -> usize {
    std::env::var("HOSTKV_REGISTER_PARALLEL_BYTES")
        .ok()
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(PARALLEL_BYTES)
}

fn register_chunks(
    ctx: sys::CUcontext,
    ptr: u64,
    parts: &[(usize, usize)],
    len: usize,
) -> (Vec<i32>, usize) {
    let threads = if len >= parallel_bytes() && parts.len() > 1 {
        std::thread::available_parallelism()
            .map_or(1, |n| n.get())
            .min(MAX_THREADS)
            .min(parts.len())
    } else {
        1
    };
    let mut rcs = vec![0i32; parts.len()];
    let fill = |first: usize, slots: &mut [i32]| {
        for (k, rc) in slots.iter_mut().enumerate() {
            let (o, s) = parts[first + k];
            *rc = register_one(ptr + o as u64, s);
        }
    };
    if threads <= 1 {
        fill(0, &mut rcs);
        return (rcs, 1);
    }
    let ctx_addr = ctx as usize;
    let per = parts.len().div_ceil(threads);
    let fill = &fill;
    // Each share sits in a cell so that a share whose thread could not be spawned is done on
    // this thread instead (a failed spawn must not panic, nor leave chunks unregistered).
    let shares: Vec<Share> = rcs
        .chunks_mut(per)
        .enumerate()
        .map(|(t, slots)| Mutex::new(Some((t * per, slots))))
        .collect();
    let mut spawned = 0;
    std::thread::scope(|scope| {
        for cell in &shares {
            let worker = move || {
                // SAFETY: the context stays alive (primary or caller's) for the whole call.
                let set = code(unsafe { sys::cuCtxSetCurrent(ctx_addr as sys::CUcontext) });
                if let Some((first, slots)) = take_share(cell) {
                    if set != 0 {
                        slots.iter_mut().for_each(|rc| *rc = set);
                    } else {
                        fill(first, slots);
                    }
                }
            };
            match std::thread::Builder::new()
                .name("hostkv-register".into())
                .spawn_scoped(scope, worker)
            {
                Ok(_) => spawned += 1,
                Err(_) => {
                    if let Some((first, slots)) = take_share(cell) {
                        fill(first, slots);
                    }
                }
            }
        }
    });
    drop(shares);
    (rcs, spawned.max(1))
}

pub(crate) fn register(
    ptr: u64,
    len: usize,
    granularity: usize,
    chunk_limit: usize,
) -> Result<Vec<(u64, usize)>> {
    let parts = chunks(len, granularity, chunk_limit)?;
    if parts.is_empty() {
        return Ok(Vec::new());
    }
    probe::ready()?;
    // PORTABLE registrations belong to every context: any current one will do.
    let scope = probe::bind_context(None)?;
    let start = Instant::now();
    let (rcs, threads) = register_chunks(scope.ctx(), ptr, &parts, len);
    if let Some(bad) = rcs.iter().position(|&rc| rc != 0) {
        for (&(o, _), _) in parts.iter().zip(&rcs).filter(|(_, &rc)| rc == 0).rev() {
            unregister_one(ptr + o as u64);
        }
        let (offset, size) = parts[bad];
        let rc = rcs[bad];
        let chunk_bytes = parts[0].1;
        return Err(Error::Cuda(format!(
            "cudaHostRegister failed (rc={rc}, {}) at offset={offset} size={size} \
             (total={len}, chunk_limit={chunk_bytes}); host buffer is not pinned and device \
             transfers may silently return stale data.",
            error_string(rc)
        )));
    }
    if std::env::var_os("HOSTKV_LOG_REGISTER").is_some() {
        let secs = start.elapsed().as_secs_f64();
        eprintln!(
            "hostkv_rs: registered {len} bytes in {} chunk(s) on {threads} thread(s) in {secs:.3} s \
             ({:.2} GB/s)",
            parts.len(),
            len as f64 / secs.max(1e-9) / 1e9
        );
    }
    Ok(parts.iter().map(|&(o, s)| (ptr + o as u64, s)).collect())
}

pub(crate) fn unregister(ranges: &[(u64, usize)]) {
    // A forked child must not call into CUDA; its parent's registrations are not its own.
    if ranges.is_empty() || !probe::initialised_here() {
        return;
    }
    // A copy or kernel still queued on any stream may read or write this memory: let it finish
    // before the pages are unpinned (and, on drop, unmapped). Pool destruction is rare; a
    // device fault from a DMA into unmapped memory would end the process.
    probe::drain_active_devices();
    let Ok(_scope) = probe::bind_context(None) else {
        return;
    };
    for &(p, _) in ranges.iter().rev() {
        unregister_one(p);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunks_are_whole_multiples_of_the_granularity() {
        let g = 3 << 20;
        let parts = chunks(100 << 20, g, 16 << 20).unwrap();
        let chunk = (16 << 20) / g * g;
        assert_eq!(parts[0], (0, chunk));
        assert!(parts.iter().all(|&(o, _)| o % g == 0));
        assert!(parts[..parts.len() - 1].iter().all(|&(_, s)| s == chunk));
        assert_eq!(parts.iter().map(|p| p.1).sum::<usize>(), 100 << 20);
        assert!(parts.windows(2).all(|w| w[0].0 + w[0].1 == w[1].0));
    }

    #[test]
    fn no_granularity_is_one_registration() {
        assert_eq!(chunks(5 << 30, 0, 1 << 30).unwrap(), vec![(0, 5 << 30)]);
        assert!(chunks(0, 0, 1 << 30).unwrap().is_empty());
    }

    #[test]
    fn granularity_above_the_limit_is_refused_with_sglangs_text() {
        let e = chunks(1 << 30, 3 << 20, 2 << 20).unwrap_err();
        assert_eq!(
            e.to_string(),
            "Host registration granularity exceeds the configured chunk limit: \
             granularity=3145728, chunk_limit=2097152"
        );
        assert!(matches!(e, Error::Unsupported(_)));
    }
}
