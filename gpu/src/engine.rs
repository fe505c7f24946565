//! The transfer engine shared by the GPU backends (CUDA and HIP): per-device stream sets,
//! the cache of opened IPC handles, op splitting, batched submission, fences (DESIGN §7)
//! and the "synchronize everything before returning, even on error" rule. Each driver API
//! plugs in through [`DeviceApi`], so the HIP backend runs the same logic that is
//! exercised on NVIDIA hardware.
//!
//! One copy call ([`GpuRegion::transfer_group`]) takes every part of a transfer that lives
//! on one GPU (a vLLM worker registers one allocation per layer, so a block touches dozens
//! of regions), cuts ops at 16 MiB and at the boundaries of host registrations, spreads
//! them over the streams of one stream set in byte-balanced contiguous runs, and submits
//! each run as batches (`cuMemcpyBatchAsync` where the driver has it: one call for
//! hundreds of 64 KiB pages instead of one call each).

use std::any::Any;
use std::collections::HashMap;
use std::os::fd::OwnedFd;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::time::Instant;
use std::sync::{Arc, Mutex, MutexGuard, RwLock};

use crate::error::format_uuid;
use crate::fence::{self, FenceWord};
use crate::gather;
use crate::{
    check_ops, expect_kind, Backend, CopyOp, DeviceRegion, Fence, GpuError, MemoryKind,
    MemoryRegistration, Part, StagePlan,
};

/// Streams per copy call unless tuned ([`set_tuning`], `UMBP_COPY_STREAMS`). One stream
/// measured best on the H200 (2026-11-29) with pipelined stages: 64 KiB pages 50.9/50.5
/// GB/s store/load vs 48.5/48.5 with 4 streams (each stream's share of a stage starts
/// with small batches again, and every stream needs its own stage events); more streams
/// may still help where a batch can spread over several copy engines.
const DEFAULT_STREAMS: usize = 1;
/// Most streams a set may have.
pub(crate) const MAX_STREAMS: usize = 16;

/// Ops larger than this are cut so that one huge op also spreads over the streams.
const SPLIT_BYTES: u64 = 16 << 20;

/// Most copies handed to the driver in one batch call unless tuned
/// ([`set_batch_max`], `UMBP_COPY_BATCH_MAX`).
const DEFAULT_BATCH_MAX: usize = 512;
static BATCH_MAX: AtomicUsize = AtomicUsize::new(0);

/// Size of the first batch of each stream's run (then growing by BATCH_GROWTH up to the
/// batch maximum).
const FIRST_BATCH: usize = 16;
/// Batch growth factor, 4/3: the driver takes ~0.85 µs per copy and the DMA drains a
/// 64 KiB copy in ~1.2 µs (H200, 2026-11-29), so a batch may be at most ~1.4x the one
/// before for the DMA not to idle while it is handed over (doubling left gaps).
const BATCH_GROWTH_NUM: usize = 4;
const BATCH_GROWTH_DEN: usize = 3;

/// Most copies per batched driver call (1..=65536).
pub fn set_batch_max(n: usize) {
    BATCH_MAX.store(n.clamp(1, 65536), Ordering::Relaxed);
}

/// See [`set_batch_max`].
pub fn batch_max() -> usize {
    let mut n = BATCH_MAX.load(Ordering::Relaxed);
    if n == 0 {
        n = std::env::var("UMBP_COPY_BATCH_MAX").ok().and_then(|v| v.parse().ok()).unwrap_or(DEFAULT_BATCH_MAX).clamp(1, 65536);
        BATCH_MAX.store(n, Ordering::Relaxed);
    }
    n
}

static STREAMS: AtomicUsize = AtomicUsize::new(0);
static BATCH: AtomicUsize = AtomicUsize::new(0);
static PARALLEL: AtomicUsize = AtomicUsize::new(0);

/// Copy calls with at least this many items enqueue each stream's run from its own
/// thread when parallel submission is on ([`set_parallel_submit`]).
const PARALLEL_MIN_ITEMS: usize = 256;

/// Engine counters of this process (all GPU copy calls), for benchmarks.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct EngineStats {
    pub calls: u64,
    pub items: u64,
    pub bytes: u64,
    /// Time spent handing copies to the driver.
    pub enqueue_ns: u64,
    /// Time of whole copy calls (fence waits, enqueue, synchronization).
    pub total_ns: u64,
    /// Stages reported finished before their copy call ended (staged calls).
    pub stages: u64,
}

static STAT_CALLS: AtomicU64 = AtomicU64::new(0);
static STAT_ITEMS: AtomicU64 = AtomicU64::new(0);
static STAT_BYTES: AtomicU64 = AtomicU64::new(0);
static STAT_ENQUEUE: AtomicU64 = AtomicU64::new(0);
static STAT_TOTAL: AtomicU64 = AtomicU64::new(0);
static STAT_STAGES: AtomicU64 = AtomicU64::new(0);

/// Snapshot of [`EngineStats`].
pub fn engine_stats() -> EngineStats {
    EngineStats {
        calls: STAT_CALLS.load(Ordering::Relaxed),
        items: STAT_ITEMS.load(Ordering::Relaxed),
        bytes: STAT_BYTES.load(Ordering::Relaxed),
        enqueue_ns: STAT_ENQUEUE.load(Ordering::Relaxed),
        total_ns: STAT_TOTAL.load(Ordering::Relaxed),
        stages: STAT_STAGES.load(Ordering::Relaxed),
    }
}

/// Whether large copy calls enqueue each stream's share from its own thread (default
/// off, `UMBP_COPY_PARALLEL=1` turns it on). Measured on the H200 (2026-11-29): no gain,
/// the driver's enqueue (~0.7 µs per batched copy) stays ahead of the DMA from one
/// thread, and 4 submitting threads made 64 KiB-page calls ~5% slower.
pub fn set_parallel_submit(on: bool) {
    PARALLEL.store(if on { 1 } else { 2 }, Ordering::Relaxed);
}

/// See [`set_parallel_submit`].
pub fn parallel_submit() -> bool {
    let mut p = PARALLEL.load(Ordering::Relaxed);
    if p == 0 {
        p = if std::env::var("UMBP_COPY_PARALLEL").is_ok_and(|v| v == "1") { 1 } else { 2 };
        PARALLEL.store(p, Ordering::Relaxed);
    }
    p == 1
}

/// Copy tuning of this process: streams per copy call (1..=16) and whether batched copy
/// submission is used where the driver has it. Defaults: `UMBP_COPY_STREAMS` (else 1) and
/// `UMBP_COPY_BATCH` (`0` turns batching off). For benchmarks and operators; takes effect
/// for copy calls that start afterwards.
pub fn set_tuning(streams: usize, batch: bool) {
    STREAMS.store(streams.clamp(1, MAX_STREAMS), Ordering::Relaxed);
    BATCH.store(if batch { 1 } else { 2 }, Ordering::Relaxed);
}

