use super::super::sim::{simulated, SimulatedDevice};
use super::*;
use std::sync::atomic::Ordering;

use crate::{Dir, EngineConfig};

/// A device-to-host transfer, no fence, default tuning.
fn args() -> TransferArgs<'static> {
    TransferArgs {
        dir: Dir::DeviceToHost,
        host_base: std::ptr::null_mut(),
        fence: Fence::None,
        fence_timeout: fence::FENCE_TIMEOUT,
        keep_waiting: &|| true,
        engine: EngineConfig::default(),
    }
}

/// 64 pages of 1 KiB "device" memory copied to host in 4 stages of 16 pages, each
/// stage built only when asked for. Returns the result, the stages reported, whether
/// each reported stage had landed when reported, and whether each stage was built only
/// after the one before had been handed to the driver.
fn staged_copy(api: &SimulatedDevice, engine: &Engine<SimulatedDevice>, lens: &[usize]) -> (Result<(), GpuError>, Vec<usize>, bool, bool) {
    let src: Vec<u8> = (0..64 * 1024).map(|i| (i % 251) as u8).collect();
    let mut dst = vec![0u8; src.len()];
    let dst_ptr = dst.as_mut_ptr();
    let stage_items = |s: usize| -> Vec<Item> {
        (s * 16..(s + 1) * 16)
            // SAFETY: offsets inside `dst`/`src`.
            .map(|i| Item { host: unsafe { dst_ptr.add(i * 1024) }, device: src[i * 1024..].as_ptr() as u64, len: lens[i] })
            .collect()
    };
    let stage_bytes = |s: usize| {
        // SAFETY: reads the test's buffer; the simulated copies ran synchronously.
        unsafe { std::slice::from_raw_parts(dst_ptr.add(s * 16 * 1024), 16 * 1024) }
    };
    let mut built_in_order = true;
    let mut build = |s: usize, items: &mut Vec<Item>| {
        built_in_order &= stage_bytes(s - 1) == &src[(s - 1) * 16 * 1024..s * 16 * 1024];
        items.extend(stage_items(s));
        Ok(())
    };
    let mut reported = Vec::new();
    let mut landed_when_reported = true;
    let mut done = |s: usize| {
        landed_when_reported &= stage_bytes(s) == &src[s * 16 * 1024..(s + 1) * 16 * 1024];
        reported.push(s);
    };
    // SAFETY: items point into `src`/`dst`, alive for the call.
    let r =
        unsafe { engine.run(api, &Call { args: &args(), stages: 4, signal: false, ranges: &[] }, stage_items(0), &mut build, &mut done) };
    (r, reported, landed_when_reported, built_in_order)
}

/// A panic in the caller's stage builder (a pool bug while it reserves the next
/// stage) must not unwind past copies still in flight: the pool unpins and may reuse
/// their memory while unwinding.
#[test]
fn a_panicking_stage_builder_drains_the_streams_first() {
    for events in [true, false] {
        let (api, engine) = simulated(usize::MAX, events, true);
        let src = vec![5u8; 4096];
        let mut dst = vec![0u8; 4096];
        let item = |i: usize, dst: *mut u8| Item { host: dst.wrapping_add(i * 1024), device: src[i * 1024..].as_ptr() as u64, len: 1024 };
        let dst_ptr = dst.as_mut_ptr();
        let mut build = |s: usize, items: &mut Vec<Item>| {
            if s == 2 {
                panic!("injected builder panic");
            }
            items.push(item(s, dst_ptr));
            Ok(())
        };
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            // SAFETY: items point into `src`/`dst`, alive for the call.
            unsafe {
                engine.run(
                    &api,
                    &Call { args: &args(), stages: 4, signal: false, ranges: &[] },
                    vec![item(0, dst_ptr)],
                    &mut build,
                    &mut |_| {},
                )
            }
        }));
        assert!(r.is_err(), "the panic goes on to the caller");
        assert!(api.syncs.load(Ordering::Relaxed) > 0, "streams left running under a panic (events {events})");
    }
}

