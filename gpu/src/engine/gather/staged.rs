//! Device staging for small pages ([`GatherMode::Staged`]; under [`GatherMode::Auto`]
//! where the calibration found it fastest): the kernel gathers a stage's pages into a
//! device buffer and copy engines move whole contiguous host runs, or the reverse for a
//! load.

use std::sync::atomic::{AtomicU64, Ordering};

#[cfg(doc)]
use super::GatherMode;
use super::{blocks_for, desc_pieces, Desc, DescBuf, GatherConfig, GatherState, ALIGN, LAUNCHED_PAGES, LAUNCHES, THREADS};
#[cfg(doc)]
use super::{build_descs, desc_count};
use crate::engine::api::DeviceApi;
use crate::engine::item::Item;
use crate::Dir;
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

/// Average length of the contiguous host runs of `items` taken in `order` (0 for none).
pub(crate) fn average_host_run(items: &[Item], order: &[u32]) -> usize {
    let (mut total, mut runs, mut end) = (0usize, 0usize, None::<usize>);
    for &i in order {
        let it = &items[i as usize];
        if end != Some(it.host as usize) {
            runs += 1;
        }
        total += it.len;
        end = Some(it.host as usize + it.len);
    }
    total.checked_div(runs).unwrap_or(0)
}

/// The order (indices into `items`, host addresses ascending) in which a stage goes
/// through device staging of `chunk`-byte buffers (a call's items come layer by layer;
/// the pages of one object lie next to each other in pool memory), or None where it does
/// not: not `wanted` ([`GatherState::wants_staged`]), a device address or length not
/// 16-byte aligned, an item larger than a chunk, or contiguous host runs shorter than
/// [`STAGE_MIN_RUN`] on average. Indices, not item copies: for 4 KiB pages this runs for
/// every page and the copies cost (issue #14: 34 ns per page with copies and separate
/// passes against 14 for the direct kernel, on the dry simulated driver).
pub(crate) fn staged_order(wanted: bool, items: &[Item], chunk: usize) -> Option<Vec<u32>> {
    if !wanted || chunk == 0 || items.is_empty() || u32::try_from(items.len()).is_err() {
        return None;
    }
    let (mut lo, mut hi, mut bits, mut page_bits, mut longest) = (usize::MAX, 0usize, 0usize, 0usize, 0usize);
    for it in items {
        let h = it.host as usize;
        lo = lo.min(h);
        hi = hi.max(h + it.len);
        bits |= it.device as usize | it.len;
        page_bits |= h | it.len;
        longest = longest.max(it.len);
    }
    if !bits.is_multiple_of(ALIGN) || longest > chunk {
        return None;
    }
    let order = by_page(items, lo, hi, page_bits).unwrap_or_else(|| {
        let mut order: Vec<u32> = (0..items.len() as u32).collect();
        order.sort_unstable_by_key(|&i| items[i as usize].host as usize);
        order
    });
    (average_host_run(items, &order) >= STAGE_MIN_RUN).then_some(order)
}

/// `items` in host address order in O(n) where every host address and length is a
/// multiple of 4 KiB (`page_bits`: all of them or'ed) and they span (`lo..hi`) at most 4
/// pages per item: each is placed at the slot of its first page. None (sort instead)
/// otherwise or where two start on the same page. (A comparison sort of a kv4k stage's
/// ~14k items cost ~0.4 ms of CPU per stage on the H200 machine, enough to slow the whole
/// call.)
pub(super) fn by_page(items: &[Item], lo: usize, hi: usize, page_bits: usize) -> Option<Vec<u32>> {
    const PAGE: usize = 4096;
    const EMPTY: u32 = u32::MAX;
    let pages = (hi - lo) / PAGE;
    if !page_bits.is_multiple_of(PAGE) || pages > 4 * items.len() {
        return None;
    }
    let mut slots = vec![EMPTY; pages];
    for (i, it) in items.iter().enumerate() {
        let slot = &mut slots[(it.host as usize - lo) / PAGE];
        if *slot != EMPTY {
            return None;
        }
        *slot = i as u32;
    }
    slots.retain(|&s| s != EMPTY);
    Some(slots)
}