/// The tuning in effect: `(streams, batch)`.
pub fn tuning() -> (usize, bool) {
    let mut s = STREAMS.load(Ordering::Relaxed);
    if s == 0 {
        s = std::env::var("UMBP_COPY_STREAMS")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(DEFAULT_STREAMS)
            .clamp(1, MAX_STREAMS);
        STREAMS.store(s, Ordering::Relaxed);
    }
    let mut b = BATCH.load(Ordering::Relaxed);
    if b == 0 {
        b = if std::env::var("UMBP_COPY_BATCH").is_ok_and(|v| v == "0") { 2 } else { 1 };
        BATCH.store(b, Ordering::Relaxed);
    }
    (s, b == 1)
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Dir {
    DeviceToHost,
    HostToDevice,
}

/// One contiguous copy between host memory and device memory, in absolute addresses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Item {
    pub host: *mut u8,
    pub device: u64,
    pub len: usize,
}

// SAFETY: plain addresses; what may be done with them is the copy call's contract, and a
// call's items are only handed to the driver (from one or several enqueueing threads).
unsafe impl Send for Item {}
// SAFETY: as above; items are never written after they are built.
unsafe impl Sync for Item {}

/// The driver calls the engine needs. Implementations map driver errors to
/// [`GpuError::Driver`] with the call's name. Optional capabilities (batching, events,
/// stream memory operations) have defaults that report them absent; the engine then
/// falls back (one call per copy, CPU-side fence waits and writes).
pub(crate) trait DeviceApi: Send + Sync + 'static {
    /// "CUDA" or "HIP", for messages.
    const API: &'static str;
    const KIND: MemoryKind;
    /// What makes a device current on a thread (CUDA: its primary context).
    type Device: Send + Sync;
    type Stream: Copy + Send;
    type Event: Copy + Send;

    fn device_count(&self) -> Result<i32, GpuError>;
    fn device_uuid(&self, ordinal: i32) -> Result<[u8; 16], GpuError>;
    fn open_device(&self, ordinal: i32) -> Result<Self::Device, GpuError>;
    /// Makes `dev` current on the calling thread, remembering what was current; called
    /// before every batch of calls because the pool calls in from threads it does not
    /// control (in embedded mode, the worker's own threads).
    fn bind(&self, dev: &Self::Device) -> Result<(), GpuError>;
    /// Restores what was current before the matching `bind`.
    fn unbind(&self);
    fn create_stream(&self) -> Result<Self::Stream, GpuError>;
    fn destroy_stream(&self, stream: Self::Stream);
    /// # Safety
    /// `host[..len]` is valid (writable for DeviceToHost) until the stream is synchronized;
    /// `device..device+len` lies inside an open allocation.
    unsafe fn copy_async(
        &self,
        dir: Dir,
        host: *mut u8,
        device: u64,
        len: usize,
        stream: Self::Stream,
    ) -> Result<(), GpuError>;
    /// Enqueues every item on `stream`, in one driver call where the driver can. Default:
    /// one [`Self::copy_async`] per item.
    ///
    /// # Safety
    /// As [`Self::copy_async`] for every item.
    unsafe fn copy_batch_async(
        &self,
        dev: &Self::Device,
        dir: Dir,
        items: &[Item],
        stream: Self::Stream,
        batch: bool,
    ) -> Result<(), GpuError> {
        let _ = (dev, batch);
        for it in items {
            // SAFETY: forwarded contract.
            unsafe { self.copy_async(dir, it.host, it.device, it.len, stream) }?;
        }
        Ok(())
    }
    fn synchronize(&self, stream: Self::Stream) -> Result<(), GpuError>;
    fn create_event(&self) -> Result<Self::Event, GpuError> {
        Err(GpuError::Unsupported(format!("{}: events not wired", Self::API)))
    }
    fn destroy_event(&self, _event: Self::Event) {}
    /// `waiter` waits (on the GPU) for the work enqueued on `other` so far.
    fn join(&self, waiter: Self::Stream, event: Self::Event, other: Self::Stream) -> Result<(), GpuError> {
        let _ = (waiter, event, other);
        Err(GpuError::Unsupported(format!("{}: events not wired", Self::API)))
    }
    /// Records `event` on `stream`: it completes once the work enqueued so far is done.
    fn record(&self, event: Self::Event, stream: Self::Stream) -> Result<(), GpuError> {
        let _ = (event, stream);
        Err(GpuError::Unsupported(format!("{}: events not wired", Self::API)))
    }
    /// Whether the work before the last [`Self::record`] of `event` is done (no waiting).
    fn event_done(&self, event: Self::Event) -> Result<bool, GpuError> {
        let _ = event;
        Err(GpuError::Unsupported(format!("{}: events not wired", Self::API)))
    }
    /// Blocks until [`Self::event_done`] would say true; errors of that work surface here.
    fn event_wait(&self, event: Self::Event) -> Result<(), GpuError> {
        let _ = event;
        Err(GpuError::Unsupported(format!("{}: events not wired", Self::API)))
    }
    /// Enqueues a wait until the device-mapped host word at `addr` reaches `value`
    /// (cyclic `>=`).
    ///
    /// # Safety
    /// `addr` is a device-mapped 8-byte word that stays mapped until the stream passed.
    unsafe fn wait_value64(&self, stream: Self::Stream, addr: u64, value: u64) -> Result<(), GpuError>;
    /// Enqueues a write of `value` to the device-mapped word at `addr`, after the stream's
    /// earlier work, with a memory barrier before it.
    ///
    /// # Safety
    /// As [`Self::wait_value64`].
    unsafe fn write_value64(&self, stream: Self::Stream, addr: u64, value: u64) -> Result<(), GpuError>;
    /// # Safety
    /// A device is bound on this thread.
    unsafe fn ipc_open(&self, handle: &[u8; 64]) -> Result<u64, GpuError>;
    /// # Safety
    /// `ptr` came from `ipc_open` and no copy on it is in flight.
    unsafe fn ipc_close(&self, ptr: u64) -> Result<(), GpuError>;
    /// Base and size of the allocation containing `ptr`.
    fn address_range(&self, ptr: u64) -> Result<(u64, u64), GpuError>;
    /// # Safety
    /// See [`Backend::register_host_memory`]; a device is bound on this thread.
    unsafe fn host_register(&self, base: *mut u8, len: usize) -> Result<(), GpuError>;
    /// # Safety
    /// See [`Backend::unregister_host_memory`].
    unsafe fn host_unregister(&self, base: *mut u8) -> Result<(), GpuError>;

    // Kernel path ([`crate::gather`]); defaults report it absent (copy engines only).
    /// Loads the page copy kernel for `dev` (bound); an opaque function handle.
    fn copy_kernel(&self, dev: &Self::Device) -> Result<u64, GpuError> {
        let _ = dev;
        Err(GpuError::Unsupported(format!("{}: no page copy kernel", Self::API)))
    }
    /// Whether host memory registered with [`Self::host_register`] is addressable by
    /// kernels at its host address.
    fn host_pointers_are_device_pointers(&self, dev: &Self::Device) -> Result<bool, GpuError> {
        let _ = dev;
        Ok(false)
    }
    /// Enqueues `kernel` over `n` descriptors at device address `descs` on `stream`.
    ///
    /// # Safety
    /// `descs` holds `n` [`crate::gather::Desc`] readable by the device until the stream
    /// passed the launch; each names ranges valid as in [`Self::copy_async`].
    unsafe fn launch_copy_kernel(&self, kernel: u64, descs: u64, n: u64, blocks: u32, threads: u32, stream: Self::Stream) -> Result<(), GpuError> {
        let _ = (kernel, descs, n, blocks, threads, stream);
        Err(GpuError::Unsupported(format!("{}: no page copy kernel", Self::API)))
    }
    /// Pinned host memory, device-mapped at its host address (a device is bound).
    fn alloc_mapped(&self, bytes: usize) -> Result<*mut u8, GpuError> {
        let _ = bytes;
        Err(GpuError::Unsupported(format!("{}: no mapped allocations", Self::API)))
    }
    /// # Safety
    /// `ptr` came from [`Self::alloc_mapped`] and nothing reads it any more.
    unsafe fn free_mapped(&self, ptr: *mut u8) {
        let _ = ptr;
    }
    /// Device memory (a device is bound).
    fn alloc_device(&self, bytes: usize) -> Result<u64, GpuError> {
        let _ = bytes;
        Err(GpuError::Unsupported(format!("{}: no device allocations", Self::API)))
    }
    /// # Safety
    /// `ptr` came from [`Self::alloc_device`] and nothing uses it any more.
    unsafe fn free_device(&self, ptr: u64) {
        let _ = ptr;
    }
}

