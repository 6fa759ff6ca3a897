//! Plan building (the per-call overhead of a load: validation) and CPU engine bandwidth.
//!
//! `cargo bench --bench engine` (add `-- --quick` for a short run).

use std::hint::black_box;
use std::time::Duration;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use hostkv_rs::request::{
    Backend, DeviceMemory, DeviceSide, HostGeometry, IndexArray, IndexMap, IndexWidth, Layout, Op,
    TransferRequest,
};
use hostkv_rs::{cpu, plan};

const PAGE: usize = 64;
const LAYERS: usize = 32;
/// 8 heads x 128 dims x bf16: one token, one layer, one of K/V.
const ITEM: usize = 2048;

fn index_array(v: &[i64]) -> IndexArray {
    IndexArray {
        ptr: v.as_ptr() as u64,
        len: v.len(),
        width: IndexWidth::I64,
        on_device: false,
        map: IndexMap::Identity,
    }
}

/// A two-plane MHA pool of `pages` host pages and as many device pages, indices shuffled by page.
struct Setup {
    host: Vec<u8>,
    dev: Vec<u8>,
    host_idx: Vec<i64>,
    dev_idx: Vec<i64>,
    rows: usize,
}

impl Setup {
    fn new(pages: usize) -> Self {
        let rows = pages * PAGE;
        let host_idx: Vec<i64> = (0..rows as i64).rev().collect::<Vec<_>>();
        // Reverse the page order but keep tokens within a page ascending (as the controller does).
        let host_idx = host_idx
            .chunks(PAGE)
            .flat_map(|c| c.iter().rev().copied())
            .collect();
        Self {
            // Zeroed allocations stay virtual: plan building never touches the pool bytes.
            host: vec![0; 2 * LAYERS * rows * ITEM],
            dev: vec![0; 2 * rows * ITEM],
            host_idx,
            dev_idx: (0..rows as i64).collect(),
            rows,
        }
    }

    /// The request borrows nothing: `self` must outlive it, untouched.
    fn load(&mut self, layout: Layout, backend: Backend) -> TransferRequest {
        let plane = (LAYERS * self.rows * ITEM) as u64;
        let host = self.host.as_mut_ptr() as u64;
        let dev = self.dev.as_mut_ptr() as u64;
        let geom = HostGeometry {
            layout,
            layers: LAYERS,
            rows: self.rows,
            page_size: PAGE,
            heads: 1,
            item_bytes: vec![ITEM, ITEM],
            plane_base: vec![host, host + plane],
        };
        let device = DeviceSide {
            layer_ptrs: vec![dev, dev + (self.rows * ITEM) as u64],
            rows: self.rows,
            row_pitch: None,
            memory: DeviceMemory::Host,
        };
        let op = Op::Load {
            host_layer: LAYERS - 1,
        };
        // SAFETY: two host planes of L*S*I bytes in `self.host`, two device layers of S*I bytes
        // in `self.dev`, index vectors of `rows` elements: all alive and untouched while the
        // request is used (the benchmark keeps `self`).
        unsafe {
            TransferRequest::new(
                geom,
                backend,
                op,
                device,
                index_array(&self.host_idx),
                index_array(&self.dev_idx),
            )
        }
    }
}

fn plan_building(c: &mut Criterion) {
    let mut g = c.benchmark_group("plan_build_load");
    g.measurement_time(Duration::from_secs(2))
        .warm_up_time(Duration::from_millis(500));
    for pages in [1usize, 64] {
        let mut s = Setup::new(pages);
        for (name, layout, backend) in [
            ("direct_pfd", Layout::PageFirstDirect, Backend::Direct),
            ("direct_lf", Layout::LayerFirst, Backend::Direct),
            ("kernel_pf", Layout::PageFirst, Backend::Kernel),
        ] {
            let req = s.load(layout, backend);
            g.bench_with_input(BenchmarkId::new(name, pages), &req, |b, req| {
                b.iter(|| black_box(plan::build(black_box(req)).unwrap().bytes()))
            });
        }
    }
    g.finish();
}

