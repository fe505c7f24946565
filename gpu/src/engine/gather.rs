//! The page copy kernel path (issue #14): many small pages moved by one kernel launch
//! instead of one copy-engine descriptor each, and one large object split over several
//! streams.
//!
//! Copy engines take about 0.85 µs of driver time per copy and do not reach line rate on
//! 4–16 KiB pages; a kernel reads and writes the pages itself. The kernel
//! (`umbp_copy_pages`) takes a list of `Desc` (source address, destination address,
//! length) and copies each, one warp per page, 16 bytes per lane and access, 4 KiB per warp
//! iteration. Both directions are the same kernel: pool DRAM is registered device-mapped,
//! and the kernel path is only used where the driver says that registered host pointers
//! are valid device addresses (unified addressing: CUDA's
//! `CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM`), and only for copies whose host side lies in
//! a registered range and whose addresses and lengths are 16-byte aligned.
//!
//! Ordering is the copy-engine path's: the kernel is launched on the same stream of the
//! call's stream set, after the store fence's stream wait, and the load fence's stream
//! write follows it on that stream, so a fenced store or load behaves the same on either
//! path. Descriptor lists live in device-mapped pinned memory owned by the stream set
//! (`DescBuf`): a call writes each stage's list at a fresh offset, a list that no longer
//! fits moves to a larger buffer and the old one is kept until the call has synchronized
//! its streams, and a set is reused only by a later call (after that synchronization).
//!
//! Which path a stage takes is decided by measurement: the first time a GPU's engine opens
//! a region, the engine times copy engines, the kernel and device staging (the kernel
//! gathers pages device-to-device into a staging buffer, copy engines move it whole;
//! `gather/staged.rs`) for pages of 4 KiB to 128 KiB in both directions (`calibrate`) and
//! keeps, per direction, the largest page size at which each path that runs a kernel won
//! (`Calibration::use_staged`, `Calibration::use_kernel`). [`GatherConfig`] forces a
//! path and sets the kernel's block count.
//!
//! HIP: [`HIP_SOURCE`] is the same kernel in HIP C++, for hiprtc; the HIP backend does not
//! compile or launch it yet (it reports the kernel path unavailable and uses copy engines).
//! It has never run on AMD hardware.
//!
//! Files: this one holds the descriptors, the kernel sources, the path choice and the
//! launch; `gather/calibrate.rs` the calibration; `gather/staged.rs` device staging;
//! `gather/tests.rs` the tests.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

use super::api::DeviceApi;
use super::item::Item;
use crate::Dir;
use crate::GpuError;

/// One page copy as the kernel reads it: 3 little-endian u64s.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Desc {
    pub src: u64,
    pub dst: u64,
    pub len: u64,
}
const _: () = assert!(std::mem::size_of::<Desc>() == 24);

/// Alignment the kernel needs of every address and length (it moves 16-byte vectors).
pub(crate) const ALIGN: usize = 16;

/// Name of the kernel in [`PTX`] and [`HIP_SOURCE`].
pub(crate) const KERNEL_NAME: &std::ffi::CStr = c"umbp_copy_pages";

/// Threads per block of the kernel (16 warps).
pub(crate) const THREADS: u32 = 512;

/// `umbp_copy_pages(const Desc* descs, u64 n)`. Global warp `w` copies pages `w`, `w + W`,
/// ... (W = warps in the grid); a page goes in 4 KiB chunks (lane `l` loads bytes
/// `l*16 + k*512` for k = 0..8, then stores them), the rest of a page below 4 KiB in
/// 16-byte steps. A warp loads its next page's descriptor before it copies the current
/// page: the list lives in device-mapped pinned memory, so a descriptor load is a PCIe
/// round trip that would otherwise precede every page's first data access (kept as it is
/// not slower: docs/history/benchmarks-2026-11.md, third pass). Streaming
/// cache hints (`.cs`) keep the pages from evicting the engine's working set from L2.
/// Hand-written so that nothing needs nvcc; the driver compiles it for the GPU at load.
pub(crate) const PTX: &str = r#"
.version 7.0
.target sm_70
.address_size 64

