//! The transfer engine shared by the GPU backends (CUDA and HIP): per-device stream sets,
//! the cache of opened IPC handles, op splitting, batched submission, fences (see
//! [`crate::fence`] and docs/gpu.md) and the "synchronize everything before returning, even on error" rule. Each driver API
//! plugs in through [`DeviceApi`], so the HIP backend runs the same logic that is
//! exercised on NVIDIA hardware.
//!
//! One copy call ([`region::GpuRegion`]'s `transfer_group`) takes every part of a transfer that lives
//! on one GPU (a vLLM worker registers one allocation per layer, so a block touches dozens
//! of regions), cuts ops at 16 MiB and at the boundaries of host registrations, spreads
//! them over the streams of one stream set in byte-balanced contiguous runs, and submits
//! each run as batches (`cuMemcpyBatchAsync` where the driver has it: one call for
//! hundreds of 64 KiB pages instead of one call each).
//!
//! | file | concern |
//! |---|---|
//! | `api.rs` | [`DeviceApi`]: the driver calls, one implementation per GPU API |
//! | `backend.rs` | [`GpuBackend`]: devices, engines, host registrations, opening regions |
//! | `shared.rs` | what a backend's regions share: engines per device, the IPC mapping cache, host ranges |
//! | `ipc_cache.rs` | the IPC cache's key (peer, device, handle) and entry |
//! | `region.rs` | [`region::GpuRegion`]: one opened allocation and its transfer hooks |
//! | `pipeline.rs` | one copy call: fence wait, staged batched submission, fence signal, sync |
//! | `streams.rs` | stream sets one copy call takes whole, their events |
//! | `item.rs` | [`Item`]: one contiguous copy, the unit every other file works in |
//! | `batch.rs` | cutting ops into items, balancing runs over streams, batch growth |
//! | `config.rs` | copy tuning (streams, batching, batch size, parallel submission) |
//! | `stats.rs` | counters of copy calls |
//! | `gather.rs` | the page copy kernel: calibration, descriptor lists, launches; `gather/staged.rs` device staging |

mod api;
mod backend;
pub(crate) mod batch;
mod config;
#[cfg(test)]
mod cost;
pub mod gather;
mod ipc_cache;
mod item;
mod pipeline;
mod region;
mod shared;
#[cfg(test)]
mod sim;
mod stats;
mod streams;

use std::sync::atomic::AtomicBool;
use std::sync::{Mutex, MutexGuard};

use crate::GpuError;

pub(crate) use crate::Dir;
pub(crate) use api::DeviceApi;
pub(crate) use backend::GpuBackend;
pub use config::EngineConfig;
pub(crate) use item::Item;
use stats::EngineCounters;
pub use stats::EngineStats;
use streams::StreamSet;

/// One GPU as seen by the pool: its bound handle and idle stream sets. Stream sets are
/// taken whole by one copy call, so concurrent calls from several pool threads never wait
/// on each other's work.
struct Engine<A: DeviceApi> {
    ordinal: i32,
    uuid: [u8; 16],
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
    gather: std::sync::OnceLock<Option<crate::gather::GatherState>>,
    /// Counters of this engine's copy calls.
    stats: EngineCounters,
}

impl<A: DeviceApi> Engine<A> {
    fn new(ordinal: i32, uuid: [u8; 16], dev: A::Device, memops: bool) -> Self {
        Engine {
            ordinal,
            uuid,
            dev,
            idle: Mutex::new(Vec::new()),
            memops: AtomicBool::new(memops),
            events: AtomicBool::new(true),
            stats: EngineCounters::default(),
            gather: std::sync::OnceLock::new(),
        }
    }
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
