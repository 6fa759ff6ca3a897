//! How a transfer reads an index array: which elements, and what each value becomes. SGLang
//! translates indices before its copies in three places; here the planner, the CPU engine and the
//! kernels apply the translation while they read, so no translated copy is ever built:
//!
//! - DCP (MLA with `dcp_size > 1`): this rank's physical slots of widened logical slots,
//!   `idx[rank::size] // size` (`maybe_dcp_kernel_indices`).
//! - V4 page rows: one row per whole page, `idx[::P] // P` (the first token of each page).
//! - V4 C4 tokens: a token's 576-byte value and 8-byte scale inside its page row, as rows of
//!   576-byte and 8-byte units ([`crate::pool::c4`]).
//!
//! Position `i` of a mapped array reads raw element `offset + i * stride` and maps its value `t`
//! to `floor(t / div) * mul + (t mod div) * rem_mul + add` (floor division: a negative index
//! stays negative, and is refused as one). A result past `i64` saturates to `i64::MAX`, which
//! every bound refuses.

use crate::error::{Error, Result};
use crate::pool::c4;

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum IndexMap {
    /// Every element, unchanged.
    #[default]
    Identity,
    /// `idx[rank::size] // size` over whole widened pages (SGLang 0.5.18-0.5.19 assert that the
    /// array holds a multiple of `size` slots).
    Dcp { size: u32, rank: u32 },
    /// `idx[rank::size] // size` over any number of slots (SGLang 0.5.20+, which slices without
    /// the assert: the rank's share of a short run is what the slice holds).
    DcpShare { size: u32, rank: u32 },
    /// `idx[::page] // page`: one page row per whole page of token slots.
    PageRows { page: u32 },
    /// C4 token -> its value, a row of 576-byte units.
    C4Value,
    /// C4 token -> its scale, a row of 8-byte units.
    C4Scale,
}

/// An [`IndexMap`] as arithmetic: what the planner applies and, field for field, the kernels'
/// `HkvIndexMap` (rust/kernels/hostkv_transfer.cu; a test compares the layouts).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MapParams {
    pub offset: u64,
    pub stride: u64,
    pub div: i64,
    pub mul: i64,
    pub rem_mul: i64,
    pub add: i64,
    /// Page rows: every read element starts a run of `run` consecutive raw elements beginning
    /// on a multiple of `run` (0: no such rule). The planner checks it for host-resident arrays
    /// ([`IndexMap::PageRows`]'s own check), the kernels' first pass for device-resident ones.
    pub run: u64,
}

impl MapParams {
    pub const IDENTITY: Self = Self {
        offset: 0,
        stride: 1,
        div: 1,
        mul: 1,
        rem_mul: 0,
        add: 0,
        run: 0,
    };

    /// The mapped value of raw index `t`.
    #[inline(always)]
    pub fn apply(&self, t: i64) -> i64 {
        if self.div == 1 && self.mul == 1 && self.add == 0 {
            return t;
        }
        let q = t.div_euclid(self.div) as i128;
        let r = t.rem_euclid(self.div) as i128;
        let v = q * self.mul as i128 + r * self.rem_mul as i128 + self.add as i128;
        v.clamp(i64::MIN as i128, i64::MAX as i128) as i64
    }

    /// Raw element read by position `i`.
    #[inline(always)]
    pub fn raw_position(&self, i: usize) -> usize {
        self.offset as usize + i * self.stride as usize
    }
}

impl IndexMap {
    pub fn params(self) -> MapParams {
        match self {
            Self::Identity => MapParams::IDENTITY,
            Self::Dcp { size, rank } | Self::DcpShare { size, rank } => MapParams {
                offset: rank as u64,
                stride: size as u64,
                div: size as i64,
                ..MapParams::IDENTITY
            },
            Self::PageRows { page } => MapParams {
                stride: page as u64,
                div: page as i64,
                run: page as u64,
                ..MapParams::IDENTITY
            },
            Self::C4Value => MapParams {
                div: c4::PAGE_TOKENS as i64,
                mul: c4::VALUES_PER_ROW as i64,
                rem_mul: 1,
                ..MapParams::IDENTITY
            },
            Self::C4Scale => MapParams {
                div: c4::PAGE_TOKENS as i64,
                mul: c4::SCALES_PER_ROW as i64,
                rem_mul: 1,
                add: c4::SCALE_FIRST as i64,
                ..MapParams::IDENTITY
            },
        }
    }

    /// The map's own parameters: a DCP rank below a positive size, a positive page size.
    pub fn check(self) -> Result<()> {
        match self {
            Self::Dcp { size, rank } | Self::DcpShare { size, rank }
                if size == 0 || rank >= size =>
            {
                Err(Error::value(format!(
                    "dcp_rank must lie in [0, dcp_size); got dcp_rank={rank}, dcp_size={size}"
                )))
            }
            Self::PageRows { page: 0 } => Err(Error::value(
                "a page-row index map needs a positive page size, got 0",
            )),
            _ => Ok(()),
        }
    }

