//! Device backends of UMBP: how the pool copies KV bytes between its DRAM and memory a
//! worker registered (docs/gpu.md; its place among the crates: docs/architecture.md). One
//! sealed trait pair, four kinds:
//!
//! | kind | module | peer memory reached through |
//! |---|---|---|
//! | [`MemoryKind::HostMemfd`] | [`host`] | a sealed memfd the worker passed, mapped shared |
//! | [`MemoryKind::HostProcess`] | [`host`] | `/proc/<pid>/mem` of the worker |
//! | [`MemoryKind::Cuda`] | [`cuda`] | `cuIpcOpenMemHandle`, copies on the pool's streams |
//! | [`MemoryKind::Hip`] | [`hip`] | `hipIpcOpenMemHandle` (never run on AMD hardware yet) |
//!
//! GPU libraries are loaded at run time, so this crate builds and its host backends run on
//! machines without any GPU stack; asking for a GPU kind there is an error naming the
//! missing library, never a panic. The crate reads no environment: copy tuning comes in
//! an [`EngineConfig`] with every transfer ([`TransferArgs`]).
//!
//! The pool side uses [`backend_for`], [`Backend`], [`DeviceRegion`] and
//! [`transfer_pipelined`]. Worker side helpers that fill a [`MemoryRegistration`] are
//! [`host::export_memfd`], [`host::export_process_memory`], [`cuda::export_cuda_memory`]
//! and [`hip::export_hip_memory`].

use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::{Arc, Mutex};

pub use umbp_protocol::layout::CopyOp;
pub use umbp_protocol::wire::{MemoryKind, MemoryRegistration};

pub mod cuda;
mod engine;
mod error;
pub mod fence;
pub mod hip;
pub mod host;
#[doc(hidden)]
pub mod testkit;

/// The page copy kernel's settings and counters (`umbp-bench transfer` prints them).
pub use engine::gather;
pub use engine::{EngineConfig, EngineStats};
pub use error::GpuError;
pub use fence::FenceWord;
pub use gather::{GatherConfig, GatherMode};

/// Direction of a copy between a registered region ("device") and pool memory ("host").
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Dir {
    /// Region -> pool memory: a store.
    DeviceToHost,
    /// Pool memory -> region: a load.
    HostToDevice,
}

/// One region's share of a [`transfer`].
pub struct Part<'a> {
    pub region: &'a dyn DeviceRegion,
    pub ops: &'a [CopyOp],
}

/// Ordering of a [`transfer`] against a worker's stream ([`fence`]; docs/gpu.md,
/// "Stream-ordered transfers").
#[derive(Clone, Copy, Default)]
pub enum Fence<'a> {
    #[default]
    None,
    /// Store: read device memory only once the word reaches the value.
    WaitBefore(FenceWord<'a>, u64),
    /// Load: write the value into the word once every byte has landed. Done on the GPU
    /// where possible; the caller writes it from the CPU afterwards in any case (also on
    /// failure, with [`fence::ABORT`]), so a waiting stream is always released.
    SignalAfter(FenceWord<'a>, u64),
}

/// What every part of one [`transfer`] (or every stage of a [`transfer_pipelined`])
/// shares.
#[derive(Clone, Copy)]
pub struct TransferArgs<'a> {
    pub dir: Dir,
    /// Pool memory the ops' `host_offset`s count from.
    pub host_base: *mut u8,
    pub fence: Fence<'a>,
    /// How long a store waits for its fence word before it fails (the pool's
    /// `--store-fence-timeout-ms`; [`fence::FENCE_TIMEOUT`] by default).
    pub fence_timeout: std::time::Duration,
    /// Asked while a store waits for its fence: returning false (peer gone, pool stopping)
    /// gives up at once; otherwise the wait ends after `fence_timeout`.
    pub keep_waiting: &'a dyn Fn() -> bool,
    /// Tuning of the GPU copy engine for this transfer (host regions ignore it).
    pub engine: EngineConfig,
}