.visible .entry umbp_copy_pages(.param .u64 p_desc, .param .u64 p_n)
{
    .reg .pred %p<5>;
    .reg .b32 %r<10>;
    .reg .b64 %rd<20>;
    .reg .b32 %v<32>;
    ld.param.u64 %rd1, [p_desc];
    ld.param.u64 %rd2, [p_n];
    mov.u32 %r1, %tid.x;
    and.b32 %r2, %r1, 31;
    shr.u32 %r3, %r1, 5;
    mov.u32 %r4, %ntid.x;
    shr.u32 %r4, %r4, 5;
    mov.u32 %r5, %ctaid.x;
    mov.u32 %r6, %nctaid.x;
    mad.lo.u32 %r7, %r5, %r4, %r3;
    mul.lo.u32 %r8, %r6, %r4;
    cvt.u64.u32 %rd3, %r7;
    cvt.u64.u32 %rd4, %r8;
    mul.wide.u32 %rd5, %r2, 16;
    setp.ge.u64 %p1, %rd3, %rd2;
    @%p1 bra DONE;
    mad.lo.u64 %rd6, %rd3, 24, %rd1;
    ld.global.u64 %rd7, [%rd6];
    ld.global.u64 %rd8, [%rd6+8];
    ld.global.u64 %rd9, [%rd6+16];
PAGE:
    add.u64 %rd15, %rd3, %rd4;
    setp.lt.u64 %p4, %rd15, %rd2;
    @!%p4 bra NOPREF;
    mad.lo.u64 %rd6, %rd15, 24, %rd1;
    ld.global.u64 %rd16, [%rd6];
    ld.global.u64 %rd17, [%rd6+8];
    ld.global.u64 %rd18, [%rd6+16];
NOPREF:
    mov.u64 %rd10, 0;
CHUNK:
    add.u64 %rd11, %rd10, 4096;
    setp.gt.u64 %p2, %rd11, %rd9;
    @%p2 bra TAIL;
    add.u64 %rd12, %rd7, %rd10;
    add.u64 %rd12, %rd12, %rd5;
    add.u64 %rd13, %rd8, %rd10;
    add.u64 %rd13, %rd13, %rd5;
    ld.global.cs.v4.u32 {%v0, %v1, %v2, %v3}, [%rd12];
    ld.global.cs.v4.u32 {%v4, %v5, %v6, %v7}, [%rd12+512];
    ld.global.cs.v4.u32 {%v8, %v9, %v10, %v11}, [%rd12+1024];
    ld.global.cs.v4.u32 {%v12, %v13, %v14, %v15}, [%rd12+1536];
    ld.global.cs.v4.u32 {%v16, %v17, %v18, %v19}, [%rd12+2048];
    ld.global.cs.v4.u32 {%v20, %v21, %v22, %v23}, [%rd12+2560];
    ld.global.cs.v4.u32 {%v24, %v25, %v26, %v27}, [%rd12+3072];
    ld.global.cs.v4.u32 {%v28, %v29, %v30, %v31}, [%rd12+3584];
    st.global.cs.v4.u32 [%rd13], {%v0, %v1, %v2, %v3};
    st.global.cs.v4.u32 [%rd13+512], {%v4, %v5, %v6, %v7};
    st.global.cs.v4.u32 [%rd13+1024], {%v8, %v9, %v10, %v11};
    st.global.cs.v4.u32 [%rd13+1536], {%v12, %v13, %v14, %v15};
    st.global.cs.v4.u32 [%rd13+2048], {%v16, %v17, %v18, %v19};
    st.global.cs.v4.u32 [%rd13+2560], {%v20, %v21, %v22, %v23};
    st.global.cs.v4.u32 [%rd13+3072], {%v24, %v25, %v26, %v27};
    st.global.cs.v4.u32 [%rd13+3584], {%v28, %v29, %v30, %v31};
    mov.u64 %rd10, %rd11;
    bra CHUNK;
TAIL:
    add.u64 %rd14, %rd10, %rd5;
TLOOP:
    setp.ge.u64 %p3, %rd14, %rd9;
    @%p3 bra NEXT;
    add.u64 %rd12, %rd7, %rd14;
    add.u64 %rd13, %rd8, %rd14;
    ld.global.cs.v4.u32 {%v0, %v1, %v2, %v3}, [%rd12];
    st.global.cs.v4.u32 [%rd13], {%v0, %v1, %v2, %v3};
    add.u64 %rd14, %rd14, 512;
    bra TLOOP;
NEXT:
    @!%p4 bra DONE;
    mov.u64 %rd3, %rd15;
    mov.u64 %rd7, %rd16;
    mov.u64 %rd8, %rd17;
    mov.u64 %rd9, %rd18;
    bra PAGE;
DONE:
    ret;
}
"#;

