//! One drive's part of the store: its directory, ring, segments and in-memory index, and
//! the record I/O under its lock (put, read, seal, reclaim, compact). The store spreads keys
//! over shards and the warm restart (`rebuild`) fills one from its segment files.

use std::collections::{BTreeMap, HashMap};
use std::os::fd::AsRawFd;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};

use super::config::SsdConfig;
use super::error::SsdError;
use super::format::{self, FooterEntry, RecordHeader, HEADER_BYTES};
pub(super) use super::index::{rec_key, Loc, RecKey, Slot};
use super::segment::{AlignedBuf, Directory, Segment};
use super::uring::{ReadJob, Ring, WriteJob};

pub(super) struct SegMeta {
    pub seg: Segment,
    /// Bytes of the file in use: records, plus the footer once sealed.
    pub len: u64,
    /// Bytes of records the index still points at.
    pub live_bytes: u64,
    /// The records' footer entries while the segment has no footer on disk (the active
    /// one, or one whose footer could not be written); empty once the footer is written:
    /// compaction and reclaim read a sealed segment's entries back from its footer
    /// (issue #34, S7: no per-object copy of every header in memory).
    pub records: Vec<FooterEntry>,
    pub sealed: bool,
    /// Its footer is on disk (written by `seal`, or found valid at start).
    pub footer: bool,
    /// Nothing written since its last fdatasync (`SsdStore::flush`).
    pub synced: bool,
}

/// Counters, shared by all shards.
#[derive(Debug, Default)]
pub(super) struct Counters {
    pub puts: AtomicU64,
    pub put_bytes: AtomicU64,
    pub hits: AtomicU64,
    pub misses: AtomicU64,
    pub crc_failures: AtomicU64,
    pub read_errors: AtomicU64,
    pub write_errors: AtomicU64,
    pub torn_records_skipped: AtomicU64,
    pub misplaced_records: AtomicU64,
    pub segments_scanned: AtomicU64,
    pub segments_unreadable: AtomicU64,
    pub segments_refused: AtomicU64,
    pub segments_from_footer: AtomicU64,
    pub compactions: AtomicU64,
    pub compacted_bytes: AtomicU64,
    pub evicted_objects: AtomicU64,
    pub rebuild_us: AtomicU64,
    pub segment_syncs: AtomicU64,
    pub dir_syncs: AtomicU64,
}

pub(super) fn bump(c: &AtomicU64, n: u64) {
    c.fetch_add(n, Ordering::Relaxed);
}

/// What a successful put did besides storing. Objects the store dropped meanwhile (for
/// room, or unreadable in a compaction) are not here: they are reported by
/// [`SsdStore::take_evicted`], whatever the call's result, so none is lost on an error path.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct PutOutcome {}

/// The shard a key's records go to (of `n`).
pub(super) fn shard_index(key: u128, n: usize) -> usize {
    ((key as u64 ^ (key >> 64) as u64) % n as u64) as usize
}

pub(super) struct Shard {
    pub dir: Directory,
    pub ring: Ring,
    pub capacity: u64,
    pub high: u64,
    pub low: u64,
    pub segment_bytes: u64,
    pub compact_live_ratio: f64,
    pub segments: BTreeMap<u64, SegMeta>,
    pub active: Option<u64>,
    pub next_id: u64,
    /// By (key, namespace): the same key of two namespaces is two objects.
    pub index: HashMap<RecKey, Slot>,
    /// The newest tombstone of each removed key, while it may hide an older record.
    pub tombstones: HashMap<RecKey, Slot>,
    /// Sum of `len` over segments.
    pub used: u64,
    /// Keys that left `index` without the caller asking (reclaim, a failed compaction or
    /// read), until `SsdStore::take_evicted` hands them to the pool.
    pub evicted: Vec<RecKey>,
}

