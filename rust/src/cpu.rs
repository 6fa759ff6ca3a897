//! CPU copy engine: runs a validated [`Plan`] with memcpy, on several threads when it is large.
//!
//! The plan has already been checked against both pools (`plan::build`), so this module does no
//! validation beyond what the plan's walk re-checks; it only decides how to split the work. No
//! per-copy list is ever built: each thread walks its share of the plan's units (index
//! positions, or page blocks) and copies as it goes, so the engine's memory is a few hundred
//! bytes of stack per thread (plus one small job record when it runs in parallel), whatever the
//! transfer's size.
//!
//! Parallel plans run on a small persistent worker pool (`workers`): starting a thread per call
//! costs tens of microseconds, as much as copying a 256 KiB page. The calling thread always works
//! too and claims chunks dynamically, so a plan finishes even if no worker gets a CPU in time (a
//! busy 2-core machine), and a late worker finds nothing left to do.

use std::ops::Range;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

use crate::error::{Error, Result};
use crate::plan::{CopyOp, Plan};
use crate::request::DeviceMemory;

/// Below this many bytes one thread is faster, measured with `cargo bench --bench engine --
/// cpu_engine_split` (docs/benchmarks.md): on 2 cores, 256-512 KiB plans took 2x longer split
/// (cache lines of the destination bounce between the cores' L2s and a sleeping worker needs
/// tens of microseconds to start), 1 MiB broke even, 2 MiB ran 1.6x faster.
pub const PARALLEL_THRESHOLD: u64 = 1 << 20;
/// Smallest piece a thread claims at a time: small enough to rebalance when a thread is
/// descheduled, large enough that claiming (one atomic add) stays negligible.
const MIN_CHUNK: u64 = 64 << 10;
/// Chunks per participating thread (more chunks: better balance under interference).
const CHUNKS_PER_THREAD: u64 = 4;

/// Plans of smaller pieces split only from `SMALL_PIECE_THRESHOLD`: page_head's 256-byte head
/// pieces ran ~1.4x slower split at 2 MiB (one-page backups) but 1.6x faster at 16-128 MiB
/// (`hostkv-rs bench --quick`); 2 KiB rows gain from 1 MiB.
const MIN_AVG_OP_FOR_SPLIT: u64 = 1024;
const SMALL_PIECE_THRESHOLD: u64 = 4 << 20;

/// Threads that would work on `total` bytes moved in copies of at least `piece` bytes (this
/// thread included).
fn threads_for(total: u64, piece: u64) -> usize {
    let small_pieces = piece < MIN_AVG_OP_FOR_SPLIT;
    if total < PARALLEL_THRESHOLD || (small_pieces && total < SMALL_PIECE_THRESHOLD) {
        return 1;
    }
    workers::max_threads()
}

fn refuse_device_memory(plan: &Plan<'_>) -> Result<()> {
    match plan.device_memory() {
        DeviceMemory::Host => Ok(()),
        DeviceMemory::Cuda => Err(Error::unsupported(
            "the CPU engine cannot reach CUDA device memory; run the transfer on CUDA",
        )),
    }
}

/// Copies `len` bytes from `src` to `dst`.
///
/// # Safety
/// `[src, src+len)` is readable and `[dst, dst+len)` writable CPU memory that no Rust reference
/// covers; the two may overlap only when `overlap_ok` is set.
#[inline(always)]
unsafe fn copy(op: CopyOp, overlap_ok: bool) {
    let (src, dst, len) = (op.src as *const u8, op.dst as *mut u8, op.len as usize);
    if overlap_ok {
        // SAFETY: the caller's ranges, any overlap allowed (memmove).
        unsafe { std::ptr::copy(src, dst, len) };
        return;
    }
    // Short copies (head segments, small items) go without a libc call: the loads are done
    // before the stores, so even these would be overlap-safe.
    match len {
        16 => {
            // SAFETY: 16 readable bytes at `src`, 16 writable at `dst`; unaligned access.
            unsafe {
                dst.cast::<u128>()
                    .write_unaligned(src.cast::<u128>().read_unaligned())
            }
        }
        8 => {
            // SAFETY: as above, 8 bytes.
            unsafe {
                dst.cast::<u64>()
                    .write_unaligned(src.cast::<u64>().read_unaligned())
            }
        }
        4 => {
            // SAFETY: as above, 4 bytes.
            unsafe {
                dst.cast::<u32>()
                    .write_unaligned(src.cast::<u32>().read_unaligned())
            }
        }
        // SAFETY: the caller's ranges, disjoint.
        _ => unsafe { std::ptr::copy_nonoverlapping(src, dst, len) },
    }
}