/// The same kernel for HIP (hiprtc), same parameters and contract. Never compiled or run
/// on AMD hardware: the HIP backend does not load it yet.
pub const HIP_SOURCE: &str = r#"
#include <hip/hip_runtime.h>
struct Desc { unsigned long long src, dst, len; };
extern "C" __global__ void umbp_copy_pages(const Desc* descs, unsigned long long n) {
    const unsigned lane = threadIdx.x % warpSize;
    const unsigned long long warps = (unsigned long long)gridDim.x * (blockDim.x / warpSize);
    for (unsigned long long i = blockIdx.x * (blockDim.x / warpSize) + threadIdx.x / warpSize; i < n; i += warps) {
        const Desc d = descs[i];
        const uint4* src = (const uint4*)d.src;
        uint4* dst = (uint4*)d.dst;
        for (unsigned long long v = lane; v < d.len / 16; v += warpSize) dst[v] = src[v];
    }
}
"#;

/// Which path a copy call's stages take.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum GatherMode {
    /// By the per-GPU calibration (the default).
    #[default]
    Auto,
    /// The kernel wherever it can run (aligned, registered, kernel loaded); for tests and
    /// operators who measured.
    Kernel,
    /// Copy engines only (no SM is used for copies).
    CopyEngine,
    /// Staged through device memory wherever it can run (`Auto` stages where the
    /// calibration found it fastest): the kernel gathers a stage's pages device-to-device
    /// into a contiguous staging buffer and one copy-engine copy per contiguous host run
    /// moves it to pool memory (loads: the reverse), in chunks of
    /// [`crate::EngineConfig::stage_bytes`] over three (`STAGE_SLOTS`) buffers so the gather
    /// of one chunk overlaps the DMA of the one before. Used where a stage's host side
    /// runs contiguous for at least `STAGE_MIN_RUN` (64 KiB) on average; elsewhere as
    /// [`GatherMode::Auto`].
    Staged,
}

/// Kernel path settings: [`crate::EngineConfig::gather`], passed with every transfer
/// (the calibration, done at a GPU's first region, uses those of that registration).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct GatherConfig {
    pub mode: GatherMode,
    /// Blocks (of 512 threads, one SM each at most) the kernel runs on; 0: the smallest
    /// count the calibration found within 3% of the best rate for 4 KiB pages.
    pub blocks: u32,
    /// Most bytes one kernel launch moves (a stage is cut into several launches); 0: one
    /// launch per stage (the default): shorter launches interfered less with the engine's
    /// kernels but moved small pages slower, neither enough to be the default
    /// (docs/history/benchmarks-2026-11.md, "Page copy kernel path and single objects").
    pub launch_bytes: usize,
    /// Streams one large object (at least 4 MiB per copy on average, few copies) is split
    /// over; 0 or 1: no split (the default): a split over 4 streams did not move 16 or 64
    /// MiB objects beyond run-to-run noise on the H200 (docs/history/benchmarks-2026-11.md,
    /// "Page copy kernel path and single objects").
    pub split_streams: usize,
}

impl GatherConfig {
    pub(crate) fn launch_bytes(&self) -> usize {
        if self.launch_bytes == 0 {
            usize::MAX
        } else {
            self.launch_bytes.max(ALIGN)
        }
    }
    pub(crate) fn split_streams(&self) -> usize {
        self.split_streams.clamp(1, 16)
    }
}

/// One measured page size (GB/s; 0: not measured).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Point {
    pub page: usize,
    pub d2h_ce_gbps: f64,
    pub d2h_kernel_gbps: f64,
    pub h2d_ce_gbps: f64,
    pub h2d_kernel_gbps: f64,
    /// Device staging (kernel gather device-to-device, copy engines for the DMA).
    pub d2h_staged_gbps: f64,
    pub h2d_staged_gbps: f64,
}

/// A path that runs a kernel must beat copy engines by this factor: its kernel takes
/// turns on the GPU from the engine's own, where copy engines do not measurably slow the
/// engine (docs/history/benchmarks-2026-11.md, second and sixth passes).
pub const KERNEL_MARGIN: f64 = 1.10;
/// Device staging must beat the direct kernel by this factor to replace it.
const STAGED_OVER_KERNEL: f64 = 1.02;

