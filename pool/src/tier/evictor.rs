//! Background eviction between the watermarks, so the store path never evicts itself:
//! DRAM bytes, used index slots (live entries and tombstones: a pool of objects smaller
//! than the index was sized for fills the index before DRAM), and each namespace's quota
//! (`--namespace-share`). The policy lives in [`crate::store::objects::Policy`]. With an SSD tier,
//! objects evicted for DRAM bytes that the admission policy admits are written to SSD by
//! this thread, outside the store lock (`tier::run_demotions`), then leave DRAM.

use std::time::{Duration, Instant};

use std::sync::atomic::{AtomicBool, Ordering};

use super::TierWork;

/// Objects evicted per hold of the store lock (about 1.7 µs each on the 2-core VM): a copy
/// thread waits at most one step for its stage's reservations.
const EVICTION_STEP: usize = 64;

/// The evictor thread: the store and the tiers (`pool`), until `stopping`.
pub fn run(pool: TierWork<'_>, stopping: &AtomicBool) {
    let (lock, cv) = &pool.store.evict_wake;
    let mut sync = pool.tiers.ssd.as_deref().map(|_| PeriodicSync { last: Instant::now(), written: 0 });
    // Acquire pairs with `Pool::stop`'s swap: seen at the latest after its wake.
    while !stopping.load(Ordering::Acquire) {
        {
            let mut woken = lock.lock().expect("evictor lock");
            if !*woken {
                woken = cv.wait_timeout(woken, Duration::from_millis(20)).expect("evictor lock").0;
            }
            *woken = false;
        }
        let demotions = {
            let mut store = pool.store.objects.lock().expect("store lock");
            if store.needs_eviction() {
                let (bytes, entries) = (store.allocated_bytes(), store.published_count());
                let mut pass = store.eviction_pass();
                let mut n = 0;
                loop {
                    n += store.evict_step(&mut pass, Instant::now(), EVICTION_STEP);
                    if pass.is_done() {
                        break;
                    }
                    // Transfers of the whole node wait while this thread holds the lock.
                    store = pool
                        .store
                        .objects
                        .yield_to_urgent(store, crate::store::priority_lock::BACKGROUND_YIELD_PATIENCE)
                        .expect("store lock");
                }
                tracing::debug!(
                    evicted = n,
                    bytes_before = bytes,
                    bytes_after = store.allocated_bytes(),
                    entries_before = entries,
                    entries_after = store.published_count(),
                    "evicted to the low watermarks"
                );
            }
            store.take_demotions()
        };
        // Demotion I/O runs here, without the store lock (tier/mod.rs).
        if let Some(ssd) = &pool.tiers.ssd {
            crate::tier::run_demotions(pool, ssd, demotions);
            // Then SSD objects that touch hints found, into the DRAM left below the high
            // watermark (best effort, tier::prefetch).
            let hinted = pool.store.objects.lock().expect("store lock").take_prefetch();
            if !hinted.is_empty() {
                crate::tier::prefetch(pool, hinted);
            }
            if let Some(s) = &mut sync {
                s.tick(ssd);
            }
        }
    }
}

/// `--ssd-sync-interval`: the tier flushed (footers, fdatasyncs, directory fsyncs) once
/// the interval passed and records were written since the last flush. A flush seals each
/// drive's active segment, so an idle pool is never flushed (no segment churn).
struct PeriodicSync {
    last: Instant,
    /// Records written (puts, compactions, drops) as of the last flush.
    written: u64,
}

impl PeriodicSync {
    fn tick(&mut self, ssd: &crate::tier::SsdTier) {
        let every = ssd.config.sync_interval;
        if every.is_zero() || self.last.elapsed() < every {
            return;
        }
        self.last = Instant::now();
        let st = ssd.store.stats();
        let written = st.puts + st.compactions + st.evicted_objects;
        if written == self.written {
            return;
        }
        self.written = written;
        let t = Instant::now();
        match ssd.store.flush() {
            Ok(()) => tracing::debug!(ms = t.elapsed().as_secs_f64() * 1e3, "SSD tier flushed (--ssd-sync-interval)"),
            Err(e) => {
                tracing::warn!(error = %e, "SSD periodic flush failed: records written since the last sync may not survive a power loss")
            }
        }
    }
}
