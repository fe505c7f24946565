//! One copy call on one GPU: fence wait, staged and batched submission, fence signal,
//! and synchronization of every stream used before returning, even on error.

use std::sync::atomic::Ordering;
use std::time::Instant;

use super::batch::{balance, next_batch, FIRST_BATCH};
use super::config::PARALLEL_MIN_ITEMS;
use super::stats::CallCounts;
use super::streams::StreamSet;
use super::{Bound, DeviceApi, Engine, Item};
use crate::fence::{self, FenceWord};
use crate::gather;
use crate::{Fence, GpuError, TransferArgs};

/// What one copy call on one engine does besides its items.
pub(super) struct Call<'a> {
    /// Direction, pool memory base, fence, `keep_waiting` and tuning of the transfer.
    pub args: &'a TransferArgs<'a>,
    /// Stages of the call (1: all items at once).
    pub stages: usize,
    /// Write a load fence from the GPU: set when this call covers every part of the
    /// transfer (else the caller writes it from the CPU afterwards).
    pub signal: bool,
    /// Registered host ranges (start, end): pages outside them never go to the kernel.
    pub ranges: &'a [(usize, usize)],
}

/// Appends the items of stage `s` (s >= 1) of a staged [`Engine::run`].
type StageBuilder<'a> = dyn FnMut(usize, &mut Vec<Item>) -> Result<(), GpuError> + 'a;

/// Whether every event of one stage completed (`block`: wait for it).
fn stage_landed<A: DeviceApi>(api: &A, events: &[A::Event], block: bool) -> Result<bool, GpuError> {
    for &e in events {
        if block {
            api.event_wait(e)?;
        } else if !api.event_done(e)? {
            return Ok(false);
        }
    }
    Ok(true)
}

/// Builds stage `s` while earlier stages may be copying on `set`'s streams. If the
/// caller's builder panics, every stream is synchronized before the panic goes on: the
/// caller gives the pool memory of those copies back while unwinding, and a DMA must not
/// still read or write it then.
fn build_or_drain<A: DeviceApi>(
    api: &A,
    set: &StreamSet<A>,
    build: &mut StageBuilder<'_>,
    s: usize,
    items: &mut Vec<Item>,
) -> Result<(), GpuError> {
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| build(s, items))) {
        Ok(r) => r,
        Err(panic) => {
            for &stream in &set.streams {
                if let Err(e) = api.synchronize(stream) {
                    tracing::error!(api = A::API, "stream synchronize after a panic failed: {e}");
                }
            }
            std::panic::resume_unwind(panic)
        }
    }
}

