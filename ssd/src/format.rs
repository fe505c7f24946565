//! The SSD tier's on-disk format (docs/ssd.md): record headers, segment footers and their
//! CRC32C framing. Pure encoding and decoding, no I/O.
//!
//! A segment file is a sequence of records, each starting on a [`BLOCK`] boundary and
//! padded to one: a [`HEADER_BYTES`] header, then the payload, then zeros. A sealed
//! segment ends with a footer: one [`ENTRY_BYTES`] entry per record (padded to a block),
//! then a one-block trailer that says where the entries are and carries their CRC.
//!
//! Format 2 (issue #34, S4): record headers and trailers also carry a 64-bit tag keyed by
//! the directory's secret [`Salt`] (`.umbp-ssd.salt`, created with the directory, 0600), so
//! bytes a tenant wrote (a payload) can never form a header or trailer the store accepts:
//! CRC32C is no MAC, anyone can compute it.

/// Alignment of every record, footer and I/O (O_DIRECT needs the logical block size;
/// 4 KiB covers every drive we target).
pub const BLOCK: u64 = 4096;
pub const HEADER_BYTES: usize = 128;
pub const ENTRY_BYTES: usize = 72;
pub const TRAILER_BYTES: usize = BLOCK as usize;

pub const RECORD_MAGIC: u32 = u32::from_le_bytes(*b"UMBR");
pub const TRAILER_MAGIC: u32 = u32::from_le_bytes(*b"UMBF");
pub const FORMAT_VERSION: u16 = 2;

/// Bytes of the salt file (`.umbp-ssd.salt`): [`SALT_MAGIC`], 16 secret bytes, 8 zeros.
pub const SALT_FILE_BYTES: usize = 32;
pub const SALT_MAGIC: &[u8; 8] = b"UMBPSLT2";

/// A directory's secret: the key of the tags in its record headers and trailers. Only the
/// pool's uid can read it (the salt file is 0600 in a directory checked like the socket
/// directory), and a tenant, who only chooses payload bytes, never sees it.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct Salt([u8; 16]);

impl std::fmt::Debug for Salt {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Salt(..)")
    }
}

impl Salt {
    pub fn new(secret: [u8; 16]) -> Self {
        Self(secret)
    }

    /// The salt file's contents.
    pub fn file_bytes(&self) -> [u8; SALT_FILE_BYTES] {
        let mut b = [0u8; SALT_FILE_BYTES];
        b[..8].copy_from_slice(SALT_MAGIC);
        b[8..24].copy_from_slice(&self.0);
        b
    }

    /// Parses a salt file's contents (exact length, magic, zero tail).
    pub fn from_file_bytes(b: &[u8]) -> Option<Self> {
        if b.len() != SALT_FILE_BYTES || &b[..8] != SALT_MAGIC || b[24..].iter().any(|&x| x != 0) {
            return None;
        }
        Some(Self(b[8..24].try_into().expect("16 bytes")))
    }

    /// The keyed tag of `bytes` in `domain`: the first 8 bytes of SHA-256(secret, domain,
    /// bytes). Every tagged message of a domain has one fixed length (116 bytes of header,
    /// 32 of trailer), so a secret-prefix hash has no length extension to fear; forging a
    /// tag without the secret is guessing 64 bits.
    fn tag(&self, domain: &[u8; 4], bytes: &[u8]) -> u64 {
        use sha2::Digest;
        let mut h = sha2::Sha256::new();
        h.update(self.0);
        h.update(domain);
        h.update(bytes);
        u64::from_le_bytes(h.finalize()[..8].try_into().expect("8 bytes"))
    }
}

const HEADER_TAG_DOMAIN: &[u8; 4] = b"hdr2";
const TRAILER_TAG_DOMAIN: &[u8; 4] = b"trl2";
/// Header bytes the tag covers, and where the tag sits.
const HEADER_TAGGED: usize = 116;
/// Trailer bytes the tag covers, and where the tag sits.
const TRAILER_TAGGED: usize = 32;

/// Record flag: a tombstone (the key was removed; size 0, hides older records of the key).
pub const FLAG_TOMBSTONE: u16 = 1;

pub fn align_up(n: u64) -> u64 {
    n.div_ceil(BLOCK) * BLOCK
}

/// Largest segment file: offsets in the in-memory index are block numbers in a u32.
pub const MAX_SEGMENT_BYTES: u64 = (u32::MAX as u64) * BLOCK;

