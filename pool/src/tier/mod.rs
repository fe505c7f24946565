//! Tiers below DRAM (docs/architecture.md, "Tiers below DRAM"): the seam a load uses to
//! bring an object that is not in DRAM into a DRAM allocation ([`TierSource`]), the SSD
//! tier's source, the demoter (run by the evictor thread) and the warm restart.
//!
//! Lock rule: no I/O under the store lock. The store marks objects (demoting, promoting)
//! under its lock; the bytes move here, outside it; the store then switches the object's
//! tier under the lock again (index location and KV events).
//!
//! The room below observe/: of the rooms it imports store/ only. The evictor thread and the
//! cluster seam (remote.rs) live here because both drive demotions and fetches.

pub(crate) mod evictor;
pub mod remote;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use umbp_protocol::location::Tier;
use umbp_protocol::ObjectKey;

use crate::store::objects::{Demotion, GroupKey, ObjectStore};
use crate::store::Store;
use umbp_ssd::{SsdConfig, SsdError, SsdStore};

/// One object to fetch from a lower tier into its new DRAM allocation.
pub struct FetchItem<'a> {
    pub key: ObjectKey,
    /// The namespace that stored it (part of its identity on SSD).
    pub namespace: u128,
    /// Its DRAM allocation, exactly the object's size; only this fetch writes it.
    pub dst: &'a mut [u8],
}