#[test]
fn staged_run_reports_each_landed_stage_in_order() {
    for lag in [false, true] {
        let (api, engine) = simulated(usize::MAX, true, lag);
        let (r, reported, landed, in_order) = staged_copy(&api, &engine, &[1024; 64]);
        assert!(r.is_ok(), "{r:?}");
        assert_eq!(reported, vec![0, 1, 2, 3], "lag {lag}");
        assert!(landed, "a stage was reported before its bytes landed");
        assert!(in_order, "a stage was built before the one before it was enqueued");
        assert_eq!(api.copies.load(Ordering::Relaxed), 64);
    }
}

#[test]
fn staged_run_never_reports_a_failed_stage_or_later_ones() {
    let (api, engine) = simulated(13, true, false);
    let mut lens = vec![1024; 64];
    lens[40] = 13; // stage 2
    let (r, reported, landed, _) = staged_copy(&api, &engine, &lens);
    assert!(r.is_err());
    assert!(reported.len() <= 2 && reported.iter().enumerate().all(|(i, s)| i == *s), "{reported:?}");
    assert!(landed);
}

#[test]
fn without_events_a_staged_run_copies_everything_and_reports_nothing() {
    let (api, engine) = simulated(usize::MAX, false, false);
    let (r, reported, _, _) = staged_copy(&api, &engine, &[1024; 64]);
    assert!(r.is_ok());
    assert!(reported.is_empty(), "the caller reports the stages after the call");
    assert_eq!(api.copies.load(Ordering::Relaxed), 64);
    assert!(!engine.events.load(Ordering::Relaxed));
}

/// Issue #14 on the CPU stand-in: with a calibration saying the kernel wins up to
/// 16 KiB, a staged call of 4 KiB pages goes to the kernel (one launch per stage of
/// 1 MiB, no copy-engine copy), 64 KiB pages go to copy engines, pages outside
/// registered host memory never go to the kernel, and one 4 MiB object is cut for 4
/// streams. Bytes land right in every case.
#[test]
fn stages_take_the_path_the_calibration_chose() {
    use crate::gather::{Calibration, GatherConfig, GatherMode, GatherState, Point};
    let split = GatherConfig { split_streams: 4, ..GatherConfig::default() };
    let (api, engine) = simulated(usize::MAX, true, false);
    let p = |page| Point { page, d2h_ce_gbps: 10.0, d2h_kernel_gbps: 40.0, h2d_ce_gbps: 10.0, h2d_kernel_gbps: 40.0, ..Point::default() };
    let calibration = Calibration::from_points(vec![p(4096), p(16384)], 8);
    assert!(engine.gather.set(Some(GatherState { kernel: 1, calibration })).is_ok());
    let total = 4 << 20;
    let src: Vec<u8> = (0..total).map(|i| (i % 251) as u8).collect();
    let mut dst = vec![0u8; total];
    let dst_ptr = dst.as_mut_ptr();
    let registered = [(dst_ptr as usize, dst_ptr as usize + total)];
    // Pages of `page` bytes in reverse order; returns (kernel launches, copies).
    let run = |gather: GatherConfig, page: usize, stages: usize, ranges: &[(usize, usize)]| {
        let n = total / page;
        let per = n / stages;
        let stage = |s: usize| -> Vec<Item> {
            (s * per..(s + 1) * per)
                .map(|i| Item { host: dst_ptr.wrapping_add((n - 1 - i) * page), device: src[i * page..].as_ptr() as u64, len: page })
                .collect()
        };
        let (k0, c0) = (api.kernels.load(Ordering::Relaxed), api.copies.load(Ordering::Relaxed));
        // SAFETY: the test resets its own buffer while nothing copies.
        unsafe { std::ptr::write_bytes(dst_ptr, 0, total) };
        let mut build = |s: usize, items: &mut Vec<Item>| {
            items.extend(stage(s));
            Ok(())
        };
        let mut a = args();
        a.engine.gather = gather;
        // SAFETY: items point into `src`/`dst`, alive for the call.
        let r = unsafe { engine.run(&api, &Call { args: &a, stages, signal: false, ranges }, stage(0), &mut build, &mut |_| {}) };
        assert!(r.is_ok(), "{r:?}");
        for i in 0..n {
            // SAFETY: reads the test's buffer after the call.
            let got = unsafe { std::slice::from_raw_parts(dst_ptr.add((n - 1 - i) * page), page) };
            assert_eq!(got, &src[i * page..(i + 1) * page], "page {i} of {page} B");
        }
        (api.kernels.load(Ordering::Relaxed) - k0, api.copies.load(Ordering::Relaxed) - c0)
    };
    assert_eq!(run(split, 4096, 4, &registered), (4, 0), "4 KiB pages: one launch per stage");
    assert_eq!(run(split, 16384, 1, &registered), (1, 0), "4 MiB of 16 KiB pages: one launch");
    assert_eq!(run(split, 65536, 4, &registered), (0, 64), "64 KiB pages: copy engines");
    assert_eq!(run(split, 4096, 2, &[]), (0, 1024), "unregistered host memory: copy engines");
    assert_eq!(run(split, total, 1, &registered), (0, 4), "one 4 MiB object: cut for 4 streams");
    assert_eq!(run(split, total / 4, 1, &registered), (0, 4), "1 MiB objects: not cut");
    assert_eq!(run(GatherConfig { split_streams: 1, ..split }, total, 1, &registered), (0, 1), "split off: one copy");
    assert_eq!(run(GatherConfig::default(), total, 1, &registered), (0, 1), "no split by default");
    // The mode each call passes is the one it follows (no process-wide setting).
    let ce = GatherConfig { mode: GatherMode::CopyEngine, ..split };
    assert_eq!(run(ce, 4096, 4, &registered), (0, 1024), "copy engines forced: no launch");
    let kernel = GatherConfig { mode: GatherMode::Kernel, ..split };
    assert_eq!(run(kernel, 65536, 4, &registered), (4, 0), "kernel forced: 64 KiB pages too");
    assert_eq!(run(kernel, 4096, 2, &[]), (0, 1024), "kernel forced, unregistered: copy engines");
    let cut = GatherConfig { launch_bytes: 256 << 10, ..split };
    assert_eq!(run(cut, 4096, 4, &registered), (16, 0), "1 MiB stages cut into 256 KiB launches");
    let _ = &mut dst;
}