/// A load of one layer_first layer of `item`-byte rows: host row `from[k]` -> device row `to[k]`
/// (one plane of `src.len() / item` rows into `dst.len() / item` device rows).
///
/// # Safety
/// `src`, `dst`, `from` and `to` outlive the request and are not touched while it is used.
unsafe fn gather(
    src: &mut [u8],
    dst: &mut [u8],
    item: usize,
    from: &[i64],
    to: &[i64],
    backend: Backend,
) -> TransferRequest {
    let geom = HostGeometry {
        layout: Layout::LayerFirst,
        layers: 1,
        rows: src.len() / item,
        page_size: 1,
        heads: 1,
        item_bytes: vec![item],
        plane_base: vec![src.as_mut_ptr() as u64],
    };
    let device = DeviceSide {
        layer_ptrs: vec![dst.as_mut_ptr() as u64],
        rows: dst.len() / item,
        row_pitch: None,
        memory: DeviceMemory::Host,
    };
    let op = Op::Load { host_layer: 0 };
    // SAFETY: the plane and the device layer are the two slices (rows * item bytes each), the
    // index arrays the two index slices; the caller keeps all four alive and untouched.
    unsafe {
        TransferRequest::new(
            geom,
            backend,
            op,
            device,
            index_array(from),
            index_array(to),
        )
    }
}

/// Gathers `n` items of `item` bytes from shuffled places into one contiguous buffer, compared
/// with one run of the same bytes through the engine and with one memcpy.
fn engine_bandwidth(c: &mut Criterion) {
    let mut g = c.benchmark_group("cpu_engine");
    g.sample_size(20)
        .measurement_time(Duration::from_secs(3))
        .warm_up_time(Duration::from_millis(500));
    let total = 32usize << 20;
    for item in [2usize << 10, 128 << 10] {
        let n = total / item;
        let mut src = vec![7u8; total];
        let mut dst = vec![0u8; total];
        // A fixed stride permutation: neighbours in dst are far apart in src.
        let stride = (n / 2 + 1) | 1;
        let from: Vec<i64> = (0..n).map(|k| ((k * stride) % n) as i64).collect();
        let to: Vec<i64> = (0..n as i64).collect();
        g.throughput(Throughput::Bytes(total as u64));
        {
            // SAFETY: all four buffers outlive the request and are only used through it.
            let req = unsafe { gather(&mut src, &mut dst, item, &from, &to, Backend::Kernel) };
            let plan = plan::build(&req).unwrap();
            g.bench_function(BenchmarkId::new("gather", item), |b| {
                b.iter(|| cpu::execute(black_box(&plan)).unwrap())
            });
        }
        {
            // SAFETY: as above.
            let req = unsafe { gather(&mut src, &mut dst, item, &to, &to, Backend::Direct) };
            let plan = plan::build(&req).unwrap();
            g.bench_function(BenchmarkId::new("memcpy_engine", item), |b| {
                b.iter(|| cpu::execute(black_box(&plan)).unwrap())
            });
        }
        g.bench_function(BenchmarkId::new("memcpy_single_thread", item), |b| {
            b.iter(|| dst.copy_from_slice(black_box(&src)))
        });
    }
    g.finish();
}

