//! The engine's CPU cost per page (issue #14): a kv4k-shaped pipelined transfer through
//! real [`GpuRegion`](super::region::GpuRegion)s of the simulated driver with the bytes
//! not moved (`dry`), so that only the engine's own work (checking ops, items, path
//! choice, kernel descriptors, batches) is timed or counted. `cargo test --release -p
//! umbp-gpu --lib engine::cost -- --ignored --nocapture`; under
//! `valgrind --tool=callgrind` the inclusive instructions of `transfer_pipelined` divided
//! by the pages moved give instructions per page (docs/history/benchmarks-2026-11.md, fifth pass).

use std::sync::atomic::Ordering;
use std::time::Instant;

use super::backend::GpuBackend;
use super::sim::simulated;
use crate::gather::{Calibration, GatherConfig, GatherMode, GatherState, Point};
use crate::{new_registration, Backend, CopyOp, DeviceRegion, Dir, EngineConfig, Fence, MemoryKind, Peer, StagePlan, TransferArgs};

/// kv4k of issue #14: 80 layers, K and V pages of 4 KiB apart, 625 blocks (10k tokens).
const LAYERS: usize = 80;
const BLOCKS: u64 = 625;
const PAGE: u64 = 4096;
/// The pool's default stage (`--copy-stage-size` 64 MiB): 7 stages for 400 MB.
const STAGES: usize = 7;

/// Made-up addresses: nothing is dereferenced in dry mode but the descriptors.
const HOST_BASE: usize = 0x7f00_0000_0000;
const DEV_BASE: u64 = 0x10_0000_0000;

struct Setup {
    backend: GpuBackend<super::sim::SimulatedDevice>,
    regions: Vec<Box<dyn DeviceRegion>>,
}

fn setup(crossover: usize) -> Setup {
    let (mut api, _) = simulated(usize::MAX, true, false);
    api.dry = true;
    api.alloc_len = 2 * BLOCKS * PAGE;
    let backend = GpuBackend::new(api);
    let object = LAYERS as u64 * 2 * PAGE;
    // SAFETY: the simulated driver registers nothing; the range is only compared.
    unsafe { backend.register_host_memory(HOST_BASE as *mut u8, (BLOCKS * object) as usize) }.unwrap();
    // Copy engines at open: no calibration (the test sets its own below).
    let engine =
        EngineConfig { gather: GatherConfig { mode: GatherMode::CopyEngine, ..GatherConfig::default() }, ..EngineConfig::default() };
    let peer = Peer { attachment: 0, pid: std::process::id(), pidfd: None, verify: &|| Ok(()), engine };
    let regions: Vec<Box<dyn DeviceRegion>> = (0..LAYERS)
        .map(|l| {
            let mut reg = new_registration(MemoryKind::Cuda, l as u32, DEV_BASE + (l as u64) * (64 << 20), 0, 2 * BLOCKS * PAGE);
            reg.device_uuid = [7; 16];
            backend.open_region_for(&reg, None, &peer).unwrap()
        })
        .collect();
    let p = |page| Point { page, d2h_ce_gbps: 10.0, d2h_kernel_gbps: 40.0, h2d_ce_gbps: 10.0, h2d_kernel_gbps: 40.0, ..Point::default() };
    let engines = backend.shared.engines.lock().unwrap();
    let engine = engines.values().next().unwrap();
    let points = if crossover == 0 { vec![] } else { vec![p(crossover)] };
    assert!(engine.gather.set(Some(GatherState { kernel: 1, calibration: Calibration::from_points(points, 2) })).is_ok());
    drop(engines);
    Setup { backend, regions }
}