/// A record placed in the active segment but not yet written.
struct Pending<'a> {
    item: usize,
    seg: u64,
    offset: u64,
    header: RecordHeader,
    hdr: [u8; HEADER_BYTES],
    data: &'a [u8],
}

fn write_error(path: PathBuf, e: std::io::Error) -> SsdError {
    match e.raw_os_error() {
        Some(libc::ENOSPC) | Some(libc::EFBIG) | Some(libc::EDQUOT) => SsdError::DiskFull { path, source: e },
        _ => SsdError::Io { path, what: "writing record".into(), source: e },
    }
}

impl Shard {
    pub(super) fn new(dir: Directory, ring: Ring, capacity: u64, c: &SsdConfig) -> Self {
        Self {
            dir,
            ring,
            capacity,
            high: (capacity as f64 * c.high_watermark) as u64,
            low: (capacity as f64 * c.low_watermark) as u64,
            segment_bytes: c.segment_bytes,
            compact_live_ratio: c.compact_live_ratio,
            segments: BTreeMap::new(),
            active: None,
            next_id: 0,
            index: HashMap::new(),
            tombstones: HashMap::new(),
            used: 0,
            evicted: Vec::new(),
        }
    }

    /// Bytes counted against capacity: the files plus the active segment's future footer.
    pub(super) fn used_total(&self) -> u64 {
        let footer = self.active.and_then(|a| self.segments.get(&a)).map_or(0, |m| format::footer_len(m.records.len() as u64));
        self.used + footer
    }

    /// The record the index holds for (key, namespace).
    pub(super) fn lookup(&self, key: u128, namespace: u128) -> Option<Loc> {
        let k = RecKey::new(key, namespace);
        self.index.get(&k).map(|s| s.loc(&k, false))
    }

    /// A record of `size` bytes in segment `seg` is no longer live.
    pub(super) fn mark_dead(&mut self, seg: u64, size: u64) {
        if let Some(m) = self.segments.get_mut(&seg) {
            m.live_bytes = m.live_bytes.saturating_sub(format::record_len(size));
        }
    }

    /// Applies a record that is now on disk to the index (later sequence numbers win).
    pub(super) fn apply(&mut self, loc: Loc) {
        let key = rec_key(&loc.header);
        let seq = loc.header.seq;
        if loc.header.is_tombstone() {
            if let Some(old) = self.index.get(&key).copied() {
                if old.seq < seq {
                    self.index.remove(&key);
                    self.mark_dead(old.seg, old.size);
                }
            }
            // An equal sequence number is the same tombstone moved by compaction.
            if self.tombstones.get(&key).is_none_or(|t| t.seq <= seq) {
                self.tombstones.insert(key, Slot::new(&loc));
            }
            return;
        }
        if self.tombstones.get(&key).is_some_and(|t| t.seq > seq) {
            return;
        }
        if let Some(old) = self.index.get(&key).copied() {
            // An equal sequence number is the same record moved by compaction: it moves.
            if old.seq > seq {
                return;
            }
            self.mark_dead(old.seg, old.size);
        }
        self.tombstones.remove(&key);
        if let Some(m) = self.segments.get_mut(&loc.seg) {
            m.live_bytes += format::record_len(loc.header.size);
        }
        self.index.insert(key, Slot::new(&loc));
    }

    /// Writes the active segment's footer and stops appending to it.
    pub(super) fn seal_active(&mut self) {
        let Some(id) = self.active.take() else { return };
        self.seal(id);
    }

    pub(super) fn seal(&mut self, id: u64) {
        let Some(m) = self.segments.get_mut(&id) else { return };
        m.sealed = true;
        m.synced = false;
        let footer = format::encode_footer(&m.records, m.len, &self.dir.salt);
        let mut buf = AlignedBuf::new(footer.len());
        buf[..footer.len()].copy_from_slice(&footer);
        match m.seg.write_all_at(&buf, footer.len(), m.len) {
            Ok(()) => {
                m.len += footer.len() as u64;
                self.used += footer.len() as u64;
                // On disk now: read back from there when needed (compaction, reclaim).
                m.footer = true;
                m.records = Vec::new();
            }
            // The segment stays without a footer; the next start scans its records.
            Err(e) => tracing::warn!(error = %e, "SSD segment footer not written; the next start scans this segment"),
        }
    }