/// Plans that move at least this many bytes store with non-temporal (streaming) stores: their
/// destination cannot stay in cache anyway, and an ordinary store first reads each destination
/// line (a read-for-ownership pass the streaming store skips). glibc's memcpy makes the same
/// switch, but only for single copies past ~3/4 of the shared cache, which the plan's pieces
/// never are.
pub const STREAM_PLAN_BYTES: u64 = 2 << 20;
/// Pieces shorter than this keep ordinary stores: their partial lines would cost a full-line
/// write each without the streaming store's benefit.
pub const STREAM_MIN_PIECE: u64 = 256;
/// Pieces scattered over the destination (a load's device rows, a layer-major walk) stream only
/// from this size: 256-byte pieces loaded into scattered rows ran 0.77x with streaming stores
/// (`issue_22_streaming_stores_side_by_side`), while a backup writing the host page in order
/// gains from 256 bytes on.
pub const STREAM_SCATTERED_PIECE: u64 = 1024;

/// How a run of the engine stores its copies.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stores {
    /// Streaming stores for large plans of pieces of at least [`STREAM_MIN_PIECE`] bytes,
    /// ordinary stores otherwise (what `execute` does).
    Auto,
    /// Ordinary stores only (the yardstick the benchmarks compare with).
    Ordinary,
}

/// Copies `len` bytes from `src` to `dst` with streaming stores for the 16-byte-aligned body of
/// the destination and ordinary stores for its unaligned head and tail. The caller issues a
/// store fence before it reports the copies done: streaming stores are weakly ordered, and the
/// Release ordering of that report does not order them.
///
/// # Safety
/// `[src, src+len)` is readable and `[dst, dst+len)` writable CPU memory that no Rust reference
/// covers, and the two do not overlap.
#[cfg(target_arch = "x86_64")]
#[inline]
unsafe fn copy_streaming(src: *const u8, dst: *mut u8, len: usize) {
    use std::arch::x86_64::{__m128i, _mm_loadu_si128, _mm_stream_si128};
    let head = dst.align_offset(16).min(len);
    // SAFETY: the first `head` bytes of the caller's disjoint ranges.
    unsafe { std::ptr::copy_nonoverlapping(src, dst, head) };
    let body = (len - head) & !63;
    let (mut s, mut d) = (src.wrapping_add(head), dst.wrapping_add(head));
    let end = d.wrapping_add(body);
    while d < end {
        // SAFETY: 64 bytes at `s` are readable (inside the caller's source range: `head + body
        // <= len`) and 64 at `d` writable and 16-byte aligned; SSE2 is part of x86_64.
        unsafe {
            let v0 = _mm_loadu_si128(s.cast::<__m128i>());
            let v1 = _mm_loadu_si128(s.add(16).cast::<__m128i>());
            let v2 = _mm_loadu_si128(s.add(32).cast::<__m128i>());
            let v3 = _mm_loadu_si128(s.add(48).cast::<__m128i>());
            _mm_stream_si128(d.cast::<__m128i>(), v0);
            _mm_stream_si128(d.add(16).cast::<__m128i>(), v1);
            _mm_stream_si128(d.add(32).cast::<__m128i>(), v2);
            _mm_stream_si128(d.add(48).cast::<__m128i>(), v3);
            s = s.add(64);
            d = d.add(64);
        }
    }
    // SAFETY: the rest of the caller's ranges (`len - head - body` bytes).
    unsafe { std::ptr::copy_nonoverlapping(s, d, len - head - body) };
}

