//! The [`Backend`] of a GPU kind: its devices, engines and host registrations.

use std::collections::HashMap;
use std::os::fd::OwnedFd;
use std::sync::{Arc, Mutex, RwLock};

use super::ipc_cache::{open_ipc_mappings, Holder, IpcKey, IpcMapping};
use super::region::GpuRegion;
use super::{lock, Bound, DeviceApi, Engine, EngineStats};
use crate::error::format_uuid;
use crate::{expect_kind, Backend, DeviceRegion, GpuError, MemoryKind, MemoryRegistration};

pub(super) struct Shared<A: DeviceApi> {
    pub(super) api: A,
    pub(super) engines: Mutex<HashMap<[u8; 16], Arc<Engine<A>>>>,
    /// Opened IPC handles. A worker often registers several tensors of one allocation (the
    /// PyTorch caching allocator packs them), and opening one handle twice in a process is
    /// an error with CUDA, so each handle is opened once and reference counted.
    pub(super) ipc: Mutex<HashMap<IpcKey, IpcMapping>>,
    /// Host ranges registered through this backend, sorted by start: copies are cut at
    /// their ends, because a DMA straddling two registrations may be staged by the driver.
    pub(super) host_ranges: RwLock<Vec<(usize, usize)>>,
}

/// [`Backend`] of a GPU kind.
pub(crate) struct GpuBackend<A: DeviceApi> {
    pub(super) shared: Arc<Shared<A>>,
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

impl<A: DeviceApi> Shared<A> {
    fn engine_for(&self, uuid: &[u8; 16]) -> Result<Arc<Engine<A>>, GpuError> {
        let mut engines = lock(&self.engines);
        if let Some(e) = engines.get(uuid) {
            return Ok(e.clone());
        }
        for ordinal in 0..self.api.device_count()? {
            if &self.api.device_uuid(ordinal)? == uuid {
                let dev = self.api.open_device(ordinal)?;
                let engine = Arc::new(Engine::new(ordinal, *uuid, dev, true));
                tracing::debug!(api = A::API, ordinal, uuid = %format_uuid(uuid), "opened transfer engine");
                engines.insert(*uuid, engine.clone());
                return Ok(engine);
            }
        }
        Err(GpuError::DeviceNotFound { api: A::API, uuid: format_uuid(uuid) })
    }

    /// The engine used for host registration: any device will do because registrations are
    /// portable; device 0 keeps it deterministic.
    fn first_engine(&self) -> Result<Arc<Engine<A>>, GpuError> {
        if self.api.device_count()? < 1 {
            return Err(GpuError::Unsupported(format!("no {} device visible to the pool", A::API)));
        }
        let uuid = self.api.device_uuid(0)?;
        self.engine_for(&uuid)
    }
}

impl<A: DeviceApi> crate::sealed::Sealed for GpuBackend<A> {}

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
        self.shared.host_ranges.write().unwrap_or_else(|e| e.into_inner()).retain(|r| r.0 != base as usize);
        let engine = self.shared.first_engine()?;
        let _bound = Bound::new(&self.shared.api, &engine.dev)?;
        // SAFETY: forwarded caller contract.
        unsafe { self.shared.api.host_unregister(base) }
    }

    /// A peer that is this very process (embedded mode: the pool runs inside the worker)
    /// has its device pointer used directly, because a process cannot open its own IPC
    /// handle (CUDA refuses it).
    fn open_region_for(
        &self,
        reg: &MemoryRegistration,
        _fd: Option<OwnedFd>,
        peer: &crate::Peer<'_>,
    ) -> Result<Box<dyn DeviceRegion>, GpuError> {
        self.open_gpu_region(reg, peer.pid, Holder::of(peer), &peer.engine)
    }

    fn open_mappings(&self) -> usize {
        open_ipc_mappings(self)
    }

    fn engine_stats(&self) -> Vec<EngineStats> {
        let mut stats: Vec<EngineStats> = lock(&self.shared.engines).values().map(|e| e.stats.snapshot(e.ordinal, e.uuid)).collect();
        stats.sort_by_key(|s| s.ordinal);
        stats
    }
}

impl<A: DeviceApi> GpuBackend<A> {
    fn open_gpu_region(
        &self,
        reg: &MemoryRegistration,
        peer_pid: u32,
        holder: Holder,
        config: &super::EngineConfig,
    ) -> Result<Box<dyn DeviceRegion>, GpuError> {
        expect_kind(A::KIND, reg)?;
        if reg.size == 0 {
            return Err(GpuError::invalid(A::KIND, "size is 0"));
        }
        let shared = &self.shared;
        let engine = shared.engine_for(&reg.device_uuid)?;
        let _bound = Bound::new(&shared.api, &engine.dev)?;
        engine.calibrate_once(&shared.api, config);
        let (mapping, key) = if peer_pid == std::process::id() {
            (self.local_mapping(reg)?, None)
        } else {
            let key = (holder, reg.device_uuid, reg.ipc_handle);
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
        if reg.offset.checked_add(reg.size).is_none_or(|end| end > mapping.size) {
            return Err(GpuError::invalid(
                A::KIND,
                format!("offset {} + size {} passes the exported allocation of {} bytes", reg.offset, reg.size, mapping.size),
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
                    if let Some(mut st) = set.staging.take() {
                        // SAFETY: as above.
                        unsafe { st.free(&self.api) };
                    }
                    set.streams.into_iter().for_each(|s| self.api.destroy_stream(s));
                    set.events.into_iter().chain(set.stage_events).for_each(|e| self.api.destroy_event(e));
                }
            }
        }
    }
}
