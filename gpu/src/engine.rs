//! The transfer engine shared by the GPU backends (CUDA and HIP): per-device stream sets,
//! the cache of opened IPC handles, op splitting and the "synchronize everything before
//! returning, even on error" rule. Each driver API plugs in through [`DeviceApi`], so the
//! HIP backend runs the same logic that is exercised on NVIDIA hardware.

use std::collections::HashMap;
use std::os::fd::OwnedFd;
use std::sync::{Arc, Mutex, MutexGuard};

use crate::error::format_uuid;
use crate::{
    check_ops, expect_kind, Backend, CopyOp, DeviceRegion, GpuError, MemoryKind, MemoryRegistration,
};

/// Streams per copy call. Several streams let the driver spread a batch over more than one
/// copy engine; more than a handful buys nothing on current GPUs.
const STREAMS_PER_COPY: usize = 4;

/// Ops larger than this are cut so that one huge op also spreads over the streams.
const SPLIT_BYTES: u64 = 16 << 20;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Dir {
    DeviceToHost,
    HostToDevice,
}

/// The few driver calls the engine needs. Implementations map driver errors to
/// [`GpuError::Driver`] with the call's name.
pub(crate) trait DeviceApi: Send + Sync + 'static {
    /// "CUDA" or "HIP", for messages.
    const API: &'static str;
    const KIND: MemoryKind;
    /// What makes a device current on a thread (CUDA: its primary context).
    type Device: Send + Sync;
    type Stream: Copy + Send;

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
    fn synchronize(&self, stream: Self::Stream) -> Result<(), GpuError>;
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
}

/// One GPU as seen by the pool: its bound handle and idle stream sets. Stream sets are
/// taken whole by one copy call, so concurrent calls from several pool threads never wait
/// on each other's work.
struct Engine<A: DeviceApi> {
    ordinal: i32,
    dev: A::Device,
    idle: Mutex<Vec<Vec<A::Stream>>>,
}

#[derive(Clone, Copy)]
struct IpcMapping {
    ptr: u64,
    /// Bytes of the exported allocation from `ptr` on.
    size: u64,
    refs: usize,
}

type IpcKey = ([u8; 16], [u8; 64]);

struct Shared<A: DeviceApi> {
    api: A,
    engines: Mutex<HashMap<[u8; 16], Arc<Engine<A>>>>,
    /// Opened IPC handles. A worker often registers several tensors of one allocation (the
    /// PyTorch caching allocator packs them), and opening one handle twice in a process is
    /// an error with CUDA, so each handle is opened once and reference counted.
    ipc: Mutex<HashMap<IpcKey, IpcMapping>>,
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
            }),
        }
    }
}

impl<A: DeviceApi> GpuBackend<A> {
    /// Opens (or shares) the IPC mapping of `reg`'s allocation. A device is bound.
    fn ipc_mapping(&self, reg: &MemoryRegistration) -> Result<IpcMapping, GpuError> {
        let api = &self.shared.api;
        let mut ipc = lock(&self.shared.ipc);
        if let Some(m) = ipc.get_mut(&(reg.device_uuid, reg.ipc_handle)) {
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
        ipc.insert((reg.device_uuid, reg.ipc_handle), m);
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
        if let Err(e) = closed {
            tracing::warn!(api = A::API, "closing IPC mapping {ptr:#x}: {e}");
        }
    }
}

impl<A: DeviceApi> Engine<A> {
    fn take_streams(&self, api: &A) -> Result<Vec<A::Stream>, GpuError> {
        if let Some(set) = lock(&self.idle).pop() {
            return Ok(set);
        }
        let mut set = Vec::with_capacity(STREAMS_PER_COPY);
        for _ in 0..STREAMS_PER_COPY {
            match api.create_stream() {
                Ok(s) => set.push(s),
                Err(e) => {
                    set.into_iter().for_each(|s| api.destroy_stream(s));
                    return Err(e);
                }
            }
        }
        Ok(set)
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
        unsafe { self.shared.api.host_register(base, len) }
    }

    unsafe fn unregister_host_memory(&self, base: *mut u8) -> Result<(), GpuError> {
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
        expect_kind(A::KIND, reg)?;
        if reg.size == 0 {
            return Err(GpuError::invalid(A::KIND, "size is 0"));
        }
        let shared = &self.shared;
        let engine = shared.engine_for(&reg.device_uuid)?;
        let _bound = Bound::new(&shared.api, &engine.dev)?;
        let (mapping, key) = if peer_pid == std::process::id() {
            (self.local_mapping(reg)?, None)
        } else {
            (
                self.ipc_mapping(reg)?,
                Some((reg.device_uuid, reg.ipc_handle)),
            )
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

struct GpuRegion<A: DeviceApi> {
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

impl<A: DeviceApi> GpuRegion<A> {
    /// Enqueues every op round-robin on one stream set, then synchronizes every stream
    /// used, also after an enqueue error: returning while a DMA still targets pool memory
    /// would let the pool reuse that memory under it.
    ///
    /// # Safety
    /// Host ranges of all ops are valid (writable for DeviceToHost) for the call.
    unsafe fn run(&self, ops: &[CopyOp], host: *mut u8, dir: Dir) -> Result<(), GpuError> {
        check_ops(ops, self.alloc_id, self.len)?;
        if ops.iter().all(|op| op.len == 0) {
            return Ok(());
        }
        let api = &self.shared.api;
        let _bound = Bound::new(api, &self.engine.dev)?;
        let streams = self.engine.take_streams(api)?;
        let mut used = [false; STREAMS_PER_COPY];
        let mut next = 0usize;
        let mut first_err = None;
        'ops: for op in ops {
            let mut done = 0;
            while done < op.len {
                let piece = (op.len - done).min(SPLIT_BYTES);
                let s = next % streams.len();
                next += 1;
                // SAFETY: host side valid by the caller's contract and check_ops (no
                // overflow); device side inside the region by check_ops and open.
                let r = unsafe {
                    api.copy_async(
                        dir,
                        host.add((op.host_offset + done) as usize),
                        self.device_ptr + op.device_offset + done,
                        piece as usize,
                        streams[s],
                    )
                };
                if let Err(e) = r {
                    first_err = Some(e);
                    break 'ops;
                }
                used[s] = true;
                done += piece;
            }
        }
        for (i, &s) in streams.iter().enumerate() {
            if used[i] {
                if let Err(e) = api.synchronize(s) {
                    first_err.get_or_insert(e);
                }
            }
        }
        lock(&self.engine.idle).push(streams);
        first_err.map_or(Ok(()), Err)
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
        unsafe { self.run(ops, host_base, Dir::DeviceToHost) }
    }

    unsafe fn copy_from_host(&self, ops: &[CopyOp], host_base: *const u8) -> Result<(), GpuError> {
        // SAFETY: forwarded caller contract; host-to-device copies only read host memory.
        unsafe { self.run(ops, host_base.cast_mut(), Dir::HostToDevice) }
    }
}

impl<A: DeviceApi> Drop for Shared<A> {
    fn drop(&mut self) {
        // Runs once no region is left (each holds the Arc); backends are cached for the
        // life of the process, so in practice this is a test or teardown path.
        let engines = std::mem::take(&mut *lock(&self.engines));
        for engine in engines.values() {
            if let Ok(_bound) = Bound::new(&self.api, &engine.dev) {
                for set in lock(&engine.idle).drain(..) {
                    set.into_iter().for_each(|s| self.api.destroy_stream(s));
                }
            }
        }
    }
}