/// Other architectures keep ordinary stores.
///
/// # Safety
/// As the x86_64 version.
#[cfg(not(target_arch = "x86_64"))]
#[inline]
unsafe fn copy_streaming(src: *const u8, dst: *mut u8, len: usize) {
    // SAFETY: the caller's disjoint ranges.
    unsafe { std::ptr::copy_nonoverlapping(src, dst, len) };
}

/// Orders every streaming store of this thread before what it does next (reporting its chunk
/// done): `sfence`, which ordinary atomics do not imply for streaming stores.
#[inline]
fn fence_streaming_stores() {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: `sfence` has no preconditions (SSE is part of x86_64).
    unsafe {
        std::arch::x86_64::_mm_sfence()
    };
}

/// One contiguous copy with streaming stores, fenced (the benchmarks' NT-copy yardstick).
pub fn copy_streaming_fenced(src: &[u8], dst: &mut [u8]) {
    let len = src.len().min(dst.len());
    // SAFETY: two distinct Rust slices (one shared, one exclusive) cannot overlap; `len` bytes
    // of each are in bounds.
    unsafe { copy_streaming(src.as_ptr(), dst.as_mut_ptr(), len) };
    fence_streaming_stores();
}

/// Copies the walk collects before running them back to back (on the stack: 24 bytes each).
const BATCH: usize = 64;
/// Copies of at most this many bytes that the walk writes in address order run at once (a
/// couple of loads and stores: batching them cost 1.2x on 512 MiB page_first / page_head
/// backups of 16-byte pieces, while batching made the same loads 1.3-1.6x faster).
const SMALL: u64 = 32;

/// Runs the plan's units `units` on this thread. The walk's copies are gathered in small
/// batches: a run of memcpys back to back keeps more cache misses in flight than memcpys
/// interleaved with index arithmetic (measured 1.8x faster for 1 KiB copies to scattered
/// pages). With overlapping pools (a plan that is not `disjoint`) every copy is a memmove and
/// keeps its place in the order.
fn run_units(plan: &Plan<'_>, units: Range<usize>, stores: Stores) -> Result<()> {
    refuse_device_memory(plan)?;
    let overlap_ok = !plan.disjoint();
    let streaming = stores == Stores::Auto
        && !overlap_ok
        && plan.bytes() >= STREAM_PLAN_BYTES
        && (plan.min_piece() >= STREAM_SCATTERED_PIECE
            || (plan.min_piece() >= STREAM_MIN_PIECE && plan.writes_host_in_order()));
    let mut batch = [CopyOp {
        src: 0,
        dst: 0,
        len: 0,
    }; BATCH];
    let mut n = 0;
    // Short copies that land one after another on the host (a backup walked row by row) are
    // cheapest done at once; scattered ones (loads) gain from batching like the rest.
    let small = if plan.writes_host_in_order() {
        SMALL
    } else {
        0
    };
    let run = |ops: &[CopyOp]| {
        for &op in ops {
            // SAFETY: `Plan::walk` emits only copies inside one host plane and one device
            // layer of the request (validated geometry, re-checked indices);
            // `TransferRequest::new` made both valid, readable and writable CPU memory (the
            // device side is host memory: `refuse_device_memory` passed) that no Rust reference
            // covers, for as long as the plan borrows the request. Source and destination
            // overlap only when the plan is not `disjoint`, and then `overlap_ok` is set (and
            // `streaming` is not).
            unsafe {
                if streaming {
                    copy_streaming(op.src as *const u8, op.dst as *mut u8, op.len as usize)
                } else {
                    copy(op, overlap_ok)
                }
            };
        }
    };
    let walked = plan.walk(units, &mut |op| {
        if op.len <= small && !overlap_ok {
            // SAFETY: as in `run` (disjoint copies may run in any order).
            unsafe { copy(op, false) };
            return true;
        }
        batch[n] = op;
        n += 1;
        if n == BATCH {
            run(&batch);
            n = 0;
        }
        true
    });
    run(&batch[..n]);
    if streaming {
        fence_streaming_stores();
    }
    walked
}