    /// Frees room until `needed` more bytes fit under the low watermark (or nothing is
    /// left to free): compaction of mostly dead segments first, then the oldest segments.
    fn reclaim(&mut self, needed: u64, counters: &Counters) {
        let target = self.low.saturating_sub(needed);
        let mut guard = 0;
        while self.used_total() > target && !self.segments.is_empty() && guard < 100_000 {
            guard += 1;
            let candidate = self
                .segments
                .iter()
                .filter(|(id, m)| Some(**id) != self.active && m.len > 0)
                .map(|(id, m)| (*id, m.live_bytes as f64 / m.len as f64))
                .filter(|(_, r)| *r < self.compact_live_ratio)
                .min_by(|a, b| a.1.total_cmp(&b.1));
            match candidate {
                Some((id, _)) => self.compact(id, counters),
                None => {
                    let oldest = *self.segments.keys().next().expect("non-empty");
                    self.drop_segment(oldest, counters);
                }
            }
        }
    }

    /// The footer entries of segment `id`: from memory while it has no footer on disk,
    /// else read back from its footer; where that read fails, what the index and the
    /// tombstones hold in it (every record that still matters, found the slow way).
    fn segment_entries(&self, id: u64) -> Vec<FooterEntry> {
        let Some(m) = self.segments.get(&id) else { return Vec::new() };
        if !m.footer {
            return m.records.clone();
        }
        match m.seg.read_footer(m.len, &self.dir.salt) {
            Ok(Some(entries)) => return entries,
            Ok(None) => {
                tracing::warn!(path = %m.seg.path.display(), "SSD segment footer no longer valid: its records are found in the index")
            }
            Err(e) => tracing::warn!(error = %e, "SSD segment footer unreadable: its records are found in the index"),
        }
        let of = |map: &HashMap<RecKey, Slot>, tomb: bool| -> Vec<FooterEntry> {
            map.iter()
                .filter(|(_, s)| s.seg == id)
                .map(|(k, s)| {
                    let l = s.loc(k, tomb);
                    FooterEntry { header: l.header, offset: l.offset }
                })
                .collect()
        };
        let mut out = of(&self.index, false);
        out.extend(of(&self.tombstones, true));
        out.sort_unstable_by_key(|e| e.offset);
        out
    }

    /// Removes a segment and its file; the live objects it held (now gone) go to
    /// `evicted`. Returns how many.
    fn drop_segment(&mut self, id: u64, counters: &Counters) -> usize {
        if self.active == Some(id) {
            self.active = None;
        }
        let records = self.segment_entries(id);
        let Some(m) = self.segments.remove(&id) else { return 0 };
        let mut gone = 0;
        for e in &records {
            let key = rec_key(&e.header);
            if self.index.get(&key).is_some_and(|l| l.is_at(id, e.offset)) {
                self.index.remove(&key);
                self.evicted.push(key);
                gone += 1;
            }
            if self.tombstones.get(&key).is_some_and(|l| l.is_at(id, e.offset)) {
                self.tombstones.remove(&key);
            }
        }
        self.used -= m.len;
        bump(&counters.evicted_objects, gone as u64);
        if let Err(e) = self.dir.remove_segment(id) {
            tracing::warn!(error = %e, "removing SSD segment");
        }
        gone
    }