/// What a GPU's calibration measured and decided.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Calibration {
    pub points: Vec<Point>,
    /// Kernel blocks chosen (or configured).
    pub blocks: u32,
    /// Kernel GB/s (the slower direction) for 4 KiB pages per block count tried.
    pub block_rates: Vec<(u32, f64)>,
    /// Largest page size at which the kernel beat copy engines, per direction (0: never).
    pub d2h_crossover: usize,
    pub h2d_crossover: usize,
    /// Largest page size at which device staging beat both, per direction (0: never).
    pub d2h_staged_up_to: usize,
    pub h2d_staged_up_to: usize,
}

impl Calibration {
    /// Derives the crossovers from measured points: per direction, the largest page size
    /// where the kernel beat copy engines by [`KERNEL_MARGIN`], and where device staging
    /// beat copy engines by as much and the kernel by 2%.
    pub fn from_points(points: Vec<Point>, blocks: u32) -> Self {
        let cross = |f: &dyn Fn(&Point) -> bool| points.iter().filter(|p| f(p)).map(|p| p.page).max().unwrap_or(0);
        let d2h_crossover = cross(&|p| p.d2h_kernel_gbps > p.d2h_ce_gbps * KERNEL_MARGIN);
        let h2d_crossover = cross(&|p| p.h2d_kernel_gbps > p.h2d_ce_gbps * KERNEL_MARGIN);
        let staged = |st: f64, ce: f64, k: f64| st > ce * KERNEL_MARGIN && st > k * STAGED_OVER_KERNEL;
        let d2h_staged_up_to = cross(&|p| staged(p.d2h_staged_gbps, p.d2h_ce_gbps, p.d2h_kernel_gbps));
        let h2d_staged_up_to = cross(&|p| staged(p.h2d_staged_gbps, p.h2d_ce_gbps, p.h2d_kernel_gbps));
        Calibration { points, blocks, block_rates: Vec::new(), d2h_crossover, h2d_crossover, d2h_staged_up_to, h2d_staged_up_to }
    }

    /// Whether a stage of average copy size `avg` in direction `dir` goes through device
    /// staging (where it can: [`staged_order`]).
    pub(crate) fn use_staged(&self, dir: Dir, avg: usize) -> bool {
        let up_to = match dir {
            Dir::DeviceToHost => self.d2h_staged_up_to,
            Dir::HostToDevice => self.h2d_staged_up_to,
        };
        avg > 0 && avg <= up_to
    }

    /// Whether any stage could go through device staging (so staging buffers are needed).
    pub(crate) fn stages_any(&self) -> bool {
        self.d2h_staged_up_to > 0 || self.h2d_staged_up_to > 0
    }

    /// Whether a stage of average copy size `avg` in direction `dir` goes to the kernel.
    pub(crate) fn use_kernel(&self, dir: Dir, avg: usize) -> bool {
        let cross = match dir {
            Dir::DeviceToHost => self.d2h_crossover,
            Dir::HostToDevice => self.h2d_crossover,
        };
        avg > 0 && avg <= cross
    }
}

/// A GPU's kernel path: the loaded kernel and its calibration.
pub(crate) struct GatherState {
    pub kernel: u64,
    pub calibration: Calibration,
}

impl GatherState {
    /// Whether a stage goes through device staging: forced by [`GatherMode::Staged`] or by
    /// the calibration under [`GatherMode::Auto`] (where it can run: [`staged_order`]).
    pub(crate) fn wants_staged(&self, mode: GatherMode, dir: Dir, scan: &Scan) -> bool {
        match mode {
            GatherMode::Staged => true,
            GatherMode::Auto => self.calibration.use_staged(dir, scan.average()),
            GatherMode::Kernel | GatherMode::CopyEngine => false,
        }
    }

    /// Whether a stage goes to the kernel: by the calibration (or forced by
    /// [`GatherMode::Kernel`]) and only where [`eligible`] (`scan` of the stage's items).
    pub(crate) fn wants(&self, mode: GatherMode, dir: Dir, scan: &Scan) -> bool {
        let chosen = match mode {
            GatherMode::CopyEngine => false,
            GatherMode::Kernel => true,
            GatherMode::Auto | GatherMode::Staged => self.calibration.use_kernel(dir, scan.average()),
        };
        chosen && scan.eligible
    }
}

