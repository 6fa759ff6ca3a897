//! Pinning host memory: `cuMemHostRegister(PORTABLE | DEVICEMAP)` in chunks of at most the
//! chunk limit that never split a copy unit (each chunk is a whole multiple of the granularity,
//! or of 4 KiB when none is given), in parallel threads for large regions. A chunk the driver
//! refuses is retried in halves (still whole copy units) down to one copy unit: single huge
//! registrations fail intermittently on a GPU whose memory is full, which is exactly when a host
//! pool is built. If a piece of one copy unit still fails, everything is rolled back. Every chunk
//! is recorded with its device (`registry`), and unpinned with that device current.

use std::ffi::c_int;
use std::sync::Mutex;
use std::time::Instant;

use cudarc::driver::sys;

use super::driver::{as_void, code, error_string};
use super::probe;
use super::registry::{self, Chunk};
use crate::error::{Error, Result};

/// Regions at least this large are registered from several threads (pinning is dominated by
/// the kernel walking and locking pages, which scales with threads).
const PARALLEL_BYTES: usize = 4 << 30;
const MAX_THREADS: usize = 8;
/// Copy unit when the pool gives none (layer_first pools): chunks stay page-aligned.
const DEFAULT_UNIT: usize = 4096;
/// `CUDA_ERROR_INVALID_VALUE` and `CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED`: smaller pieces
/// would fail the same way, so these are not retried.
const NOT_RETRIED: [i32; 2] = [1, 712];

/// The copy unit chunks are whole multiples of.
fn unit_of(granularity: usize, chunk_limit: usize) -> usize {
    if granularity == 0 {
        DEFAULT_UNIT.min(chunk_limit).max(1)
    } else {
        granularity
    }
}

/// Chunk boundaries `(offset, size)` for `len` bytes: every chunk but the last is the largest
/// multiple of the copy unit not above `chunk_limit` (granularity 0: a 4 KiB unit).
pub(crate) fn chunks(
    len: usize,
    granularity: usize,
    chunk_limit: usize,
) -> Result<Vec<(usize, usize)>> {
    if granularity > chunk_limit || chunk_limit == 0 {
        return Err(Error::unsupported(format!(
            "Host registration granularity exceeds the configured chunk limit: \
             granularity={granularity}, chunk_limit={chunk_limit}"
        )));
    }
    let unit = unit_of(granularity, chunk_limit);
    let chunk = chunk_limit / unit * unit;
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
    // SAFETY: `[ptr, ptr+size)` is a chunk of the range `register`'s caller keeps mapped until
    // it is unregistered; the driver only pins it (or refuses).
    code(unsafe { sys::cuMemHostRegister_v2(as_void(ptr), size, flags) })
}

fn unregister_one(ptr: u64) {
    // SAFETY: `ptr` is the base of a range this module registered.
    let _ = unsafe { sys::cuMemHostUnregister(as_void(ptr)) };
}

/// A chunk that could not be registered even in pieces of one copy unit.
#[derive(Clone, Copy, Debug)]
struct Failed {
    offset: usize,
    size: usize,
    rc: i32,
}

/// What registering one chunk gave: the pieces registered (in address order), and the piece that
/// failed for good, if any (then the pieces after it were not tried).
#[derive(Default)]
struct Outcome {
    pieces: Vec<(usize, usize)>,
    failed: Option<Failed>,
}

/// Registers `[off, off+size)`; a refused piece larger than one unit is retried as two halves.
fn register_halving(ptr: u64, off: usize, size: usize, unit: usize, out: &mut Outcome) -> bool {
    let rc = register_one(ptr + off as u64, size);
    if rc == 0 {
        out.pieces.push((off, size));
        return true;
    }
    if size <= unit || NOT_RETRIED.contains(&rc) {
        out.failed = Some(Failed {
            offset: off,
            size,
            rc,
        });
        return false;
    }
    let first = (size.div_ceil(unit) / 2).max(1) * unit;
    eprintln!(
        "hostkv_rs: cudaHostRegister of {size} bytes at offset {off} failed (rc={rc}, {}); \
         retrying as {first} + {} bytes",
        error_string(rc),
        size - first
    );
    register_halving(ptr, off, first, unit, out)
        && register_halving(ptr, off + first, size - first, unit, out)
}

type Share<'a> = Mutex<Option<(usize, &'a mut [Outcome])>>;

fn take_share<'a>(cell: &Share<'a>) -> Option<(usize, &'a mut [Outcome])> {
    // Taking a share cannot panic halfway, so a poisoned lock still holds valid data.
    cell.lock().unwrap_or_else(|p| p.into_inner()).take()
}

