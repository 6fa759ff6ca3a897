//! The committed PTX (scripts/gen_ptx.sh), embedded in the library. NUL-terminated because
//! `cuModuleLoadDataEx` reads PTX as a C string.

pub(crate) const PTX: &str = concat!(include_str!("../../kernels/hostkv_transfer.ptx"), "\0");

pub(crate) const KERNEL_CHECK: &[u8] = b"hkv_check_indices\0";
pub(crate) const KERNEL_TRANSFER: &[u8] = b"hkv_transfer\0";

#[cfg(test)]
mod tests {
    use sha2::{Digest, Sha256};

    use super::*;
    use crate::cuda::params;

    const CU: &str = include_str!("../../kernels/hostkv_transfer.cu");
    const SHIM: &str = include_str!("../../kernels/emu_shim.h");

    fn hex(bytes: &[u8]) -> String {
        bytes.iter().map(|b| format!("{b:02x}")).collect()
    }

    #[test]
    fn committed_ptx_matches_its_sources() {
        let first = PTX.lines().next().unwrap_or_default();
        let recorded = first
            .strip_prefix("// source-sha256: ")
            .expect("first line of hostkv_transfer.ptx must be the source-sha256 comment");
        // gen_ptx.sh hashes the .cu bytes followed by the shim's.
        let digest = Sha256::new().chain_update(CU).chain_update(SHIM).finalize();
        assert_eq!(
            recorded.trim(),
            hex(&digest),
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