/// A tier a load can fetch objects from. `fetch` runs outside the store lock, on the
/// copy thread that runs the load, before that load's copies to the GPU; it must write
/// each item's `dst` completely with the object's exact bytes and return true, or return
/// false for that item (a miss: the object leaves the pool). Never wrong bytes.
pub trait TierSource: Send + Sync {
    fn fetch(&self, items: &mut [FetchItem<'_>]) -> Vec<bool>;
    /// The cluster tier's counters, for the pool report and /metrics (None: not a cluster).
    fn cluster_report(&self) -> Option<crate::pool_report::ClusterReport> {
        None
    }
}

/// What tier work (promotion, demotion, prefetch, the stop flush) uses of the pool: the
/// store and the tiers below it; nothing of peers or the copy path.
#[derive(Clone, Copy)]
pub(crate) struct TierWork<'a> {
    pub store: &'a Store,
    pub tiers: &'a Tiers,
}

/// The lower tiers this pool has, by tier.
#[derive(Clone, Default)]
pub struct Tiers {
    pub ssd: Option<Arc<SsdTier>>,
    /// Another node's pool (issue #17): plugs in here.
    pub remote: Option<Arc<dyn TierSource>>,
}

impl Tiers {
    pub fn source(&self, tier: Tier) -> Option<&dyn TierSource> {
        match tier {
            Tier::Dram => None,
            Tier::Ssd => self.ssd.as_deref().map(|s| s as &dyn TierSource),
            Tier::Remote => self.remote.as_deref(),
        }
    }
}

/// The SSD tier: the store and the I/O-side counters.
pub struct SsdTier {
    pub store: SsdStore,
    pub config: SsdConfig,
    /// Bytes a demotion batch writes at most (the evictor switches objects per batch).
    batch_bytes: u64,
    pub write_failures: AtomicU64,
}

/// Most objects in one demotion batch (one `put_batch`: up to the ring's queue depth of
/// chunks in flight per drive).
const DEMOTE_BATCH_OBJECTS: usize = 256;

impl SsdTier {
    /// Opens (and rebuilds) the SSD store. Errors name the directory.
    pub fn open(config: &SsdConfig) -> Result<Self, SsdError> {
        let store = SsdStore::open(config)?;
        let st = store.stats();
        if !st.direct_io && config.direct_io {
            tracing::warn!(dirs = ?config.dirs, "SSD tier: O_DIRECT refused by the file system (tmpfs?): buffered I/O through the page cache");
        }
        tracing::info!(
            dirs = ?config.dirs,
            capacity_bytes = st.capacity_bytes,
            objects = st.objects,
            rebuild_ms = st.rebuild_ms,
            torn_records_skipped = st.torn_records_skipped,
            direct_io = st.direct_io,
            io_uring = st.io_uring,
            admission = %config.admission,
            "SSD tier open"
        );
        Ok(Self {
            store,
            config: config.clone(),
            batch_bytes: (config.queue_depth as u64 * config.chunk_bytes as u64).max(64 << 20),
            write_failures: AtomicU64::new(0),
        })
    }
}

impl TierSource for SsdTier {
    /// All items in one batch per drive (one ring, up to the queue depth of chunks in
    /// flight), read through the ring's registered buffers straight into each item's DRAM
    /// allocation: no staging copy. The store checks the header and payload CRC32C of
    /// every record; a failed or bad record is a miss for that item only.
    fn fetch(&self, items: &mut [FetchItem<'_>]) -> Vec<bool> {
        crate::fault::promotion(items.iter().map(|i| i.key));
        let keys: Vec<(ObjectKey, u128)> = items.iter().map(|i| (i.key, i.namespace)).collect();
        let mut dsts: Vec<&mut [u8]> = items.iter_mut().map(|i| &mut *i.dst).collect();
        let infos = self.store.get_batch_into(&keys, &mut dsts);
        infos
            .into_iter()
            .zip(&keys)
            .map(|(info, (key, ns))| {
                // The store matched (key, namespace) and the exact size.
                let good = info.is_some_and(|i| i.namespace == *ns);
                if !good {
                    tracing::debug!(key = %format_args!("{:032x}", key.0), "SSD fetch missed (record gone, unreadable, other size or bad CRC)");
                }
                good
            })
            .collect()
    }
}

/// One promotion begun under the store lock (`ObjectStore::begin_promotion`): the object,
/// the DRAM allocation it owns until it is finished, and where its bytes come from.
#[derive(Clone, Copy, Debug)]
pub struct Promotion {
    pub key: GroupKey,
    /// DRAM offset of its allocation (`size` bytes).
    pub offset: u64,
    pub size: u64,
    pub tier: Tier,
    /// The namespace that stored it (part of its identity on SSD and remotely).
    pub namespace: u128,
}

/// Promotions from `begin_promotion` to `finish_promotion`, the one place their DRAM is
/// written: [`Promotions::fetch`] fills each allocation from its tier outside the store
/// lock, [`Promotions::finish`] ends them under it.
///
/// If the thread panics in between (the fetch, a tier's bug), dropping them while
/// unwinding finishes each as failed (a miss: the object and its lower-tier record go)
/// instead of leaving it "promoting" forever, which would make every later load of the key
/// wait and miss, block storing it again and hold its DRAM. Objects on the remote tier are
/// abandoned first (a transfer may still write their DRAM, so it is never reused).
pub struct Promotions<'a> {
    pool: TierWork<'a>,
    /// Still open: emptied by `finish`.
    open: Vec<Promotion>,
}

impl<'a> Promotions<'a> {
    /// Takes over promotions just begun (each `begin_promotion` returned its offset).
    pub fn new(pool: TierWork<'a>, open: Vec<Promotion>) -> Self {
        Self { pool, open }
    }

    pub fn list(&self) -> &[Promotion] {
        &self.open
    }

    /// Fetches every object from its tier into its DRAM allocation, a batch per tier;
    /// `result[i]`: promotion `i` has its exact bytes. Runs without the store lock.
    pub fn fetch(&self) -> Vec<bool> {
        let mut fetched = vec![false; self.open.len()];
        let base = self.pool.store.dram.base();
        for tier in Tier::ALL {
            let Some(source) = self.pool.tiers.source(tier) else { continue };
            let idx: Vec<usize> = (0..self.open.len()).filter(|&i| self.open[i].tier == tier).collect();
            if idx.is_empty() {
                continue;
            }
            let mut items: Vec<FetchItem<'_>> = idx
                .iter()
                .map(|&i| {
                    let p = &self.open[i];
                    FetchItem {
                        key: p.key.key,
                        namespace: p.namespace,
                        // SAFETY: `begin_promotion` allocated these `size` bytes of DRAM to
                        // this object and marked it promoting, pinned by its promoter: no
                        // other object shares them, no copy reads them (loads of it wait
                        // for the promotion) and nothing frees them until `finish` or
                        // `drop` ends the promotion, after `items` is gone. Distinct
                        // objects' allocations do not overlap, so the slices are disjoint.
                        dst: unsafe { std::slice::from_raw_parts_mut(base.add(p.offset as usize), p.size as usize) },
                    }
                })
                .collect();
            let ok = source.fetch(&mut items);
            for (&i, ok) in idx.iter().zip(ok) {
                fetched[i] = ok;
            }
        }
        fetched
    }

