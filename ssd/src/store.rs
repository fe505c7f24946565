//! The SSD store: one shard per directory (drive), each with its own ring, segments and
//! in-memory index; put/get/remove in batches, capacity with high/low watermarks, and
//! compaction of dead records. I/O runs under the shard's lock (one ring per drive).

use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Instant;

use umbp_protocol::ObjectKey;

use super::config::SsdConfig;
use super::error::SsdError;
use super::format::{self, RecordHeader, FLAG_TOMBSTONE};
use super::segment::Directory;
use super::shard::{bump, shard_index, Counters, Out, PutOutcome, RecKey, Shard};
use super::uring::Ring;

/// A snapshot of the store's state and counters.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct SsdStats {
    pub objects: u64,
    pub used_bytes: u64,
    pub live_bytes: u64,
    pub capacity_bytes: u64,
    pub segments: u64,
    pub direct_io: bool,
    /// I/O goes through io_uring on every drive (else synchronous pread/pwrite somewhere).
    pub io_uring: bool,
    pub puts: u64,
    pub put_bytes: u64,
    pub hits: u64,
    pub misses: u64,
    /// Reads whose header or payload CRC32C did not match: served as misses.
    pub crc_failures: u64,
    /// Reads that failed with an I/O error: served as misses.
    pub read_errors: u64,
    pub write_errors: u64,
    /// Torn or corrupt records skipped by the rebuild's record scan.
    pub torn_records_skipped: u64,
    /// Records found in a directory their key does not map to (the directory list changed).
    pub misplaced_records: u64,
    pub segments_scanned: u64,
    /// Segments that could not be opened or read at start (skipped; their objects are misses).
    pub segments_unreadable: u64,
    /// Segment files refused at start and left untouched: a symlink, not a regular file,
    /// another uid's, or hard-linked (docs/security.md, "The SSD directory").
    pub segments_refused: u64,
    pub segments_from_footer: u64,
    pub compactions: u64,
    pub compacted_bytes: u64,
    pub evicted_objects: u64,
    /// Time `open` spent reading footers and scanning segments (not opening rings).
    pub rebuild_ms: f64,
    /// Segment files `flush` (or a clean close) fdatasynced: every one written since its
    /// last sync, those sealed earlier included (issue #34, S5).
    pub segment_syncs: u64,
    /// Directory fsyncs by `flush` (one per directory per call: names created or removed).
    pub dir_syncs: u64,
}

/// What the store knows about an object without reading it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SsdObjectInfo {
    pub namespace: u128,
    pub size: u64,
    pub layout_object_size: u64,
}
/// The first sequence number of a store whose readable records end at `max_seq`: past
/// them, and at least the wall clock in nanoseconds since the epoch. A segment skipped as
/// unreadable at start may hold higher numbers than any read; were numbering to go on from
/// `max_seq`, its old records would beat newer ones once it is readable again (issue #34,
/// S6). Numbers are taken far slower than one per nanosecond, so every record written
/// before this start has a lower one, as long as the clock does not go back across the
/// restart (docs/ssd.md).
fn first_seq(max_seq: u64) -> u64 {
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos() as u64);
    max_seq.saturating_add(1).max(now)
}

/// The SSD tier's store over one or more directories.
pub struct SsdStore {
    shards: Vec<Mutex<Shard>>,
    seq: AtomicU64,
    counters: Counters,
    capacity: u64,
}

