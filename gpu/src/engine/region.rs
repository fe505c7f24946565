//! A peer allocation opened on one GPU, and the [`DeviceRegion`] hooks that batch the parts
//! of a transfer on one GPU into one copy call.

use std::any::Any;
use std::sync::Arc;

use super::batch::{push_ops, SPLIT_BYTES};
use super::ipc_cache::IpcKey;
use super::pipeline::Call;
use super::shared::Shared;
use super::{duplicate, DeviceApi, Dir, Engine, EngineConfig, Item};
use crate::sealed::{Group, Pipelined, RegionHooks, Staged};
use crate::{CopyOp, DeviceRegion, Fence, GpuError, MemoryKind, Part, StagePlan, TransferArgs};

pub(crate) struct GpuRegion<A: DeviceApi> {
    pub(super) shared: Arc<Shared<A>>,
    pub(super) engine: Arc<Engine<A>>,
    /// The shared IPC mapping this region holds a reference on; None in-process.
    pub(super) key: Option<IpcKey>,
    /// Device address of byte 0 of the registered range, in the pool's address space.
    pub(super) device_ptr: u64,
    pub(super) len: u64,
    pub(super) alloc_id: u32,
}

impl<A: DeviceApi> Drop for GpuRegion<A> {
    fn drop(&mut self) {
        if let Some(key) = &self.key {
            self.shared.release(key, &self.engine);
        }
    }
}

impl<A: DeviceApi> GpuRegion<A> {
    /// `region` as a region of this same engine, if it is one.
    fn same_engine<'x>(&self, region: &'x dyn DeviceRegion) -> Option<&'x GpuRegion<A>> {
        region.as_any().and_then(|a| a.downcast_ref::<GpuRegion<A>>()).filter(|r| Arc::ptr_eq(&r.engine, &self.engine))
    }

    /// One part on this region alone, with the default [`EngineConfig`].
    ///
    /// # Safety
    /// Host ranges of all ops are valid (writable for DeviceToHost) for the call.
    unsafe fn run_one(&self, ops: &[CopyOp], host_base: *mut u8, dir: Dir) -> Result<(), GpuError> {
        let part = [Part { region: self, ops }];
        let args = TransferArgs {
            dir,
            host_base,
            fence: Fence::None,
            fence_timeout: crate::fence::FENCE_TIMEOUT,
            keep_waiting: &|| true,
            engine: EngineConfig::default(),
        };
        let mut group = Group::new(1);
        // SAFETY: forwarded caller contract.
        unsafe { self.transfer_group(&args, &part, 0, &mut group) };
        group.results[0].take().unwrap_or(Ok(()))
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
}

impl<A: DeviceApi> RegionHooks for GpuRegion<A> {
    fn as_any(&self) -> Option<&dyn Any> {
        Some(self)
    }

    fn batch_group(&self) -> Option<usize> {
        Some(Arc::as_ptr(&self.engine) as usize)
    }

    unsafe fn transfer_pipelined<'r>(&self, args: &TransferArgs<'_>, first: StagePlan<'r>, rest: Staged<'_, 'r>) -> Pipelined<'r> {
        let ranges = self.shared.host_ranges.read().unwrap_or_else(|e| e.into_inner()).clone();
        let push_stage = |stage: &StagePlan<'r>, items: &mut Vec<Item>| -> Result<(), GpuError> {
            for (region, ops) in stage {
                let r = self
                    .same_engine(*region)
                    .ok_or_else(|| GpuError::Unsupported("a pipelined transfer's stages must all be on one GPU".into()))?;
                push_ops(items, args.host_base, r.device_ptr, ops, r.alloc_id, r.len, &ranges, SPLIT_BYTES)?;
            }
            Ok(())
        };
        // Room for one item per op (most ops are one item) of the first stage; later
        // stages reuse it.
        let mut items = Vec::with_capacity(first.iter().map(|(_, ops)| ops.len()).sum());
        if let Err(e) = push_stage(&first, &mut items) {
            return Ok(Err(e));
        }
        let Staged { stages, plan, stage_done } = rest;
        let mut build = |s: usize, items: &mut Vec<Item>| push_stage(&plan(s), items);
        let call = Call { args, stages, signal: true, ranges: &ranges };
        // SAFETY: host ranges valid by the caller's contract and check_ops (no overflow);
        // device ranges inside each region by check_ops and open.
        Ok(unsafe { self.engine.run(&self.shared.api, &call, items, &mut build, stage_done) })
    }

    /// Claims every unclaimed part from `first` on whose region is a region of this same
    /// engine, and runs them all as one copy call.
    unsafe fn transfer_group(&self, args: &TransferArgs<'_>, parts: &[Part<'_>], first: usize, group: &mut Group) -> bool {
        let ranges = self.shared.host_ranges.read().unwrap_or_else(|e| e.into_inner()).clone();
        let mut items = Vec::new();
        let mut members = Vec::new();
        for (i, p) in parts.iter().enumerate().skip(first) {
            if group.claimed[i] {
                continue;
            }
            let Some(r) = self.same_engine(p.region) else {
                continue;
            };
            group.claimed[i] = true;
            if let Err(e) = push_ops(&mut items, args.host_base, r.device_ptr, p.ops, r.alloc_id, r.len, &ranges, SPLIT_BYTES) {
                group.results[i] = Some(Err(e));
                continue;
            }
            members.push(i);
        }
        // The GPU writes a load fence only when this call covers every part.
        let call = Call { args, stages: 1, signal: group.claimed.iter().all(|c| *c), ranges: &ranges };
        let mut no_build = |_: usize, _: &mut Vec<Item>| Ok(());
        // SAFETY: host ranges valid by the caller's contract and check_ops (no overflow);
        // device ranges inside each region by check_ops and open.
        let r = unsafe { self.engine.run(&self.shared.api, &call, items, &mut no_build, &mut |_| {}) };
        for i in members {
            group.results[i] = Some(match &r {
                Ok(()) => Ok(()),
                Err(e) => Err(duplicate(e)),
            });
        }
        true
    }
}