    /// Copies a segment's live records (and tombstones still needed) to the active segment,
    /// then removes it.
    pub(super) fn compact(&mut self, id: u64, counters: &Counters) {
        let Some(len) = self.segments.get(&id).map(|m| m.len) else { return };
        let records = self.segment_entries(id);
        let older_exists = self.segments.keys().next().is_some_and(|&first| first < id);
        let mut moved = 0u64;
        for e in records {
            let key = rec_key(&e.header);
            let at = |l: &Slot| l.is_at(id, e.offset);
            if self.index.get(&key).is_some_and(at) {
                let loc = self.index[&key].loc(&key, false);
                let mut data = vec![0u8; loc.header.size as usize];
                if self.read_records(&[loc], &mut [&mut data[..]], counters)[0] {
                    let hdr = loc.header;
                    if self.put_records(&[(hdr, &data[..])], counters, false)[0].is_ok() {
                        moved += format::record_len(hdr.size);
                        continue;
                    }
                }
                // Unreadable or not rewritten: the object is gone (a miss, never wrong),
                // and the pool is told (`evicted`).
                if self.index.remove(&key).is_some() {
                    self.evicted.push(key);
                    bump(&counters.evicted_objects, 1);
                }
            } else if e.header.is_tombstone() && older_exists && self.tombstones.get(&key).is_some_and(at) {
                let _ = self.put_records(&[(e.header, &[][..])], counters, false);
            }
        }
        let gone = self.drop_segment(id, counters);
        debug_assert_eq!(gone, 0);
        bump(&counters.compactions, 1);
        bump(&counters.compacted_bytes, len.saturating_sub(moved));
    }

    /// Appends records (headers already carry their sequence numbers); per-record result.
    /// With `reclaim`, first frees room per the watermarks.
    pub(super) fn put_records(
        &mut self,
        items: &[(RecordHeader, &[u8])],
        counters: &Counters,
        reclaim: bool,
    ) -> Vec<Result<PutOutcome, SsdError>> {
        let mut results: Vec<Result<PutOutcome, SsdError>> = (0..items.len()).map(|_| Ok(PutOutcome::default())).collect();
        let mut pending: Vec<Pending<'_>> = Vec::new();
        for (i, (header, data)) in items.iter().enumerate() {
            let rec = format::record_len(header.size);
            if rec + format::footer_len(1) > self.segment_bytes {
                results[i] = Err(SsdError::TooLarge { size: header.size, segment_bytes: self.segment_bytes });
                continue;
            }
            if reclaim && self.used_total() + rec > self.high {
                self.flush(&mut pending, &mut results, counters);
                // What it drops goes to `evicted`, whatever becomes of this item.
                self.reclaim(rec, counters);
            }
            if self.used_total() + rec + format::BLOCK > self.capacity {
                results[i] = Err(SsdError::NoRoom { needed: rec, capacity: self.capacity, dir: self.dir.path.clone() });
                continue;
            }
            let fits = self
                .active
                .and_then(|a| self.segments.get(&a))
                .is_some_and(|m| m.len + rec + format::footer_len(m.records.len() as u64 + 1) <= self.segment_bytes);
            if !fits {
                self.flush(&mut pending, &mut results, counters);
                self.seal_active();
                let id = self.next_id;
                match self.dir.create_segment(id) {
                    Ok(seg) => {
                        self.next_id += 1;
                        self.segments.insert(
                            id,
                            SegMeta { seg, len: 0, live_bytes: 0, records: Vec::new(), sealed: false, footer: false, synced: false },
                        );
                        self.active = Some(id);
                    }
                    Err(e) => {
                        results[i] = Err(e);
                        continue;
                    }
                }
            }
            let id = self.active.expect("active segment");
            let m = self.segments.get_mut(&id).expect("active segment");
            let offset = m.len;
            // Reserve the space now so later items of the batch land after this one; a
            // failed write leaves a dead (torn) region that the rebuild skips.
            m.len += rec;
            self.used += rec;
            m.records.push(FooterEntry { header: *header, offset });
            pending.push(Pending { item: i, seg: id, offset, header: *header, hdr: header.encode(&self.dir.salt), data });
        }
        self.flush(&mut pending, &mut results, counters);
        results
    }

