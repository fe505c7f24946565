//! What a GPU backend's regions share: the driver API, one engine per device, the IPC
//! mappings of peers' allocations (opened once, reference counted) and the registered host
//! ranges. Regions hold it by `Arc`; it closes everything when the last one goes.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, RwLock};

use super::ipc_cache::{IpcKey, IpcMapping};
use super::{lock, Bound, DeviceApi, Engine};
use crate::error::format_uuid;
use crate::{GpuError, MemoryRegistration};

/// The driver API and what every region of one backend uses.
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

impl<A: DeviceApi> Shared<A> {
    pub(super) fn engine_for(&self, uuid: &[u8; 16]) -> Result<Arc<Engine<A>>, GpuError> {
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
    pub(super) fn first_engine(&self) -> Result<Arc<Engine<A>>, GpuError> {
        if self.api.device_count()? < 1 {
            return Err(GpuError::Unsupported(format!("no {} device visible to the pool", A::API)));
        }
        let uuid = self.api.device_uuid(0)?;
        self.engine_for(&uuid)
    }

    /// Opens (or shares) the IPC mapping of `reg`'s allocation. A device is bound.
    pub(super) fn ipc_mapping(&self, reg: &MemoryRegistration, key: IpcKey) -> Result<IpcMapping, GpuError> {
        let api = &self.api;
        let mut ipc = lock(&self.ipc);
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
    pub(super) fn local_mapping(&self, reg: &MemoryRegistration) -> Result<IpcMapping, GpuError> {
        let (base, size) = self.api.address_range(reg.address)?;
        if reg.address.checked_sub(reg.offset) != Some(base) {
            return Err(GpuError::invalid(
                A::KIND,
                format!("address {:#x} - offset {} is not the allocation base {base:#x}", reg.address, reg.offset),
            ));
        }
        Ok(IpcMapping { ptr: base, size, refs: 0 })
    }

    /// Drops one reference on a mapping; the last one closes it (on `engine`'s device).
    pub(super) fn release(&self, key: &IpcKey, engine: &Engine<A>) {
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

    /// IPC mappings open now (tests check that a dead worker's mappings are closed).
    pub(super) fn open_mappings(&self) -> usize {
        lock(&self.ipc).len()
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