/// Copies every part in `args.dir` and returns one result per part. Parts on one GPU run
/// as one batched copy call, so a block spread over many per-layer allocations costs one
/// submission and one synchronization, not one per layer. Host parts are copied by their
/// region, after a CPU wait for a store fence.
///
/// # Safety
/// For every op, `args.host_base[host_offset..+len]` is valid pool memory (writable for
/// [`Dir::DeviceToHost`]) that no one else accesses during the call.
pub unsafe fn transfer(args: &TransferArgs<'_>, parts: &[Part<'_>]) -> Vec<Result<(), GpuError>> {
    let mut group = sealed::Group::new(parts.len());
    for i in 0..parts.len() {
        if !group.claimed[i] {
            // SAFETY: forwarded caller contract.
            unsafe { parts[i].region.transfer_group(args, parts, i, &mut group) };
        }
    }
    let mut fence_checked: Option<Result<(), String>> = None;
    for (i, part) in parts.iter().enumerate() {
        if group.results[i].is_some() {
            continue;
        }
        if let (Dir::DeviceToHost, Fence::WaitBefore(word, value)) = (args.dir, args.fence) {
            let ok =
                fence_checked.get_or_insert_with(|| word.wait_cpu(value, args.fence_timeout, args.keep_waiting).map_err(|e| e.to_string()));
            if let Err(e) = ok {
                group.results[i] = Some(Err(GpuError::Unsupported(e.clone())));
                continue;
            }
        }
        // SAFETY: forwarded caller contract.
        group.results[i] = Some(unsafe {
            match args.dir {
                Dir::DeviceToHost => part.region.copy_to_host(part.ops, args.host_base),
                Dir::HostToDevice => part.region.copy_from_host(part.ops, args.host_base),
            }
        });
    }
    group.results.into_iter().map(|r| r.unwrap_or(Ok(()))).collect()
}

/// One stage of a [`transfer_pipelined`]: the regions and the ops on each.
pub type StagePlan<'r> = Vec<(&'r dyn DeviceRegion, Vec<CopyOp>)>;

/// A transfer in `stages` stages that the caller plans one at a time, so that planning a
/// stage, the DMA of the stages before it and the caller's use of landed stages overlap
/// (the pool reserves and plans the next blocks while earlier ones copy, and publishes a
/// stage's blocks while later ones still copy).
///
/// `plan(s)` gives stage `s`'s copies; it is called once per stage, in order (stage 0
/// first, before anything is enqueued), and only while the call goes on: after a failure
/// it is not called again. `stage_done(s)` is called once per stage, in order, only for a
/// stage whose copies all landed without error (and, for a fenced store, whose fence was
/// not aborted); stages from the first failure on are never reported. When every stage is
/// on one GPU with working events, a stage is reported while later ones still copy;
/// otherwise every stage is planned first, copied as one [`transfer`], and reported after
/// it (same meaning, no overlap). Returns the first error.
///
/// # Safety
/// As [`transfer`], for every op of every stage.
pub unsafe fn transfer_pipelined<'r>(
    args: &TransferArgs<'_>,
    stages: usize,
    plan: &mut dyn FnMut(usize) -> StagePlan<'r>,
    stage_done: &mut dyn FnMut(usize),
) -> Result<(), GpuError> {
    let stages = stages.max(1);
    let reported = std::cell::Cell::new(0usize);
    let mut report = |s: usize| {
        // In order and once each, whatever the region does.
        if s == reported.get() {
            stage_done(s);
            reported.set(s + 1);
        }
    };
    let first = plan(0);
    let group = first.first().and_then(|(r, _)| r.batch_group());
    let first = match (group, first.iter().all(|(r, _)| r.batch_group() == group)) {
        (Some(_), true) => {
            let lead = first[0].0;
            let staged = sealed::Staged { stages, plan, stage_done: &mut report };
            // SAFETY: forwarded caller contract.
            match unsafe { lead.transfer_pipelined(args, first, staged) } {
                Ok(r) => {
                    // Stages the region ran without reporting (no events: one stage).
                    if r.is_ok() {
                        (reported.get()..stages).for_each(&mut report);
                    }
                    return r;
                }
                Err(first) => first,
            }
        }
        _ => first,
    };
    // Host regions, or parts on several GPUs: plan everything, copy, report.
    let mut plans = vec![first];
    plans.extend((1..stages).map(&mut *plan));
    let parts: Vec<Part<'_>> = plans.iter().flatten().map(|(region, ops)| Part { region: *region, ops }).collect();
    // SAFETY: forwarded caller contract.
    let results = unsafe { transfer(args, &parts) };
    match results.into_iter().find_map(Result::err) {
        Some(e) => Err(e),
        None => {
            (0..stages).for_each(report);
            Ok(())
        }
    }
}

/// The crate-internal side of [`DeviceRegion`] and [`Backend`]: the set of backends is
/// closed (host memfd, host process, CUDA, HIP), so no other crate implements them, and
/// the hooks [`transfer`] uses to batch GPU regions stay out of the public API.
mod sealed {
    use super::*;