static CALIBRATIONS: Mutex<Vec<(i32, Calibration)>> = Mutex::new(Vec::new());

/// Calibrations done in this process: (device ordinal, result), for logs and benchmarks.
pub fn calibrations() -> Vec<(i32, Calibration)> {
    CALIBRATIONS.lock().unwrap_or_else(|e| e.into_inner()).clone()
}

pub(crate) fn record_calibration(ordinal: i32, c: &Calibration) {
    CALIBRATIONS.lock().unwrap_or_else(|e| e.into_inner()).push((ordinal, c.clone()));
}

static LAUNCHES: AtomicU64 = AtomicU64::new(0);
static LAUNCHED_PAGES: AtomicU64 = AtomicU64::new(0);

/// Kernel launches and pages moved by them in this process (the calibration's included),
/// for tests and benchmarks.
pub fn kernel_launches() -> (u64, u64) {
    (LAUNCHES.load(Ordering::Relaxed), LAUNCHED_PAGES.load(Ordering::Relaxed))
}

/// Whether every item can go to the kernel: 16-byte aligned addresses and lengths, host
/// side inside one registered (device-mapped) range.
#[cfg(test)]
pub(crate) fn eligible(items: &[Item], ranges: &[(usize, usize)]) -> bool {
    scan(items, ranges).eligible
}

/// What one pass over a stage's items finds, for the copy call's bookkeeping, its choice
/// of path and the kernel's descriptor count (issue #14: the separate passes over 16,000
/// items per stage were a measurable part of the CPU time the GPU waited for).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Scan {
    pub items: usize,
    pub bytes: u64,
    /// Descriptors [`build_descs`] writes for them ([`desc_count`]).
    pub descs: usize,
    /// [`eligible`]: non-empty, 16-byte aligned, each host range inside one registration.
    pub eligible: bool,
}

impl Scan {
    /// Average bytes per item (0 for none).
    pub(crate) fn average(&self) -> usize {
        (self.bytes as usize).checked_div(self.items).unwrap_or(0)
    }
}

/// One pass over `items`: see [`Scan`]. Consecutive items of a stage almost always lie in
/// the registration of the one before (the pool's DRAM is one), so the range found last
/// is tried before the binary search.
pub(crate) fn scan(items: &[Item], ranges: &[(usize, usize)]) -> Scan {
    let (mut bytes, mut descs, mut bits, mut inside) = (0u64, 0usize, 0usize, !items.is_empty());
    let mut cur = (0usize, 0usize);
    for it in items {
        let h = it.host as usize;
        bytes += it.len as u64;
        descs += if it.len <= DESC_MAX { 1 } else { it.len.div_ceil(DESC_MAX) };
        bits |= h | it.device as usize | it.len;
        if inside {
            let fits = |r: (usize, usize)| h >= r.0 && h.checked_add(it.len).is_some_and(|end| end <= r.1);
            if !fits(cur) {
                let i = ranges.partition_point(|r| r.0 <= h);
                match i.checked_sub(1).map(|i| ranges[i]) {
                    Some(r) if fits(r) => cur = r,
                    _ => inside = false,
                }
            }
        }
    }
    Scan { items: items.len(), bytes, descs, eligible: inside && bits.is_multiple_of(ALIGN) }
}

/// Average bytes per item (0 for none).
pub(crate) fn average(items: &[Item]) -> usize {
    let total: usize = items.iter().map(|i| i.len).sum();
    total.checked_div(items.len()).unwrap_or(0)
}

/// Largest descriptor: longer copies are cut so that several warps share them.
pub(crate) const DESC_MAX: usize = 64 << 10;

/// Descriptors [`build_descs`] writes for `items`.
pub(crate) fn desc_count(items: &[Item]) -> usize {
    items.iter().map(|i| i.len.div_ceil(DESC_MAX)).sum()
}

/// Writes the descriptors of `items` (host pointers used as device addresses: the caller
/// checked that the driver allows it) into `out` (of [`desc_count`] entries), copies over
/// [`DESC_MAX`] cut into pieces of at most that.
pub(crate) fn build_descs(dir: Dir, items: &[Item], out: &mut [Desc]) {
    // The direction is decided once, not per page: this runs for every page of a stage.
    match dir {
        Dir::DeviceToHost => fill_descs(items, out, |host, device, len| Desc { src: device, dst: host, len }),
        Dir::HostToDevice => fill_descs(items, out, |host, device, len| Desc { src: host, dst: device, len }),
    }
}

