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
    /// Descriptor lists of kernel-path stages ([`crate::gather`]).
    pub(super) descs: crate::gather::DescBuf,
    /// Device staging buffers ([`crate::gather::GatherMode::Staged`]), made at first use.
    pub(super) staging: Option<crate::gather::Staging<A>>,
}

impl<A: DeviceApi> Engine<A> {
    pub(super) fn take_set(&self, api: &A, want: usize) -> Result<StreamSet<A>, GpuError> {
        let mut set = lock(&self.idle).pop().unwrap_or(StreamSet {
            streams: Vec::new(),
            events: Vec::new(),
            stage_events: Vec::new(),
            descs: crate::gather::DescBuf::default(),
            staging: None,
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

    /// The kernel path of this GPU unless copy engines are forced or it is unavailable.
    pub(super) fn gather_path(&self, mode: crate::gather::GatherMode) -> Option<&crate::gather::GatherState> {
        match mode {
            crate::gather::GatherMode::CopyEngine => None,
            _ => self.gather.get().and_then(Option::as_ref),
        }
    }

    /// Calibrates the kernel path once (a device is bound); later calls return at once.
    /// Not while `config` forces copy engines (a later region opened under another mode
    /// calibrates then).
    pub(super) fn calibrate_once(&self, api: &A, config: &super::EngineConfig) {
        use crate::gather;
        if config.gather.mode == gather::GatherMode::CopyEngine {
            return;
        }
        let config = config.clamped();
        self.gather.get_or_init(|| match gather::calibrate(api, &self.dev, config.gather, config.batch_max) {
            Ok(g) => {
                let c = &g.calibration;
                tracing::info!(
                    api = A::API,
                    ordinal = self.ordinal,
                    blocks = c.blocks,
                    d2h_staged_up_to = c.d2h_staged_up_to,
                    h2d_staged_up_to = c.h2d_staged_up_to,
                    d2h_kernel_up_to = c.d2h_crossover,
                    h2d_kernel_up_to = c.h2d_crossover,
                    points = ?c.points,
                    "page copy kernel calibrated: pages up to the staged sizes go through device staging, up to the kernel sizes to the kernel, larger ones to copy engines"
                );
                gather::record_calibration(self.ordinal, c);
                Some(g)
            }
            Err(e) => {
                tracing::info!(api = A::API, ordinal = self.ordinal, "page copy kernel unavailable, copy engines only: {e}");
                None
            }
        });
    }

    /// Makes sure `set` has staging buffers of `chunk` bytes (reallocated if the size
    /// changed), reset for a new call; false (with a log) where they cannot be had.
    ///
    /// # Safety
    /// The set's streams were synchronized since its last call.
    pub(super) unsafe fn staging_ready(&self, api: &A, set: &mut StreamSet<A>, chunk: usize) -> bool {
        let want = chunk.next_multiple_of(4096).max(1 << 20);
        if let Some(s) = set.staging.as_mut().filter(|s| s.chunk == want) {
            s.reset();
            return true;
        }
        if let Some(mut old) = set.staging.take() {
            // SAFETY: forwarded contract.
            unsafe { old.free(api) };
        }
        match crate::gather::Staging::new(api, chunk) {
            Ok(s) => {
                set.staging = Some(s);
                true
            }
            Err(e) => {
                tracing::warn!(api = A::API, ordinal = self.ordinal, "device staging unavailable, not staging: {e}");
                false
            }
        }
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