/// Issue #14, staged path on the CPU stand-in: pages that come layer by layer (as the
/// pool's copy calls hand them) but lie object by object in pool memory are gathered
/// into device staging chunks and moved as one copy per object, in both directions,
/// over several chunks (the 3 staging slots reused); bytes land right. A layout whose
/// host runs are short, and the other modes, do not stage.
#[test]
fn staged_mode_moves_whole_objects_through_device_staging() {
    use crate::gather::{Calibration, GatherConfig, GatherMode, GatherState, Point};
    let (api, engine) = simulated(usize::MAX, true, false);
    assert!(engine.gather.set(Some(GatherState { kernel: 1, calibration: Calibration::from_points(vec![], 8) })).is_ok());
    let (layers, objects, page) = (16usize, 96usize, 4096usize);
    let total = layers * objects * page;
    // Device: layer-major (one allocation per layer); host: object-major.
    let dev: Vec<u8> = (0..total).map(|i| (i % 249) as u8).collect();
    let mut host = vec![0u8; total];
    let host_ptr = host.as_mut_ptr();
    let mut items = Vec::new();
    for l in 0..layers {
        for o in 0..objects {
            items.push(Item {
                host: host_ptr.wrapping_add((o * layers + l) * page),
                device: dev[(l * objects + o) * page..].as_ptr() as u64,
                len: page,
            });
        }
    }
    let cfg = EngineConfig {
        gather: GatherConfig { mode: GatherMode::Staged, ..GatherConfig::default() },
        stage_bytes: 1 << 20,
        ..Default::default()
    };
    let run = |dir: Dir, items: Vec<Item>, cfg: EngineConfig| {
        let mut a = args();
        a.dir = dir;
        a.engine = cfg;
        let (k0, c0, s0) = (api.kernels.load(Ordering::Relaxed), api.copies.load(Ordering::Relaxed), api.joins.load(Ordering::Relaxed));
        // SAFETY: items point into `dev`/`host`, alive for the call.
        let r =
            unsafe { engine.run(&api, &Call { args: &a, stages: 1, signal: false, ranges: &[] }, items, &mut |_, _| Ok(()), &mut |_| {}) };
        assert!(r.is_ok(), "{r:?}");
        (api.kernels.load(Ordering::Relaxed) - k0, api.copies.load(Ordering::Relaxed) - c0, api.joins.load(Ordering::Relaxed) - s0)
    };
    let check = |host: &[u8]| {
        for l in 0..layers {
            for o in 0..objects {
                let (h, d) = ((o * layers + l) * page, (l * objects + o) * page);
                assert_eq!(&host[h..h + page], &dev[d..d + page], "layer {l} object {o}");
            }
        }
    };
    // Store: 6 MiB in 1 MiB chunks of 16 objects (64 KiB each, adjacent in pool
    // memory): one gather and one DMA per chunk.
    let (k, c, chunks) = run(Dir::DeviceToHost, items.clone(), cfg);
    assert_eq!((k, c, chunks), (6, 6, 6), "one gather and one host run per chunk");
    check(&host);
    // Load back into a cleared device copy: scatter per chunk.
    let mut dev2 = vec![0u8; total];
    let back: Vec<Item> =
        items.iter().map(|it| Item { device: it.device - dev.as_ptr() as u64 + dev2.as_mut_ptr() as u64, ..*it }).collect();
    let (k, c, chunks) = run(Dir::HostToDevice, back, cfg);
    assert_eq!((k, c, chunks), (6, 6, 6));
    assert_eq!(dev2, dev, "loaded bytes");
    assert!(engine.idle.lock().unwrap().iter().all(|s| s.staging.as_ref().is_some_and(|s| s.chunk == 1 << 20)));
    // Every other object: still whole objects, one DMA each.
    let halves: Vec<Item> = items.iter().step_by(2).copied().collect();
    assert_eq!(run(Dir::DeviceToHost, halves, cfg), (3, objects / 2, 3));
    check(&host);
    // Short host runs (one layer: a 4 KiB page per object): not staged, the
    // calibration's path (copy engines here).
    let scattered: Vec<Item> = items[..objects].to_vec();
    let n = scattered.len();
    // SAFETY: the test clears its own buffer while nothing copies.
    unsafe { std::ptr::write_bytes(host_ptr, 0, total) };
    assert_eq!(run(Dir::DeviceToHost, scattered, cfg), (0, n, 0));
    // Auto, under a calibration where staging never won: not staged.
    let auto = EngineConfig { gather: GatherConfig::default(), ..cfg };
    assert_eq!(run(Dir::DeviceToHost, items.clone(), auto).2, 0);
    // Auto on a GPU whose calibration found staging fastest for 4 KiB stores only
    // (loads: the direct kernel won): stores stage, loads take the kernel, and a
    // forced mode overrides the calibration.
    let point = Point {
        page,
        d2h_ce_gbps: 5.0,
        d2h_kernel_gbps: 40.0,
        h2d_ce_gbps: 5.0,
        h2d_kernel_gbps: 40.0,
        d2h_staged_gbps: 50.0,
        h2d_staged_gbps: 30.0,
    };
    let (api2, engine2) = simulated(usize::MAX, true, false);
    assert!(engine2.gather.set(Some(GatherState { kernel: 1, calibration: Calibration::from_points(vec![point], 8) })).is_ok());
    let run2 = |dir: Dir, items: Vec<Item>, mode: GatherMode| {
        let mut a = args();
        a.dir = dir;
        a.engine = EngineConfig { gather: GatherConfig { mode, ..GatherConfig::default() }, ..cfg };
        let (k0, c0, s0) = (api2.kernels.load(Ordering::Relaxed), api2.copies.load(Ordering::Relaxed), api2.joins.load(Ordering::Relaxed));
        let registered = [(host_ptr as usize, host_ptr as usize + total)];
        // SAFETY: items point into `dev`/`host`, alive for the call.
        let r = unsafe {
            engine2.run(&api2, &Call { args: &a, stages: 1, signal: false, ranges: &registered }, items, &mut |_, _| Ok(()), &mut |_| {})
        };
        assert!(r.is_ok(), "{r:?}");
        (api2.kernels.load(Ordering::Relaxed) - k0, api2.copies.load(Ordering::Relaxed) - c0, api2.joins.load(Ordering::Relaxed) - s0)
    };
    // SAFETY: the test clears its own buffer while nothing copies.
    unsafe { std::ptr::write_bytes(host_ptr, 0, total) };
    assert_eq!(run2(Dir::DeviceToHost, items.clone(), GatherMode::Auto), (6, 6, 6), "auto store: staged");
    check(&host);
    dev2.fill(0);
    let back2: Vec<Item> =
        items.iter().map(|it| Item { device: it.device - dev.as_ptr() as u64 + dev2.as_mut_ptr() as u64, ..*it }).collect();
    let (k, c, chunks) = run2(Dir::HostToDevice, back2, GatherMode::Auto);
    assert_eq!((c, chunks), (0, 0), "auto load: the direct kernel, no staging");
    assert!(k > 0);
    assert_eq!(dev2, dev, "loaded bytes");
    assert_eq!(run2(Dir::DeviceToHost, items.clone(), GatherMode::Kernel).2, 0, "forced kernel: not staged");
    assert_eq!(run2(Dir::DeviceToHost, items.clone(), GatherMode::CopyEngine), (0, items.len(), 0), "forced copy engines");
    let _ = &mut host;
}