    /// Writes the pending records in one batch and indexes those that landed.
    fn flush<'a>(&mut self, pending: &mut Vec<Pending<'a>>, results: &mut [Result<PutOutcome, SsdError>], counters: &Counters) {
        if pending.is_empty() {
            return;
        }
        let jobs: Vec<WriteJob<'_>> = pending
            .iter()
            .map(|p| WriteJob {
                fd: self.segments[&p.seg].seg.file.as_raw_fd(),
                offset: p.offset,
                len: format::record_len(p.header.size),
                pieces: vec![&p.hdr[..], p.data],
            })
            .collect();
        let done = self.ring.write_batch(&jobs);
        drop(jobs);
        for p in pending.iter() {
            if let Some(m) = self.segments.get_mut(&p.seg) {
                m.synced = false;
            }
        }
        for (p, r) in pending.drain(..).zip(done) {
            match r {
                Ok(()) => {
                    if !p.header.is_tombstone() {
                        bump(&counters.puts, 1);
                        bump(&counters.put_bytes, p.header.size);
                    }
                    self.apply(Loc { seg: p.seg, offset: p.offset, header: p.header });
                }
                Err(e) => {
                    bump(&counters.write_errors, 1);
                    let path = self.segments[&p.seg].seg.path.clone();
                    tracing::warn!(path = %path.display(), key = format_args!("{:032x}", p.header.key), error = %e, "SSD record write failed");
                    // Drop the entry from the footer list: the region is dead.
                    if let Some(m) = self.segments.get_mut(&p.seg) {
                        m.records.retain(|r| r.offset != p.offset);
                    }
                    results[p.item] = Err(write_error(path, e));
                }
            }
        }
    }

    /// Reads records into `outs` (each exactly its payload's size); `true` where the bytes
    /// are exactly what was stored (header and payload CRC32C checked). A failure drops the
    /// object from the index: it is a miss from then on.
    pub(super) fn read_records(&mut self, locs: &[Loc], outs: &mut [&mut [u8]], counters: &Counters) -> Vec<bool> {
        let n = locs.len();
        let mut hdrs = vec![[0u8; HEADER_BYTES]; n];
        // Payload CRC per record: chunks that land in order extend a running CRC; others
        // wait in `later` and are combined at the end (crc32c_combine costs microseconds).
        let mut crcs: Vec<PayloadCrc> = (0..n).map(|_| PayloadCrc::default()).collect();
        for (o, l) in outs.iter().zip(locs) {
            assert_eq!(o.len() as u64, l.header.size, "read_records: one payload-sized output per record");
        }
        let results = {
            let mut sinks: Vec<Box<super::uring::Sink<'_>>> = Vec::with_capacity(n);
            for ((out, hdr), (crc, loc)) in outs.iter_mut().zip(hdrs.iter_mut()).zip(crcs.iter_mut().zip(locs)) {
                let size = loc.header.size;
                sinks.push(Box::new(move |at: u64, data: &[u8]| {
                    let end = at + data.len() as u64;
                    let h = HEADER_BYTES as u64;
                    if at < h {
                        let n = (h - at).min(data.len() as u64) as usize;
                        hdr[at as usize..at as usize + n].copy_from_slice(&data[..n]);
                    }
                    let (ps, pe) = (at.max(h), end.min(h + size));
                    if ps < pe {
                        let src = &data[(ps - at) as usize..(pe - at) as usize];
                        out[(ps - h) as usize..(pe - h) as usize].copy_from_slice(src);
                        crc.add(ps - h, src);
                    }
                }));
            }
            let mut jobs: Vec<ReadJob<'_>> = locs
                .iter()
                .zip(sinks.iter_mut())
                .map(|(l, s)| ReadJob {
                    fd: self.segments.get(&l.seg).map_or(-1, |m| m.seg.file.as_raw_fd()),
                    offset: l.offset,
                    len: format::record_len(l.header.size),
                    sink: &mut **s,
                })
                .collect();
            self.ring.read_batch(&mut jobs)
        };
        let mut ok = vec![false; n];
        for i in 0..n {
            let loc = locs[i];
            let path = || self.segments.get(&loc.seg).map(|m| m.seg.path.clone()).unwrap_or_default();
            let key = format_args!("{:032x}", loc.header.key);
            match &results[i] {
                Err(e) => {
                    bump(&counters.read_errors, 1);
                    tracing::warn!(path = %path().display(), key = %key, error = %e, "SSD read failed: served as a miss");
                }
                Ok(()) => {
                    let crc = crcs[i].finish();
                    let header_ok = RecordHeader::decode(&hdrs[i], &self.dir.salt).is_ok_and(|h| h == loc.header);
                    if header_ok && crc == loc.header.payload_crc {
                        ok[i] = true;
                    } else {
                        bump(&counters.crc_failures, 1);
                        tracing::warn!(path = %path().display(), offset = loc.offset, key = %key, "SSD record failed its CRC32C check: served as a miss");
                    }
                }
            }
            if !ok[i] && self.index.get(&rec_key(&loc.header)).is_some_and(|l| l.is_at(loc.seg, loc.offset)) {
                self.index.remove(&rec_key(&loc.header));
                self.mark_dead(loc.seg, loc.header.size);
                self.evicted.push(rec_key(&loc.header));
            }
        }
        ok
    }
}

