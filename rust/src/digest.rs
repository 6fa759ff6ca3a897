//! Page digests: a 128-bit XXH3 of a page's bytes, however many pieces the page is stored in.
//! The L3 tier stores one with every object and checks it on load, so a corrupted, foreign or
//! overwritten object is a miss, never a hit with the wrong bytes.

use std::collections::HashMap;
use std::sync::Mutex;

use twox_hash::xxhash3_128::Hasher;

/// XXH3-128 of the concatenation of `parts`.
pub fn digest128<'a>(parts: impl IntoIterator<Item = &'a [u8]>) -> u128 {
    let mut h = Hasher::new();
    for part in parts {
        h.write(part);
    }
    h.finish_128()
}

/// The digests a watched host pool keeps of its pages (`HOSTKV_PAGE_DIGEST`), by logical page
/// number: recorded by a backup, compared by a load, forgotten when a page may be written by
/// other means. The mutex is a leaf: nothing else is locked, and nothing waits, while it is held.
#[derive(Default)]
pub struct PageDigests {
    map: Mutex<HashMap<u64, u128>>,
}

impl PageDigests {
    /// Remembers the digests of `pages` (just written).
    pub fn record(&self, pages: &[u64], digests: &[u128]) {
        let mut map = self.map.lock().unwrap_or_else(|p| p.into_inner());
        map.extend(pages.iter().copied().zip(digests.iter().copied()));
    }

    /// Forgets `pages`.
    pub fn forget(&self, pages: &[u64]) {
        let mut map = self.map.lock().unwrap_or_else(|p| p.into_inner());
        for page in pages {
            map.remove(page);
        }
    }

    /// The pages among `pages` that have a recorded digest, with it.
    pub fn known(&self, pages: &[u64]) -> Vec<(u64, u128)> {
        let map = self.map.lock().unwrap_or_else(|p| p.into_inner());
        pages
            .iter()
            .filter_map(|p| map.get(p).map(|&d| (*p, d)))
            .collect()
    }
}

/// The pages `slots` touch, each once, ascending (a negative slot is page 0's: a refused call
/// never gets here).
pub fn pages_touched(slots: &[i64], page_size: u64) -> Vec<u64> {
    let page_size = page_size.max(1);
    let mut pages: Vec<u64> = slots.iter().map(|&s| s.max(0) as u64 / page_size).collect();
    pages.sort_unstable();
    pages.dedup();
    pages
}

/// Every slot of `pages`, page by page (what a page digest is taken over).
pub fn page_slots(pages: &[u64], page_size: u64) -> Vec<i64> {
    pages
        .iter()
        .flat_map(|&p| (p * page_size..(p + 1) * page_size).map(|s| s as i64))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pages_are_listed_once_with_every_slot() {
        let pages = pages_touched(&[9, 1, 8, 2], 4);
        assert_eq!(pages, vec![0, 2]);
        assert_eq!(page_slots(&pages, 4), vec![0, 1, 2, 3, 8, 9, 10, 11]);
        assert!(pages_touched(&[], 4).is_empty() && page_slots(&[], 4).is_empty());
    }

    #[test]
    fn recorded_pages_are_known_until_forgotten() {
        let digests = PageDigests::default();
        digests.record(&[1, 2], &[11, 22]);
        assert_eq!(digests.known(&[0, 1, 2]), vec![(1, 11), (2, 22)]);
        digests.forget(&[1]);
        assert_eq!(digests.known(&[0, 1, 2]), vec![(2, 22)]);
        digests.record(&[2], &[23]);
        assert_eq!(digests.known(&[2]), vec![(2, 23)]);
    }

    #[test]
    fn pieces_hash_as_their_concatenation() {
        let whole: Vec<u8> = (0..10_000u32).map(|i| (i * 7 % 251) as u8).collect();
        let one = digest128([whole.as_slice()]);
        let (a, b) = whole.split_at(4097);
        assert_eq!(digest128([a, b]), one);
        assert_eq!(digest128([a, &b[..0], b]), one);
        let mut flipped = whole.clone();
        flipped[9_999] ^= 1;
        assert_ne!(digest128([flipped.as_slice()]), one);
        assert_ne!(digest128([&whole[..9_999]]), one);
    }

    #[test]
    fn digests_are_xxh3_128_as_stored_by_earlier_builds() {
        // Objects already in a store were written with these values (xxHash's empty-input
        // vector, and a long input that takes the SIMD path): a hash crate that changed them
        // would turn every stored page into a digest miss.
        assert_eq!(digest128([]), 0x99aa06d3014798d86001c324468d497f);
        let whole: Vec<u8> = (0..10_000u32).map(|i| (i * 7 % 251) as u8).collect();
        assert_eq!(
            digest128([whole.as_slice()]),
            0x6a14a48339eb05f2436bab56c0b548ea
        );
    }
}
