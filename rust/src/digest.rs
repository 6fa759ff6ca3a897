//! Page digests: a 128-bit XXH3 of a page's bytes, however many pieces the page is stored in.
//! The L3 tier stores one with every object and checks it on load, so a corrupted, foreign or
//! overwritten object is a miss, never a hit with the wrong bytes.

use xxhash_rust::xxh3::Xxh3;

/// XXH3-128 of the concatenation of `parts`.
pub fn digest128<'a>(parts: impl IntoIterator<Item = &'a [u8]>) -> u128 {
    let mut h = Xxh3::new();
    for part in parts {
        h.update(part);
    }
    h.digest128()
}

#[cfg(test)]
mod tests {
    use super::*;

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
}