/// Runs `plan` on this thread only.
pub fn execute_serial(plan: &Plan<'_>) -> Result<()> {
    run_units(plan, 0..plan.units(), Stores::Auto)
}

/// Runs `plan`. Large plans are cut into ranges of units of about equal bytes, which this thread
/// and the pool's workers claim one at a time. A plan whose pools overlap (not `disjoint`) runs
/// on this thread with `memmove` per copy.
pub fn execute(plan: &Plan<'_>) -> Result<()> {
    execute_with(plan, Stores::Auto)
}

/// [`execute`] with the store policy chosen (benchmarks compare the two).
pub fn execute_with(plan: &Plan<'_>, stores: Stores) -> Result<()> {
    refuse_device_memory(plan)?;
    let total = plan.bytes();
    let units = plan.units();
    let n = threads_for(total, plan.min_piece());
    if n <= 1 || !plan.disjoint() || units < 2 {
        return run_units(plan, 0..units, stores);
    }
    let chunk_bytes = total.div_ceil(n as u64 * CHUNKS_PER_THREAD).max(MIN_CHUNK);
    let unit_bytes = (total / units as u64).max(1);
    run_chunked(plan, (chunk_bytes / unit_bytes).max(1) as usize, stores)
}

/// Runs `plan` in ranges of `per_chunk` units claimed by this thread and the pool's workers
/// (tests force any split through this). Serial, in order, when the plan is not `disjoint`.
#[cfg(test)]
pub(crate) fn execute_chunked(plan: &Plan<'_>, per_chunk: usize) -> Result<()> {
    refuse_device_memory(plan)?;
    if !plan.disjoint() {
        return run_units(plan, 0..plan.units(), Stores::Auto);
    }
    run_chunked(plan, per_chunk.max(1), Stores::Auto)
}

fn run_chunked(plan: &Plan<'_>, per_chunk: usize, stores: Stores) -> Result<()> {
    let units = plan.units();
    let chunks = units.div_ceil(per_chunk);
    // Only an index array changed under the transfer can fail here; the first error wins.
    let failed: Mutex<Option<Error>> = Mutex::new(None);
    let run = |k: usize| {
        let lo = k * per_chunk;
        let hi = (lo + per_chunk).min(units);
        if let Err(e) = run_units(plan, lo..hi, stores) {
            failed
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .get_or_insert(e);
        }
    };
    workers::parallel_for(chunks, &run);
    match failed.into_inner().unwrap_or_else(|p| p.into_inner()) {
        Some(e) => Err(e),
        None => Ok(()),
    }
}