/// Copies that are not staged keep the configured stream count on a GPU whose
/// calibration stages small pages, although the stream set then holds staging's
/// second stream: 64 KiB pages spread over both ran ~2 % slower on the H200
/// (docs/history/benchmarks-2026-11.md, sixth pass).
#[test]
fn unstaged_copies_keep_the_configured_streams_where_staging_is_calibrated() {
    use crate::gather::{Calibration, GatherState, Point};
    let (api, engine) = simulated(usize::MAX, true, false);
    let point = Point {
        page: 4096,
        d2h_ce_gbps: 5.0,
        d2h_kernel_gbps: 40.0,
        h2d_ce_gbps: 5.0,
        h2d_kernel_gbps: 40.0,
        d2h_staged_gbps: 50.0,
        h2d_staged_gbps: 50.0,
    };
    assert!(engine.gather.set(Some(GatherState { kernel: 1, calibration: Calibration::from_points(vec![point], 8) })).is_ok());
    let (pages, page) = (64usize, 64usize << 10);
    let src: Vec<u8> = (0..pages * page).map(|i| (i % 253) as u8).collect();
    let mut dst = vec![0u8; src.len()];
    let dst_ptr = dst.as_mut_ptr();
    // Pages in reverse order on the host side: 64 copies, none contiguous with the next.
    let items: Vec<Item> = (0..pages)
        .map(|i| Item { host: dst_ptr.wrapping_add((pages - 1 - i) * page), device: src[i * page..].as_ptr() as u64, len: page })
        .collect();
    let registered = [(dst_ptr as usize, dst_ptr as usize + dst.len())];
    // SAFETY: items point into `src`/`dst`, alive for the call.
    let r = unsafe {
        engine.run(&api, &Call { args: &args(), stages: 1, signal: false, ranges: &registered }, items, &mut |_, _| Ok(()), &mut |_| {})
    };
    assert!(r.is_ok(), "{r:?}");
    for i in 0..pages {
        assert_eq!(&dst[(pages - 1 - i) * page..(pages - i) * page], &src[i * page..(i + 1) * page], "page {i}");
    }
    assert_eq!(api.kernels.load(Ordering::Relaxed), 0, "64 KiB pages: copy engines");
    assert_eq!(api.streams_made.load(Ordering::Relaxed), 2, "the set holds staging's second stream");
    let used: std::collections::BTreeSet<usize> = api.batch_streams.lock().unwrap().iter().copied().collect();
    assert_eq!(used.len(), 1, "copies spread over streams {used:?}; the config has one");
}