impl SsdStore {
    /// Opens (creating nothing but lock and segment files) every directory and rebuilds the
    /// index from the segments already there.
    pub fn open(config: &SsdConfig) -> Result<Self, SsdError> {
        let c = config;
        if c.dirs.is_empty() {
            return Err(SsdError::Config("no SSD directory given".into()));
        }
        if !(0.0 < c.low_watermark && c.low_watermark <= c.high_watermark && c.high_watermark <= 1.0) {
            return Err(SsdError::Config(format!(
                "watermarks must satisfy 0 < low ({}) <= high ({}) <= 1",
                c.low_watermark, c.high_watermark
            )));
        }
        if !c.segment_bytes.is_multiple_of(format::BLOCK)
            || c.segment_bytes < 4 * format::BLOCK
            || c.segment_bytes > format::MAX_SEGMENT_BYTES
        {
            return Err(SsdError::Config(format!(
                "segment size {} must be a multiple of {}, at least 4 blocks and at most {}",
                c.segment_bytes,
                format::BLOCK,
                format::MAX_SEGMENT_BYTES
            )));
        }
        let per_shard = c.capacity_bytes / c.dirs.len() as u64;
        if per_shard < c.segment_bytes {
            return Err(SsdError::Config(format!(
                "capacity {} over {} directories is less than one segment ({}) per directory",
                c.capacity_bytes,
                c.dirs.len(),
                c.segment_bytes
            )));
        }
        let counters = Counters::default();
        let mut rebuild = std::time::Duration::ZERO;
        let mut shards = Vec::with_capacity(c.dirs.len());
        let mut max_seq = 0;
        let n = c.dirs.len();
        for (i, path) in c.dirs.iter().enumerate() {
            let dir = Directory::open(path, c.direct_io)?;
            let ring =
                Ring::new(c.queue_depth, c.chunk_bytes, c.io_uring).map_err(|source| SsdError::Uring { path: path.clone(), source })?;
            let mut shard = Shard::new(dir, ring, per_shard, c);
            let started = Instant::now();
            max_seq = max_seq.max(super::rebuild::rebuild_shard(&mut shard, i, n, &counters)?);
            rebuild += started.elapsed();
            shards.push(Mutex::new(shard));
        }
        counters.rebuild_us.store(rebuild.as_micros() as u64, Ordering::Relaxed);
        Ok(Self { shards, seq: AtomicU64::new(first_seq(max_seq)), counters, capacity: per_shard * n as u64 })
    }

    fn shard(&self, key: ObjectKey) -> std::sync::MutexGuard<'_, Shard> {
        let i = shard_index(key.0, self.shards.len());
        self.shards[i].lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The directory (shard) number a key's records go to.
    pub fn shard_of(&self, key: ObjectKey) -> usize {
        shard_index(key.0, self.shards.len())
    }

    /// The directories, in shard order.
    pub fn dirs(&self) -> Vec<PathBuf> {
        self.shards.iter().map(|s| s.lock().unwrap_or_else(|p| p.into_inner()).dir.path.clone()).collect()
    }

    /// Stores one object (replacing an older copy of the key).
    pub fn put(&self, key: ObjectKey, namespace: u128, layout_object_size: u64, data: &[u8]) -> Result<PutOutcome, SsdError> {
        self.put_batch(&[(key, namespace, layout_object_size, data)]).pop().expect("one result")
    }

    /// Stores many objects with their writes batched per drive (queue depth up to the
    /// ring's). Results in input order.
    pub fn put_batch(&self, items: &[(ObjectKey, u128, u64, &[u8])]) -> Vec<Result<PutOutcome, SsdError>> {
        let n = self.shards.len();
        let mut by_shard: Vec<Vec<usize>> = vec![Vec::new(); n];
        for (i, it) in items.iter().enumerate() {
            by_shard[shard_index(it.0 .0, n)].push(i);
        }
        let mut results: Vec<Option<Result<PutOutcome, SsdError>>> = (0..items.len()).map(|_| None).collect();
        for (s, idx) in by_shard.iter().enumerate() {
            if idx.is_empty() {
                continue;
            }
            let payload_crcs: Vec<u32> = idx.iter().map(|&i| crc32c::crc32c(items[i].3)).collect();
            // Numbered under the shard's lock: records of one shard reach the disk in the
            // order of their sequence numbers, so of two racing puts of a key the one the
            // index keeps is the one written last (issue #34, S6).
            let mut shard = self.shards[s].lock().unwrap_or_else(|p| p.into_inner());
            let recs: Vec<(RecordHeader, &[u8])> = idx
                .iter()
                .zip(&payload_crcs)
                .map(|(&i, &payload_crc)| {
                    let (key, namespace, layout, data) = items[i];
                    let header = RecordHeader {
                        flags: 0,
                        key: key.0,
                        namespace,
                        size: data.len() as u64,
                        layout_object_size: layout,
                        // Relaxed: uniqueness is all the counter gives; the order of one
                        // shard's records is the shard lock's, held here.
                        seq: self.seq.fetch_add(1, Ordering::Relaxed),
                        payload_crc,
                    };
                    (header, data)
                })
                .collect();
            for (&i, r) in idx.iter().zip(shard.put_records(&recs, &self.counters, true)) {
                results[i] = Some(r);
            }
        }
        results.into_iter().map(|r| r.expect("every item has a result")).collect()
    }

