//! Issue #34, S4: bytes a tenant chose (a payload) must never become a record header or a
//! segment trailer the store accepts, whatever a crash leaves on disk. The forgeries here
//! are built by hand as a tenant would, without the directory's secret: magic, version,
//! fields and CRC32C (no secret in any of them), the keyed tag's bytes left zero (format 1
//! had zeros there). Both tests list the forged record on format 1.

use std::os::unix::fs::FileExt;

use super::*;

/// Every record of these tests is this big: header + payload exactly 4 blocks.
const SIZE: usize = 4 * format::BLOCK as usize - HEADER_BYTES;
const RL: u64 = 4 * format::BLOCK;

/// A record header as a tenant can make one: everything but the keyed tag.
fn forged_header(key: u128, namespace: u128, data: &[u8]) -> [u8; HEADER_BYTES] {
    let mut b = [0u8; HEADER_BYTES];
    b[0..4].copy_from_slice(&format::RECORD_MAGIC.to_le_bytes());
    b[4..6].copy_from_slice(&format::FORMAT_VERSION.to_le_bytes());
    b[8..24].copy_from_slice(&key.to_le_bytes());
    b[24..40].copy_from_slice(&namespace.to_le_bytes());
    b[40..48].copy_from_slice(&(data.len() as u64).to_le_bytes());
    b[48..56].copy_from_slice(&65536u64.to_le_bytes());
    b[56..64].copy_from_slice(&(1u64 << 61).to_le_bytes());
    b[64..68].copy_from_slice(&crc32c::crc32c(data).to_le_bytes());
    let crc = crc32c::crc32c(&b[..124]);
    b[124..128].copy_from_slice(&crc.to_le_bytes());
    b
}

/// Writes victims 0..5 (namespace 7), the tenant's record (key 100, namespace 9) carrying
/// `evil`, then victims 5..n; returns the segment file (one segment, all records RL long).
fn write_segment(d: &Path, evil: &[u8], after: u64) -> std::path::PathBuf {
    let store = open_store(&cfg(&[d], 64 << 20, 8 << 20));
    for i in 0..5 {
        store.put(key(i), 7, 65536, &payload(i, SIZE)).unwrap();
    }
    store.put(key(100), 9, 65536, evil).unwrap();
    for i in 5..5 + after {
        store.put(key(i), 7, 65536, &payload(i, SIZE)).unwrap();
    }
    drop(store);
    let segs = segment::segment_files(d).unwrap();
    assert_eq!(segs.len(), 1);
    segs[0].clone()
}

/// A crash after the tenant's record was reserved whose first block (its header) never
/// landed but a later chunk did: zeros, then the tenant's bytes, which carry a header for
/// another namespace's key with a winning sequence number. The scan skips zero blocks, so
/// the next block is read as a header: the keyed tag refuses it.
#[test]
fn a_forged_header_after_a_record_whose_header_never_landed_is_not_listed() {
    let d = tempdir();
    let victim = (key(1), 7u128);
    let forged_data = vec![0xEEu8; 1000];
    let mut evil = payload(100, SIZE);
    let at = format::BLOCK as usize - HEADER_BYTES;
    evil[at..at + HEADER_BYTES].copy_from_slice(&forged_header(victim.0 .0, victim.1, &forged_data));
    evil[at + HEADER_BYTES..at + HEADER_BYTES + forged_data.len()].copy_from_slice(&forged_data);
    let seg = write_segment(d.path(), &evil, 5);
    let f = std::fs::OpenOptions::new().write(true).open(&seg).unwrap();
    f.set_len(11 * RL).unwrap();
    f.write_all_at(&vec![0u8; format::BLOCK as usize], 5 * RL).unwrap();
    drop(f);
    let store = open_store(&cfg(&[d.path()], 64 << 20, 8 << 20));
    let got = store.get(victim.0, victim.1).expect("the victim's own record");
    assert!(got.1 == payload(1, SIZE), "a tenant's forged header was served for another namespace's key");
    let st = store.stats();
    assert_eq!((st.segments_scanned, st.torn_records_skipped), (1, 1), "{st:?}");
    assert!(store.get(key(100), 9).is_none());
    for i in 0..5 {
        assert!(store.get(key(i), 7).unwrap().1 == payload(i, SIZE), "record {i} before the torn one");
    }
}