impl<A: DeviceApi> Engine<A> {
    /// Runs a copy call in direction `call.args.dir` on this engine: fence wait (stores), copies
    /// spread over the stream set, fence signal (loads, when `call.signal` is set), then
    /// synchronizes every stream used, also after an error: returning while a DMA still
    /// targets pool memory would let the pool reuse that memory under it.
    ///
    /// The call has `call.stages` stages: `first` holds stage 0's items, and `build(s, items)`
    /// appends stage `s`'s (s >= 1), called only once stage `s - 1` is enqueued, so the
    /// caller's planning of a stage overlaps the DMA of the ones before. Each stage is
    /// spread over the streams on its own and followed by an event per stream, and
    /// `stage_done(s)` is called, in order, as soon as stage `s` has landed without error,
    /// while later stages still copy. Stages from the first failure on are not reported.
    /// Without working events all stages are built first and run as one, and none is
    /// reported (the caller reports them when the call succeeded).
    ///
    /// # Safety
    /// Every item's host range is valid (writable for DeviceToHost) for the call and its
    /// device range lies inside an open allocation.
    pub(super) unsafe fn run(
        &self,
        api: &A,
        call: &Call<'_>,
        first: Vec<Item>,
        build: &mut StageBuilder<'_>,
        stage_done: &mut dyn FnMut(usize),
    ) -> Result<(), GpuError> {
        let TransferArgs { dir, fence, fence_timeout, keep_waiting, engine: config, .. } = *call.args;
        let config = config.clamped();
        let signal = call.signal;
        let ranges = call.ranges;
        let mut items = first;
        // One large object: cut over several streams (copy engines), both directions.
        let large = gather::is_large(&config.gather, &items);
        let stages = call.stages.max(1);
        let staged = stages > 1 && self.events.load(Ordering::Relaxed);
        let mut rest_built = stages == 1;
        if !staged && !rest_built {
            for s in 1..stages {
                build(s, &mut items)?;
            }
            rest_built = true;
        }
        let wait = match &fence {
            Fence::WaitBefore(word, value) if !items.is_empty() || staged => Some((*word, *value)),
            _ => None,
        };
        let signal = match &fence {
            Fence::SignalAfter(word, value) if signal => Some((*word, *value)),
            _ => None,
        };
        if items.is_empty() && signal.is_none() && !staged {
            return Ok(());
        }
        let t_call = Instant::now();
        let (streams, batch) = (config.streams, config.batch);
        let streams = if large { streams.max(config.gather.split_streams()) } else { streams };
        if large && !staged {
            gather::split_large(&mut items, streams);
        }
        // Streams the copy engines' copies are spread over (the configured count).
        let copy_streams = if staged { streams } else { streams.clamp(1, items.len().max(1)) };
        let mode = config.gather.mode;
        let kernel = self.gather_path(mode);
        // Device staging (forced, or where the calibration found it fastest) needs a
        // kernel stream and a DMA stream.
        let stage_mode = match mode {
            gather::GatherMode::Staged => true,
            gather::GatherMode::Auto => kernel.is_some_and(|g| g.calibration.stages_any()),
            _ => false,
        };
        // The set may have more (staging's DMA stream); copies that are not staged still
        // use `copy_streams` only: 64 KiB pages over two streams ran ~2 % slower
        // (docs/history/benchmarks-2026-11.md, sixth pass).
        let n_streams = if stage_mode { copy_streams.max(2) } else { copy_streams };
        let _bound = Bound::new(api, &self.dev)?;
        let mut set = self.take_set(api, n_streams)?;
        // SAFETY: the set's previous call synchronized its streams before putting it back.
        unsafe { set.descs.reset(api) };
        // Eligibility for the kernel is looked up only where a kernel could take the stage.
        let scan_ranges: &[(usize, usize)] = if kernel.is_some() { ranges } else { &[] };
        // SAFETY: as for the descriptors above.
        let stage_chunk = if stage_mode && kernel.is_some() && unsafe { self.staging_ready(api, &mut set, config.stage_bytes) } {
            set.staging.as_ref().map_or(0, |s| s.chunk)
        } else {
            0
        };
        // A stage's host order where it goes through device staging (None: it does not).
        let staged_order = |scan: &gather::Scan, items: &[Item]| {
            kernel.and_then(|g| gather::staged_order(g.wants_staged(mode, dir, scan), items, stage_chunk))
        };
        let mut used = vec![false; set.streams.len()];
        let mut first_err: Option<GpuError> = None;
        // Store fence: on the GPU when the word is device-mapped and the driver supports
        // stream memory operations, else the CPU waits before enqueueing anything.
        let mut gpu_wait: Option<(FenceWord<'_>, u64)> = None;
        if let Some((word, value)) = wait {
            let mut cpu_wait = true;
            if let (Some(addr), true) = (word.device(), self.memops.load(Ordering::Relaxed)) {
                if !fence::reached(word.load(), value) {
                    let mut ok = true;
                    for (stream, used) in set.streams.iter().zip(used.iter_mut()).take(n_streams) {
                        // SAFETY: the word stays mapped for the call (the caller holds its
                        // region); the watchdog below releases it before we return.
                        match unsafe { api.wait_value64(*stream, addr, value) } {
                            Ok(()) => *used = true,
                            Err(e) => {
                                tracing::warn!(api = A::API, "stream wait on a fence word failed, falling back to CPU waits: {e}");
                                self.memops.store(false, Ordering::Relaxed);
                                ok = false;
                                break;
                            }
                        }
                    }
                    if ok {
                        gpu_wait = Some((word, value));
                        cpu_wait = false;
                    }
                } else {
                    cpu_wait = false;
                    if fence::aborted(word.load(), value) {
                        first_err = Some(GpuError::FenceAborted { value, word: word.load() });
                    }
                }
            }
            if cpu_wait {
                if let Err(e) = word.wait_cpu(value, fence_timeout, keep_waiting) {
                    // Streams that got a GPU wait must not hang: release them (the
                    // copies then read unready bytes; the error fails the store).
                    if used.iter().any(|u| *u) {
                        word.signal(value);
                    }
                    first_err = Some(e);
                }
            }
        }
        let staged = staged && first_err.is_none() && self.stage_events_ready(api, &mut set, stages * n_streams);
        // Before a stage is reported: a store whose worker aborted its fence read bytes the
        // engine never finished, and nothing of it may be published.
        let fence_ok = |first_err: &mut Option<GpuError>| {
            if let Some((word, value)) = gpu_wait {
                if fence::aborted(word.load(), value) {
                    first_err.get_or_insert(GpuError::FenceAborted { value, word: word.load() });
                }
            }
            first_err.is_none()
        };
        let mut reported = 0;
        let (mut n_items, mut n_bytes) = (0u64, 0u64);
        let t_enqueue = Instant::now();
        if first_err.is_none() {
            let per_call = config.batch_max;
            // Batches grow from FIRST_BATCH by BATCH_GROWTH: the DMA starts after the first
            // batch call returns (~0.7-0.9 µs per copy on the H200's driver), so a small
            // first batch starts it within microseconds; growing slower than the DMA drains
            // (64 KiB takes ~1.2 µs at 55 GB/s) keeps it from idling between batches.
            let enqueue = |items: &[Item], stream: A::Stream, run: std::ops::Range<usize>| -> Result<(), GpuError> {
                let (mut pos, mut size) = (run.start, FIRST_BATCH.min(per_call));
                while pos < run.end {
                    let end = (pos + size).min(run.end);
                    // SAFETY: forwarded caller contract for each item.
                    unsafe { api.copy_batch_async(&self.dev, dir, &items[pos..end], stream, batch) }?;
                    pos = end;
                    size = next_batch(size, per_call);
                }
                Ok(())
            };
            if staged {
                'stages: for s in 0..stages {
                    if s > 0 {
                        items.clear();
                        if let Err(e) = build_or_drain(api, &set, build, s, &mut items) {
                            first_err = Some(e);
                            break;
                        }
                    }
                    if large {
                        gather::split_large(&mut items, copy_streams);
                    }
                    // One pass for the counters, the path and the descriptor count.
                    let scan = gather::scan(&items, scan_ranges);
                    n_items += scan.items as u64;
                    n_bytes += scan.bytes;
                    if let (Some(g), Some(staging), Some(order)) = (kernel, set.staging.as_mut(), staged_order(&scan, &items)) {
                        (used[0], used[1]) = (true, true);
                        // SAFETY: forwarded caller contract; `staged_order` checked
                        // alignment and sizes.
                        if let Err(e) = unsafe {
                            gather::launch_staged(
                                api, &self.dev, g, &mut set.descs, staging, &config.gather, dir, &items, &order, scan.descs,
                                set.streams[0], set.streams[1],
                            )
                        } {
                            first_err = Some(e);
                            break 'stages;
                        }
                    } else if let Some(g) = kernel.filter(|g| g.wants(mode, dir, &scan)) {
                        // Same stream, same place as the copies: after the store fence's
                        // wait, before the stage event and the load fence's write.
                        used[0] = true;
                        // SAFETY: forwarded caller contract; `wants` checked eligibility.
                        let launched =
                            unsafe { gather::launch(api, g, &mut set.descs, &config.gather, dir, &items, &scan, set.streams[0]) };
                        if let Err(e) = launched {
                            first_err = Some(e);
                            break 'stages;
                        }
                    } else {
                        for (k, run) in balance(&items, copy_streams).into_iter().enumerate() {
                            used[k] = true;
                            if let Err(e) = enqueue(&items, set.streams[k], run) {
                                first_err = Some(e);
                                break 'stages;
                            }
                        }
                    }
                    let events = &set.stage_events[s * n_streams..][..n_streams];
                    for ((&event, &stream), used) in events.iter().zip(&set.streams).zip(used.iter_mut()) {
                        *used = true;
                        if let Err(e) = api.record(event, stream) {
                            first_err = Some(e);
                            break 'stages;
                        }
                    }
                    // Report what already landed while the driver still takes later stages.
                    while reported < s {
                        match stage_landed(api, &set.stage_events[reported * n_streams..][..n_streams], false) {
                            Ok(true) if fence_ok(&mut first_err) => {
                                stage_done(reported);
                                reported += 1;
                            }
                            Ok(_) => break,
                            Err(e) => {
                                first_err = Some(e);
                                break 'stages;
                            }
                        }
                    }
                    if first_err.is_some() {
                        break;
                    }
                }
            } else {
                if !rest_built {
                    // Events turned out unusable: one stage after all.
                    for s in 1..stages {
                        if let Err(e) = build_or_drain(api, &set, build, s, &mut items) {
                            first_err.get_or_insert(e);
                            break;
                        }
                    }
                }
                let scan = gather::scan(&items, scan_ranges);
                n_items = scan.items as u64;
                n_bytes = scan.bytes;
                let runs = balance(&items, copy_streams);
                if first_err.is_some() {
                } else if let (Some(g), Some(staging), Some(order)) = (kernel, set.staging.as_mut(), staged_order(&scan, &items)) {
                    (used[0], used[1]) = (true, true);
                    // SAFETY: forwarded caller contract; `staged_order` checked eligibility.
                    first_err = unsafe {
                        gather::launch_staged(
                            api, &self.dev, g, &mut set.descs, staging, &config.gather, dir, &items, &order, scan.descs, set.streams[0],
                            set.streams[1],
                        )
                    }
                    .err();
                } else if let Some(g) = kernel.filter(|g| g.wants(mode, dir, &scan)) {
                    used[0] = true;
                    // SAFETY: forwarded caller contract; `wants` checked eligibility.
                    first_err = unsafe { gather::launch(api, g, &mut set.descs, &config.gather, dir, &items, &scan, set.streams[0]) }.err();
                } else if runs.len() > 1 && items.len() >= PARALLEL_MIN_ITEMS && config.parallel_submit {
                    let results: Vec<Result<(), GpuError>> = std::thread::scope(|scope| {
                        let handles: Vec<_> = runs
                            .iter()
                            .enumerate()
                            .map(|(k, run)| {
                                let (run, stream) = (run.clone(), set.streams[k]);
                                let (enqueue, items) = (&enqueue, &items);
                                scope.spawn(move || {
                                    let _bound = Bound::new(api, &self.dev)?;
                                    enqueue(items, stream, run)
                                })
                            })
                            .collect();
                        handles
                            .into_iter()
                            .map(|h| h.join().unwrap_or_else(|_| Err(GpuError::Unsupported("copy submission thread panicked".into()))))
                            .collect()
                    });
                    // Every stream may hold copies (a failed one possibly some): sync all.
                    used.iter_mut().take(runs.len()).for_each(|u| *u = true);
                    first_err = results.into_iter().find_map(Result::err);
                } else {
                    for (k, run) in runs.iter().enumerate() {
                        used[k] = true;
                        if let Err(e) = enqueue(&items, set.streams[k], run.clone()) {
                            first_err = Some(e);
                            break;
                        }
                    }
                }
            }
        }
        let enqueue_ns = t_enqueue.elapsed().as_nanos() as u64;
        // Load fence from the GPU: stream 0 waits for the others, then writes the value.
        if let (None, Some((word, value)), Some(addr)) = (&first_err, signal, signal.and_then(|(w, _)| w.device())) {
            if self.memops.load(Ordering::Relaxed) {
                let _ = word;
                if let Err(e) = self.signal_on_gpu(api, &mut set, &mut used, n_streams, addr, value) {
                    tracing::debug!(api = A::API, "GPU-side fence write unavailable, the CPU writes it: {e}");
                }
            }
        }
        // Watchdog for GPU-side waits: a worker that died or never writes its fence would
        // leave our streams blocked; release them (the error fails the store).
        if let Some((word, value)) = gpu_wait {
            let released = if first_err.is_some() { Err(None) } else { word.wait_cpu(value, fence_timeout, keep_waiting).map_err(Some) };
            if let Err(e) = released {
                word.signal(value);
                if let Some(e) = e {
                    first_err.get_or_insert(e);
                }
            }
        }
        if staged {
            while reported < stages && first_err.is_none() {
                match stage_landed(api, &set.stage_events[reported * n_streams..][..n_streams], true) {
                    Ok(_) if fence_ok(&mut first_err) => {
                        stage_done(reported);
                        reported += 1;
                    }
                    Ok(_) => {}
                    Err(e) => first_err = Some(e),
                }
            }
        }
        for (k, &s) in set.streams.iter().enumerate() {
            if used[k] {
                if let Err(e) = api.synchronize(s) {
                    first_err.get_or_insert(e);
                }
            }
        }
        if let (None, Some((word, value))) = (&first_err, gpu_wait) {
            if fence::aborted(word.load(), value) {
                first_err = Some(GpuError::FenceAborted { value, word: word.load() });
            }
        }
        self.put_set(set);
        self.stats.add(CallCounts {
            items: n_items,
            bytes: n_bytes,
            enqueue_ns,
            total_ns: t_call.elapsed().as_nanos() as u64,
            stages: reported as u64,
        });
        first_err.map_or(Ok(()), Err)
    }
}

#[cfg(test)]
mod tests;
