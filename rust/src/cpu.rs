//! CPU copy engine: runs a validated plan with memcpy, on several threads when it is large.
//!
//! The plan has already been checked against both pools (`plan::build`), so this module does no
//! validation; it only decides how to split the bytes.
//!
//! Parallel plans run on a small persistent worker pool (`workers`): starting a thread per call
//! costs tens of microseconds, as much as copying a 256 KiB page. The calling thread always works
//! too and claims chunks dynamically, so a plan finishes even if no worker gets a CPU in time (a
//! busy 2-core machine), and a late worker finds nothing left to do.

use std::sync::atomic::{AtomicUsize, Ordering};

use crate::plan::CopyOp;

/// Below this many bytes one thread is faster, measured with `cargo bench --bench engine --
/// cpu_engine_split` (docs/benchmarks.md): on 2 cores, 256-512 KiB plans took 2x longer split
/// (cache lines of the destination bounce between the cores' L2s and a sleeping worker needs
/// tens of microseconds to start), 1 MiB broke even, 2 MiB ran 1.6x faster.
pub const PARALLEL_THRESHOLD: u64 = 1 << 20;
/// Smallest piece a thread claims at a time: small enough to rebalance when a thread is
/// descheduled, large enough that claiming (one atomic add) and finding the piece stay negligible.
const MIN_CHUNK: u64 = 64 << 10;
/// Chunks per participating thread (more chunks: better balance under interference).
const CHUNKS_PER_THREAD: u64 = 4;

#[inline(always)]
fn overlaps(op: &CopyOp) -> bool {
    op.src < op.dst + op.len && op.dst < op.src + op.len
}

/// Copies `len` bytes of `op` starting `skip` bytes in.
///
/// # Safety
/// Both ranges of `op` must be valid for the copy (guaranteed by `plan::build`).
#[inline(always)]
unsafe fn copy_part(op: &CopyOp, skip: u64, len: u64) {
    let src = (op.src + skip) as *const u8;
    let dst = (op.dst + skip) as *mut u8;
    // A pool copying into itself can overlap; distinct pools never do.
    if overlaps(op) {
        std::ptr::copy(src, dst, len as usize);
    } else {
        std::ptr::copy_nonoverlapping(src, dst, len as usize);
    }
}

/// Runs every copy of `ops` in order on this thread.
///
/// # Safety
/// Every op's source and destination ranges must be valid, as `plan::build` guarantees.
pub unsafe fn execute_serial(ops: &[CopyOp]) {
    for op in ops {
        copy_part(op, 0, op.len);
    }
}

/// Plans of smaller pieces on average split only from `SMALL_PIECE_THRESHOLD`: page_head's
/// 256-byte head pieces ran ~1.4x slower split at 2 MiB (one-page backups) but 1.6x faster at
/// 16-128 MiB (`hostkv-rs bench --quick`); 2 KiB rows gain from 1 MiB.
const MIN_AVG_OP_FOR_SPLIT: u64 = 1024;
const SMALL_PIECE_THRESHOLD: u64 = 4 << 20;

/// Threads that would work on a plan of `total` bytes in `ops` pieces (this thread included).
fn threads_for(total: u64, ops: usize) -> usize {
    let small_pieces = total < MIN_AVG_OP_FOR_SPLIT.saturating_mul(ops as u64);
    if total < PARALLEL_THRESHOLD || (small_pieces && total < SMALL_PIECE_THRESHOLD) {
        return 1;
    }
    workers::max_threads()
}

/// Runs a plan. Large plans are cut into byte windows of the plan's concatenated byte stream,
/// which this thread and the pool's workers claim one at a time.
///
/// # Safety
/// Every op's source and destination ranges must be valid, as `plan::build` guarantees, and no
/// op may write bytes that another op reads (true for two distinct pools; for a pool copying into
/// itself the result is as unspecified as on a GPU).
pub unsafe fn execute(ops: &[CopyOp]) {
    let total: u64 = ops.iter().map(|o| o.len).sum();
    let n = threads_for(total, ops.len());
    // An op whose own source and destination overlap needs memmove semantics over its whole
    // range, which splitting would break.
    if n <= 1 || ops.iter().any(overlaps) {
        execute_serial(ops);
        return;
    }
    let chunk = total.div_ceil(n as u64 * CHUNKS_PER_THREAD).max(MIN_CHUNK);
    let starts = chunk_starts(ops, chunk, total);
    let run = |k: usize| {
        let lo = chunk * k as u64;
        let hi = (lo + chunk).min(total);
        let (first, pos) = starts[k];
        // SAFETY: as for `execute`; the byte windows of different chunks are disjoint.
        unsafe { copy_window(&ops[first..], pos, lo, hi) };
    };
    workers::parallel_for(starts.len(), &run);
}