    /// Ends every promotion under the store lock: `fetched[i]` publishes promotion `i` in
    /// DRAM (it stays pinned for its promoter), false drops it. Returns which are
    /// published (false also where the object was dropped meanwhile).
    pub fn finish(mut self, store: &mut ObjectStore, fetched: &[bool]) -> Vec<bool> {
        let open = std::mem::take(&mut self.open);
        open.iter().zip(fetched).map(|(p, &ok)| store.finish_promotion(p.key, p.offset, ok)).collect()
    }
}

impl Drop for Promotions<'_> {
    fn drop(&mut self) {
        if self.open.is_empty() {
            return;
        }
        tracing::error!(objects = self.open.len(), "promotion interrupted (its thread panicked): finishing it as failed");
        // Not poisoned by this panic (the fetch runs without the lock); if another thread
        // poisoned it, contain_panic stops the pool anyway.
        let mut store = self.pool.store.objects.lock().unwrap_or_else(|p| p.into_inner());
        for p in self.open.drain(..) {
            if p.tier == Tier::Remote {
                store.abandon_promotion(p.key, crate::store::objects::Writer::Unknown);
            }
            store.finish_promotion(p.key, p.offset, false);
        }
    }
}

/// Writes the objects the evictor chose for demotion to SSD, in batches, then switches
/// each to the SSD tier (or drops it on failure) under the store lock. Also removes the
/// SSD records of objects that left the index. Called by the evictor thread, without
/// the store lock.
pub fn run_demotions(pool: TierWork<'_>, ssd: &SsdTier, mut work: Vec<Demotion>) {
    // Removals first: a key dropped and then stored and chosen again must not lose its
    // new record to the old object's removal.
    drop_records(pool, ssd);
    while !work.is_empty() {
        let mut take = 0;
        let mut bytes = 0u64;
        while take < work.len() && take < DEMOTE_BATCH_OBJECTS && (take == 0 || bytes + work[take].size <= ssd.batch_bytes) {
            bytes += work[take].size;
            take += 1;
        }
        let batch: Vec<Demotion> = work.drain(..take).collect();
        let base = pool.store.dram.base();
        let items: Vec<(ObjectKey, u128, u64, &[u8])> = batch
            .iter()
            .map(|d| {
                // SAFETY: `d` is an object the store marked demoting: published (its bytes
                // are complete and never written again) and never freed until
                // `finish_demotion` below, so its DRAM range is valid and stable for this read.
                let bytes = unsafe { std::slice::from_raw_parts(base.add(d.offset as usize), d.size as usize) };
                (d.key.key, d.namespace, d.size, bytes)
            })
            .collect();
        crate::fault::demotion_batch(items.len());
        let results = ssd.store.put_batch(&items);
        // Every record the store dropped meanwhile (for room, on any path: also where this
        // batch's writes then failed), not just those of successful puts (issue #34, S1).
        let mut gone: std::collections::HashSet<_> = ssd.store.take_evicted().into_iter().collect();
        let mut written = Vec::with_capacity(batch.len());
        for (d, r) in batch.iter().zip(results) {
            match r {
                Ok(_) => {
                    written.push(Ok(ssd.store.shard_of(d.key.key) as u64));
                }
                Err(e) => {
                    let n = ssd.write_failures.fetch_add(1, Ordering::Relaxed);
                    if n.is_power_of_two() {
                        tracing::warn!(key = %format_args!("{:032x}", d.key.key.0), failures = n + 1, "SSD demotion failed, the object is dropped: {e}");
                    }
                    written.push(Err(()));
                }
            }
        }
        let now = Instant::now();
        let mut store = pool.store.objects.lock().expect("store lock");
        // Records dropped for room first: an object demoted in this very batch may be
        // among them (then it is dropped below rather than listed on SSD).
        for (d, w) in batch.iter().zip(written) {
            let w = match w {
                Ok(_) if gone.remove(&(d.key.key, d.namespace)) => Err(()),
                w => w,
            };
            store.finish_demotion(d.key, w, now);
        }
        let gone: Vec<_> = gone.into_iter().collect();
        store.ssd_records_gone(&gone, &pool.store.tenant_groups);
    }
    drop_records(pool, ssd);
}