/// Where splitting starts to pay: plans of 2 KiB items (a page of 64 tokens is 128 KiB per plane
/// and layer) of 64 KiB to 4 MiB through `execute` (pool workers above `PARALLEL_THRESHOLD`) and
/// through `execute_serial`. Sources cycle through 8 buffers, as per-layer loads cycle layers.
fn engine_split(c: &mut Criterion) {
    let mut g = c.benchmark_group("cpu_engine_split");
    g.sample_size(30)
        .measurement_time(Duration::from_secs(1))
        .warm_up_time(Duration::from_millis(300));
    for total in [
        64usize << 10,
        128 << 10,
        256 << 10,
        512 << 10,
        1 << 20,
        2 << 20,
        4 << 20,
    ] {
        let item = 2048;
        let n = total / item;
        let mut srcs: Vec<Vec<u8>> = (0..8).map(|i| vec![i as u8; total]).collect();
        let mut dst = vec![0u8; total];
        let from: Vec<i64> = (0..n as i64).rev().collect();
        let to: Vec<i64> = (0..n as i64).collect();
        let reqs: Vec<TransferRequest> = srcs
            .iter_mut()
            // SAFETY: sources, destination and indices outlive the requests; the destination is
            // shared by the requests but they run one at a time.
            .map(|src| unsafe { gather(src, &mut dst, item, &from, &to, Backend::Kernel) })
            .collect();
        let plans: Vec<plan::Plan<'_>> = reqs.iter().map(|r| plan::build(r).unwrap()).collect();
        g.throughput(Throughput::Bytes(total as u64));
        let mut i = 0;
        g.bench_function(BenchmarkId::new("execute", total >> 10), |b| {
            b.iter(|| {
                i = (i + 1) % plans.len();
                cpu::execute(black_box(&plans[i])).unwrap()
            })
        });
        g.bench_function(BenchmarkId::new("serial", total >> 10), |b| {
            b.iter(|| {
                i = (i + 1) % plans.len();
                cpu::execute_serial(black_box(&plans[i])).unwrap()
            })
        });
    }
    g.finish();
}

/// Issue 13's case, scaled down: a page_head backup with 16-byte head segments (8 heads of 16
/// bytes, 32 layers, K and V), 64 MiB moved, host pages in shuffled order. The plan is built
/// and run per iteration (it holds no per-copy records, so building it is one index pass).
fn page_head_backup(c: &mut Criterion) {
    let mut g = c.benchmark_group("page_head_backup_16b");
    g.sample_size(10)
        .measurement_time(Duration::from_secs(3))
        .warm_up_time(Duration::from_millis(500));
    let (layers, heads, seg) = (32usize, 8usize, 16usize);
    let item = heads * seg;
    let rows = 8192usize; // 2 planes x 32 layers x 8192 rows x 128 B = 64 MiB
    let plane = layers * rows * item;
    let mut host = vec![1u8; 2 * plane];
    let mut dev: Vec<Vec<u8>> = (0..2 * layers)
        .map(|k| vec![k as u8; rows * item])
        .collect();
    let pages = rows / PAGE;
    let from: Vec<i64> = (0..pages)
        .flat_map(|k| {
            let hp = (k * 37) % pages;
            (0..PAGE).map(move |r| (hp * PAGE + r) as i64)
        })
        .collect();
    let to: Vec<i64> = (0..rows as i64).collect();
    let hb = host.as_mut_ptr() as u64;
    let geom = HostGeometry {
        layout: Layout::PageHead,
        layers,
        rows,
        page_size: PAGE,
        heads,
        item_bytes: vec![item, item],
        plane_base: vec![hb, hb + plane as u64],
    };
    let device = DeviceSide {
        layer_ptrs: dev.iter_mut().map(|d| d.as_mut_ptr() as u64).collect(),
        rows,
        row_pitch: None,
        memory: DeviceMemory::Host,
    };
    // SAFETY: the host planes are `host` (2 x L*S*I bytes), each device layer one `dev` vector of
    // S*I bytes, the indices `from`/`to`; all outlive the request and are used only through it.
    let req = unsafe {
        TransferRequest::new(
            geom,
            Backend::Kernel,
            Op::Backup,
            device,
            index_array(&from),
            index_array(&to),
        )
    };
    g.throughput(Throughput::Bytes(2 * plane as u64));
    g.bench_function("build_and_execute", |b| {
        b.iter(|| cpu::execute(&plan::build(black_box(&req)).unwrap()).unwrap())
    });
    g.finish();
}

criterion_group!(
    benches,
    plan_building,
    engine_bandwidth,
    engine_split,
    page_head_backup
);
criterion_main!(benches);