/// For each chunk `k` (bytes `[k*chunk, (k+1)*chunk)` of the stream), the index of the op holding
/// its first byte and that op's stream offset: one pass, so no chunk rescans the plan.
fn chunk_starts(ops: &[CopyOp], chunk: u64, total: u64) -> Vec<(usize, u64)> {
    let n = total.div_ceil(chunk) as usize;
    let mut out = Vec::with_capacity(n);
    let mut pos = 0u64;
    for (i, op) in ops.iter().enumerate() {
        let end = pos + op.len;
        while out.len() < n && (out.len() as u64) * chunk < end {
            out.push((i, pos));
        }
        pos = end;
    }
    out
}

/// Copies bytes `[lo, hi)` of the stream of `ops`, whose first op starts at stream offset `pos`.
unsafe fn copy_window(ops: &[CopyOp], mut pos: u64, lo: u64, hi: u64) {
    for op in ops {
        let end = pos + op.len;
        if end > lo && pos < hi {
            let a = lo.max(pos);
            let b = hi.min(end);
            copy_part(op, a - pos, b - a);
        }
        if end >= hi {
            break;
        }
        pos = end;
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

    // SAFETY: `task` is `Sync` and is only called under the protocol above.
    unsafe impl Send for Job {}
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
        // SAFETY: pools are leaked, never freed, so a published pointer stays valid.
        if !cur.is_null() && unsafe { (*cur).pid } == pid {
            return unsafe { &*cur };
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

    fn pattern(n: usize, seed: u8) -> Vec<u8> {
        (0..n)
            .map(|i| {
                (i as u32)
                    .wrapping_mul(2654435761)
                    .wrapping_add(seed as u32) as u8
            })
            .collect()
    }

    fn reference(src: &[u8], dst: &mut [u8], ops: &[(usize, usize, usize)]) {
        for &(s, d, l) in ops {
            dst[d..d + l].copy_from_slice(&src[s..s + l]);
        }
    }

    fn run(src: &[u8], dst: &mut [u8], ops: &[(usize, usize, usize)]) {
        let plan: Vec<CopyOp> = ops
            .iter()
            .map(|&(s, d, l)| CopyOp {
                src: src.as_ptr() as u64 + s as u64,
                dst: dst.as_mut_ptr() as u64 + d as u64,
                len: l as u64,
            })
            .collect();
        unsafe { execute(&plan) };
    }

    #[test]
    fn small_plan_matches_reference() {
        let src = pattern(4096, 1);
        let mut a = vec![0u8; 4096];
        let mut b = vec![0u8; 4096];
        let ops = [
            (0, 100, 12),
            (500, 0, 3),
            (1000, 2000, 1000),
            (4000, 4090, 6),
        ];
        reference(&src, &mut a, &ops);
        run(&src, &mut b, &ops);
        assert_eq!(a, b);
    }

    #[test]
    fn large_plan_splits_ops_across_threads_exactly() {
        // ~9 MiB in uneven ops so the thread windows cut through ops.
        let n = 9 << 20;
        let src = pattern(n, 7);
        let mut a = vec![0u8; n];
        let mut b = vec![0u8; n];
        let mut ops = Vec::new();
        let mut pos = 0;
        let mut k = 0;
        while pos < n {
            let len = (1 + (k * 7919) % 300_000).min(n - pos);
            // Reverse placement so source and destination orders differ.
            ops.push((pos, n - pos - len, len));
            pos += len;
            k += 1;
        }
        assert!(threads_for(n as u64, ops.len()) >= 1);
        reference(&src, &mut a, &ops);
        run(&src, &mut b, &ops);
        assert_eq!(a, b);
    }

    #[test]
    fn single_huge_op_is_split() {
        let n = 12 << 20;
        let src = pattern(n, 3);
        let mut dst = vec![0u8; n];
        run(&src, &mut dst, &[(0, 0, n)]);
        assert_eq!(src, dst);
    }

    #[test]
    fn overlapping_op_behaves_as_memmove() {
        let mut buf = pattern(64, 9);
        let expect = {
            let mut e = buf.clone();
            e.copy_within(0..40, 8);
            e
        };
        let base = buf.as_mut_ptr() as u64;
        unsafe {
            execute(&[CopyOp {
                src: base,
                dst: base + 8,
                len: 40,
            }])
        };
        assert_eq!(buf, expect);
    }

    /// Many ops just above the split threshold: chunk windows cut through ops. Tiny pieces stay
    /// on one thread.
    #[test]
    fn plan_just_above_threshold_matches_reference() {
        let n = PARALLEL_THRESHOLD as usize + 12_345;
        assert_eq!(threads_for(n as u64, n / 1500), workers::max_threads());
        assert_eq!(threads_for(n as u64, n / 37), 1);
        assert_eq!(
            threads_for(
                SMALL_PIECE_THRESHOLD,
                (SMALL_PIECE_THRESHOLD / 256) as usize
            ),
            workers::max_threads()
        );
        let src = pattern(n, 5);
        let mut a = vec![0u8; n];
        let mut b = vec![0u8; n];
        let ops: Vec<_> = (0..n / 1500)
            .map(|k| (k * 1500, n - (k + 1) * 1500, 1500))
            .collect();
        reference(&src, &mut a, &ops);
        run(&src, &mut b, &ops);
        assert_eq!(a, b);
    }

    #[test]
    fn chunk_starts_point_at_the_op_holding_each_chunk_start() {
        let ops: Vec<CopyOp> = [10u64, 5, 100, 1, 1, 300]
            .iter()
            .map(|&len| CopyOp {
                src: 0,
                dst: 0,
                len,
            })
            .collect();
        let total: u64 = ops.iter().map(|o| o.len).sum();
        for chunk in [1u64, 7, 50, 64, 417, 1000] {
            let starts = chunk_starts(&ops, chunk, total);
            assert_eq!(starts.len() as u64, total.div_ceil(chunk));
            for (k, &(i, pos)) in starts.iter().enumerate() {
                let byte = k as u64 * chunk;
                assert!(
                    pos <= byte && byte < pos + ops[i].len,
                    "chunk {chunk} k {k}"
                );
                assert_eq!(pos, ops[..i].iter().map(|o| o.len).sum::<u64>());
            }
        }
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
    fn concurrent_callers_each_get_their_bytes() {
        let n = 1 << 20;
        std::thread::scope(|s| {
            for t in 0..4u8 {
                s.spawn(move || {
                    let src = pattern(n, t);
                    for _ in 0..20 {
                        let mut dst = vec![0u8; n];
                        // Reversed 4 KiB blocks, so the plan has many ops.
                        let ops: Vec<_> = (0..n / 4096)
                            .map(|k| (k * 4096, n - (k + 1) * 4096, 4096))
                            .collect();
                        let mut expect = vec![0u8; n];
                        reference(&src, &mut expect, &ops);
                        run(&src, &mut dst, &ops);
                        assert_eq!(dst, expect);
                    }
                });
            }
        });
    }

    #[test]
    fn forked_child_runs_parallel_plans_on_a_fresh_pool() {
        // Start the parent's pool first, so the child inherits one whose threads it lacks.
        let n = 2 << 20;
        let src = pattern(n, 11);
        let mut dst = vec![0u8; n];
        run(&src, &mut dst, &[(0, 0, n)]);
        // SAFETY: the child only copies, compares and exits; glibc keeps malloc usable after fork.
        let pid = unsafe { libc::fork() };
        assert!(pid >= 0);
        if pid == 0 {
            let mut d = vec![0u8; n];
            let ops: Vec<_> = (0..n / 2048)
                .map(|k| (k * 2048, n - (k + 1) * 2048, 2048))
                .collect();
            let mut expect = vec![0u8; n];
            reference(&src, &mut expect, &ops);
            run(&src, &mut d, &ops);
            unsafe { libc::_exit(if d == expect { 0 } else { 1 }) };
        }
        // A child stuck on an inherited lock would hang: give it 20 s.
        let mut status = 0;
        let mut waited = 0;
        loop {
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
        assert_eq!(src, dst);
    }

    #[test]
    fn empty_plan_is_a_no_op() {
        unsafe { execute(&[]) };
        assert_eq!(threads_for(0, 0), 1);
    }
}