/// Largest payload a record may claim: anything above is not a record (a segment holds at
/// most a few GiB; a header or footer entry claiming more was planted or rotted).
pub const MAX_PAYLOAD: u64 = 1 << 40;

/// Largest sequence number a record may carry: numbers start at the wall clock in
/// nanoseconds (2^62 ns is the year 2116), and a planted or rotted huge one must not make
/// the store's numbering saturate or wrap.
pub const MAX_SEQ: u64 = 1 << 62;

/// Whether a header's (or footer entry's) fields are in range: size (its record length
/// computable) and sequence number.
pub fn header_in_range(h: &RecordHeader) -> bool {
    checked_record_len(h.size).is_some() && h.seq <= MAX_SEQ
}

/// Bytes a record with this payload occupies on disk (header + payload, block aligned), or
/// None above [`MAX_PAYLOAD`] (a size read from disk may be anything).
pub fn checked_record_len(payload: u64) -> Option<u64> {
    if payload > MAX_PAYLOAD {
        return None;
    }
    payload.checked_add(HEADER_BYTES as u64)?.div_ceil(BLOCK).checked_mul(BLOCK)
}

/// [`checked_record_len`] for a size the pool produced or already checked; saturates at
/// `u64::MAX` (which no file holds) rather than wrapping to a small length.
pub fn record_len(payload: u64) -> u64 {
    checked_record_len(payload).unwrap_or(u64::MAX)
}

/// Bytes the footer of a segment with `entries` records occupies.
pub fn footer_len(entries: u64) -> u64 {
    align_up(entries * ENTRY_BYTES as u64) + TRAILER_BYTES as u64
}

/// What a record header says. `payload_crc` is CRC32C of the payload bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RecordHeader {
    pub flags: u16,
    pub key: u128,
    pub namespace: u128,
    pub size: u64,
    /// The layout's object size the payload was stored under (checked on promotion).
    pub layout_object_size: u64,
    /// Store-wide sequence number: the highest one of a key wins on rebuild.
    pub seq: u64,
    pub payload_crc: u32,
}

/// Why a header or footer did not decode.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FormatError {
    BadMagic,
    BadVersion(u16),
    BadCrc,
    BadLength,
    /// The keyed tag does not match: bytes the store did not write with this directory's
    /// salt (a tenant's payload, another directory's segment).
    BadTag,
}

impl std::fmt::Display for FormatError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::BadMagic => f.write_str("bad magic"),
            Self::BadVersion(v) => write!(f, "unknown format version {v}"),
            Self::BadCrc => f.write_str("CRC32C mismatch"),
            Self::BadLength => f.write_str("length out of range"),
            Self::BadTag => f.write_str("keyed tag mismatch (not written by this store with this directory's salt)"),
        }
    }
}

fn get_u16(b: &[u8], at: usize) -> u16 {
    u16::from_le_bytes(b[at..at + 2].try_into().expect("2 bytes"))
}
fn get_u32(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().expect("4 bytes"))
}
fn get_u64(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().expect("8 bytes"))
}
fn get_u128(b: &[u8], at: usize) -> u128 {
    u128::from_le_bytes(b[at..at + 16].try_into().expect("16 bytes"))
}

impl RecordHeader {
    /// Header layout (little endian): magic u32 @0, version u16 @4, flags u16 @6, key u128 @8,
    /// namespace u128 @24, size u64 @40, layout object size u64 @48, seq u64 @56,
    /// payload CRC32C u32 @64, zeros up to @116, keyed tag of bytes 0..116 u64 @116, header
    /// CRC32C of bytes 0..124 u32 @124.
    pub fn encode(&self, salt: &Salt) -> [u8; HEADER_BYTES] {
        let mut b = [0u8; HEADER_BYTES];
        b[0..4].copy_from_slice(&RECORD_MAGIC.to_le_bytes());
        b[4..6].copy_from_slice(&FORMAT_VERSION.to_le_bytes());
        b[6..8].copy_from_slice(&self.flags.to_le_bytes());
        b[8..24].copy_from_slice(&self.key.to_le_bytes());
        b[24..40].copy_from_slice(&self.namespace.to_le_bytes());
        b[40..48].copy_from_slice(&self.size.to_le_bytes());
        b[48..56].copy_from_slice(&self.layout_object_size.to_le_bytes());
        b[56..64].copy_from_slice(&self.seq.to_le_bytes());
        b[64..68].copy_from_slice(&self.payload_crc.to_le_bytes());
        let tag = salt.tag(HEADER_TAG_DOMAIN, &b[..HEADER_TAGGED]);
        b[HEADER_TAGGED..124].copy_from_slice(&tag.to_le_bytes());
        let crc = crc32c::crc32c(&b[..124]);
        b[124..128].copy_from_slice(&crc.to_le_bytes());
        b
    }

