//! The CUDA kernels, run under the CPU emulation, against the CPU engine (`plan::build` +
//! `cpu::execute_serial`): byte-exact for every layout, direction, index width and block quota.

use std::mem::offset_of;

use super::emulate::{emulate_with_quota, hkv_params_layout};
use super::params::{
    HkvDeviceRecord, HkvErrorRecord, HkvParams, ABORT_RING, BLOCK_THREADS, INLINE_PTRS,
};
use crate::error::Error;
use crate::plan;
use crate::request::{
    Backend, DeviceMemory, DeviceSide, HostGeometry, IndexArray, IndexMap, IndexWidth, Layout, Op,
    TransferRequest,
};

/// xorshift64*: reproducible test data without a dependency.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
    fn bytes(&mut self, n: usize) -> Vec<u8> {
        (0..n).map(|_| self.next() as u8).collect()
    }
    /// `k` distinct values from `[0, n)`, in random order.
    fn distinct(&mut self, n: u64, k: usize) -> Vec<i64> {
        let mut all: Vec<i64> = (0..n as i64).collect();
        for i in (1..all.len()).rev() {
            let j = self.below(i as u64 + 1) as usize;
            all.swap(i, j);
        }
        all.truncate(k);
        all
    }
}

#[derive(Clone)]
struct Pools {
    host: Vec<Vec<u8>>,
    /// Plane-major, `layers` per plane.
    dev: Vec<Vec<u8>>,
}

#[derive(Clone, Copy, Debug)]
struct Case {
    layout: Layout,
    layers: usize,
    rows: usize,
    page: usize,
    heads: usize,
    items: [usize; 2],
    planes: usize,
    dev_rows: usize,
    n: usize,
    width: IndexWidth,
    backup: bool,
    host_layer: usize,
    /// Strided device rows: bytes from one row to the next (None: packed).
    row_pitch: Option<usize>,
}

impl Case {
    fn new(layout: Layout, items: &[usize], layers: usize) -> Self {
        Case {
            layout,
            layers,
            rows: 48,
            page: 4,
            heads: 1,
            items: [items[0], *items.get(1).unwrap_or(&0)],
            planes: items.len(),
            dev_rows: 40,
            n: 13,
            width: IndexWidth::I64,
            backup: true,
            host_layer: 0,
            row_pitch: None,
        }
    }
}

struct Built {
    pools: Pools,
    host_idx: Vec<u8>,
    dev_idx: Vec<u8>,
}

fn encode(v: &[i64], w: IndexWidth) -> Vec<u8> {
    match w {
        IndexWidth::I32 => v.iter().flat_map(|&x| (x as i32).to_ne_bytes()).collect(),
        IndexWidth::I64 => v.iter().flat_map(|&x| x.to_ne_bytes()).collect(),
    }
}

fn build(c: &Case, seed: u64) -> Built {
    let mut rng = Rng(seed | 1);
    let dev_layers = if c.backup { c.layers } else { 1 };
    // page_unified's planes (K, V) are the components of one allocation.
    let host = if c.layout == Layout::PageUnified {
        vec![rng.bytes(c.planes * c.layers * c.rows * c.items[0])]
    } else {
        (0..c.planes)
            .map(|p| rng.bytes(c.layers * c.rows * c.items[p]))
            .collect()
    };
    let pools = Pools {
        host,
        dev: (0..c.planes)
            .flat_map(|p| (0..dev_layers).map(move |_| p))
            .map(|p| rng.bytes(c.dev_rows * c.row_pitch.unwrap_or(c.items[p])))
            .collect(),
    };
    let host = rng.distinct(c.rows as u64, c.n);
    let dev = rng.distinct(c.dev_rows as u64, c.n);
    Built {
        pools,
        host_idx: encode(&host, c.width),
        dev_idx: encode(&dev, c.width),
    }
}

fn request(c: &Case, pools: &mut Pools, host_idx: &[u8], dev_idx: &[u8]) -> TransferRequest {
    request_with(c, pools, host_idx, dev_idx, Backend::Kernel, false)
}

/// `on_device`: both index arrays marked GPU-resident (host memory the emulated kernels read).
fn request_with(
    c: &Case,
    pools: &mut Pools,
    host_idx: &[u8],
    dev_idx: &[u8],
    backend: Backend,
    on_device: bool,
) -> TransferRequest {
    let identity = (IndexMap::Identity, IndexMap::Identity);
    mapped_request(
        c,
        pools,
        (host_idx, dev_idx),
        (c.n, c.n),
        identity,
        backend,
        on_device,
    )
}

