//! Fault injection compiled out (the `fault-injection` feature is off, as in the daemon):
//! the hooks the pool's threads call are empty and inlined away, and nothing can arm a
//! fault. The armable version is fault.rs.

use umbp_protocol::ObjectKey;

/// The hold points (see fault.rs); never held in this build.
#[doc(hidden)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HoldPoint {
    ServiceBeforeArm,
    ServiceCorrupt,
    ClusterFollowerStart,
    ReportRings,
}

#[inline(always)]
pub(crate) fn check_copy(_keys: impl Iterator<Item = ObjectKey> + Clone) {}

#[inline(always)]
pub(crate) fn check_landed(_keys: impl Iterator<Item = ObjectKey>) {}

#[doc(hidden)]
#[inline(always)]
pub fn pass(_point: HoldPoint) {}

/// # Safety
/// None needed: does nothing (the armable version's contract is in fault.rs).
#[inline(always)]
pub(crate) unsafe fn stored(_dram: *mut u8, _blocks: impl Iterator<Item = (ObjectKey, u64)>, _size: u64) {}

#[inline(always)]
pub(crate) fn demotion_batch(_objects: usize) {}

#[inline(always)]
pub(crate) fn promotion(_keys: impl Iterator<Item = umbp_protocol::ObjectKey>) {}

#[inline(always)]
pub(crate) fn fetch_fails(_key: umbp_protocol::ObjectKey) -> bool {
    false
}