    /// Decodes and checks a header (magic, header CRC, version, keyed tag). The payload CRC
    /// is the caller's to check against the payload.
    pub fn decode(b: &[u8], salt: &Salt) -> Result<Self, FormatError> {
        if b.len() < HEADER_BYTES {
            return Err(FormatError::BadLength);
        }
        if get_u32(b, 0) != RECORD_MAGIC {
            return Err(FormatError::BadMagic);
        }
        if crc32c::crc32c(&b[..124]) != get_u32(b, 124) {
            return Err(FormatError::BadCrc);
        }
        let version = get_u16(b, 4);
        if version != FORMAT_VERSION {
            return Err(FormatError::BadVersion(version));
        }
        if salt.tag(HEADER_TAG_DOMAIN, &b[..HEADER_TAGGED]) != get_u64(b, HEADER_TAGGED) {
            return Err(FormatError::BadTag);
        }
        Ok(Self {
            flags: get_u16(b, 6),
            key: get_u128(b, 8),
            namespace: get_u128(b, 24),
            size: get_u64(b, 40),
            layout_object_size: get_u64(b, 48),
            seq: get_u64(b, 56),
            payload_crc: get_u32(b, 64),
        })
    }

    pub fn is_tombstone(&self) -> bool {
        self.flags & FLAG_TOMBSTONE != 0
    }
}

/// One footer entry: a record's header fields plus where it starts in the segment.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FooterEntry {
    pub header: RecordHeader,
    pub offset: u64,
}

impl FooterEntry {
    /// Entry layout: key u128 @0, namespace u128 @16, size u64 @32, layout object size u64
    /// @40, offset u64 @48, seq u64 @56, payload CRC u32 @64, flags u16 @68, zero u16 @70.
    pub fn encode_into(&self, b: &mut [u8]) {
        let h = &self.header;
        b[0..16].copy_from_slice(&h.key.to_le_bytes());
        b[16..32].copy_from_slice(&h.namespace.to_le_bytes());
        b[32..40].copy_from_slice(&h.size.to_le_bytes());
        b[40..48].copy_from_slice(&h.layout_object_size.to_le_bytes());
        b[48..56].copy_from_slice(&self.offset.to_le_bytes());
        b[56..64].copy_from_slice(&h.seq.to_le_bytes());
        b[64..68].copy_from_slice(&h.payload_crc.to_le_bytes());
        b[68..70].copy_from_slice(&h.flags.to_le_bytes());
        b[70..72].fill(0);
    }

    pub fn decode(b: &[u8]) -> Self {
        Self {
            header: RecordHeader {
                key: get_u128(b, 0),
                namespace: get_u128(b, 16),
                size: get_u64(b, 32),
                layout_object_size: get_u64(b, 40),
                seq: get_u64(b, 56),
                payload_crc: get_u32(b, 64),
                flags: get_u16(b, 68),
            },
            offset: get_u64(b, 48),
        }
    }
}

/// The last block of a sealed segment.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Trailer {
    /// Segment offset of the first entry (the end of the records).
    pub entries_offset: u64,
    pub count: u64,
    /// CRC32C of the `count * ENTRY_BYTES` entry bytes.
    pub entries_crc: u32,
}

impl Trailer {
    /// Trailer layout: magic u32 @0, version u16 @4, zero u16 @6, entries offset u64 @8,
    /// count u64 @16, entries CRC u32 @24, trailer CRC32C of bytes 0..28 u32 @28, keyed tag
    /// of bytes 0..32 u64 @32, zeros.
    pub fn encode(&self, salt: &Salt) -> [u8; TRAILER_BYTES] {
        let mut b = [0u8; TRAILER_BYTES];
        b[0..4].copy_from_slice(&TRAILER_MAGIC.to_le_bytes());
        b[4..6].copy_from_slice(&FORMAT_VERSION.to_le_bytes());
        b[8..16].copy_from_slice(&self.entries_offset.to_le_bytes());
        b[16..24].copy_from_slice(&self.count.to_le_bytes());
        b[24..28].copy_from_slice(&self.entries_crc.to_le_bytes());
        let crc = crc32c::crc32c(&b[..28]);
        b[28..32].copy_from_slice(&crc.to_le_bytes());
        let tag = salt.tag(TRAILER_TAG_DOMAIN, &b[..TRAILER_TAGGED]);
        b[TRAILER_TAGGED..TRAILER_TAGGED + 8].copy_from_slice(&tag.to_le_bytes());
        b
    }

