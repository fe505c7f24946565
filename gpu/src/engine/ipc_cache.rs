//! IPC mappings of peer allocations, opened once per (peer, device, handle) and reference
//! counted.

use super::backend::{GpuBackend, Shared};
use super::{lock, Bound, DeviceApi, Engine};
use crate::{GpuError, MemoryRegistration};

#[derive(Clone, Copy)]
pub(super) struct IpcMapping {
    pub(super) ptr: u64,
    /// Bytes of the exported allocation from `ptr` on.
    pub(super) size: u64,
    refs: usize,
}

/// Who registered a mapping: the peer's process when the pool can name it, else (pid 0: a
/// peer in another pid namespace, where every such peer reads as pid 0) its attachment.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub(super) enum Holder {
    Process(u32),
    Attachment(u32),
}

impl Holder {
    pub(super) fn of(peer: &crate::Peer<'_>) -> Self {
        if peer.pid == 0 {
            Holder::Attachment(peer.attachment)
        } else {
            Holder::Process(peer.pid)
        }
    }
}

/// (holder, device UUID, handle bytes). IPC handles are bearer tokens: the driver maps
/// whatever handle it is given, and a process-wide cache keyed by the bytes alone let any
/// peer that presented another's handle reuse the other's mapping without even a driver
/// call. Keyed by the registering process too, a handle is shared only among the
/// attachments of the one process that sent it (a reconnecting worker re-registers while
/// its old regions may still be held); another process gets its own driver call. Peers
/// whose pid the pool cannot see share nothing: one attachment each.
pub(super) type IpcKey = (Holder, [u8; 16], [u8; 64]);

impl<A: DeviceApi> GpuBackend<A> {
    /// Opens (or shares) the IPC mapping of `reg`'s allocation. A device is bound.
    pub(super) fn ipc_mapping(&self, reg: &MemoryRegistration, key: IpcKey) -> Result<IpcMapping, GpuError> {
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
    pub(super) fn local_mapping(&self, reg: &MemoryRegistration) -> Result<IpcMapping, GpuError> {
        let (base, size) = self.shared.api.address_range(reg.address)?;
        if reg.address.checked_sub(reg.offset) != Some(base) {
            return Err(GpuError::invalid(
                A::KIND,
                format!("address {:#x} - offset {} is not the allocation base {base:#x}", reg.address, reg.offset),
            ));
        }
        Ok(IpcMapping { ptr: base, size, refs: 0 })
    }
}

impl<A: DeviceApi> Shared<A> {
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
}

/// Number of IPC mappings this process holds open per GPU kind (tests check that a dead
/// worker's mappings are closed).
pub(crate) fn open_ipc_mappings<A: DeviceApi>(b: &GpuBackend<A>) -> usize {
    lock(&b.shared.ipc).len()
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
