//! Copy tuning knobs of the GPU engine.

use std::sync::atomic::{AtomicUsize, Ordering};

/// Streams per copy call unless tuned ([`set_tuning`], `UMBP_COPY_STREAMS`). One stream
/// measured best on the H200 (2026-11-29) with pipelined stages: 64 KiB pages 50.9/50.5
/// GB/s store/load vs 48.5/48.5 with 4 streams (each stream's share of a stage starts
/// with small batches again, and every stream needs its own stage events); more streams
/// may still help where a batch can spread over several copy engines.
const DEFAULT_STREAMS: usize = 1;
/// Most streams a set may have.
pub(crate) const MAX_STREAMS: usize = 16;

/// Most copies handed to the driver in one batch call unless tuned
/// ([`set_batch_max`], `UMBP_COPY_BATCH_MAX`).
const DEFAULT_BATCH_MAX: usize = 512;
static BATCH_MAX: AtomicUsize = AtomicUsize::new(0);

/// Most copies per batched driver call (1..=65536).
pub fn set_batch_max(n: usize) {
    BATCH_MAX.store(n.clamp(1, 65536), Ordering::Relaxed);
}

/// See [`set_batch_max`].
pub fn batch_max() -> usize {
    let mut n = BATCH_MAX.load(Ordering::Relaxed);
    if n == 0 {
        n = std::env::var("UMBP_COPY_BATCH_MAX").ok().and_then(|v| v.parse().ok()).unwrap_or(DEFAULT_BATCH_MAX).clamp(1, 65536);
        BATCH_MAX.store(n, Ordering::Relaxed);
    }
    n
}

static STREAMS: AtomicUsize = AtomicUsize::new(0);
static BATCH: AtomicUsize = AtomicUsize::new(0);
static PARALLEL: AtomicUsize = AtomicUsize::new(0);

/// Copy calls with at least this many items enqueue each stream's run from its own
/// thread when parallel submission is on ([`set_parallel_submit`]).
pub(super) const PARALLEL_MIN_ITEMS: usize = 256;

/// Whether large copy calls enqueue each stream's share from its own thread (default
/// off, `UMBP_COPY_PARALLEL=1` turns it on). Measured on the H200 (2026-11-29): no gain,
/// the driver's enqueue (~0.7 µs per batched copy) stays ahead of the DMA from one
/// thread, and 4 submitting threads made 64 KiB-page calls ~5% slower.
pub fn set_parallel_submit(on: bool) {
    PARALLEL.store(if on { 1 } else { 2 }, Ordering::Relaxed);
}

/// See [`set_parallel_submit`].
pub fn parallel_submit() -> bool {
    let mut p = PARALLEL.load(Ordering::Relaxed);
    if p == 0 {
        p = if std::env::var("UMBP_COPY_PARALLEL").is_ok_and(|v| v == "1") { 1 } else { 2 };
        PARALLEL.store(p, Ordering::Relaxed);
    }
    p == 1
}

/// Copy tuning of this process: streams per copy call (1..=16) and whether batched copy
/// submission is used where the driver has it. Defaults: `UMBP_COPY_STREAMS` (else 1) and
/// `UMBP_COPY_BATCH` (`0` turns batching off). For benchmarks and operators; takes effect
/// for copy calls that start afterwards.
pub fn set_tuning(streams: usize, batch: bool) {
    STREAMS.store(streams.clamp(1, MAX_STREAMS), Ordering::Relaxed);
    BATCH.store(if batch { 1 } else { 2 }, Ordering::Relaxed);
}

/// The tuning in effect: `(streams, batch)`.
pub fn tuning() -> (usize, bool) {
    let mut s = STREAMS.load(Ordering::Relaxed);
    if s == 0 {
        s = std::env::var("UMBP_COPY_STREAMS")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(DEFAULT_STREAMS)
            .clamp(1, MAX_STREAMS);
        STREAMS.store(s, Ordering::Relaxed);
    }
    let mut b = BATCH.load(Ordering::Relaxed);
    if b == 0 {
        b = if std::env::var("UMBP_COPY_BATCH").is_ok_and(|v| v == "0") { 2 } else { 1 };
        BATCH.store(b, Ordering::Relaxed);
    }
    (s, b == 1)
}