    /// Decodes the trailer of a segment `file_len` bytes long and checks that it describes
    /// exactly the bytes before it.
    pub fn decode(b: &[u8], file_len: u64, salt: &Salt) -> Result<Self, FormatError> {
        if b.len() < TRAILER_TAGGED + 8 {
            return Err(FormatError::BadLength);
        }
        if get_u32(b, 0) != TRAILER_MAGIC {
            return Err(FormatError::BadMagic);
        }
        if crc32c::crc32c(&b[..28]) != get_u32(b, 28) {
            return Err(FormatError::BadCrc);
        }
        let version = get_u16(b, 4);
        if version != FORMAT_VERSION {
            return Err(FormatError::BadVersion(version));
        }
        if salt.tag(TRAILER_TAG_DOMAIN, &b[..TRAILER_TAGGED]) != get_u64(b, TRAILER_TAGGED) {
            return Err(FormatError::BadTag);
        }
        let t = Self { entries_offset: get_u64(b, 8), count: get_u64(b, 16), entries_crc: get_u32(b, 24) };
        let end = t
            .count
            .checked_mul(ENTRY_BYTES as u64)
            .and_then(|n| t.entries_offset.checked_add(align_up(n)))
            .and_then(|n| n.checked_add(TRAILER_BYTES as u64));
        if end != Some(file_len) || !t.entries_offset.is_multiple_of(BLOCK) {
            return Err(FormatError::BadLength);
        }
        Ok(t)
    }
}

/// Encodes a footer (entries padded to a block, then the trailer) for records ending at
/// `entries_offset`.
pub fn encode_footer(entries: &[FooterEntry], entries_offset: u64, salt: &Salt) -> Vec<u8> {
    let n = entries.len() as u64;
    let mut out = vec![0u8; footer_len(n) as usize];
    for (i, e) in entries.iter().enumerate() {
        e.encode_into(&mut out[i * ENTRY_BYTES..(i + 1) * ENTRY_BYTES]);
    }
    let entries_crc = crc32c::crc32c(&out[..entries.len() * ENTRY_BYTES]);
    let trailer = Trailer { entries_offset, count: n, entries_crc }.encode(salt);
    let t = out.len() - TRAILER_BYTES;
    out[t..].copy_from_slice(&trailer);
    out
}

