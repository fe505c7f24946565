//! Device staging for small pages ([`GatherMode::Staged`]; under [`GatherMode::Auto`]
//! where the calibration found it fastest): the kernel gathers a stage's pages into a
//! device buffer and copy engines move whole contiguous host runs, or the reverse for a
//! load.

use std::sync::atomic::{AtomicU64, Ordering};

use super::{blocks_for, build_descs, desc_count, launch_chunks, DescBuf, GatherConfig, GatherState, ALIGN, LAUNCHED_PAGES, LAUNCHES, THREADS};
#[cfg(doc)]
use super::GatherMode;
use crate::engine::{DeviceApi, Dir, Item};
use crate::GpuError;

/// Staging buffers per stream set (chunk `i` uses buffer `i % STAGE_SLOTS`).
pub(crate) const STAGE_SLOTS: usize = 3;
/// Least average contiguous host run (bytes) for which a stage is staged.
pub(crate) const STAGE_MIN_RUN: usize = 64 << 10;
/// Blocks of the device-to-device gather/scatter kernel when none is configured.
pub(crate) const STAGE_BLOCKS: u32 = 64;

static STAGING_BYTES: AtomicU64 = AtomicU64::new(0);
static STAGED_CHUNKS: AtomicU64 = AtomicU64::new(0);

/// Device staging memory allocated now in this process and chunks moved through it, for
/// tests and benchmarks.
pub fn staging_stats() -> (u64, u64) {
    (STAGING_BYTES.load(Ordering::Relaxed), STAGED_CHUNKS.load(Ordering::Relaxed))
}

/// Device staging buffers of one stream set ([`GatherMode::Staged`]): `STAGE_SLOTS`
/// chunks of `chunk` bytes at `base`, and per slot an event marking it filled (by the
/// gather or the host-to-device DMA) and one marking it drained (by the DMA out or the
/// scatter).
pub(crate) struct Staging<A: DeviceApi> {
    pub base: u64,
    pub chunk: usize,
    filled: Vec<A::Event>,
    drained: Vec<A::Event>,
    /// Slots used earlier in the current call (their drain must be waited for).
    armed: [bool; STAGE_SLOTS],
    next: usize,
}

impl<A: DeviceApi> Staging<A> {
    /// Allocates the buffers and events (a device is bound).
    pub fn new(api: &A, chunk: usize) -> Result<Self, GpuError> {
        let chunk = chunk.next_multiple_of(4096).max(1 << 20);
        let base = api.alloc_device(chunk * STAGE_SLOTS)?;
        let mut s = Staging { base, chunk, filled: Vec::new(), drained: Vec::new(), armed: [false; STAGE_SLOTS], next: 0 };
        STAGING_BYTES.fetch_add((chunk * STAGE_SLOTS) as u64, Ordering::Relaxed);
        for _ in 0..STAGE_SLOTS {
            match (api.create_event(), api.create_event()) {
                (Ok(f), Ok(d)) => {
                    s.filled.push(f);
                    s.drained.push(d);
                }
                (f, d) => {
                    f.into_iter().chain(d).for_each(|e| api.destroy_event(e));
                    let err = GpuError::Unsupported(format!("{}: no events for device staging", A::API));
                    // SAFETY: nothing was enqueued on these buffers.
                    unsafe { s.free(api) };
                    return Err(err);
                }
            }
        }
        Ok(s)
    }

    /// Starts a call: every slot is free (the previous call synchronized its streams).
    pub fn reset(&mut self) {
        self.armed = [false; STAGE_SLOTS];
        self.next = 0;
    }

    /// Frees buffers and events.
    ///
    /// # Safety
    /// Nothing enqueued on them still runs (the streams were synchronized).
    pub unsafe fn free(&mut self, api: &A) {
        // SAFETY: forwarded contract.
        unsafe { api.free_device(self.base) };
        STAGING_BYTES.fetch_sub((self.chunk * STAGE_SLOTS) as u64, Ordering::Relaxed);
        self.filled.drain(..).chain(self.drained.drain(..)).for_each(|e| api.destroy_event(e));
    }
}

/// Average length of the contiguous host runs of `items` in order (0 for none).
pub(crate) fn average_host_run(items: &[Item]) -> usize {
    let total: usize = items.iter().map(|i| i.len).sum();
    let runs = items.windows(2).filter(|w| w[0].host.wrapping_add(w[0].len) != w[1].host).count() + usize::from(!items.is_empty());
    total.checked_div(runs).unwrap_or(0)
}

/// The items of a stage that goes through device staging of `chunk`-byte buffers, in
/// host address order (a call's items come layer by layer; the pages of one object lie
/// next to each other in pool memory), or None where it does not: not `wanted`
/// ([`GatherState::wants_staged`]), a device address or length not 16-byte aligned, an
/// item larger than a chunk, or contiguous host runs shorter than [`STAGE_MIN_RUN`] on
/// average.
pub(crate) fn staged_items(wanted: bool, items: &[Item], chunk: usize) -> Option<Vec<Item>> {
    if !wanted || chunk == 0 || items.is_empty() {
        return None;
    }
    if !items.iter().all(|it| (it.device as usize | it.len).is_multiple_of(ALIGN) && it.len <= chunk) {
        return None;
    }
    let sorted = by_page(items).unwrap_or_else(|| {
        let mut sorted = items.to_vec();
        if !sorted.is_sorted_by_key(|i| i.host as usize) {
            sorted.sort_unstable_by_key(|i| i.host as usize);
        }
        sorted
    });
    (average_host_run(&sorted) >= STAGE_MIN_RUN).then_some(sorted)
}