    /// Reads one object: its bytes exactly as stored, or `None` (absent, or its read failed
    /// or its CRC did not match: never wrong bytes).
    pub fn get(&self, key: ObjectKey, namespace: u128) -> Option<(SsdObjectInfo, Vec<u8>)> {
        let mut out = Vec::new();
        let info = self.get_batch(&[(key, namespace)], &mut [&mut out])[0]?;
        Some((info, out))
    }

    /// Reads many objects into `outs` (each resized to its object); per-key info or None.
    /// Where the result is None the output's contents are unspecified.
    pub fn get_batch(&self, keys: &[(ObjectKey, u128)], outs: &mut [&mut Vec<u8>]) -> Vec<Option<SsdObjectInfo>> {
        assert_eq!(keys.len(), outs.len(), "one output per key");
        let outs: Vec<Out<'_>> = outs.iter_mut().map(|o| Out::Grow(o)).collect();
        self.read_into(keys, outs)
    }

    /// Reads many objects straight into caller memory (the pool's fresh DRAM allocations:
    /// no staging copy): each `outs[i]` must be exactly its object's size, else that key is
    /// a miss (counted in `misses`). All keys of one shard go to its ring in one batch, up
    /// to the queue depth in flight. Per-key info or None; where None, that output's
    /// contents are unspecified (it may hold part of the record: never use it).
    pub fn get_batch_into(&self, keys: &[(ObjectKey, u128)], outs: &mut [&mut [u8]]) -> Vec<Option<SsdObjectInfo>> {
        assert_eq!(keys.len(), outs.len(), "one output per key");
        let outs: Vec<Out<'_>> = outs.iter_mut().map(|o| Out::Exact(o)).collect();
        self.read_into(keys, outs)
    }

    fn read_into(&self, keys: &[(ObjectKey, u128)], outs: Vec<Out<'_>>) -> Vec<Option<SsdObjectInfo>> {
        let n = self.shards.len();
        let mut results = vec![None; keys.len()];
        let mut by_shard: Vec<Vec<usize>> = vec![Vec::new(); n];
        for (i, k) in keys.iter().enumerate() {
            by_shard[shard_index(k.0 .0, n)].push(i);
        }
        let mut outs: Vec<Option<Out<'_>>> = outs.into_iter().map(Some).collect();
        for (s, idx) in by_shard.iter().enumerate() {
            if idx.is_empty() {
                continue;
            }
            let mut shard = self.shards[s].lock().unwrap_or_else(|p| p.into_inner());
            let mut found = Vec::new();
            let mut locs = Vec::new();
            let mut bufs: Vec<&mut [u8]> = Vec::new();
            for &i in idx {
                let Some(l) = shard.lookup(keys[i].0 .0, keys[i].1) else {
                    bump(&self.counters.misses, 1);
                    continue;
                };
                match outs[i].take().expect("each output once").prepare(l.header.size) {
                    Some(buf) => {
                        found.push(i);
                        locs.push(l);
                        bufs.push(buf);
                    }
                    None => {
                        tracing::debug!(
                            key = format_args!("{:032x}", l.header.key),
                            size = l.header.size,
                            "SSD record size differs from the destination's: a miss"
                        );
                        bump(&self.counters.misses, 1);
                    }
                }
            }
            let ok = shard.read_records(&locs, &mut bufs, &self.counters);
            for ((i, l), ok) in found.into_iter().zip(locs).zip(ok) {
                if ok {
                    bump(&self.counters.hits, 1);
                    let h = l.header;
                    results[i] = Some(SsdObjectInfo { namespace: h.namespace, size: h.size, layout_object_size: h.layout_object_size });
                } else {
                    bump(&self.counters.misses, 1);
                }
            }
        }
        results
    }

