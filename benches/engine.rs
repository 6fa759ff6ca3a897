//! Plan building (the per-call overhead of a load) and CPU engine bandwidth.
//!
//! `cargo bench --bench engine` (add `-- --quick` for a short run).

use std::hint::black_box;
use std::time::Duration;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use hostkv_rs::transfer::{
    Backend, DeviceSide, HostGeometry, IndexArray, IndexWidth, Layout, Op, TransferRequest,
};
use hostkv_rs::{cpu, plan};

const PAGE: usize = 64;
const LAYERS: usize = 32;
/// 8 heads x 128 dims x bf16: one token, one layer, one of K/V.
const ITEM: usize = 2048;

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

    fn load(&mut self, layout: Layout, backend: Backend) -> TransferRequest {
        let plane = (LAYERS * self.rows * ITEM) as u64;
        let host = self.host.as_mut_ptr() as u64;
        let dev = self.dev.as_mut_ptr() as u64;
        TransferRequest {
            geom: HostGeometry {
                layout,
                layers: LAYERS,
                rows: self.rows,
                page_size: PAGE,
                heads: 1,
                item_bytes: vec![ITEM, ITEM],
                plane_base: vec![host, host + plane],
            },
            backend,
            op: Op::Load {
                host_layer: LAYERS - 1,
            },
            device: DeviceSide {
                layer_ptrs: vec![dev, dev + (self.rows * ITEM) as u64],
                rows: self.rows,
            },
            host_idx: IndexArray {
                ptr: self.host_idx.as_ptr() as u64,
                len: self.rows,
                width: IndexWidth::I64,
                on_device: false,
            },
            dev_idx: IndexArray {
                ptr: self.dev_idx.as_ptr() as u64,
                len: self.rows,
                width: IndexWidth::I64,
                on_device: false,
            },
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
                b.iter(|| black_box(plan::build(black_box(req)).unwrap()))
            });
        }
    }
    g.finish();
}

/// Gathers `n` items of `item` bytes from shuffled places into one contiguous buffer, compared
/// with one memcpy of the same bytes.
fn engine_bandwidth(c: &mut Criterion) {
    let mut g = c.benchmark_group("cpu_engine");
    g.sample_size(20)
        .measurement_time(Duration::from_secs(3))
        .warm_up_time(Duration::from_millis(500));
    let total = 32usize << 20;
    for item in [2usize << 10, 128 << 10] {
        let n = total / item;
        let src = vec![7u8; total];
        let mut dst = vec![0u8; total];
        // A fixed stride permutation: neighbours in dst are far apart in src.
        let stride = (n / 2 + 1) | 1;
        let ops: Vec<plan::CopyOp> = (0..n)
            .map(|k| plan::CopyOp {
                src: src.as_ptr() as u64 + ((k * stride) % n * item) as u64,
                dst: dst.as_mut_ptr() as u64 + (k * item) as u64,
                len: item as u64,
            })
            .collect();
        g.throughput(Throughput::Bytes(total as u64));
        g.bench_function(BenchmarkId::new("gather", item), |b| {
            // SAFETY: every op lies inside `src` / `dst`, which outlive the benchmark.
            b.iter(|| unsafe { cpu::execute(black_box(&ops)) })
        });
        let one = [plan::CopyOp {
            src: src.as_ptr() as u64,
            dst: dst.as_mut_ptr() as u64,
            len: total as u64,
        }];
        g.bench_function(BenchmarkId::new("memcpy_engine", item), |b| {
            // SAFETY: as above.
            b.iter(|| unsafe { cpu::execute(black_box(&one)) })
        });
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
        let srcs: Vec<Vec<u8>> = (0..8).map(|i| vec![i as u8; total]).collect();
        let mut dst = vec![0u8; total];
        let plans: Vec<Vec<plan::CopyOp>> = srcs
            .iter()
            .map(|src| {
                (0..n)
                    .map(|k| plan::CopyOp {
                        src: src.as_ptr() as u64 + ((n - 1 - k) * item) as u64,
                        dst: dst.as_mut_ptr() as u64 + (k * item) as u64,
                        len: item as u64,
                    })
                    .collect()
            })
            .collect();
        g.throughput(Throughput::Bytes(total as u64));
        let mut i = 0;
        g.bench_function(BenchmarkId::new("execute", total >> 10), |b| {
            b.iter(|| {
                i = (i + 1) % plans.len();
                // SAFETY: every op lies inside a source buffer and `dst`, which outlive this.
                unsafe { cpu::execute(black_box(&plans[i])) }
            })
        });
        g.bench_function(BenchmarkId::new("serial", total >> 10), |b| {
            b.iter(|| {
                i = (i + 1) % plans.len();
                // SAFETY: as above.
                unsafe { cpu::execute_serial(black_box(&plans[i])) }
            })
        });
    }
    g.finish();
}

criterion_group!(benches, plan_building, engine_bandwidth, engine_split);
criterion_main!(benches);