/// Decodes the entries of a footer whose trailer was checked.
pub fn decode_entries(t: &Trailer, bytes: &[u8]) -> Result<Vec<FooterEntry>, FormatError> {
    let n = t.count as usize * ENTRY_BYTES;
    if bytes.len() < n {
        return Err(FormatError::BadLength);
    }
    if crc32c::crc32c(&bytes[..n]) != t.entries_crc {
        return Err(FormatError::BadCrc);
    }
    Ok(bytes[..n].chunks_exact(ENTRY_BYTES).map(FooterEntry::decode).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn salt() -> Salt {
        Salt::new(*b"0123456789abcdef")
    }

    fn header() -> RecordHeader {
        RecordHeader {
            flags: 0,
            key: 0x0123_4567_89ab_cdef_fedc_ba98_7654_3210,
            namespace: 7,
            size: 12345,
            layout_object_size: 65536,
            seq: 99,
            payload_crc: crc32c::crc32c(b"payload"),
        }
    }

    #[test]
    fn header_roundtrips_and_every_flipped_bit_is_detected() {
        let h = header();
        let b = h.encode(&salt());
        assert_eq!(RecordHeader::decode(&b, &salt()), Ok(h));
        for i in 0..HEADER_BYTES * 8 {
            let mut c = b;
            c[i / 8] ^= 1 << (i % 8);
            assert!(RecordHeader::decode(&c, &salt()).is_err(), "bit {i} flipped went unnoticed");
        }
        assert_eq!(RecordHeader::decode(&[0u8; HEADER_BYTES], &salt()), Err(FormatError::BadMagic));
        assert_eq!(RecordHeader::decode(&b[..64], &salt()), Err(FormatError::BadLength));
    }

    #[test]
    fn a_header_or_trailer_made_without_the_salt_is_refused() {
        // What a tenant can write: valid magic, version and CRC32C (no secret in them), a tag
        // from any other key (here: the all-zero salt, and another directory's).
        let other = Salt::new([0; 16]);
        let forged = header().encode(&other);
        assert_eq!(RecordHeader::decode(&forged, &salt()), Err(FormatError::BadTag));
        assert_eq!(RecordHeader::decode(&forged, &other), Ok(header()));
        let mut zero_tag = header().encode(&salt());
        zero_tag[116..124].fill(0);
        let crc = crc32c::crc32c(&zero_tag[..124]);
        zero_tag[124..].copy_from_slice(&crc.to_le_bytes());
        assert_eq!(RecordHeader::decode(&zero_tag, &salt()), Err(FormatError::BadTag));
        let f = encode_footer(&[FooterEntry { header: header(), offset: 0 }], 4 * BLOCK, &other);
        let len = 4 * BLOCK + f.len() as u64;
        assert_eq!(Trailer::decode(&f[f.len() - TRAILER_BYTES..], len, &salt()), Err(FormatError::BadTag));
        // Format 1 (no tag; version 1 under a valid CRC) is refused by its version.
        let mut v1 = header().encode(&salt());
        v1[4..6].copy_from_slice(&1u16.to_le_bytes());
        v1[116..124].fill(0);
        let crc = crc32c::crc32c(&v1[..124]);
        v1[124..].copy_from_slice(&crc.to_le_bytes());
        assert_eq!(RecordHeader::decode(&v1, &salt()), Err(FormatError::BadVersion(1)));
    }

    #[test]
    fn salt_file_roundtrips_and_refuses_anything_else() {
        let b = salt().file_bytes();
        assert_eq!(Salt::from_file_bytes(&b), Some(salt()));
        assert_eq!(Salt::from_file_bytes(&b[..31]), None);
        let mut c = b;
        c[0] ^= 1;
        assert_eq!(Salt::from_file_bytes(&c), None);
        let mut c = b;
        c[31] = 1;
        assert_eq!(Salt::from_file_bytes(&c), None);
        assert_eq!(format!("{:?}", salt()), "Salt(..)", "the secret is never logged");
    }

    #[test]
    fn footer_roundtrips_and_rejects_a_wrong_length_or_crc() {
        let entries: Vec<_> = (0..100u64).map(|i| FooterEntry { header: RecordHeader { seq: i, ..header() }, offset: i * BLOCK }).collect();
        let off = 100 * BLOCK;
        let f = encode_footer(&entries, off, &salt());
        assert_eq!(f.len() as u64, footer_len(100));
        let len = off + f.len() as u64;
        let t = Trailer::decode(&f[f.len() - TRAILER_BYTES..], len, &salt()).unwrap();
        assert_eq!(t.count, 100);
        assert_eq!(decode_entries(&t, &f).unwrap(), entries);
        assert_eq!(Trailer::decode(&f[f.len() - TRAILER_BYTES..], len + BLOCK, &salt()), Err(FormatError::BadLength));
        let mut g = f.clone();
        g[5] ^= 1;
        assert_eq!(decode_entries(&t, &g), Err(FormatError::BadCrc));
    }

    #[test]
    fn a_huge_size_has_no_record_length() {
        // A planted header may say anything: 2^64 - 1 used to wrap to a one-block record.
        for size in [u64::MAX, u64::MAX - HEADER_BYTES as u64 + 1, u64::MAX - 4000, u64::MAX - 1, u64::MAX / 2, MAX_PAYLOAD + 1] {
            assert_eq!(checked_record_len(size), None, "{size}");
            assert_eq!(record_len(size), u64::MAX, "{size}");
            assert!(!header_in_range(&RecordHeader { size, ..header() }));
        }
        assert_eq!(checked_record_len(MAX_PAYLOAD), Some(MAX_PAYLOAD + BLOCK));
        assert!(header_in_range(&RecordHeader { seq: MAX_SEQ, ..header() }));
        assert!(!header_in_range(&RecordHeader { seq: MAX_SEQ + 1, ..header() }));
        assert!(!header_in_range(&RecordHeader { seq: u64::MAX, ..header() }));
    }

    #[test]
    fn lengths_are_block_aligned() {
        assert_eq!(record_len(0), BLOCK);
        assert_eq!(record_len(BLOCK - HEADER_BYTES as u64), BLOCK);
        assert_eq!(record_len(BLOCK - HEADER_BYTES as u64 + 1), 2 * BLOCK);
        assert_eq!(footer_len(0), BLOCK);
        assert_eq!(footer_len(56), 2 * BLOCK);
        assert_eq!(footer_len(57), 3 * BLOCK);
    }
}