/// The CPU engine, on one thread (the reference the emulation is compared with).
fn run_cpu(req: &TransferRequest) {
    let plan = plan::build(req).unwrap_or_else(|e| panic!("plan refused: {e}"));
    crate::cpu::execute_serial(&plan).unwrap();
}

/// Runs the CPU engine and the emulated kernel on copies of the same data and compares every
/// byte of every buffer; also makes sure the transfer changed something (so it can fail).
fn check_case(c: &Case, quota: u32, seed: u64) {
    let b = build(c, seed);
    let mut want = b.pools.clone();
    let req = request(c, &mut want, &b.host_idx, &b.dev_idx);
    run_cpu(&req);
    let mut got = b.pools.clone();
    let req = request(c, &mut got, &b.host_idx, &b.dev_idx);
    emulate_with_quota(&req, quota).unwrap_or_else(|e| panic!("{c:?}: emulation failed: {e}"));
    if c.n > 0 {
        assert!(
            want.host != b.pools.host || want.dev != b.pools.dev,
            "{c:?}: the reference moved nothing"
        );
    }
    for (p, (w, g)) in want.host.iter().zip(&got.host).enumerate() {
        if w != g {
            let at = w.iter().zip(g).position(|(a, b)| a != b).unwrap();
            panic!("{c:?} quota {quota}: host plane {p} differs first at byte {at}");
        }
    }
    for (k, (w, g)) in want.dev.iter().zip(&got.dev).enumerate() {
        if w != g {
            let at = w.iter().zip(g).position(|(a, b)| a != b).unwrap();
            panic!("{c:?} quota {quota}: device layer buffer {k} differs first at byte {at}");
        }
    }
}

fn both_directions(mut c: Case, quotas: &[u32], seed: u64) {
    for backup in [true, false] {
        c.backup = backup;
        c.host_layer = if backup { 0 } else { c.layers - 1 };
        for &q in quotas {
            check_case(&c, q, seed ^ q as u64);
        }
    }
}

#[test]
fn params_layout_matches_the_cuda_struct() {
    let mut v = [0u64; 40];
    // SAFETY: writes at most `cap` values.
    unsafe { hkv_params_layout(v.as_mut_ptr(), v.len() as u32) };
    let want = [
        std::mem::size_of::<HkvParams>(),
        offset_of!(HkvParams, dev_ptrs),
        offset_of!(HkvParams, dev_table),
        offset_of!(HkvParams, host_base),
        offset_of!(HkvParams, item_bytes),
        offset_of!(HkvParams, seg_bytes),
        offset_of!(HkvParams, dev_pitch),
        offset_of!(HkvParams, host_idx),
        offset_of!(HkvParams, dev_idx),
        offset_of!(HkvParams, n),
        offset_of!(HkvParams, host_rows),
        offset_of!(HkvParams, dev_rows),
        offset_of!(HkvParams, err),
        offset_of!(HkvParams, dev_err),
        offset_of!(HkvParams, abort_seq),
        offset_of!(HkvParams, host_map),
        offset_of!(HkvParams, dev_map),
        std::mem::size_of::<crate::index_map::MapParams>(),
        offset_of!(HkvParams, layers),
        offset_of!(HkvParams, layer_begin),
        offset_of!(HkvParams, layer_count),
        offset_of!(HkvParams, planes),
        offset_of!(HkvParams, layout),
        offset_of!(HkvParams, to_host),
        offset_of!(HkvParams, page_size),
        offset_of!(HkvParams, heads),
        offset_of!(HkvParams, host_idx_wide),
        offset_of!(HkvParams, dev_idx_wide),
        std::mem::size_of::<HkvErrorRecord>(),
        std::mem::size_of::<HkvDeviceRecord>(),
        offset_of!(HkvErrorRecord, aborted),
        offset_of!(HkvErrorRecord, ack),
        offset_of!(HkvDeviceRecord, abort_ring),
        INLINE_PTRS,
        ABORT_RING,
        BLOCK_THREADS as usize,
    ];
    let got: Vec<usize> = v[..want.len()].iter().map(|&x| x as usize).collect();
    assert_eq!(got, want);
    // The PTX declares the same parameter size (the GPU reads the block by these offsets).
    let decl = format!(".param .align 8 .b8 hkv_transfer_param_0[{}]", want[0]);
    assert!(
        super::ptx::PTX.contains(&decl),
        "PTX parameter block is not {} bytes",
        want[0]
    );
}