/// A crash before the active segment's footer was written leaves the file ending with the
/// last record's payload. A tenant whose record is last can end it with a trailer, footer
/// entries and a record header of its own making, placed at the offsets its record lands
/// at: the trailer describes exactly the bytes before it, so format 1 read the segment
/// through this footer (one entry: the victim's key, pointing at the forged header) and
/// served the tenant's bytes for it. The keyed tag refuses the trailer; the scan finds the
/// real records, the tenant's own as a whole.
#[test]
fn a_forged_footer_at_the_end_of_an_unsealed_segment_is_not_read() {
    let d = tempdir();
    let victim = (key(1), 7u128);
    let forged_data = vec![0xEEu8; 1000];
    let r = 5 * RL; // where the tenant's record lands
    let b = format::BLOCK as usize;
    let p = |file_offset: u64| (file_offset - r) as usize - HEADER_BYTES; // payload index
    let mut evil = payload(100, SIZE);
    let forged = forged_header(victim.0 .0, victim.1, &forged_data);
    let hdr_at = r + format::BLOCK;
    evil[p(hdr_at)..p(hdr_at) + HEADER_BYTES].copy_from_slice(&forged);
    evil[p(hdr_at) + HEADER_BYTES..p(hdr_at) + HEADER_BYTES + forged_data.len()].copy_from_slice(&forged_data);
    // One footer entry: the forged header's fields and where it is.
    let entries_at = r + 2 * format::BLOCK;
    let mut entry = [0u8; format::ENTRY_BYTES];
    entry[0..16].copy_from_slice(&forged[8..24]);
    entry[16..32].copy_from_slice(&forged[24..40]);
    entry[32..40].copy_from_slice(&forged[40..48]);
    entry[40..48].copy_from_slice(&forged[48..56]);
    entry[48..56].copy_from_slice(&hdr_at.to_le_bytes());
    entry[56..64].copy_from_slice(&forged[56..64]);
    entry[64..68].copy_from_slice(&forged[64..68]);
    evil[p(entries_at)..p(entries_at) + entry.len()].copy_from_slice(&entry);
    evil[p(entries_at) + entry.len()..p(entries_at) + b].fill(0);
    let trailer_at = r + 3 * format::BLOCK;
    let mut t = vec![0u8; b];
    t[0..4].copy_from_slice(&format::TRAILER_MAGIC.to_le_bytes());
    t[4..6].copy_from_slice(&format::FORMAT_VERSION.to_le_bytes());
    t[8..16].copy_from_slice(&entries_at.to_le_bytes());
    t[16..24].copy_from_slice(&1u64.to_le_bytes());
    t[24..28].copy_from_slice(&crc32c::crc32c(&entry).to_le_bytes());
    let crc = crc32c::crc32c(&t[..28]);
    t[28..32].copy_from_slice(&crc.to_le_bytes());
    // The record's (and, after the crash, the file's) last block is all payload.
    assert_eq!(p(trailer_at) + b, SIZE);
    evil[p(trailer_at)..].copy_from_slice(&t);
    let seg = write_segment(d.path(), &evil, 0);
    // The crash: the footer never written.
    let f = std::fs::OpenOptions::new().write(true).open(&seg).unwrap();
    f.set_len(6 * RL).unwrap();
    drop(f);
    let store = open_store(&cfg(&[d.path()], 64 << 20, 8 << 20));
    let got = store.get(victim.0, victim.1).expect("the victim's own record");
    assert!(got.1 == payload(1, SIZE), "a tenant's forged footer served its bytes for another namespace's key");
    let st = store.stats();
    assert_eq!((st.segments_scanned, st.segments_from_footer, st.torn_records_skipped), (1, 0, 0), "{st:?}");
    assert!(store.get(key(100), 9).unwrap().1 == evil, "the tenant's own record, whole");
    for i in 0..5 {
        assert!(store.get(key(i), 7).unwrap().1 == payload(i, SIZE), "record {i}");
    }
    assert_eq!(st.objects, 6);
}