    /// Per-part bookkeeping of one [`transfer`]: which parts a region's group claimed and
    /// what each part's copy gave.
    pub struct Group {
        pub claimed: Vec<bool>,
        pub results: Vec<Option<Result<(), GpuError>>>,
    }

    impl Group {
        pub fn new(n: usize) -> Self {
            Self { claimed: vec![false; n], results: (0..n).map(|_| None).collect() }
        }
    }

    /// The stages of a [`transfer_pipelined`] after the first.
    pub struct Staged<'a, 'r> {
        pub stages: usize,
        pub plan: &'a mut dyn FnMut(usize) -> StagePlan<'r>,
        pub stage_done: &'a mut dyn FnMut(usize),
    }

    /// What a region's `transfer_pipelined` returns: the transfer's result, or the first
    /// stage back where the region's group cannot run stages.
    pub type Pipelined<'r> = Result<Result<(), GpuError>, StagePlan<'r>>;

    pub trait Sealed {}

    pub trait RegionHooks {
        /// For [`transfer`]'s grouping of GPU regions.
        fn as_any(&self) -> Option<&dyn std::any::Any> {
            None
        }

        /// Regions with the same group run their parts of a [`transfer`] as one copy call
        /// (GPU regions of one device); None for regions copied on their own (host).
        fn batch_group(&self) -> Option<usize> {
            None
        }

        /// Claims and runs the parts from `first` on that this region can batch with (GPU
        /// regions of one device), recording their results in `group`. Returns false when it
        /// runs nothing (host regions).
        ///
        /// # Safety
        /// As [`transfer`].
        unsafe fn transfer_group(&self, args: &TransferArgs<'_>, parts: &[Part<'_>], first: usize, group: &mut Group) -> bool {
            let _ = (args, parts, first, group);
            false
        }

        /// Runs every stage when this region's group can (GPU regions), else hands `first`
        /// back.
        ///
        /// # Safety
        /// As [`transfer_pipelined`].
        unsafe fn transfer_pipelined<'r>(&self, args: &TransferArgs<'_>, first: StagePlan<'r>, rest: Staged<'_, 'r>) -> Pipelined<'r> {
            let _ = (args, rest);
            Err(first)
        }
    }
}

/// Peer memory the pool may copy to and from, opened from one [`MemoryRegistration`].
/// Dropping it releases what opening took (mapping, IPC handle). Implemented by this
/// crate's backends only.
pub trait DeviceRegion: sealed::RegionHooks + Send + Sync {
    fn kind(&self) -> MemoryKind;
    /// Bytes of the registered range; valid device offsets are `0..len`.
    fn len(&self) -> u64;
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Copies each op's `region[device_offset..+len]` into `host_base[host_offset..+len]`
    /// and returns when all are done (GPU regions: with the default [`EngineConfig`]; a
    /// [`transfer`] passes its own). Every op is checked against the region first
    /// ([`check_ops`]): one bad op refuses the whole call before any byte moves. An op whose
    /// `alloc_id` differs from the registration's is refused too (a pool bookkeeping bug).
    ///
    /// # Safety
    /// `host_base[host_offset..+len]` is valid, writable pool memory for each op, and no one
    /// else accesses it during the call.
    unsafe fn copy_to_host(&self, ops: &[CopyOp], host_base: *mut u8) -> Result<(), GpuError>;
    /// The reverse: pool DRAM -> peer memory. Same checks as [`Self::copy_to_host`].
    ///
    /// # Safety
    /// `host_base[host_offset..+len]` is valid, readable pool memory for each op.
    unsafe fn copy_from_host(&self, ops: &[CopyOp], host_base: *const u8) -> Result<(), GpuError>;

    /// Slot `slot` of this region used as a fence page ([`fence`]). Only small HostMemfd
    /// regions can be (they are mapped by the pool and registered with the GPU driver on
    /// first use); others refuse.
    fn fence_word(&self, slot: u32) -> Result<FenceWord<'_>, GpuError> {
        let _ = slot;
        Err(GpuError::Unsupported(format!("{:?} memory cannot hold fence words (use a small HostMemfd region)", self.kind())))
    }
}