/// Most objects one prefetch pass promotes (one fetch batch).
const PREFETCH_BATCH: usize = 256;

/// Touch-hint prefetch (best effort; the evictor thread): promotes SSD objects a
/// scheduler's hint found, before the load that usually follows, while DRAM is below its
/// high watermark (a prefetch never makes the evictor drop or demote anything). Same
/// steps as a load's promotion (`begin_promotion`, a batched fetch straight into DRAM,
/// `finish_promotion`), then unpinned: the object is a plain DRAM object, most recently
/// used. A load that arrives meanwhile waits for it (`Promoting`) instead of reading again.
/// Returns how many were promoted.
pub fn prefetch(pool: TierWork<'_>, keys: Vec<GroupKey>) -> usize {
    let mut keys = keys;
    let mut promoted = 0;
    while !keys.is_empty() {
        let mut mine: Vec<Promotion> = Vec::new();
        {
            let mut store = pool.store.objects.lock().unwrap_or_else(|p| p.into_inner());
            let take = keys.len().min(PREFETCH_BATCH);
            let batch: Vec<GroupKey> = keys.drain(..take).collect();
            for key in batch {
                if store.needs_eviction() {
                    keys.clear();
                    break;
                }
                // Only objects still on SSD (not promoted, loaded or dropped meanwhile).
                let Some(size) = store.size_on(key, Tier::Ssd) else { continue };
                if let Some((offset, tier, namespace)) = store.begin_promotion(key) {
                    mine.push(Promotion { key, offset, size, tier, namespace });
                }
            }
        }
        if mine.is_empty() {
            continue;
        }
        let promotions = Promotions::new(pool, mine);
        let fetched = promotions.fetch();
        let mut store = pool.store.objects.lock().unwrap_or_else(|p| p.into_inner());
        let promoted_keys: Vec<GroupKey> = promotions.list().iter().map(|p| p.key).collect();
        for (key, published) in promoted_keys.into_iter().zip(promotions.finish(&mut store, &fetched)) {
            if published {
                store.finish_load(key);
                promoted += 1;
            }
        }
    }
    if promoted > 0 {
        tracing::debug!(promoted, "SSD objects prefetched on touch hints");
    }
    promoted
}