#[test]
fn layer_first_and_page_first_every_item_size() {
    for layout in [
        Layout::LayerFirst,
        Layout::PageFirst,
        Layout::PageFirstDirect,
    ] {
        for items in [&[12usize][..], &[656], &[3], &[16, 24], &[40, 12]] {
            let c = Case::new(layout, items, 5);
            both_directions(c, &[1, 2, 7], 0x5eed ^ items[0] as u64);
        }
    }
}

#[test]
fn strided_device_rows_every_kernel_layout() {
    // SGLang's unified pools: each device layer is a view of token-major entries, its rows a
    // pitch apart that is more than their bytes (the gaps hold other layers' rows). page_head
    // is refused with them, as SGLang refuses it (plan's tests).
    for layout in [
        Layout::LayerFirst,
        Layout::PageFirst,
        Layout::PageFirstDirect,
        Layout::PageUnified,
    ] {
        for (items, gap) in [(&[16usize][..], 48), (&[12, 12], 5), (&[656], 100)] {
            let mut c = Case::new(layout, items, 5);
            c.heads = if layout == Layout::PageUnified { 4 } else { 1 };
            c.row_pitch = Some(items.iter().max().unwrap() + gap);
            both_directions(c, &[1, 7], 0x5717 ^ gap as u64);
        }
    }
}

#[test]
fn page_head_splits_items_per_head() {
    for (items, heads) in [
        (&[12usize][..], 3),
        (&[656], 8),
        (&[3], 3),
        (&[64, 32], 4),
        (&[48], 2),
    ] {
        let mut c = Case::new(Layout::PageHead, items, 7);
        c.heads = heads;
        both_directions(c, &[1, 2, 7], 0xbeef ^ heads as u64);
    }
}

#[test]
fn page_unified_moves_head_groups_of_interleaved_k_and_v() {
    // SGLang 0.5.23's page block; items of 3, 12 and 66 bytes reach the 4- and 1-byte paths.
    for (items, groups) in [
        (&[64usize, 64][..], 2),
        (&[48, 48], 3),
        (&[1152], 1),
        (&[12, 12], 4),
        (&[66], 1),
        (&[3, 3], 1),
    ] {
        let mut c = Case::new(Layout::PageUnified, items, 5);
        c.heads = groups;
        both_directions(c, &[1, 2, 7], 0x0423 ^ groups as u64);
    }
}

#[test]
fn int32_indices_and_edge_sizes() {
    for layout in [
        Layout::LayerFirst,
        Layout::PageFirst,
        Layout::PageFirstDirect,
        Layout::PageHead,
    ] {
        for n in [1usize, 2, 40] {
            let mut c = Case::new(layout, &[24, 8], 3);
            c.width = IndexWidth::I32;
            c.heads = if layout == Layout::PageHead { 2 } else { 1 };
            c.n = n;
            both_directions(c, &[2], n as u64);
        }
    }
}

#[test]
fn page_size_one_like_v4_page_rows() {
    for layout in [
        Layout::LayerFirst,
        Layout::PageFirst,
        Layout::PageFirstDirect,
    ] {
        let mut c = Case::new(layout, &[1000], 11);
        c.page = 1;
        c.rows = 17;
        c.dev_rows = 23;
        c.n = 9;
        both_directions(c, &[1, 7], 0x44);
    }
}

#[test]
fn prime_layer_count_61_with_many_items() {
    for layout in [Layout::PageFirst, Layout::PageHead] {
        let mut c = Case::new(layout, &[256, 128], 61);
        c.heads = if layout == Layout::PageHead { 4 } else { 1 };
        c.rows = 64;
        c.dev_rows = 64;
        c.n = 64;
        both_directions(c, &[2, 7], 61);
    }
}

#[test]
fn layer_table_beyond_the_parameter_block() {
    // 2 planes x 131 layers = 262 device pointers: more than HKV_INLINE_PTRS, so the kernel
    // reads them from a table.
    let mut c = Case::new(Layout::PageFirst, &[16, 8], 131);
    c.rows = 8;
    c.dev_rows = 8;
    c.n = 5;
    c.backup = true;
    assert!(c.planes * c.layers > INLINE_PTRS);
    check_case(&c, 2, 131);
}

#[test]
fn empty_transfer_is_a_no_op() {
    let mut c = Case::new(Layout::LayerFirst, &[16], 2);
    c.n = 0;
    both_directions(c, &[2], 0);
}

