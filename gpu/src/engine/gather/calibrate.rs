//! The calibration (see gather.rs): on a GPU's first use, copy engines, the page copy
//! kernel and device staging are timed for pages of 4 KiB to 128 KiB in both directions,
//! and the kernel's block count is picked.

use super::*;

/// Page sizes the calibration measures.
pub(crate) const CALIBRATION_PAGES: [usize; 6] = [4 << 10, 8 << 10, 16 << 10, 32 << 10, 64 << 10, 128 << 10];
/// Bytes moved per calibration measurement.
const CALIBRATION_BYTES: usize = 16 << 20;
/// Staging chunk of the calibration: 4 chunks per pass, so that gathers and DMAs overlap
/// as in a transfer's stages.
const CALIBRATION_STAGE_CHUNK: usize = CALIBRATION_BYTES / 4;
/// Passes per staged measurement: the first chunk's gather (or the last one's scatter)
/// does not overlap a DMA, which in a transfer happens once per call, not per 16 MiB (one
/// pass measured 4 KiB-page staging at 48-51 GB/s where transfers of 400 MB ran at 53).
const CALIBRATION_STAGE_PASSES: usize = 4;
/// Block counts tried for 4 KiB pages when none is configured.
const CALIBRATION_BLOCKS: [u32; 7] = [1, 2, 4, 8, 16, 32, 64];

/// Loads the kernel and times copy engines against it on this GPU (a device is bound on
/// the calling thread). Takes about 0.1–0.3 s; done once per GPU.
pub(crate) fn calibrate<A: DeviceApi>(api: &A, dev: &A::Device, config: GatherConfig, batch_max: usize) -> Result<GatherState, GpuError> {
    let kernel = api.copy_kernel(dev)?;
    if !api.host_pointers_are_device_pointers(dev)? {
        return Err(GpuError::Unsupported(format!("{}: registered host memory is not addressable at its host address", A::API)));
    }
    let device = api.alloc_device(2 * CALIBRATION_BYTES)?;
    let host = match api.alloc_mapped(CALIBRATION_BYTES) {
        Ok(h) => h,
        Err(e) => {
            // SAFETY: just allocated, unused.
            unsafe { api.free_device(device) };
            return Err(e);
        }
    };
    let stream = api.create_stream();
    let mut descs = DescBuf::default();
    // Device staging needs a second stream, staging buffers and events; without them the
    // calibration measures the other two paths only.
    let mut staging = match (api.create_stream(), Staging::new(api, CALIBRATION_STAGE_CHUNK)) {
        (Ok(s2), Ok(st)) => Some((s2, st)),
        (s2, st) => {
            tracing::debug!(api = A::API, "calibration without device staging: {:?} {:?}", s2.as_ref().err(), st.as_ref().err());
            if let Ok(s2) = s2 {
                api.destroy_stream(s2);
            }
            if let Ok(mut st) = st {
                // SAFETY: nothing was enqueued on it.
                unsafe { st.free(api) };
            }
            None
        }
    };
    let r = stream.and_then(|stream| {
        let r = measure_all(api, dev, kernel, config, batch_max, stream, device, host, &mut descs, staging.as_mut());
        let _ = api.synchronize(stream);
        api.destroy_stream(stream);
        r
    });
    if let Some((s2, mut st)) = staging {
        let _ = api.synchronize(s2);
        api.destroy_stream(s2);
        // SAFETY: both streams that used it were synchronized.
        unsafe { st.free(api) };
    }
    // SAFETY: the stream was synchronized (or never created); nothing reads these.
    unsafe {
        descs.free(api);
        api.free_mapped(host);
        api.free_device(device);
    }
    r.map(|calibration| GatherState { kernel, calibration })
}