#[inline(always)]
fn fill_descs(items: &[Item], out: &mut [Desc], make: impl Fn(u64, u64, u64) -> Desc) {
    let mut out = out.iter_mut();
    for it in items {
        desc_pieces(it.len, |off, len| {
            if let Some(d) = out.next() {
                *d = make(it.host as u64 + off, it.device + off, len);
            }
        });
    }
}

/// Calls `emit(offset, length)` for each descriptor of a `len`-byte copy: one, or pieces
/// of at most [`DESC_MAX`].
#[inline(always)]
pub(crate) fn desc_pieces(len: usize, mut emit: impl FnMut(u64, u64)) {
    if len <= DESC_MAX {
        return emit(0, len as u64);
    }
    let mut done = 0;
    while done < len {
        let n = DESC_MAX.min(len - done);
        emit(done as u64, n as u64);
        done += n;
    }
}

/// A stage of fewer copies than this times the split streams counts as "few large".
const LARGE_FEW: usize = 16;
/// Objects of at least this many bytes per item on average are split: a 1 MiB object split
/// over 4 streams got slower, the extra streams' synchronization costing more than the
/// overlap gains (docs/history/benchmarks-2026-11.md, "Page copy kernel path and single
/// objects").
pub(crate) const LARGE_MIN_AVG: usize = 4 << 20;
/// Smallest piece of a split object.
pub(crate) const LARGE_MIN_PIECE: usize = 256 << 10;

/// Whether a stage of these items is "few large objects", to be split over
/// [`GatherConfig::split_streams`] streams (none when that is 1).
pub(crate) fn is_large(config: &GatherConfig, items: &[Item]) -> bool {
    config.split_streams() > 1 && !items.is_empty() && items.len() < LARGE_FEW && average(items) >= LARGE_MIN_AVG
}

/// Cuts items so that there are at least `streams` pieces of about equal size (each at
/// least [`LARGE_MIN_PIECE`], cut at 4 KiB multiples), for [`crate::engine`]'s balancing to
/// spread one object over several streams (copy engines).
pub(crate) fn split_large(items: &mut Vec<Item>, streams: usize) {
    let total: usize = items.iter().map(|i| i.len).sum();
    if items.len() >= streams || total < 2 * LARGE_MIN_PIECE {
        return;
    }
    let piece = (total.div_ceil(streams)).next_multiple_of(4096).max(LARGE_MIN_PIECE);
    let mut out = Vec::with_capacity(streams + items.len());
    for it in items.iter() {
        let mut done = 0;
        while done < it.len {
            let len = piece.min(it.len - done);
            out.push(Item { host: it.host.wrapping_add(done), device: it.device + done as u64, len });
            done += len;
        }
    }
    *items = out;
}

/// Device-mapped pinned memory holding one stream set's descriptor lists. `used` counts
/// the bytes handed out in the current call; [`DescBuf::reset`] starts a call.
pub(crate) struct DescBuf {
    pub ptr: *mut u8,
    pub cap: usize,
    pub used: usize,
    /// Buffers outgrown during the current call; freed at the next reset, once the call
    /// that may still read them synchronized its streams.
    pub retired: Vec<(*mut u8, usize)>,
}

// SAFETY: plain memory owned by the set; the set is used by one copy call at a time.
unsafe impl Send for DescBuf {}

impl Default for DescBuf {
    fn default() -> Self {
        DescBuf { ptr: std::ptr::null_mut(), cap: 0, used: 0, retired: Vec::new() }
    }
}

impl DescBuf {
    /// Frees retired buffers and starts a new call.
    ///
    /// # Safety
    /// No launch of an earlier call can still read them (its streams were synchronized).
    pub unsafe fn reset<A: DeviceApi>(&mut self, api: &A) {
        for (p, _) in self.retired.drain(..) {
            // SAFETY: forwarded contract.
            unsafe { api.free_mapped(p) };
        }
        self.used = 0;
    }