/// Pages over a descriptor's maximum (64 KiB) through device staging: each is cut into
/// several descriptors of the stage's one list, and the bytes land right both ways.
#[test]
fn staged_pages_over_a_descriptor_are_cut_and_land_right() {
    use crate::gather::{Calibration, GatherConfig, GatherMode, GatherState, DESC_MAX};
    let (api, engine) = simulated(usize::MAX, true, false);
    assert!(engine.gather.set(Some(GatherState { kernel: 1, calibration: Calibration::from_points(vec![], 8) })).is_ok());
    let (pages, page) = (24usize, DESC_MAX + DESC_MAX / 2);
    let dev: Vec<u8> = (0..pages * page).map(|i| (i % 241) as u8).collect();
    let mut host = vec![0u8; pages * page];
    let host_ptr = host.as_mut_ptr();
    // Device pages in reverse order, host packed: one contiguous host run.
    let items: Vec<Item> = (0..pages)
        .map(|i| Item { host: host_ptr.wrapping_add(i * page), device: dev[(pages - 1 - i) * page..].as_ptr() as u64, len: page })
        .collect();
    let mut a = args();
    a.engine = EngineConfig {
        gather: GatherConfig { mode: GatherMode::Staged, ..GatherConfig::default() },
        stage_bytes: 1 << 20,
        ..Default::default()
    };
    let k0 = api.kernels.load(Ordering::Relaxed);
    // SAFETY: items point into `dev`/`host`, alive for the call.
    let r = unsafe {
        engine.run(&api, &Call { args: &a, stages: 1, signal: false, ranges: &[] }, items.clone(), &mut |_, _| Ok(()), &mut |_| {})
    };
    assert!(r.is_ok(), "{r:?}");
    assert!(api.kernels.load(Ordering::Relaxed) > k0, "staged: the gather kernel ran");
    for i in 0..pages {
        assert_eq!(&host[i * page..(i + 1) * page], &dev[(pages - 1 - i) * page..(pages - i) * page], "page {i}");
    }
    let mut dev2 = vec![0u8; dev.len()];
    let back: Vec<Item> =
        items.iter().map(|it| Item { device: it.device - dev.as_ptr() as u64 + dev2.as_mut_ptr() as u64, ..*it }).collect();
    a.dir = Dir::HostToDevice;
    // SAFETY: as above.
    let r = unsafe { engine.run(&api, &Call { args: &a, stages: 1, signal: false, ranges: &[] }, back, &mut |_, _| Ok(()), &mut |_| {}) };
    assert!(r.is_ok(), "{r:?}");
    assert_eq!(dev2, dev, "loaded bytes");
    let _ = &mut host;
}

