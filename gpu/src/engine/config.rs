//! Copy tuning of the GPU engine: [`EngineConfig`], built by whoever runs the pool (the
//! daemon from its flags) and passed with every transfer.

use crate::gather::GatherConfig;

/// Streams per copy call by default. One stream measured best on the H200 with pipelined
/// stages: each stream's share of a stage starts with small batches again, and every stream
/// needs its own stage events (docs/history/benchmarks-2026-11.md, "GPU transfers"); more
/// streams may still help where a batch can spread over several copy engines.
const DEFAULT_STREAMS: usize = 1;
/// Device staging chunk of the staged path by default.
const DEFAULT_STAGE_BYTES: usize = 16 << 20;
/// Most streams a set may have.
pub(crate) const MAX_STREAMS: usize = 16;

/// Most copies handed to the driver in one batch call by default.
const DEFAULT_BATCH_MAX: usize = 512;
/// Largest batch maximum.
pub(crate) const MAX_BATCH: usize = 65536;

/// Copy calls with at least this many items enqueue each stream's run from its own
/// thread when parallel submission is on ([`EngineConfig::parallel_submit`]).
pub(super) const PARALLEL_MIN_ITEMS: usize = 256;

/// How the GPU engine submits one copy call; built once by whoever runs the pool (the
/// daemon from its flags, see docs/operations.md) and passed with every transfer
/// ([`crate::TransferArgs::engine`]). Start from `EngineConfig::default()` and set fields;
/// the engine clamps out-of-range values ([`Self::clamped`]). Host regions ignore it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct EngineConfig {
    /// Streams one copy call spreads its copies over (1..=16, default 1).
    pub streams: usize,
    /// Batched copy submission (`cuMemcpyBatchAsync`) where the driver has it (default
    /// on); off: one driver call per copy.
    pub batch: bool,
    /// Most copies per batched driver call (1..=65536, default 512).
    pub batch_max: usize,
    /// Large copy calls enqueue each stream's share from its own thread (default off). No
    /// gain on the H200: the driver's enqueue stays ahead of the DMA from one thread, and 4
    /// submitting threads made 64 KiB-page calls slower (docs/history/benchmarks-2026-11.md,
    /// "GPU transfers").
    pub parallel_submit: bool,
    /// The page copy kernel path ([`crate::gather`]): mode, blocks, launch size and the
    /// split of large objects (default: by the calibration, no split).
    pub gather: GatherConfig,
    /// Bytes per device staging chunk of [`crate::GatherMode::Staged`] (rounded up to
    /// 4 KiB, at least 1 MiB; default 16 MiB); each stream set that stages allocates
    /// `STAGE_SLOTS` (3) of them in device memory once.
    pub stage_bytes: usize,
}

impl Default for EngineConfig {
    fn default() -> Self {
        Self {
            streams: DEFAULT_STREAMS,
            batch: true,
            batch_max: DEFAULT_BATCH_MAX,
            parallel_submit: false,
            gather: GatherConfig::default(),
            stage_bytes: DEFAULT_STAGE_BYTES,
        }
    }
}

impl EngineConfig {
    /// The config with `streams` and `batch_max` brought into their ranges.
    pub fn clamped(self) -> Self {
        Self { streams: self.streams.clamp(1, MAX_STREAMS), batch_max: self.batch_max.clamp(1, MAX_BATCH), ..self }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_and_clamping() {
        let c = EngineConfig::default();
        assert_eq!((c.streams, c.batch, c.batch_max, c.parallel_submit), (1, true, 512, false));
        let low = EngineConfig { streams: 0, batch_max: 0, ..c }.clamped();
        assert_eq!((low.streams, low.batch_max), (1, 1));
        let high = EngineConfig { streams: 99, batch_max: 1 << 20, ..c }.clamped();
        assert_eq!((high.streams, high.batch_max), (MAX_STREAMS, MAX_BATCH));
    }
}