/// The peer a registration comes from, as the pool knows it from the peer's socket.
pub struct Peer<'a> {
    /// The attachment registering: GPU IPC mappings are kept per attachment, so one peer
    /// presenting another's handle bytes never reuses the other's mapping.
    pub attachment: u32,
    /// SO_PEERCRED pid; 0 when the peer is not visible in the pool's pid namespace.
    pub pid: u32,
    /// A pidfd of the process that connected, taken at accept.
    pub pidfd: Option<BorrowedFd<'a>>,
    /// Checks that `pid` still names the process that connected and that it still runs as
    /// the peer's uid; Err says what changed.
    pub verify: &'a dyn Fn() -> Result<(), String>,
    /// The pool's GPU copy tuning when the registration comes: the page copy kernel of a
    /// GPU is calibrated at its first region under `engine.gather` (not at all while the
    /// mode is [`GatherMode::CopyEngine`]). Host backends ignore it.
    pub engine: EngineConfig,
}

/// Opens regions of one memory kind inside the pool process. Implemented by this crate's
/// backends only ([`backend_for`]).
pub trait Backend: sealed::Sealed + Send + Sync {
    fn kind(&self) -> MemoryKind;
    /// Makes `[base, base+len)` of pool DRAM usable for DMA (pinned, registered with the
    /// driver as portable and device-mapped). Host backends: no-op. The pool calls it in
    /// chunks from a background thread, concurrently with copies on chunks already
    /// registered; copies touching unregistered memory still work, only slower (the driver
    /// stages them). Keep every copy op inside one chunk: a copy straddling two separately
    /// registered ranges may be staged too.
    ///
    /// # Safety
    /// The range is mapped memory of this process that stays mapped until unregistered.
    unsafe fn register_host_memory(&self, base: *mut u8, len: usize) -> Result<(), GpuError> {
        let _ = (base, len);
        Ok(())
    }
    /// Undoes one [`Self::register_host_memory`] call, named by its `base`.
    ///
    /// # Safety
    /// `base` was registered by this backend and no copy on it is in flight.
    unsafe fn unregister_host_memory(&self, base: *mut u8) -> Result<(), GpuError> {
        let _ = base;
        Ok(())
    }
    /// Opens one registration of `peer`: what the pool calls. `fd` is the memfd of a
    /// HostMemfd registration (ignored otherwise). HostProcess checks with `peer.verify`
    /// that the pid still is the process that connected (and runs as its uid) before and
    /// after it takes its handle on that process's memory; the GPU backends keep IPC
    /// mappings per peer process. `peer.pid` must come from the socket's SO_PEERCRED, never
    /// from a message (a peer naming another pid would make the pool read that process
    /// with the pool's rights).
    fn open_region_for(&self, reg: &MemoryRegistration, fd: Option<OwnedFd>, peer: &Peer<'_>) -> Result<Box<dyn DeviceRegion>, GpuError>;
    /// [`Self::open_region_for`] a bare pid (tests, tools): no identity to check beyond a
    /// pidfd that HostProcess takes here.
    fn open_region(&self, reg: &MemoryRegistration, fd: Option<OwnedFd>, peer_pid: u32) -> Result<Box<dyn DeviceRegion>, GpuError> {
        let pidfd = match self.kind() {
            MemoryKind::HostProcess => {
                expect_kind(MemoryKind::HostProcess, reg)?;
                Some(host::pidfd_of(peer_pid)?)
            }
            _ => None,
        };
        let peer = Peer {
            attachment: 0,
            pid: peer_pid,
            pidfd: pidfd.as_ref().map(|f| f.as_fd()),
            verify: &|| Ok(()),
            engine: EngineConfig::default(),
        };
        self.open_region_for(reg, fd, &peer)
    }
    /// Peer allocations this process holds open (GPU: IPC mappings). A worker that died
    /// must leave none behind once its regions are dropped.
    fn open_mappings(&self) -> usize {
        0
    }
    /// Counters of each GPU copy engine (one per device) this backend opened; empty for
    /// host backends.
    fn engine_stats(&self) -> Vec<EngineStats> {
        Vec::new()
    }
}

static BACKENDS: Mutex<[Option<Arc<dyn Backend>>; 4]> = Mutex::new([None, None, None, None]);

/// Pool side: the backend for a kind, loading CUDA/HIP at run time. Backends hold the
/// process's driver state (devices, IPC mappings, host registrations), which the driver
/// keeps per process, so there is one per kind: cached once it loaded; a failure (library
/// absent) is not cached, so it is retried on the next call.
pub fn backend_for(kind: MemoryKind) -> Result<Arc<dyn Backend>, GpuError> {
    let slot = kind as usize - 1;
    let mut cache = BACKENDS.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(b) = &cache[slot] {
        return Ok(b.clone());
    }
    let backend: Arc<dyn Backend> = match kind {
        MemoryKind::HostMemfd => Arc::new(host::HostMemfdBackend),
        MemoryKind::HostProcess => Arc::new(host::HostProcessBackend),
        MemoryKind::Cuda => cuda::backend()?,
        MemoryKind::Hip => hip::backend()?,
    };
    cache[slot] = Some(backend.clone());
    Ok(backend)
}

/// The backends [`backend_for`] loaded so far, without loading any (reports use it: asking
/// a GPU-less machine for CUDA would try to load the library each time).
pub fn loaded_backends() -> Vec<Arc<dyn Backend>> {
    BACKENDS.lock().unwrap_or_else(|e| e.into_inner()).iter().flatten().cloned().collect()
}

/// Checks every op against a region of `region_len` bytes registered as `alloc_id`:
/// in-range device side (with overflow checks) and a host offset that does not overflow.
/// Backends call it before moving any byte.
pub fn check_ops(ops: &[CopyOp], alloc_id: u32, region_len: u64) -> Result<(), GpuError> {
    for (index, op) in ops.iter().enumerate() {
        if op.alloc_id != alloc_id {
            return Err(GpuError::WrongAllocation { index, expected: alloc_id, found: op.alloc_id });
        }
        if !op_inside(op, region_len) {
            return Err(GpuError::OutOfRange { index, device_offset: op.device_offset, len: op.len, region_len });
        }
    }
    Ok(())
}

/// Whether `op` stays inside a region of `region_len` bytes and its host range is
/// addressable (the range half of [`check_ops`]).
#[inline]
pub(crate) fn op_inside(op: &CopyOp, region_len: u64) -> bool {
    op.device_offset.checked_add(op.len).is_some_and(|end| end <= region_len)
        && op.host_offset.checked_add(op.len).is_some_and(|end| end <= isize::MAX as u64)
}

/// A registration with every field zero but those given; the GPU exports fill in the
/// device identity and handle. Built from `zeroed()` so that fields added to the wire
/// struct later start at zero instead of breaking every constructor.
pub(crate) fn new_registration(kind: MemoryKind, alloc_id: u32, address: u64, offset: u64, size: u64) -> MemoryRegistration {
    let mut reg: MemoryRegistration = bytemuck::Zeroable::zeroed();
    reg.kind = kind as u32;
    reg.alloc_id = alloc_id;
    reg.address = address;
    reg.offset = offset;
    reg.size = size;
    reg
}

/// Refuses a registration given to a backend of another kind.
pub(crate) fn expect_kind(backend: MemoryKind, reg: &MemoryRegistration) -> Result<(), GpuError> {
    let requested = MemoryKind::from_u32(reg.kind).map_err(|_| GpuError::invalid(backend, format!("unknown memory kind {}", reg.kind)))?;
    if requested != backend {
        return Err(GpuError::KindMismatch { backend, requested });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn op(device_offset: u64, len: u64) -> CopyOp {
        CopyOp { alloc_id: 3, device_offset, host_offset: 0, len }
    }

    #[test]
    fn ops_inside_pass() {
        assert!(check_ops(&[op(0, 100), op(900, 100), op(1000, 0)], 3, 1000).is_ok());
    }

    #[test]
    fn ops_outside_name_the_op() {
        let err = check_ops(&[op(0, 10), op(995, 10)], 3, 1000).unwrap_err();
        assert!(matches!(err, GpuError::OutOfRange { index: 1, device_offset: 995, len: 10, region_len: 1000 }));
        assert!(err.to_string().contains("copy op 1"), "{err}");
        // Overflow of offset + len is out of range, not a wrap-around into the region.
        assert!(check_ops(&[op(u64::MAX - 1, 4)], 3, u64::MAX).is_err());
        let host_overflow = CopyOp { alloc_id: 3, device_offset: 0, host_offset: u64::MAX, len: 2 };
        assert!(check_ops(&[host_overflow], 3, 1000).is_err());
    }

    #[test]
    fn ops_of_another_allocation_are_refused() {
        let err = check_ops(&[CopyOp { alloc_id: 4, ..op(0, 1) }], 3, 1000).unwrap_err();
        assert!(matches!(err, GpuError::WrongAllocation { index: 0, expected: 3, found: 4 }));
    }

    #[test]
    fn backend_cache_returns_one_instance_per_kind() {
        let a = backend_for(MemoryKind::HostMemfd).unwrap();
        let b = backend_for(MemoryKind::HostMemfd).unwrap();
        assert!(Arc::ptr_eq(&a, &b));
        assert_eq!(backend_for(MemoryKind::HostProcess).unwrap().kind(), MemoryKind::HostProcess);
    }
}