/// Bad indices marked as GPU-resident are checked by the kernel: error reported, nothing written.
#[test]
fn bad_device_resident_index_writes_nothing() {
    for (side, bad) in [
        ("device", 40i64),
        ("device", -1),
        ("host", 48),
        ("host", -7),
    ] {
        for width in [IndexWidth::I32, IndexWidth::I64] {
            let mut c = Case::new(Layout::PageFirst, &[32], 3);
            c.width = width;
            c.backup = side == "host";
            let b = build(&c, 7);
            let mut host_vals: Vec<i64> = (0..c.n as i64).collect();
            let mut dev_vals: Vec<i64> = (0..c.n as i64).collect();
            if side == "host" {
                host_vals[5] = bad;
            } else {
                dev_vals[c.n - 1] = bad;
            }
            let (hi, di) = (encode(&host_vals, width), encode(&dev_vals, width));
            let mut pools = b.pools.clone();
            let req = request_with(&c, &mut pools, &hi, &di, Backend::Kernel, true);
            let e = emulate_with_quota(&req, 2).unwrap_err();
            let msg = e.to_string();
            assert!(matches!(e, Error::Plan(_)), "{msg}");
            assert!(msg.starts_with(&format!("{side} index {bad} ")), "{msg}");
            assert!(
                pools.host == b.pools.host && pools.dev == b.pools.dev,
                "{side} {bad}: wrote"
            );
        }
    }
}

/// The same indices, valid, pass through the device-resident path unchanged.
#[test]
fn device_resident_valid_indices_match_the_plan() {
    let c = Case::new(Layout::PageFirstDirect, &[20], 4);
    let b = build(&c, 9);
    let mut want = b.pools.clone();
    let req = request(&c, &mut want, &b.host_idx, &b.dev_idx);
    run_cpu(&req);
    let mut got = b.pools.clone();
    let req = request_with(&c, &mut got, &b.host_idx, &b.dev_idx, Backend::Kernel, true);
    emulate_with_quota(&req, 3).unwrap();
    assert!(want.host == got.host && want.dev == got.dev);
}

#[test]
fn host_resident_bad_index_is_refused_before_any_write() {
    let c = Case::new(Layout::LayerFirst, &[8], 2);
    let b = build(&c, 3);
    let mut vals: Vec<i64> = (0..c.n as i64).collect();
    vals[2] = c.rows as i64;
    let hi = encode(&vals, c.width);
    let mut pools = b.pools.clone();
    let req = request(&c, &mut pools, &hi, &b.dev_idx);
    assert!(matches!(emulate_with_quota(&req, 2), Err(Error::Plan(_))));
    assert!(pools.host == b.pools.host && pools.dev == b.pools.dev);
}

#[test]
fn direct_requests_emulate_the_copy_engine_plan() {
    let mut c = Case::new(Layout::PageFirstDirect, &[16], 3);
    c.n = 8;
    let b = build(&c, 5);
    // Page-aligned runs: pages 3 and 0 on the host, rows 8.. and 16.. on the device.
    let host: Vec<i64> = vec![12, 13, 14, 15, 0, 1, 2, 3];
    let dev: Vec<i64> = vec![8, 9, 10, 11, 16, 17, 18, 19];
    let (hi, di) = (encode(&host, c.width), encode(&dev, c.width));
    let mut want = b.pools.clone();
    let req = request_with(&c, &mut want, &hi, &di, Backend::Direct, false);
    run_cpu(&req);
    let mut got = b.pools.clone();
    let req = request_with(&c, &mut got, &hi, &di, Backend::Direct, false);
    emulate_with_quota(&req, 2).unwrap();
    assert!(want.host == got.host && want.dev == got.dev && want.host != b.pools.host);
}