    /// Space for `n` descriptors not used by this call before: a slice to fill and its
    /// device address.
    pub fn take<A: DeviceApi>(&mut self, api: &A, n: usize) -> Result<(&mut [Desc], u64), GpuError> {
        let bytes = n * std::mem::size_of::<Desc>();
        let at = self.used.next_multiple_of(64);
        if self.ptr.is_null() || at + bytes > self.cap {
            let cap = (bytes * 2).max(self.cap * 2).max(64 << 10);
            let ptr = api.alloc_mapped(cap)?;
            if !self.ptr.is_null() {
                self.retired.push((self.ptr, self.cap));
            }
            (self.ptr, self.cap, self.used) = (ptr, cap, 0);
            return self.take(api, n);
        }
        self.used = at + bytes;
        // SAFETY: `ptr[at..at+bytes]` lies in our allocation (checked above), is 64-byte
        // aligned (page-aligned allocation, `at` rounded), and no launch of this call reads
        // it yet; Desc is plain data.
        let slice = unsafe { std::slice::from_raw_parts_mut(self.ptr.add(at).cast::<Desc>(), n) };
        Ok((slice, self.ptr as u64 + at as u64))
    }

    /// Frees everything (the set is being destroyed; nothing runs).
    ///
    /// # Safety
    /// As [`Self::reset`].
    pub unsafe fn free<A: DeviceApi>(&mut self, api: &A) {
        // SAFETY: forwarded contract.
        unsafe { self.reset(api) };
        if !self.ptr.is_null() {
            // SAFETY: forwarded contract.
            unsafe { api.free_mapped(self.ptr) };
            self.ptr = std::ptr::null_mut();
        }
    }
}

/// Enqueues the kernel for `items` (whose [`scan`] is `scan`) on `stream`, descriptors
/// taken from `descs`.
///
/// # Safety
/// As [`DeviceApi::copy_async`] for every item, and [`eligible`] holds for them.
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn launch<A: DeviceApi>(
    api: &A,
    state: &GatherState,
    descs: &mut DescBuf,
    config: &GatherConfig,
    dir: Dir,
    items: &[Item],
    scan: &Scan,
    stream: A::Stream,
) -> Result<(), GpuError> {
    if items.is_empty() {
        return Ok(());
    }
    let max_bytes = config.launch_bytes();
    // One launch for the stage (the default) needs no chunk list: `scan` has its count.
    let whole = scan.bytes as usize <= max_bytes;
    let all = 0..items.len();
    let chunks = if whole { Vec::new() } else { launch_chunks(items, max_bytes) };
    for chunk in if whole { std::slice::from_ref(&all) } else { &chunks[..] } {
        let items = &items[chunk.clone()];
        let n = if whole { scan.descs } else { desc_count(items) };
        let (slice, dev) = descs.take(api, n)?;
        build_descs(dir, items, slice);
        let blocks = blocks_for(state.calibration.blocks, n);
        // SAFETY: the descriptors are written and stay untouched until the call
        // synchronized; forwarded contract for the pages.
        unsafe { api.launch_copy_kernel(state.kernel, dev, n as u64, blocks, THREADS, stream) }?;
        LAUNCHES.fetch_add(1, Ordering::Relaxed);
        LAUNCHED_PAGES.fetch_add(items.len() as u64, Ordering::Relaxed);
    }
    Ok(())
}

/// Contiguous runs of `items` of at most `max_bytes` each (an item larger than that alone).
pub(crate) fn launch_chunks(items: &[Item], max_bytes: usize) -> Vec<std::ops::Range<usize>> {
    let mut out = Vec::new();
    let (mut start, mut bytes) = (0, 0);
    for (i, it) in items.iter().enumerate() {
        if i > start && bytes + it.len > max_bytes {
            out.push(start..i);
            (start, bytes) = (i, 0);
        }
        bytes += it.len;
    }
    if start < items.len() {
        out.push(start..items.len());
    }
    out
}

/// Blocks for `pages` pages: no more than one warp per page.
pub(crate) fn blocks_for(blocks: u32, pages: usize) -> u32 {
    let warps = THREADS as usize / 32;
    (blocks as usize).min(pages.div_ceil(warps)).max(1) as u32
}

mod calibrate;
mod staged;
pub(crate) use calibrate::calibrate;
#[cfg(test)]
pub(crate) use calibrate::pick_blocks;
pub use staged::staging_stats;
pub(crate) use staged::{launch_staged, staged_order, Staging};

#[cfg(test)]
mod tests;
