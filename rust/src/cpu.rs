//! CPU copy engine: runs a validated plan with memcpy, on several threads when it is large.
//!
//! The plan has already been checked against both pools (`plan::build`), so this module does no
//! validation; it only decides how to split the bytes.

use crate::plan::CopyOp;

/// Below this many bytes one thread is faster than spawning helpers (a thread costs ~20 us).
pub const PARALLEL_THRESHOLD: u64 = 4 << 20;
/// Each helper thread gets at least this much work.
const MIN_BYTES_PER_THREAD: u64 = 2 << 20;
const MAX_THREADS: usize = 8;

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

fn threads_for(total: u64) -> usize {
    if total < PARALLEL_THRESHOLD {
        return 1;
    }
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    cpus.min(MAX_THREADS)
        .min((total / MIN_BYTES_PER_THREAD) as usize)
        .max(1)
}

/// Runs a plan. Large plans are split by bytes across threads: thread `k` copies bytes
/// `[k*T/n, (k+1)*T/n)` of the plan's concatenated byte stream.
///
/// # Safety
/// Every op's source and destination ranges must be valid, as `plan::build` guarantees, and no
/// op may write bytes that another op reads (true for two distinct pools; for a pool copying into
/// itself the result is as unspecified as on a GPU).
pub unsafe fn execute(ops: &[CopyOp]) {
    let total: u64 = ops.iter().map(|o| o.len).sum();
    let n = threads_for(total);
    // An op whose own source and destination overlap needs memmove semantics over its whole
    // range, which splitting would break.
    if n <= 1 || ops.iter().any(overlaps) {
        execute_serial(ops);
        return;
    }
    let share = total.div_ceil(n as u64);
    std::thread::scope(|s| {
        for k in 1..n {
            let (lo, hi) = (
                (share * k as u64).min(total),
                (share * (k as u64 + 1)).min(total),
            );
            // SAFETY: as for `execute`; the byte windows of different threads are disjoint.
            let spawned = std::thread::Builder::new()
                .spawn_scoped(s, move || unsafe { copy_window(ops, lo, hi) });
            if spawned.is_err() {
                // No thread available (resource limits): do that window here instead.
                copy_window(ops, lo, hi);
            }
        }
        copy_window(ops, 0, share.min(total));
    });
}

/// Copies bytes `[lo, hi)` of the plan's concatenated stream.
unsafe fn copy_window(ops: &[CopyOp], lo: u64, hi: u64) {
    let mut pos = 0u64;
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
        assert!(threads_for(n as u64) >= 1);
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

    #[test]
    fn empty_plan_is_a_no_op() {
        unsafe { execute(&[]) };
        assert_eq!(threads_for(0), 1);
    }
}