    /// What the index says about a key (no I/O).
    pub fn info(&self, key: ObjectKey, namespace: u128) -> Option<SsdObjectInfo> {
        let shard = self.shard(key);
        shard.lookup(key.0, namespace).map(|l| SsdObjectInfo {
            namespace: l.header.namespace,
            size: l.header.size,
            layout_object_size: l.header.layout_object_size,
        })
    }

    pub fn contains(&self, key: ObjectKey, namespace: u128) -> bool {
        self.info(key, namespace).is_some()
    }

    /// Removes a key; a tombstone record keeps it removed across restarts. Returns whether
    /// it was present. If the tombstone cannot be written the key is still removed now, but
    /// may reappear after a restart (logged).
    pub fn remove(&self, key: ObjectKey, namespace: u128) -> bool {
        let mut shard = self.shard(key);
        let Some(loc) = shard.lookup(key.0, namespace) else { return false };
        let tomb = RecordHeader {
            flags: FLAG_TOMBSTONE,
            key: key.0,
            namespace: loc.header.namespace,
            size: 0,
            layout_object_size: 0,
            seq: self.seq.fetch_add(1, Ordering::Relaxed),
            payload_crc: crc32c::crc32c(&[]),
        };
        if let Err(e) = shard.put_records(&[(tomb, &[][..])], &self.counters, true).pop().expect("one") {
            tracing::warn!(key = format_args!("{:032x}", key.0), error = %e, "SSD tombstone not written: the key may reappear after a restart");
            shard.index.remove(&RecKey::new(key.0, namespace));
            shard.mark_dead(loc.seg, loc.header.size);
        }
        true
    }

    /// Takes the (key, namespace) of every object that left the store since the last call
    /// without the caller removing it: dropped for room (by any put or a tombstone's
    /// reclaim, whether that call then succeeded or failed), lost in a compaction, or
    /// unreadable. The pool removes them from its index (issue #34, S1). A key stored
    /// again since is not listed (its new record is there).
    pub fn take_evicted(&self) -> Vec<(ObjectKey, u128)> {
        let mut out = Vec::new();
        for s in &self.shards {
            let mut s = s.lock().unwrap_or_else(|p| p.into_inner());
            let gone = std::mem::take(&mut s.evicted);
            out.extend(gone.into_iter().filter(|k| !s.index.contains_key(k)).map(|k| (ObjectKey(k.key()), k.namespace())));
        }
        out.sort_unstable_by_key(|k| (k.0 .0, k.1));
        out.dedup();
        out
    }

    /// Keys currently stored (for rebuilding an index above this store).
    pub fn keys(&self) -> Vec<(ObjectKey, SsdObjectInfo)> {
        let mut out = Vec::new();
        for s in &self.shards {
            let s = s.lock().unwrap_or_else(|p| p.into_inner());
            out.extend(s.index.iter().map(|(k, l)| {
                (ObjectKey(k.key()), SsdObjectInfo { namespace: k.namespace(), size: l.size, layout_object_size: l.layout_object_size })
            }));
        }
        out
    }

