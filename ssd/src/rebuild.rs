//! Warm restart: rebuilds a shard's index from its segment files. A sealed segment is read
//! through its footer (one read of the entries); a segment without a valid footer (the one
//! being written when the pool stopped) is scanned record by record, every payload checked
//! against its CRC32C; torn or corrupt records are skipped (by their header's length, never
//! searched for inside) and counted, then the segment is sealed so the next start reads its
//! footer.

use std::sync::atomic::Ordering;

use super::error::SsdError;
use super::format::{self, FooterEntry, RecordHeader, Salt, BLOCK, HEADER_BYTES};
use super::segment::{AlignedBuf, Segment};
use super::shard::{shard_index, Counters, Loc, SegMeta, Shard};

/// Reads a segment through a sliding aligned window.
struct Window<'a> {
    seg: &'a Segment,
    buf: AlignedBuf,
    start: u64,
    valid: usize,
}

impl<'a> Window<'a> {
    fn new(seg: &'a Segment, bytes: usize) -> Self {
        Self { seg, buf: AlignedBuf::new(bytes), start: 0, valid: 0 }
    }

    /// Bytes `[at, at + len)` (block-aligned `at`), or None past the end of the file.
    fn get(&mut self, at: u64, len: usize) -> Result<Option<&[u8]>, SsdError> {
        if at < self.start || at + len as u64 > self.start + self.valid as u64 {
            if len > self.buf.len() {
                self.buf = AlignedBuf::new(len);
            }
            self.start = at;
            self.valid = self.seg.read_at(&mut self.buf, at)?;
            if len > self.valid {
                return Ok(None);
            }
        }
        let o = (at - self.start) as usize;
        Ok(Some(&self.buf[o..o + len]))
    }
}

/// Scans records from the start; returns the valid ones and the count of torn or corrupt
/// records skipped.
///
/// Never looks for a header inside a record's payload (which a tenant wrote, and which may
/// carry a header that passes its CRC32C: issue #34, S4): a header whose payload fails its
/// CRC is skipped by the length it claims (checked to fit in the file); a header that does
/// not fit (a torn tail) or a block that is neither a header nor zeros ends the scan of
/// the segment (what follows is lost: misses, never wrong bytes). Zero blocks are space
/// reserved for a record whose write did not land at all, skipped block by block; a
/// tenant's block found after them passes as a header only with this directory's secret
/// salt (format 2's keyed tag), which no tenant has.
fn scan(seg: &Segment, len: u64, salt: &Salt) -> Result<(Vec<FooterEntry>, u64), SsdError> {
    // Offsets in the index are u32 block numbers: nothing past MAX_SEGMENT_BYTES is a
    // record (a segment is never that long; a planted sparse file may claim to be).
    let len = len.min(format::MAX_SEGMENT_BYTES);
    let mut w = Window::new(seg, 8 << 20);
    let mut out = Vec::new();
    let mut torn = 0u64;
    let mut pos = 0u64;
    while pos + BLOCK <= len {
        let Some(block) = w.get(pos, BLOCK as usize)? else { break };
        if block.iter().all(|&b| b == 0) {
            // Zeros: never-written space (a reserved record whose write did not land).
            pos += BLOCK;
            continue;
        }
        // Checked: a header's size is whatever is on disk (a huge one used to wrap).
        let fits = |h: &RecordHeader| {
            format::header_in_range(h)
                && format::checked_record_len(h.size).and_then(|rl| pos.checked_add(rl)).is_some_and(|end| end <= len)
        };
        let header = match RecordHeader::decode(block, salt) {
            Ok(h) if fits(&h) => h,
            _ => {
                // Not a header where one must be, or one past the end of the file: the
                // record's length is unknown, so nothing after it can be trusted.
                torn += 1;
                break;
            }
        };
        // Fits in the file (checked above), so in usize too on 64-bit targets.
        let rl = format::record_len(header.size) as usize;
        let Some(rec) = w.get(pos, rl)? else {
            torn += 1;
            break;
        };
        let payload = &rec[HEADER_BYTES..HEADER_BYTES + header.size as usize];
        if crc32c::crc32c(payload) == header.payload_crc {
            out.push(FooterEntry { header, offset: pos });
        } else {
            // A header whose payload did not (fully) land: skip the whole record.
            torn += 1;
        }
        pos += rl as u64;
    }
    Ok((out, torn))
}

/// Loads every segment of the shard's directory; returns the highest sequence number seen.
pub(super) fn rebuild_shard(shard: &mut Shard, shard_idx: usize, nshards: usize, c: &Counters) -> Result<u64, SsdError> {
    let ids = shard.dir.list_segments()?;
    let mut all: Vec<Loc> = Vec::new();
    let mut to_seal = Vec::new();
    for id in ids {
        shard.next_id = shard.next_id.max(id + 1);
        // An unreadable segment (EIO, not a file) loses its objects, not the whole tier; one
        // the pool must not trust (a symlink, another uid's file) is left as it is.
        let skip = |e: SsdError| {
            if matches!(e, SsdError::Unsafe { .. }) {
                tracing::warn!(error = %e, "SSD segment refused at start: not the pool's own file, left untouched");
                c.segments_refused.fetch_add(1, Ordering::Relaxed);
            } else {
                tracing::warn!(error = %e, "SSD segment unreadable at start: skipped, its objects are misses");
                c.segments_unreadable.fetch_add(1, Ordering::Relaxed);
            }
        };
        let seg = match shard.dir.open_segment(id) {
            Ok(s) => s,
            Err(e) => {
                skip(e);
                continue;
            }
        };
        let len = match seg.file_len() {
            Ok(l) => l,
            Err(e) => {
                skip(e);
                continue;
            }
        };
        if len == 0 {
            let _ = shard.dir.remove_segment(id);
            continue;
        }
        let footer = match seg.read_footer(len, &shard.dir.salt) {
            Ok(f) => f,
            Err(e) => {
                skip(e);
                continue;
            }
        };
        let (records, sealed, file_len) = match footer {
            Some(entries) => {
                c.segments_from_footer.fetch_add(1, Ordering::Relaxed);
                (entries, true, len)
            }
            None => {
                c.segments_scanned.fetch_add(1, Ordering::Relaxed);
                let (entries, torn) = match scan(&seg, len, &shard.dir.salt) {
                    Ok(r) => r,
                    Err(e) => {
                        skip(e);
                        continue;
                    }
                };
                if torn > 0 {
                    tracing::warn!(path = %seg.path.display(), torn, kept = entries.len(), "SSD segment had torn or corrupt records: skipped");
                }
                c.torn_records_skipped.fetch_add(torn, Ordering::Relaxed);
                to_seal.push(id);
                (entries, false, format::align_up(len))
            }
        };
        for e in &records {
            all.push(Loc { seg: id, offset: e.offset, header: e.header });
        }
        shard.used += file_len;
        // A footer on disk: its entries are read back from there when needed (issue #34, S7).
        let records = if sealed { Vec::new() } else { records };
        shard.segments.insert(id, SegMeta { seg, len: file_len, live_bytes: 0, records, sealed, footer: sealed, synced: false });
    }
    all.sort_by_key(|l| (l.header.seq, l.seg, l.offset));
    let mut max_seq = 0;
    for loc in all {
        max_seq = max_seq.max(loc.header.seq);
        if shard_index(loc.header.key, nshards) != shard_idx {
            c.misplaced_records.fetch_add(1, Ordering::Relaxed);
            continue;
        }
        shard.apply(loc);
    }
    for id in to_seal {
        shard.seal(id);
    }
    Ok(max_seq)
}