/// The pool's plan of stage `s` (pool/src/copy/transfer.rs `copy`): per allocation, per
/// block, its K and V page; objects lie one after the other in pool memory.
fn plan(regions: &[Box<dyn DeviceRegion>], s: usize) -> StagePlan<'_> {
    let object = LAYERS as u64 * 2 * PAGE;
    let n = BLOCKS as usize;
    regions
        .iter()
        .enumerate()
        .map(|(l, r)| {
            let mut ops = Vec::new();
            for b in (s * n / STAGES) as u64..((s + 1) * n / STAGES) as u64 {
                for kv in 0..2u64 {
                    ops.push(CopyOp {
                        alloc_id: l as u32,
                        device_offset: kv * BLOCKS * PAGE + b * PAGE,
                        host_offset: b * object + (2 * l as u64 + kv) * PAGE,
                        len: PAGE,
                    });
                }
            }
            (r.as_ref(), ops)
        })
        .collect()
}

/// Runs the pipelined transfer `reps` times each way with the plans built beforehand;
/// returns ns per page and the pages of one transfer.
fn run(setup: &Setup, gather: GatherMode, reps: usize) -> (f64, usize) {
    let pages = LAYERS * 2 * BLOCKS as usize;
    let mut ns = 0u128;
    for rep in 0..reps {
        for dir in [Dir::DeviceToHost, Dir::HostToDevice] {
            let mut plans: Vec<Option<StagePlan<'_>>> = (0..STAGES).map(|s| Some(plan(&setup.regions, s))).collect();
            let engine = EngineConfig { gather: GatherConfig { mode: gather, ..GatherConfig::default() }, ..EngineConfig::default() };
            let args = TransferArgs {
                dir,
                host_base: HOST_BASE as *mut u8,
                fence: Fence::None,
                fence_timeout: crate::fence::FENCE_TIMEOUT,
                keep_waiting: &|| true,
                engine,
            };
            let mut done = 0;
            let t = Instant::now();
            // SAFETY: dry simulated driver: no byte is read or written.
            let r = unsafe { crate::transfer_pipelined(&args, STAGES, &mut |s| plans[s].take().unwrap(), &mut |_| done += 1) };
            if rep > 0 {
                ns += t.elapsed().as_nanos();
            }
            assert!(r.is_ok(), "{r:?}");
            assert_eq!(done, STAGES);
        }
    }
    (ns as f64 / ((reps.max(2) - 1) * 2 * pages) as f64, pages)
}

/// kv4k through the kernel path and through copy engines: ns per page (release build)
/// and the kernel launches / copies the simulated driver saw.
#[test]
#[ignore = "a measurement: run with --release --ignored --nocapture (docs/benchmarks.md)"]
fn kv4k_engine_cost_per_page() {
    let reps: usize = std::env::var("UMBP_COST_REPS").ok().and_then(|v| v.parse().ok()).unwrap_or(11);
    let only = std::env::var("UMBP_COST_MODE").unwrap_or_default();
    for (name, mode, crossover) in
        [("kernel", GatherMode::Auto, 16384), ("staged", GatherMode::Staged, 16384), ("copy-engine", GatherMode::CopyEngine, 0)]
    {
        if !only.is_empty() && only != name {
            continue;
        }
        let s = setup(crossover);
        let engines = s.backend.shared.engines.lock().unwrap().values().next().unwrap().clone();
        let (k0, c0) = (s.backend.shared.api.kernels.load(Ordering::Relaxed), s.backend.shared.api.copies.load(Ordering::Relaxed));
        let (ns, pages) = run(&s, mode, reps);
        let (k, c) = (s.backend.shared.api.kernels.load(Ordering::Relaxed) - k0, s.backend.shared.api.copies.load(Ordering::Relaxed) - c0);
        let stats = engines.stats.snapshot(0, [7; 16]);
        println!(
            "kv4k {name}: {ns:.1} ns/page ({pages} pages, {reps} reps x 2 dirs, first rep not timed), launches {k}, copies {c}, engine enqueue {:.1} ns/page",
            stats.enqueue_ns as f64 / stats.items.max(1) as f64
        );
    }
}