    /// Positions of a mapped array over `raw_len` raw elements, or SGLang's refusal when the
    /// raw array is not made of whole groups.
    pub fn count(self, raw_len: usize) -> Result<usize> {
        self.check()?;
        match self {
            Self::Identity | Self::C4Value | Self::C4Scale => Ok(raw_len),
            Self::Dcp { size, .. } => {
                if raw_len % size as usize != 0 {
                    return Err(Error::assertion(format!(
                        "HiCache DCP translation expects runs of whole widened pages; got \
                         {raw_len} logical slots with dcp_size={size}."
                    )));
                }
                Ok(raw_len / size as usize)
            }
            // The elements at rank, rank + size, ... below raw_len.
            Self::DcpShare { size, rank } => Ok(raw_len
                .saturating_sub(rank as usize)
                .div_ceil(size as usize)),
            Self::PageRows { page } => {
                if raw_len % page as usize != 0 {
                    return Err(Error::transfer(format!(
                        "page-row transfers take whole pages: {raw_len} indices are not a \
                         multiple of the page size {page}"
                    )));
                }
                Ok(raw_len / page as usize)
            }
        }
    }

    /// The mapped values of `raw` (the slots a transfer moves: a watched pool's page digests).
    pub fn apply_all(self, raw: &[i64]) -> Result<Vec<i64>> {
        let n = self.count(raw.len())?;
        let p = self.params();
        Ok((0..n).map(|i| p.apply(raw[p.raw_position(i)])).collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dcp_takes_the_ranks_share_and_divides() {
        let m = IndexMap::Dcp { size: 2, rank: 1 };
        assert_eq!(m.apply_all(&[8, 9, 10, 11]).unwrap(), vec![4, 5]);
        assert_eq!(
            IndexMap::Dcp { size: 2, rank: 0 }
                .apply_all(&[8, 9, 10, 11])
                .unwrap(),
            vec![4, 5]
        );
        let e = m.apply_all(&[1, 2, 3]).unwrap_err();
        assert!(
            matches!(e, Error::Arg(crate::error::ArgError::Assertion(_))),
            "{e:?}"
        );
        assert!(e
            .to_string()
            .contains("got 3 logical slots with dcp_size=2"));
        assert!(IndexMap::Dcp { size: 2, rank: 2 }.count(4).is_err());
        // SGLang 0.5.20+: the rank's share of any run, as its slice takes it.
        let share = |rank, raw: &[i64]| IndexMap::DcpShare { size: 2, rank }.apply_all(raw);
        assert_eq!(share(0, &[8, 9, 10]).unwrap(), vec![4, 5]);
        assert_eq!(share(1, &[8, 9, 10]).unwrap(), vec![4]);
        assert_eq!(share(1, &[8]).unwrap(), Vec::<i64>::new());
        assert_eq!(share(0, &[]).unwrap(), Vec::<i64>::new());
        assert!(IndexMap::DcpShare { size: 2, rank: 2 }.count(4).is_err());
        assert!(IndexMap::Dcp { size: 0, rank: 0 }.check().is_err());
        assert!(IndexMap::Dcp { size: 2, rank: 1 }.check().is_ok());
    }

    #[test]
    fn page_rows_read_the_first_token_of_each_page() {
        let m = IndexMap::PageRows { page: 4 };
        assert_eq!(
            m.apply_all(&[8, 9, 10, 11, 0, 1, 2, 3]).unwrap(),
            vec![2, 0]
        );
        assert!(m.count(6).is_err());
        assert!(IndexMap::PageRows { page: 0 }.count(0).is_err());
    }

    #[test]
    fn c4_maps_match_the_row_functions() {
        for t in [0i64, 1, 63, 64, 65, 127, 128, 64 * 1000 + 17] {
            assert_eq!(
                IndexMap::C4Value.params().apply(t),
                c4::value_row(t as u64) as i64
            );
            assert_eq!(
                IndexMap::C4Scale.params().apply(t),
                c4::scale_row(t as u64) as i64
            );
        }
    }

    #[test]
    fn negative_stays_negative_and_huge_saturates() {
        for m in [
            IndexMap::C4Value,
            IndexMap::C4Scale,
            IndexMap::PageRows { page: 64 },
            IndexMap::Dcp { size: 4, rank: 3 },
        ] {
            let p = m.params();
            assert!(p.apply(-1) < 0, "{m:?}");
            assert!(p.apply(i64::MIN) < 0, "{m:?}");
            assert!(p.apply(i64::MAX) >= 0, "{m:?}");
        }
        assert_eq!(IndexMap::C4Scale.params().apply(i64::MAX), i64::MAX);
    }
}