/// The streams (and lazily made events) one copy call uses exclusively.
struct StreamSet<A: DeviceApi> {
    streams: Vec<A::Stream>,
    /// Join events of the GPU-side load fence write.
    events: Vec<A::Event>,
    /// Stage-end markers of staged calls: stage `s`, stream `k` at `s * streams + k`.
    stage_events: Vec<A::Event>,
    /// Descriptor lists of kernel-path stages.
    descs: gather::DescBuf,
}

/// One GPU as seen by the pool: its bound handle and idle stream sets. Stream sets are
/// taken whole by one copy call, so concurrent calls from several pool threads never wait
/// on each other's work.
struct Engine<A: DeviceApi> {
    ordinal: i32,
    dev: A::Device,
    idle: Mutex<Vec<StreamSet<A>>>,
    /// Stream memory operations (GPU-side fence waits/writes) work; cleared at the first
    /// failure, after which fences are waited for and written by the CPU.
    memops: AtomicBool,
    /// Events work (staged calls report finished stages); cleared at the first failure,
    /// after which staged calls run as one stage (reported when the call ends).
    events: AtomicBool,
    /// The kernel path, calibrated at the first region opened on this GPU; None where it
    /// cannot run (then copy engines only).
    gather: std::sync::OnceLock<Option<gather::GatherState>>,
}

#[derive(Clone, Copy)]
struct IpcMapping {
    ptr: u64,
    /// Bytes of the exported allocation from `ptr` on.
    size: u64,
    refs: usize,
}

/// (peer pid, device UUID, handle bytes). IPC handles are bearer tokens: the driver maps
/// whatever handle it is given, and a process-wide cache keyed by the bytes alone let any
/// peer that presented another's handle reuse the other's mapping without even a driver
/// call. Keyed by the registering process too, a handle is shared only among the
/// attachments of the one process that sent it (a reconnecting worker re-registers while
/// its old regions may still be held); another process gets its own driver call.
type IpcKey = (u32, [u8; 16], [u8; 64]);

struct Shared<A: DeviceApi> {
    api: A,
    engines: Mutex<HashMap<[u8; 16], Arc<Engine<A>>>>,
    /// Opened IPC handles. A worker often registers several tensors of one allocation (the
    /// PyTorch caching allocator packs them), and opening one handle twice in a process is
    /// an error with CUDA, so each handle is opened once and reference counted.
    ipc: Mutex<HashMap<IpcKey, IpcMapping>>,
    /// Host ranges registered through this backend, sorted by start: copies are cut at
    /// their ends, because a DMA straddling two registrations may be staged by the driver.
    host_ranges: RwLock<Vec<(usize, usize)>>,
}

/// A device bound on this thread until dropped; the thread's previous context or device is
/// restored then, so a worker thread calling into an embedded pool keeps its own.
struct Bound<'a, A: DeviceApi>(&'a A);

impl<'a, A: DeviceApi> Bound<'a, A> {
    fn new(api: &'a A, dev: &A::Device) -> Result<Self, GpuError> {
        api.bind(dev)?;
        Ok(Bound(api))
    }
}