/// Registers every chunk (halving refused ones); returns each chunk's outcome, in chunk order,
/// and the number of threads used. `ctx` is current on the calling thread; helper threads make
/// it current too.
fn register_chunks(
    ctx: sys::CUcontext,
    ptr: u64,
    parts: &[(usize, usize)],
    len: usize,
    unit: usize,
    parallel_from: usize,
) -> (Vec<Outcome>, usize) {
    let threads = if len >= parallel_from && parts.len() > 1 {
        std::thread::available_parallelism()
            .map_or(1, |n| n.get())
            .min(MAX_THREADS)
            .min(parts.len())
    } else {
        1
    };
    let mut outcomes: Vec<Outcome> = parts.iter().map(|_| Outcome::default()).collect();
    let fill = |first: usize, slots: &mut [Outcome]| {
        for (k, out) in slots.iter_mut().enumerate() {
            let (o, s) = parts[first + k];
            register_halving(ptr, o, s, unit, out);
        }
    };
    if threads <= 1 {
        fill(0, &mut outcomes);
        return (outcomes, 1);
    }
    let ctx_addr = ctx as usize;
    let per = parts.len().div_ceil(threads);
    let fill = &fill;
    // Each share sits in a cell so that a share whose thread could not be spawned is done on
    // this thread instead (a failed spawn must not panic, nor leave chunks unregistered).
    let shares: Vec<Share> = outcomes
        .chunks_mut(per)
        .enumerate()
        .map(|(t, slots)| Mutex::new(Some((t * per, slots))))
        .collect();
    let mut spawned = 0;
    std::thread::scope(|scope| {
        for cell in &shares {
            let worker = move || {
                // A new thread starts in global capture mode: pin in relaxed mode, as the
                // calling thread does.
                let _relaxed = super::driver::RelaxedCapture::enter();
                // SAFETY: the context stays alive (primary or caller's) for the whole call.
                let set = code(unsafe { sys::cuCtxSetCurrent(ctx_addr as sys::CUcontext) });
                if let Some((first, slots)) = take_share(cell) {
                    if set != 0 {
                        for (k, out) in slots.iter_mut().enumerate() {
                            let (offset, size) = parts[first + k];
                            out.failed = Some(Failed {
                                offset,
                                size,
                                rc: set,
                            });
                        }
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
    (outcomes, spawned.max(1))
}

/// Pins `[ptr, ptr+len)` in chunks and records them in the registry.
///
/// # Safety
/// As for `cuda::register_host`: a live mapping of the caller's that stays mapped (and is not
/// registered by anyone else) until it is unregistered.
pub(crate) unsafe fn register(
    ptr: u64,
    len: usize,
    granularity: usize,
    chunk_limit: usize,
    device: Option<c_int>,
) -> Result<Vec<(u64, usize)>> {
    let parts = chunks(len, granularity, chunk_limit)?;
    if parts.is_empty() {
        return Ok(Vec::new());
    }
    let parallel_from = crate::config::register_parallel_bytes(PARALLEL_BYTES)?;
    probe::ready()?;
    // The device the caller names (the pool's GPU, as SGLang registers on torch's current
    // device), else the thread's current context, else device 0's primary context. PORTABLE
    // registrations belong to every context; the device is recorded so the range is unpinned
    // with the same device current, never by creating a context on another GPU.
    let scope = match device {
        Some(ordinal) => probe::bind_device(ordinal)?,
        None => probe::bind_context(None)?,
    };
    let device: c_int = probe::current_device()?;
    let unit = unit_of(granularity, chunk_limit);
    let start = Instant::now();
    let (outcomes, threads) = register_chunks(scope.ctx(), ptr, &parts, len, unit, parallel_from);
    let pieces: Vec<(usize, usize)> = outcomes
        .iter()
        .flat_map(|o| o.pieces.iter().copied())
        .collect();
    if let Some(bad) = outcomes.iter().find_map(|o| o.failed) {
        for &(o, _) in pieces.iter().rev() {
            unregister_one(ptr + o as u64);
        }
        let chunk_bytes = parts[0].1;
        return Err(Error::cuda(format!(
            "cudaHostRegister failed (rc={}, {}) at offset={} size={} (total={len}, \
             chunk_limit={chunk_bytes}); host buffer is not pinned and device transfers may \
             silently return stale data.",
            bad.rc,
            error_string(bad.rc),
            bad.offset,
            bad.size
        )));
    }
    if crate::config::log_register() {
        let secs = start.elapsed().as_secs_f64();
        eprintln!(
            "hostkv_rs: registered {len} bytes in {} chunk(s) on {threads} thread(s) in {secs:.3} s \
             ({:.2} GB/s), device {device}",
            pieces.len(),
            len as f64 / secs.max(1e-9) / 1e9
        );
    }
    registry::insert(
        pieces
            .iter()
            .map(|&(o, s)| Chunk {
                base: ptr + o as u64,
                len: s,
                device,
            })
            .collect(),
    );
    Ok(pieces.iter().map(|&(o, s)| (ptr + o as u64, s)).collect())
}

/// Unpins ranges returned by `register`, after the work queued on them has finished (bounded
/// wait: see `registry::remove`). Blocks: call without the GIL.
pub(crate) fn unregister(ranges: &[(u64, usize)]) -> Result<()> {
    // A forked child must not call into CUDA; its parent's registrations are not its own.
    if ranges.is_empty() || !probe::initialised_here() {
        return Ok(());
    }
    registry::remove(ranges[0].0)
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
    fn without_a_granularity_chunks_are_capped_and_page_aligned() {
        // Before: one registration of the whole region, whatever its size.
        let parts = chunks(5 << 30, 0, 1 << 30).unwrap();
        assert_eq!(parts.len(), 5);
        assert!(parts.iter().all(|&(o, s)| s == 1 << 30 && o % 4096 == 0));
        let parts = chunks(10 << 20, 0, (3 << 20) + 100).unwrap();
        assert!(parts
            .iter()
            .all(|&(o, s)| o % 4096 == 0 && s <= (3 << 20) + 100));
        assert_eq!(parts.iter().map(|p| p.1).sum::<usize>(), 10 << 20);
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
        assert!(matches!(
            e,
            Error::Layout(crate::error::LayoutError::Unsupported(_))
        ));
    }
}