/// A request over `pools` whose index arrays (`lens` raw elements each) are read through `maps`;
/// `c.n` is ignored (the maps say how many positions move).
#[allow(clippy::too_many_arguments)]
fn mapped_request(
    c: &Case,
    pools: &mut Pools,
    raw: (&[u8], &[u8]),
    lens: (usize, usize),
    maps: (IndexMap, IndexMap),
    backend: Backend,
    on_device: bool,
) -> TransferRequest {
    let idx = |b: &[u8], len: usize, map: IndexMap| IndexArray {
        ptr: b.as_ptr() as u64,
        len,
        width: c.width,
        on_device,
        map,
    };
    assert!(raw.0.len() >= lens.0 * c.width.bytes() && raw.1.len() >= lens.1 * c.width.bytes());
    let geom = HostGeometry {
        layout: c.layout,
        layers: c.layers,
        rows: c.rows,
        page_size: c.page,
        heads: c.heads,
        item_bytes: c.items[..c.planes].to_vec(),
        plane_base: if c.layout == Layout::PageUnified {
            vec![pools.host[0].as_mut_ptr() as u64; c.planes]
        } else {
            pools
                .host
                .iter_mut()
                .map(|h| h.as_mut_ptr() as u64)
                .collect()
        },
    };
    let op = if c.backup {
        Op::Backup
    } else {
        Op::Load {
            host_layer: c.host_layer,
        }
    };
    let device = DeviceSide {
        layer_ptrs: pools
            .dev
            .iter_mut()
            .map(|d| d.as_mut_ptr() as u64)
            .collect(),
        rows: c.dev_rows,
        row_pitch: c.row_pitch.map(|p| p as u64),
        memory: DeviceMemory::Host,
    };
    // SAFETY: the test's own buffers, of the sizes stated (asserted for the index arrays),
    // alive and untouched while the request is used.
    unsafe {
        TransferRequest::new(
            geom,
            backend,
            op,
            device,
            idx(raw.0, lens.0, maps.0),
            idx(raw.1, lens.1, maps.1),
        )
    }
}

/// Raw index arrays for `map` whose mapped values are exactly `want`: each read element is an
/// inverse image, and every element the map skips is -7 (a read of one would be refused).
fn raw_for(map: IndexMap, want: &[i64]) -> Vec<i64> {
    match map {
        IndexMap::Identity => want.to_vec(),
        IndexMap::Dcp { size, rank } | IndexMap::DcpShare { size, rank } => {
            let s = size as i64;
            let mut v = vec![-7; want.len() * size as usize];
            for (i, &w) in want.iter().enumerate() {
                v[rank as usize + i * size as usize] = w * s + (i as i64 % s);
            }
            v
        }
        // Whole pages of token slots: the CPU engine checks every index of a page (the kernel
        // reads only the first, so the rest must agree with it).
        IndexMap::PageRows { page } => want
            .iter()
            .flat_map(|&w| (0..page as i64).map(move |j| w * page as i64 + j))
            .collect(),
        IndexMap::C4Value | IndexMap::C4Scale => unreachable!("built from tokens"),
    }
}

/// The emulated kernel (device-resident indices: pass 1 and pass 2 apply the map) and the CPU
/// engine (the planner applies it) move exactly the rows an identity transfer of the mapped
/// values moves: DCP shares, V4 page rows and C4 value / scale rows.
#[test]
fn mapped_indices_move_the_same_rows_everywhere() {
    let mut rng = Rng(0x001d_3ec4);
    let mut cases = 0;
    for map in [
        IndexMap::Dcp { size: 2, rank: 1 },
        IndexMap::Dcp { size: 4, rank: 0 },
        IndexMap::DcpShare { size: 3, rank: 2 },
        IndexMap::PageRows { page: 4 },
        IndexMap::C4Value,
        IndexMap::C4Scale,
    ] {
        for backup in [true, false] {
            let mut c = Case::new(Layout::LayerFirst, &[8], 3);
            c.backup = backup;
            c.host_layer = 2;
            let (h_raw, d_raw, h_want, d_want) = match map {
                IndexMap::C4Value | IndexMap::C4Scale => {
                    let per_row = if map == IndexMap::C4Value {
                        crate::pool::c4::VALUES_PER_ROW
                    } else {
                        crate::pool::c4::SCALES_PER_ROW
                    };
                    // Two C4 page rows on each side, as rows of the finer unit.
                    c.rows = 2 * per_row as usize;
                    c.dev_rows = c.rows;
                    let h = rng.distinct(128, 11);
                    let d = rng.distinct(128, 11);
                    let f = |t: &i64| {
                        let t = *t as u64;
                        (if map == IndexMap::C4Value {
                            crate::pool::c4::value_row(t)
                        } else {
                            crate::pool::c4::scale_row(t)
                        }) as i64
                    };
                    let (hw, dw) = (h.iter().map(f).collect(), d.iter().map(f).collect());
                    (h, d, hw, dw)
                }
                _ => {
                    let hw = rng.distinct(c.rows as u64, 9);
                    let dw = rng.distinct(c.dev_rows as u64, 9);
                    (raw_for(map, &hw), raw_for(map, &dw), hw, dw)
                }
            };
            let b = build(&c, rng.next());
            // Reference: identity arrays of the mapped values on the CPU engine.
            let mut want = b.pools.clone();
            c.n = h_want.len();
            let (hw, dw) = (encode(&h_want, c.width), encode(&d_want, c.width));
            run_cpu(&request(&c, &mut want, &hw, &dw));
            assert!(want.host != b.pools.host || want.dev != b.pools.dev);
            let (hr, dr) = (encode(&h_raw, c.width), encode(&d_raw, c.width));
            let lens = (h_raw.len(), d_raw.len());
            for on_device in [false, true] {
                let mut got = b.pools.clone();
                let maps = (map, map);
                let req = mapped_request(
                    &c,
                    &mut got,
                    (&hr, &dr),
                    lens,
                    maps,
                    Backend::Kernel,
                    on_device,
                );
                if on_device {
                    emulate_with_quota(&req, 1)
                        .unwrap_or_else(|e| panic!("{map:?}: emulation failed: {e}"));
                } else {
                    run_cpu(&req);
                }
                assert!(
                    got.host == want.host && got.dev == want.dev,
                    "{map:?} backup={backup} on_device={on_device}: bytes differ"
                );
                cases += 1;
            }
        }
    }
    assert_eq!(cases, 24);
}