    /// Compacts every sealed segment whose live fraction is below the configured ratio.
    /// Returns the number of segments compacted.
    pub fn compact(&self) -> usize {
        let mut done = 0;
        for s in &self.shards {
            let mut s = s.lock().unwrap_or_else(|p| p.into_inner());
            let ids: Vec<u64> = s
                .segments
                .iter()
                .filter(|(id, m)| Some(**id) != s.active && m.len > 0 && (m.live_bytes as f64 / m.len as f64) < s.compact_live_ratio)
                .map(|(id, _)| *id)
                .collect();
            for id in ids {
                s.compact(id, &self.counters);
                done += 1;
            }
        }
        done
    }

    /// Seals the active segments (writes their footers), fdatasyncs every segment written
    /// since its last sync (those sealed earlier too) and fsyncs each directory (segment
    /// files created and removed): after this, everything stored survives power loss too,
    /// and a restart needs no record scan. Every shard is tried; the first error is returned.
    pub fn flush(&self) -> Result<(), SsdError> {
        let mut first = Ok(());
        for s in &self.shards {
            let mut s = s.lock().unwrap_or_else(|p| p.into_inner());
            s.seal_active();
            let mut r = Ok(());
            for m in s.segments.values_mut().filter(|m| !m.synced) {
                match m.seg.sync() {
                    Ok(()) => {
                        m.synced = true;
                        bump(&self.counters.segment_syncs, 1);
                    }
                    Err(e) => r = r.and(Err(e)),
                }
            }
            let r = r.and(s.dir.sync().inspect(|()| bump(&self.counters.dir_syncs, 1)));
            first = first.and(r);
        }
        first
    }

    pub fn stats(&self) -> SsdStats {
        let c = &self.counters;
        let g = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let mut st = SsdStats {
            capacity_bytes: self.capacity,
            puts: g(&c.puts),
            put_bytes: g(&c.put_bytes),
            hits: g(&c.hits),
            misses: g(&c.misses),
            crc_failures: g(&c.crc_failures),
            read_errors: g(&c.read_errors),
            write_errors: g(&c.write_errors),
            torn_records_skipped: g(&c.torn_records_skipped),
            misplaced_records: g(&c.misplaced_records),
            segments_scanned: g(&c.segments_scanned),
            segments_unreadable: g(&c.segments_unreadable),
            segments_refused: g(&c.segments_refused),
            segments_from_footer: g(&c.segments_from_footer),
            compactions: g(&c.compactions),
            compacted_bytes: g(&c.compacted_bytes),
            evicted_objects: g(&c.evicted_objects),
            rebuild_ms: g(&c.rebuild_us) as f64 / 1000.0,
            segment_syncs: g(&c.segment_syncs),
            dir_syncs: g(&c.dir_syncs),
            direct_io: true,
            io_uring: true,
            ..Default::default()
        };
        for s in &self.shards {
            let s = s.lock().unwrap_or_else(|p| p.into_inner());
            st.objects += s.index.len() as u64;
            st.used_bytes += s.used_total();
            st.live_bytes += s.segments.values().map(|m| m.live_bytes).sum::<u64>();
            st.segments += s.segments.len() as u64;
            st.direct_io &= s.dir.direct;
            st.io_uring &= s.ring.is_uring();
        }
        st
    }

    /// Paths of the segment files (tests and tools).
    pub fn segment_paths(&self) -> Vec<PathBuf> {
        let mut out = Vec::new();
        for s in &self.shards {
            let s = s.lock().unwrap_or_else(|p| p.into_inner());
            out.extend(s.segments.values().map(|m| m.seg.path.clone()));
        }
        out
    }
}

impl Drop for SsdStore {
    /// A clean close is a `flush`: the active segments sealed (the next start reads only
    /// footers), every segment and directory synced (power-loss durable).
    fn drop(&mut self) {
        if let Err(e) = self.flush() {
            tracing::warn!(error = %e, "SSD store closed without syncing: a power loss may lose recent records");
        }
    }
}
