//! Whole-array index checks without a branch per element, for the planner's fast path over
//! plain int64 arrays. They only say whether an array passes; the planner's element-wise checks
//! then name the first culprit. The wheel targets baseline x86-64 (SSE2, no 64-bit compares),
//! so where the CPU has AVX2 the same loops are compiled for it and picked at run time.

/// Whether any value lies outside `[0, bound)` (a negative value reads as past any bound).
pub fn any_outside(values: &[i64], bound: u64) -> bool {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU has AVX2, the only feature the function is compiled for.
        return unsafe { avx2::any_outside(values, bound) };
    }
    portable::any_outside(values, bound)
}

/// Whether every page of `p` positions holds a whole page: the host run starts on a multiple
/// of `p`, both runs are consecutive, and the device run ends within `dev_rows`.
pub fn pages_hold(host: &[i64], dev: &[i64], p: usize, dev_rows: u64) -> bool {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: as above.
        return unsafe { avx2::pages_hold(host, dev, p, dev_rows) };
    }
    portable::pages_hold(host, dev, p, dev_rows)
}

mod portable {
    #[inline(always)]
    pub fn any_outside(values: &[i64], bound: u64) -> bool {
        if values.is_empty() {
            return false;
        }
        // Signed min and max reduce in vector registers; an unsigned compare per element does not.
        let (lo, hi) = values
            .iter()
            .fold((i64::MAX, i64::MIN), |(lo, hi), &v| (lo.min(v), hi.max(v)));
        lo < 0 || hi as u64 >= bound
    }

    #[inline(always)]
    pub fn pages_hold(host: &[i64], dev: &[i64], p: usize, dev_rows: u64) -> bool {
        let pu = p as u64;
        let pages = host.len().min(dev.len()) / p;
        // Plain loops: an iterator adapter here is outlined without the caller's AVX2.
        let mut broken = 0i64;
        for k in 0..pages {
            let (h, d) = (&host[k * p..(k + 1) * p], &dev[k * p..(k + 1) * p]);
            let (h0, d0) = (h[0], d[0]);
            if (h0 as u64) % pu != 0 || (d0 as u64).checked_add(pu).is_none_or(|end| end > dev_rows)
            {
                return false;
            }
            for j in 0..p {
                let step = j as i64;
                broken |= (h[j] ^ h0.wrapping_add(step)) | (d[j] ^ d0.wrapping_add(step));
            }
        }
        broken == 0
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    #[target_feature(enable = "avx2")]
    pub unsafe fn any_outside(values: &[i64], bound: u64) -> bool {
        super::portable::any_outside(values, bound)
    }

    #[target_feature(enable = "avx2")]
    pub unsafe fn pages_hold(host: &[i64], dev: &[i64], p: usize, dev_rows: u64) -> bool {
        super::portable::pages_hold(host, dev, p, dev_rows)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn any_outside_finds_negatives_and_values_at_the_bound() {
        let mut values: Vec<i64> = (0..1000).collect();
        assert!(!any_outside(&values, 1000));
        assert!(any_outside(&values, 999));
        values[517] = -1;
        assert!(any_outside(&values, 1 << 40));
        assert!(!any_outside(&[], 0));
        for (dispatched, portable) in [
            (
                any_outside(&values, 1000),
                portable::any_outside(&values, 1000),
            ),
            (
                any_outside(&values[..517], 1000),
                portable::any_outside(&values[..517], 1000),
            ),
        ] {
            assert_eq!(dispatched, portable);
        }
    }

    /// The element-wise rules the planner names culprits by, for comparison.
    fn naive_pages_hold(host: &[i64], dev: &[i64], p: usize, dev_rows: u64) -> bool {
        (0..host.len() / p).all(|k| {
            let (h0, d0) = (host[k * p], dev[k * p]);
            h0 as u64 % p as u64 == 0
                && (d0 as u64)
                    .checked_add(p as u64)
                    .is_some_and(|e| e <= dev_rows)
                && (0..p)
                    .all(|j| host[k * p + j] == h0 + j as i64 && dev[k * p + j] == d0 + j as i64)
        })
    }

    #[test]
    fn scans_agree_with_the_element_wise_rules_on_random_arrays() {
        let mut state = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = move |n: u64| {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (state >> 33) % n
        };
        for _ in 0..2000 {
            let p = [1usize, 2, 4, 16, 64][next(5) as usize];
            let pages = next(6) as usize;
            let mut host = Vec::new();
            let mut dev = Vec::new();
            for _ in 0..pages {
                let (h0, d0) = ((next(40) * p as u64) as i64, next(40 * p as u64) as i64);
                host.extend((0..p as i64).map(|j| h0 + j));
                dev.extend((0..p as i64).map(|j| d0 + j));
            }
            // Break one element now and then: off by one, negative, or huge.
            if !host.is_empty() && next(2) == 0 {
                let (side, at) = (next(2), next(host.len() as u64) as usize);
                let v = [1i64, -1, i64::MIN, 1 << 62][next(4) as usize];
                let target = if side == 0 { &mut host } else { &mut dev };
                target[at] = target[at].wrapping_add(v);
            }
            let rows = next(45 * p as u64);
            assert_eq!(
                pages_hold(&host, &dev, p, rows),
                naive_pages_hold(&host, &dev, p, rows),
                "p={p} rows={rows} host={host:?} dev={dev:?}"
            );
            let bound = next(50 * p as u64);
            let naive = host.iter().any(|&v| v < 0 || v as u64 >= bound);
            assert_eq!(
                any_outside(&host, bound),
                naive,
                "bound={bound} values={host:?}"
            );
        }
    }

    #[test]
    fn pages_hold_checks_alignment_runs_and_the_device_end() {
        let host: Vec<i64> = (64..192).collect();
        let dev: Vec<i64> = (10..138).collect();
        assert!(pages_hold(&host, &dev, 64, 138));
        assert!(
            !pages_hold(&host, &dev, 64, 137),
            "device run past its rows"
        );
        assert!(
            !pages_hold(&host[1..65], &dev[..64], 64, 1000),
            "host run off its page"
        );
        let mut broken = host.clone();
        broken[100] += 1;
        assert!(!pages_hold(&broken, &dev, 64, 1000));
        let mut broken = dev.clone();
        broken[127] = 0;
        assert!(!pages_hold(&host, &broken, 64, 1000));
        assert!(
            !pages_hold(&host, &[i64::MAX; 128], 64, u64::MAX),
            "an end past u64"
        );
        assert!(portable::pages_hold(&host, &dev, 64, 138));
    }
}
