//! The committed PTX (scripts/gen_ptx.sh), embedded in the library. NUL-terminated because
//! `cuModuleLoadDataEx` reads PTX as a C string.

pub(crate) const PTX: &str = concat!(include_str!("../../kernels/hostkv_transfer.ptx"), "\0");

pub(crate) const KERNEL_CHECK: &[u8] = b"hkv_check_indices\0";
pub(crate) const KERNEL_TRANSFER: &[u8] = b"hkv_transfer\0";

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cuda::params;

    const CU: &str = include_str!("../../kernels/hostkv_transfer.cu");
    const SHIM: &str = include_str!("../../kernels/emu_shim.h");

    /// FIPS 180-4 SHA-256, enough to recompute gen_ptx.sh's source hash without nvcc or a crate.
    fn sha256(data: &[u8]) -> [u8; 32] {
        const K: [u32; 64] = [
            0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4,
            0xab1c5ed5, 0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe,
            0x9bdc06a7, 0xc19bf174, 0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f,
            0x4a7484aa, 0x5cb0a9dc, 0x76f988da, 0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7,
            0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967, 0x27b70a85, 0x2e1b2138, 0x4d2c6dfc,
            0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85, 0xa2bfe8a1, 0xa81a664b,
            0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070, 0x19a4c116,
            0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
            0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7,
            0xc67178f2,
        ];
        let mut h: [u32; 8] = [
            0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a, 0x510e527f, 0x9b05688c, 0x1f83d9ab,
            0x5be0cd19,
        ];
        let mut msg = data.to_vec();
        msg.push(0x80);
        while msg.len() % 64 != 56 {
            msg.push(0);
        }
        msg.extend_from_slice(&((data.len() as u64) * 8).to_be_bytes());
        for block in msg.chunks_exact(64) {
            let mut w = [0u32; 64];
            for (i, word) in block.chunks_exact(4).enumerate() {
                w[i] = u32::from_be_bytes([word[0], word[1], word[2], word[3]]);
            }
            for i in 16..64 {
                let s0 = w[i - 15].rotate_right(7) ^ w[i - 15].rotate_right(18) ^ (w[i - 15] >> 3);
                let s1 = w[i - 2].rotate_right(17) ^ w[i - 2].rotate_right(19) ^ (w[i - 2] >> 10);
                w[i] = w[i - 16]
                    .wrapping_add(s0)
                    .wrapping_add(w[i - 7])
                    .wrapping_add(s1);
            }
            let mut v = h;
            for i in 0..64 {
                let s1 = v[4].rotate_right(6) ^ v[4].rotate_right(11) ^ v[4].rotate_right(25);
                let ch = (v[4] & v[5]) ^ (!v[4] & v[6]);
                let t1 = v[7]
                    .wrapping_add(s1)
                    .wrapping_add(ch)
                    .wrapping_add(K[i])
                    .wrapping_add(w[i]);
                let s0 = v[0].rotate_right(2) ^ v[0].rotate_right(13) ^ v[0].rotate_right(22);
                let maj = (v[0] & v[1]) ^ (v[0] & v[2]) ^ (v[1] & v[2]);
                let t2 = s0.wrapping_add(maj);
                v = [
                    t1.wrapping_add(t2),
                    v[0],
                    v[1],
                    v[2],
                    v[3].wrapping_add(t1),
                    v[4],
                    v[5],
                    v[6],
                ];
            }
            for (a, b) in h.iter_mut().zip(v) {
                *a = a.wrapping_add(b);
            }
        }
        let mut out = [0u8; 32];
        for (i, word) in h.iter().enumerate() {
            out[i * 4..i * 4 + 4].copy_from_slice(&word.to_be_bytes());
        }
        out
    }

    fn hex(bytes: &[u8]) -> String {
        bytes.iter().map(|b| format!("{b:02x}")).collect()
    }

    #[test]
    fn sha256_matches_known_vectors() {
        assert_eq!(
            hex(&sha256(b"")),
            "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
        );
        assert_eq!(
            hex(&sha256(b"abc")),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
        // Two-block message (56 bytes of input forces a second padding block).
        assert_eq!(
            hex(&sha256(
                b"abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq"
            )),
            "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1"
        );
    }

    #[test]
    fn committed_ptx_matches_its_sources() {
        let first = PTX.lines().next().unwrap_or_default();
        let recorded = first
            .strip_prefix("// source-sha256: ")
            .expect("first line of hostkv_transfer.ptx must be the source-sha256 comment");
        let mut src = CU.as_bytes().to_vec();
        src.extend_from_slice(SHIM.as_bytes());
        assert_eq!(
            recorded.trim(),
            hex(&sha256(&src)),
            "rust/kernels/hostkv_transfer.ptx is stale: run scripts/gen_ptx.sh and commit the result"
        );
    }

    #[test]
    fn ptx_header_is_pinned_to_isa_8_0_and_sm_80() {
        let lines: Vec<&str> = PTX.lines().map(str::trim).collect();
        for want in [".version 8.0", ".target sm_80", ".address_size 64"] {
            assert!(lines.contains(&want), "PTX header must contain `{want}`");
        }
        for other in lines
            .iter()
            .filter(|l| l.starts_with(".version") || l.starts_with(".target"))
        {
            assert!(
                *other == ".version 8.0" || *other == ".target sm_80",
                "unexpected PTX header line `{other}`"
            );
        }
        for entry in ["hkv_check_indices", "hkv_transfer"] {
            assert!(
                PTX.contains(&format!(".visible .entry {entry}(")),
                "PTX lacks entry {entry}"
            );
        }
        assert!(PTX.ends_with('\0') && !PTX[..PTX.len() - 1].contains('\0'));
    }

    /// The copy kernel leaves room for the forward pass: 256-thread blocks compiled for 4 blocks
    /// per SM (at most 64 registers per thread, a quarter of the register file per block), and
    /// the quota keeps meaning SGLang's "1024-thread blocks' worth of warps".
    #[test]
    fn kernels_are_compiled_and_launched_as_small_blocks() {
        let ptx = PTX;
        for entry in ["hkv_check_indices", "hkv_transfer"] {
            let at = ptx
                .find(&format!(".entry {entry}("))
                .expect("entry in the PTX");
            let body = &ptx[at..at + ptx[at..].find('{').expect("entry body")];
            assert!(body.contains(".maxntid 256, 1, 1"), "{entry}: {body}");
            assert!(body.contains(".minnctapersm 4"), "{entry}: {body}");
        }
        assert_eq!((params::BLOCK_THREADS, params::BLOCKS_PER_QUOTA), (256, 4));
        // Quota 2 (SGLang's default): 64 warps at most, like two 1024-thread blocks.
        assert_eq!(params::transfer_grid(1 << 20, 2), 8);
        assert_eq!(params::transfer_grid(3, 2), 1);
        assert_eq!(params::check_grid(1 << 20, 1), 4);
    }
}