/// CRC32C of a payload whose chunks arrive in any order.
#[derive(Default)]
struct PayloadCrc {
    /// CRC of payload bytes `[0, next)`.
    crc: u32,
    next: u64,
    /// Chunks past a gap: (offset, CRC, length).
    later: Vec<(u64, u32, usize)>,
}

impl PayloadCrc {
    fn add(&mut self, at: u64, bytes: &[u8]) {
        if at == self.next {
            self.crc = crc32c::crc32c_append(self.crc, bytes);
            self.next += bytes.len() as u64;
        } else {
            self.later.push((at, crc32c::crc32c(bytes), bytes.len()));
        }
    }

    fn finish(&mut self) -> u32 {
        self.later.sort_unstable_by_key(|c| c.0);
        self.later.iter().fold(self.crc, |acc, &(_, c, len)| crc32c::crc32c_combine(acc, c, len))
    }
}

/// Where one read's payload goes.
pub(super) enum Out<'a> {
    /// Resized to the record's payload.
    Grow(&'a mut Vec<u8>),
    /// Caller memory that must be exactly the payload's size.
    Exact(&'a mut [u8]),
}

impl<'a> Out<'a> {
    pub(super) fn prepare(self, size: u64) -> Option<&'a mut [u8]> {
        match self {
            Out::Grow(v) => {
                v.resize(size as usize, 0);
                Some(&mut v[..])
            }
            Out::Exact(s) => (s.len() as u64 == size).then_some(s),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::PayloadCrc;

    #[test]
    fn payload_crc_is_order_independent() {
        let data: Vec<u8> = (0..100_000u32).map(|i| (i * 7 + i / 3) as u8).collect();
        let want = crc32c::crc32c(&data);
        let chunks: Vec<(u64, &[u8])> = data.chunks(8192).enumerate().map(|(i, c)| (i as u64 * 8192, c)).collect();
        for order in
            [vec![0usize, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12], vec![3, 0, 1, 2, 12, 5, 4, 6, 7, 8, 9, 11, 10], (0..13).rev().collect()]
        {
            let mut p = PayloadCrc::default();
            for i in order {
                p.add(chunks[i].0, chunks[i].1);
            }
            assert_eq!(p.finish(), want);
        }
        assert_eq!(PayloadCrc::default().finish(), crc32c::crc32c(&[]));
    }
}