/// Writes the descriptors of one page moved between `staged` (an address in a staging
/// slot) and `device` at `out[*next..]`, cut as [`build_descs`] cuts.
#[inline(always)]
fn put_descs(out: &mut [Desc], next: &mut usize, dir: Dir, staged: u64, device: u64, len: usize) {
    desc_pieces(len, |off, n| {
        let (s, d) = (staged + off, device + off);
        out[*next] = match dir {
            Dir::DeviceToHost => Desc { src: d, dst: s, len: n },
            Dir::HostToDevice => Desc { src: s, dst: d, len: n },
        };
        *next += 1;
    });
}

/// Enqueues a stage through device staging: per chunk of at most `staging.chunk` bytes of
/// `items` taken in `order` ([`staged_order`]), DeviceToHost: the kernel gathers the pages
/// into a staging slot on `ks`, then `kd` copies each contiguous host run out of it with
/// copy engines; HostToDevice: `kd` copies the runs in, then the kernel scatters them on
/// `ks`. Slots are reused only after their previous drain (GPU-side event waits); chunk
/// `i + 1`'s gather overlaps chunk `i`'s DMA. The last work of a stores' stage is on `kd`,
/// of a load's on `ks`: the caller records stage events and joins the fence write on both.
/// `n_descs` is [`desc_count`] of the items (the caller's scan has it).
///
/// # Safety
/// As [`DeviceApi::copy_async`] for every item; `order` comes from [`staged_order`] for
/// these items and this chunk size (lengths at most a chunk, 16-byte aligned).
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
    order: &[u32],
    n_descs: usize,
    ks: A::Stream,
    kd: A::Stream,
) -> Result<(), GpuError> {
    let blocks = if config.blocks > 0 { config.blocks } else { STAGE_BLOCKS };
    // One descriptor list for the stage, written chunk by chunk as the pages are placed.
    let (out, dev_descs) = descs.take(api, n_descs)?;
    let mut runs: Vec<Item> = Vec::new();
    let (mut pos, mut next) = (0usize, 0usize);
    while pos < order.len() {
        let slot = staging.next;
        staging.next = (slot + 1) % STAGE_SLOTS;
        let base = staging.base + (slot * staging.chunk) as u64;
        // Staging offsets in host order; one DMA item per contiguous host run.
        runs.clear();
        let (first_pos, first_desc, mut off) = (pos, next, 0usize);
        while let Some(&i) = order.get(pos) {
            let it = items[i as usize];
            if pos > first_pos && off + it.len > staging.chunk {
                break;
            }
            match runs.last_mut() {
                Some(r) if r.host.wrapping_add(r.len) == it.host => r.len += it.len,
                _ => runs.push(Item { host: it.host, device: base + off as u64, len: it.len }),
            }
            put_descs(out, &mut next, dir, base + off as u64, it.device, it.len);
            off += it.len;
            pos += 1;
        }
        let n = next - first_desc;
        let chunk_descs = dev_descs + (first_desc * std::mem::size_of::<Desc>()) as u64;
        let blocks = blocks_for(blocks, n);
        let (filled, drained) = (staging.filled[slot], staging.drained[slot]);
        match dir {
            // A slot is refilled only after its own last drain (recorded right after it),
            // not after everything the other stream queued since: waiting for the newest
            // work put the gather of each chunk behind the DMA of the one before, so gather
            // and DMA took turns instead of overlapping
            // (docs/history/benchmarks-2026-11.md, sixth pass).
            Dir::DeviceToHost => {
                if staging.armed[slot] {
                    api.wait_event(ks, drained)?;
                }
                // SAFETY: descriptors written, kept until the call synchronized; pages and
                // staging slot are device memory valid for the call.
                unsafe { api.launch_copy_kernel(state.kernel, chunk_descs, n as u64, blocks, THREADS, ks) }?;
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
                unsafe { api.launch_copy_kernel(state.kernel, chunk_descs, n as u64, blocks, THREADS, ks) }?;
                api.record(drained, ks)?;
            }
        }
        staging.armed[slot] = true;
        LAUNCHES.fetch_add(1, Ordering::Relaxed);
        LAUNCHED_PAGES.fetch_add((pos - first_pos) as u64, Ordering::Relaxed);
        STAGED_CHUNKS.fetch_add(1, Ordering::Relaxed);
    }
    Ok(())
}