/// The tuning a transfer passes is the one its copy call uses (it used to be read from
/// process-wide statics): streams, batch maximum and batching.
#[test]
fn a_call_uses_the_engine_config_it_is_given() {
    let (api, engine) = simulated(usize::MAX, true, false);
    let src = vec![3u8; 300 * 1024];
    let mut dst = vec![0u8; src.len()];
    let items: Vec<Item> = (0..300)
        // SAFETY: offsets inside `dst`.
        .map(|i| Item { host: unsafe { dst.as_mut_ptr().add(i * 1024) }, device: src[i * 1024..].as_ptr() as u64, len: 1024 })
        .collect();
    let mut tuned = args();
    tuned.engine.streams = 3;
    tuned.engine.batch_max = 20;
    tuned.engine.batch = false;
    // SAFETY: items point into `src`/`dst`, alive for the call.
    let r =
        unsafe { engine.run(&api, &Call { args: &tuned, stages: 1, signal: false, ranges: &[] }, items, &mut |_, _| Ok(()), &mut |_| {}) };
    assert!(r.is_ok(), "{r:?}");
    assert_eq!(dst, src);
    assert_eq!(api.streams_made.load(Ordering::Relaxed), 3, "streams of the config");
    let batches = api.batches.lock().unwrap().clone();
    assert!(batches.iter().all(|&(n, batch)| n <= 20 && !batch), "{batches:?}");
    assert_eq!(batches.iter().map(|b| b.0).sum::<usize>(), 300);
    assert!(batches.iter().any(|&(n, _)| n == 20), "batches grow to the configured maximum: {batches:?}");
}

/// Counters are per engine: a call on one engine shows in its counters only.
#[test]
fn counters_are_per_engine() {
    let (api, engine) = simulated(usize::MAX, true, false);
    let (_, other) = simulated(usize::MAX, true, false);
    let (r, reported, _, _) = staged_copy(&api, &engine, &[1024; 64]);
    assert!(r.is_ok() && reported.len() == 4);
    let s = engine.stats.snapshot(0, [7; 16]);
    assert_eq!((s.calls, s.items, s.bytes, s.stages), (1, 64, 64 * 1024, 4), "{s:?}");
    assert!(s.total_ns >= s.enqueue_ns);
    assert_eq!(other.stats.snapshot(0, [7; 16]).calls, 0);
    // Summed over engines (the bench's totals): counters add, identity stays.
    let mut total = other.stats.snapshot(1, [9; 16]);
    total.add(&s);
    total.add(&s);
    assert_eq!((total.ordinal, total.calls, total.items, total.bytes, total.stages), (1, 2, 128, 128 * 1024, 8));
    assert_eq!((total.total_ns, total.enqueue_ns), (2 * s.total_ns, 2 * s.enqueue_ns));
}
