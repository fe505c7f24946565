//! The [`Backend`] of a GPU kind: its devices, engines and host registrations.

use std::collections::HashMap;
use std::os::fd::OwnedFd;
use std::sync::{Arc, Mutex, RwLock};

use super::ipc_cache::Holder;
use super::region::GpuRegion;
use super::shared::Shared;
use super::{lock, Bound, DeviceApi, EngineStats};
use crate::{expect_kind, Backend, DeviceRegion, GpuError, MemoryKind, MemoryRegistration};

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
        self.shared.open_mappings()
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
            (shared.local_mapping(reg)?, None)
        } else {
            let key = (holder, reg.device_uuid, reg.ipc_handle);
            (shared.ipc_mapping(reg, key)?, Some(key))
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

#[cfg(test)]
mod tests {
    use super::super::sim::simulated;
    use super::super::sim::SimulatedDevice;
    use super::*;
    use crate::{Backend, MemoryKind};
    use std::sync::atomic::Ordering;

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
        let peer = |pid: u32, attachment: u32| crate::Peer {
            attachment,
            pid,
            pidfd: None,
            verify: &|| Ok(()),
            engine: crate::EngineConfig::default(),
        };
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

    /// Issue #32 item 5: every peer in another pid namespace reads as pid 0, so a cache by
    /// pid let one such peer reuse another's mapping by presenting its handle bytes.
    #[test]
    fn peers_in_another_pid_namespace_do_not_share_ipc_mappings() {
        let (api, _) = simulated(usize::MAX, true, false);
        let backend = GpuBackend::new(api);
        let mut reg = crate::new_registration(MemoryKind::Cuda, 1, 0x1000, 0, 4096);
        reg.device_uuid = [7; 16];
        reg.ipc_handle = [43; 64];
        let opens = |b: &GpuBackend<SimulatedDevice>| b.shared.api.ipc_opens.load(Ordering::Relaxed);
        let peer =
            |attachment: u32| crate::Peer { attachment, pid: 0, pidfd: None, verify: &|| Ok(()), engine: crate::EngineConfig::default() };
        let victim = backend.open_region_for(&reg, None, &peer(1)).unwrap();
        let thief = backend.open_region_for(&reg, None, &peer(2)).unwrap();
        assert_eq!(opens(&backend), 2, "a pid-0 peer's handle bytes were served from another pid-0 peer's mapping");
        drop(victim);
        assert_eq!(backend.open_mappings(), 1, "the thief's mapping is its own");
        drop(thief);
        assert_eq!(backend.open_mappings(), 0);
    }
}
