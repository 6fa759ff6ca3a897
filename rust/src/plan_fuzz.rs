//! One fuzz input -> one transfer request over buffers sized exactly to their geometry, planned
//! and run on the CPU engine. The `cargo fuzz` target (`fuzz/fuzz_targets/plan.rs`) calls
//! [`one_input`]; the unit test below replays the committed corpus (`fuzz/corpus/plan`), so CI
//! keeps the harness compiling and the corpus passing without a nightly toolchain.
//!
//! What a finding looks like: a panic (any of the asserts below, or one inside the planner), or,
//! under the fuzzer's AddressSanitizer, a read or write outside one of the exact-size buffers.

use crate::plan::{build, validate};
use crate::request::{
    Backend, DeviceMemory, DeviceSide, HostGeometry, IndexArray, IndexMap, IndexWidth, Layout, Op,
    TransferRequest,
};

const PAIRS: [(Layout, Backend); 8] = [
    (Layout::LayerFirst, Backend::Kernel),
    (Layout::PageFirst, Backend::Kernel),
    (Layout::PageHead, Backend::Kernel),
    (Layout::PageFirstDirect, Backend::Kernel),
    (Layout::LayerFirst, Backend::Direct),
    (Layout::PageFirstDirect, Backend::Direct),
    // Refused pairs stay in the input space: they must be refused, not planned.
    (Layout::PageFirst, Backend::Direct),
    (Layout::PageHead, Backend::Direct),
];

/// Reads the input a byte at a time; past the end every byte is 0.
struct Bytes<'a>(&'a [u8]);

impl Bytes<'_> {
    fn byte(&mut self) -> u8 {
        match self.0.split_first() {
            Some((&b, rest)) => {
                self.0 = rest;
                b
            }
            None => 0,
        }
    }
}

/// Plans and runs the request `data` describes. Header (13 bytes): pair, layers, page size,
/// plane count, two item sizes, heads, host pages, ragged rows, device rows, op and layer, index
/// width, length skew and index map; then index values as signed bytes, host and device interleaved.
pub fn one_input(data: &[u8]) {
    let mut b = Bytes(data);
    let (layout, backend) = PAIRS[b.byte() as usize % PAIRS.len()];
    let layers = 1 + b.byte() as usize % 8;
    let page = b.byte() as usize % 10; // 0 is refused
    let nplanes = 1 + b.byte() as usize % 2;
    let items: Vec<usize> = (0..2).map(|_| 1 + b.byte() as usize % 32).collect();
    let items = items[..nplanes].to_vec();
    let heads = b.byte() as usize % 5; // 0 is refused
    let rows = (b.byte() as usize % 7) * page.max(1) + b.byte() as usize % 3;
    let dev_rows = b.byte() as usize % 41;
    let op_byte = b.byte();
    let host_layer = (op_byte >> 2) as usize % 10; // past `layers` is refused
    let op = match op_byte % 3 {
        0 => Op::Backup,
        1 => Op::BackupLayer { host_layer },
        _ => Op::Load { host_layer },
    };
    let width = if b.byte() % 2 == 0 {
        IndexWidth::I32
    } else {
        IndexWidth::I64
    };
    let skew_map = b.byte();
    let skew = skew_map % 4; // 3: the device array is one shorter
                             // Both arrays read through one index map (DCP share, page rows, C4 token rows).
    let map = match (skew_map >> 2) % 6 {
        0 | 1 => IndexMap::Identity,
        2 => IndexMap::Dcp {
            size: 2,
            rank: u32::from(skew_map >> 5 & 1),
        },
        3 => IndexMap::PageRows {
            page: page.max(1) as u32,
        },
        4 => IndexMap::C4Value,
        _ => IndexMap::C4Scale,
    };
    let mut host_idx = Vec::new();
    let mut dev_idx = Vec::new();
    while !b.0.is_empty() && host_idx.len() < 256 {
        host_idx.push(b.byte() as i8 as i64);
        dev_idx.push(b.byte() as i8 as i64);
    }
    if skew == 3 {
        dev_idx.pop();
    }

    let device_layers = match op {
        Op::Backup => layers,
        Op::BackupLayer { .. } | Op::Load { .. } => 1,
    };
    let mut host: Vec<Vec<u8>> = items
        .iter()
        .enumerate()
        .map(|(p, &i)| vec![p as u8 + 1; layers * rows * i])
        .collect();
    let mut dev: Vec<Vec<u8>> = items
        .iter()
        .flat_map(|&i| (0..device_layers).map(move |l| vec![0x80 | l as u8; dev_rows * i]))
        .collect();
    let encode = |v: &[i64]| -> Vec<u8> {
        match width {
            IndexWidth::I32 => v.iter().flat_map(|&x| (x as i32).to_ne_bytes()).collect(),
            IndexWidth::I64 => v.iter().flat_map(|&x| x.to_ne_bytes()).collect(),
        }
    };
    let (hb, db) = (encode(&host_idx), encode(&dev_idx));
    let array = |bytes: &[u8], len: usize| IndexArray {
        ptr: bytes.as_ptr() as u64,
        len,
        width,
        on_device: false,
        map,
    };
    let geom = HostGeometry {
        layout,
        layers,
        rows,
        page_size: page,
        heads,
        item_bytes: items.clone(),
        plane_base: host.iter_mut().map(|h| h.as_mut_ptr() as u64).collect(),
    };
    let device = DeviceSide {
        layer_ptrs: dev.iter_mut().map(|d| d.as_mut_ptr() as u64).collect(),
        rows: dev_rows,
        row_pitch: None,
        memory: DeviceMemory::Host,
    };
    let before = (host.clone(), dev.clone());
    // SAFETY: the planes hold exactly layers * rows * item bytes and each device layer exactly
    // dev_rows * item bytes (the sizes the geometry states), the index arrays hold `len`
    // elements of `width`; all are distinct allocations owned by this function, alive and
    // untouched by anything else until the request is dropped at its end.
    let req = unsafe {
        TransferRequest::new(
            geom,
            backend,
            op,
            device,
            array(&hb, host_idx.len()),
            array(&db, dev_idx.len()),
        )
    };
    let checked = validate(&req);
    match build(&req) {
        Ok(plan) => {
            assert!(checked.is_ok(), "validate refused what build planned");
            crate::cpu::execute(&plan).expect("a planned transfer failed on the CPU engine");
            // The source side is never written.
            if op.to_host() {
                assert!(dev == before.1, "a backup wrote the device side");
            } else {
                assert!(host == before.0, "a load wrote the host side");
            }
        }
        Err(e) => {
            assert!(checked.is_err(), "build refused what validate passed: {e}");
            assert!(!e.to_string().is_empty());
            assert!(
                host == before.0 && dev == before.1,
                "refused, but bytes moved"
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Replays every committed corpus input (and the empty input).
    #[test]
    fn the_committed_fuzz_corpus_passes() {
        one_input(&[]);
        let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/fuzz/corpus/plan");
        let mut n = 0;
        for entry in std::fs::read_dir(dir).expect("fuzz/corpus/plan") {
            let path = entry.unwrap().path();
            one_input(&std::fs::read(&path).unwrap());
            n += 1;
        }
        assert!(n >= 8, "only {n} corpus inputs in {dir}");
    }
}