/// A mapped index that lands out of range is refused by the kernel's pass 1 with the mapped
/// value, and nothing is written.
#[test]
fn a_mapped_index_out_of_range_is_refused_by_the_kernel() {
    let c = Case::new(Layout::LayerFirst, &[8], 2);
    let b = build(&c, 5);
    let mut got = b.pools.clone();
    let map = IndexMap::PageRows { page: 4 };
    // Page row 12 of a 48-row pool is in range; page row 48 (token 192) is not.
    let h = encode(&[48, 49, 50, 51, 192, 193, 194, 195], c.width);
    let d = encode(&[0, 1, 2, 3, 4, 5, 6, 7], c.width);
    let req = mapped_request(
        &c,
        &mut got,
        (&h, &d),
        (8, 8),
        (map, map),
        Backend::Kernel,
        true,
    );
    let e = emulate_with_quota(&req, 1).unwrap_err().to_string();
    assert!(e.contains("host index 48") && e.contains("[0, 48)"), "{e}");
    assert!(got.host == b.pools.host && got.dev == b.pools.dev);
}

/// Device-resident page-row indices are checked whole, as the planner checks host-resident
/// ones: a page whose slots do not run on from its first, or whose first slot is not on a page
/// boundary, is refused by the kernel's pass 1 naming the position, and nothing is written.
#[test]
fn a_broken_device_resident_page_run_is_refused_by_the_kernel() {
    let c = Case::new(Layout::LayerFirst, &[8], 2);
    let b = build(&c, 6);
    let map = IndexMap::PageRows { page: 4 };
    let good = [8, 9, 10, 11, 20, 21, 22, 23];
    let cases: [(&[i64], &[i64], &str); 3] = [
        // Host side: the second page's third slot is not 22 (SGLang would move page 5 anyway).
        (
            &[8, 9, 10, 11, 20, 21, 1000000000, 23],
            &good,
            "host index at position 6",
        ),
        // Device side: two half pages.
        (
            &good,
            &[8, 9, 20, 21, 12, 13, 14, 15],
            "device index at position 2",
        ),
        // A page that starts off its boundary.
        (
            &[9, 10, 11, 12, 20, 21, 22, 23],
            &good,
            "host index at position 0",
        ),
    ];
    for (host, dev, want) in cases {
        let mut got = b.pools.clone();
        let (h, d) = (encode(host, c.width), encode(dev, c.width));
        let req = mapped_request(
            &c,
            &mut got,
            (&h, &d),
            (8, 8),
            (map, map),
            Backend::Kernel,
            true,
        );
        let e = emulate_with_quota(&req, 1).unwrap_err().to_string();
        assert!(
            e.contains(want) && e.contains("whole pages of 4 consecutive slots"),
            "{e}"
        );
        assert!(
            got.host == b.pools.host && got.dev == b.pools.dev,
            "{want}: bytes changed"
        );
    }
    // The same pages, whole: moved.
    let mut got = b.pools.clone();
    let (h, d) = (encode(&good, c.width), encode(&good, c.width));
    let req = mapped_request(
        &c,
        &mut got,
        (&h, &d),
        (8, 8),
        (map, map),
        Backend::Kernel,
        true,
    );
    emulate_with_quota(&req, 1).unwrap();
    assert!(got.host != b.pools.host || got.dev != b.pools.dev);
}
