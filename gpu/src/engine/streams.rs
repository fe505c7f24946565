//! Stream sets: the streams and events one copy call takes whole.

use std::sync::atomic::Ordering;

use super::{lock, DeviceApi, Engine};
use crate::GpuError;

/// The streams (and lazily made events) one copy call uses exclusively.
pub(super) struct StreamSet<A: DeviceApi> {
    pub(super) streams: Vec<A::Stream>,
    /// Join events of the GPU-side load fence write.
    pub(super) events: Vec<A::Event>,
    /// Stage-end markers of staged calls: stage `s`, stream `k` at `s * streams + k`.
    pub(super) stage_events: Vec<A::Event>,
}

impl<A: DeviceApi> Engine<A> {
    pub(super) fn take_set(&self, api: &A, want: usize) -> Result<StreamSet<A>, GpuError> {
        let mut set = lock(&self.idle).pop().unwrap_or(StreamSet {
            streams: Vec::new(),
            events: Vec::new(),
            stage_events: Vec::new(),
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

    pub(super) fn put_set(&self, set: StreamSet<A>) {
        lock(&self.idle).push(set);
    }


    /// Makes sure `set` has `n` stage events; false (and staging off for this engine from
    /// now on) where the driver has no usable events.
    pub(super) fn stage_events_ready(&self, api: &A, set: &mut StreamSet<A>, n: usize) -> bool {
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

    pub(super) fn signal_on_gpu(
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