impl<A: DeviceApi> Drop for Bound<'_, A> {
    fn drop(&mut self) {
        self.0.unbind();
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic while holding these locks leaves plain data in a consistent state.
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// [`Backend`] of a GPU kind.
pub(crate) struct GpuBackend<A: DeviceApi> {
    shared: Arc<Shared<A>>,
}

impl<A: DeviceApi> GpuBackend<A> {
    pub(crate) fn new(api: A) -> Self {
        Self {
            shared: Arc::new(Shared {
                api,
                engines: Mutex::new(HashMap::new()),
                ipc: Mutex::new(HashMap::new()),
                host_ranges: RwLock::new(Vec::new()),
            }),
        }
    }
}

impl<A: DeviceApi> GpuBackend<A> {
    /// Opens (or shares) the IPC mapping of `reg`'s allocation. A device is bound.
    fn ipc_mapping(&self, reg: &MemoryRegistration, key: IpcKey) -> Result<IpcMapping, GpuError> {
        let api = &self.shared.api;
        let mut ipc = lock(&self.shared.ipc);
        if let Some(m) = ipc.get_mut(&key) {
            m.refs += 1;
            return Ok(*m);
        }
        // SAFETY: the engine's device is bound on this thread.
        let ptr = unsafe { api.ipc_open(&reg.ipc_handle) }?;
        let size = match api.address_range(ptr) {
            Ok((base, size)) => base + size - ptr,
            Err(e) => {
                // SAFETY: just opened, nothing uses it.
                let _ = unsafe { api.ipc_close(ptr) };
                return Err(e);
            }
        };
        let m = IpcMapping { ptr, size, refs: 1 };
        ipc.insert(key, m);
        Ok(m)
    }

    /// The allocation of `reg` in this very process: its `address` is a device pointer
    /// here, `address - offset` must be the allocation's base.
    fn local_mapping(&self, reg: &MemoryRegistration) -> Result<IpcMapping, GpuError> {
        let (base, size) = self.shared.api.address_range(reg.address)?;
        if reg.address.checked_sub(reg.offset) != Some(base) {
            return Err(GpuError::invalid(
                A::KIND,
                format!(
                    "address {:#x} - offset {} is not the allocation base {base:#x}",
                    reg.address, reg.offset
                ),
            ));
        }
        Ok(IpcMapping {
            ptr: base,
            size,
            refs: 0,
        })
    }
}

impl<A: DeviceApi> Shared<A> {
    fn engine_for(&self, uuid: &[u8; 16]) -> Result<Arc<Engine<A>>, GpuError> {
        let mut engines = lock(&self.engines);
        if let Some(e) = engines.get(uuid) {
            return Ok(e.clone());
        }
        for ordinal in 0..self.api.device_count()? {
            if &self.api.device_uuid(ordinal)? == uuid {
                let dev = self.api.open_device(ordinal)?;
                let engine = Arc::new(Engine {
                    ordinal,
                    dev,
                    idle: Mutex::new(Vec::new()),
                    memops: AtomicBool::new(true),
                    events: AtomicBool::new(true),
                    gather: std::sync::OnceLock::new(),
                });
                tracing::debug!(api = A::API, ordinal, uuid = %format_uuid(uuid), "opened transfer engine");
                engines.insert(*uuid, engine.clone());
                return Ok(engine);
            }
        }
        Err(GpuError::DeviceNotFound {
            api: A::API,
            uuid: format_uuid(uuid),
        })
    }

    /// The engine used for host registration: any device will do because registrations are
    /// portable; device 0 keeps it deterministic.
    fn first_engine(&self) -> Result<Arc<Engine<A>>, GpuError> {
        if self.api.device_count()? < 1 {
            return Err(GpuError::Unsupported(format!(
                "no {} device visible to the pool",
                A::API
            )));
        }
        let uuid = self.api.device_uuid(0)?;
        self.engine_for(&uuid)
    }

    fn release(&self, key: &IpcKey, engine: &Engine<A>) {
        let mut ipc = lock(&self.ipc);
        let Some(m) = ipc.get_mut(key) else { return };
        m.refs -= 1;
        if m.refs > 0 {
            return;
        }
        let ptr = m.ptr;
        ipc.remove(key);
        let closed = Bound::new(&self.api, &engine.dev).and_then(|_bound| {
            // SAFETY: no region refers to the mapping any more and copies are synchronous.
            unsafe { self.api.ipc_close(ptr) }
        });
        match closed {
            Ok(()) => tracing::debug!(api = A::API, "closed IPC mapping {ptr:#x}"),
            Err(e) => tracing::warn!(api = A::API, "closing IPC mapping {ptr:#x}: {e}"),
        }
    }
}

/// Number of IPC mappings this process holds open per GPU kind (tests check that a dead
/// worker's mappings are closed).
pub(crate) fn open_ipc_mappings<A: DeviceApi>(b: &GpuBackend<A>) -> usize {
    lock(&b.shared.ipc).len()
}

/// End of the registered range containing `addr`, if any.
fn range_end(ranges: &[(usize, usize)], addr: usize) -> Option<usize> {
    let i = ranges.partition_point(|r| r.0 <= addr);
    (i > 0 && ranges[i - 1].1 > addr).then(|| ranges[i - 1].1)
}

/// Appends the items of `op` (device side at `dev_base`), cut at `split` bytes and at the
/// ends of registered host ranges.
pub(crate) fn push_items(
    items: &mut Vec<Item>,
    host_base: *mut u8,
    dev_base: u64,
    op: &CopyOp,
    ranges: &[(usize, usize)],
    split: u64,
) {
    let mut done = 0;
    while done < op.len {
        let host = host_base as usize + (op.host_offset + done) as usize;
        let mut piece = (op.len - done).min(split);
        if let Some(end) = range_end(ranges, host) {
            piece = piece.min((end - host) as u64);
        }
        items.push(Item {
            host: host as *mut u8,
            device: dev_base + op.device_offset + done,
            len: piece as usize,
        });
        done += piece;
    }
}

/// The batch after one of `size` copies: BATCH_GROWTH larger (at least one more), at most
/// `per_call`.
fn next_batch(size: usize, per_call: usize) -> usize {
    (size * BATCH_GROWTH_NUM / BATCH_GROWTH_DEN).max(size + 1).min(per_call)
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

/// Splits `items` into at most `n` contiguous runs of about equal bytes.
pub(crate) fn balance(items: &[Item], n: usize) -> Vec<std::ops::Range<usize>> {
    let total: u64 = items.iter().map(|i| i.len as u64).sum();
    let n = n.clamp(1, items.len().max(1));
    let mut runs = Vec::with_capacity(n);
    let (mut start, mut acc) = (0, 0u64);
    for (i, it) in items.iter().enumerate() {
        acc += it.len as u64;
        // Close run k once it holds its share of the bytes (k+1)/n of the total.
        if acc * n as u64 >= total * (runs.len() as u64 + 1) && runs.len() + 1 < n {
            runs.push(start..i + 1);
            start = i + 1;
        }
    }
    if start < items.len() || runs.is_empty() {
        runs.push(start..items.len());
    }
    runs
}

/// Builds stage `s` while earlier stages may be copying on `set`'s streams. If the
/// caller's builder panics, every stream is synchronized before the panic goes on: the
/// caller gives the pool memory of those copies back while unwinding, and a DMA must not
/// still read or write it then.
fn build_or_drain<A: DeviceApi>(api: &A, set: &StreamSet<A>, build: &mut StageBuilder<'_>, s: usize, items: &mut Vec<Item>) -> Result<(), GpuError> {
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
    fn take_set(&self, api: &A, want: usize) -> Result<StreamSet<A>, GpuError> {
        let mut set = lock(&self.idle).pop().unwrap_or(StreamSet {
            streams: Vec::new(),
            events: Vec::new(),
            stage_events: Vec::new(),
            descs: gather::DescBuf::default(),
        });
        while set.streams.len() < want {
            match api.create_stream() {
                Ok(s) => set.streams.push(s),
                Err(e) => {
                    self.put_set(set);
                    return Err(e);
                }
            }
        }
        Ok(set)
    }

    fn put_set(&self, set: StreamSet<A>) {
        lock(&self.idle).push(set);
    }

    /// Runs a copy call in direction `dir` on this engine: fence wait (stores), copies
    /// spread over the stream set, fence signal (loads, when `signal` is set), then
    /// synchronizes every stream used, also after an error: returning while a DMA still
    /// targets pool memory would let the pool reuse that memory under it.
    ///
    /// The call has `stages` stages: `first` holds stage 0's items, and `build(s, items)`
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
    #[allow(clippy::too_many_arguments)]
    unsafe fn run(
        &self,
        api: &A,
        dir: Dir,
        first: Vec<Item>,
        stages: usize,
        build: &mut StageBuilder<'_>,
        fence: &Fence<'_>,
        signal: bool,
        keep_waiting: &dyn Fn() -> bool,
        stage_done: &mut dyn FnMut(usize),
        ranges: &[(usize, usize)],
    ) -> Result<(), GpuError> {
        let mut items = first;
        // One large object: cut over several streams (copy engines), both directions.
        let large = gather::is_large(&items);
        let stages = stages.max(1);
        let staged = stages > 1 && self.events.load(Ordering::Relaxed);
        let mut rest_built = stages == 1;
        if !staged && !rest_built {
            for s in 1..stages {
                build(s, &mut items)?;
            }
            rest_built = true;
        }
        let wait = match fence {
            Fence::WaitBefore(word, value) if !items.is_empty() || staged => Some((*word, *value)),
            _ => None,
        };
        let signal = match fence {
            Fence::SignalAfter(word, value) if signal => Some((*word, *value)),
            _ => None,
        };
        if items.is_empty() && signal.is_none() && !staged {
            return Ok(());
        }
        let t_call = Instant::now();
        let (streams, batch) = tuning();
        let streams = if large { streams.max(gather::LARGE_STREAMS) } else { streams };
        if large && !staged {
            gather::split_large(&mut items, streams);
        }
        let n_streams = if staged { streams } else { streams.clamp(1, items.len().max(1)) };
        let _bound = Bound::new(api, &self.dev)?;
        let mut set = self.take_set(api, n_streams)?;
        // SAFETY: the set's previous call synchronized its streams before putting it back.
        unsafe { set.descs.reset(api) };
        let kernel = self.gather_path();
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
                if let Err(e) = word.wait_cpu(value, keep_waiting) {
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
            let per_call = batch_max();
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
                        gather::split_large(&mut items, n_streams);
                    }
                    n_items += items.len() as u64;
                    n_bytes += items.iter().map(|i| i.len as u64).sum::<u64>();
                    if let Some(g) = kernel.filter(|g| g.wants(dir, &items, ranges)) {
                        used[0] = true;
                        // SAFETY: forwarded caller contract; `wants` checked eligibility.
                        if let Err(e) = unsafe { gather::launch(api, g, &mut set.descs, dir, &items, set.streams[0]) } {
                            first_err = Some(e);
                            break 'stages;
                        }
                    } else {
                        for (k, run) in balance(&items, n_streams).into_iter().enumerate() {
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
                n_items = items.len() as u64;
                n_bytes = items.iter().map(|i| i.len as u64).sum::<u64>();
                let runs = balance(&items, n_streams);
                if first_err.is_some() {
                } else if let Some(g) = kernel.filter(|g| g.wants(dir, &items, ranges)) {
                    used[0] = true;
                    // SAFETY: forwarded caller contract; `wants` checked eligibility.
                    first_err = unsafe { gather::launch(api, g, &mut set.descs, dir, &items, set.streams[0]) }.err();
                } else if runs.len() > 1 && items.len() >= PARALLEL_MIN_ITEMS && parallel_submit() {
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
        STAT_ENQUEUE.fetch_add(t_enqueue.elapsed().as_nanos() as u64, Ordering::Relaxed);
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
            let released = if first_err.is_some() { Err(None) } else { word.wait_cpu(value, keep_waiting).map_err(Some) };
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
        STAT_CALLS.fetch_add(1, Ordering::Relaxed);
        STAT_ITEMS.fetch_add(n_items, Ordering::Relaxed);
        STAT_BYTES.fetch_add(n_bytes, Ordering::Relaxed);
        STAT_TOTAL.fetch_add(t_call.elapsed().as_nanos() as u64, Ordering::Relaxed);
        STAT_STAGES.fetch_add(reported as u64, Ordering::Relaxed);
        first_err.map_or(Ok(()), Err)
    }

    /// The kernel path of this GPU unless copy engines are forced or it is unavailable.
    fn gather_path(&self) -> Option<&gather::GatherState> {
        match gather::gather_config().mode {
            gather::GatherMode::CopyEngine => None,
            _ => self.gather.get().and_then(Option::as_ref),
        }
    }

    /// Calibrates the kernel path once (a device is bound); later calls return at once.
    fn calibrate_once(&self, api: &A) {
        if gather::gather_config().mode == gather::GatherMode::CopyEngine {
            return;
        }
        self.gather.get_or_init(|| match gather::calibrate(api, &self.dev, gather::gather_config(), batch_max()) {
            Ok(g) => {
                let c = &g.calibration;
                tracing::info!(
                    api = A::API,
                    ordinal = self.ordinal,
                    blocks = c.blocks,
                    d2h_kernel_up_to = c.d2h_crossover,
                    h2d_kernel_up_to = c.h2d_crossover,
                    points = ?c.points,
                    "page copy kernel calibrated: pages up to these sizes go to the kernel, larger ones to copy engines"
                );
                gather::record_calibration(self.ordinal, c);
                Some(g)
            }
            Err(e) => {
                tracing::info!(api = A::API, ordinal = self.ordinal, "page copy kernel unavailable, copy engines only: {e}");
                None
            }
        });
    }

    /// Makes sure `set` has `n` stage events; false (and staging off for this engine from
    /// now on) where the driver has no usable events.
    fn stage_events_ready(&self, api: &A, set: &mut StreamSet<A>, n: usize) -> bool {
        if !self.events.load(Ordering::Relaxed) {
            return false;
        }
        while set.stage_events.len() < n {
            match api.create_event() {
                Ok(e) => set.stage_events.push(e),
                Err(e) => {
                    tracing::debug!(api = A::API, "no events, copy calls run unstaged: {e}");
                    self.events.store(false, Ordering::Relaxed);
                    return false;
                }
            }
        }
        true
    }

    fn signal_on_gpu(
        &self,
        api: &A,
        set: &mut StreamSet<A>,
        used: &mut [bool],
        runs: usize,
        addr: u64,
        value: u64,
    ) -> Result<(), GpuError> {
        while set.events.len() < runs.saturating_sub(1) {
            set.events.push(api.create_event()?);
        }
        for k in 1..runs {
            api.join(set.streams[0], set.events[k - 1], set.streams[k])?;
        }
        used[0] = true;
        // SAFETY: the caller's fence word stays mapped until it synchronized the stream.
        unsafe { api.write_value64(set.streams[0], addr, value) }
    }
}

impl<A: DeviceApi> Backend for GpuBackend<A> {
    fn kind(&self) -> MemoryKind {
        A::KIND
    }

    unsafe fn register_host_memory(&self, base: *mut u8, len: usize) -> Result<(), GpuError> {
        let engine = self.shared.first_engine()?;
        let _bound = Bound::new(&self.shared.api, &engine.dev)?;
        // SAFETY: forwarded caller contract; a device is bound.
        unsafe { self.shared.api.host_register(base, len) }?;
        let mut ranges = self.shared.host_ranges.write().unwrap_or_else(|e| e.into_inner());
        let at = ranges.partition_point(|r| r.0 < base as usize);
        ranges.insert(at, (base as usize, base as usize + len));
        Ok(())
    }

    unsafe fn unregister_host_memory(&self, base: *mut u8) -> Result<(), GpuError> {
        self.shared
            .host_ranges
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .retain(|r| r.0 != base as usize);
        let engine = self.shared.first_engine()?;
        let _bound = Bound::new(&self.shared.api, &engine.dev)?;
        // SAFETY: forwarded caller contract.
        unsafe { self.shared.api.host_unregister(base) }
    }

    /// `peer_pid` equal to this process (embedded mode: the pool runs inside the worker)
    /// uses the worker's device pointer directly, because a process cannot open its own
    /// IPC handle (CUDA refuses it).
    fn open_region(
        &self,
        reg: &MemoryRegistration,
        _fd: Option<OwnedFd>,
        peer_pid: u32,
    ) -> Result<Box<dyn DeviceRegion>, GpuError> {
        self.open_gpu_region(reg, peer_pid)
    }

    fn open_region_for(
        &self,
        reg: &MemoryRegistration,
        _fd: Option<OwnedFd>,
        peer: &crate::Peer<'_>,
    ) -> Result<Box<dyn DeviceRegion>, GpuError> {
        self.open_gpu_region(reg, peer.pid)
    }

    fn open_mappings(&self) -> usize {
        open_ipc_mappings(self)
    }
}

impl<A: DeviceApi> GpuBackend<A> {
    fn open_gpu_region(&self, reg: &MemoryRegistration, peer_pid: u32) -> Result<Box<dyn DeviceRegion>, GpuError> {
        expect_kind(A::KIND, reg)?;
        if reg.size == 0 {
            return Err(GpuError::invalid(A::KIND, "size is 0"));
        }
        let shared = &self.shared;
        let engine = shared.engine_for(&reg.device_uuid)?;
        let _bound = Bound::new(&shared.api, &engine.dev)?;
        engine.calibrate_once(&shared.api);
        let (mapping, key) = if peer_pid == std::process::id() {
            (self.local_mapping(reg)?, None)
        } else {
            let key = (peer_pid, reg.device_uuid, reg.ipc_handle);
            (self.ipc_mapping(reg, key)?, Some(key))
        };
        let region = GpuRegion {
            shared: shared.clone(),
            engine,
            key,
            // Wrapping: a hostile offset must reach the range check below, not a panic.
            device_ptr: mapping.ptr.wrapping_add(reg.offset),
            len: reg.size,
            alloc_id: reg.alloc_id,
        };
        // Checked after taking the reference so that dropping `region` releases it.
        if reg
            .offset
            .checked_add(reg.size)
            .is_none_or(|end| end > mapping.size)
        {
            return Err(GpuError::invalid(
                A::KIND,
                format!(
                    "offset {} + size {} passes the exported allocation of {} bytes",
                    reg.offset, reg.size, mapping.size
                ),
            ));
        }
        tracing::debug!(
            api = A::API,
            ordinal = region.engine.ordinal,
            alloc_id = reg.alloc_id,
            size = reg.size,
            in_process = region.key.is_none(),
            "opened device region"
        );
        Ok(Box::new(region))
    }
}

pub(crate) struct GpuRegion<A: DeviceApi> {
    shared: Arc<Shared<A>>,
    engine: Arc<Engine<A>>,
    /// The shared IPC mapping this region holds a reference on; None in-process.
    key: Option<IpcKey>,
    /// Device address of byte 0 of the registered range, in the pool's address space.
    device_ptr: u64,
    len: u64,
    alloc_id: u32,
}

impl<A: DeviceApi> Drop for GpuRegion<A> {
    fn drop(&mut self) {
        if let Some(key) = &self.key {
            self.shared.release(key, &self.engine);
        }
    }
}

fn duplicate(e: &GpuError) -> GpuError {
    match e {
        GpuError::Driver { call, code, name } => GpuError::Driver { call, code: *code, name: name.clone() },
        GpuError::FenceAborted { value, word } => GpuError::FenceAborted { value: *value, word: *word },
        GpuError::FenceTimeout { value, last, waited_ms, why } => {
            GpuError::FenceTimeout { value: *value, last: *last, waited_ms: *waited_ms, why }
        }
        other => GpuError::Unsupported(other.to_string()),
    }
}

impl<A: DeviceApi> GpuRegion<A> {
    /// `region` as a region of this same engine, if it is one.
    fn same_engine<'x>(&self, region: &'x dyn DeviceRegion) -> Option<&'x GpuRegion<A>> {
        region.as_any().and_then(|a| a.downcast_ref::<GpuRegion<A>>()).filter(|r| Arc::ptr_eq(&r.engine, &self.engine))
    }

    /// # Safety
    /// Host ranges of all ops are valid (writable for DeviceToHost) for the call.
    unsafe fn run_one(&self, ops: &[CopyOp], host: *mut u8, dir: Dir) -> Result<(), GpuError> {
        let part = [Part { region: self, ops }];
        let mut results = [None];
        let mut claimed = [false];
        // SAFETY: forwarded caller contract.
        unsafe {
            self.transfer_group(dir == Dir::DeviceToHost, &part, 0, &mut claimed, &mut results, host, &Fence::None, &|| true)
        };
        results[0].take().unwrap_or(Ok(()))
    }
}

impl<A: DeviceApi> DeviceRegion for GpuRegion<A> {
    fn kind(&self) -> MemoryKind {
        A::KIND
    }

    fn len(&self) -> u64 {
        self.len
    }

    unsafe fn copy_to_host(&self, ops: &[CopyOp], host_base: *mut u8) -> Result<(), GpuError> {
        // SAFETY: forwarded caller contract.
        unsafe { self.run_one(ops, host_base, Dir::DeviceToHost) }
    }

    unsafe fn copy_from_host(&self, ops: &[CopyOp], host_base: *const u8) -> Result<(), GpuError> {
        // SAFETY: forwarded caller contract; host-to-device copies only read host memory.
        unsafe { self.run_one(ops, host_base.cast_mut(), Dir::HostToDevice) }
    }

    fn as_any(&self) -> Option<&dyn Any> {
        Some(self)
    }

    fn batch_group(&self) -> Option<usize> {
        Some(Arc::as_ptr(&self.engine) as usize)
    }

    unsafe fn transfer_pipelined<'r>(
        &self,
        to_host: bool,
        stages: usize,
        first: StagePlan<'r>,
        plan: &mut dyn FnMut(usize) -> StagePlan<'r>,
        host_base: *mut u8,
        fence: &Fence<'_>,
        keep_waiting: &dyn Fn() -> bool,
        stage_done: &mut dyn FnMut(usize),
    ) -> Result<Result<(), GpuError>, StagePlan<'r>> {
        let dir = if to_host { Dir::DeviceToHost } else { Dir::HostToDevice };
        let ranges = self.shared.host_ranges.read().unwrap_or_else(|e| e.into_inner()).clone();
        let push_stage = |stage: &StagePlan<'r>, items: &mut Vec<Item>| -> Result<(), GpuError> {
            for (region, ops) in stage {
                let r = self.same_engine(*region).ok_or_else(|| {
                    GpuError::Unsupported("a pipelined transfer's stages must all be on one GPU".into())
                })?;
                check_ops(ops, r.alloc_id, r.len)?;
                for op in ops {
                    push_items(items, host_base, r.device_ptr, op, &ranges, SPLIT_BYTES);
                }
            }
            Ok(())
        };
        let mut items = Vec::new();
        if let Err(e) = push_stage(&first, &mut items) {
            return Ok(Err(e));
        }
        let mut build = |s: usize, items: &mut Vec<Item>| push_stage(&plan(s), items);
        // SAFETY: host ranges valid by the caller's contract and check_ops (no overflow);
        // device ranges inside each region by check_ops and open.
        Ok(unsafe { self.engine.run(&self.shared.api, dir, items, stages, &mut build, fence, true, keep_waiting, stage_done, &ranges) })
    }

    /// Claims every unclaimed part from `first` on whose region is a region of this same
    /// engine, and runs them all as one copy call.
    unsafe fn transfer_group(
        &self,
        to_host: bool,
        parts: &[Part<'_>],
        first: usize,
        claimed: &mut [bool],
        results: &mut [Option<Result<(), GpuError>>],
        host_base: *mut u8,
        fence: &Fence<'_>,
        keep_waiting: &dyn Fn() -> bool,
    ) -> bool {
        let dir = if to_host { Dir::DeviceToHost } else { Dir::HostToDevice };
        let ranges = self.shared.host_ranges.read().unwrap_or_else(|e| e.into_inner()).clone();
        let mut items = Vec::new();
        let mut members = Vec::new();
        for (i, p) in parts.iter().enumerate().skip(first) {
            if claimed[i] {
                continue;
            }
            let Some(r) = self.same_engine(p.region) else {
                continue;
            };
            claimed[i] = true;
            if let Err(e) = check_ops(p.ops, r.alloc_id, r.len) {
                results[i] = Some(Err(e));
                continue;
            }
            for op in p.ops {
                push_items(&mut items, host_base, r.device_ptr, op, &ranges, SPLIT_BYTES);
            }
            members.push(i);
        }
        let signal = claimed.iter().all(|c| *c);
        let mut no_build = |_: usize, _: &mut Vec<Item>| Ok(());
        // SAFETY: host ranges valid by the caller's contract and check_ops (no overflow);
        // device ranges inside each region by check_ops and open.
        let r = unsafe { self.engine.run(&self.shared.api, dir, items, 1, &mut no_build, fence, signal, keep_waiting, &mut |_| {}, &ranges) };
        for i in members {
            results[i] = Some(match &r {
                Ok(()) => Ok(()),
                Err(e) => Err(duplicate(e)),
            });
        }
        true
    }

}

impl<A: DeviceApi> Drop for Shared<A> {
    fn drop(&mut self) {
        // Runs once no region is left (each holds the Arc); backends are cached for the
        // life of the process, so in practice this is a test or teardown path.
        let engines = std::mem::take(&mut *lock(&self.engines));
        for engine in engines.values() {
            if let Ok(_bound) = Bound::new(&self.api, &engine.dev) {
                for mut set in lock(&engine.idle).drain(..) {
                    // SAFETY: idle sets were synchronized before they were put back.
                    unsafe { set.descs.free(&self.api) };
                    set.streams.into_iter().for_each(|s| self.api.destroy_stream(s));
                    set.events.into_iter().chain(set.stage_events).for_each(|e| self.api.destroy_event(e));
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn op(device_offset: u64, host_offset: u64, len: u64) -> CopyOp {
        CopyOp { alloc_id: 1, device_offset, host_offset, len }
    }

    #[test]
    fn items_are_cut_at_split_size_and_registration_ends() {
        let base = 0x1000_0000usize as *mut u8;
        let mut items = Vec::new();
        // 40 MiB op, no registrations: 16 + 16 + 8.
        push_items(&mut items, base, 0x9000, &op(0, 0, 40 << 20), &[], SPLIT_BYTES);
        assert_eq!(items.iter().map(|i| i.len).collect::<Vec<_>>(), vec![16 << 20, 16 << 20, 8 << 20]);
        assert_eq!(items[1].device, 0x9000 + (16 << 20));
        assert_eq!(items[1].host as usize, 0x1000_0000 + (16 << 20));
        // A registration boundary 1 MiB into the op cuts it there.
        items.clear();
        let ranges = [(0x1000_0000, 0x1000_0000 + (1 << 20)), (0x1000_0000 + (1 << 20), 0x2000_0000)];
        push_items(&mut items, base, 0, &op(0, 4096, 2 << 20), &ranges, SPLIT_BYTES);
        assert_eq!(items.len(), 2);
        assert_eq!(items[0].len, (1 << 20) - 4096);
        assert_eq!(items[0].len + items[1].len, 2 << 20);
        assert_eq!(items[1].host as usize, 0x1000_0000 + (1 << 20));
        assert_eq!(range_end(&ranges, 0x0fff_ffff), None);
        assert_eq!(range_end(&ranges, 0x2000_0000), None);
    }

    /// A CPU stand-in for a GPU driver (no GPU on the machines that run the unit tests; the
    /// real driver path runs on the device machine): "device" addresses are host
    /// addresses, copies happen at once, events are done when recorded unless
    /// `events_lag` makes only blocking waits see them. A copy of `fail_len` bytes fails.
    struct SimulatedDevice {
        fail_len: usize,
        events: bool,
        events_lag: bool,
        copies: AtomicUsize,
        ipc_opens: AtomicUsize,
        syncs: AtomicUsize,
    }

    impl DeviceApi for SimulatedDevice {
        const API: &'static str = "SIM";
        const KIND: MemoryKind = MemoryKind::Cuda;
        type Device = ();
        type Stream = usize;
        type Event = usize;
        fn device_count(&self) -> Result<i32, GpuError> {
            Ok(1)
        }
        fn device_uuid(&self, _: i32) -> Result<[u8; 16], GpuError> {
            Ok([7; 16])
        }
        fn open_device(&self, _: i32) -> Result<(), GpuError> {
            Ok(())
        }
        fn bind(&self, _: &()) -> Result<(), GpuError> {
            Ok(())
        }
        fn unbind(&self) {}
        fn create_stream(&self) -> Result<usize, GpuError> {
            Ok(0)
        }
        fn destroy_stream(&self, _: usize) {}
        unsafe fn copy_async(&self, dir: Dir, host: *mut u8, device: u64, len: usize, _: usize) -> Result<(), GpuError> {
            if len == self.fail_len {
                return Err(GpuError::Unsupported("simulated copy failure".into()));
            }
            self.copies.fetch_add(1, Ordering::Relaxed);
            let (src, dst) = match dir {
                Dir::DeviceToHost => (device as *const u8, host),
                Dir::HostToDevice => (host as *const u8, device as *mut u8),
            };
            // SAFETY: the test's items point into its own live buffers.
            unsafe { std::ptr::copy_nonoverlapping(src, dst, len) };
            Ok(())
        }
        fn synchronize(&self, _: usize) -> Result<(), GpuError> {
            self.syncs.fetch_add(1, Ordering::Relaxed);
            Ok(())
        }
        fn create_event(&self) -> Result<usize, GpuError> {
            if self.events { Ok(0) } else { Err(GpuError::Unsupported("no events".into())) }
        }
        fn record(&self, _: usize, _: usize) -> Result<(), GpuError> {
            Ok(())
        }
        fn event_done(&self, _: usize) -> Result<bool, GpuError> {
            Ok(!self.events_lag)
        }
        fn event_wait(&self, _: usize) -> Result<(), GpuError> {
            Ok(())
        }
        unsafe fn wait_value64(&self, _: usize, _: u64, _: u64) -> Result<(), GpuError> {
            Err(GpuError::Unsupported("no memops".into()))
        }
        unsafe fn write_value64(&self, _: usize, _: u64, _: u64) -> Result<(), GpuError> {
            Err(GpuError::Unsupported("no memops".into()))
        }
        unsafe fn ipc_open(&self, handle: &[u8; 64]) -> Result<u64, GpuError> {
            // Like the driver: any handle bytes map (the first byte picks the "allocation").
            self.ipc_opens.fetch_add(1, Ordering::Relaxed);
            Ok(0x7000_0000 + ((handle[0] as u64) << 24))
        }
        unsafe fn ipc_close(&self, _: u64) -> Result<(), GpuError> {
            Ok(())
        }
        fn address_range(&self, ptr: u64) -> Result<(u64, u64), GpuError> {
            Ok((ptr, 1 << 20))
        }
        unsafe fn host_register(&self, _: *mut u8, _: usize) -> Result<(), GpuError> {
            Ok(())
        }
        unsafe fn host_unregister(&self, _: *mut u8) -> Result<(), GpuError> {
            Ok(())
        }
    }

    fn simulated(fail_len: usize, events: bool, events_lag: bool) -> (SimulatedDevice, Engine<SimulatedDevice>) {
        let api = SimulatedDevice {
            fail_len,
            events,
            events_lag,
            copies: AtomicUsize::new(0),
            ipc_opens: AtomicUsize::new(0),
            syncs: AtomicUsize::new(0),
        };
        let engine = Engine { ordinal: 0, dev: (), idle: Mutex::new(Vec::new()), memops: AtomicBool::new(false), events: AtomicBool::new(true), gather: std::sync::OnceLock::new() };
        (api, engine)
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
        let r = unsafe { engine.run(api, Dir::DeviceToHost, stage_items(0), 4, &mut build, &Fence::None, false, &|| true, &mut done, &[]) };
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
                unsafe { engine.run(&api, Dir::DeviceToHost, vec![item(0, dst_ptr)], 4, &mut build, &Fence::None, false, &|| true, &mut |_| {}, &[]) }
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

    /// Issue #13 item 2 (run on the CPU stand-in, not on a GPU): a second process presenting
    /// the same handle bytes must not reuse the first one's mapping without a driver call;
    /// the same process re-registering (a reconnect) shares it.
    #[test]
    fn ipc_mappings_are_not_shared_between_peers() {
        let (api, _) = simulated(usize::MAX, true, false);
        let backend = GpuBackend::new(api);
        let mut reg = crate::new_registration(MemoryKind::Cuda, 1, 0x1000, 0, 4096);
        reg.device_uuid = [7; 16];
        reg.ipc_handle = [42; 64];
        let opens = |b: &GpuBackend<SimulatedDevice>| b.shared.api.ipc_opens.load(Ordering::Relaxed);
        let peer = |pid: u32, attachment: u32| crate::Peer { attachment, pid, pidfd: None, verify: &|| Ok(()) };
        let victim = backend.open_region_for(&reg, None, &peer(1_000_001, 1)).unwrap();
        assert_eq!(opens(&backend), 1);
        let again = backend.open_region_for(&reg, None, &peer(1_000_001, 2)).unwrap();
        assert_eq!(opens(&backend), 1, "the same process re-registering shares its mapping");
        let thief = backend.open_region_for(&reg, None, &peer(1_000_002, 3)).unwrap();
        assert_eq!(opens(&backend), 2, "another peer's handle bytes were served from the cache without a driver call");
        assert_eq!(backend.open_mappings(), 2);
        drop((victim, again));
        assert_eq!(backend.open_mappings(), 1, "the thief's mapping is its own");
        drop(thief);
        assert_eq!(backend.open_mappings(), 0);
    }

    #[test]
    fn batches_grow_to_the_maximum_and_stay_there() {
        for per_call in [1, 2, 16, 512, 65536] {
            let mut size = FIRST_BATCH.min(per_call);
            let mut steps = 0;
            while size < per_call {
                let next = next_batch(size, per_call);
                assert!(next > size && next <= per_call && next * 3 <= size * 4 + 3, "{size} -> {next}");
                size = next;
                steps += 1;
            }
            assert_eq!(next_batch(size, per_call), per_call, "stays at the maximum");
            assert!(steps < 40);
        }
    }

    #[test]
    fn runs_are_contiguous_and_balanced() {
        let it = |len| Item { host: std::ptr::null_mut(), device: 0, len };
        let items: Vec<Item> = (0..10).map(|_| it(64 << 10)).collect();
        let runs = balance(&items, 4);
        assert_eq!(runs.len(), 4);
        assert_eq!(runs.first().unwrap().start, 0);
        assert_eq!(runs.last().unwrap().end, 10);
        for w in runs.windows(2) {
            assert_eq!(w[0].end, w[1].start);
        }
        assert!(runs.iter().all(|r| (2..=3).contains(&r.len())), "{runs:?}");
        // Fewer items than streams: one run each.
        assert_eq!(balance(&items[..2], 4).len(), 2);
        assert_eq!(balance(&[], 4), vec![0..0]);
        // One huge item and many small ones: the huge one gets its own run.
        let mut mixed = vec![it(64 << 20)];
        mixed.extend((0..64).map(|_| it(1 << 20)));
        let runs = balance(&mixed, 2);
        assert_eq!(runs[0], 0..1);
        assert_eq!(runs[1], 1..65);
    }
}