/// A lazily started pool of parked worker threads, rebuilt in a forked child (which inherits the
/// pool's memory but none of its threads, and possibly a lock some worker held at the fork).
pub mod workers {
    use super::{AtomicUsize, Ordering};
    use std::panic::{catch_unwind, AssertUnwindSafe};
    use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicU64};
    use std::sync::{Arc, Mutex, OnceLock};
    use std::thread::Thread;
    use std::time::{Duration, Instant};

    /// Threads working on one job at most, the caller included.
    const MAX_THREADS: usize = 8;

    type Task = dyn Fn(usize) + Sync;

    /// One `parallel_for` call. `task` borrows the caller's stack: it is only called for a claimed
    /// index `< n`, and the caller returns only after every claimed index is done, so a worker
    /// that still holds the job afterwards can never call it.
    struct Job {
        task: *const Task,
        n: usize,
        next: AtomicUsize,
        done: AtomicUsize,
        panicked: AtomicBool,
        /// Woken when a worker finishes the last chunk.
        caller: Thread,
    }

    // SAFETY: the only non-auto-Send field is `task`, a pointer to a `Sync` closure that is
    // called only for a claimed index while its owner waits (see above); sending the job to a
    // worker thread therefore only shares that `Sync` closure.
    unsafe impl Send for Job {}
    // SAFETY: as for `Send`: through `&Job` other threads only call the `Sync` closure (under the
    // claim protocol) and touch atomics.
    unsafe impl Sync for Job {}

    impl Job {
        fn work(&self) {
            loop {
                let k = self.next.fetch_add(1, Ordering::Relaxed);
                if k >= self.n {
                    return;
                }
                // SAFETY: `k < n` was claimed by this thread alone, so the caller is still
                // waiting for it and `task` is alive.
                let task = unsafe { &*self.task };
                if catch_unwind(AssertUnwindSafe(|| task(k))).is_err() {
                    self.panicked.store(true, Ordering::Relaxed);
                }
                if self.done.fetch_add(1, Ordering::Release) + 1 == self.n {
                    self.caller.unpark();
                }
            }
        }
    }

    /// A worker that finished a job busy-polls this long for the next one (a burst of per-layer
    /// loads arrives microseconds apart), then naps in `NAP` steps until `IDLE`, then parks.
    /// A worker woken from a nap or a park needs tens of microseconds here before it copies (a
    /// halted vCPU has to be rescheduled): longer than a whole 1 MiB plan.
    const SPIN: Duration = Duration::from_micros(100);
    const NAP: Duration = Duration::from_micros(50);
    const IDLE: Duration = Duration::from_millis(5);

    struct Pool {
        pid: libc::pid_t,
        helpers: usize,
        /// Bumped (under `slot`) for every job; polled without the lock by awake workers.
        generation: AtomicU64,
        /// Held only to post or take a job (no copy, no Python under it).
        slot: Mutex<Option<Arc<Job>>>,
        /// The workers, for `unpark` (a no-op syscall-free flag for one that is not parked).
        threads: OnceLock<Vec<Thread>>,
    }

    static POOL: AtomicPtr<Pool> = AtomicPtr::new(std::ptr::null_mut());

    fn cpus() -> usize {
        std::thread::available_parallelism().map_or(1, |n| n.get())
    }

    /// Threads a large job may use: the caller plus the pool's helpers.
    pub fn max_threads() -> usize {
        cpus().clamp(1, MAX_THREADS)
    }

    fn lock(pool: &Pool) -> std::sync::MutexGuard<'_, Option<Arc<Job>>> {
        // A poisoned lock only means a thread panicked holding it; the slot is still valid.
        pool.slot.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Waits until `generation` moves past `seen`: spinning, then napping, then parked. A caller
    /// that wants this worker now unparks it (ends a nap or the park at once).
    fn wait_for_job(pool: &Pool, seen: u64) {
        let fresh = || pool.generation.load(Ordering::Acquire) != seen;
        let start = Instant::now();
        while start.elapsed() < SPIN {
            for _ in 0..64 {
                if fresh() {
                    return;
                }
                std::hint::spin_loop();
            }
        }
        // An unpark between a check and the park leaves a token, so no job is missed.
        while !fresh() {
            if start.elapsed() < IDLE {
                std::thread::park_timeout(NAP);
            } else {
                std::thread::park();
            }
        }
    }

    fn worker(pool: &'static Pool) {
        let mut seen = 0u64;
        loop {
            wait_for_job(pool, seen);
            let job = {
                let slot = lock(pool);
                seen = pool.generation.load(Ordering::Acquire);
                slot.clone()
            };
            if let Some(job) = job {
                job.work();
            }
        }
    }

    /// The pool of this process, started on first use (and again after a fork).
    fn pool() -> &'static Pool {
        // SAFETY: getpid has no preconditions.
        let pid = unsafe { libc::getpid() };
        let cur = POOL.load(Ordering::Acquire);
        if !cur.is_null() {
            // SAFETY: pools are leaked, never freed, so a published non-null pointer stays valid
            // for the life of the process.
            let cur: &'static Pool = unsafe { &*cur };
            if cur.pid == pid {
                return cur;
            }
        }
        let fresh: &'static Pool = Box::leak(Box::new(Pool {
            pid,
            helpers: max_threads() - 1,
            generation: AtomicU64::new(0),
            slot: Mutex::new(None),
            threads: OnceLock::new(),
        }));
        let fresh_ptr = fresh as *const Pool as *mut Pool;
        match POOL.compare_exchange(cur, fresh_ptr, Ordering::AcqRel, Ordering::Acquire) {
            Ok(_) => {
                // Only the thread that published the pool starts its workers, so no thread is
                // ever started for a pool that lost the race. An inherited pool (after fork) is
                // leaked untouched: its lock may be held by a thread that does not exist here.
                let threads = (0..fresh.helpers)
                    .filter_map(|i| {
                        std::thread::Builder::new()
                            .name(format!("hostkv-copy-{i}"))
                            .spawn(move || worker(fresh))
                            .ok()
                    })
                    .map(|h| h.thread().clone())
                    .collect();
                let _ = fresh.threads.set(threads);
                fresh
            }
            Err(winner) => {
                // SAFETY: `fresh` was never published and no thread refers to it.
                drop(unsafe { Box::from_raw(fresh_ptr) });
                // SAFETY: as above, a published pool is never freed.
                unsafe { &*winner }
            }
        }
    }

    /// Calls `task(k)` once for every `k` in `0..n`, on this thread and the pool's workers, and
    /// returns when all calls are done. Panics if a call panicked.
    pub fn parallel_for(n: usize, task: &(dyn Fn(usize) + Sync)) {
        let pool = if n > 1 { Some(pool()) } else { None };
        let Some(pool) = pool.filter(|p| p.helpers > 0) else {
            (0..n).for_each(task);
            return;
        };
        // SAFETY: only the lifetime is erased; see `Job` for why it is never outlived.
        let task: *const Task =
            unsafe { std::mem::transmute::<&(dyn Fn(usize) + Sync), &'static Task>(task) };
        let job = Arc::new(Job {
            task,
            n,
            next: AtomicUsize::new(0),
            done: AtomicUsize::new(0),
            panicked: AtomicBool::new(false),
            caller: std::thread::current(),
        });
        {
            let mut slot = lock(pool);
            *slot = Some(job.clone());
            pool.generation.fetch_add(1, Ordering::Release);
        }
        // Cheap for a worker that is spinning (no syscall); a napping or parked one needs tens
        // of microseconds to get a CPU here, so small jobs are mostly done by this thread.
        for t in pool.threads.get().into_iter().flatten().take(n - 1) {
            t.unpark();
        }
        job.work();
        // What is left are chunks a worker claimed and is copying right now. Spin briefly, then
        // sleep: the worker may share this CPU (another process holds the other one), and then
        // spinning would only keep it from finishing.
        let mut spins = 0u32;
        while job.done.load(Ordering::Acquire) < n {
            if spins < 200 {
                std::hint::spin_loop();
                spins += 1;
            } else {
                // Spurious returns (an earlier job's late unpark) just loop.
                std::thread::park_timeout(Duration::from_millis(1));
            }
        }
        if job.panicked.load(Ordering::Relaxed) {
            panic!("a parallel task panicked");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan;
    use crate::request::{
        Backend, DeviceSide, HostGeometry, IndexArray, IndexWidth, Layout, Op, TransferRequest,
    };

    fn pattern(n: usize, seed: u8) -> Vec<u8> {
        (0..n)
            .map(|i| {
                (i as u32)
                    .wrapping_mul(2654435761)
                    .wrapping_add(seed as u32) as u8
            })
            .collect()
    }

    /// A load of one layer_first layer of `item`-byte rows: host row `from[k]` -> device row
    /// `to[k]`, the host plane being `host_len` bytes at `host`, the device layer `dev_len` bytes
    /// at `dev`.
    ///
    /// # Safety
    /// Both ranges and both index slices stay alive, and are touched only through the request,
    /// while it is used.
    #[allow(clippy::too_many_arguments)]
    unsafe fn load(
        host: *mut u8,
        host_len: usize,
        dev: *mut u8,
        dev_len: usize,
        item: usize,
        from: &[i64],
        to: &[i64],
        backend: Backend,
    ) -> TransferRequest {
        let idx = |v: &[i64]| IndexArray {
            ptr: v.as_ptr() as u64,
            len: v.len(),
            width: IndexWidth::I64,
            on_device: false,
            map: crate::request::IndexMap::Identity,
        };
        let geom = HostGeometry {
            layout: Layout::LayerFirst,
            layers: 1,
            rows: host_len / item,
            page_size: 1,
            heads: 1,
            item_bytes: vec![item],
            plane_base: vec![host as u64],
        };
        let device = DeviceSide {
            layer_ptrs: vec![dev as u64],
            rows: dev_len / item,
            row_pitch: None,
            memory: DeviceMemory::Host,
        };
        let op = Op::Load { host_layer: 0 };
        // SAFETY: the caller's promise: the plane, the device layer and the index slices are
        // live and used only through this request.
        unsafe { TransferRequest::new(geom, backend, op, device, idx(from), idx(to)) }
    }

    /// Gathers `src` rows `from[k]` into `dst` rows `to[k]` through the engine (`execute`).
    fn gather(src: &mut [u8], dst: &mut [u8], item: usize, from: &[i64], to: &[i64], b: Backend) {
        let (sl, dl) = (src.len(), dst.len());
        // SAFETY: `src`, `dst` and the index slices are borrowed for this whole function and
        // used only through the request.
        let req = unsafe {
            load(
                src.as_mut_ptr(),
                sl,
                dst.as_mut_ptr(),
                dl,
                item,
                from,
                to,
                b,
            )
        };
        execute(&plan::build(&req).unwrap()).unwrap();
    }

    fn reference(src: &[u8], dst: &mut [u8], item: usize, from: &[i64], to: &[i64]) {
        for (&f, &t) in from.iter().zip(to) {
            let (f, t) = (f as usize * item, t as usize * item);
            dst[t..t + item].copy_from_slice(&src[f..f + item]);
        }
    }

    #[test]
    fn large_plans_split_across_threads_exactly() {
        // 9 MiB of 4 KiB rows in reverse order, and 3-byte rows in a stride permutation: chunk
        // boundaries cut between rows anywhere.
        for (item, rows) in [(4096usize, 2304usize), (3, 3 << 20)] {
            let mut src = pattern(item * rows, 7);
            let mut want = vec![0u8; item * rows];
            let mut got = want.clone();
            let stride = (rows / 2 + 1) | 1;
            let from: Vec<i64> = (0..rows).map(|k| ((k * stride) % rows) as i64).collect();
            let to: Vec<i64> = (0..rows as i64).rev().collect();
            assert_eq!(
                threads_for((item * rows) as u64, item as u64),
                workers::max_threads()
            );
            reference(&src, &mut want, item, &from, &to);
            gather(&mut src, &mut got, item, &from, &to, Backend::Kernel);
            assert!(got == want, "item {item}");
        }
    }

    #[test]
    fn one_long_run_is_split_across_threads() {
        // Direct layer_first, 12 MiB in one run: every chunk copies its own part of it.
        let (item, rows) = (16usize, 786_432usize);
        let mut src = pattern(item * rows, 3);
        let mut dst = vec![0u8; item * rows];
        let all: Vec<i64> = (0..rows as i64).collect();
        gather(&mut src, &mut dst, item, &all, &all, Backend::Direct);
        assert!(src == dst);
    }

    #[test]
    fn overlapping_pools_behave_as_memmove() {
        // The device layer starts 8 bytes into the host plane: one 40-byte run overlapping
        // itself, which must move as memmove would, on one thread.
        let mut buf = pattern(64, 9);
        let expect = {
            let mut e = buf.clone();
            e.copy_within(0..40, 8);
            e
        };
        let base = buf.as_mut_ptr();
        let rows: Vec<i64> = (0..40).collect();
        // SAFETY: both ranges lie in `buf`, which outlives the request and is used only through
        // it; the overlap is allowed.
        let req = unsafe {
            load(
                base,
                40,
                base.wrapping_add(8),
                40,
                1,
                &rows,
                &rows,
                Backend::Direct,
            )
        };
        let p = plan::build(&req).unwrap();
        assert!(!p.disjoint());
        execute(&p).unwrap();
        drop(req);
        assert_eq!(buf, expect);
    }

    #[test]
    fn concurrent_callers_each_get_their_bytes() {
        let (item, rows) = (4096usize, 256usize);
        std::thread::scope(|s| {
            for t in 0..4u8 {
                s.spawn(move || {
                    let mut src = pattern(item * rows, t);
                    let from: Vec<i64> = (0..rows as i64).collect();
                    let to: Vec<i64> = (0..rows as i64).rev().collect();
                    let mut expect = vec![0u8; item * rows];
                    reference(&src, &mut expect, item, &from, &to);
                    for _ in 0..20 {
                        let mut dst = vec![0u8; item * rows];
                        gather(&mut src, &mut dst, item, &from, &to, Backend::Kernel);
                        assert!(dst == expect);
                    }
                });
            }
        });
    }

    #[test]
    fn forked_child_runs_parallel_plans_on_a_fresh_pool() {
        // Start the parent's pool first, so the child inherits one whose threads it lacks.
        let (item, rows) = (2048usize, 1024usize);
        let mut src = pattern(item * rows, 11);
        let mut dst = vec![0u8; item * rows];
        let all: Vec<i64> = (0..rows as i64).collect();
        gather(&mut src, &mut dst, item, &all, &all, Backend::Kernel);
        assert!(src == dst);
        // SAFETY: the child only copies, compares and exits; glibc keeps malloc usable after fork.
        let pid = unsafe { libc::fork() };
        assert!(pid >= 0);
        if pid == 0 {
            let rev: Vec<i64> = (0..rows as i64).rev().collect();
            let mut d = vec![0u8; item * rows];
            let mut expect = vec![0u8; item * rows];
            reference(&src, &mut expect, item, &all, &rev);
            gather(&mut src, &mut d, item, &all, &rev, Backend::Kernel);
            // SAFETY: ends the child at once.
            unsafe { libc::_exit(if d == expect { 0 } else { 1 }) };
        }
        // A child stuck on an inherited lock would hang: give it 20 s.
        let mut status = 0;
        let mut waited = 0;
        loop {
            // SAFETY: polls our own child.
            let r = unsafe { libc::waitpid(pid, &mut status, libc::WNOHANG) };
            if r == pid {
                break;
            }
            assert!(waited < 2000, "forked child did not finish");
            std::thread::sleep(std::time::Duration::from_millis(10));
            waited += 1;
        }
        assert!(
            libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0,
            "{status}"
        );
    }

    #[test]
    fn empty_plan_is_a_no_op() {
        let mut src = [1u8; 16];
        let mut dst = [2u8; 16];
        gather(&mut src, &mut dst, 4, &[], &[], Backend::Kernel);
        assert_eq!(dst, [2u8; 16]);
    }

    #[test]
    fn parallel_for_runs_every_index_once() {
        use std::sync::atomic::AtomicU32;
        for n in [0usize, 1, 2, 3, 17, 200] {
            let hits: Vec<AtomicU32> = (0..n).map(|_| AtomicU32::new(0)).collect();
            workers::parallel_for(n, &|k| {
                hits[k].fetch_add(1, Ordering::Relaxed);
            });
            assert!(hits.iter().all(|h| h.load(Ordering::Relaxed) == 1), "{n}");
        }
    }

    #[test]
    fn thread_count_follows_bytes_and_piece_size() {
        let n = PARALLEL_THRESHOLD + 12_345;
        assert_eq!(threads_for(n, 1500), workers::max_threads());
        assert_eq!(threads_for(n, 37), 1);
        assert_eq!(threads_for(PARALLEL_THRESHOLD - 1, 1 << 20), 1);
        assert_eq!(
            threads_for(SMALL_PIECE_THRESHOLD, 256),
            workers::max_threads()
        );
        assert_eq!(threads_for(0, 0), 1);
    }
}