/// Clean stop: writes the DRAM objects the admission policy admits (and that have no SSD
/// record yet) to SSD, most recently used first, in demotion batches, for at most `limit`;
/// then seals and syncs the segments. A restart on the same directories lists them again.
/// Called by `Pool::stop` after every pool thread has exited (nothing else touches the
/// store). Logs what it wrote and what it left for lack of time.
pub fn flush_on_stop(pool: TierWork<'_>, ssd: &SsdTier, limit: std::time::Duration) {
    if limit.is_zero() {
        return;
    }
    let started = Instant::now();
    let deadline = started + limit;
    let mut work = {
        let mut store = pool.store.objects.lock().unwrap_or_else(|p| p.into_inner());
        // Demotions the evictor chose but did not start before it stopped come first.
        let mut w = store.take_demotions();
        w.extend(store.take_flush(started));
        w
    };
    let (objects, bytes) = (work.len(), work.iter().map(|d| d.size).sum::<u64>());
    if objects > 0 {
        tracing::info!(objects, bytes, admission = %ssd.config.admission, limit_s = limit.as_secs_f64(), "clean stop: writing DRAM objects to SSD");
    }
    let failures_before = ssd.write_failures.load(Ordering::Relaxed);
    let (mut written, mut written_bytes) = (0usize, 0u64);
    let mut last_log = started;
    while !work.is_empty() && Instant::now() < deadline {
        let mut take = 0;
        let mut batch_bytes = 0u64;
        while take < work.len() && take < DEMOTE_BATCH_OBJECTS && (take == 0 || batch_bytes + work[take].size <= ssd.batch_bytes) {
            batch_bytes += work[take].size;
            take += 1;
        }
        let batch: Vec<Demotion> = work.drain(..take).collect();
        run_demotions(pool, ssd, batch);
        written += take;
        written_bytes += batch_bytes;
        if last_log.elapsed() >= std::time::Duration::from_secs(1) {
            last_log = Instant::now();
            tracing::info!(objects = written, of = objects, bytes = written_bytes, "clean stop: SSD flush progress");
        }
    }
    if !work.is_empty() {
        let left_bytes: u64 = work.iter().map(|d| d.size).sum();
        tracing::warn!(
            objects = work.len(),
            bytes = left_bytes,
            limit_s = limit.as_secs_f64(),
            "clean stop: SSD flush time limit reached; these DRAM objects are not kept (raise --ssd-flush-on-stop)"
        );
        let mut store = pool.store.objects.lock().unwrap_or_else(|p| p.into_inner());
        for d in &work {
            store.cancel_demotion(d.key);
        }
    }
    let failed = ssd.write_failures.load(Ordering::Relaxed) - failures_before;
    if let Err(e) = ssd.store.flush() {
        tracing::warn!(error = %e, "clean stop: SSD segments not synced");
    }
    if objects > 0 {
        tracing::info!(
            objects = written as u64 - failed,
            bytes = written_bytes,
            failed,
            not_written = work.len(),
            ms = started.elapsed().as_millis() as u64,
            "clean stop: DRAM objects written to SSD"
        );
    }
}

/// Removes from SSD the records of objects that left the index (reset, index pressure,
/// failed promotions), outside the store lock.
pub fn drop_records(pool: TierWork<'_>, ssd: &SsdTier) {
    let drops = pool.store.objects.lock().expect("store lock").take_ssd_drops();
    for (key, ns) in drops {
        // A miss later is the worst a race here can do (the key stored and demoted again
        // before this remove): never wrong bytes.
        ssd.store.remove(key, ns);
    }
    // A tombstone's reclaim drops other records for room: their objects leave the index.
    let gone = ssd.store.take_evicted();
    if !gone.is_empty() {
        pool.store.objects.lock().expect("store lock").ssd_records_gone(&gone, &pool.store.tenant_groups);
    }
}

/// Warm restart: lists every record of the SSD store in its namespace's group's index as
/// an SSD object (before any peer can attach). Returns how many were listed.
pub fn restore(store: &mut crate::store::objects::ObjectStore, groups: &crate::store::groups::TenantGroups, ssd: &SsdTier) -> u64 {
    let started = Instant::now();
    let keys = ssd.store.keys();
    let mut listed = 0u64;
    let mut skipped = 0u64;
    for (key, info) in keys {
        let group = groups.group_of(info.namespace);
        let payload = ssd.store.shard_of(key) as u64;
        if store.insert_lower(group, info.namespace, key, info.size, Tier::Ssd, payload) {
            listed += 1;
        } else {
            skipped += 1;
        }
    }
    if listed + skipped > 0 {
        tracing::info!(listed, skipped, ms = started.elapsed().as_millis() as u64, "SSD objects listed in the index (warm restart)");
    }
    if skipped > 0 {
        tracing::warn!(skipped, "SSD objects not listed: the key is held twice in one tenant group, or the index is full");
    }
    listed
}