#[allow(clippy::too_many_arguments)]
fn measure_all<A: DeviceApi>(
    api: &A,
    dev: &A::Device,
    kernel: u64,
    config: GatherConfig,
    batch_max: usize,
    stream: A::Stream,
    device: u64,
    host: *mut u8,
    descs: &mut DescBuf,
    staging: Option<&mut (A::Stream, Staging<A>)>,
) -> Result<Calibration, GpuError> {
    // Pages every other page-size slot on the device (not one contiguous run), packed on
    // the host: the pool's layout.
    let items = |page: usize| -> Vec<Item> {
        (0..CALIBRATION_BYTES / page)
            .map(|i| Item { host: host.wrapping_add(i * page), device: device + (2 * i * page) as u64, len: page })
            .collect()
    };
    let second = staging.as_ref().map(|s| s.0);
    let sync = || -> Result<(), GpuError> {
        api.synchronize(stream)?;
        second.map_or(Ok(()), |s| api.synchronize(s))
    };
    // GB/s of `passes` x CALIBRATION_BYTES moved by `f`: the best of 3 after a warm-up.
    let time_passes = |passes: usize, f: &mut dyn FnMut() -> Result<(), GpuError>| -> Result<f64, GpuError> {
        f()?;
        sync()?;
        let mut best = f64::MAX;
        for _ in 0..3 {
            let t = std::time::Instant::now();
            f()?;
            sync()?;
            best = best.min(t.elapsed().as_secs_f64());
        }
        Ok((passes * CALIBRATION_BYTES) as f64 / best / 1e9)
    };
    let time = |f: &mut dyn FnMut() -> Result<(), GpuError>| time_passes(1, f);
    let descs = std::cell::RefCell::new(descs);
    let kernel_rate = |items: &[Item], dir: Dir, blocks: u32| -> Result<f64, GpuError> {
        let state = GatherState { kernel, calibration: Calibration { blocks, ..Default::default() } };
        let sc = scan(items, &[]);
        time(&mut || {
            let mut d = descs.borrow_mut();
            // SAFETY: the stream was synchronized after every launch of this function.
            unsafe { d.reset(api) };
            // SAFETY: items lie in our two allocations, 16-byte aligned.
            unsafe { launch(api, &state, &mut d, &config, dir, items, &sc, stream) }
        })
    };
    // Copy engines as the engine feeds them: a small first batch, then growing ones.
    let ce_rate = |items: &[Item], dir: Dir| -> Result<f64, GpuError> {
        use crate::engine::batch::{next_batch, FIRST_BATCH};
        let per_call = batch_max.max(1);
        time(&mut || {
            let (mut pos, mut size) = (0, FIRST_BATCH.min(per_call));
            while pos < items.len() {
                let end = (pos + size).min(items.len());
                // SAFETY: as above.
                unsafe { api.copy_batch_async(dev, dir, &items[pos..end], stream, true) }?;
                pos = end;
                size = next_batch(size, per_call);
            }
            Ok(())
        })
    };
    let staging = staging.map(|s| std::cell::RefCell::new(&mut s.1));
    // Device staging as a transfer's stage runs it: the items in host order, then chunks
    // over the staging slots (the kernel gathers on `stream`, copy engines on the second).
    let staged_rate = |items: &[Item], dir: Dir| -> Result<f64, GpuError> {
        let (Some(staging), Some(kd)) = (staging.as_ref(), second) else { return Ok(0.0) };
        let state = GatherState { kernel, calibration: Calibration::default() };
        let chunk = staging.borrow().chunk;
        let Some(order) = staged_order(true, items, chunk) else { return Ok(0.0) };
        let n_descs = desc_count(items);
        time_passes(CALIBRATION_STAGE_PASSES, &mut || {
            let (mut d, mut st) = (descs.borrow_mut(), staging.borrow_mut());
            // SAFETY: both streams were synchronized after every launch of this function.
            unsafe { d.reset(api) };
            st.reset();
            for _ in 0..CALIBRATION_STAGE_PASSES {
                // SAFETY: items lie in our two allocations, 16-byte aligned, each one page
                // of at most 128 KiB, smaller than a chunk (`staged_order` checked); the
                // slots' own events order each pass after the one before.
                unsafe { launch_staged(api, dev, &state, &mut d, &mut st, &config, dir, items, &order, n_descs, stream, kd) }?;
            }
            Ok(())
        })
    };
    let mut block_rates = Vec::new();
    let blocks = if config.blocks > 0 {
        config.blocks
    } else {
        let small = items(CALIBRATION_PAGES[0]);
        let mut rates = Vec::new();
        for b in CALIBRATION_BLOCKS {
            let r = kernel_rate(&small, Dir::DeviceToHost, b)?.min(kernel_rate(&small, Dir::HostToDevice, b)?);
            rates.push((b, r));
        }
        block_rates.clone_from(&rates);
        pick_blocks(&rates)
    };
    let mut points = Vec::new();
    for page in CALIBRATION_PAGES {
        let its = items(page);
        points.push(Point {
            page,
            d2h_ce_gbps: ce_rate(&its, Dir::DeviceToHost)?,
            d2h_kernel_gbps: kernel_rate(&its, Dir::DeviceToHost, blocks)?,
            h2d_ce_gbps: ce_rate(&its, Dir::HostToDevice)?,
            h2d_kernel_gbps: kernel_rate(&its, Dir::HostToDevice, blocks)?,
            d2h_staged_gbps: staged_rate(&its, Dir::DeviceToHost)?,
            h2d_staged_gbps: staged_rate(&its, Dir::HostToDevice)?,
        });
    }
    Ok(Calibration { block_rates, ..Calibration::from_points(points, blocks) })
}

/// The fewest blocks whose rate is within 3% of the best measured.
pub(crate) fn pick_blocks(rates: &[(u32, f64)]) -> u32 {
    let best = rates.iter().map(|r| r.1).fold(0.0, f64::max);
    rates.iter().filter(|r| r.1 >= best * 0.97).map(|r| r.0).min().unwrap_or(16)
}