/// `items` in host address order in O(n) where every host address and length is a
/// multiple of 4 KiB and they span at most 4 pages per item: each is placed at the slot
/// of its first page. None (sort instead) otherwise or where two start on the same page.
/// (A comparison sort of a kv4k stage's ~14k items cost ~0.4 ms of CPU per stage on the
/// H200 machine, enough to slow the whole call.)
pub(super) fn by_page(items: &[Item]) -> Option<Vec<Item>> {
    const PAGE: usize = 4096;
    let (mut lo, mut hi) = (usize::MAX, 0usize);
    for it in items {
        let h = it.host as usize;
        if !(h | it.len).is_multiple_of(PAGE) {
            return None;
        }
        lo = lo.min(h);
        hi = hi.max(h + it.len);
    }
    let pages = (hi - lo) / PAGE;
    if pages > 4 * items.len() {
        return None;
    }
    let mut slots: Vec<Option<Item>> = vec![None; pages];
    for it in items {
        let slot = &mut slots[(it.host as usize - lo) / PAGE];
        if slot.is_some() {
            return None;
        }
        *slot = Some(*it);
    }
    Some(slots.into_iter().flatten().collect())
}

/// Enqueues a stage through device staging: per chunk of at most `staging.chunk` bytes,
/// DeviceToHost: the kernel gathers the pages into a staging slot on `ks`, then `kd`
/// copies each contiguous host run out of it with copy engines; HostToDevice: `kd` copies
/// the runs in, then the kernel scatters them on `ks`. Slots are reused only after their
/// previous drain (GPU-side event waits); chunk `i + 1`'s gather overlaps chunk `i`'s DMA.
/// The last work of a stores' stage is on `kd`, of a load's on `ks`: the caller records
/// stage events and joins the fence write on both.
///
/// # Safety
/// As [`DeviceApi::copy_async`] for every item; each item's length is at most
/// `staging.chunk` and device addresses and lengths are 16-byte aligned ([`staged_items`]).
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn launch_staged<A: DeviceApi>(
    api: &A,
    dev: &A::Device,
    state: &GatherState,
    descs: &mut DescBuf,
    staging: &mut Staging<A>,
    config: &GatherConfig,
    dir: Dir,
    items: &[Item],
    ks: A::Stream,
    kd: A::Stream,
) -> Result<(), GpuError> {
    let blocks = if config.blocks > 0 { config.blocks } else { STAGE_BLOCKS };
    for chunk in launch_chunks(items, staging.chunk) {
        let items = &items[chunk];
        let slot = staging.next;
        staging.next = (slot + 1) % STAGE_SLOTS;
        let base = staging.base + (slot * staging.chunk) as u64;
        // Staging offsets in item order; one DMA item per contiguous host run.
        let mut runs: Vec<Item> = Vec::new();
        let mut off = 0u64;
        let mut moves: Vec<Item> = Vec::with_capacity(items.len());
        for it in items {
            match runs.last_mut() {
                Some(r) if r.host.wrapping_add(r.len) == it.host => r.len += it.len,
                _ => runs.push(Item { host: it.host, device: base + off, len: it.len }),
            }
            // The kernel's view: `host` is the staging address, `device` the page.
            moves.push(Item { host: (base + off) as *mut u8, device: it.device, len: it.len });
            off += it.len as u64;
        }
        let n = desc_count(&moves);
        let (slice, dev_descs) = descs.take(api, n)?;
        build_descs(dir, &moves, slice);
        let blocks = blocks_for(blocks, n);
        let (filled, drained) = (staging.filled[slot], staging.drained[slot]);
        match dir {
            // A slot is refilled only after its own last drain (recorded right after it),
            // not after everything the other stream queued since: waiting for the newest
            // work put the gather of each chunk behind the DMA of the one before, so
            // gather and DMA took turns instead of overlapping (H200, 2026-12-02: 4 KiB
            // pages at 44 GB/s instead of the copy engines' 55).
            Dir::DeviceToHost => {
                if staging.armed[slot] {
                    api.wait_event(ks, drained)?;
                }
                // SAFETY: descriptors written, kept until the call synchronized; pages and
                // staging slot are device memory valid for the call.
                unsafe { api.launch_copy_kernel(state.kernel, dev_descs, n as u64, blocks, THREADS, ks) }?;
                api.join(kd, filled, ks)?;
                // SAFETY: forwarded caller contract for the host runs; the staging slot
                // is ours until the next drain wait.
                unsafe { api.copy_batch_async(dev, dir, &runs, kd, true) }?;
                api.record(drained, kd)?;
            }
            Dir::HostToDevice => {
                if staging.armed[slot] {
                    api.wait_event(kd, drained)?;
                }
                // SAFETY: as above.
                unsafe { api.copy_batch_async(dev, dir, &runs, kd, true) }?;
                api.join(ks, filled, kd)?;
                // SAFETY: as above.
                unsafe { api.launch_copy_kernel(state.kernel, dev_descs, n as u64, blocks, THREADS, ks) }?;
                api.record(drained, ks)?;
            }
        }
        staging.armed[slot] = true;
        LAUNCHES.fetch_add(1, Ordering::Relaxed);
        LAUNCHED_PAGES.fetch_add(items.len() as u64, Ordering::Relaxed);
        STAGED_CHUNKS.fetch_add(1, Ordering::Relaxed);
    }
    Ok(())
}
